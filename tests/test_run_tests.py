"""tools/run_tests.py on a small suite of its own: a folder that passes only when another folder's tests were
collected before it passes in one pytest process over the whole suite, and fails when run alone."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "run_tests.py"


@pytest.fixture
def run_tests(monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the suites here need none: 0.2 s a process
    spec = importlib.util.spec_from_file_location("run_tests", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_tests"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["run_tests"]


def suite(root: Path) -> Path:
    """tests/a (a test and the module it imports), tests/b (a test importing tests/a's module by its bare
    name, as tests/a's directory on sys.path allows once tests/a is collected), a top-level test file."""
    tests = root / "tests"
    for folder in ("a", "b"):
        (tests / folder).mkdir(parents=True)
    (tests / "a" / "shared_a.py").write_text("VALUE = 3\n")
    test = "from shared_a import VALUE\n\n\ndef test_value():\n    assert VALUE == 3\n"
    for name in ("a/test_a.py", "b/test_b.py"):
        (tests / name).write_text(test)
    (tests / "test_top.py").write_text("def test_sum():\n    assert sum([1, 2]) == 3\n")
    return tests


def folder_lines(out: str) -> dict[str, str]:
    summary = out.split("===== each folder alone =====")[1]
    return {line.split()[0]: line for line in summary.strip().splitlines()[:-1]}


def test_a_folder_that_needs_another_folder_fails_alone(tmp_path, capfd, run_tests):
    tests = suite(tmp_path)
    assert [name for name, _ in run_tests.test_groups(tests)] == ["tests/a", "tests/b", "tests/test_*.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", str(tests)]
    whole = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stdout  # one process over the suite cannot see it

    assert run_tests.main([], tmp_path) == 1
    lines = folder_lines(capfd.readouterr().out)
    assert set(lines) == {"tests/a", "tests/b", "tests/test_*.py"}
    assert " ok " in lines["tests/a"] and "1 passed" in lines["tests/a"]
    assert "FAILED" in lines["tests/b"] and " ok " in lines["tests/test_*.py"]

    (tests / "b" / "shared_a.py").write_text("VALUE = 3\n")  # tests/b carries what it imports
    assert run_tests.main([], tmp_path) == 0
    out = capfd.readouterr().out
    assert all(" ok " in line for line in folder_lines(out).values())
    assert "slowest 15 tests" in out and "tests/b/test_b.py::test_value" in out


def test_a_named_path_runs_alone_and_options_reach_every_folder(tmp_path, capfd, run_tests):
    suite(tmp_path)
    assert run_tests.main(["tests/a", "-k", "value"], tmp_path) == 0  # the path alone, in one process
    out = capfd.readouterr().out
    assert "1 passed" in out and "slowest 15 durations" in out  # pytest's own --durations report
    assert run_tests.main(["tests/b/test_b.py"], tmp_path) != 0
    capfd.readouterr()
    assert run_tests.main(["-k", "sum"], tmp_path) == 1  # tests/b still fails to import
    lines = folder_lines(capfd.readouterr().out)
    assert "no tests" in lines["tests/a"] and " ok " in lines["tests/test_*.py"]
