"""Reading a run's metrics log in tests."""

from __future__ import annotations

import json
from pathlib import Path


def logged(out: Path) -> dict[int, dict]:
    """The lines of `out/metrics.jsonl` by step; fails when a step is logged twice or out of order."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {line["step"]: line for line in lines}
