"""LoRA adapters: a low-rank update beside a frozen linear layer.

    y = W x + b + scale * B A dropout(x)        scale = alpha / rank

A target layer (`model.lora.targets`) holds its adapter as the submodule `lora` (`LoRA`, parameters `a`
and `b`); a layer without one holds `lora = None`. Dense layers: a [rank, in], b [out, rank]. Experts:
one adapter per expert, a [E, rank, in], b [E, out, rank], applied to the rows of each expert in the
same grouped computation as the base weights (`grouped_linear` over the tokens sorted by expert), never
a loop over tokens. fc1's adapter produces [gate; up] rows like fc1 itself (HF's interleaved
`gate_up_proj` columns are a reordering of the same rows), and it is added before the clamped SwiGLU.

Initialisation (`LoRA.reset`): a uniform in +-1/sqrt(in) (kaiming-uniform with a = sqrt(5), as PEFT),
b zero, so a fresh adapter leaves the model's outputs unchanged. With LoRA on the model's base parameters
are frozen (`requires_grad` False): optimizers built from trainable parameters hold the adapters only.
`adapters_disabled(model)` runs the base model (the KL reference policy) without a second copy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.config.lora import LoRAConfig
from megatron_gptoss.ops import batch_invariant


class LoRA(nn.Module):
    """The adapter of one layer: `delta(x)` = scale * B A dropout(x). `experts` None: a [rank, in], b [out,
    rank]; else a [experts, rank, in], b [experts, out, rank] with rows grouped by expert (`grouped`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        cfg: LoRAConfig,
        experts: int | None = None,
        dtype=None,
        device=None,
    ):
        super().__init__()
        lead = () if experts is None else (experts,)
        self.scale, self.dropout, self.enabled = cfg.scale, cfg.dropout, True
        self.a = nn.Parameter(torch.empty(*lead, cfg.rank, in_features, dtype=dtype, device=device))
        self.b = nn.Parameter(torch.zeros(*lead, out_features, cfg.rank, dtype=dtype, device=device))

    @torch.no_grad()
    def reset(self, generator: torch.Generator | None = None) -> None:
        """a uniform in +-1/sqrt(in_features), b zero."""
        bound = 1.0 / math.sqrt(self.a.shape[-1])
        noise = torch.rand(self.a.shape, generator=generator, dtype=torch.float32).mul_(2 * bound).sub_(bound)
        self.a.copy_(noise.to(self.a.dtype))
        self.b.zero_()

    @property
    def drops(self) -> bool:
        """Whether the adapter draws dropout on its input (training, dropout > 0)."""
        return self.training and self.dropout > 0

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.dropout) if self.drops else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> the update [..., out] (dense adapters)."""
        return batch_invariant.linear(batch_invariant.linear(self._drop(x), self.a), self.b) * self.scale

    def grouped(self, x: torch.Tensor, bounds: torch.Tensor, gemm) -> torch.Tensor:
        """Rows x [M, in] sorted by expert (expert e: rows [bounds[e], bounds[e + 1])) -> the update [M, out]
        of each row's expert; `gemm(x, weight [E, out, in], bounds)` is the experts' grouped GEMM. The rank
        is zero-padded to a multiple of 8 (torch._grouped_mm takes 16-byte aligned bf16 operands); the padded
        rows of A and columns of B are zero, so the product and the gradients of a and b are unchanged."""
        a: torch.Tensor = self.a
        b: torch.Tensor = self.b
        pad = -a.shape[-2] % 8
        if pad:
            a, b = nn.functional.pad(a, (0, 0, 0, pad)), nn.functional.pad(b, (0, pad))
        return gemm(gemm(self._drop(x), a, bounds), b, bounds) * self.scale


class LoRALinear(nn.Linear):
    """nn.Linear with an optional adapter `lora` (None: a plain linear layer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, lora: LoRA | None, dtype, device):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.lora = lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = batch_invariant.linear(x, self.weight, self.bias)
        lora = active(self.lora)
        return y if lora is None else y + lora(x)


def active(lora: LoRA | None) -> LoRA | None:
    """The adapter if it exists and is enabled, else None."""
    return lora if lora is not None and lora.enabled else None


def make_adapter(
    cfg: LoRAConfig,
    target: str,
    in_features: int,
    out_features: int,
    experts: int | None = None,
    dtype=None,
    device=None,
) -> LoRA | None:
    """An adapter for the layer `target` (a name of LORA_TARGETS) when LoRA is on and targets it."""
    if not cfg.enabled or target not in cfg.targets:
        return None
    return LoRA(in_features, out_features, cfg, experts, dtype, device)


def adapters(model: nn.Module) -> Iterator[LoRA]:
    for module in model.modules():
        if isinstance(module, LoRA):
            yield module


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (from `named_parameters`) belongs to an adapter."""
    return ".lora." in f".{name}"


def freeze_base(model: nn.Module) -> None:
    """Adapters trainable, every other parameter frozen."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))


@contextmanager
def adapters_disabled(*models: nn.Module) -> Iterator[None]:
    """Within the block `models` (a model, or the stage models of a rank) compute as their base (every
    adapter skipped); restored on exit."""
    mods = [m for model in models for m in adapters(model)]
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, state in zip(mods, before):
            m.enabled = state


@torch.no_grad()
def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A computed in fp32, returned in W's dtype: weight [out, in], a [r, in], b [out, r], or
    with a leading expert dim on all three. A shard of W merges with the matching shards of a and b (the
    parallel layouts cut a and b so that B A's shard is b_local a_local)."""
    delta = torch.matmul(b.float(), a.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


def base_config(config: ModelConfig) -> ModelConfig:
    """`config` without adapters: what a rollout engine builds when it receives merged weights."""
    return dataclasses.replace(config, lora=LoRAConfig()) if config.lora.enabled else config


def adapter_of(name: str) -> str | None:
    """The adapter prefix of a weight that can carry one (`X.weight` -> `X.lora`), else None."""
    return name[: -len(".weight")] + ".lora" if name.endswith(".weight") else None
