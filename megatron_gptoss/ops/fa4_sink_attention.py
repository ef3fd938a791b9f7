"""flash-attn-4 (CuTe DSL kernels, `pip install megatron_gptoss[fa4]`) as a sink attention backend.

Its `learnable_sink` argument carries the sinks forward and backward (d_sink included), with GQA, window
and packed sequences (`flash_attn_varlen_func`). Used on Hopper and newer (sm90+): the sink backward is
not there on older GPUs. Contract as `megatron_gptoss.ops.sink_attention`; our `window=W` is its
`window_size=(W - 1, 0)`. bf16 / fp16 only. Its default backward sums dQ with atomics (not repeatable bit
for bit); `deterministic=True` takes its semaphore-ordered backward, which is.
"""

from __future__ import annotations

import torch

from megatron_gptoss.errors import AttentionInputError

try:
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    IMPORT_ERROR: str | None = None
except (ImportError, OSError, RuntimeError) as err:  # optional dependency, or its native libraries missing
    flash_attn_func = flash_attn_varlen_func = None
    # The message only: the exception's traceback would keep alive every frame of the stack that first
    # imported this module (an engine's generate: its KV cache and activations) for the process's life.
    IMPORT_ERROR = f"{type(err).__name__}: {err}"

HEAD_DIMS = (64, 96, 128)
DTYPES = (torch.bfloat16, torch.float16)


def is_supported(q: torch.Tensor) -> bool:
    """flash-attn-4 importable, q on a CUDA GPU of compute capability 9.0 or newer, dtype and head_dim
    among those it compiles."""
    if flash_attn_func is None or not q.is_cuda:
        return False
    major, _ = torch.cuda.get_device_capability(q.device)
    return major >= 9 and q.dtype in DTYPES and q.shape[-1] in HEAD_DIMS


def fa4_sink_attention(
    q,
    k,
    v,
    sinks,
    *,
    window=None,
    cu_seqlens=None,
    max_seqlen=None,
    softmax_scale=None,
    return_lse=False,
    deterministic=False,
):
    """Layouts as flash-attn (padded [B, T, H, D] or packed [N, H, D] + cu_seqlens); sinks [Hq], passed
    to the kernel in fp32. LSE [B, Hq, T] or [Hq, N], natural log, sink included. `deterministic`: the
    backward's dQ, dK and dV summed in a fixed order (flash-attn-4's semaphores), so repeatable."""
    if not is_supported(q):
        raise AttentionInputError(
            f"fa4 backend needs flash-attn-4 and an sm90+ GPU, dtype in {DTYPES}, head_dim in {HEAD_DIMS}; "
            f"got {q.device} {q.dtype} head_dim {q.shape[-1]} (import error: {IMPORT_ERROR})"
        )
    window_size = (window - 1, 0) if window is not None else (None, None)
    kwargs = dict(
        softmax_scale=softmax_scale,
        causal=True,
        window_size=window_size,
        learnable_sink=sinks.float(),
        return_lse=True,
        deterministic=deterministic,
    )
    if cu_seqlens is None:
        out, lse = flash_attn_func(q, k, v, **kwargs)
    else:
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out, lse = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            **kwargs,
        )
    return (out, lse) if return_lse else out
