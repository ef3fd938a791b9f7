"""Sink attention backends on a CUDA GPU against a float64 reference.

bf16: each backend's error per tensor (output, LSE, dq, dk, dv, dsinks of a loss using output and LSE)
is at most 2x the error of eager attention computed in bf16: operands and matmul outputs in bf16, the
softmax in fp32 (as flash-attn's own tests define the low-precision reference). fp32 Triton (IEEE dots):
1e-5. Triton's gradients are bitwise identical across runs, its packed rows equal its padded rows, and
its decode rows equal its training rows bit for bit; so are flash-attn-4's with its deterministic backward
(`fa4det`), the like-for-like peer of ours in `benchmarks/bench_attention.py`.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gptoss.ops import backend_available, eager_sink_attention, sink_attention
from megatron_gptoss.ops.sink_attention import visibility_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def rel_err(ours, ref):
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def cu_from(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def make_inputs(lead, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(*lead, hq, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(*lead, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(*lead, hkv, d, generator=g, device="cuda").to(dtype)
    sinks = torch.randn(hq, generator=g, device="cuda")
    return q, k, v, sinks


def eager_low_precision(q, k, v, sinks, *, window=None, cu_seqlens=None, max_seqlen=None, return_lse=True):
    """Eager attention computed in q's dtype: bf16 matmuls (bf16 outputs), fp32 softmax over keys + sink."""
    packed = cu_seqlens is not None
    if packed:
        q, k, v = q[None], k[None], v[None]
    _, tokens, hq, d = q.shape
    group = hq // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, 1)
    vt = v.transpose(1, 2).repeat_interleave(group, 1)
    scores = (qt @ kt.transpose(-1, -2)) * d**-0.5
    allowed = visibility_mask(tokens, window, cu_seqlens, q.device)
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    logits = torch.cat([scores, sinks.float().view(1, hq, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    out = (p @ vt).transpose(1, 2)
    if packed:
        out, lse = out[0], lse[0]
    return out, lse


def run(fn, inputs, dtype, **kwargs):
    sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [t.detach().to(dtype if i < 3 else sink_dtype).requires_grad_() for i, t in enumerate(inputs)]
    out, lse = fn(*leaves, return_lse=True, **kwargs)
    g = torch.Generator(device="cuda").manual_seed(1)
    g_out = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, device="cuda", dtype=torch.float64)
    ((out.double() * g_out).sum() + (lse.double() * g_lse).sum()).backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def backend(name):
    if name == "triton1":
        return triton_one_pass
    if name == "fa4det":
        return fa4_deterministic

    def fn(*args, **kwargs):
        return sink_attention(*args, backend=name, **kwargs)

    return fn


def triton_one_pass(q, *args, **kwargs):
    """Triton with the default tiles and the one-pass backward (dQ inside the dK/dV kernel)."""
    from dataclasses import replace

    from megatron_gptoss.ops import triton_sink_attention as tsa

    cu = kwargs.get("cu_seqlens")
    longest = int((cu[1:] - cu[:-1]).max()) if cu is not None else q.shape[1]
    windowed = kwargs.get("window") is not None
    cfg = replace(tsa.default_config(q.shape[-1], q.dtype, windowed, q.device, longest), fused_dq=True)
    return with_config(cfg)(q, *args, **kwargs)


def with_config(cfg):
    """Our Triton attention under `cfg` in place of the default config."""
    from megatron_gptoss.ops.triton_sink_attention import triton_sink_attention

    def fn(*args, **kwargs):
        return triton_sink_attention(*args, config=cfg, **kwargs)

    return fn


def fa4_deterministic(*args, **kwargs):
    from megatron_gptoss.ops.fa4_sink_attention import fa4_sink_attention

    return fa4_sink_attention(*args, deterministic=True, **kwargs)


def available(name, q):
    """Whether backend `name` (our aliases: triton1 runs on triton, fa4det on fa4) runs here."""
    return backend_available({"triton1": "triton", "fa4det": "fa4"}.get(name, name), q)


CASES = {
    # lead dims, q heads, kv heads, head_dim, window, packed lengths
    "causal-gqa8": ((2, 1000), 16, 2, 64, None, None),
    "window128-gqa8": ((1, 1000), 16, 2, 64, 128, None),
    "d128-len777": ((1, 777), 8, 1, 128, None, None),
    "packed-gqa8": (None, 16, 2, 64, None, [300, 0, 517, 183]),
    "packed-window128": (None, 16, 2, 64, 128, [300, 0, 517, 183]),
}
BF16_RUNS = [(b, c) for b in ("triton", "triton1", "fa4", "fa4det") for c in CASES] + [
    ("flex", "causal-gqa8"),
    ("flex", "window128-gqa8"),
]


def case_inputs(name, dtype, seed=0):
    lead, hq, hkv, d, window, lengths = CASES[name]
    cu = cu_from(lengths) if lengths else None
    inputs = make_inputs(lead or (sum(lengths),), hq, hkv, d, dtype, seed)
    return inputs, dict(window=window, cu_seqlens=cu)


@pytest.mark.parametrize("name,case", BF16_RUNS)
def test_bf16_error_within_twice_eager_bf16(name, case):
    inputs, kw = case_inputs(case, torch.bfloat16)
    if not available(name, inputs[0]):
        pytest.skip(f"{name} not available here")
    ref = run(eager_sink_attention, inputs, torch.float64, **kw)
    base = run(eager_low_precision, inputs, torch.bfloat16, **kw)
    ours = run(backend(name), inputs, torch.bfloat16, **kw)
    report = {
        n: (round(rel_err(a, r), 6), round(rel_err(b, r), 6)) for n, a, b, r in zip(NAMES, ours, base, ref)
    }
    print(f"\n{name} {case} (ours, eager-bf16): {report}")
    assert all(o <= 2 * b for o, b in report.values()), report


@pytest.mark.parametrize("name", ["triton", "triton1"])
@pytest.mark.parametrize("case", ["causal-gqa8", "window128-gqa8", "packed-window128"])
def test_triton_fp32_within_1e5(case, name):
    inputs, kw = case_inputs(case, torch.float32)
    ref = run(eager_sink_attention, inputs, torch.float64, **kw)
    ours = run(backend(name), inputs, torch.float32, **kw)
    errors = {n: rel_err(a, r) for n, a, r in zip(NAMES, ours, ref)}
    assert all(e <= 1e-5 for e in errors.values()), errors


@pytest.mark.parametrize("name", ["triton", "triton1", "fa4det"])
@pytest.mark.parametrize("case", ["causal-gqa8", "packed-window128"])
def test_gradients_bitwise_deterministic(case, name):
    inputs, kw = case_inputs(case, torch.bfloat16, seed=4)
    if not available(name, inputs[0]):
        pytest.skip(f"{name} not available here")
    first = run(backend(name), inputs, torch.bfloat16, **kw)
    second = run(backend(name), inputs, torch.bfloat16, **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("case", ["causal-gqa8", "window128-gqa8", "packed-gqa8", "packed-window128"])
def test_triton_tma_loads_give_the_same_bits(case):
    """The backward's tiles read through tensor descriptors (`KernelConfig.tma`) or through pointers: the
    same values, so bitwise the same gradients (bf16)."""
    from dataclasses import replace

    from megatron_gptoss.ops import triton_sink_attention as tsa

    inputs, kw = case_inputs(case, torch.bfloat16, seed=6)
    q = inputs[0]
    base = tsa.default_config(q.shape[-1], q.dtype, kw["window"] is not None, q.device)
    runs = [run(with_config(replace(base, tma=tma)), inputs, torch.bfloat16, **kw) for tma in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*runs)), case


@pytest.mark.parametrize("case", ["causal-gqa8", "packed-gqa8"])
def test_triton_register_cap_gives_the_same_bits(case):
    """The long-sequence config caps the dQ kernel's registers (`KernelConfig.dq_max_registers`, ptxas):
    the same instructions, so bitwise the same gradients as uncapped (bf16)."""
    from dataclasses import replace

    from megatron_gptoss.ops import triton_sink_attention as tsa

    inputs, kw = case_inputs(case, torch.bfloat16, seed=7)
    q = inputs[0]
    base = tsa.default_config(q.shape[-1], q.dtype, False, q.device, max_seqlen=8192)
    assert base.dq_max_registers is not None
    caps = (None, base.dq_max_registers)
    runs = [run(with_config(replace(base, dq_max_registers=c)), inputs, torch.bfloat16, **kw) for c in caps]
    assert all(torch.equal(a, b) for a, b in zip(*runs)), case


@pytest.mark.parametrize("window", [None, 128])
def test_triton_packed_rows_equal_each_document_alone(window):
    lengths = [300, 0, 517, 183]
    cu = cu_from(lengths)
    q, k, v, sinks = make_inputs((sum(lengths),), 16, 2, 64, torch.bfloat16, seed=2)
    out, lse = sink_attention(q, k, v, sinks, window=window, cu_seqlens=cu, return_lse=True, backend="triton")
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        o1, l1 = sink_attention(
            q[None, a:b], k[None, a:b], v[None, a:b], sinks, window=window, return_lse=True, backend="triton"
        )
        assert torch.equal(out[a:b], o1[0]) and torch.equal(lse[:, a:b], l1[0])


@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("n_new", [1, 5])
def test_triton_decode_rows_bitwise_equal_training_rows(window, n_new):
    from megatron_gptoss.ops.triton_sink_attention import triton_sink_attention, triton_sink_decode

    lengths = [1000, 642]  # 642 - 5 .. 641 straddles the 640 tile boundary
    q, k, v, sinks = make_inputs((2, 1000), 16, 2, 64, torch.bfloat16, seed=9)
    out, lse = triton_sink_attention(q, k, v, sinks, window=window, return_lse=True)
    cu = cu_from(lengths)
    pq, pk, pv = (torch.cat([t[0], t[1, : lengths[1]]]) for t in (q, k, v))
    p_out, p_lse = triton_sink_attention(pq, pk, pv, sinks, window=window, cu_seqlens=cu, return_lse=True)
    k_cache = torch.full((2, 1024, 2, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    for b, n in enumerate(lengths):
        k_cache[b, :n], v_cache[b, :n] = k[b, :n], v[b, :n]
    q_new = torch.stack([q[b, n - n_new : n] for b, n in enumerate(lengths)])
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    d_out, d_lse = triton_sink_decode(q_new, k_cache, v_cache, sinks, seqlens, window=window, return_lse=True)
    n0, n1 = lengths
    assert torch.equal(d_out[0], out[0, n0 - n_new :]) and torch.equal(d_lse[0], lse[0, :, n0 - n_new :])
    assert torch.equal(d_out[1], p_out[n0 + n1 - n_new :]) and torch.equal(
        d_lse[1], p_lse[:, n0 + n1 - n_new :]
    )
