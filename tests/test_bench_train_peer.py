"""benchmarks/bench_train_peer.py on the CPU: the timing summary, the packed positions, and the plain-torch
stand-in for the peer's varlen attention against a float64 sink-attention reference (forward and
gradients); with torchtitan installed, the peer model builds at tiny width and trains a step."""

import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_train_peer as peer  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def test_timing_summary_median_and_spread():
    gen = torch.Generator().manual_seed(3)
    times = (torch.rand(11, generator=gen) + 0.5).tolist()
    s = peer.timing_summary(times)
    ordered = sorted(times)
    assert s["median_s"] == ordered[5]
    assert (s["min_s"], s["max_s"]) == (ordered[0], ordered[-1])
    assert s["spread_pct"] == pytest.approx(100 * (ordered[-1] - ordered[0]) / ordered[5])
    with pytest.raises(ValueError, match="at least one"):
        peer.timing_summary([])


def test_time_steps_prepares_each_step_untimed():
    calls = []
    times = peer.time_steps(
        lambda: calls.append("step"), 2, 3, torch.device("cpu"), prepare=lambda: calls.append("zero")
    )
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["zero", "step"] * 5


def test_time_steps_aligns_each_step_untimed():
    """`align` (the ranks' barrier) runs after `prepare` and before each step, outside the timed span."""
    calls = []

    def align():
        calls.append("align")
        time.sleep(0.05)

    def step():
        calls.append("step")

    def zero():
        calls.append("zero")

    times = peer.time_steps(step, 1, 3, torch.device("cpu"), prepare=zero, align=align)
    assert calls == ["zero", "align", "step"] * 4
    assert len(times) == 3 and max(times) < 0.05


def test_packed_positions_restart_per_document():
    pos = peer.packed_positions([3, 1, 2])
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1]]
    with pytest.raises(ValueError, match="positive"):
        peer.packed_positions([4, 0])


def sink_attention_reference(q, k, v, sinks, docs, window, scale):
    """float64, from the formula: per document, softmax over the visible keys and the head's sink
    logit, the sink contributing no value. q/k/v (tokens, heads, dim)."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in docs:
        qd = q[start : start + n].transpose(0, 1)
        kd = k[start : start + n].repeat_interleave(rep, 1).transpose(0, 1)
        vd = v[start : start + n].repeat_interleave(rep, 1).transpose(0, 1)
        scores = qd @ kd.transpose(1, 2) * scale
        i = torch.arange(n)
        visible = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < (window or n + 1))
        scores = scores.masked_fill(~visible, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :n]
        out.append((probs @ vd).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 4])
def test_eager_varlen_with_sink_rescale_matches_sink_attention(window):
    gen = torch.Generator().manual_seed(7)
    docs, hq, hkv, d = [9, 5, 7], 4, 2, 8
    total = sum(docs)
    q = torch.randn(total, hq, d, generator=gen, requires_grad=True)
    k = torch.randn(total, hkv, d, generator=gen, requires_grad=True)
    v = torch.randn(total, hkv, d, generator=gen, requires_grad=True)
    sinks = torch.randn(hq, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 9, 14, 21], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    out, lse = peer.eager_varlen_attn(
        q,
        k,
        v,
        cu,
        cu,
        9,
        9,
        return_aux=SimpleNamespace(lse=True),
        scale=scale,
        window_size=(window - 1, 0) if window else (-1, 0),
        enable_gqa=True,
    )
    assert lse.shape == (hq, total)
    # the peer's sink epilogue: out * sigmoid(lse - sink), lse taken as (tokens, heads)
    ours = out * torch.sigmoid(lse.t() - sinks.view(1, -1)).unsqueeze(-1)
    inputs = [q, k, v, sinks]
    ref = sink_attention_reference(q, k, v, sinks, docs, window, scale)
    assert rel(ours, ref) < 1e-6
    grad_out = torch.randn(ref.shape, generator=gen)
    got = torch.autograd.grad(ours, inputs, grad_out)
    want = torch.autograd.grad(ref, inputs, grad_out.double())
    for name, g, w in zip("qkvs", got, want, strict=True):
        assert rel(g, w) < 1e-5, name
    plain = peer.eager_varlen_attn(q, k, v, cu, cu, 9, 9, window_size=(-1, -1))  # no aux: the output only
    assert isinstance(plain, torch.Tensor) and plain.shape == q.shape


def test_peer_model_builds_and_trains_a_step_at_tiny_width():
    pytest.importorskip("torchtitan", reason="the pinned torchtitan wheel is not installed")
    config = peer.peer_config(dim=64, hidden_dim=32, num_experts=4, top_k=2, num_layers=2, vocab=64)
    torch.manual_seed(0)
    model = peer.build_peer(config, torch.device("cpu"), torch.bfloat16, compile_blocks=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    from torchtitan.models.common import attention as tt_attention

    assert tt_attention.varlen_attn is peer.eager_varlen_attn
    assert all(
        isinstance(b.attention.inner_attention, tt_attention.VarlenAttention) for b in model.layers.values()
    )
    windows = [b.attention.inner_attention.window_size for b in model.layers.values()]
    assert windows == [(127, 0), (-1, 0)]  # sliding (128 keys) then full, as gpt-oss
    docs = [24, 16]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (1, 40), generator=gen)
    targets = torch.randint(0, 64, (1, 40), generator=gen)
    loss = peer.peer_step(model, tokens, peer.packed_positions(docs), targets)
    assert abs(float(loss) - math.log(64)) < 1.0
    for name, p in model.named_parameters():
        if name.endswith(("expert_bias", "tokens_per_expert")):
            continue
        assert p.grad is not None and torch.isfinite(p.grad.float()).all(), name
        assert p.grad.float().abs().sum() > 0, name


def test_adapt_varlen_call_repeats_kv_heads_where_gqa_is_missing():
    seen = {}

    def old_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        seen.update(k=k, v=v, scale=scale, window=window_size)
        return q

    call, note = peer.adapt_varlen_call(old_varlen)
    assert "GQA by repeated KV heads" in note and "default split count" in note
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(10, 4, 8, generator=gen)
    k = torch.randn(10, 2, 8, generator=gen)
    v = torch.randn(10, 2, 8, generator=gen)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    call(q, k, v, cu, cu, 10, 10, scale=0.5, window_size=(3, 0), enable_gqa=True, num_splits=1)
    assert torch.equal(seen["k"][:, 1], k[:, 0]) and torch.equal(seen["k"][:, 2], k[:, 1])
    assert torch.equal(seen["v"][:, 3], v[:, 1]) and seen["k"].shape == (10, 4, 8)
    assert seen["scale"] == 0.5 and seen["window"] == (3, 0)

    def new_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, enable_gqa=False, num_splits=None, **kw):
        return q

    same, note = peer.adapt_varlen_call(new_varlen)
    assert same is new_varlen and note == ""


def test_import_peer_fills_a_name_this_torch_lacks_with_a_placeholder(tmp_path, monkeypatch):
    """A peer module importing a name a torch module lacks imports with a placeholder in its place, listed;
    an import error of anything else is raised."""
    import torch.distributed

    pkg = tmp_path / "peerpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "uses_new_torch.py").write_text(
        "from torch.distributed import NameFromANewerTorch\n\n"
        "def f(x: NameFromANewerTorch) -> int:\n    return 1\n"
    )
    (pkg / "broken.py").write_text("from peerpkg import not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(peer, "TORCH_PLACEHOLDERS", [])
    try:
        module = peer.import_peer("peerpkg.uses_new_torch")
        assert module.f(None) == 1
        assert peer.TORCH_PLACEHOLDERS == ["torch.distributed.NameFromANewerTorch"]
        with pytest.raises(ImportError, match="not_there"):
            peer.import_peer("peerpkg.broken")
    finally:
        if hasattr(torch.distributed, "NameFromANewerTorch"):
            delattr(torch.distributed, "NameFromANewerTorch")
