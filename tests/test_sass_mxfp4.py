"""benchmarks/sass_mxfp4.py on the CPU: the MXFP4 forward kernel compiled for sm_90 by the installed Triton
(in a child process: the tests' interpreter mode would hand it interpreted functions), its K loop counted.
The checkpoint's bytes are read from shared memory a byte at a time; the shuffled and the pairs byte
formats read them as matrix-unit fragments, and the pairs format decodes with a fraction of the byte
permutes and instructions; at 16 rows a tile nothing spills and several programs share an SM. Guards the
decoding's cost against a change that brings the byte reads or the permutes back; and the forward,
input-gradient and decoding kernels compile for sm_80 and sm_90 in both formats (a compiler failure there
is invisible to the interpreter's tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sass_mxfp4  # noqa: E402

pytestmark = pytest.mark.skipif(not sass_mxfp4.tools_present(), reason="Triton without its CUDA tools")


def _run(args: list[str]) -> tuple[str, dict[tuple[str, str], dict[str, int]]]:
    """sass_mxfp4.py's output and its rows by (layer, byte format), run in a child process with `args`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_mxfp4.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout  # fmt: skip
    header = next(line for line in out.splitlines() if line.startswith("| layer |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(columns) and cells[0] in ("fc1", "fc2"):
            rows[cells[0], cells[1]] = dict(zip(columns[2:], map(int, cells[2:])))
    return out, rows


def test_byte_formats_in_the_compiled_loop():
    out, rows = _run(["--compile-others"])
    for byte_format in ("checkpoint", "pairs"):  # the kernels the interpreter runs but never compiles
        for capability in (80, 90):
            line = f"compiled: forward, input gradient and decoding, {byte_format} bytes, sm_{capability}"
            assert line in out, out
    assert len(rows) == 6, out
    for layer, steps in (("fc1", 16), ("fc2", 8)):  # wgmma's K of 16 over a step of 128, fc1's two halves
        checkpoint, shuffled, pairs = (rows[layer, f] for f in ("checkpoint", "shuffled", "pairs"))
        assert all(r["HGMMA"] == steps for r in (checkpoint, shuffled, pairs))
        assert checkpoint["LDS.U8"] == 4 * steps  # each byte a thread decodes, one shared-memory read
        assert shuffled["LDS.U8"] == 0 and shuffled["LDSM"] == steps // 4
        assert pairs["LDS.U8"] == 0 and pairs["LDSM"] == steps // 4
        assert pairs["PRMT"] <= checkpoint["PRMT"] // 8
        assert pairs["instructions"] <= 0.7 * checkpoint["instructions"]
        assert shuffled["instructions"] < checkpoint["instructions"]
        for row in (checkpoint, shuffled, pairs):  # 16 rows a tile: nothing spilled, several programs an SM
            assert row["spilled bytes"] == 0 and row["programs an SM"] >= 2
            assert 1 <= row["BAR.SYNC"] <= 8  # the stage barrier (its loads seen by all warps), a few more


def test_programs_per_sm_counts_each_limit():
    """Registers (allocated 256 a warp), shared memory (plus 1 KiB a program) and warps each bound it."""
    assert sass_mxfp4.programs_per_sm(224, 64 * 1024, 4) == 2  # 7,168 registers a warp: 2 x 4 warps fit
    assert sass_mxfp4.programs_per_sm(128, 36 * 1024, 4) == 4  # 4,096 a warp: 4 programs of 4 warps
    assert sass_mxfp4.programs_per_sm(40, 100 * 1024, 4) == 2  # shared memory: 2 x 101 KiB of 228
    assert sass_mxfp4.programs_per_sm(32, 1024, 8) == 8  # warps: 64 an SM


def test_a_register_cap_lets_more_programs_share_an_sm():
    """--maxnreg 128 (`Mxfp4Config.maxnreg`) at the pairs' 64-row tiles: fc1 holds at most 128 registers a
    thread and more of its programs fit an SM than the compiler's own choice lets."""
    tiles = ["--formats", "pairs", "--block-m", "64", "--block-k", "64"]
    free, capped = _run(tiles)[1], _run([*tiles, "--maxnreg", "128"])[1]
    fc1, fc1_capped = free["fc1", "pairs"], capped["fc1", "pairs"]
    assert fc1["registers"] > 128 >= fc1_capped["registers"]
    assert fc1_capped["programs an SM"] > fc1["programs an SM"]
    assert fc1_capped["HGMMA"] == fc1["HGMMA"] == 8  # the same products: K step 64, two halves
    assert capped["fc2", "pairs"]["registers"] <= 128
