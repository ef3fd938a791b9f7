"""benchmarks/profile_decode.py at toy size on the CPU: it profiles a decode-only step of every asked mode and
prints the step's kernels (CPU ops here) by time, the median step time, and with --ops the op table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    """benchmarks/profile_decode.py as a module (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "benchmarks/profile_decode.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_profile_decode_tiny_prints_kernels_and_ops(capsys):
    tool = _tool()
    tool.main(["--tiny", "--modes", "off", "--ops", "--top", "5"])
    out = capsys.readouterr().out
    assert "## cuda_graphs=off: 4 rows" in out and "decode-only steps, median" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| kernel")]
    assert 1 <= len(rows) <= 5 and all(float(row.split("|")[2]) >= 0 for row in rows)
    assert "ops of the profiled step:" in out and "aten::" in out


def test_profile_decode_of_the_lora_step_engine(capsys):
    """--expert-format mxfp4-pairs --lora-rank 4 (the LoRA RL step's engine at toy size) decodes and names
    what it profiled."""
    tool = _tool()
    tool.main(
        ["--tiny", "--modes", "off", "--top", "3", "--expert-format", "mxfp4-pairs", "--lora-rank", "4"]
    )
    out = capsys.readouterr().out
    assert "experts mxfp4-pairs, LoRA rank 4" in out and "decode-only steps, median" in out


def test_profile_decode_prefill_phase_times_the_prompt_steps(capsys):
    """--phase prefill --chunk 16: the 48 prompt tokens of the toy run (4 rows of 12) prefill in 3 steps of
    16, all timed, the second profiled."""
    tool = _tool()
    tool.main(["--tiny", "--modes", "off", "--top", "3", "--phase", "prefill", "--chunk", "16"])
    out = capsys.readouterr().out
    assert "48 prompt tokens of 4 rows, 3 prefill steps of up to 16 tokens, median" in out, out
    assert "profiled step: " in out and "| kernel | ms | share |" in out


def test_profile_decode_mixed_phase_times_the_steps_that_prefill_beside_decoding_rows(capsys):
    """--phase mixed: 4 slots, and 4 more prompts that take the slots rows 0-3 free one step apart: each
    prefills in a step of its own beside the decoding rows, and only those 4 steps are timed."""
    tool = _tool()
    tool.main(["--tiny", "--modes", "off", "--top", "3", "--phase", "mixed"])
    out = capsys.readouterr().out
    assert "## cuda_graphs=off: 4 steps that prefill beside decoding rows (4 slots" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| kernel")]
    assert "| kernel | ms | share |" in out and len(rows) == 3  # one of the 4 steps was profiled
