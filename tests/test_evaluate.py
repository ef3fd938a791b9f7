"""tools/evaluate.py: a tiny GPT-OSS with the real o200k_harmony vocabulary evaluated on GSM8K-format rows
with the embedded engine. Every sample line agrees with its completion (ids, text, parsed messages) and its
reward; the metrics agree with the lines; the samples do not depend on the batch size; a distributed
checkpoint of another layout (tp 2) evaluates to the same greedy completions as the HF directory it came
from; pass@k equals a brute-force count over every k-subset of the samples."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NUMBERS = [(3, 4), (8, 9), (12, 30)]
QUESTIONS = [f"Tom has {a} apples and buys {b} more. How many apples does he have?" for a, b in NUMBERS]


def parity_reward(messages, row):
    """A reward that varies with the completion (1 when its text has an even length, else 0.25), named
    `test_evaluate:parity_reward` and imported by the reward workers (the tests' directory is on their
    path)."""
    text = "".join(str(m.get("content") or "") for m in messages)
    return 1.0 if len(text) % 2 == 0 else 0.25


def _tool():
    spec = importlib.util.spec_from_file_location("evaluate_tool", ROOT / "tools" / "evaluate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _tool()


def harmony_babbler(model) -> None:
    """Make `model` sample, whatever the context, <|message|> (0.3), <|return|> (0.15) or a digit 1-5
    (0.11 each), so its completions parse into messages of varied content: every embedding carries 1000 on
    the first hidden dimension, which dominates the residual stream, so the final norm's output is about
    sqrt(hidden) there and nearly 0 elsewhere; the output layer reads only that dimension, giving those
    tokens logits of 20 + log(p) and every other token 0."""
    from megatron_gptoss.harmony import MESSAGE, RETURN, get_tokenizer

    digits = [get_tokenizer().encode(str(d)) for d in range(1, 6)]
    probs = {MESSAGE: 0.3, RETURN: 0.15, **{ids[0]: 0.11 for ids in digits if len(ids) == 1}}
    assert len(probs) == 7
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["embedding.word_embeddings.weight"][:, 0] = 1000.0
        params["decoder.final_layernorm.weight"].fill_(1.0)
        out = params["output_layer.weight"]
        out.zero_()
        for token, p in probs.items():
            out[token, 0] = (20.0 + math.log(p)) / math.sqrt(model.config.hidden_size)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two tiny HF checkpoints with the tokenizer's 201,088-entry vocabulary (random weights, and the
    harmony babbler), 3 GSM8K rows and a --config (HF configs do not carry the attention backend)."""
    from megatron_gptoss.config import gpt_oss_tiny
    from megatron_gptoss.hf.io import save_hf
    from megatron_gptoss.model.gpt_oss import build_model

    root = tmp_path_factory.mktemp("evaluate")
    config = gpt_oss_tiny(vocab_size=201088, make_vocab_size_divisible_by=128, max_position_embeddings=512)
    save_hf(build_model(config, seed=5), root / "hf")
    babbler = build_model(config, seed=6)
    harmony_babbler(babbler)
    save_hf(babbler, root / "babbler")
    data = root / "test.jsonl"
    with data.open("w") as f:
        for question, (a, b) in zip(QUESTIONS, NUMBERS):
            f.write(json.dumps({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    overrides = root / "eval.yaml"
    overrides.write_text(
        "model:\n  attention_backend: eager\nreward:\n  workers: 1\nrun:\n  num_threads: 2\n"
    )  # noqa: E501
    return root, data, overrides


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(tool, files, out: str, *extra: str) -> tuple[dict, list[dict]]:
    root, data, overrides = files
    args = ["--data", str(data), "--engine", "embedded", "--max-new-tokens", "8", "--config", str(overrides)]
    metrics = tool.main([*args, "--output", str(root / out), "--no-progress", *extra])
    return metrics, lines(root / out)


@pytest.fixture(scope="module")
def sampled(tool, files):
    root = files[0]
    extra = ["--checkpoint", str(root / "babbler"), "--samples", "2", "--temperature", "1.0", "--seed", "7"]
    extra += ["--reward", "test_evaluate:parity_reward"]
    metrics, samples = run(tool, files, "samples.jsonl", *extra)
    _, one_by_one = run(tool, files, "one.jsonl", *extra, "--batch-size", "1")
    return metrics, samples, one_by_one


def test_sample_lines_hold_each_completion_and_its_reward(sampled, files):
    from megatron_gptoss.harmony import get_tokenizer, parse_completion, stop_token_ids

    _, samples, _ = sampled
    assert [(s["row"], s["sample"]) for s in samples] == list(itertools.product(range(3), range(2)))
    tokenizer = get_tokenizer()
    for s in samples:
        assert s["prompt"] == [{"role": "user", "content": QUESTIONS[s["row"]]}]
        assert s["data_source"] == "openai/gsm8k" and s["file"] == str(files[1]) and s["file_row"] == s["row"]
        ids = s["completion_ids"]
        assert 1 <= s["num_tokens"] == len(ids) <= 8
        assert s["completion"] == tokenizer.decode(ids)
        parsed = parse_completion(ids)
        assert s["messages"] == [dict(m) for m in parsed] and s["parse_error"] == parsed.error
        assert s["finish_reason"] == ("stop" if ids[-1] in stop_token_ids() else "length")
        assert s["reward"] == parity_reward(s["messages"], {}) and s["correct"] == (s["reward"] >= 1.0)
        assert s["reward_error"] is None
    # the two samples of a prompt come from different streams
    assert any(samples[2 * r]["completion_ids"] != samples[2 * r + 1]["completion_ids"] for r in range(3))


def test_metrics_agree_with_the_samples(sampled, files):
    metrics, samples, _ = sampled
    written = json.loads((files[0] / "samples.metrics.json").read_text())
    assert written == json.loads(json.dumps(metrics))
    correct = [float(s["correct"]) for s in samples]
    assert 0 < sum(correct) < len(correct), "the check needs a mix of correct and incorrect samples"
    assert metrics["prompts"] == 3 and metrics["samples_per_prompt"] == 2 and metrics["samples"] == 6
    assert metrics["correct_samples"] == sum(correct)
    assert metrics["pass@1"] == pytest.approx(sum(correct) / 6, abs=1e-12)
    any_correct = [max(correct[2 * r], correct[2 * r + 1]) for r in range(3)]
    assert metrics["pass@2"] == pytest.approx(sum(any_correct) / 3, abs=1e-12)
    assert metrics["reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 6, abs=1e-12)
    assert metrics["reward_errors"] == 0 and metrics["reward_timeouts"] == 0
    assert sum(metrics["finish_reasons"].values()) == 6
    assert metrics["by_data_source"]["openai/gsm8k"]["pass@1"] == pytest.approx(metrics["pass@1"])
    assert metrics["kind"] == "hf" and metrics["sampling"]["seed"] == 7 and metrics["sampling"]["top_k"] == 0


def test_samples_do_not_depend_on_the_batch_size(sampled):
    _, samples, one_by_one = sampled
    assert [s["completion_ids"] for s in one_by_one] == [s["completion_ids"] for s in samples]


def test_distributed_checkpoint_of_another_layout_matches_the_hf_directory(tool, files):
    from megatron_gptoss.checkpoint.dist_convert import hf_to_dist
    from megatron_gptoss.config import ParallelConfig

    root = files[0]
    hf_to_dist(root / "hf", root / "dist", ParallelConfig(tensor_model_parallel_size=2), 2, progress=False)
    greedy = ["--greedy", "--limit", "2", "--reward", "gsm8k"]
    from_hf, hf_samples = run(tool, files, "hf.jsonl", "--checkpoint", str(root / "hf"), *greedy)
    from_dist, dist_samples = run(tool, files, "dist.jsonl", "--checkpoint", str(root / "dist"), *greedy)
    assert from_dist["kind"] == "distributed" and from_dist["step"] == 0 and from_dist["prompts"] == 2
    assert [s["completion_ids"] for s in dist_samples] == [s["completion_ids"] for s in hf_samples]
    assert from_dist["pass@1"] == from_hf["pass@1"] and from_dist["sampling"]["top_k"] == 1


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_is_the_unbiased_estimator(tool):
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = float(brute_force(n, c, k))
                assert tool.pass_at_k(n, c, k) == expected, (n, c, k)  # both correctly rounded
    assert tool.pass_at_k(100, 3, 1) == 0.03 and tool.pass_at_k(100, 0, 100) == 0.0
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            tool.pass_at_k(*bad)


def test_a_run_with_a_critic_and_a_reward_kl_evaluates_without_them(tool, tmp_path):
    """The run's config names gae and an adaptive KL penalty in the reward; evaluation builds the policy
    alone (no critic, no reference policy)."""
    import argparse
    import dataclasses

    from megatron_gptoss.config import gpt_oss_tiny
    from megatron_gptoss.harmony import VOCAB_SIZE

    model = dataclasses.asdict(gpt_oss_tiny(vocab_size=VOCAB_SIZE))
    algorithm = {"advantage": "gae", "kl_in_reward_coef": 0.1, "kl_ctrl": "adaptive"}
    manifest = {"model": model, "config": {"algorithm": algorithm, "ppo": {"kl_coef": 0.2}}}
    source = tool.Source("distributed", tmp_path, manifest)
    flags = dict(config=None, engine=None, temperature=None, top_p=None, top_k=None, max_new_tokens=None)
    args = argparse.Namespace(**flags, greedy=True, reward=None, data=[str(tmp_path / "rows.jsonl")])
    cfg = tool.make_config(source, args)
    assert cfg.algorithm.advantage == "grpo" and cfg.algorithm.kl_in_reward_coef == 0.0
    assert cfg.ppo.kl_coef == 0.0


def test_a_lora_checkpoint_evaluates_as_its_merged_export(tool, files, tmp_path):
    """An adapters-only checkpoint of a LoRA run started from the HF directory: evaluation rebuilds the base
    from that directory and applies the adapters; its greedy completions equal those of the checkpoint's
    merged HF export (tools/convert_dist_to_hf.py), and differ from the base's own."""
    import dataclasses

    import torch.distributed as dist

    from megatron_gptoss.checkpoint.distributed import DistributedCheckpointer, RunState
    from megatron_gptoss.checkpoint.manager import CheckpointManager
    from megatron_gptoss.config import ParallelConfig
    from megatron_gptoss.config.lora import LoRAConfig
    from megatron_gptoss.hf.io import read_config
    from megatron_gptoss.model.gpt_oss import GPTOSSModel
    from megatron_gptoss.model.lora import adapters
    from megatron_gptoss.parallel.apply import parallelize
    from megatron_gptoss.parallel.dims import ParallelDims
    from megatron_gptoss.parallel.loading import load_hf_parallel

    root = files[0]
    config = dataclasses.replace(
        read_config(root / "hf", make_vocab_size_divisible_by=128, attention_backend="eager"),
        lora=LoRAConfig(rank=2, alpha=4.0),
    )
    run_config = {"run": {"init_from_hf": str(root / "hf"), "seed": 0}, "model": dataclasses.asdict(config)}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        dims = ParallelDims.build(ParallelConfig(), config)
        model = parallelize(GPTOSSModel(config), dims, ParallelConfig())
        load_hf_parallel([model], root / "hf", dims, config)
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for m in adapters(model):
                m.a.copy_(torch.randn(m.a.shape, generator=gen))
                m.b.copy_(torch.randn(m.b.shape, generator=gen))
        checkpoints = CheckpointManager(tmp_path / "checkpoints")
        group = dist.new_group(backend="gloo")
        DistributedCheckpointer(checkpoints, dims, config, group, run_config=run_config).save(
            1, {"model": [model]}, None, RunState(1)
        )
    finally:
        dist.destroy_process_group()
    step = tmp_path / "checkpoints" / "step_000001"
    convert = importlib.util.spec_from_file_location(
        "convert_dist_to_hf", ROOT / "tools" / "convert_dist_to_hf.py"
    )
    assert convert is not None and convert.loader is not None
    converter = importlib.util.module_from_spec(convert)
    convert.loader.exec_module(converter)
    converter.main([str(step), str(tmp_path / "merged"), "--dtype", "float32", "--no-verify"])
    greedy = ["--greedy", "--limit", "2", "--reward", "gsm8k"]
    _, lora_samples = run(tool, files, "lora.jsonl", "--checkpoint", str(step), *greedy)
    _, merged_samples = run(tool, files, "merged.jsonl", "--checkpoint", str(tmp_path / "merged"), *greedy)
    _, base_samples = run(tool, files, "base.jsonl", "--checkpoint", str(root / "hf"), *greedy)
    assert [s["completion_ids"] for s in lora_samples] == [s["completion_ids"] for s in merged_samples]
    assert [s["completion_ids"] for s in lora_samples] != [s["completion_ids"] for s in base_samples]
