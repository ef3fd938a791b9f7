"""benchmarks/step_probe.py on the CPU: the per-step table (times, host times, clock samples falling inside
each step, the allocator columns), the spread and its flag over 5%, and `time_steps` marking each step."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_train_peer as peer  # noqa: E402
import step_probe  # noqa: E402


def test_spread_and_flag():
    assert step_probe.spread_pct([0.1]) == 0.0
    assert abs(step_probe.spread_pct([1.0, 1.2, 1.1]) - 100.0 * 0.2 / 1.1) < 1e-9
    lines: list[str] = []
    probe = step_probe.StepProbe(torch.device("cpu"))
    for _ in range(3):
        probe.begin()
        probe.launched()
        probe.end()
    assert probe.report([0.100, 0.101, 0.102], print_fn=lines.append) < 5.0
    assert "unsteady" not in lines[-1]
    lines.clear()
    assert probe.report([0.100, 0.130, 0.101], print_fn=lines.append) > 5.0
    assert "unsteady" in lines[-1] and "median 101.00 ms" in lines[-1]
    assert len(lines) == 2 + 3 + 1  # header, rule, one row per step, the summary


def test_clock_samples_are_assigned_to_their_step():
    """Samples (nvidia-smi's CSV lines) count in the step whose wall-clock interval holds them."""
    probe = step_probe.StepProbe(torch.device("cpu"))
    probe.steps = [step_probe._Step(100.0, 100.5, 0.2), step_probe._Step(101.0, 101.5, 0.3)]
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(100))
    stamp2 = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(101))
    probe._log.write(
        f"{stamp}.200, 1980, 3201, 300.5, 40, 0x0000000000000000\n"
        f"{stamp}.400, 1700, 3201, 650.0, 41, 0x0000000000000004\n"
        f"{stamp2}.100, 1965, 3201, 310.0, 41, 0x0000000000000000\n"
        "not a sample line\n"
    )
    probe._log.flush()
    lines: list[str] = []
    probe.report([0.5, 0.5], print_fn=lines.append)
    first, second = lines[2], lines[3]
    assert "| 1700-1980 |" in first and "| 650 |" in first and "0x0000000000000004" in first
    assert "| 200.00 |" in first  # host time
    assert "| 1965-1965 |" in second and "| none |" in second


def test_time_steps_marks_each_step():
    calls = []

    class Probe:
        def begin(self):
            calls.append("begin")

        def launched(self):
            calls.append("launched")

        def end(self):
            calls.append("end")

    times = peer.time_steps(lambda: calls.append("step"), 1, 2, torch.device("cpu"), probe=Probe())
    assert len(times) == 2
    assert calls == ["begin", "step", "launched", "end"] * 3
