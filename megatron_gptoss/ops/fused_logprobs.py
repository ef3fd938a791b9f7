"""The learner's head on CUDA in few launches: from a chunk's fp32 logits, one kernel gives each row's
log-prob of its target, entropy and normaliser, and one gives the logits' gradient, in place of the dozen
elementwise and reduction kernels per chunk of `model.logprobs`' PyTorch path (which stays the CPU's and the
batch-invariant mode's).

    row_stats(z [n, V] fp32, targets [n] int64, inv_temp) -> (logprob [n], entropy [n], lse [n]) fp32
        of softmax(z * inv_temp): logprob = log_softmax[target], entropy = -sum p log p, lse its normaliser
    logit_grad(z, targets, lse, entropy, grad_logprob | None, grad_entropy | None, inv_temp, out)
        -> the gradient with respect to z of sum(grad_logprob * logprob + grad_entropy * entropy), written
        into `out`: fp32 [n, V], or half-precision [n, 2V] as hi | lo (hi + lo = the fp32 gradient up to a
        relative 2^-17 in bf16), the two terms of the backward's half-precision GEMMs

Each is fp32 with one rounding per output; the normaliser comes from a running max and sum in one pass
(within fp32 rounding of torch.logsumexp). CUDA, or the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from megatron_gptoss.ops.fused_moe import _pow2

_BLOCK_V = 2048  # logits per step of a row's loop


def _block(vocab: int) -> int:
    return min(_BLOCK_V, _pow2(max(vocab, 16)))


def _check(z: Tensor, targets: Tensor) -> None:
    if z.dim() != 2 or z.dtype != torch.float32 or z.stride(1) != 1:
        raise ValueError(
            f"logits must be fp32 [n, V] with unit column stride, got {z.dtype} {tuple(z.shape)}"
        )
    if targets.shape != (z.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [{z.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")


def _kernels():
    return importlib.import_module("megatron_gptoss.ops.logprob_kernels")


def row_stats(z: Tensor, targets: Tensor, inv_temp: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    _check(z, targets)
    n, vocab = z.shape
    logprob, entropy, lse = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    if n:
        _kernels().row_stats_kernel[(n,)](
            z, z.stride(0), targets, logprob, entropy, lse, vocab, float(inv_temp), BLOCK_V=_block(vocab),
            num_warps=4,
        )  # fmt: skip
    return logprob, entropy, lse


def logit_grad(
    z: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logprob: Tensor | None,
    grad_entropy: Tensor | None,
    inv_temp: float,
    out: Tensor,
) -> Tensor:
    _check(z, targets)
    n, vocab = z.shape
    split = out.dtype in (torch.bfloat16, torch.float16)
    width = 2 * vocab if split else vocab
    if out.shape != (n, width) or out.stride(1) != 1 or not (split or out.dtype == torch.float32):
        raise ValueError(f"out must be fp32 [{n}, {vocab}] or half [{n}, {2 * vocab}], unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)}")  # fmt: skip
    if grad_logprob is None and grad_entropy is None:
        raise ValueError("logit_grad needs grad_logprob, grad_entropy or both")
    if n:
        g_lp = lse if grad_logprob is None else grad_logprob.float().contiguous()
        g_ent = lse if grad_entropy is None else grad_entropy.float().contiguous()
        _kernels().logit_grad_kernel[(n,)](
            z, z.stride(0), targets, lse, entropy, g_lp, g_ent, out, out.stride(0), vocab, float(inv_temp),
            HAS_LP=grad_logprob is not None, HAS_ENT=grad_entropy is not None, SPLIT=split,
            BLOCK_V=_block(vocab), num_warps=4,
        )  # fmt: skip
    return out
