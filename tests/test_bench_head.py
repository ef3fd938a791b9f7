"""benchmarks/bench_head.py's CPU smoke test: each variant's log-probs, entropy and gradients agree with the
unchunked peer in the same run, and a frozen head's weight gets no gradient."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_head  # noqa: E402


def test_bench_head_small():
    out = bench_head.main(["--small", "--tolerance", "1e-5"])
    rows = {(r["variant"], r["head"]): r for r in out["rows"]}
    assert set(rows) == {
        (v, h) for v in ("peer: unchunked", "pytorch chunks") for h in ("trainable", "frozen")
    }
    assert rows[("peer: unchunked", "trainable")]["max_rel_err"] == 0.0
    assert all(r["max_rel_err"] <= 1e-5 and r["ms"] > 0 for r in rows.values())
