"""Router replay's record: the experts each token the engine computes is routed to.

A forward hook on every layer's router keeps its top-k expert ids [N, k] of the step's packed tokens; after
the step they are stacked to [N, layers, k] (`model.moe.routing_dtype`: uint8 up to 255 experts, int16 past,
so that no expert id is the `no_route` mark), copied to the host once, and split over the sequences of the
step in their token order. Only engines built with `record_routing=True` install the hooks: otherwise nothing
runs.

A decode step replayed from a CUDA graph calls no hook, so the bucketed decode steps keep static buffers
(`static(batch)`: [batch, k] per layer): while a bucket's forward runs, eagerly or being captured, the hooks
copy each layer's top-k ids into them (`writing_into`), so every replay writes its routing there too, and
after the step `read_from` hands the recorder the rows of the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.moe import routing_dtype


class RoutingRecorder:
    """Hooks on `model`'s routers; `collect(plan)` files a step's routing under its sequences."""

    def __init__(self, model: GPTOSSModel, config: ModelConfig):
        self.dtype = routing_dtype(config.num_experts)
        self.topk = config.moe_router_topk
        layers = model.decoder.layers
        self.order = [int(i) for i in layers.keys()]
        self._step: dict[int, torch.Tensor] = {}
        # a bucketed decode step's static buffers, written by the hooks while its forward runs
        self._into: dict[int, torch.Tensor] | None = None
        for index, layer in layers.items():
            layer.get_submodule("mlp.router").register_forward_hook(partial(self._hook, int(index)))

    def _hook(self, layer: int, module, inputs, output) -> None:
        if self._into is None:
            self._step[layer] = output[2]
        else:
            self._into[layer].copy_(output[2])

    def static(self, batch: int, device: torch.device) -> dict[int, torch.Tensor]:
        """Static routing buffers of a bucketed decode step of `batch` rows: [batch, k] ids per layer."""
        return {i: torch.zeros(batch, self.topk, dtype=torch.long, device=device) for i in self.order}

    @contextmanager
    def writing_into(self, buffers: dict[int, torch.Tensor]) -> Iterator[None]:
        """While the block runs (a bucket's forward, eager or captured), the routers' ids go to `buffers`."""
        self._into = buffers
        try:
            yield
        finally:
            self._into = None

    def read_from(self, buffers: dict[int, torch.Tensor], rows: int) -> None:
        """The routing of a bucketed step's first `rows` rows (its real ones), for `collect`."""
        self._step = {layer: ids[:rows] for layer, ids in buffers.items()}

    def collect(self, plan) -> None:
        """Split the step's routing [N, layers, k] over `plan.chunks` (a padding step records nothing)."""
        if plan.chunks:
            ids = torch.stack([self._step[i] for i in self.order], dim=1).to(self.dtype).cpu()
            for chunk in plan.chunks:
                chunk.seq.routing.append(ids[chunk.offset : chunk.offset + chunk.count])
        self._step.clear()

    def of(self, seq, tokens: int | None) -> torch.Tensor:
        """The routing a sequence recorded ([tokens, layers, k]), its first `tokens` rows when given."""
        empty = torch.zeros(0, len(self.order), self.topk, dtype=self.dtype)
        routing = torch.cat(seq.routing) if seq.routing else empty
        return routing if tokens is None else routing[:tokens]
