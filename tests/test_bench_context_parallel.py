"""benchmarks/bench_context_parallel.py at toy widths on the CPU (2 gloo ranks): one document per cp group at
cp 1 (dp 2) and cp 2 (zig-zag chunks over both ranks) trains, and each run appends its JSON line: layout,
document length, step time, model FLOPs per second and the estimate (a cp 2 rank holds half the tokens)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cp1_and_cp2_runs_report_their_layout_and_estimate(tmp_path):
    out = tmp_path / "cp.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for cp in (1, 2):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(ROOT / "benchmarks/bench_context_parallel.py"), "--small", "--cp", str(cp),
                   "--iters", "2", "--out", str(out)]  # fmt: skip
        subprocess.run(command, check=True, env=env, cwd=tmp_path, timeout=300)
    cp1, cp2 = (json.loads(line) for line in out.read_text().splitlines())
    assert (cp1["layout"], cp2["layout"]) == ("cp1 ep2 dp2", "cp2 ep2 dp1")
    for result in (cp1, cp2):
        assert result["doc_tokens"] == 512 and result["activation_checkpointing"]
        assert result["fwd_bwd_ms"] > 0 and result["model_tflops_per_gpu"] > 0 and result["estimated_gib"] > 0
    assert cp2["estimated_gib"] < cp1["estimated_gib"]
