"""Run the test suite one folder per process, so that every folder of tests/ is shown to pass alone.

    python3 tools/run_tests.py [pytest args...]

One pytest process over the whole suite cannot show it: a test file can import a module that only another
folder's test put on sys.path, and pass only because that folder was collected first. So this first collects
the whole suite in one process (test module names stay unique, and `python3 -m pytest` keeps working), then
runs each folder of tests/ holding test files, and the top-level test files, each in its own process. It
prints each run's outcome and time, then the slowest tests over all runs, and exits 1 if any run failed.

The arguments go to every pytest run. When one of them names a test path (`tests/ops`,
`tests/rl/test_critic.py::test_x`), pytest runs just those arguments, once, as it would be called directly.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

SLOWEST = 15  # tests listed in the final durations report
NO_TESTS = 5  # pytest's exit status when nothing was collected (a -k that selects nothing in a folder)


@dataclass
class Outcome:
    name: str  # the folder, or "tests/test_*.py"
    status: int  # pytest's exit status
    seconds: float  # wall time of the process
    counts: dict[str, int]  # passed, failed, skipped, errors as the JUnit report has them


def test_groups(tests: Path) -> list[tuple[str, list[str]]]:
    """(name, pytest paths) for each folder under `tests` holding test files (the helpers folder holds none)
    and for the top-level test files; paths relative to the folder above `tests`."""
    root = tests.parent
    groups = []
    for folder in sorted(p for p in tests.iterdir() if p.is_dir()):
        if any(folder.rglob("test_*.py")):
            name = folder.relative_to(root).as_posix()
            groups.append((name, [name]))
    top = sorted(p.relative_to(root).as_posix() for p in tests.glob("test_*.py"))
    if top:
        groups.append((f"{tests.name}/test_*.py", top))
    return groups


def names_a_path(args: list[str], root: Path) -> bool:
    """Whether an argument is a test path (a file or folder, optionally with ::node) rather than an option."""
    return any(not a.startswith("-") and (root / a.split("::")[0]).exists() for a in args)


def run_pytest(args: list[str], root: Path) -> int:
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=root).returncode


def collect_all(args: list[str], root: Path) -> int:
    """Collect the whole suite in one process; prints pytest's count, or all its output on failure."""
    cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", *args]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    print(lines[-1] if done.returncode in (0, NO_TESTS) and lines else done.stdout + done.stderr, flush=True)
    return done.returncode


def junit_cases(path: Path) -> tuple[dict[str, int], list[tuple[float, str]]]:
    """(outcome counts, [(seconds, file::test)]) of one JUnit report (xunit1: each case names its file)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    cases = []
    if not path.exists():  # pytest stopped before writing it (a usage error)
        return counts, cases
    for case in ET.parse(path).iter("testcase"):
        kinds = {child.tag for child in case}
        kind = "failed" if "failure" in kinds else "errors" if "error" in kinds else None
        counts[kind or ("skipped" if "skipped" in kinds else "passed")] += 1
        cases.append((float(case.get("time", 0.0)), f"{case.get('file')}::{case.get('name')}"))
    return counts, cases


def run_groups(root: Path, args: list[str]) -> list[Outcome]:
    outcomes, cases = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, paths) in enumerate(test_groups(root / "tests")):
            print(f"\n===== {name} (alone) =====", flush=True)
            report = Path(tmp) / f"{i}.xml"
            start = time.monotonic()
            junit = [f"--junitxml={report}", "-o", "junit_family=xunit1"]
            status = run_pytest(["-q", "-ra", *junit, *paths, *args], root)
            counts, timed = junit_cases(report)
            outcomes.append(Outcome(name, status, time.monotonic() - start, counts))
            cases += timed
    print(f"\n===== slowest {SLOWEST} tests (setup + call + teardown) =====")
    for seconds, case in sorted(cases, reverse=True)[:SLOWEST]:
        print(f"{seconds:8.2f}s  {case}")
    return outcomes


def report(outcomes: list[Outcome]) -> bool:
    """Print one line per run; True when every run passed (or selected no test)."""
    print("\n===== each folder alone =====")
    ok = True
    for o in outcomes:
        ok &= o.status in (0, NO_TESTS)
        verdict = {0: "ok", NO_TESTS: "no tests"}.get(o.status, f"FAILED (exit {o.status})")
        detail = ", ".join(f"{v} {k}" for k, v in o.counts.items() if v)
        print(f"{o.name:28s} {verdict:18s} {o.seconds:7.1f}s  {detail}")
    print(f"total {sum(o.seconds for o in outcomes):.1f}s")
    return ok


def main(args: list[str], root: Path) -> int:
    if names_a_path(args, root):
        return run_pytest(["-q", "-ra", f"--durations={SLOWEST}", *args], root)
    print("===== the whole suite collects in one process =====", flush=True)
    collected = collect_all(args, root)
    ok = report(run_groups(root, args))
    return 0 if ok and collected in (0, NO_TESTS) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], Path(__file__).resolve().parents[1]))
