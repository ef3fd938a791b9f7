"""Batch-invariant mode: the GEMMs, the MoE expert GEMMs and the log-softmax normaliser computed so that
each row's result depends on that row alone, never on how many rows share the call or where it sits.

With the mode on, a token's logits are the same bits whether the learner computes them in a packed
training forward of thousands of tokens or the rollout engine in a decode step of a few rows: the basis of
bitwise on-policy RL (`rollout.bitwise_on_policy`). Library GEMMs pick their algorithm (tiling, split-K)
by shape, and reductions split a row over several thread blocks when rows are few; here every call runs
one Triton kernel with one fixed tiling and reduces each row inside one program in a fixed order:

    invariant_linear(x [..., K], w [N, K], b [N] | None, out_dtype) -> [..., N]
    invariant_grouped_linear(x [M, K] sorted by expert, w [E, N, K], bounds int32 [E + 1]) -> [M, N]
    logsumexp_rows(z [R, V]) -> [R] fp32
    linear(x, w, b)   torch's linear, or invariant_linear while the mode is on (the model's layers call it)

Forward only is batch-invariant; the backward runs the usual library GEMMs (the gradient needs no bit
equality with anything). The mode is process-wide (`set_enabled`, or the `enabled` context): the learner
and a colocated engine share it. On the CPU the kernels run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from torch import Tensor

from megatron_gptoss.ops.fused_moe import _cdiv, _pow2

_STATE = {"on": False}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of every GEMM, fixed whatever the shapes
_TILE = (64, 128, 64, 4, 3)
_CPU_TILE = (16, 32, 16, 1, 1)  # the interpreter: small tiles, fewer numpy calls
_LSE_BLOCK = 1024


def active() -> bool:
    """Whether the batch-invariant mode is on."""
    return _STATE["on"]


def set_enabled(flag: bool) -> None:
    _STATE["on"] = bool(flag)


@contextlib.contextmanager
def enabled(flag: bool = True) -> Iterator[None]:
    """The mode on (or off) inside the block, restored after."""
    before = _STATE["on"]
    _STATE["on"] = bool(flag)
    try:
        yield
    finally:
        _STATE["on"] = before


def _kernels():
    return importlib.import_module("megatron_gptoss.ops.batch_invariant_kernels")


def _matmul(x: Tensor, weight: Tensor, bias: Tensor | None, bounds: Tensor | None, out_dtype) -> Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]); grouped (`bounds` given): rows sorted by expert, weight
    [E, N, K], no bias -> [M, N] in out_dtype. No host sync (CUDA-graph capturable)."""
    m, k = x.shape
    grouped = bounds is not None
    weight3 = weight if grouped else weight[None]
    e, n, _ = weight3.shape
    block_m, block_n, block_k, warps, stages = _TILE if x.is_cuda else _CPU_TILE
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    tile_start = bounds
    if bounds is not None:
        tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
        tile_start = torch.zeros(e + 1, dtype=torch.int32, device=x.device)
        torch.cumsum(tiles, 0, out=tile_start[1:])
    grid = (_cdiv(m, block_m) + (e if grouped else 0), _cdiv(n, block_n))
    precision = "ieee" if x.dtype == torch.float32 else None
    _kernels().grouped_matmul_kernel[grid](
        x, weight3, weight3 if bias is None else bias, out, bounds, tile_start,
        x.stride(0), x.stride(1), weight3.stride(0), weight3.stride(1), weight3.stride(2), 0,
        out.stride(0), out.stride(1), m, n, k, e,
        E_POW2=_pow2(e), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUPED=grouped,
        HAS_BIAS=bias is not None, DOT_PRECISION=precision, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, out_dtype):
        out = _matmul(x2, weight, bias, None, out_dtype)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g = grad.to(x2.dtype) if grad.dtype != x2.dtype else grad
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        grad_w = (g.t() @ x2).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def invariant_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in `out_dtype` (default x's dtype), fp32
    accumulation; batch-invariant. Differentiable in x, weight and bias."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = _Linear.apply(x2, weight, bias, out_dtype or x.dtype)
    return out.view(*lead, weight.shape[0])


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bounds, backward_fn):
        ctx.save_for_backward(x, weight, bounds)
        ctx.backward_fn = backward_fn
        return _matmul(x, weight, None, bounds, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bounds = ctx.saved_tensors
        needs = ctx.needs_input_grad[:2]  # a frozen weight (LoRA) gets no gradient GEMM
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) for t, n in zip((x, weight), needs)]
            y = ctx.backward_fn(*leaves, bounds)
            grads = iter(torch.autograd.grad(y, [t for t in leaves if t.requires_grad], grad))
        grad_x, grad_w = (next(grads) if n else None for n in needs)
        return grad_x, grad_w, None, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`torch.nn.functional.linear`, or `invariant_linear` while the mode is on."""
    if _STATE["on"]:
        return invariant_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def invariant_grouped_linear(x: Tensor, weight: Tensor, bounds: Tensor, backward_fn) -> Tensor:
    """Rows x [M, K] sorted by expert (expert e: rows [bounds[e], bounds[e + 1]), bounds int32 on x's
    device) times weight[e]^T, weight [E, N, K] -> [M, N]; batch-invariant. The backward differentiates
    `backward_fn(x, weight, bounds)`, the library grouped GEMM of the same product."""
    return _Grouped.apply(x, weight, bounds, backward_fn)


def logsumexp_rows(z: Tensor) -> Tensor:
    """z [R, V] -> log sum exp over each row [R] fp32; batch-invariant (not differentiable: the log-prob
    paths that use it have their own backward)."""
    z = z if z.stride(-1) == 1 else z.contiguous()
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        _kernels().logsumexp_kernel[(z.shape[0],)](z, out, z.shape[1], z.stride(0), BLOCK=_LSE_BLOCK)
    return out
