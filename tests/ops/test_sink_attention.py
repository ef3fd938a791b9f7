"""Sink attention backends against a float64 eager reference, on the CPU (Triton under its interpreter).

Errors are ||ours - ref|| / ||ref|| per tensor (output, LSE, and the gradients of q, k, v and sinks of a
loss that uses both the output and the LSE); fp32 must land within 1e-5 of the float64 reference.
Shapes are tiny and the interpreter's tiles are 16 x 16, so lengths like 37 cover partial blocks.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from megatron_gptoss.ops import (
    AttentionInputError,
    eager_sink_attention,
    flex_sink_attention,
    sink_attention,
    sink_decode,
)

TOL = 1e-5
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton tests need TRITON_INTERPRET=1"
)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def make_inputs(tokens, hq, hkv, d, batch=None, seed=0, sink_scale=1.0):
    """fp64 q, k, v (padded when batch is given, packed otherwise) and sinks."""
    g = torch.Generator().manual_seed(seed)
    lead = (batch, tokens) if batch is not None else (tokens,)
    q = torch.randn(*lead, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(*lead, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(*lead, hkv, d, generator=g, dtype=torch.float64)
    sinks = sink_scale * torch.randn(hq, generator=g, dtype=torch.float64)
    return q, k, v, sinks


def run_with_grads(fn, inputs, dtype, seed=1, **kwargs):
    """out, lse and the grads of (q, k, v, sinks) for loss = <out, g_o> + <lse, g_l>."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = fn(*leaves, return_lse=True, **kwargs)
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    loss = (out.double() * g_out).sum() + (lse.double() * g_lse).sum()
    loss.backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def assert_close_to_reference(ours, ref, tol=TOL):
    errors = {name: rel_err(a, b) for name, a, b in zip(NAMES, ours, ref)}
    assert all(e <= tol for e in errors.values()), errors


def triton_backend(*args, **kwargs):
    return sink_attention(*args, backend="triton", **kwargs)


# ------------------------------------------------------------------------------------------------
# Eager in fp32 and flex forward against the fp64 reference
@pytest.mark.parametrize("window", [None, 6])
def test_eager_fp32_matches_fp64(window):
    inputs = make_inputs(29, 4, 2, 16, batch=2)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, window=window)
    ours = run_with_grads(eager_sink_attention, inputs, torch.float32, window=window)
    assert_close_to_reference(ours, ref)


@pytest.mark.parametrize("packed,window", [(False, None), (False, 6), (True, None)])
def test_flex_forward_matches_fp64(packed, window):
    inputs = make_inputs(37, 4, 2, 16, batch=None if packed else 2)
    cu = torch.tensor([0, 5, 5, 20, 37], dtype=torch.int32) if packed else None
    out, lse = flex_sink_attention(
        *(t.float() for t in inputs), window=window, cu_seqlens=cu, return_lse=True
    )
    ref_out, ref_lse = eager_sink_attention(*inputs, window=window, cu_seqlens=cu, return_lse=True)
    assert rel_err(out, ref_out) <= TOL and rel_err(lse, ref_lse) <= TOL


def test_comparison_detects_a_dropped_sink():
    """The reference check is able to fail: attention without the sink is far from the contract."""
    q, k, v, sinks = make_inputs(20, 2, 1, 16, batch=1, sink_scale=3.0)
    ref = eager_sink_attention(q, k, v, sinks)
    no_sink = eager_sink_attention(q, k, v, torch.full_like(sinks, -torch.inf))
    assert rel_err(no_sink, ref) > 100 * TOL


# ------------------------------------------------------------------------------------------------
# Triton: forward, LSE and gradients against the fp64 reference
TRITON_CASES = [
    # batch, tokens, q heads, kv heads, head_dim, window
    pytest.param(2, 37, 4, 1, 16, None, id="causal-gqa4-len37"),
    pytest.param(1, 45, 2, 2, 32, None, id="causal-mha-d32"),
    pytest.param(2, 37, 4, 2, 16, 6, id="window6-gqa2"),
    pytest.param(1, 40, 2, 1, 16, 16, id="window-equals-block"),
    pytest.param(1, 40, 2, 1, 16, 17, id="window-block-plus-1"),
    pytest.param(1, 33, 2, 1, 16, 1, id="window1-self-only"),
    pytest.param(1, 20, 2, 1, 64, 100, id="d64-window-wider-than-seq"),
]


@needs_interpreter
@pytest.mark.parametrize("batch,tokens,hq,hkv,d,window", TRITON_CASES)
def test_triton_matches_fp64(batch, tokens, hq, hkv, d, window):
    inputs = make_inputs(tokens, hq, hkv, d, batch=batch)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, window=window)
    ours = run_with_grads(triton_backend, inputs, torch.float32, window=window)
    assert_close_to_reference(ours, ref)


@needs_interpreter
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("tiles", [(32, 16, 16, 32, 32, 16), (16, 32, 32, 16, 16, 32)], ids=["m>n", "m<n"])
@pytest.mark.parametrize("window", [None, 9])
def test_triton_unequal_tiles(tiles, window, tma):
    """Query tiles larger and smaller than key blocks (forward, dK/dV and dQ each); causal dK/dV with and
    without the pairing of key blocks p and last - p; the backward's looped tiles through pointers and
    through tensor descriptors."""
    from megatron_gptoss.ops.triton_sink_attention import KernelConfig

    fm, fn, km, kn, qm, qn = tiles
    cfg = KernelConfig(fm, fn, 1, 1, km, kn, 1, 1, qm, qn, 1, 1, dkdv_pair=fm > fn, tma=tma)
    inputs = make_inputs(43, 2, 1, 16, batch=1)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, window=window)
    ours = run_with_grads(triton_backend_with_config(cfg), inputs, torch.float32, window=window)
    assert_close_to_reference(ours, ref)


def triton_backend_with_config(cfg):
    from megatron_gptoss.ops.triton_sink_attention import triton_sink_attention

    def fn(*args, **kwargs):
        return triton_sink_attention(*args, config=cfg, **kwargs)

    return fn


@needs_interpreter
@pytest.mark.parametrize("layout", ["heads-apart", "rows-between-batch-rows"])
def test_triton_backward_layouts_with_and_without_a_descriptor_view(layout):
    """The backward reads Q, dO, K and V through tensor descriptors over [rows, heads * head_dim] where the
    layout has that view, pointer loads where not: q, k, v with the heads apart ([B, H, T, D] transposed:
    no view) and padded rows sliced out of longer batch rows (a view with rows_per_b = T + 3 > T)."""
    from megatron_gptoss.ops import triton_sink_attention as tsa

    base = make_inputs(29, 4, 2, 16, batch=2, seed=5)
    q, k, v = (t.float() for t in base[:3])
    if layout == "heads-apart":
        views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    else:
        views = [torch.cat([t, torch.zeros_like(t[:, :3])], dim=1)[:, :29] for t in (q, k, v)]
    descriptor = tsa._row_descriptor(views[0], 16)
    if layout == "heads-apart":
        assert descriptor is None
    else:
        assert descriptor is not None and descriptor[1] == 32
    ref = run_with_grads(eager_sink_attention, base, torch.float64)
    ours = run_with_grads(triton_backend, [*views, base[3].float()], torch.float32)
    assert_close_to_reference(ours, ref)


@needs_interpreter
@pytest.mark.parametrize("window", [None, 7])
def test_triton_packed_matches_fp64_and_each_document_alone(window):
    """Packed documents (empty ones included, first and last) equal each document run alone, bit for bit;
    zero-length documents launch programs that must write nothing and add nothing."""
    lengths = [0, 5, 19, 0, 33, 1, 0]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = make_inputs(int(cu[-1]), 4, 2, 16, seed=3)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, window=window, cu_seqlens=cu)
    ours = run_with_grads(triton_backend, inputs, torch.float32, window=window, cu_seqlens=cu)
    assert_close_to_reference(ours, ref)

    q, k, v, sinks = (t.float() for t in inputs)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:
            continue
        doc = [q[a:b][None], k[a:b][None], v[a:b][None], sinks.double()]
        alone = run_with_grads(triton_backend, doc, torch.float32, window=window)
        assert torch.equal(ours[0][a:b], alone[0][0]), f"doc {i} output"
        assert torch.equal(ours[1][:, a:b], alone[1][0]), f"doc {i} lse"
    # gradients of one document alone, with the packed loss restricted to it
    a, b = int(cu[4]), int(cu[5])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = triton_backend(*leaves, window=window, cu_seqlens=cu, return_lse=True)
    (out[a:b].sum() + lse[:, a:b].sum()).backward()
    doc_leaves = [leaves[0][a:b][None], leaves[1][a:b][None], leaves[2][a:b][None]]
    doc_leaves = [t.detach().clone().requires_grad_() for t in doc_leaves] + [
        sinks.detach().clone().requires_grad_()
    ]
    d_out, d_lse = triton_backend(*doc_leaves, window=window, return_lse=True)
    (d_out.sum() + d_lse.sum()).backward()
    assert torch.equal(leaves[0].grad[a:b], doc_leaves[0].grad[0])
    assert torch.equal(leaves[1].grad[a:b], doc_leaves[1].grad[0])
    assert torch.equal(leaves[2].grad[a:b], doc_leaves[2].grad[0])
    assert rel_err(leaves[3].grad, doc_leaves[3].grad) <= TOL


@needs_interpreter
@pytest.mark.parametrize("fused_dq", [False, True], ids=["two-pass", "one-pass"])
def test_triton_dsink_summed_over_many_partials(monkeypatch, fused_dq):
    """d_sink is summed from one partial per (head, sequence, query tile) by one program per KV head, in
    chunks of SINK_CHUNK: with a chunk of 4 the sum loops over several chunks (7 documents x 3 tiles), and
    the loss with and without the LSE term still matches float64."""
    from megatron_gptoss.ops import triton_sink_attention as tsa

    monkeypatch.setattr(tsa, "SINK_CHUNK", 4)
    cfg = replace(tsa.default_config(16, torch.float32, False, torch.device("cpu")), fused_dq=fused_dq)
    lengths = [0, 5, 19, 0, 33, 1, 12]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = make_inputs(int(cu[-1]), 4, 2, 16, seed=11, sink_scale=3.0)
    fn = triton_backend_with_config(cfg)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, cu_seqlens=cu)
    assert_close_to_reference(run_with_grads(fn, inputs, torch.float32, cu_seqlens=cu), ref)
    grads = []
    for attention, dtype in ((eager_sink_attention, torch.float64), (fn, torch.float32)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        (attention(*leaves, cu_seqlens=cu) * torch.arange(4, dtype=dtype).view(1, 4, 1)).sum().backward()
        grads.append(leaves[3].grad)
    assert rel_err(grads[1], grads[0]) <= TOL


@needs_interpreter
def test_triton_grid_limits_are_a_clear_error():
    """More query tiles or sequences than CUDA's grid axes take is refused before any launch, naming both."""
    q, k, v, sinks = (t.float() for t in make_inputs(8, 2, 1, 16))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="exceed the launch grid"):
        triton_backend(q, k, v, sinks, cu_seqlens=cu, max_seqlen=16 * 65535 + 1)
    many = torch.zeros(65537, dtype=torch.int32)
    many[-1] = 8
    with pytest.raises(AttentionInputError, match="65536 sequences"):
        triton_backend(q, k, v, sinks, cu_seqlens=many, max_seqlen=8)


@needs_interpreter
def test_triton_row_offsets_past_32_bits_are_a_clear_error():
    """A row is addressed by a 32-bit offset from its sequence's first row: a sequence whose rows pass that at
    the inputs' token stride is refused before any launch, naming the tensor and its stride."""
    q, k, v, sinks = (t.float() for t in make_inputs(8, 2, 1, 16))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    longest = 2**31 // q.stride(0)  # q's token stride: 2 heads x 16
    with pytest.raises(
        AttentionInputError, match=r"q's token stride of 32 elements passes 32-bit row offsets"
    ):
        triton_backend(q, k, v, sinks, cu_seqlens=cu, max_seqlen=longest)
    triton_backend(q, k, v, sinks, cu_seqlens=cu, max_seqlen=8)  # the same inputs at their real length run


@needs_interpreter
def test_triton_rows_without_keys_are_finite():
    """Under the causal contract a query always sees itself, so rows without keys arise only in effect:
    here half the heads have scores around -1e5 (every exp underflows), which the reference also treats
    as Z = exp(sink): O = 0 exactly and LSE = sink, gradients finite and equal to the reference. (Window 1
    and window-edge blocks, where a row's first visited block is entirely masked, are covered above.)"""
    q, k, v, sinks = make_inputs(35, 4, 2, 16, batch=1, seed=5)
    direction = torch.randn(16, dtype=torch.float64)
    direction = direction / direction.norm()
    q[:, :, :2] = 320.0 * direction  # heads 0-1 (kv head 0): q.k = -320 * 320 = -102400
    k[:, :, :1] = -320.0 * direction
    inputs = (q, k, v, sinks)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64)
    ours = run_with_grads(triton_backend, inputs, torch.float32)
    assert all(torch.isfinite(t).all() for t in ours)
    assert torch.equal(ours[0][:, :, :2], torch.zeros_like(ours[0][:, :, :2]))
    sink_rows = sinks[:2].float().view(1, 2, 1).expand(1, 2, 35)
    torch.testing.assert_close(ours[1][:, :2], sink_rows, rtol=1e-6, atol=0)  # base-2 round trip
    assert_close_to_reference(ours, ref)


@needs_interpreter
def test_triton_sink_dominated_rows():
    """Large sinks (+8) leave little weight to keys: output small, LSE near the sink, still within 1e-5."""
    inputs = make_inputs(30, 2, 1, 16, batch=1, seed=7)
    inputs = inputs[:3] + (inputs[3] + 8.0,)
    ref = run_with_grads(eager_sink_attention, inputs, torch.float64, window=4)
    ours = run_with_grads(triton_backend, inputs, torch.float32, window=4)
    assert_close_to_reference(ours, ref)


# ------------------------------------------------------------------------------------------------
# Decode rows equal training rows
@needs_interpreter
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("n_new", [1, 7])
def test_triton_decode_rows_equal_training_rows(window, n_new):
    from megatron_gptoss.ops.triton_sink_attention import triton_sink_attention, triton_sink_decode

    q, k, v, sinks = (t.float() for t in make_inputs(37, 4, 2, 16, batch=2, seed=11))
    lengths = [37, 20]
    out, lse = triton_sink_attention(q, k, v, sinks, window=window, return_lse=True)
    cu = torch.tensor([0, 37, 57], dtype=torch.int32)
    packed_q = torch.cat([q[0], q[1, :20]])
    packed_k, packed_v = torch.cat([k[0], k[1, :20]]), torch.cat([v[0], v[1, :20]])
    p_out, p_lse = triton_sink_attention(
        packed_q, packed_k, packed_v, sinks, window=window, cu_seqlens=cu, return_lse=True
    )
    cache_len = 40  # entries past a sequence's length hold NaN: they must never be read into a result
    k_cache = torch.full((2, cache_len, 2, 16), float("nan"))
    v_cache = torch.full((2, cache_len, 2, 16), float("nan"))
    for b, n in enumerate(lengths):
        k_cache[b, :n], v_cache[b, :n] = k[b, :n], v[b, :n]
    q_new = torch.stack([q[b, n - n_new : n] for b, n in enumerate(lengths)])
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    decode = sink_decode if n_new == 1 else triton_sink_decode  # the package export and the kernel module
    d_out, d_lse = decode(q_new, k_cache, v_cache, sinks, seqlens, window=window, return_lse=True)
    assert torch.equal(d_out[0], out[0, 37 - n_new :]) and torch.equal(d_lse[0], lse[0, :, 37 - n_new :])
    assert torch.equal(d_out[1], p_out[57 - n_new :]) and torch.equal(d_lse[1], p_lse[:, 57 - n_new :])


@needs_interpreter
@pytest.mark.parametrize("window", [None, 5])
def test_triton_decode_left_padded_rows_read_no_key_before_the_sequence(window):
    """A prefill group pads short rows on the left: a row with fewer valid entries than new queries has
    queries before position 0. Those rows read nothing (zeros; keys before a sequence's first entry are the
    previous sequence's memory) and the real rows still equal the training rows."""
    from megatron_gptoss.ops.triton_sink_attention import triton_sink_attention, triton_sink_decode

    q, k, v, sinks = (t.float() for t in make_inputs(24, 4, 2, 16, batch=2, seed=13))
    n_new, short = 20, 6  # row 1 holds 6 entries: 14 padding queries sit at positions -14 .. -1
    out, lse = triton_sink_attention(q[1:, :short], k[1:, :short], v[1:, :short], sinks, window=window,
                                     return_lse=True)  # fmt: skip
    k_cache, v_cache = k.clone(), v.clone()
    k_cache[1, short:], v_cache[1, short:] = float("nan"), float("nan")
    seqlens = torch.tensor([24, short], dtype=torch.int32)
    q_new = torch.cat([q[:, : n_new - short], q[:, :short]], dim=1)  # row 1: padding, then its 6 queries
    d_out, d_lse = triton_sink_decode(q_new, k_cache, v_cache, sinks, seqlens, window=window, return_lse=True)
    assert torch.equal(d_out[1, n_new - short :], out[0]) and torch.equal(
        d_lse[1, :, n_new - short :], lse[0]
    )
    assert torch.count_nonzero(d_out[1, : n_new - short]) == 0


# ------------------------------------------------------------------------------------------------
# Clear errors
def _small(batch=1, tokens=8, hq=2, hkv=1, d=16, dtype=torch.float32):
    return [t.to(dtype) for t in make_inputs(tokens, hq, hkv, d, batch=batch)]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: dict(a, q=a["q"][0]), "expected"),
        (lambda a: dict(a, k=a["k"][:, :5], v=a["v"][:, :5]), "disagree"),
        (lambda a: dict(a, v=a["v"][..., :8]), "differ in shape"),
        (
            lambda a: dict(
                a, k=torch.randn(1, 8, 2, 16), v=torch.randn(1, 8, 2, 16), q=torch.randn(1, 8, 3, 16)
            ),
            "divisible",
        ),
        (lambda a: dict(a, sinks=torch.zeros(3)), "sinks"),
        (lambda a: dict(a, window=0), "window"),
        (lambda a: dict(a, backend="cudnn"), "unknown attention backend"),
    ],
)
def test_bad_inputs_raise(mutate, match):
    q, k, v, sinks = _small()
    args = mutate(dict(q=q, k=k, v=v, sinks=sinks))
    with pytest.raises(AttentionInputError, match=match):
        sink_attention(**args)


def test_bad_cu_seqlens_raise():
    q, k, v, sinks = _packed_small()
    for cu, match in [
        (torch.tensor([0, 4, 8], dtype=torch.int64), "int32"),
        (torch.tensor([0, 4, 7], dtype=torch.int32), "end at total_tokens"),
        (torch.tensor([0, 6, 4, 8], dtype=torch.int32), "non-decreasing"),
    ]:
        with pytest.raises(AttentionInputError, match=match):
            sink_attention(q, k, v, sinks, cu_seqlens=cu)


def _packed_small():
    return [t.float() for t in make_inputs(8, 2, 1, 16)]


@needs_interpreter
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: _small(d=24), "head_dim"),
        (lambda: _small(dtype=torch.float64), "dtype"),
    ],
)
def test_triton_rejects_unsupported(make, match):
    with pytest.raises(AttentionInputError, match=match):
        sink_attention(*make(), backend="triton")


@needs_interpreter
def test_triton_decode_rejects_bad_cache_seqlens():
    from megatron_gptoss.ops.triton_sink_attention import triton_sink_decode

    q, k, v, sinks = _small(batch=2)
    with pytest.raises(AttentionInputError, match="cache_seqlens"):
        triton_sink_decode(q[:, -1:], k, v, sinks, torch.tensor([8, 8]))
    with pytest.raises(AttentionInputError, match="do not fit"):
        triton_sink_decode(torch.cat([q, q], 1), k, v, sinks, torch.tensor([8, 8], dtype=torch.int32))


@pytest.mark.parametrize("window", [None, 3])
def test_eager_packed_input_one_document_at_a_time(monkeypatch, window):
    """The eager reference over a pack too large for its whole-pack scores (the bound lowered to 0) equals
    the whole-pack computation: outputs, LSE and the gradients of q, k, v and the sinks."""
    import importlib

    module = importlib.import_module("megatron_gptoss.ops.sink_attention")  # the package exports a function
    gen = torch.Generator().manual_seed(11)
    cu = torch.tensor([0, 5, 6, 13, 17], dtype=torch.int32)
    q = torch.randn(17, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(17, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    w_out, w_lse = torch.randn(17, 4, 8, generator=gen), torch.randn(4, 17, generator=gen)
    results = []
    for bound in (module.EAGER_PACKED_SCORES, 0):
        monkeypatch.setattr(module, "EAGER_PACKED_SCORES", bound)
        for t in (q, k, v, sinks):
            t.grad = None
        out, lse = module.eager_sink_attention(q, k, v, sinks, window=window, cu_seqlens=cu, return_lse=True)
        ((out * w_out).sum() + (lse * w_lse).sum()).backward()
        results.append([out.detach(), lse.detach(), *(t.grad.clone() for t in (q, k, v, sinks))])
    for ours, ref in zip(results[1], results[0]):
        assert rel_err(ours, ref) <= 1e-6


def test_a_failed_optional_backend_import_keeps_no_caller_alive(monkeypatch):
    """The first `backend_available("fa4")` imports the fa4 module from deep inside a caller (an engine's
    generate); where flash-attn-4 is missing, the module must not keep the ImportError's traceback, whose
    frames would hold the caller's locals (the KV cache) for the life of the process."""
    import gc
    import sys
    import weakref

    from megatron_gptoss.ops.sink_attention import backend_available

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn...` raises ImportError
    monkeypatch.delitem(sys.modules, "megatron_gptoss.ops.fa4_sink_attention", raising=False)

    class Big:
        pass

    def caller() -> weakref.ref:
        held = Big()  # a local of the frame that triggers the import
        assert not backend_available("fa4", torch.zeros(1))
        return weakref.ref(held)

    ref = caller()
    gc.collect()
    assert ref() is None
    module = sys.modules["megatron_gptoss.ops.fa4_sink_attention"]
    assert isinstance(module.IMPORT_ERROR, str) and "flash_attn" in module.IMPORT_ERROR
