"""Checkpoint hygiene: pruning counts only verified checkpoints, resume auto never starts fresh silently,
a truncated manifest is named, a full disk or an unwritable directory fails a save cleanly, the export
tool verifies by default, HF readers name a missing or unexpected tensor."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from helpers.scripts import load_script
from safetensors.torch import load_file, save_file

from megatron_gptoss.checkpoint import manager as manager_module
from megatron_gptoss.checkpoint.dist_convert import dist_to_hf, hf_to_dist
from megatron_gptoss.checkpoint.dist_planner import read_metadata
from megatron_gptoss.checkpoint.manager import CheckpointManager
from megatron_gptoss.config import ParallelConfig, gpt_oss_tiny
from megatron_gptoss.errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from megatron_gptoss.hf import load_hf, save_hf
from megatron_gptoss.model import build_model

OURS = {"make_vocab_size_divisible_by": 32}  # what config.json does not carry


def payload(text: str):
    def write(directory: Path) -> None:
        (directory / "a.bin").write_bytes(text.encode() * 100)

    return write


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def corrupt(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------------
# Pruning and resume
def test_pruning_after_a_fallback_keeps_the_good_checkpoint(tmp_path):
    first = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        first.save(step, payload(f"s{step}"), {})
    corrupt(tmp_path / "step_000003" / "a.bin")
    restarted = CheckpointManager(tmp_path, keep_last=2)  # a new process: nothing verified yet
    assert restarted.find_resumable() == tmp_path / "step_000002"
    restarted.save(4, payload("s4"), {})
    # 4 and 2 are the two verified ones: the unverified 3 does not push 2 out
    assert names(tmp_path) == ["latest", "step_000002", "step_000003", "step_000004"]
    restarted.save(5, payload("s5"), {})
    assert names(tmp_path) == ["latest", "step_000004", "step_000005"]


def test_resume_auto_with_no_usable_checkpoint_names_each_one(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    assert manager.find_resumable() is None  # an empty directory: a fresh start
    manager.save(1, payload("one"), {})
    manager.save(2, payload("two"), {})
    corrupt(tmp_path / "step_000001" / "a.bin")
    (tmp_path / "step_000002" / "manifest.json").write_text('{"step": 2, "files": {"a.b')  # truncated
    with pytest.raises(CorruptCheckpointError) as err:
        CheckpointManager(tmp_path).find_resumable()
    message = str(err.value)
    assert "2 checkpoint(s) and none can be resumed" in message
    assert "step_000001: " in message and "a.bin: checksum mismatch" in message
    assert "step_000002: " in message and "manifest.json: unreadable, truncated" in message


def test_a_truncated_manifest_is_a_corrupt_checkpoint_error(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, payload("one"), {})
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(CorruptCheckpointError, match="manifest.json: unreadable, truncated or not JSON"):
        CheckpointManager.verify(path)
    (path / "manifest.json").write_text("[]")
    with pytest.raises(CorruptCheckpointError, match="not a checkpoint manifest"):
        CheckpointManager.verify(path)


def test_the_run_id_is_in_the_manifest_and_another_runs_checkpoints_are_not_pruned(tmp_path):
    CheckpointManager(tmp_path, run_id="other").save(1, payload("x"), {})
    mine = CheckpointManager(tmp_path, keep_last=1, run_id="mine")
    for step in (2, 3):
        path = mine.save(step, payload(f"s{step}"), {})
    assert json.loads((path / "manifest.json").read_text())["run_id"] == "mine"
    assert names(tmp_path) == ["latest", "step_000001", "step_000003"]


# ------------------------------------------------------------------------------------------------
# A save that cannot write
def test_a_full_disk_names_itself_removes_the_partial_files_and_keeps_the_last_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, payload("one"), {})

    def fills_the_disk(directory: Path) -> None:
        (directory / "a.bin").write_bytes(b"half written")
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "a.bin"))

    with pytest.raises(CheckpointSaveError) as err:
        manager.save(2, fills_the_disk, {})
    assert "disk full writing " + str(tmp_path / ".step_000002.partial" / "a.bin") in str(err.value)
    assert names(tmp_path) == ["latest", "step_000001"]
    assert manager.find_resumable() == tmp_path / "step_000001"


def test_a_full_disk_while_writing_the_manifest(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(1, payload("one"), {})

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manager_module, "write_manifest", no_space)
    with pytest.raises(CheckpointSaveError, match=r"disk full writing .*step_000002.partial/manifest.json"):
        manager.save(2, payload("two"), {})
    assert names(tmp_path) == ["latest", "step_000001"]


def test_an_unwritable_directory_says_permission_denied(tmp_path, monkeypatch):
    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(CheckpointSaveError, match=f"permission denied writing {tmp_path / 'ckpt'}"):
        CheckpointManager(tmp_path / "ckpt").save(1, payload("one"), {})


# ------------------------------------------------------------------------------------------------
# Export and HF readers


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hygiene") / "hf"
    save_hf(build_model(gpt_oss_tiny(attention_backend="eager"), seed=0), path)
    return path


def test_export_verifies_checksums_unless_told_not_to(hf_dir, tmp_path):
    dist = hf_to_dist(hf_dir, tmp_path / "dist", ParallelConfig(), 1, **OURS, progress=False)
    name = "model.norm.weight"
    stored = read_metadata(dist).storage_data.items()
    (item,) = [v for k, v in stored if k.fqn == "model/decoder.final_layernorm.weight"]
    data = bytearray((dist / item.relative_path).read_bytes())
    ones = torch.ones(32, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()  # the stored norm
    at = data.index(ones, item.offset, item.offset + item.length)
    data[at + 1] ^= 0x40  # a flipped bit inside a stored tensor: still decodes, to a wrong value
    (dist / item.relative_path).write_bytes(bytes(data))
    export = load_script("convert_dist_to_hf").main
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp: checksum mismatch"):
        export([str(dist), str(tmp_path / "out"), "--no-progress"])
    assert not (tmp_path / "out").exists()
    export([str(dist), str(tmp_path / "out"), "--no-progress", "--no-verify"])
    exported = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    original = {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    assert not torch.equal(exported[name], original[name])  # what verification would have stopped


def test_dist_to_hf_names_a_truncated_manifest(hf_dir, tmp_path):
    dist = hf_to_dist(hf_dir, tmp_path / "dist", ParallelConfig(), 1, **OURS, progress=False)
    (dist / "manifest.json").write_text((dist / "manifest.json").read_text()[:40])
    with pytest.raises(CorruptCheckpointError, match="manifest.json: unreadable, truncated"):
        dist_to_hf(dist, tmp_path / "out", progress=False)


def _rewrite_shard(path: Path, edit) -> None:
    """Apply `edit` to the tensors of the (single) shard of the HF directory `path`."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (file,) = set(index["weight_map"].values())
    tensors = load_file(path / file)
    edit(tensors, index["weight_map"], file)
    save_file(tensors, path / file, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_tensor_listed_in_the_index_but_absent_from_its_file_is_named(hf_dir, tmp_path):
    broken = tmp_path / "hf"
    save_hf(load_hf(hf_dir), broken)
    _rewrite_shard(broken, lambda tensors, wm, file: tensors.pop("model.layers.1.self_attn.sinks"))
    pattern = r"'model.layers.1.self_attn.sinks' is listed in the index but absent from .*model.*safetensors"
    with pytest.raises(CheckpointError, match=pattern):
        hf_to_dist(broken, tmp_path / "dist", ParallelConfig(), 1, **OURS, progress=False)
    with pytest.raises(CheckpointError, match=pattern):
        load_hf(broken, **OURS)


def test_a_tensor_the_model_does_not_have_is_named(hf_dir, tmp_path):
    broken = tmp_path / "hf"
    save_hf(load_hf(hf_dir), broken)

    def add(tensors, weight_map, file):
        tensors["model.layers.7.self_attn.sinks"] = tensors["model.layers.1.self_attn.sinks"].clone()
        weight_map["model.layers.7.self_attn.sinks"] = file

    _rewrite_shard(broken, add)
    with pytest.raises(CheckpointError, match="does not have .*'model.layers.7.self_attn.sinks'"):
        hf_to_dist(broken, tmp_path / "dist", ParallelConfig(), 1, **OURS, progress=False)
    assert not (tmp_path / "dist").exists()
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.7.self_attn.sinks'"):
        load_hf(broken, **OURS)
