"""Asynchronous rollouts in the one trainer (world 1, the demo's model and task, `trainer.rollout_buffer`):

- `rollout.max_staleness=0` is the synchronous loop: the same metrics and final weights as a loop that
  calls `collect_rollouts` for every step;
- k = 1: every trained token's recorded version is the one the schedule says (batch s sampled at version
  max(0, s - 2)), `staleness/max` <= 1 every step; with partial rollouts too, where the batches ahead are
  generated in a thread while the learner computes and the run equals one without that overlap
  (`tests/rollout/test_partial.py` checks what a continued row computes under `keep` and `recompute`);
- the buffer's checkpointed prompt stream is the one before the first batch not trained (a stateful task
  resumed from it draws the batches in flight again: none skipped, none twice);
- a row older than k versions is dropped and generated again with its own seed, counted."""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.batches import observed_batches
from safetensors.torch import load_file

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams
from megatron_gptoss.trainer import loop, rollout_buffer
from megatron_gptoss.trainer.rollout_buffer import RolloutBuffer
from megatron_gptoss.trainer.rollouts import collect_rollouts, seed_base

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.steps=3", "run.eval_every=0", "run.progress=false", "run.tensorboard=false", "env.eval_size=1",
        "run.save_every=-1", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"]  # fmt: skip


def _run(out: Path, *overrides: str) -> dict[int, dict]:
    loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={out}", *overrides]))
    lines = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {line["step"]: line for line in lines}


class _Synchronous:
    """The loop before the buffer: `collect_rollouts` for every step, nothing ahead."""

    def __init__(self, cfg, engine, host, task, sampling):
        self.cfg, self.engine, self.task, self.sampling = cfg, engine, task, sampling

    def take(self, step, last_step):
        rollouts, metrics = collect_rollouts(self.cfg, self.engine, self.task, self.sampling, step)
        return rollouts, [[step - 1] * len(g.token_ids) for g in rollouts.generations], metrics

    def weights_are(self, version):
        pass

    def wait(self):
        pass

    def exclusive(self):
        return nullcontext()

    def busy_s(self):
        return 0.0

    def state_dict(self):
        return self.task.state_dict()

    def load_state_dict(self, state):
        self.task.load_state_dict(state)

    def close(self):
        self.task.close()


def test_no_staleness_is_the_synchronous_loop(tmp_path, monkeypatch):
    ours = _run(tmp_path / "buffer", "run.export_hf=true")
    monkeypatch.setattr(loop, "RolloutBuffer", _Synchronous)
    before = _run(tmp_path / "sync", "run.export_hf=true")
    assert sorted(ours) == sorted(before) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key, value in before[step].items():
            if not key.startswith(("time/", "idle/", "perf/")):
                assert ours[step][key] == value, (step, key)
        assert ours[step]["staleness/max"] == 0.0 and ours[step]["buffer/depth"] == 0.0
    a, b = (
        load_file(next((tmp_path / run / "hf_final").glob("*.safetensors"))) for run in ("buffer", "sync")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["whole", "recompute"])
def test_bounded_staleness(tmp_path, monkeypatch, mode):
    seen: list[torch.Tensor] = []  # the versions of every trained batch
    background = {"calls": 0}
    threaded = RolloutBuffer._background

    def counted(self, later, version):
        background["calls"] += 1
        return threaded(self, later, version)

    monkeypatch.setattr(RolloutBuffer, "_background", counted)
    partial = [] if mode == "whole" else ["rollout.partial=true", f"rollout.partial_kv={mode}"]
    with observed_batches(lambda args, batch: seen.append(batch.versions[batch.loss_mask > 0])):
        lines = _run(tmp_path / mode, "run.export_hf=false", "rollout.max_staleness=1", *partial)
    assert len(seen) == 3
    for step, versions in enumerate(seen, start=1):
        assert versions.numel() > 0
        assert int(versions.max()) <= step - 1 and int(versions.min()) >= max(0, step - 2), (step, versions)
        gaps = (step - 1 - versions).double()
        assert lines[step]["staleness/max"] == float(gaps.max()) <= 1.0
        assert lines[step]["staleness/mean"] == pytest.approx(float(gaps.mean()))
        assert lines[step]["staleness/dropped_rows"] == 0.0
    assert lines[2]["staleness/max"] == 1.0  # batch 2 was sampled at version 0 while the learner held 1
    assert lines[2]["mismatch/staleness1/tokens"] > 0 and lines[2]["mismatch/staleness1/abs_diff_max"] > 0
    assert (
        lines[1]["buffer/depth"] == 4.0 and lines[3]["buffer/depth"] == 0.0
    )  # batch 2 ahead; none at the end
    if mode == "whole":
        assert torch.equal(seen[2], torch.ones_like(seen[2]))  # batch 3: sampled whole at version 1
        return
    # the batches ahead were generated in a thread while the learner computed; without, the same run up to
    # float32 rounding (two threads share the CPU's intra-op pool: GEMMs split their sums differently)
    assert background["calls"] == 3
    monkeypatch.setattr(RolloutBuffer, "overlaps", staticmethod(lambda cfg, host: False))
    alone = _run(tmp_path / "sequential", "run.export_hf=false", "rollout.max_staleness=1", *partial)
    assert background["calls"] == 3
    for step in (1, 2, 3):
        for key, value in alone[step].items():
            # engine/*: the engine's steps since the last read, which a batch generated in a thread meanwhile
            # falls on either side of
            if not key.startswith(("time/", "idle/", "perf/", "engine/")):
                assert lines[step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (step, key)


def test_partial_needs_the_embedded_engine():
    with pytest.raises(ConfigError, match="rollout.partial=true needs rollout.engine='embedded'"):
        load_config(None, ["rollout.partial=true", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.partial_kv='maybe' not in"):
        load_config(None, ["rollout.partial_kv=maybe"])
    with pytest.raises(ConfigError, match="dapo.dynamic_sampling generates extra rounds"):
        load_config(None, ["rollout.max_staleness=2", "dapo.dynamic_sampling=true"])


# ---------------------------------------------------------------------------------------- the buffer alone
@dataclass
class _Prompt:
    token_ids: list[int]


class _Stream:
    """A task whose prompts come from a position in a stream (as the dataset task's do)."""

    def __init__(self):
        self.position = 0

    def sample_prompts(self, n, rng):
        self.position += n
        return [_Prompt([self.position - n + i]) for i in range(n)]

    def score_batch(self, prompts, responses):
        return [{"reward": float(r[0] % 2), "correct": False} for r in responses], {}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def close(self):
        pass


class _Engine:
    """Row i answers its prompt with [seed + i]; call c's tokens carry `versions[min(c, 1)]` (None: not
    recorded)."""

    def __init__(self, versions=None):
        self.versions, self.calls = versions, []

    def generate(self, prompts, params: SamplingParams):
        self.calls.append((prompts, params.seed))
        out = []
        for i, p in enumerate(prompts):
            v = None if self.versions is None else list(self.versions[min(len(self.calls) - 1, 1)])
            out.append(Generation(list(p), [params.seed + i, 7], [-1.0, -1.0], "length", versions=v))
        return out


def _cfg(*overrides):
    return load_config(None, ["rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", *overrides])


@pytest.mark.usefixtures("world_of_one")
def test_the_checkpointed_stream_is_before_the_first_untrained_batch():
    cfg = _cfg("rollout.max_staleness=2")
    task = _Stream()
    buffer = RolloutBuffer(cfg, _Engine(), None, task, SamplingParams())
    first, _, metrics = buffer.take(1, 10)  # batches 1, 2 and 3 drawn
    assert task.position == 6 and metrics["buffer/depth"] == 8.0
    assert buffer.state_dict() == {"position": 2}  # a checkpoint now: batch 2 onwards not trained
    second, _, _ = buffer.take(2, 10)
    resumed_task = _Stream()
    resumed = RolloutBuffer(cfg, _Engine(), None, resumed_task, SamplingParams())
    resumed.load_state_dict({"position": 2})
    again, _, _ = resumed.take(2, 10)
    assert (
        [p.token_ids for p in again.prompts] == [p.token_ids for p in second.prompts] == [[2]] * 2 + [[3]] * 2
    )
    assert [p.token_ids for p in first.prompts] == [[0]] * 2 + [[1]] * 2


@pytest.mark.usefixtures("world_of_one")
def test_a_row_too_stale_is_generated_again():
    cfg = _cfg("rollout.max_staleness=1")
    engine = _Engine(versions=[[1, 3], [3, 3]])  # first tokens sampled at version 1: beyond k at step 4
    buffer = RolloutBuffer(cfg, engine, None, _Stream(), SamplingParams())
    rollouts, versions, metrics = buffer.take(4, 4)
    assert metrics["staleness/dropped_rows"] == 4.0
    base = seed_base(cfg, 4, 0, 4)
    assert engine.calls[1:] == [([[p.token_ids[0]]], base + i) for i, p in enumerate(rollouts.prompts)]
    assert [g.token_ids[0] for g in rollouts.generations] == [base + i for i in range(4)]
    assert versions == [[3, 3]] * 4  # the engine's record of the regenerated rows


class _DecodingHost:
    """An engine that decodes queued rows on its own (the separate placement's `EngineClient`): records its
    calls; row i of a batch answers [seed + i] under the version it holds."""

    decodes_ahead = True
    device = torch.device("cpu")

    def __init__(self):
        self.calls: list[tuple] = []
        self.version = 0
        self.batches: dict[int, tuple] = {}
        self.started = 0

    def start(self, prompts, params: SamplingParams):
        handle = self.started
        self.started += 1
        self.batches[handle] = (prompts, params.seed, self.version)
        self.calls.append(("start", handle))
        return handle

    def finish(self, handle):
        self.calls.append(("finish", handle))
        prompts, seed, version = self.batches.pop(handle)
        rows = enumerate(prompts)
        return [Generation(list(p), [seed + i], [-1.0], "length", versions=[version]) for i, p in rows]

    def weights_changed(self, version, recompute):
        self.version = version
        self.calls.append(("version", version))

    def busy_s(self):
        return 0.0


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("partial", [True, False])
def test_an_engine_that_decodes_ahead_gets_the_next_batch_before_this_one_is_finished(partial):
    """Separate placement, k = 1: take(s) queues batch s + 1 before it waits for batch s, so that the rows of
    batch s + 1 fill the slots batch s's finished rows leave (the versions still hold: s + 1 at s - 1)."""
    cfg = _cfg("rollout.max_staleness=1", f"rollout.partial={str(partial).lower()}")
    host = _DecodingHost()
    buffer = RolloutBuffer(cfg, _Engine(), host, _Stream(), SamplingParams(seed=5))
    for step in (1, 2, 3):
        _, versions, metrics = buffer.take(step, 3)
        buffer.wait()
        assert max(max(v) for v in versions) <= step - 1 and step - 1 - min(min(v) for v in versions) <= 1
        assert metrics["buffer/depth"] == (4.0 if step < 3 else 0.0)
        buffer.weights_are(step)
    assert host.calls == [
        ("version", 0), ("start", 0), ("start", 1), ("finish", 0), ("version", 1),
        ("start", 2), ("finish", 1), ("version", 2), ("finish", 2), ("version", 3),
    ]  # fmt: skip


@pytest.mark.usefixtures("world_of_one")
def test_agentic_batches_ahead_overlap_the_learner_only_on_engine_ranks():
    """Agentic trajectories generated whole through engine ranks run beside the learner (a thread); on the
    colocated engine, whose sessions share the learner's device, they do not."""
    agentic = _cfg("rollout.max_staleness=1", "agent.enabled=true")
    assert RolloutBuffer.overlaps(agentic, _DecodingHost())
    assert not RolloutBuffer.overlaps(agentic, type("Colocated", (), {"decodes_ahead": False})())
    assert not RolloutBuffer.overlaps(_cfg("agent.enabled=true"), _DecodingHost())  # k = 0: nothing ahead


@pytest.mark.usefixtures("world_of_one")
def test_partial_agentic_trajectories_through_engine_ranks_need_one_learner_rank(monkeypatch):
    """Each batch's trajectories run in a thread beside the learner: with more learner ranks its engine
    commands would interleave with their collectives, so the buffer refuses them by name."""
    cfg = _cfg("rollout.max_staleness=1", "rollout.partial=true", "agent.enabled=true")
    monkeypatch.setattr(rollout_buffer.dist, "get_world_size", lambda group=None: 3)
    with pytest.raises(ConfigError, match=r"needs one learner rank \(got 3\)"):
        RolloutBuffer(cfg, _Engine(), _DecodingHost(), _Stream(), SamplingParams())
    monkeypatch.setattr(rollout_buffer.dist, "get_world_size", lambda group=None: 1)
    assert RolloutBuffer(cfg, _Engine(), _DecodingHost(), _Stream(), SamplingParams()).threaded
