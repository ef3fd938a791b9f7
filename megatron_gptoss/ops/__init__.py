"""Kernels with PyTorch references: sink-aware attention (eager, flex, triton, fa4 backends)."""

from megatron_gptoss.ops import interpreter  # noqa: F401  (the CPU interpreter's row-invariant dot)
from megatron_gptoss.ops.sink_attention import (
    BACKENDS,
    AttentionInputError,
    backend_available,
    eager_sink_attention,
    flex_sink_attention,
    sink_attention,
    sink_decode,
    sink_paged_decode,
)

__all__ = [
    "BACKENDS",
    "AttentionInputError",
    "backend_available",
    "eager_sink_attention",
    "flex_sink_attention",
    "sink_attention",
    "sink_decode",
    "sink_paged_decode",
]
