"""Bad input to the conversion and evaluation tools (tools/convert_hf_to_dist.py, convert_dist_to_hf.py,
evaluate.py) ends in one line naming the problem and exit status 1, never a traceback; and whatever they
read is verified: a safetensors file whose bytes were flipped (NaN or inf values), whose header gives a
tensor another shape or dtype, or an MXFP4 scale byte that decodes to NaN, fails naming the file and the
tensor; a sharded checkpoint fails its checksums, or, checksums rewritten, its non-finite values.

The cases run each tool's `__main__` block in this process; one subprocess per tool checks the real exit
status and standard error.
"""

from __future__ import annotations

import json
import runpy
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_gptoss.checkpoint.dist_convert import hf_to_dist
from megatron_gptoss.checkpoint.manager import file_sha256
from megatron_gptoss.config import ParallelConfig, gpt_oss_tiny
from megatron_gptoss.errors import CorruptCheckpointError
from megatron_gptoss.hf import load_hf, quantize_mxfp4, save_hf
from megatron_gptoss.hf.io import iter_checkpoint, read_config
from megatron_gptoss.model import build_model

REPO = Path(__file__).resolve().parents[2]
OURS = ["--make-vocab-size-divisible-by", "32"]  # what config.json does not carry
NORM = "model.norm.weight"


def _single_shard(path: Path) -> Path:
    (file,) = sorted(path.glob("*.safetensors"))
    return file


def _rewrite(path: Path, edit) -> None:
    """Apply `edit` to the tensors of the HF directory `path`'s single shard."""
    file = _single_shard(path)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _flip_to_nan(file: Path, name: str, element: int) -> None:
    """Overwrite element `element` of bf16 tensor `name` in the safetensors `file` with NaN's bytes."""
    data = bytearray(file.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    start = 8 + length + json.loads(data[8 : 8 + length])[name]["data_offsets"][0] + 2 * element
    data[start : start + 2] = b"\xc0\x7f"
    file.write_bytes(bytes(data))


def _mxfp4(path: Path, source: Path) -> None:
    """`source` with its expert weights as MXFP4, one scale byte 255 (NaN in E8M0)."""
    shutil.copytree(source, path)
    file = _single_shard(path)
    tensors = {}
    for name, tensor in load_file(file).items():
        if name.endswith(("gate_up_proj", "down_proj")):
            blocks, scales = quantize_mxfp4(tensor.float().transpose(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            tensors[name] = tensor
    tensors["model.layers.0.mlp.experts.down_proj_scales"][0, 0, 0] = 255
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(tensors, file.name)}))
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF directory, its sharded checkpoint, and broken copies of both."""
    root = tmp_path_factory.mktemp("tool_inputs")
    good = save_hf(build_model(gpt_oss_tiny(attention_backend="eager"), seed=0), root / "hf")
    dist = hf_to_dist(
        good, root / "dist", ParallelConfig(), 1, make_vocab_size_divisible_by=32, progress=False
    )
    paths = {"hf": good, "dist": dist, "missing": root / "missing", "out": root / "out"}
    (root / "out").mkdir()
    for name in ("no_config", "config_not_json", "shard_missing", "shard_truncated", "flipped"):
        paths[name] = Path(shutil.copytree(good, root / name))
    for name in ("wrong_shape", "wrong_dtype"):
        paths[name] = Path(shutil.copytree(good, root / name))
    (paths["no_config"] / "config.json").unlink()
    (paths["config_not_json"] / "config.json").write_text("{not json")
    _single_shard(paths["shard_missing"]).unlink()
    with open(_single_shard(paths["shard_truncated"]), "r+b") as f:
        f.truncate(1000)
    _flip_to_nan(_single_shard(paths["flipped"]), NORM, 3)
    _rewrite(paths["wrong_shape"], lambda t: t.update({NORM: torch.ones(t[NORM].numel() + 1)}))
    _rewrite(paths["wrong_dtype"], lambda t: t.update({NORM: torch.ones(t[NORM].shape, dtype=torch.int32)}))
    _mxfp4(root / "mxfp4_nan", good)
    paths["mxfp4_nan"] = root / "mxfp4_nan"
    paths["dist_corrupt"] = Path(shutil.copytree(dist, root / "dist_corrupt"))
    stored = paths["dist_corrupt"] / "__0_0.distcp"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    paths["dist_nan"] = Path(shutil.copytree(dist, root / "dist_nan"))  # NaN, checksums rewritten
    stored = paths["dist_nan"] / "__0_0.distcp"
    data = bytearray(stored.read_bytes())
    at = data.index(torch.ones(32, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())  # a norm
    data[at : at + 2] = b"\xc0\x7f"
    stored.write_bytes(bytes(data))
    manifest = json.loads((paths["dist_nan"] / "manifest.json").read_text())
    manifest["files"]["__0_0.distcp"] = file_sha256(stored)
    (paths["dist_nan"] / "manifest.json").write_text(json.dumps(manifest))
    paths["root_unusable"] = root / "root_unusable"  # a checkpoint root whose only checkpoint is corrupt
    shutil.copytree(paths["dist_corrupt"], paths["root_unusable"] / "step_000000")
    (paths["root_unusable"] / "latest").write_text("step_000000")
    return paths


H2D, D2H, EVAL = "convert_hf_to_dist", "convert_dist_to_hf", "evaluate"
CASES = {  # tool, its arguments (named inputs in braces), the error class, words of the message
    "h2d_missing_input": (H2D, ["{missing}", "{missing}x", *OURS], "CheckpointError", "has no config.json"),
    "h2d_no_config": (H2D, ["{no_config}", "{missing}", *OURS], "CheckpointError", "has no config.json"),
    "h2d_config_not_json": (
        H2D,
        ["{config_not_json}", "{missing}", *OURS],
        "CheckpointError",
        "config.json is not a valid GPT-OSS config",
    ),
    "h2d_shard_missing": (H2D, ["{shard_missing}", "{missing}", *OURS], "CheckpointError", "does not exist"),
    "h2d_shard_truncated": (
        H2D,
        ["{shard_truncated}", "{missing}", *OURS],
        "CheckpointError",
        "cannot read safetensors file",
    ),
    "h2d_existing_output": (H2D, ["{hf}", "{out}", *OURS], "ConfigError", "out exists; choose a new"),
    "h2d_bad_layout": (
        H2D,
        ["{hf}", "{missing}", "--tp", "3", "--world", "3", *OURS],
        "LayoutError",
        "num_attention_heads=4 not divisible by tp=3",
    ),
    "h2d_flipped_bytes": (
        H2D,
        ["{flipped}", "{missing}", *OURS],
        "CorruptCheckpointError",
        f"model-00001-of-00001.safetensors: tensor '{NORM}' holds 1 non-finite value(s) (NaN or inf), "
        "the first at [3]",
    ),
    "h2d_wrong_shape": (
        H2D,
        ["{wrong_shape}", "{missing}", *OURS],
        "CheckpointError",
        f"model-00001-of-00001.safetensors: tensor '{NORM}' has shape (33,), expected (32,)",
    ),
    "h2d_wrong_dtype": (
        H2D,
        ["{wrong_dtype}", "{missing}", *OURS],
        "CorruptCheckpointError",
        f"tensor '{NORM}' has dtype torch.int32, expected a floating-point dtype",
    ),
    "h2d_mxfp4_nan_scale": (
        H2D,
        ["{mxfp4_nan}", "{missing}", *OURS],
        "CorruptCheckpointError",
        "tensor 'model.layers.0.mlp.experts.down_proj_scales' holds 32 non-finite value(s)",
    ),
    "d2h_missing_input": (D2H, ["{missing}", "{missing}x"], "CheckpointError", "missing does not exist"),
    "d2h_not_a_checkpoint": (D2H, ["{hf}", "{missing}"], "CorruptCheckpointError", "no manifest.json"),
    "d2h_checksum": (D2H, ["{dist_corrupt}", "{missing}"], "CorruptCheckpointError", "checksum mismatch"),
    "d2h_nan_values": (
        D2H,
        ["{dist_nan}", "{missing}"],
        "CorruptCheckpointError",
        "layernorm.weight' holds 1 non-finite value(s) (NaN or inf), the first at [0]",
    ),
    "d2h_existing_output": (D2H, ["{dist}", "{out}"], "ConfigError", "out exists; choose a new"),
    "d2h_no_usable_checkpoint": (
        D2H,
        ["{root_unusable}", "{missing}"],
        "CorruptCheckpointError",
        "step_000000",
    ),
    "eval_missing_checkpoint": (
        EVAL,
        ["--checkpoint", "{missing}", "--output", "{missing}/s.jsonl"],
        "ConfigError",
        "neither an HF directory",
    ),
    "eval_corrupt_checkpoint": (
        EVAL,
        ["--checkpoint", "{dist_corrupt}", "--output", "{missing}/s.jsonl"],
        "CorruptCheckpointError",
        "checksum mismatch",
    ),
    "eval_output_is_a_directory": (
        EVAL,
        ["--checkpoint", "{hf}", "--output", "{out}"],
        "ConfigError",
        "out is a directory; name a file",
    ),
    "eval_config_not_yaml": (
        EVAL,
        [
            "--checkpoint",
            "{hf}",
            "--output",
            "{missing}/s.jsonl",
            "--config",
            "{hf}/model-00001-of-00001.safetensors",
        ],
        "ConfigError",
        "--config",
    ),
}


def _argv(arguments: list[str], inputs: dict[str, Path]) -> list[str]:
    return [a.format(**inputs) for a in arguments] + ["--no-progress"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_ends_in_one_line_and_exit_1(case, inputs, capsys, monkeypatch):
    tool, arguments, error, words = CASES[case]
    script = REPO / "tools" / f"{tool}.py"
    monkeypatch.setattr(sys, "argv", [str(script), *_argv(arguments, inputs)])
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(script), run_name="__main__")
    assert ended.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{tool}.py: {error}: "), lines
    assert words in lines[0], lines[0]
    assert not inputs["missing"].exists() and not list(inputs["out"].iterdir())  # nothing written


@pytest.mark.parametrize("case", ["h2d_flipped_bytes", "d2h_checksum", "eval_output_is_a_directory"])
def test_the_process_exits_1_with_one_line(case, inputs):
    tool, arguments, error, words = CASES[case]
    argv = [sys.executable, str(REPO / "tools" / f"{tool}.py"), *_argv(arguments, inputs)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{tool}.py: {error}: ") and words in lines[0]


def test_every_hf_reader_verifies_what_it_reads(inputs):
    """load_hf and iter_checkpoint (what evaluate.py streams into its engine) verify as the tools do."""
    config = read_config(inputs["hf"], make_vocab_size_divisible_by=32)
    for name, words in (
        ("flipped", f"'{NORM}' holds 1 non-finite"),
        ("mxfp4_nan", "down_proj_scales' holds"),
    ):
        with pytest.raises(CorruptCheckpointError, match=words):
            list(iter_checkpoint(inputs[name], config, torch.float32))
        with pytest.raises(CorruptCheckpointError, match=words):
            load_hf(inputs[name], make_vocab_size_divisible_by=32)
    load_hf(inputs["hf"], make_vocab_size_divisible_by=32)  # the good directory passes
