"""User tools that misbehave, for test_agent_inputs.py (named `hostile_tools:NAME` in the agent config and
imported by the tools' worker processes). Standard library only, so a worker starts in milliseconds."""

import os
import re
import signal
import sys
import time

time.sleep(float(os.environ.get("HOSTILE_TOOLS_IMPORT_S", "0")))  # a slow import, where a test asks


def hold_gil(pid_file: str) -> str:
    """Record this process's pid, then backtrack forever in one regular-expression call, which never
    releases the GIL (a thread of the same process could not even be scheduled)."""
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    re.match(r"(a+)+$", "a" * 64 + "b")
    return "unreachable"


def exit_now(code: int) -> str:
    os._exit(code)


def kill_self() -> str:
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


def exit_politely(code: int) -> str:
    sys.exit(code)


def worker_pid() -> int:
    return os.getpid()
