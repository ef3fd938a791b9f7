"""YaRN rotary position embedding (rotate-half layout) as GPT-OSS uses it."""

from __future__ import annotations

import math

import torch

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.ops import batch_invariant


def yarn_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (fp32) and the concentration factor multiplying cos and sin."""
    dim, base, factor = config.head_dim, config.rotary_base, config.yarn_factor
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if factor <= 1.0:
        return 1.0 / pos_freqs, 1.0
    original = config.yarn_original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(config.yarn_beta_fast), correction_dim(config.yarn_beta_slow)
    if config.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    concentration = 0.1 * math.log(factor) + 1.0
    return inv_freq, concentration


class RotaryEmbedding(torch.nn.Module):
    """cos/sin [..., head_dim / 2] of integer positions, computed in fp32, cast to the activation dtype.

    The inverse frequencies are computed on the host and kept on `device`, so a forward on that device
    copies nothing from the host (a decode step captured in a CUDA graph may not). A model built on the meta
    device keeps them on the host, with their values, for `parallel.loading.materialize` to move."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        inv_freq, self.concentration = yarn_inv_freq(config)
        self.max_positions = config.max_position_embeddings
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        on_meta = device is not None and torch.device(device).type == "meta"
        self.register_buffer("inv_freq", inv_freq if on_meta else inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_invariant.active():  # rows of one table: a position's values whatever the batch around it
            cos, sin = self._table(positions.device)
            return cos[positions].to(dtype), sin[positions].to(dtype)
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        cos = (freqs.cos() * self.concentration).to(dtype)
        sin = (freqs.sin() * self.concentration).to(dtype)
        return cos, sin

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos / sin of every position below `max_position_embeddings`, computed once per device (a
        vectorised cos can differ by an ulp from the scalar one of a tensor's tail elements)."""
        table = self._tables.get(device)
        if table is None:
            table = self._compute(torch.arange(self.max_positions, device=device), torch.float32)
            self._tables[device] = table
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., tokens, heads, head_dim]; cos/sin [..., tokens, head_dim / 2]. Rotate-half convention."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
