"""Triton kernels of `megatron_gptoss.ops.rms_norm` (which states the contract): one row per forward
program; backward programs own consecutive rows and write one fp32 dweight partial each."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(x, weight, out, rstd, H, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, (w * (v * r)).to(out.dtype.element_ty), mask=ok)
    tl.store(rstd + row, r)


@triton.jit
def rms_norm_bwd_kernel(
    x, weight, grad, rstd, grad_x, partial, N, H, stride_x, stride_g, stride_gx, rows_per_program,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, N)
    for row in range(first, last):
        v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(grad + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(rstd + row)
        xhat = v * r
        wg = w * g
        dx = r * (wg - xhat * (tl.sum(xhat * wg, axis=0) / H))
        tl.store(grad_x + row * stride_gx + cols, dx.to(grad_x.dtype.element_ty), mask=ok)
        acc += g * xhat
    tl.store(partial + pid * H + cols, acc, mask=ok)
