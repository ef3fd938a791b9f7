"""What each timed step of a benchmark ran under: the GPU's clocks, power and clock-limit reasons (sampled by
`nvidia-smi` every few milliseconds in a background process) and the caching allocator's device
allocations, frees and retries during the step. A benchmark whose step times spread prints this table to
tell a slow clock (the machine) from a host stall or the allocator (ours).

    probe = StepProbe(device)          # starts the sampler where nvidia-smi exists (CUDA only)
    for each step: probe.begin(); step(); sync; probe.end()
    probe.report(times)                # one row per step, then the spread and a flag over SPREAD_LIMIT_PCT
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime

import torch

SPREAD_LIMIT_PCT = 5.0  # (max - min) / median of the timed steps above this is flagged
_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer name first
_ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def spread_pct(times: list[float]) -> float:
    """(max - min) / median of `times`, in percent (0 for fewer than two)."""
    if len(times) < 2:
        return 0.0
    return 100.0 * (max(times) - min(times)) / statistics.median(times)


@dataclass
class _Step:
    start: float
    end: float = 0.0
    host: float = 0.0  # seconds until the step's Python returned (its launches queued), before the sync
    alloc: dict[str, int] = field(default_factory=dict)


class StepProbe:
    """Per-step clocks and allocator activity (module doc). On the CPU, or without nvidia-smi, only the
    allocator columns (CUDA) or nothing is recorded; `report` still prints the times and the spread."""

    def __init__(self, device: torch.device, period_ms: int = 20):
        self.device = device
        self.steps: list[_Step] = []
        self._samples: list[tuple[float, list[str]]] | None = None
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        if device.type == "cuda" and shutil.which("nvidia-smi"):
            index = device.index if device.index is not None else torch.cuda.current_device()
            for reasons in _REASONS:
                cmd = ["nvidia-smi", "-i", str(index), f"--query-gpu={_FIELDS},{reasons}",
                       "--format=csv,noheader,nounits", f"-lms={period_ms}"]  # fmt: skip
                self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.DEVNULL)
                time.sleep(0.3)
                if self._proc.poll() is None:
                    break
                self._proc = None

    def _alloc(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {k: int(stats.get(k, 0)) for k in _ALLOC_KEYS}

    def begin(self) -> None:
        self.steps.append(_Step(time.time(), alloc=self._alloc()))

    def launched(self) -> None:
        """The step's Python returned: its launches are queued (the host time; a step whose host time is
        its wall time is bound by the host, or waited for the device inside)."""
        step = self.steps[-1]
        step.host = time.time() - step.start

    def end(self) -> None:
        step = self.steps[-1]
        step.end = time.time()
        after = self._alloc()
        step.alloc = {k: after[k] - step.alloc.get(k, 0) for k in after}

    def _read_samples(self) -> list[tuple[float, list[str]]]:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._proc = None
        if self._samples is None:
            self._samples = []
            self._log.seek(0)
            for line in self._log.read().splitlines():
                parts = [p.strip() for p in line.split(",")]
                try:
                    stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                except ValueError:
                    continue
                self._samples.append((stamp, parts[1:]))
        return self._samples

    def report(self, times: list[float], name: str = "step", print_fn=print) -> float:
        """Print one row per timed step (the last len(times) steps begun) and the spread; returns it."""
        samples = self._read_samples()
        steps = self.steps[-len(times) :] if times else []
        columns = "ms | host ms | SM MHz | mem MHz | W max | limit reasons | cudaMalloc/Free | retries"
        print_fn(f"| {name} | {columns} |")
        print_fn("|---|---|---|---|---|---|---|---|---|")
        for i, (t, step) in enumerate(zip(times, steps)):
            inside = [s for stamp, s in samples if step.start <= stamp <= step.end]
            if inside:
                sm = [float(s[0]) for s in inside]
                mem = statistics.median(float(s[1]) for s in inside)
                watts = max(float(s[2]) for s in inside)
                reasons = sorted({s[4] for s in inside if len(s) > 4 and s[4] not in ("0x0000000000000000",)})
                clock = f"{min(sm):.0f}-{max(sm):.0f}"
                extra = f"{mem:.0f} | {watts:.0f} | {' '.join(reasons) or 'none'}"
            else:
                clock, extra = "-", "- | - | -"
            a = step.alloc
            alloc = f"{a.get('num_device_alloc', '-')}/{a.get('num_device_free', '-')}"
            retries = a.get("num_alloc_retries", "-")
            times_ms = f"{t * 1e3:.2f} | {step.host * 1e3:.2f}"
            print_fn(f"| {i} | {times_ms} | {clock} | {extra} | {alloc} | {retries} |")
        spread = spread_pct(times)
        flag = f"  ** over {SPREAD_LIMIT_PCT:.0f}%: unsteady **" if spread > SPREAD_LIMIT_PCT else ""
        median = statistics.median(times) * 1e3 if times else float("nan")
        print_fn(f"{name}: median {median:.2f} ms, spread (max - min) / median {spread:.1f}%{flag}")
        return spread
