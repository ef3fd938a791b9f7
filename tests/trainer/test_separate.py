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
import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.batches import observed_batches
from helpers.harness import pool
from safetensors.torch import load_file

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.trainer import loop
from megatron_gptoss.trainer.engine_process import ChildEngine
from megatron_gptoss.trainer.separate import EngineClient, placement_ranks

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.steps=3", "run.eval_every=0", "run.progress=false", "run.tensorboard=false", "env.eval_size=1",
        "run.save_every=-1", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"]  # fmt: skip
SKIP = ("time/", "perf/", "engine/", "idle/")


def _lines(out: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _train(out: str, *overrides: str) -> list[list[int]]:
    """A run on every rank of the pool; the versions of every step's trained tokens (learner ranks)."""
    recorded: list[list[int]] = []
    cfg = load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides])
    with observed_batches(lambda _, batch: recorded.append(batch.versions[batch.loss_mask > 0].tolist())):
        result = loop.run(cfg)
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


def _row_versions(out: str, *overrides: str) -> tuple[list[list[list[int]]], int]:
    """A run on every rank of the pool; the versions of each trained row's tokens, step by step, and the
    number of batches queued on the engine ranks (`EngineClient.start`)."""
    recorded: list[list[list[int]]] = []
    start, starts = EngineClient.start, []

    def starting(self, *args):
        starts.append(1)
        return start(self, *args)

    def rows(_, batch):
        recorded.append([v[m > 0].tolist() for v, m in zip(batch.versions, batch.loss_mask)])

    EngineClient.start = starting  # type: ignore[method-assign]
    try:
        with observed_batches(rows):
            loop.run(
                load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides])
            )
    finally:
        EngineClient.start = start  # type: ignore[method-assign]
    dist.barrier()
    return recorded, len(starts)


def test_whole_rows_ahead_on_two_learner_ranks(tmp_path):
    """World 3: learner ranks 0 and 1 (data parallel 2), the engine on rank 2; k = 1 without partial rollouts:
    the engine rank decodes the batch ahead while the learner computes and ends its rows before it takes
    new weights, so every row is sampled by one policy, one version behind the learner from step 2 on."""
    out = tmp_path / "run"
    extra = ("rollout.placement=separate", "rollout.max_staleness=1")
    ranks = pool(3).run(_row_versions, str(out), *extra)
    assert ranks[0] == ranks[1] and ranks[2] == ([], 0)
    assert ranks[0][1] == 3  # every batch queued (the engine decodes it on its own), none generated whole
    for step, rows in enumerate(ranks[0][0], start=1):
        assert len(rows) == 4 and all(set(row) == {max(0, step - 2)} for row in rows), (step, rows)
    lines = _lines(out)
    assert [lines[s]["staleness/max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]


def test_experts_go_to_the_engine_rank_that_holds_them(tmp_path):
    """World 3: rank 0 the learner, ranks 1 and 2 one engine at expert parallel 2: each engine rank receives
    every dense tensor and only its half of the experts."""
    out = tmp_path / "run"
    extra = ("rollout.placement=separate", "rollout.engine_ranks=1,2", "rollout.expert_parallel_size=2")
    versions = pool(3).run(_train, str(out), "run.steps=1", *extra)
    assert versions[1] == versions[2] == [] and len(versions[0]) == 1
    model = GPTOSSModel(load_config(ROOT / "configs/demo_cpu.yaml").model, device="meta")
    full = sum(p.numel() * 4 for p in model.parameters())  # float32; the demo's vocabulary has no padding
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    line = _lines(out)[1]
    assert line["sync/bytes"] == full - experts // 2
    assert line["engine/sync_bytes_total"] == 2 * full - experts


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


def _killing_run(rank: int, init_file: str, out: str, method: str, kill_at: int, *overrides: str) -> None:
    """Rank `rank` of a 2-rank world (rank 1 the engine rank, its engine in a child process): the engine
    process is killed (SIGKILL) right after it receives its `kill_at`-th call of `method`. Rank 0 writes
    the prompts of every step's trained rows to `out`/prompts.json."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    send, calls = ChildEngine._send, []

    def killing(self, name, args):
        if name == method:
            calls.append(name)
            if len(calls) == kill_at:  # the child is generating when it dies
                self.conn.send((name, args))
                os.kill(self.process.pid, signal.SIGKILL)
                return self.conn.recv()
        return send(self, name, args)

    ChildEngine._send = killing  # type: ignore[method-assign]
    extra = ["rollout.placement=separate", "rollout.engine_child=true", *overrides]
    prompts = _run_recording(Path(out), *extra)
    if rank == 0:
        (Path(out) / "prompts.json").write_text(json.dumps(prompts))
    dist.destroy_process_group()


def _run_recording(out: Path, *overrides: str) -> list[list[list[int]]]:
    """A run; the prompt of every trained row, step by step."""
    prompts: list[list[list[int]]] = []
    with observed_batches(lambda args, _: prompts.append([list(p) for p in args[0]])):
        loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides]))
    return prompts


def _kill(tmp_path: Path, out: Path, method: str, kill_at: int, *overrides: str) -> list:
    args = (str(tmp_path / "init"), str(out), method, kill_at, *overrides)
    mp.start_processes(_killing_run, args, nprocs=2, start_method="spawn")
    return json.loads((out / "prompts.json").read_text())


def test_a_killed_engine_process_is_restarted_and_nothing_is_lost(tmp_path):
    """The engine process dies while it generates step 2's rows: a new one takes the weights and the call;
    the run equals the colocated run at world 1 (every row of every step generated and trained once, the
    same samples)."""
    sep, col = tmp_path / "separate", tmp_path / "colocated"
    _kill(tmp_path, sep, "generate", 3, "run.export_hf=true")  # calls: the evaluation, step 1, step 2
    _run_recording(col, "run.export_hf=true")
    ours, theirs = _lines(sep), _lines(col)
    assert [ours[s]["engine/restarts"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step, line in theirs.items():
        kept = {k: v for k, v in line.items() if not k.startswith(SKIP)}
        assert {k: v for k, v in ours[step].items() if not k.startswith(SKIP)} == kept, step
    a, b = (load_file(next((d / "hf_final").glob("*.safetensors"))) for d in (sep, col))
    assert all(a[name].equal(b[name]) for name in b)


def test_a_killed_engine_process_requeues_its_partial_rows(tmp_path):
    """k = 1, partial rollouts: the engine process dies while it steps step 2's rows to their end (the rows
    of step 3 queued beside them): the new process queues both batches' rows again from their prompts; every
    step trains the rows of its own prompts once, none lost or twice, at most one version old."""
    sep, col = tmp_path / "separate", tmp_path / "colocated"
    k1 = ("rollout.max_staleness=1", "rollout.partial=true")
    ours = _kill(tmp_path, sep, "finish", 2, *k1)
    theirs = _run_recording(col, *k1)
    assert ours == theirs and [len(rows) for rows in ours] == [4, 4, 4]  # 2 prompts x 2 samples a step
    lines = _lines(sep)
    assert lines[3]["engine/restarts"] == 1.0
    assert all(
        lines[s]["staleness/max"] <= 1.0 and lines[s]["staleness/dropped_rows"] == 0 for s in (1, 2, 3)
    )
