"""benchmarks/bench_rollout.py at toy size on the CPU: the synthetic MXFP4 checkpoint loads, every part runs
and reports what it measures, the schedule check passes."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_rollout  # noqa: E402

from megatron_gptoss.hf.io import iter_checkpoint  # noqa: E402
from megatron_gptoss.hf.mxfp4 import FP4_MAGNITUDES  # noqa: E402


def test_synthetic_checkpoint_has_the_released_layout(tmp_path):
    config = bench_rollout.tiny_config()
    path = bench_rollout.write_synthetic_mxfp4(config, tmp_path / "ckpt")
    tensors = dict(iter_checkpoint(path, config, torch.float32))
    gate_up = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (config.num_experts, config.hidden_size, 2 * config.intermediate_size)
    grid = torch.tensor(FP4_MAGNITUDES) * 2.0**-7  # every value is an FP4 code at scale 2^-7
    assert torch.isin(gate_up.abs().unique(), grid).all() and gate_up.std() > 0.005


def test_every_part_runs_at_toy_size(tmp_path):
    args = ["--tiny", "--ckpt", str(tmp_path), "--slots", "2", "--decode-steps", "3"]
    args += ["--prompts-per-slot", "2", "--max-response", "20"]
    rows = bench_rollout.main(["--part", "all", *args])
    by_part = {r["part"]: r for r in rows}
    assert by_part["check"]["tokens_equal"] and by_part["check"]["max_logprob_delta"] <= 1e-5
    assert by_part["decode"]["step_ms"] > 0 and by_part["decode"]["gbytes_read"] > 0
    assert by_part["prefill"]["tflops"] > 0
    workload = [r for r in rows if r["part"] == "workload"]
    assert [r["schedule"] for r in workload] == ["continuous", "static"]
    assert all(r["tokens_per_s"] > 0 and r["response_max"] <= 20 for r in workload)
    assert by_part["slice"]["slots"] == 2


@pytest.mark.parametrize("batch, hit", [(1, 2), (1000, 8)])
def test_roofline_counts_the_experts_a_batch_hits(batch, hit):
    config = bench_rollout.tiny_config()  # 8 experts, top-2
    h, i = config.hidden_size, config.intermediate_size
    per_expert = 3 * h * i + 2 * i + h
    few, many = (bench_rollout.decode_bytes(config, b, 0, 1, 1) for b in (batch, batch + 1))
    base = bench_rollout.decode_bytes(config, 1, 0, 1, 1) - config.num_layers * 2 * per_expert
    assert round((few - base) / (config.num_layers * per_expert), 3) == pytest.approx(hit, abs=0.01)
    assert many >= few


def test_decode_with_adapters_counts_their_bytes(tmp_path):
    """--lora-rank gives the engine adapters (B drawn, not zero); the roofline adds their bytes."""
    args = ["--tiny", "--part", "decode", "--ckpt", str(tmp_path), "--slots", "2", "--decode-steps", "3"]
    (plain,) = bench_rollout.main(args)
    (adapted,) = bench_rollout.main([*args, "--lora-rank", "4"])
    assert plain["lora_rank"] == 0 and adapted["lora_rank"] == 4 and adapted["step_ms"] > 0
    config = bench_rollout.tiny_config()
    h, i, e, layers = config.hidden_size, config.intermediate_size, config.num_experts, config.num_layers
    qkv = config.num_attention_heads * config.head_dim + 2 * config.num_query_groups * config.head_dim
    per_layer = (h + qkv) + (config.num_attention_heads * config.head_dim + h) + e * (h + 2 * i) + e * (i + h)
    adapter_bytes = 4 * 4 * layers * per_layer  # rank 4, fp32 on the CPU
    assert (adapted["gbytes_read"] - plain["gbytes_read"]) * 1e9 == pytest.approx(adapter_bytes)


def test_decode_per_expert_format_names_each_row(tmp_path):
    """--expert-format bf16,mxfp4,mxfp4-pairs,mxfp4-tiled: one engine a format, each row named by it, the
    MXFP4 ones reading 4.25 bits an expert value whatever their byte format and layout; an unknown format
    is refused."""
    args = ["--tiny", "--part", "decode", "--ckpt", str(tmp_path), "--slots", "2", "--decode-steps", "3"]
    rows = bench_rollout.main([*args, "--expert-format", "bf16,mxfp4,mxfp4-pairs,mxfp4-tiled"])
    assert [r["format"] for r in rows] == ["bf16", "mxfp4", "mxfp4-pairs", "mxfp4-tiled"]
    assert rows[1]["gbytes_read"] == rows[2]["gbytes_read"] == rows[3]["gbytes_read"] < rows[0]["gbytes_read"]
    assert all(r["step_ms"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        bench_rollout.main([*args, "--expert-format", "nf4"])


def test_prefill_per_expert_format_names_each_row(tmp_path):
    """--part prefill --expert-format bf16,mxfp4-pairs: one prefill timed per format, each row named by it."""
    args = ["--tiny", "--part", "prefill", "--ckpt", str(tmp_path), "--slots", "2"]
    rows = bench_rollout.main([*args, "--expert-format", "bf16,mxfp4-pairs"])
    assert [(r["part"], r["format"]) for r in rows] == [("prefill", "bf16"), ("prefill", "mxfp4-pairs")]
    assert all(r["seconds"] > 0 and r["tflops"] > 0 for r in rows)


def test_workload_per_expert_format_and_admission(tmp_path):
    """--part workload --expert-format bf16,mxfp4-pairs --admit-batch 1,4: one engine a format, each run with
    every admission setting, named by both; the same tokens under either setting, in fewer steps that
    prefill when prompts join four at a time."""
    args = [
        "--tiny",
        "--part",
        "workload",
        "--ckpt",
        str(tmp_path),
        "--slots",
        "4",
        "--runs",
        "continuous:off",
    ]
    rows = bench_rollout.main([*args, "--expert-format", "bf16,mxfp4-pairs", "--admit-batch", "1,4"])
    assert [(r["format"], r["admit_batch"]) for r in rows] == [
        ("bf16", 1), ("bf16", 4), ("mxfp4-pairs", 1), ("mxfp4-pairs", 4)
    ]  # fmt: skip
    for one, four in (rows[:2], rows[2:]):
        assert four["prefill_steps"] < one["prefill_steps"] and one["prefill_s"] > 0
        assert four["tokens_per_s"] > 0 and one["decode_step_ms"] > 0


def test_workload_with_and_without_graphs_of_steps_that_prefill(tmp_path):
    """--graph-tokens 0,64: each run named by embedded.cuda_graph_max_tokens, both generating every row's
    budget (the bucketed buffers run eagerly on the CPU: `--runs continuous:padded`)."""
    args = ["--tiny", "--part", "workload", "--ckpt", str(tmp_path), "--slots", "4"]
    rows = bench_rollout.main([*args, "--runs", "continuous:padded", "--graph-tokens", "0,64"])
    assert [(r["graphs"], r["graph_tokens"]) for r in rows] == [("padded", 0), ("padded", 64)]
    assert all(r["prefill_steps"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["tokens_per_s"] * rows[0]["seconds"] == pytest.approx(
        rows[1]["tokens_per_s"] * rows[1]["seconds"]
    )


def test_workload_is_timed_after_a_short_untimed_run(tmp_path, monkeypatch):
    """--warmup-response 5: each setting generates the same prompts with budgets capped at 5 first, then
    releases the cache, then times the full budgets; 0: the timed run alone."""
    calls = []
    generate = bench_rollout.TimedEngine.generate

    def spy(self, prompts, params, max_new_tokens=None):
        budgets = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else list(max_new_tokens)
        calls.append((len(prompts), budgets, self._cache is None))
        return generate(self, prompts, params, max_new_tokens)

    monkeypatch.setattr(bench_rollout.TimedEngine, "generate", spy)
    args = ["--tiny", "--part", "workload", "--ckpt", str(tmp_path), "--slots", "2"]
    args += ["--runs", "continuous:off"]
    rows = bench_rollout.main([*args, "--warmup-response", "5"])
    warm, timed = calls[-2:]
    assert warm[0] == timed[0] == rows[0]["prompts"] == 8
    assert warm[1] == [min(b, 5) for b in timed[1]] and max(timed[1]) > 5
    assert timed[2], "the timed run starts with the cache released"
    assert rows[0]["warmup_response"] == 5 and rows[0]["tokens_per_s"] > 0
    calls.clear()
    rows = bench_rollout.main([*args, "--warmup-response", "0"])
    assert len(calls) == 2 and max(calls[-1][1]) > 5  # the build's warm-up, then the timed run only
    assert rows[0]["warmup_response"] == 0
