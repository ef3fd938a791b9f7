"""The one-pass backward (`KernelConfig.fused_dq`: dQ summed inside the dK/dV kernel in key-block order under
per-tile counters) against float64, and bitwise repeatable; on the CPU under the Triton interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_sink_attention import (
    assert_close_to_reference,
    make_inputs,
    needs_interpreter,
    run_with_grads,
    triton_backend_with_config,
)

from megatron_gptoss.ops import eager_sink_attention
from megatron_gptoss.ops.triton_sink_attention import KernelConfig

CONFIGS = {  # forward tiles, then dK/dV (query tile, key block), dQ (unused with fused_dq)
    "m<n": KernelConfig(16, 16, 1, 1, 16, 32, 1, 1, 16, 16, 1, 1, fused_dq=True),
    "m=n": KernelConfig(16, 16, 1, 1, 16, 16, 1, 1, 16, 16, 1, 1, fused_dq=True),
}


@needs_interpreter
@pytest.mark.parametrize("tiles", list(CONFIGS))
@pytest.mark.parametrize(
    "batch,tokens,hq,hkv,window",
    [(2, 37, 4, 1, None), (1, 45, 2, 2, 9), (1, 40, 2, 1, 16), (1, 33, 4, 2, 1)],
    ids=["causal-gqa4", "window9", "window16", "window1"],
)
def test_fused_dq_matches_fp64(tiles, batch, tokens, hq, hkv, window):
    cfg = CONFIGS[tiles]
    inputs = make_inputs(tokens, hq, hkv, 16, batch=batch, seed=tokens)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, window=window)
    ours = run_with_grads(triton_backend_with_config(cfg), inputs, torch.float32, window=window)
    assert_close_to_reference(ours, ref)
    two_pass = dataclasses.replace(cfg, fused_dq=False, dkdv_pair=False)
    theirs = run_with_grads(triton_backend_with_config(two_pass), inputs, torch.float32, window=window)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])  # the same forward
    assert_close_to_reference(ours, theirs)  # gradients within fp32 rounding of the two-pass backward


@needs_interpreter
@pytest.mark.parametrize("window", [None, 7])
def test_fused_dq_packed_with_empty_documents(window):
    lengths = [0, 5, 19, 0, 33, 1, 0]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = make_inputs(int(cu[-1]), 4, 2, 16, seed=3)
    fused = triton_backend_with_config(CONFIGS["m<n"])
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, window=window, cu_seqlens=cu)
    ours = run_with_grads(fused, inputs, torch.float32, window=window, cu_seqlens=cu)
    assert_close_to_reference(ours, ref)
    again = run_with_grads(fused, inputs, torch.float32, window=window, cu_seqlens=cu)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))
