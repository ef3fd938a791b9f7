"""The colocated RL loop on 4 gloo ranks (`trainer.colocated`): the demo's model and task, the learner at
tensor parallel 2 x 2 pipeline stages, the embedded engine at tensor parallel 2 (two replicas) fed by the
fan-out bridge after every update. Each step the engine's log-probs equal the learner's to float32
rounding (the sync is right; a skipped sync shows as a mismatch), the on-policy ratio is exactly 1, every
phase is timed; a run stopped and resumed with `resume=auto` logs bit for bit the metrics of one that
never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.harness import pool

from megatron_gptoss.config import load_config
from megatron_gptoss.trainer import colocated, loop

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/layouts/tiny_rl_tp2_pp2_cpu.yaml"
STEPS = 3
FAST = ["rollout.prompts_per_step=12", "rollout.n_samples_per_prompt=4", "run.tensorboard=false",
        "run.progress=false", "run.eval_every=0", f"run.steps={STEPS}", "optim.warmup_steps=0"]  # fmt: skip


def train(out: str, overrides: list[str], skip_sync: bool = False) -> None:
    cfg = load_config(CONFIG, [*FAST, f"run.output_dir={out}", *overrides])
    if skip_sync:  # the engine keeps the initial weights after the first sync
        calls = {"n": 0}
        original = colocated.Colocated.sync

        def first_only(self):
            calls["n"] += 1
            return original(self) if calls["n"] == 1 else {}

        colocated.Colocated.sync = first_only  # type: ignore[method-assign]
        try:
            loop.run(cfg)
        finally:
            colocated.Colocated.sync = original  # type: ignore[method-assign]
    else:
        loop.run(cfg)
    dist.barrier()


def metrics(out: Path) -> dict[int, dict]:
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("colocated")
    workers = pool(4)
    workers.run(train, str(base / "whole"), [])
    workers.run(train, str(base / "stopped"), ["run.steps=2"])
    workers.run(train, str(base / "stopped"), ["run.resume=auto"])
    workers.run(train, str(base / "stale"), [], True)
    return {name: metrics(base / name) for name in ("whole", "stopped", "stale")}


def test_engine_matches_learner_every_step(runs):
    whole = runs["whole"]
    assert sorted(whole) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        line = whole[step]
        assert line["mismatch/tokens"] > 0
        assert line["mismatch/abs_diff_max"] <= 1e-5, (step, line["mismatch/abs_diff_max"])
        assert line["pg/ratio_max"] == 1.0 and line["pg/ratio_min"] == 1.0
        for phase in ("generate", "logprobs", "update", "sync"):
            assert line[f"time/{phase}_s"] > 0
    stale = runs["stale"]
    assert stale[1]["mismatch/abs_diff_max"] <= 1e-5  # the first step's engine had the initial weights
    moved = [s for s in range(1, STEPS) if stale[s]["train/grad_norm"] > 0]  # steps that changed the learner
    assert moved, "no update changed the learner: nothing to detect"
    assert stale[moved[0] + 1]["mismatch/abs_diff_max"] > 1e-2  # the engine kept the old weights


def test_resume_auto_is_bitwise(runs):
    whole, stopped = runs["whole"], runs["stopped"]
    assert sorted(stopped) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        assert stopped[step].keys() >= whole[step].keys()  # the stopped run evaluated at its end
        for key, value in whole[step].items():
            if not key.startswith(("time/", "idle/")):  # idle/*: shares of wall time
                assert stopped[step][key] == value, (step, key)
