"""The engine's seeded sampler in one Triton kernel (`rollout.sampling.sample_from_logits`' untruncated
case on CUDA): per row, the tempered distribution's normaliser and an inverse-CDF draw at the row's
uniform number, in two passes over the logits, against the five full-width passes of the PyTorch path
(tempering, log-softmax, softmax, cumulative sum, search).

    seeded_sample(logits [B, V] fp32, uniforms [B] in (0, 1), temperature)
        -> tokens [B] int64: the first token whose cumulative probability reaches the row's uniform
           log-probs [B] fp32: log_softmax(logits / temperature) at the token

The PyTorch path is the reference (`rollout.sampling`): the same draw up to the summation order of the
cumulative mass (a token differs only where a uniform falls within rounding of a boundary), log-probs within
float32 rounding. CUDA, or the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

_BLOCK = 4096  # logits per step of a row's program


def seeded_sample(logits: Tensor, uniforms: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if logits.dim() != 2 or uniforms.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [B, V] and uniforms [B]; got {tuple(logits.shape)} and "
                         f"{tuple(uniforms.shape)}")  # fmt: skip
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        kernels = importlib.import_module("megatron_gptoss.ops.sampling_kernels")
        kernels.seeded_sample_kernel[(rows,)](
            logits, uniforms.to(torch.float32).contiguous(), tokens, logprobs, vocab, logits.stride(0),
            1.0 / temperature, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return tokens, logprobs
