"""Decode expert kernels (megatron_gptoss.ops.moe_decode) against float64 references, fp32 on the CPU
under the Triton interpreter (tiny shapes: experts without rows, experts with more rows than a tile,
partial column and K blocks, both product orientations, with and without bias, with and without an addend),
the MoE block's decode path against its library path (with active adapters too, bf16-format and MXFP4
experts) and when it is taken, benchmarks/bench_moe_decode.py at toy widths; on a CUDA GPU (`gpu`): bf16 and
fp32 against float64 and the library path (with adapters too), replays of a captured CUDA graph on new
routings. Errors per tensor are ||ours - ref|| / ||ref||."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from helpers.embedded_engine import engine_of, perturbed_learner
from helpers.triton_cpu import interpreted

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.config.lora import LoRAConfig
from megatron_gptoss.hf import quantize_mxfp4
from megatron_gptoss.model.lora import adapters_disabled
from megatron_gptoss.model.moe import DECODE_ROWS_PER_EXPERT, Experts, grouped_linear
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.ops import batch_invariant, fused_moe, moe_decode, mxfp4_gemm
from megatron_gptoss.ops.moe_decode import DecodeConfig
from megatron_gptoss.rollout import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
)
LIMIT, ALPHA = 7.0, 1.702
ROOT = Path(__file__).resolve().parents[2]
TILES = {
    "plain": DecodeConfig(block_m=16, block_n=16, block_k=16, warps=1, stages=1, swap=False),
    "swap": DecodeConfig(block_m=16, block_n=16, block_k=32, warps=1, stages=1, swap=True),
    "plain_tma": DecodeConfig(block_m=16, block_n=16, block_k=32, warps=1, stages=1, swap=False, tma=True),
    "swap_tma": DecodeConfig(block_m=16, block_n=16, block_k=16, warps=1, stages=1, swap=True, tma=True),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def bounds_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def inputs(counts, hidden, inter, bias, seed=0):
    """fp32 rows sorted by expert and weights scaled so that the gate and up products reach beyond the
    SwiGLU limit (both clamps taken)."""
    g = torch.Generator().manual_seed(seed)
    e, m = len(counts), sum(counts)
    x = torch.randn(m, hidden, generator=g)
    w1 = torch.randn(e, 2 * inter, hidden, generator=g) * (6.0 / hidden**0.5)
    w2 = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    b1 = torch.randn(e, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(e, hidden, generator=g) if bias else None
    return x, w1, b1, w2, b2, bounds_of(counts)


def f64(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("tile", sorted(TILES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "counts,hidden,inter",
    [([5, 0, 19, 3], 48, 40), ([0, 17, 0, 23], 64, 32), ([1, 2, 0, 0], 32, 64), ([0, 0, 0, 0], 32, 32)],
)
@interpreted
def test_kernels_match_float64_reference(tile, bias, counts, hidden, inter):
    x, w1, b1, w2, b2, bounds = inputs(counts, hidden, inter, bias)
    cfg = TILES[tile]
    h = moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, cfg)
    h_ref = moe_decode.fc1_reference(x.double(), w1.double(), f64(b1), bounds, LIMIT, ALPHA)
    assert h.shape == (sum(counts), inter) and h.dtype == x.dtype
    # fc2 on the same fp32 rows for both, so its error is its own
    y = moe_decode.decode_fc2(h, w2, b2, bounds, cfg)
    y_ref = moe_decode.fc2_reference(h.double(), w2.double(), f64(b2), bounds)
    assert y.shape == (sum(counts), hidden) and y.dtype == x.dtype
    if not sum(counts):
        return
    pre = moe_decode._grouped_reference(x.double(), w1.double(), bounds)
    assert (pre[:, :inter] > LIMIT).any() and (pre[:, inter:].abs() > LIMIT).any()
    assert rel_err(h, h_ref) <= 1e-6
    assert rel_err(y, y_ref) <= 1e-6


@pytest.mark.parametrize("tile", sorted(TILES))
@pytest.mark.parametrize("bias", [True, False])
@interpreted
def test_kernels_with_an_addend_match_float64_reference(tile, bias):
    """fc1 and fc2 with an addend (an adapter's update; fc1's in [gate; up] columns) within 1e-6 of the
    float64 references, which add it to the products before bias and SwiGLU; without it the results move."""
    counts, hidden, inter = [5, 0, 19, 3], 48, 40
    x, w1, b1, w2, b2, bounds = inputs(counts, hidden, inter, bias)
    g = torch.Generator().manual_seed(1)
    a1 = 3 * torch.randn(x.shape[0], 2 * inter, generator=g)
    a2 = torch.randn(x.shape[0], hidden, generator=g)
    cfg = TILES[tile]
    h = moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, cfg, addend=a1)
    h_ref = moe_decode.fc1_reference(
        x.double(), w1.double(), f64(b1), bounds, LIMIT, ALPHA, addend=a1.double()
    )
    y = moe_decode.decode_fc2(h, w2, b2, bounds, cfg, addend=a2)
    y_ref = moe_decode.fc2_reference(h.double(), w2.double(), f64(b2), bounds, addend=a2.double())
    assert rel_err(h, h_ref) <= 1e-6
    assert rel_err(y, y_ref) <= 1e-6
    assert rel_err(moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, cfg), h_ref) > 1e-2
    assert rel_err(moe_decode.decode_fc2(h, w2, b2, bounds, cfg), y_ref) > 1e-2


def test_default_config_on_cpu_and_cuda_shapes():
    assert moe_decode.default_config(1024, 32, torch.device("cpu")) == moe_decode.CPU_CONFIG
    cuda = torch.device("cuda")
    for rows, experts in [(0, 32), (256, 32), (1000, 32), (2048, 32), (8192, 32), (1024, 128)]:
        for dtype, gated in [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)]:
            cfg = moe_decode.default_config(rows, experts, cuda, dtype, gated)
            average = rows / experts
            for block in (cfg.block_m, cfg.block_k):  # powers of two the kernel's dot takes
                assert block & (block - 1) == 0 and block >= 16
            assert cfg.block_m <= 128 and cfg.block_m >= min(128, 2 * average)
            assert cfg.block_m == 16 or cfg.block_m < 4 * average
            per_stage = ((2 if gated else 1) * cfg.block_n + cfg.block_m) * cfg.block_k * dtype.itemsize
            assert cfg.stages >= 2 and cfg.stages * per_stage <= moe_decode.SHARED_MEMORY_BUDGET


def test_bad_shapes_are_named():
    x, w1, b1, w2, b2, bounds = inputs([3, 2, 0, 1], 48, 32, True)
    with pytest.raises(ValueError, match="bounds must be int32"):
        moe_decode.decode_fc1(x, w1, b1, bounds.long(), LIMIT, ALPHA)
    with pytest.raises(ValueError, match="do not match"):
        moe_decode.decode_fc2(x, w2, b2, bounds)  # rows [M, H] where fc2 takes [M, I]
    with pytest.raises(ValueError, match="bias"):
        moe_decode.decode_fc1(x, w1, b2, bounds, LIMIT, ALPHA)
    with pytest.raises(ValueError, match="addend must be \\[M, 64\\] = \\[6, 64\\]"):
        moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, addend=torch.zeros(6, 32))  # [M, I]
    with pytest.raises(ValueError, match="in the rows' dtype"):
        moe_decode.decode_fc2(torch.zeros(6, 32), w2, b2, bounds, addend=torch.zeros(6, 48).double())


@interpreted
@pytest.mark.parametrize(
    "counts,n,k", [([5, 0, 19, 3], 8, 40), ([5, 0, 19, 3], 40, 8), ([0, 17, 0, 2], 24, 24), ([0, 0], 8, 16)]
)
def test_decode_grouped_matches_float64_for_adapter_shapes(counts, n, k):
    """`decode_grouped` (an adapter's factor at decode: A with fewer columns than a tile, B with a K shorter
    than a step) within 1e-6 of float64, fp32, on its own tiles and on `narrow_config`'s."""
    g = torch.Generator().manual_seed(5)
    bounds = bounds_of(counts)
    x = torch.randn(sum(counts), k, generator=g)
    w = torch.randn(len(counts), n, k, generator=g)
    ref = moe_decode._grouped_reference(x.double(), w.double(), bounds)
    for cfg in (None, TILES["swap"]):
        out = moe_decode.decode_grouped(x, w, bounds, cfg)
        assert out.shape == (sum(counts), n) and out.dtype == x.dtype
        if sum(counts):
            assert rel_err(out, ref) <= 1e-6


def test_narrow_config_fits_the_adapter_shapes():
    """On CUDA the column tile is half the columns (>= 16, <= the default's) and the K step the reduction
    (>= 16, <= the default's); on the CPU the interpreter's tiles."""
    cuda = torch.device("cuda")
    base = moe_decode.default_config(1024, 32, cuda, torch.bfloat16, gated=False)
    a = moe_decode.narrow_config(1024, 32, 32, 2880, cuda)
    b = moe_decode.narrow_config(1024, 32, 5760, 32, cuda)
    assert (a.block_n, a.block_k, a.block_m) == (16, base.block_k, base.block_m)
    assert (b.block_n, b.block_k) == (base.block_n, 32)
    assert moe_decode.narrow_config(1024, 32, 8, 8, cuda).block_k == 16
    assert moe_decode.narrow_config(1024, 32, 8, 8, torch.device("cpu")) == moe_decode.CPU_CONFIG


def experts_pair(bias: bool, lora: LoRAConfig | None = None, expert_format: str = "bf16"):
    """Experts of the tiny config on the fused path, every parameter N(0, 0.25) (adapters' B too); MXFP4
    weights quantized from such values."""
    config = dataclasses.replace(
        gpt_oss_tiny(), expert_backend="grouped_mm", add_bias_linear=bias, expert_format=expert_format
    )
    if lora is not None:
        config = dataclasses.replace(config, lora=lora)
    torch.manual_seed(0)
    experts = Experts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.5 * torch.randn(p.shape))
        for weight in mxfp4_weights(experts).values():
            weight.copy_packed_(*quantize_mxfp4(0.5 * torch.randn(weight.shape)))
    return experts


def routed_rows(experts: Experts, tokens: int = 13, seed: int = 3):
    """(x, probs, indices) of `tokens` tokens routed to 2 experts each, the last expert without rows."""
    e, hidden = experts.num_experts, experts.linear_fc1.weight.shape[2]
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(e - 1, generator=g)[:2] for _ in range(tokens)])
    probs = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    return torch.randn(tokens, hidden, generator=g), probs, indices


@interpreted
@pytest.mark.parametrize("expert_format", ["bf16", "mxfp4"])
def test_experts_decode_path_with_adapters_equals_the_learner_path(expert_format, monkeypatch):
    """fp32 experts with active adapters on fc1 and fc2 (B random), float and MXFP4 weights: the engine's
    decode path (each update added in its kernel's epilogue) equals the learner's forward outside the decode
    scope within 1e-6; the adapters move the output."""
    experts = experts_pair(True, LoRAConfig(rank=2, alpha=2.0), expert_format)
    x, probs, indices = routed_rows(experts)
    monkeypatch.setattr(Experts, "decode_kernels", lambda self, x: self.decode_eligible(x))
    with torch.no_grad():
        learner = experts(x, probs, indices)
        with moe_decode.decode_scope():
            assert experts.decode_kernels(x)
            decode = experts(x, probs, indices)
            with adapters_disabled(experts):
                base = experts(x, probs, indices)
    assert rel_err(decode, learner) <= 1e-6
    assert rel_err(base, learner) > 1e-2


@interpreted
@pytest.mark.parametrize("bias", [True, False])
def test_experts_decode_path_equals_library_path(bias, monkeypatch):
    experts = experts_pair(bias)
    e, hidden = experts.num_experts, experts.linear_fc1.weight.shape[2]
    g = torch.Generator().manual_seed(3)
    indices = torch.stack([torch.randperm(e - 1, generator=g)[:2] for _ in range(13)])  # last expert empty
    probs = torch.softmax(torch.randn(13, 2, generator=g), dim=-1)
    x = torch.randn(13, hidden, generator=g)
    with torch.no_grad(), moe_decode.decode_scope():
        assert experts.decode_eligible(x) and not experts.decode_kernels(x)  # CPU: the library path
        library = experts(x, probs, indices)
        monkeypatch.setattr(Experts, "decode_kernels", lambda self, x: True)
        decode = experts(x, probs, indices)
    assert rel_err(decode, library) <= 1e-6


def test_decode_eligible_conditions():
    experts = experts_pair(True)
    e, hidden = experts.num_experts, experts.linear_fc1.weight.shape[2]
    x = torch.randn(8, hidden)
    with torch.no_grad():
        assert not experts.decode_eligible(x)  # outside the engine's decode scope: the learner's forwards
    with moe_decode.decode_scope():
        assert experts.decode_eligible(x) is False  # gradients enabled, weights require grad
    with torch.no_grad(), moe_decode.decode_scope():
        assert experts.decode_eligible(x)
        assert not experts.decode_eligible(x.double())
        assert experts.decode_eligible(torch.randn(DECODE_ROWS_PER_EXPERT * e, hidden))
        assert not experts.decode_eligible(torch.randn(DECODE_ROWS_PER_EXPERT * e + 1, hidden))
        with batch_invariant.enabled():
            assert not experts.decode_eligible(x)
        loop = Experts(dataclasses.replace(gpt_oss_tiny(), expert_backend="loop"))
        assert not loop.decode_eligible(x)
        adapted = experts_pair(True, LoRAConfig(rank=2, dropout=0.1))
        assert not adapted.decode_eligible(x)  # in training mode its adapters draw dropout
        assert adapted.eval().decode_eligible(x)  # the engine's model is in eval mode
        with moe_decode.library_only():  # a benchmark's baseline, nested either way
            assert not experts.decode_eligible(x)
            with moe_decode.decode_scope():
                assert not experts.decode_eligible(x)
        assert experts.decode_eligible(x)
    for p in experts.parameters():
        p.requires_grad_(False)
    with moe_decode.decode_scope():
        assert experts.decode_eligible(x)
        assert not experts.decode_eligible(x.requires_grad_())
        for name, p in adapted.named_parameters():
            p.requires_grad_(".lora." in name)  # a frozen base, trainable adapters
        assert not adapted.decode_eligible(x.detach())


def test_fused_references_keep_float64():
    """The references compute in float64 for float64 inputs (a float32 detour would cost ~1e-8)."""
    h = torch.randn(6, 8, dtype=torch.float64) * 3
    bounds = bounds_of([2, 4])
    out = fused_moe.swiglu_reference(h, None, bounds, LIMIT, ALPHA)
    gate, up = h[:, :4].clamp(max=LIMIT), h[:, 4:].clamp(-LIMIT, LIMIT)
    assert out.dtype == torch.float64
    assert torch.equal(out, (up + 1) * (gate * torch.sigmoid(gate * ALPHA)))


def _bench():
    path = ROOT / "benchmarks" / "bench_moe_decode.py"
    spec = importlib.util.spec_from_file_location("bench_moe_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_tiny_checks_and_times(monkeypatch, capsys):
    """benchmarks/bench_moe_decode.py at toy widths: its check passes, the sweep and the table run; a decode
    path with a wrong result fails the check."""
    bench = _bench()
    assert bench.main(["--tiny", "--budget-s", "0.01", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "decode, best" in out and "FAILED" not in out
    monkeypatch.setattr(bench, "decode_fc2", lambda cfg: lambda h, w, b, bounds: torch.zeros_like(h))
    assert bench.main(["--tiny", "--check-only"]) == 1


# ------------------------------------------------------------------------------------------------
# CUDA (`-m gpu`)
def library_path(x, w1, b1, w2, b2, bounds):
    """torch._grouped_mm + the fused bias / SwiGLU kernels: (h, y), y from the library's own h."""
    from megatron_gptoss.model.moe import grouped_linear

    h = fused_moe.swiglu_bias(grouped_linear(x, w1, bounds, "grouped_mm"), b1, bounds, LIMIT, ALPHA)
    y = grouped_linear(h, w2, bounds, "grouped_mm")
    return h, (y if b2 is None else fused_moe.expert_bias(y, b2, bounds))


def gpu_inputs(counts, hidden, inter, seed=0):
    x, w1, b1, w2, b2, bounds = inputs(counts, hidden, inter, True, seed)
    return x.cuda(), w1.cuda(), b1.cuda(), w2.cuda(), b2.cuda(), bounds.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("counts", [[9, 0, 70, 1, 33, 0, 16, 130], [3, 0, 0, 5, 0, 0, 0, 1]])
def test_kernels_fp32_gpu(tma, swap, counts):
    """fp32 with IEEE dots (small tiles: experts over several row tiles) within 1e-5 of float64."""
    x, w1, b1, w2, b2, bounds = gpu_inputs(counts, 576, 320)
    small = DecodeConfig(block_m=32, block_n=32, block_k=32, warps=4, stages=2, swap=swap, tma=tma)
    h_ref = moe_decode.fc1_reference(x.double(), w1.double(), b1.double(), bounds, LIMIT, ALPHA)
    h32 = moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, small)
    y_ref = moe_decode.fc2_reference(h32.double(), w2.double(), b2.double(), bounds)
    assert rel_err(h32, h_ref) <= 1e-5
    assert rel_err(moe_decode.decode_fc2(h32, w2, b2, bounds, small), y_ref) <= 1e-5


def row_mismatch(ours: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the fraction of elements whose value differs from ref's, and ||ours - ref|| / ||ref||."""
    differ = (ours != ref).double().mean(dim=1)
    rel = (ours.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1).clamp_min(1e-30)
    return differ, rel


def assert_rows_close(name: str, ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Per row at most 1% of the values differ and ||ours - ref|| / ||ref|| <= 2e-3 (both printed)."""
    differ, rel = row_mismatch(ours, expected)
    print(f"{name}: values differing per row mean {differ.mean():.2e} max {differ.max():.2e}, row error "
          f"max {rel.max():.2e}")  # fmt: skip
    assert differ.max() <= 0.01, (name, differ.max().item())
    assert rel.max() <= 2e-3, (name, rel.max().item())


def gpt_oss_width_decode_inputs(experts: int = 32, width: int = 2880, tokens: int = 256, k: int = 4):
    """bf16 rows of a decode step at gpt-oss width (`tokens` tokens routed to k of `experts` experts at
    random, sorted by expert), weights scaled so that both clamps of the SwiGLU are taken, biases N(0, 1)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    choice = torch.rand(tokens, experts, generator=g, device="cuda").topk(k, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    bounds = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    x = torch.randn(tokens * k, width, generator=g, device="cuda")
    w1 = torch.randn(experts, 2 * width, width, generator=g, device="cuda") * (6.0 / width**0.5)
    w2 = torch.randn(experts, width, width, generator=g, device="cuda") / width**0.5
    b1 = torch.randn(experts, 2 * width, generator=g, device="cuda")
    b2 = torch.randn(experts, width, generator=g, device="cuda")
    return *(t.bfloat16() for t in (x, w1, b1, w2, b2)), bounds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_round_as_the_library_gpt_oss_width_gpu():
    """bf16 at gpt-oss-20b width (32 experts, hidden and intermediate 2880, 256 tokens top-4), per row against
    float64 with the library path's roundings (each GEMM's products rounded to bf16, bias and SwiGLU on
    them, rounded again): the decode kernels, in every tile orientation, differ from it in at most 1% of a
    row's values, as the library path itself does; fc2 is checked on the kernel's own fc1 output. Kernels
    that feed the unrounded fp32 products to the epilogue differ in a third to a half of them."""
    x, w1, b1, w2, b2, bounds = gpt_oss_width_decode_inputs()
    ref = [t.double() for t in (x, w1, b1, w2, b2)]
    h_ref = moe_decode.fc1_reference(*ref[:3], bounds, LIMIT, ALPHA, dtype=torch.bfloat16)
    pre = moe_decode._grouped_reference(ref[0], ref[1], bounds)
    assert (pre[:, :2880] > LIMIT).any() and (pre[:, 2880:].abs() > LIMIT).any()
    h_lib, y_lib = library_path(x, w1, b1, w2, b2, bounds)
    results = {"library": (h_lib, y_lib)}
    rows = x.shape[0]
    for swap in (True, False):
        for tma in (True, False):
            cfg = {}
            for g in (True, False):
                tiles = moe_decode.default_config(rows, 32, x.device, x.dtype, g)
                cfg[g] = dataclasses.replace(tiles, swap=swap, tma=tma)
            h = moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, cfg[True])
            y = moe_decode.decode_fc2(h, w2, b2, bounds, cfg[False])
            results[f"decode swap={swap} tma={tma}"] = (h, y)
    for name, (h, y) in results.items():
        y_ref = moe_decode.fc2_reference(h.double(), *ref[3:], bounds, dtype=torch.bfloat16)
        for what, ours, expected in (("fc1", h, h_ref), ("fc2", y, y_ref)):
            differ, rel = row_mismatch(ours, expected)
            print(f"{name} {what}: values differing per row mean {differ.mean():.2e} max {differ.max():.2e}, "
                  f"row error max {rel.max():.2e}")  # fmt: skip
            assert differ.max() <= 0.01, (name, what, differ.max().item())
            assert rel.max() <= 2e-3, (name, what, rel.max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_with_an_addend_round_as_the_library_gpt_oss_width_gpu():
    """bf16 at gpt-oss-20b width with addends N(0, 1) (an adapter's update), default tiles: per row against
    float64 with the library path's roundings (products rounded to bf16, the addend added and rounded again,
    bias and SwiGLU on them, rounded again) and against the library path itself (`torch._grouped_mm`, the
    addend added as a tensor, the fused bias / SwiGLU), at most 1% of a row's values differ; fc2 is checked
    on the kernel's own fc1 output."""
    x, w1, b1, w2, b2, bounds = gpt_oss_width_decode_inputs()
    g = torch.Generator(device="cuda").manual_seed(11)
    a1 = torch.randn(x.shape[0], w1.shape[1], generator=g, device="cuda").bfloat16()
    a2 = torch.randn(x.shape[0], w2.shape[1], generator=g, device="cuda").bfloat16()
    ref = [t.double() for t in (x, w1, b1, w2, b2, a1, a2)]
    h = moe_decode.decode_fc1(x, w1, b1, bounds, LIMIT, ALPHA, addend=a1)
    y = moe_decode.decode_fc2(h, w2, b2, bounds, addend=a2)
    h_ref = moe_decode.fc1_reference(*ref[:3], bounds, LIMIT, ALPHA, torch.bfloat16, addend=ref[5])
    y_ref = moe_decode.fc2_reference(h.double(), *ref[3:5], bounds, torch.bfloat16, addend=ref[6])
    h_lib = fused_moe.swiglu_bias(grouped_linear(x, w1, bounds, "grouped_mm") + a1, b1, bounds, LIMIT, ALPHA)
    y_lib = fused_moe.expert_bias(grouped_linear(h, w2, bounds, "grouped_mm") + a2, b2, bounds)
    checks = [("fc1 vs float64", h, h_ref), ("fc2 vs float64", y, y_ref)]
    checks += [("fc1 vs library", h, h_lib), ("fc2 vs library", y, y_lib)]
    for name, ours, expected in checks:
        assert_rows_close(name, ours, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapter_factors_round_as_the_library_gpt_oss_width_gpu():
    """bf16 rank-32 adapter factors at gpt-oss-20b width (A [E, 32, 2880], then B [E, 5760, 32]) by
    `decode_grouped` against `torch._grouped_mm` on the same operands (B on the kernel's own x A^T) and
    against float64 rounded to bf16: against the library at most 1% of a row's values differ; against
    float64 (x A^T's rows are 32 values: one rounding flip is 3% of a row) at most 1% of all values and
    ||ours - ref|| / ||ref|| <= 2e-3 over the tensor."""
    x, w1, *_, bounds = gpt_oss_width_decode_inputs()
    g = torch.Generator(device="cuda").manual_seed(12)
    a = (torch.randn(32, 32, x.shape[1], generator=g, device="cuda") / x.shape[1] ** 0.5).bfloat16()
    b = torch.randn(32, w1.shape[1], 32, generator=g, device="cuda").bfloat16()
    xa = moe_decode.decode_grouped(x, a, bounds)
    xab = moe_decode.decode_grouped(xa, b, bounds)
    exact = moe_decode._grouped_reference(x.double(), a.double(), bounds).bfloat16()
    differ = (xa != exact).double().mean().item()
    print(f"x A^T vs float64: values differing {differ:.2e}, error {rel_err(xa, exact):.2e}")
    assert differ <= 0.01 and rel_err(xa, exact) <= 2e-3
    checks = [
        ("x A^T vs library", xa, grouped_linear(x, a, bounds, "grouped_mm")),
        ("(x A^T) B^T vs library", xab, grouped_linear(xa, b, bounds, "grouped_mm")),
    ]
    for name, ours, expected in checks:
        assert_rows_close(name, ours, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tma", [False, True])
def test_graph_replay_reads_bounds_on_the_device_gpu(tma):
    """Captured once, replayed on other routings of the same row count: each replay equals the eager call
    bit for bit (the bounds are read on the device only)."""
    counts = [[10, 0, 30, 24], [0, 64, 0, 0], [16, 16, 16, 16]]
    x, w1, b1, w2, b2, bounds = gpu_inputs(counts[0], 256, 192)
    x, w1, b1, w2, b2 = (t.bfloat16() for t in (x, w1, b1, w2, b2))
    static_x, static_bounds = x.clone(), bounds.clone()
    cfg = {
        g: dataclasses.replace(moe_decode.default_config(64, 4, x.device, torch.bfloat16, g), tma=tma)
        for g in (True, False)
    }

    def step():
        h = moe_decode.decode_fc1(static_x, w1, b1, static_bounds, LIMIT, ALPHA, cfg[True])
        return h, moe_decode.decode_fc2(h, w2, b2, static_bounds, cfg[False])

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, y = step()
    for i, c in enumerate(counts):
        static_x.copy_(torch.randn(x.shape, device=x.device) * (i + 1))
        static_bounds.copy_(bounds_of(c).cuda())
        graph.replay()
        expected_h, expected_y = step()
        assert torch.equal(h, expected_h)
        assert torch.equal(y, expected_y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_experts_take_the_decode_path_gpu(monkeypatch):
    """bf16 block on CUDA: the decode path in the decode scope under no_grad (not with gradients, not outside
    the scope), within 1e-2 of the library path."""
    experts = experts_pair(True).cuda().bfloat16()
    e, hidden = experts.num_experts, experts.linear_fc1.weight.shape[2]
    indices = torch.stack([torch.randperm(e)[:2] for _ in range(40)]).cuda()
    probs = torch.softmax(torch.randn(40, 2), dim=-1).cuda()
    x = torch.randn(40, hidden).cuda().bfloat16()
    assert not experts.decode_kernels(x)
    calls = []
    real = moe_decode.decode_fc1
    monkeypatch.setattr(moe_decode, "decode_fc1", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        assert not experts.decode_kernels(x)  # the learner's forwards: outside the decode scope
    with torch.no_grad(), moe_decode.decode_scope():
        assert experts.decode_kernels(x)
        decode = experts(x, probs, indices)
        assert calls
        monkeypatch.setattr(Experts, "decode_kernels", lambda self, x: False)
        library = experts(x, probs, indices)
    assert rel_err(decode, library) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("expert_format", ["bf16", "mxfp4"])
def test_experts_with_adapters_take_the_decode_path_gpu(expert_format, monkeypatch):
    """bf16 experts with active adapters (B random) on CUDA, float and MXFP4 weights: inside the decode scope
    under no_grad the decode kernels run with the adapters' updates as addends, within bf16 rounding of the
    learner's forward outside the scope (within 1e-2, as without adapters in
    `test_experts_take_the_decode_path_gpu`)."""
    experts = experts_pair(True, LoRAConfig(rank=8, alpha=8.0), expert_format).eval().cuda().bfloat16()
    x, probs, indices = (t.cuda() for t in routed_rows(experts, tokens=40))
    x = x.bfloat16()
    module, name = (
        (mxfp4_gemm, "fc1_swiglu_mxfp4") if expert_format == "mxfp4" else (moe_decode, "decode_fc1")
    )
    addends = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: addends.append(k.get("addend")) or real(*a, **k))
    with torch.no_grad():
        learner = experts(x, probs, indices)
        assert not addends
        with moe_decode.decode_scope():
            assert experts.decode_kernels(x)
            decode = experts(x, probs, indices)
        with adapters_disabled(experts):
            base = experts(x, probs, indices)
    assert len(addends) == 1 and addends[0] is not None
    differ = (decode != learner).double().mean().item()
    print(f"{expert_format}: values differing {differ:.2e}, error {rel_err(decode, learner):.2e}")
    assert rel_err(decode, learner) <= 1e-2
    assert rel_err(base, learner) > 5e-2


def test_only_the_engines_steps_enter_the_decode_scope(monkeypatch):
    """The embedded engine's forward steps (prefill and decode) run inside `decode_scope`; the learner's
    forward of the same model does not, so its experts never take the decode kernels."""
    seen: list[bool] = []
    real = Experts.decode_kernels
    monkeypatch.setattr(
        Experts, "decode_kernels", lambda self, x: seen.append(moe_decode.in_decode_scope()) or real(self, x)
    )
    learner = perturbed_learner(0)
    engine = engine_of(learner)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
    assert seen and all(seen)
    seen.clear()
    with torch.no_grad():
        learner.hidden_states(torch.tensor([[1, 2, 3]]))
    assert seen and not any(seen)
    assert not moe_decode.in_decode_scope()
