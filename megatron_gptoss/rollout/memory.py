"""Sleep / wake of an engine's device memory: what a colocated trainer calls to lend the engine's memory to
the learner between rollouts.

    sleep(1)   the KV cache is freed; the weights move to the host (pinned on CUDA) and come back on wake
    sleep(2)   the KV cache is freed; the weights are discarded (their storage released); wake allocates
               them again, zeroed, and the engine refuses to generate until `update_weights` refills them

Every call returns the bytes it released or took, measured on CUDA with `torch.cuda.memory_allocated` (on
the CPU the device is the host: the measured fields are 0 there, the weight and cache sizes are still given).

The weights are the parameters and the MXFP4 experts' uint8 buffers (`model.mxfp4_weight`, named
`<weight>.blocks` / `<weight>.scales`). Tensors named in `shared` (a LoRA engine's frozen base, which is the
learner's own memory) are never moved or freed: sleep and wake act on the engine's own weights only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_gptoss.model.mxfp4_weight import mxfp4_weights


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


class EngineMemory:
    """The sleep state of `model`'s parameters on `device`."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.level = 0
        self.has_weights = True
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.shared: set[str] = set()

    def _own(self) -> dict[str, torch.Tensor]:
        """The engine's own weights: parameters and MXFP4 buffers not in `shared`."""
        own: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        for name, weight in mxfp4_weights(self.model).items():
            own[f"{name}.blocks"], own[f"{name}.scales"] = weight.blocks, weight.scales
        return {n: t for n, t in own.items() if n not in self.shared}

    def weights_loaded(self) -> None:
        self.has_weights = True

    def sleep(self, level: int, release_cache: Callable[[], int]) -> dict[str, int]:
        """Free the cache (`release_cache` drops it and returns its bytes) and the weights' device memory."""
        if level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (weights to the host) or 2 (weights discarded), got {level}"
            )
        if self.level:
            raise RuntimeError("sleep called on a sleeping engine")
        before = _allocated(self.device)
        kv_bytes = release_cache()
        params = self._own()
        weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
        if level == 1 and self.device.type != "cpu":
            for p in params.values():
                host = torch.empty(
                    p.shape, dtype=p.dtype, device="cpu", pin_memory=self.device.type == "cuda"
                )
                p.data = host.copy_(p.data)
        elif level == 2:
            for name, p in params.items():
                self._shapes[name] = (p.shape, p.dtype)
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            self.has_weights = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.level = level
        return {
            "kv_cache_bytes": kv_bytes,
            "weight_bytes": weight_bytes,
            "device_bytes_freed": before - _allocated(self.device),
        }

    def wake(self) -> dict[str, int]:
        """Take the weights' device memory back (level 1: their values; level 2: zeros to be refilled)."""
        if not self.level:
            return {"device_bytes_taken": 0}
        before = _allocated(self.device)
        params = self._own()
        if self.level == 1 and self.device.type != "cpu":
            for p in params.values():
                p.data = p.data.to(self.device, non_blocking=True)
        elif self.level == 2:
            for name, p in params.items():
                shape, dtype = self._shapes.pop(name)
                p.data = torch.zeros(shape, dtype=dtype, device=self.device)
        self.level = 0
        return {"device_bytes_taken": _allocated(self.device) - before}
