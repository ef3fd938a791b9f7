"""Resume never skips a checkpoint without a line naming it, and a manifest that lacks a field is a
CorruptCheckpointError naming the checkpoint and the field (not a KeyError): `resume auto` falls back past
it to the previous checkpoint, naming it; the trainer, given only such a checkpoint, fails in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_gptoss.checkpoint.manager import FIELDS, MANIFEST, CheckpointManager
from megatron_gptoss.config import load_config
from megatron_gptoss.errors import CorruptCheckpointError
from megatron_gptoss.trainer import loop

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.preset=gpt_oss_tiny", "model.vocab_size=32", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "env.eval_size=4", "run.eval_every=0", "run.progress=false",
        "run.tensorboard=false", "run.export_hf=false"]  # fmt: skip


def two_checkpoints(root: Path) -> CheckpointManager:
    manager = CheckpointManager(root, keep_last=5)
    for step in (1, 2):
        manager.save(step, lambda d: (d / "w.bin").write_bytes(b"w" * 64), {"layout": {"tp": 1}})
    return CheckpointManager(root, keep_last=5)  # a new process: nothing verified yet


def edit_manifest(step_dir: Path, *drop: str) -> None:
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for key in drop:
        del manifest[key]
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_that_lost_a_field_is_skipped_naming_it(tmp_path, caplog):
    manager = two_checkpoints(tmp_path)
    assert json.loads((tmp_path / "step_000002" / MANIFEST).read_text())[FIELDS] == [
        "files", "layout", "step"
    ]  # fmt: skip
    edit_manifest(tmp_path / "step_000002", "layout")
    with caplog.at_level(logging.WARNING, logger="megatron_gptoss.checkpoint.manager"):
        assert manager.find_resumable() == tmp_path / "step_000001"
    assert any("step_000002" in r.getMessage() and "['layout']" in r.getMessage() for r in caplog.records)


def test_a_newest_checkpoint_without_manifest_is_named_when_skipped(tmp_path, caplog):
    manager = two_checkpoints(tmp_path)
    (tmp_path / "step_000002" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="megatron_gptoss.checkpoint.manager"):
        assert manager.find_resumable() == tmp_path / "step_000001"
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert skipped == [f"skipping checkpoint {tmp_path / 'step_000002'} ('latest' names it): no {MANIFEST} "
                       "(incomplete or damaged)"]  # fmt: skip


def test_the_trainer_names_the_field_a_manifest_of_another_version_lacks(tmp_path):
    out = tmp_path / "run"
    result = loop.run(
        load_config(ROOT / "configs/demo_cpu.yaml", [*TINY, f"run.output_dir={out}", "run.steps=1"])
    )
    assert (result.status, result.step) == ("finished", 1)
    edit_manifest(out / "checkpoints" / "step_000001", "layout", FIELDS)  # as a manifest with no field list
    resumed = [*TINY, f"run.output_dir={out}", "run.steps=2", "run.resume=auto"]
    with pytest.raises(CorruptCheckpointError) as err:
        loop.run(load_config(ROOT / "configs/demo_cpu.yaml", resumed))
    assert f"cannot resume from {out / 'checkpoints' / 'step_000001'}" in str(err.value)
    assert "lacks the field 'layout'" in str(err.value)
