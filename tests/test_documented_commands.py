"""Every file the README, docs/, the package READMEs and benchmarks/RESULTS.md name under tools/,
benchmarks/ or launch/ exists, and every script they run (`python X.py`, `torchrun ... X.py`, and
`python -m megatron_gptoss.train`) answers `--help` with its usage and exit status 0, so no documented
command points at a moved or broken script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "RESULTS.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "megatron_gptoss").glob("*/README.md")),
]
SCRIPT = re.compile(r"\b((?:tools|benchmarks|launch)/[A-Za-z0-9_]+\.py)\b")
LAUNCHER = r"(?:\bpython3?|\btorchrun(?: +--?[\w-]+(?:[ =]\S+)?)*)"  # python, or torchrun and its options
COMMAND = re.compile(LAUNCHER + r" +((?:tools|benchmarks|launch)/\w+\.py)")


def documented(pattern: re.Pattern) -> dict[str, list[str]]:
    """path -> the documents naming it (as `pattern`'s group 1)."""
    found: dict[str, list[str]] = {}
    for doc in DOCUMENTS:
        for script in sorted(set(pattern.findall(doc.read_text()))):
            found.setdefault(script, []).append(str(doc.relative_to(ROOT)))
    return found


def help_of(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )


def test_documents_name_scripts():
    commands = documented(COMMAND)
    assert "tools/convert_hf_to_dist.py" in commands and "benchmarks/bench_train.py" in commands
    assert not [s for s in documented(SCRIPT) if re.match(r"tools/(bench|profile|measure)_", s)]
    in_tools = [p.name for p in (ROOT / "tools").glob("*.py")]
    assert not [name for name in in_tools if re.match(r"(bench|profile|measure)_", name)]


def test_every_documented_script_answers_help():
    missing = {s: docs for s, docs in documented(SCRIPT).items() if not (ROOT / s).is_file()}
    assert not missing, f"documented files that do not exist: {missing}"
    commands = [[s] for s in sorted(documented(COMMAND))] + [["-m", "megatron_gptoss.train"]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(help_of, commands))
    failed = {
        " ".join(cmd): (r.returncode, (r.stderr or r.stdout)[-400:])
        for cmd, r in zip(commands, results)
        if r.returncode != 0 or "usage" not in r.stdout.lower()
    }
    assert not failed, failed


@pytest.mark.parametrize(
    "text,script",
    [
        ("python tools/evaluate.py --help", "tools/evaluate.py"),
        ("python3 benchmarks/bench_x.py --tiny", "benchmarks/bench_x.py"),
        ("torchrun --nproc_per_node 4 benchmarks/bench_train.py", "benchmarks/bench_train.py"),
        ("torchrun --nproc_per_node=2 --master_port 29500 launch/torchrun_rl.py", "launch/torchrun_rl.py"),
    ],
)
def test_the_command_pattern(text, script):
    assert COMMAND.findall(text) == [script]
    assert not COMMAND.findall(f"the module `{script}` holds it")
