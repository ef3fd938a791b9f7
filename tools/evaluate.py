"""Evaluate a checkpoint on held-out prompt files: pass@1, pass@k and the mean reward, every sample as JSONL.

    python tools/evaluate.py --checkpoint /models/gpt-oss-20b --data gsm8k_test.parquet --reward gsm8k \\
        --samples 8 --temperature 1.0 --max-new-tokens 1024 --output evals/gsm8k.jsonl
    python tools/evaluate.py --checkpoint outputs/run/checkpoints/step_000200 --greedy --output s.jsonl
    python tools/evaluate.py --checkpoint outputs/run/checkpoints --engine vllm --samples 4 --output s.jsonl

--checkpoint is an HF GPT-OSS directory (config.json + safetensors, bf16 or MXFP4 experts), a run's
distributed checkpoint (`run.output_dir/checkpoints/step_N`, any layout), or a checkpoint root holding
`latest` (its newest checkpoint whose checksums verify).

    HF directory     the model config from config.json; the engine takes the HF tensors as they stream from
                     the shards (`engine.update_weights`), as the trainer's bridge sends them
    distributed      the model and run config from its manifest; loaded at world 1 into the learner's stage
                     models (`trainer.colocated.Colocated`, `DistributedCheckpointer.load`: any saved layout
                     reshards), then synced into the engine through the bridge, as the trainer does. Peak
                     memory: the learner's copy of the weights plus the engine's. A LoRA run's checkpoint
                     (adapters only) gets its base from the source the run started from first
                     (`run.init_from_hf`, or the seed's random initialisation).

Settings, later ones winning: the checkpoint's (a run's config, or the defaults and config.json for an HF
directory), the --config YAML (sections as in the trainer's YAML: model fields config.json does not carry,
data.format / system_prompt / reasoning_effort / max_prompt_tokens, reward.workers / timeout_s /
format_weight, rollout.dtype / tensor_parallel_size, ...), then the flags. Unset flags fall back to the run's
`rollout` section (temperature, top-p, top-k, max new tokens, engine), `data.eval_files` and `reward.name`.
Prompts are rendered in harmony as the trainer renders them and stop at <|return|> / <|call|>.

Every prompt is sampled --samples (n) times; sample j of prompt r is row r * n + j of the evaluation and
samples from its own stream (--seed + that row), so the samples do not depend on --batch-size. --greedy (or
--temperature 0) decodes with top-k 1. A sample is correct when its reward reaches 1 (as in training).

    pass@1        mean over prompts of the fraction of their samples that are correct
    pass@k        mean over prompts of 1 - C(n - c, k) / C(n, k) (c correct of n): the unbiased estimate of
                  the chance that k samples hold a correct one; reported for k = 1, n and every --pass-k
    reward_mean   mean reward over all samples; reward_errors / reward_timeouts: samples whose reward
                  raised or ran past reward.timeout_s (they score 0)

Writes one JSON line per sample to --output (row, sample, file, file_row, data_source, the prompt messages,
ground_truth, completion text and ids, parsed messages, parse_error, reward, correct, reward_error,
finish_reason, num_tokens) and the metrics to `<output stem>.metrics.json` beside it; prints a table.

Bad input (a missing or corrupt checkpoint, a tensor holding NaN or inf, an --output that names a
directory, a --config that is not YAML) ends in one line naming it and exit status 1, before any model is
built where it can be seen then.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from megatron_gptoss.checkpoint.distributed import DistributedCheckpointer
from megatron_gptoss.checkpoint.manager import LATEST, MANIFEST, CheckpointManager, read_manifest
from megatron_gptoss.config import TrainConfig, build_config
from megatron_gptoss.data import PromptDataset, PromptRow
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.harmony import VOCAB_SIZE, get_tokenizer, parse_completion, render_prompt, stop_token_ids
from megatron_gptoss.hf.io import CONFIG_FILE, check_hf_config, iter_checkpoint, read_config
from megatron_gptoss.rewards import RewardScorer
from megatron_gptoss.trainer.colocated import Colocated
from megatron_gptoss.trainer.engines import DTYPES
from megatron_gptoss.trainer.session import session
from megatron_gptoss.utils.cli import one_line_errors

log = logging.getLogger("evaluate")


# ------------------------------------------------------------------------------------------------
# Metrics
def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate 1 - C(n - c, k) / C(n, k) that k of n samples, c of them correct, hold a
    correct one: (C(n, k) - C(n - c, k)) / C(n, k) in exact integers, one correctly rounded division."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def summarise(
    correct: Sequence[int], n: int, ks: Sequence[int], rewards: Sequence[float]
) -> dict[str, float]:
    """pass@k for every k in `ks` (correct[r]: correct samples of prompt r, of n each) and the mean reward."""
    out = {f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks}
    out["reward_mean"] = sum(rewards) / len(rewards)
    return out


# ------------------------------------------------------------------------------------------------
# Checkpoint and configuration
@dataclasses.dataclass(frozen=True)
class Source:
    """What --checkpoint names: an HF directory, or a distributed checkpoint's step directory."""

    kind: str  # "hf" or "distributed"
    path: Path
    manifest: dict[str, Any] | None = None  # the distributed checkpoint's manifest


def locate(path: Path, verify: bool) -> Source:
    """The checkpoint `path` names; a root with `latest` resolves to its newest verified checkpoint, a step
    directory has its checksums checked first when `verify`."""
    if (path / CONFIG_FILE).is_file():
        return Source("hf", path)
    if (path / LATEST).is_file():
        found = CheckpointManager(path).find_resumable()
        if found is None:
            raise ConfigError(f"{path} holds no complete, verified checkpoint")
        return Source("distributed", found, read_manifest(found))
    if (path / MANIFEST).is_file():
        manifest = CheckpointManager.verify(path) if verify else read_manifest(path)
        return Source("distributed", path, manifest)
    raise ConfigError(
        f"--checkpoint {path}: neither an HF directory ({CONFIG_FILE}), a checkpoint step directory "
        f"({MANIFEST}) nor a checkpoint root ({LATEST})"
    )


def read_overrides(path: str | None) -> dict[str, Any]:
    """The sections of the --config YAML (empty without one)."""
    if not path:
        return {}
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"--config {path}: {err}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict | None) for v in raw.values()):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
    return raw


def make_config(source: Source, args: argparse.Namespace) -> TrainConfig:
    """The checkpoint's settings <- the --config YAML <- the flags, at world 1 (module docstring)."""
    if source.kind == "hf":
        raw: dict[str, Any] = {"model": dataclasses.asdict(read_config(source.path))}
    else:
        assert source.manifest is not None
        raw = {k: dict(v) for k, v in (source.manifest.get("config") or {}).items() if isinstance(v, dict)}
        raw["model"] = dict(source.manifest["model"])
    for section, values in read_overrides(args.config).items():
        raw.setdefault(section, {}).update(values or {})
    raw["model"].pop("preset", None)  # every field is given: the preset only names the defaults
    raw["parallel"] = {}  # world 1: one rank holds the whole learner
    ppo, rollout, reward, data = (raw.setdefault(name, {}) for name in ("ppo", "rollout", "reward", "data"))
    ppo["kl_coef"] = 0.0  # no reference policy
    # neither a reference policy nor a critic: evaluation trains nothing
    raw.setdefault("algorithm", {}).update(advantage="grpo", kl_in_reward_coef=0.0, kl_ctrl="fixed")
    for flag, key in (("engine", "engine"), ("temperature", "temperature"), ("top_p", "top_p"),
                      ("top_k", "top_k"), ("max_new_tokens", "max_new_tokens")):  # fmt: skip
        if getattr(args, flag) is not None:
            rollout[key] = getattr(args, flag)
    if args.greedy:
        rollout.update(temperature=1.0, top_k=0, top_p=1.0)  # top-k 1 goes into the sampling only
    if rollout.get("engine", "embedded") == "embedded":
        rollout.update(tensor_parallel_size=1, expert_parallel_size=1)
    if args.reward is not None:
        reward["name"] = args.reward
    if args.data:
        data["eval_files"] = list(args.data)
    cfg = build_config(raw)
    if source.kind == "hf":
        check_hf_config(source.path, cfg.model)  # --config may not change the shapes
    if cfg.model.vocab_size < VOCAB_SIZE:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} < o200k_harmony's {VOCAB_SIZE}")
    if not cfg.data.eval_files:
        raise ConfigError("no prompt files: pass --data (or a run whose data.eval_files names some)")
    return cfg


# ------------------------------------------------------------------------------------------------
# Engines
@contextmanager
def open_engine(source: Source, cfg: TrainConfig) -> Iterator[Any]:
    """An engine (`generate(prompts, params)`) holding the checkpoint's weights, shut down at the end."""
    with session(cfg.run) as run_session:
        device = run_session.device
        if source.kind == "hf":
            engine = hf_engine(cfg, device)
            dtype = DTYPES[cfg.rollout.dtype]
            engine.update_weights((n, t.to(dtype)) for n, t in iter_checkpoint(source.path, cfg.model, dtype))
        else:  # the trainer's learner and engine; the checkpoint into the learner, the bridge into the engine
            engine = Colocated(cfg, device, with_engine=True)
            if cfg.model.lora.enabled:  # the checkpoint holds the adapters: the base from its source first
                engine.initialise()
            checkpointer = DistributedCheckpointer(
                CheckpointManager(source.path.parent),
                engine.dims,
                cfg.model,
                dist.new_group(backend="gloo"),
                run_config=(source.manifest or {}).get("config") or {},
            )
            checkpointer.load(source.path, {"model": engine.models}, None)
            engine.sync()
        try:
            yield engine
        finally:
            engine.shutdown()


def hf_engine(cfg: TrainConfig, device: torch.device) -> Any:
    """The engine `rollout.engine` names, with unset weights, built as the trainer's hosts build theirs."""
    if cfg.rollout.engine == "vllm":  # an optional dependency: imported where it is used
        from megatron_gptoss.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            cfg.model,
            tensor_parallel_size=cfg.rollout.tensor_parallel_size,
            dtype=cfg.rollout.dtype,
            seed=cfg.run.seed + 1,
            max_model_len=cfg.model.max_position_embeddings,
            bucket_bytes=cfg.rollout.bucket_size_mb << 20,
        )
    from megatron_gptoss.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(cfg.model, DTYPES[cfg.rollout.dtype], device, cfg.run.seed, cfg.embedded)


# ------------------------------------------------------------------------------------------------
# Evaluation
def held_out(cfg: TrainConfig, limit: int, batch: int) -> tuple[Iterator[list[PromptRow]], int, dict]:
    """Batches of the first `limit` rows (0: all) of `data.eval_files` in file order, their number and the
    files' statistics (rows read, kept, filtered as too long, truncated)."""
    dataset = PromptDataset(cfg.data, render_prompt, split="eval")
    total = min(limit, len(dataset)) if limit else len(dataset)

    def batches() -> Iterator[list[PromptRow]]:
        left = total
        for rows in dataset.batches(batch):
            if left <= 0:
                return
            yield rows[:left]
            left -= len(rows)

    return batches(), total, dict(dataset.stats)


def sample_record(row: PromptRow, r: int, j: int, generation: Any, reward: float, error: str | None) -> dict:
    """One JSON line: the prompt, the completion (text, ids, parsed messages) and its score."""
    ids = list(generation.token_ids)
    parsed = parse_completion(ids)
    try:
        text = get_tokenizer().decode(ids)
    except ValueError:  # an id beyond the tokenizer (a padded vocabulary entry): left out of the text
        text = get_tokenizer().decode([i for i in ids if 0 <= i < VOCAB_SIZE])
    return {
        "row": r,
        "sample": j,
        "file": row.file,
        "file_row": row.index,
        "data_source": row.data_source,
        "prompt": row.messages,
        "ground_truth": row.ground_truth,
        "completion": text,
        "completion_ids": ids,
        "messages": [dict(m) for m in parsed],
        "parse_error": parsed.error,
        "reward": reward,
        "correct": reward >= 1.0,
        "reward_error": error,
        "finish_reason": generation.finish_reason,
        "num_tokens": len(ids),
    }


def run_evaluation(engine: Any, cfg: TrainConfig, args: argparse.Namespace, out) -> dict[str, Any]:
    """Generate, score and write every sample (to the open file `out`); the metrics."""
    n, greedy = args.samples, args.greedy
    params = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=1 if greedy else cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=stop_token_ids(),
    )
    if greedy and n > 1:
        log.warning("greedy decoding gives %d identical samples of every prompt", n)
    batches, total, stats = held_out(cfg, args.limit, args.batch_size)
    correct: list[int] = []
    rewards: list[float] = []
    prompt_rewards: list[float] = []  # each prompt's mean reward
    finish: Counter[str] = Counter()
    by_source: dict[str, list[tuple[int, float]]] = {}
    errors = timeouts = well_formed = tokens = 0
    with (
        RewardScorer(cfg.reward) as scorer,
        tqdm(total=total, unit="prompt", disable=not args.progress) as bar,
    ):
        for rows in batches:
            first = len(correct)
            prompts = [list(row.token_ids) for row in rows for _ in range(n)]
            seed = args.seed + first * n  # row i of the evaluation samples with seed + i
            generations = engine.generate(prompts, dataclasses.replace(params, seed=seed))
            parsed = [[dict(m) for m in parse_completion(list(g.token_ids))] for g in generations]
            scores, metrics = scorer.score_batch(parsed, [row.reward_row() for row in rows for _ in range(n)])
            failed = dict(scorer.last_errors)
            errors += len(failed)
            timeouts += int(metrics.get("reward/timeouts", 0))
            for i, (generation, reward) in enumerate(zip(generations, scores)):
                r, j = first + i // n, i % n
                record = sample_record(rows[i // n], r, j, generation, float(reward), failed.get(i))
                out.write(json.dumps(record, default=str) + "\n")
                if j == 0:
                    correct.append(0)
                    prompt_rewards.append(0.0)
                correct[-1] += record["correct"]
                prompt_rewards[-1] += record["reward"] / n
                rewards.append(record["reward"])
                finish[record["finish_reason"]] += 1
                well_formed += record["parse_error"] is None
                tokens += record["num_tokens"]
            for k, row in enumerate(rows):
                by_source.setdefault(row.data_source, []).append(
                    (correct[first + k], prompt_rewards[first + k])
                )
            bar.update(len(rows))
    ks = sorted({1, n, *args.pass_k})
    metrics = {
        "prompts": len(correct),
        "samples_per_prompt": n,
        "samples": len(rewards),
        **summarise(correct, n, ks, rewards),
        "reward_errors": errors,
        "reward_timeouts": timeouts,
        "correct_samples": sum(correct),
        "format_ok": well_formed / len(rewards),
        "completion_tokens_mean": tokens / len(rewards),
        "finish_reasons": dict(sorted(finish.items())),
        "by_data_source": {
            name: {
                "prompts": len(group),
                "pass@1": sum(c for c, _ in group) / (n * len(group)),
                "reward_mean": sum(m for _, m in group) / len(group),
            }
            for name, group in sorted(by_source.items())
        },
        "data_stats": stats,
    }
    metrics["sampling"] = {**dataclasses.asdict(params), "greedy": greedy, "seed": args.seed}
    return metrics


# ------------------------------------------------------------------------------------------------
# Command line
def metrics_path(output: Path) -> Path:
    """`<output stem>.metrics.json` beside the samples (samples.jsonl -> samples.metrics.json)."""
    stem = output.name.removesuffix(".jsonl")
    return output.with_name(stem + ".metrics.json")


def check_output(output: Path) -> None:
    """ConfigError unless the samples (`output`) and the metrics beside them can be written as files:
    neither names a directory, and the nearest existing folder above them is a directory (the missing ones
    are made before the engine starts)."""
    for path in (output, metrics_path(output)):
        if path.is_dir():
            raise ConfigError(f"--output {output}: {path} is a directory; name a file (samples.jsonl)")
    above = next(p for p in output.absolute().parents if p.exists())
    if not above.is_dir():
        raise ConfigError(f"--output {output}: {above} is not a directory")


def table(metrics: dict[str, Any]) -> str:
    """The metrics as a small two-column table."""
    lines = [
        ("checkpoint", f"{metrics['checkpoint']} ({metrics['kind']})"),
        ("data", ", ".join(metrics["data"])),
        ("prompts x samples", f"{metrics['prompts']} x {metrics['samples_per_prompt']}"),
    ]
    lines += [(key, f"{value:.4f}") for key, value in metrics.items() if key.startswith("pass@")]
    lines += [
        ("reward mean", f"{metrics['reward_mean']:.4f}"),
        ("reward errors / timeouts", f"{metrics['reward_errors']} / {metrics['reward_timeouts']}"),
        ("format ok", f"{metrics['format_ok']:.4f}"),
        ("tokens / completion", f"{metrics['completion_tokens_mean']:.1f}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in metrics["finish_reasons"].items())),
    ]
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="HF directory, checkpoint step directory or root")
    parser.add_argument("--data", nargs="+", help="held-out .jsonl / .parquet files (verl or GSM8K rows)")
    parser.add_argument("--reward", help="gsm8k, ifeval, format or module:function (default: reward.name)")
    parser.add_argument("--engine", choices=["embedded", "vllm"], help="default: rollout.engine")
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt (n)")
    parser.add_argument(
        "--pass-k", type=int, nargs="*", default=[], help="more k (<= n) to report pass@k for"
    )
    parser.add_argument("--temperature", type=float, help="0: greedy (default: rollout.temperature)")
    parser.add_argument("--top-p", type=float, help="default: rollout.top_p")
    parser.add_argument("--top-k", type=int, help="default: rollout.top_k")
    parser.add_argument("--greedy", action="store_true", help="decode with top-k 1")
    parser.add_argument("--max-new-tokens", type=int, help="default: rollout.max_new_tokens")
    parser.add_argument("--limit", type=int, default=0, help="first rows of the files only (0: all)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed: row i samples with seed + i")
    parser.add_argument("--output", required=True, help="samples JSONL (metrics: <stem>.metrics.json)")
    parser.add_argument("--config", help="YAML of setting overrides (trainer sections)")
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip the checksums")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch_size < 1 or args.limit < 0:
        parser.error("--samples and --batch-size must be >= 1, --limit >= 0")
    if args.temperature is not None and args.temperature < 0:
        parser.error("--temperature must be >= 0")
    args.greedy = args.greedy or args.temperature == 0
    bad = [k for k in args.pass_k if not 1 <= k <= args.samples]
    if bad:
        parser.error(f"--pass-k {bad}: every k must be in 1..--samples ({args.samples})")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Evaluate; returns the metrics (also written beside the samples)."""
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError("tools/evaluate.py runs in one process (world 1), not under torchrun / srun")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    output = Path(args.output)
    check_output(output)
    source = locate(Path(args.checkpoint), args.verify)
    cfg = make_config(source, args)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open_engine(source, cfg) as engine, output.open("w") as out:
        metrics = run_evaluation(engine, cfg, args, out)
    metrics = {
        "checkpoint": str(source.path),
        "kind": source.kind,
        "step": source.manifest.get("step") if source.manifest else None,
        "data": list(cfg.data.eval_files),
        "reward": cfg.reward.name,
        "engine": cfg.rollout.engine,
        **metrics,
        "seconds": time.perf_counter() - start,
    }
    metrics_path(output).write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    print(table(metrics))
    print(f"samples: {output}\nmetrics: {metrics_path(output)}", file=sys.stderr)
    return metrics


if __name__ == "__main__":
    with one_line_errors():
        main()
