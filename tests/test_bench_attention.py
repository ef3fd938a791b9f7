"""benchmarks/bench_attention.py --paged at toy size on the CPU (interpreter, fp32): every tile of the sweep
and the decode tile run on the same paged rows; the decode tile is the reference's bits (error 0), a tile
over another key block is not, and each printed row names its keys, window and tile."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
def test_paged_sweep_times_every_tile_against_the_decode_tile(capsys):
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "benchmarks/bench_attention.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls = []

    def timer(fn):
        calls.append(fn)
        return 1.0

    rows = tool.paged_sweep(2, [40], torch.device("cpu"), torch.float32, timer, hq=4, hkv=2, d=16, page=4)
    assert len(rows) == len(calls) == 2 * (1 + len(tool.PAGED_TILES))  # full and window 128, every tile
    for window in (None, 128):
        mine = [r for r in rows if r["window"] == window]
        assert mine[0]["tile"] == "decode tile" and mine[0]["error"] == 0.0
        assert all(r["error"] < 1e-5 for r in mine)  # fp32 under the interpreter: every tile within rounding
    other_keys = [r for r in rows if r["tile"].startswith("16 x 32 keys") and r["window"] is None]
    assert other_keys and other_keys[0]["error"] > 0  # another key block: another order of the sums
    out = capsys.readouterr().out
    assert "| 40 | None | decode tile | 1000.0 |" in out and "| 40 | 128 | decode tile |" in out
