"""benchmarks/profile_decode.py at toy size on the CPU: it profiles a decode-only step of every asked mode and
prints the step's kernels (CPU ops here) by time, the median step time, and with --ops the op table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


def test_profile_decode_slot_counts_side_by_side(capsys):
    """--slots 2,4: one profiled step per slot count, then their kernels side by side, each row's times those
    of that kernel in the per-count tables, its ratio theirs, and the total row the tables' totals."""
    tool = _tool()
    tool.main(["--tiny", "--slots", "2,4", "--modes", "off", "--top", "4"])
    out = capsys.readouterr().out
    assert "## cuda_graphs=off: 2 rows" in out and "## cuda_graphs=off: 4 rows" in out
    head, growth = out.split("## cuda_graphs=off: the profiled step's kernels at 2, 4 slots\n")
    assert growth.startswith("| kernel | ms at 2 | ms at 4 | x 4 / 2 | growth / rows |")
    rows = [line.split("|")[1:-1] for line in growth.splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == 5 and rows[-1][0].strip() == "all kernels"
    totals = [float(part.split(" ms of kernel time")[0]) for part in head.split("profiled step: ")[1:]]
    assert [float(cell) for cell in rows[-1][1:3]] == pytest.approx(totals, abs=6e-3)  # .2f there
    for _name, at2, at4, ratio, growth_per_row in rows:
        at2, at4 = float(at2), float(at4)
        assert at4 > 0
        if at2 > 0.02:  # printed to 3 places: the ratio of the rounded cells is close to the printed one
            assert float(ratio) == pytest.approx(at4 / at2, rel=0.05, abs=0.02)
            assert float(growth_per_row) == pytest.approx(float(ratio) - 1, abs=1e-2)


class _Event:
    def __init__(self, name: str, start: float, end: float, device: str):
        self.name, self.device_type = name, f"DeviceType.{device}"
        self.time_range = type("Range", (), {"start": start, "end": end})()


def test_idle_report_merges_device_spans_and_names_the_long_gaps():
    """Device spans 0-10, 5-12 (overlapping), 15-20, 100-110 (us) over 2 steps: span 110, busy 12 + 5 + 10,
    idle 3 (under 20 us) and 80 (one long gap, 20 -> 100, with the host call that covers it and k4 after)."""
    tool = _tool()
    events = [
        _Event("k1", 0, 10, "CUDA"), _Event("k2", 5, 12, "CUDA"), _Event("k3", 15, 20, "CUDA"),
        _Event("k4", 100, 110, "CUDA"), _Event("plan_ahead", 18, 90, "CPU"), _Event("other", 200, 300, "CPU"),
    ]  # fmt: skip
    prof = type("Prof", (), {"events": lambda self: events})()
    report = tool.idle_report(prof, steps=2)
    head, table = report.split("\n", 1)
    assert head == ("device over 2 steps (per step): span 0.06 ms, busy 0.01 ms, idle 0.04 ms: 0.00 ms in 1 "
                    "gaps under 20 us, 0.04 ms in 1 longer")  # fmt: skip
    assert table.splitlines()[2] == "| 80 | 0.02 | plan_ahead (70) | k4 |"


def test_profile_decode_window_times_steps_without_syncs(capsys):
    """--window 3: the decode-only steps timed call to call, 3 of them profiled together (on the CPU no
    device events: the report says so)."""
    tool = _tool()
    tool.main(["--tiny", "--modes", "off", "--top", "3", "--window", "3"])
    out = capsys.readouterr().out
    assert "decode-only steps, median" in out and "profiled step: " in out
    assert "the 3 profiled steps launched as in a rollout, no sync between them: no device events" in out
