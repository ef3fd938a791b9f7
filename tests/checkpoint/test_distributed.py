"""Sharded checkpoints of parallel runs on a pool of 4 gloo ranks (tiny GPT-OSS, 2 layers, float32):

- resharding: 2 steps in layout A, save, load in layout B, 2 more steps; the losses of those steps and
  every parameter after them equal the single-process run of 4 steps (<= 1e-5 per tensor). Pairs:
  tp2 x pp2 -> pp2 x dp2 x ep2 (sharded optimizer), and pp2 x dp2 x ep2 (replicated optimizer) ->
  tp2 x dp2 x ep2 (sharded): tp, pp, dp, ep, vocabulary padding and optimizer sharding all change.
- same layout: stopped, resumed with `resume("auto")` and continued gives bit for bit the losses and
  parameters of the run that never stopped, the random streams included (the data order draws from
  torch's global generator); a background save lets training go on and writes the same bytes.
- failures: a process killed by SIGKILL in the middle of a save, a corrupted shard (named by its
  checksum, skipped by resume auto), a full disk (ENOSPC on one rank), another model shape or vocabulary.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from helpers.harness import pool
from helpers.reference_learner import MasterWeightAdamW
from helpers.sharded import build_dims, reference_model, rel_err, tiny_config

from megatron_gptoss.checkpoint.dist_boxes import shard_spec_of
from megatron_gptoss.checkpoint.dist_planner import CheckpointReader
from megatron_gptoss.checkpoint.distributed import (
    CheckpointSaveError,
    DistributedCheckpointer,
    RunState,
)
from megatron_gptoss.checkpoint.manager import CheckpointManager
from megatron_gptoss.config import OptimConfig
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer, apply_data_parallel
from megatron_gptoss.parallel.loading import init_parallel
from megatron_gptoss.parallel.pipeline import PipelineRunner, build_stage_model, stage_plans
from megatron_gptoss.parallel.sharding import gather_full, get_shard, local_shard
from megatron_gptoss.rl.ppo_loss import loss_denominators

WORLD, LAYERS, SEED, BUDGET, STEPS = 4, 2, 0, 32, 4
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.5)
# Document lengths of each step's global batch (8 documents, split evenly over the dp replicas).
DOCS = [
    [12, 20, 9, 17, 10, 25, 6, 14],
    [9, 19, 12, 20, 9, 17, 10, 25],
    [6, 14, 9, 19, 12, 20, 9, 17],
    [25, 6, 7, 9, 19, 12, 20, 9],
]
TIMEOUT = 240.0  # seconds a pool call may take on a loaded machine before the test fails
TP2_PP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
PP2_DP2_EP2 = {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}
TP2_DP2_EP2 = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}
CP2_DP2_EP2 = {"context_parallel_size": 2, "expert_model_parallel_size": 2}


def global_batch(step: int, order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Right-padded rows of step `step` (in `order` when given)."""
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.tensor(DOCS[step])
    width = int(lengths.max())
    valid = torch.arange(width)[None, :] < lengths[:, None]
    batch = {
        "input_ids": torch.randint(0, 96, (len(lengths), width), generator=gen) * valid,
        "targets": torch.randint(0, 96, (len(lengths), width), generator=gen) * valid,
        "valid": valid,
        "mask": ((torch.rand(len(lengths), width, generator=gen) < 0.7) & valid).float(),
    }
    return {k: v[order] for k, v in batch.items()} if order is not None else batch


def loss_of(logprobs, mask, tokens):
    return -(logprobs * mask).sum() / tokens


def reference_run() -> dict:
    """The single-process model: losses of every step, parameters after the last."""
    model = reference_model(SEED, tiny_config(num_layers=LAYERS))
    opt = MasterWeightAdamW(list(model.parameters()), OPTIM, total_steps=STEPS)
    losses = []
    for step in range(STEPS):
        b = global_batch(step)
        lp, _ = model.token_logprobs(model.hidden_states(b["input_ids"]), b["targets"])
        loss = loss_of(lp, b["mask"], int(b["mask"].sum()))
        loss.backward()
        losses.append(loss.detach())
        opt.step()
    return {"loss": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ------------------------------------------------------------------------------------------------
# Rank side
def _build(parallel: dict, shard: bool, fresh: bool):
    config = tiny_config(num_layers=LAYERS)
    cfg, dims = build_dims(config, **parallel)
    plans = stage_plans(dims, LAYERS)
    models = [parallelize(build_stage_model(config, plan), dims, cfg) for plan in plans]
    if fresh:  # the reference's weights
        full = dict(reference_model(SEED, config).named_parameters())
        with torch.no_grad():
            for model in models:
                for name, p in model.named_parameters():
                    p.copy_(local_shard(full[name], get_shard(p), dims, config.padded_vocab_size(dims.tp)))
    else:  # other weights, which a load must overwrite entirely
        init_parallel(models, config, dims, seed=99)
    models = [apply_data_parallel(m, dims) for m in models]
    opt = DistributedOptimizer(models, OPTIM, dims, total_steps=STEPS, shard=shard)
    # a frozen reference policy (RL with a KL term keeps one): layout-independent random weights
    reference = [parallelize(build_stage_model(config, plan), dims, cfg) for plan in plans]
    init_parallel(reference, config, dims, seed=7 if fresh else 8)
    for m in reference:
        m.requires_grad_(False)
    modules = {"model": models, "reference": reference}
    return config, dims, modules, opt, PipelineRunner(models, plans, dims, chunk_size=16)


def _checkpointer(root: str, dims, config) -> DistributedCheckpointer:
    group = dist.new_group(backend="gloo")
    return DistributedCheckpointer(CheckpointManager(root, keep_last=3), dims, config, group)


def _train_step(step: int, dims, runner, opt, shuffle: bool) -> torch.Tensor:
    order = torch.randperm(len(DOCS[step])) if shuffle else None  # torch's global stream
    b = global_batch(step, order)
    per = len(DOCS[step]) // dims.dp
    rows = slice(dims.coord("dp") * per, (dims.coord("dp") + 1) * per)
    mine = {k: v[rows] for k, v in b.items()}
    tokens = loss_denominators([mine["mask"]], dims.group("dp")).tokens
    packed = runner.pack(mine["input_ids"], mine["targets"], mine["valid"], BUDGET)

    def loss_fn(rows, lp, ent, mask=mine["mask"]):
        return loss_of(lp, mask[rows], tokens)

    loss = runner.forward_backward(packed, loss_fn)
    dist.all_reduce(loss, group=dims.group("dp"))
    opt.step()
    return loss


def _full_params(models, dims, vocab) -> dict[str, torch.Tensor]:
    return {
        n: gather_full(p.detach(), get_shard(p), dims, vocab).clone()
        for model in models
        for n, p in model.named_parameters()
    }


def run_case(parallel: dict, shard: bool, root: str, stop: int, options: dict) -> dict:
    """Train up to step `stop` in `parallel`; `options`: resume ("" / "auto" / path), save_at (steps
    after which to save), shuffle (data order from the global generator), async_at, slow_writes."""
    torch.manual_seed(1234)
    fresh = not options.get("resume")
    config, dims, modules, opt, runner = _build(parallel, shard, fresh)
    ckpt = _checkpointer(root, dims, config)
    logs = _capture_logs()
    if options.get("slow_writes"):
        _patch_writes(lambda: time.sleep(options["slow_writes"]))
    start, out = 0, {"loss": [], "rank": dims.rank}
    if options.get("resume"):
        loaded = ckpt.resume(options["resume"], modules, opt)
        assert loaded is not None
        start = loaded.run.step
        out.update(resumed=str(loaded.path), same_layout=loaded.same_layout, data=loaded.run.data)
    for step in range(start, stop):
        out["loss"].append(_train_step(step, dims, runner, opt, options.get("shuffle", False)))
        if step + 1 == options.get("hang_in_save_at"):
            _patch_writes(_announce_and_hang)
        if step + 1 in options.get("save_at", ()):
            ckpt.save(step + 1, modules, opt, RunState(step + 1, data={"next": step + 1}))
        if step + 1 == options.get("async_at"):
            ckpt.save_async(step + 1, modules, opt, RunState(step + 1, data={"next": step + 1}))
            out["busy_after_start"] = ckpt.busy()
        if options.get("async_at") and step + 1 == options["async_at"] + 1:
            out["busy_after_next_step"] = ckpt.busy()
    if options.get("async_at"):
        out["async_path"] = str(ckpt.wait())
    _patch_writes(None)
    out["log"] = logs.getvalue()
    out["params"] = _full_params(modules["model"], dims, config.vocab_size)
    out["reference"] = _full_params(modules["reference"], dims, config.vocab_size)
    models = modules["model"]
    out["specs_agree"] = all(
        get_shard(p) == shard_spec_of(n, dims.tp) for m in models for n, p in m.named_parameters()
    )
    return out


_ORIGINAL_WRITE = dcp_filesystem._write_item


def _patch_writes(before_each) -> None:
    """Run `before_each()` before DCP writes each item of a file (None: restore the plain writer)."""

    def write(*args, **kwargs):
        before_each()
        return _ORIGINAL_WRITE(*args, **kwargs)

    dcp_filesystem._write_item = _ORIGINAL_WRITE if before_each is None else write


def _announce_and_hang() -> None:
    print("writing", flush=True)
    time.sleep(120)


def _capture_logs() -> io.StringIO:
    text = io.StringIO()
    logger = logging.getLogger("megatron_gptoss.checkpoint")
    logger.handlers = [logging.StreamHandler(text)]
    logger.setLevel(logging.INFO)
    return text


def compare(per_rank: list[dict], ref_losses, ref_params, tol: float) -> float:
    """Worst relative error over losses and parameters of all ranks; asserts each <= tol."""
    worst = 0.0
    for out in per_rank:
        assert out["specs_agree"]
        for got, want in zip(out["loss"], ref_losses):
            worst = max(worst, rel_err(got, want))
        for name, p in out["params"].items() if ref_params else ():
            err = rel_err(p, ref_params[name]) if tol else float(not torch.equal(p, ref_params[name]))
            assert err <= tol, f"rank {out['rank']}: {name} error {err:.3g}"
            worst = max(worst, err)
    assert worst <= tol, worst
    return worst


def _real(params: dict) -> dict:
    vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
    return {n: p[:96] if n in vocab else p for n, p in params.items()}


# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize(
    "first, second",
    [
        ((TP2_PP2, True), (PP2_DP2_EP2, True)),
        ((PP2_DP2_EP2, False), (TP2_DP2_EP2, True)),
        ((CP2_DP2_EP2, True), (TP2_PP2, True)),
    ],
    ids=["tp2xpp2->pp2xdp2xep2", "pp2xdp2xep2-replicated->tp2xdp2xep2", "cp2xdp2xep2->tp2xpp2"],
)
def test_save_in_one_layout_load_in_another(tmp_path, reference, first, second):
    root = str(tmp_path / "ckpt")
    before = pool(WORLD).run(run_case, *first, root, 2, {"save_at": (2,)}, timeout=TIMEOUT)
    after = pool(WORLD).run(run_case, *second, root, STEPS, {"resume": "auto"}, timeout=TIMEOUT)
    assert all(not out["same_layout"] and out["data"] == {"next": 2} for out in after)
    compare(before, reference["loss"][:2], {}, 1e-5)
    worst = compare(after, reference["loss"][2:], _real(reference["params"]), 1e-5)
    frozen = {name: p for out in before for name, p in out["reference"].items()}
    assert all(torch.equal(p, frozen[n]) for out in after for n, p in out["reference"].items())
    print(f"{first} -> {second}: worst error {worst:.3g}")


def _equal_runs(resumed: list[dict], uninterrupted: list[dict], first_step: int) -> None:
    """Losses from `first_step` on, every final parameter and the reference policy bit for bit, rank by
    rank."""
    for got, want in zip(resumed, uninterrupted):
        assert torch.equal(torch.stack(got["loss"]), torch.stack(want["loss"][first_step:]))
        for kind in ("params", "reference"):
            for name, p in got[kind].items():
                assert torch.equal(p, want[kind][name]), (kind, name)


def test_resume_auto_in_the_same_layout_is_bitwise(tmp_path):
    """The data order draws from torch's global generator, so the random streams must be restored too.
    Then: a corrupted shard and a missing shard are named and skipped by resume auto."""
    run = pool(WORLD).run
    layout = (TP2_DP2_EP2, True)
    uninterrupted = run(run_case, *layout, str(tmp_path / "u"), STEPS, {"shuffle": True}, timeout=TIMEOUT)
    root = tmp_path / "i"
    run(run_case, *layout, str(root), 3, {"shuffle": True, "save_at": (1, 2, 3)}, timeout=TIMEOUT)
    resumed = run(run_case, *layout, str(root), STEPS, {"shuffle": True, "resume": "auto"}, timeout=TIMEOUT)
    assert all(out["same_layout"] and out["resumed"].endswith("step_000003") for out in resumed)
    _equal_runs(resumed, uninterrupted, 3)

    corrupt = root / "step_000003" / "__1_0.distcp"
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    (root / "step_000002" / "__2_0.distcp").unlink()
    resumed = run(run_case, *layout, str(root), STEPS, {"shuffle": True, "resume": "auto"}, timeout=TIMEOUT)
    log = resumed[0]["log"]
    assert "skipping checkpoint step_000003" in log and "__1_0.distcp: checksum mismatch" in log, log
    assert "skipping checkpoint step_000002" in log and "__2_0.distcp: missing" in log, log
    assert all(out["resumed"].endswith("step_000001") for out in resumed)
    _equal_runs(resumed, uninterrupted, 1)


def test_background_save_lets_training_go_on_and_writes_the_same_checkpoint(tmp_path):
    run = pool(WORLD).run
    layout = (TP2_DP2_EP2, True)
    sync = run(run_case, *layout, str(tmp_path / "s"), STEPS, {"save_at": (2,)}, timeout=TIMEOUT)
    options = {"async_at": 2, "slow_writes": 0.02}
    background = run(run_case, *layout, str(tmp_path / "a"), STEPS, options, timeout=TIMEOUT)
    assert all(out["busy_after_start"] and out["busy_after_next_step"] for out in background)
    _equal_runs(background, sync, 0)  # training went on unchanged while the save was writing
    a = CheckpointReader(background[0]["async_path"])
    s = CheckpointReader(tmp_path / "s" / "step_000002")
    keys = sorted(s.metadata.state_dict_metadata)
    assert keys == sorted(a.metadata.state_dict_metadata)
    for key in keys:
        if key == "run" or key.startswith("rank/"):
            assert str(a.blob(key)) == str(s.blob(key)), key
        else:
            assert torch.equal(a.read(key), s.read(key)), key


def full_disk_case(root: str) -> dict:
    """Save step 1, then a save of step 2 whose writes fail with ENOSPC on rank 1 only."""
    config, dims, modules, opt, runner = _build(TP2_DP2_EP2, True, fresh=True)
    models = modules["model"]
    ckpt = _checkpointer(root, dims, config)
    _train_step(0, dims, runner, opt, shuffle=False)
    ckpt.save(1, {"model": models}, opt, RunState(1))
    _train_step(1, dims, runner, opt, shuffle=False)
    calls = []

    def fail_on_rank_1():
        calls.append(1)
        if dims.rank == 1 and len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    _patch_writes(fail_on_rank_1)
    try:
        ckpt.save(2, {"model": models}, opt, RunState(2))
        error = ""
    except CheckpointSaveError as err:
        error = str(err)
    finally:
        _patch_writes(None)
    found = ckpt.find_resumable()
    loaded = ckpt.load(found, {"model": models}, opt) if found else None
    return {"error": error, "found": str(found), "step": loaded.run.step if loaded else None}


def test_full_disk_fails_cleanly_and_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    per_rank = pool(WORLD).run(full_disk_case, str(root), timeout=TIMEOUT)
    for out in per_rank:
        assert "checkpoint of step 2 not saved" in out["error"] and "rank 1" in out["error"]
        assert "No space left on device" in out["error"]
        assert out["found"].endswith("step_000001") and out["step"] == 1
    assert (root / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]


def wrong_model_case(root: str) -> list[str]:
    """Loading the checkpoint into models of another width and another vocabulary."""
    messages = []
    for overrides in ({"hidden_size": 64}, {"vocab_size": 128}):
        config = tiny_config(num_layers=LAYERS, **overrides)
        cfg, dims = build_dims(config, **TP2_PP2)
        models = [parallelize(build_stage_model(config, p), dims, cfg) for p in stage_plans(dims, LAYERS)]
        ckpt = _checkpointer(root, dims, config)
        try:
            ckpt.load(Path(root) / "step_000001", {"model": models}, None)
            messages.append("")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_another_model_shape_or_vocabulary_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    pool(WORLD).run(run_case, *(TP2_PP2, True), root, 1, {"save_at": (1,)}, timeout=TIMEOUT)
    for hidden, vocab in pool(WORLD).run(wrong_model_case, root, timeout=TIMEOUT):
        assert "another shape" in hidden and "hidden_size 32 (checkpoint) != 64 (this run)" in hidden
        assert "vocab_size 96 (checkpoint) != 128 (this run)" in vocab


_KILLED_SAVE = """
import sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
import torch.distributed as dist
import test_distributed as t
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".init", rank=0, world_size=1)
t.run_case({}, True, sys.argv[1], 2, {"save_at": (1, 2), "hang_in_save_at": 2})
"""


def test_sigkill_during_a_save_keeps_the_previous_checkpoint_for_resume_auto(tmp_path, reference):
    root = tmp_path / "ckpt"
    here = Path(__file__).resolve().parent
    args = [str(root), str(here), str(here.parent)]  # this folder, and tests/ for `helpers`
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert (root / ".step_000002.partial").exists()  # killed in the middle of writing step 2
    assert (root / "latest").read_text().strip() == "step_000001"
    assert CheckpointManager(root).find_resumable() == root / "step_000001"
    # a run of 4 ranks (tp2 x pp2) resumes from it with resume auto and matches the reference
    after = pool(WORLD).run(run_case, *(TP2_PP2, True), str(root), STEPS, {"resume": "auto"}, timeout=TIMEOUT)
    assert all(out["resumed"].endswith("step_000001") for out in after)
    assert "skipping incomplete checkpoint" in after[0]["log"]
    compare(after, reference["loss"][1:], _real(reference["params"]), 1e-5)
