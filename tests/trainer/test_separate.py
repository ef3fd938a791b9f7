"""The separate placement (`trainer.separate`) on 2 gloo ranks: rank 1 hosts the embedded engine, rank 0 the
learner.

- `rollout.max_staleness=0` equals the colocated run at world 1 bit for bit after 3 steps: the learner's
  final weights and every metric but time/*, perf/*, engine/* and idle/* (the same prompts, seeds and
  weights; the rows cross the world as they are);
- k = 1 with partial rollouts: every trained token's recorded version is at most one behind the learner
  (`staleness/max` <= 1 every step), the engine ranks decode the batch ahead while the learner computes,
  and both idle fractions are shares of the step in [0, 1);
- the placement's settings are checked against the world with errors naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.harness import pool
from safetensors.torch import load_file

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.trainer import loop
from megatron_gptoss.trainer.separate import placement_ranks

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.steps=3", "run.eval_every=0", "run.progress=false", "run.tensorboard=false", "env.eval_size=1",
        "run.save_every=-1", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"]  # fmt: skip
SKIP = ("time/", "perf/", "engine/", "idle/")


def _lines(out: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _train(out: str, *overrides: str) -> list[list[int]]:
    """A run on every rank of the pool; the versions of every step's trained tokens (learner ranks)."""
    recorded: list[list[int]] = []
    build = loop.build_batch

    def recording(*args):
        batch = build(*args)
        recorded.append(batch.versions[batch.loss_mask > 0].tolist())
        return batch

    loop.build_batch = recording  # type: ignore[assignment]
    try:
        cfg = load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides])
        result = loop.run(cfg)
    finally:
        loop.build_batch = build  # type: ignore[assignment]
    dist.barrier()
    assert result.status == "finished" and result.step == cfg.run.steps
    return recorded


def test_separate_without_staleness_equals_colocated(tmp_path):
    sep, col = tmp_path / "separate", tmp_path / "colocated"
    versions = pool(2).run(_train, str(sep), "rollout.placement=separate", "run.export_hf=true")
    assert versions[1] == [] and len(versions[0]) == 3  # rank 1 hosts only the engine
    loop.run(
        load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={col}", "run.export_hf=true"])
    )
    ours, theirs = _lines(sep), _lines(col)
    assert sorted(ours) == sorted(theirs) == [0, 1, 2, 3]
    for step, line in theirs.items():
        kept = {k: v for k, v in line.items() if not k.startswith(SKIP)}
        assert {k: v for k, v in ours[step].items() if not k.startswith(SKIP)} == kept, step
    assert ours[3]["sync/bytes"] > 0
    a, b = (load_file(next((d / "hf_final").glob("*.safetensors"))) for d in (sep, col))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name


def test_separate_with_staleness_one(tmp_path):
    out = tmp_path / "run"
    extra = ("rollout.placement=separate", "rollout.max_staleness=1", "rollout.partial=true", "run.steps=4")
    versions = pool(2).run(_train, str(out), *extra)[0]
    lines = _lines(out)
    assert len(versions) == 4
    for step, seen in enumerate(versions, start=1):
        assert seen and max(seen) <= step - 1 and min(seen) >= step - 2  # at most one version behind
        assert lines[step]["staleness/max"] == max(step - 1 - v for v in seen) <= 1.0
        assert (
            0.0 <= lines[step]["idle/engine_frac"] <= 1.0 and 0.0 <= lines[step]["idle/learner_frac"] <= 1.0
        )
    # rows queued ahead were decoded under the old weights while the learner computed (stepped only at the
    # next `finish`, after the sync, they would carry the new version: staleness 0)
    assert max(lines[s]["staleness/max"] for s in (2, 3, 4)) == 1.0
    # at this size the learner's update is most of a step: the engine ranks wait more than the learner
    idle = {side: sum(lines[s][f"idle/{side}_frac"] for s in lines if s) for side in ("engine", "learner")}
    assert idle["engine"] > idle["learner"]


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ([], 1, "at least 2 ranks"),
        (["rollout.engine_ranks=2"], 2, "not in a world of 2"),
        (["rollout.engine_ranks=1,1"], 3, "names a rank twice"),
        (["rollout.engine_ranks=0,1"], 2, "leaves no learner rank"),
        (["parallel.tensor_model_parallel_size=2"], 2, "the learner's 1 ranks [0] do not fit"),
        (["rollout.tensor_parallel_size=2"], 3, "the engine's 1 ranks [2] do not fit"),
    ],
)
def test_placement_errors_name_the_setting(overrides, world, message):
    cfg = load_config(ROOT / "configs/demo_cpu.yaml", ["rollout.placement=separate", *overrides])
    with pytest.raises(ConfigError, match="rollout") as err:
        placement_ranks(cfg, world)
    assert message in str(err.value)


def test_placement_settings_are_checked():
    engine_ranks = load_config(ROOT / "configs/demo_cpu.yaml", ["rollout.placement=separate"])
    assert placement_ranks(engine_ranks, 3) == ([2], [0, 1])
    for overrides, message in [
        (["rollout.placement=apart"], "rollout.placement='apart' not in"),
        (["rollout.engine_ranks=1"], "need rollout.placement='separate' (got 'colocated')"),
        (
            ["rollout.placement=separate", "rollout.engine_child=true", "rollout.tensor_parallel_size=2"],
            "rollout.tensor_parallel_size=1 and rollout.expert_parallel_size=1 with rollout.engine_child",
        ),
        (["rollout.placement=separate", "rollout.sleep_level=1"], "rollout.sleep_level=0"),
        (["rollout.placement=separate", "rollout.engine=vllm"], "rollout.engine='embedded'"),
    ]:
        with pytest.raises(ConfigError, match="rollout") as err:
            load_config(ROOT / "configs/demo_cpu.yaml", overrides)
        assert message in str(err.value), overrides
