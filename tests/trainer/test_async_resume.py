"""A run with `rollout.max_staleness=1` stopped after step 2 of 4 (`run.stop_file`) and resumed with
`run.resume=auto` trains every prompt of the data order exactly once: step by step the same prompts as an
uninterrupted run, though batch 3 was drawn (and, partial, half generated) before the stop.

The task is the dataset task, whose prompts come from a stream (its position is the state a checkpoint
saves), with a distinct question per row: a checkpoint that saved the stream after the batch in flight
would skip it, one that regenerated it and drew it again would train it twice. Colocated at world 1, and
under the separate placement at world 2 (rank 1 the engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.batches import observed_batches
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
ROWS = 8  # 4 steps x 2 prompts: one epoch of the file, each question once
K1 = ["rollout.max_staleness=1", "rollout.partial=true"]


def _overrides(base: Path, out: Path) -> list[str]:
    return [
        "model.preset=gpt_oss_tiny", "model.vocab_size=201088", "model.max_position_embeddings=256",
        "env.name=dataset", f"data.train_files=[{base / 'train.jsonl'}]",
        f"data.eval_files=[{base / 'test.jsonl'}]", "env.eval_size=1", "reward.workers=0",
        "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=3", "run.eval_every=0", "run.progress=false", "run.tensorboard=false",
        "run.export_hf=false", "run.save_every=0", "run.steps=4", f"run.output_dir={out}",
        f"run.stop_file={out / 'STOP'}",
    ]  # fmt: skip


def _questions(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n")


def _train(base: str, out: str, stop_after: int, *extra: str) -> list[list[tuple[int, ...]]]:
    """A run (every rank of the world); the prompt of every trained row, step by step (learner ranks). With
    `stop_after` > 0 the stop file appears while step `stop_after` trains."""
    prompts: list[list[tuple[int, ...]]] = []

    def recording(args, _):
        prompts.append([tuple(p) for p in args[0]])
        if len(prompts) == stop_after and (not dist.is_initialized() or dist.get_rank() == 0):
            (Path(out) / "STOP").touch()

    cfg = load_config(ROOT / "configs/demo_cpu.yaml", [*_overrides(Path(base), Path(out)), *extra])
    with observed_batches(recording):
        result = loop.run(cfg)
    if dist.is_initialized():
        dist.barrier()
    assert result.status == ("stopped" if stop_after else "finished"), result.status
    return prompts


def _check(straight: list, before: list, after: list) -> None:
    assert len(straight) == 4 and len(before) == 2 and len(after) == 2
    assert before + after == straight  # step by step the same rows
    trained = [p for step in before + after for p in step]
    assert len(set(trained)) == ROWS and all(trained.count(p) == 2 for p in set(trained))  # 2 samples each


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The prompt files and the uninterrupted colocated run's prompts, step by step (the data order: the
    placement does not change it)."""
    base = tmp_path_factory.mktemp("resume")
    _questions(base / "train.jsonl", ROWS)
    _questions(base / "test.jsonl", 1)
    return base, _train(str(base), str(base / "straight"), 0, *K1)


def test_colocated_resume_trains_every_prompt_once(data):
    base, straight = data
    stopped = base / "stopped"
    before = _train(str(base), str(stopped), 2, *K1)
    (stopped / "STOP").unlink()
    after = _train(str(base), str(stopped), 0, *K1, "run.resume=auto")
    _check(straight, before, after)


def test_separate_resume_trains_every_prompt_once(data):
    base, straight = data
    sep = ("rollout.placement=separate", *K1)
    workers, stopped = pool(2), base / "sep_stopped"
    before = workers.run(_train, str(base), str(stopped), 2, *sep)
    (stopped / "STOP").unlink()
    after = workers.run(_train, str(base), str(stopped), 0, *sep, "run.resume=auto")
    assert before[1] == after[1] == []  # rank 1 hosts only the engine
    _check(straight, before[0], after[0])
