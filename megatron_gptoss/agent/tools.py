"""The tools a model may call: the built-in `python` (harmony's built-in recipient, over `run_python`),
a calculator, and user function tools from `agent.tools` (`module:function` with a JSON schema).

Function tools are described to the model in the developer message as harmony's `functions` namespace;
the python tool in the system message. `ToolRegistry.prompt_keywords()` gives `render_prompt` both.

User functions run in worker processes (`ToolWorkers`, `tool_worker.py`), one call at a time each, so
whatever a function does (hold the GIL, hang, call `os._exit`, crash the interpreter) costs at most its
call: at its timeout the worker is killed, and a worker that dies answers its call with an error.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from megatron_gptoss.agent import calculator
from megatron_gptoss.agent.sandbox import PythonResult, SandboxLauncher, run_python
from megatron_gptoss.config.agent import AgentConfig, SandboxConfig
from megatron_gptoss.errors import ConfigError, ToolError

PYTHON = "python"
PYTHON_DESCRIPTION = (
    "Use this tool to execute Python code in your chain of thought. The code will not be shown to the "
    "user.\n\nWhen you send a message containing Python code to python, it is run as a fresh program in "
    "a sandbox: nothing is kept between calls, there is no network, and files can be written only in the "
    "working directory. python responds with what the program printed (stdout, then stderr) or times out "
    "after {timeout:g} seconds. Print what you want to see."
)


WORKER_SCRIPT = Path(__file__).with_name("tool_worker.py")
WORKER_START_S = 60.0  # seconds a tool worker may take to start and import the user functions


class ToolTimeout(Exception):
    """Raised by a tool's `run` that stopped at its timeout; the message is what the model reads."""


class ToolFailed(Exception):
    """Raised by a tool's `run` when the user function raised in its worker, or the worker died; the
    message (`Type: message`, or how the worker ended) is what the model reads after `NAME failed: `."""


@dataclass(frozen=True)
class Tool:
    """One tool. `name` is the recipient the model writes (`python`, `functions.lookup`); `run` takes the
    parsed arguments (a dict for a function tool, the code for python) and the timeout in seconds and
    returns the text the model reads. With `reports_start` (a user tool, whose worker may have to start
    first) `run` takes a third argument, a function it calls once the tool begins to run: the call's
    timeout counts from then."""

    name: str
    description: str
    parameters: Mapping[str, Any] | None
    run: Callable[..., str]
    reports_start: bool = False

    @property
    def builtin(self) -> bool:
        return not self.name.startswith("functions.")


def python_tool(limits: SandboxConfig, launcher: SandboxLauncher | None, timeout_s: float) -> Tool:
    def run(code: str, timeout: float) -> str:
        result = run_python(code, timeout_s=timeout, limits=limits, launcher=launcher)
        if result.timed_out:
            raise ToolTimeout(python_output(result))
        return python_output(result)

    return Tool(PYTHON, PYTHON_DESCRIPTION.format(timeout=timeout_s), None, run)


def python_output(result: PythonResult) -> str:
    """What the model reads of a sandboxed run: stdout, then stderr, then how it ended if not cleanly."""
    text = result.stdout + result.stderr
    if result.timed_out:
        text += "\n[timed out]"
    elif result.truncated:
        text += "\n[output truncated]"
    elif result.out_of_memory:
        text += "\n[stopped: out of memory]"
    elif result.out_of_disk:
        text += "\n[stopped: out of disk space]"
    elif result.exit_code is not None and result.exit_code < 0:
        text += f"\n[killed by signal {-result.exit_code}]"
    return text


def calculator_tool() -> Tool:
    def run(arguments: dict, timeout: float) -> str:
        return calculator.calculator(arguments["expression"])

    return Tool("functions.calculator", calculator.DESCRIPTION, calculator.PARAMETERS, run)


def resolve_function(spec: str, where: str) -> Callable[..., Any]:
    """The callable named by `module:function`; ConfigError naming `where` when it cannot be imported."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}={spec!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"{where}={spec!r} is not callable")
    return fn


def user_tool(spec: Mapping[str, Any], where: str, workers: ToolWorkers) -> Tool:
    """A function tool from an `agent.tools` entry, run by `workers`; its function gets the arguments as
    keywords and returns a string (as is) or a JSON-serialisable value (as JSON). The function is imported
    here first, so a wrong name is a ConfigError before any worker starts."""
    resolve_function(spec["function"], f"{where}.function")
    name, function = f"functions.{spec['name']}", spec["function"]

    def run(arguments: dict, timeout: float, started: Callable[[], None]) -> str:
        return workers.call(name, function, arguments, timeout, started)

    return Tool(name, spec.get("description", ""), spec.get("parameters"), run, reports_start=True)


class _Stop(Exception):
    """A worker passed the deadline (`died` False) or ended (`died` True, `code` its exit status)."""

    def __init__(self, died: bool, code: int | None = None):
        super().__init__(died, code)
        self.died, self.code = died, code


class _Worker:
    """One tool worker process and its two pipes (raw, non-blocking writes; reads of whole lines)."""

    def __init__(self, functions: Sequence[str]):
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group: a kill reaches what it started
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin.fileno(), self.process.stdout.fileno()
        self.started = time.monotonic()
        self.ready = False
        self.buffer = b""
        init = {"path": sys.path, "functions": list(functions), "parent": os.getpid()}
        os.set_blocking(self.stdin, False)
        try:
            self.send(json.dumps(init).encode() + b"\n", self.started + WORKER_START_S)
        except _Stop:  # it ended at once: its first answer reads the end and says so
            pass

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            if not _ready(self.stdin, select.POLLOUT, deadline):
                raise _Stop(died=False)
            try:
                view = view[os.write(self.stdin, view) :]
            except BrokenPipeError:
                raise _Stop(died=True, code=self.wait()) from None

    def receive(self, deadline: float) -> dict:
        while b"\n" not in self.buffer:
            if not _ready(self.stdout, select.POLLIN, deadline):
                raise _Stop(died=False)
            chunk = os.read(self.stdout, 1 << 16)
            if not chunk:
                raise _Stop(died=True, code=self.wait())
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def wait(self) -> int | None:
        """The exit status of a worker that closed its answers (killed after a second if it lingers)."""
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.returncode

    def kill(self) -> None:
        _kill(self.process)


def _ready(fd: int, event: int, deadline: float) -> bool:
    """Whether `fd` is ready for `event` (or closed) before `deadline`."""
    poll = select.poll()
    poll.register(fd, event)
    return bool(poll.poll(max(0.0, deadline - time.monotonic()) * 1000))


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL to the worker's process group, then reap it (a reaped pid is never signalled again) and
    close its pipes."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


def _ended(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"


def _kill_all(processes: set, owner: int) -> None:
    if os.getpid() == owner:  # a forked child never kills its parent's workers
        for process in list(processes):
            _kill(process)


class ToolWorkers:
    """Worker processes running user function tools, one call at a time each; thread-safe.

    `call(name, function, arguments, timeout, started)` takes an idle worker (or starts one: `python -I
    tool_worker.py`, which imports every function of `functions` once), waits until it is ready, calls
    `started()`, sends it the call and waits at most `timeout` seconds for its answer:
      - the function's text: returned (the worker is idle again);
      - it raised: ToolFailed("Type: message");
      - the timeout passed: the worker is killed (with whatever it started), a replacement is started at
        once, and ToolTimeout is raised;
      - the worker died (os._exit, a crash): ToolFailed naming its exit status; a replacement is started.
    Raises ToolError (not the model's doing) when a worker cannot start or import the functions within
    WORKER_START_S; every later call then raises it at once. At most `max_idle` workers wait idle.
    `close()` kills every worker; so does the end of the interpreter."""

    def __init__(self, functions: Sequence[str], max_idle: int):
        self.functions = list(functions)
        self.max_idle = max_idle
        self._idle: list[_Worker] = []
        self._processes: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, _kill_all, self._processes, os.getpid())

    def call(
        self,
        name: str,
        function: str,
        arguments: Any,
        timeout: float,
        started: Callable[[], None] | None = None,
    ) -> str:
        request = json.dumps({"function": function, "arguments": arguments}).encode() + b"\n"
        worker = self._take()
        try:
            if not worker.ready:
                self._await_ready(worker)
            if started is not None:
                started()
            deadline = time.monotonic() + timeout
            worker.send(request, deadline)
            reply = worker.receive(deadline)
        except _Stop as stop:
            self._retire(worker, replace=True)
            if not stop.died:
                raise ToolTimeout(f"error: {name} timed out after {timeout:g} s") from None
            raise ToolFailed(
                f"its worker process ended ({_ended(stop.code)}); a new worker takes the next call"
            ) from None
        self._give_back(worker)
        if "error" in reply:
            raise ToolFailed(reply["error"])
        return reply["text"]

    def _await_ready(self, worker: _Worker) -> None:
        try:
            hello = worker.receive(worker.started + WORKER_START_S)
        except _Stop as stop:
            how = _ended(stop.code) if stop.died else "still starting"
            self._fail(worker, f"a tool worker did not start within {WORKER_START_S:g} s ({how})")
        if not hello.get("ready"):
            self._fail(worker, f"a tool worker cannot import the user tools: {hello.get('error')}")
        worker.ready = True

    def _fail(self, worker: _Worker, why: str) -> NoReturn:
        self._broken = why
        self._retire(worker, replace=False)
        raise ToolError(why)

    def _take(self) -> _Worker:
        with self._lock:
            if self._broken is not None:
                raise ToolError(self._broken)
            if self._closed:
                raise ToolError("the tool workers are closed")
            if self._idle:
                return self._idle.pop()
        return self._start()

    def _start(self) -> _Worker:
        try:
            worker = _Worker(self.functions)
        except OSError as err:
            raise ToolError(f"cannot start a tool worker ({sys.executable}): {err}") from err
        with self._lock:
            self._processes.add(worker.process)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(worker)
                return
        self._retire(worker, replace=False)

    def _retire(self, worker: _Worker, *, replace: bool) -> None:
        worker.kill()
        with self._lock:
            self._processes.discard(worker.process)
            replace = replace and not self._closed and len(self._idle) < self.max_idle
        if replace:  # started now, so it has imported the functions by the next call
            fresh = self._start()
            with self._lock:
                self._idle.append(fresh)

    def close(self) -> None:
        """Kill every worker, idle or busy; later calls raise ToolError."""
        with self._lock:
            self._closed = True
            self._idle = []
        self._finalizer()


class ToolRegistry:
    """The tools of a rollout, by recipient name."""

    def __init__(self, tools: Sequence[Tool], workers: ToolWorkers | None = None):
        self.tools: dict[str, Tool] = {}
        self.workers = workers  # the processes running the user tools, closed by close()
        for tool in tools:
            if tool.name in self.tools:
                raise ConfigError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    @classmethod
    def from_config(
        cls, agent: AgentConfig, sandbox: SandboxConfig, launcher: SandboxLauncher | None = None
    ) -> ToolRegistry:
        tools = []
        if "python" in agent.builtin_tools:
            tools.append(python_tool(sandbox, launcher, agent.tool_timeout_s))
        if "calculator" in agent.builtin_tools:
            tools.append(calculator_tool())
        workers = None
        if agent.tools:
            workers = ToolWorkers([spec["function"] for spec in agent.tools], agent.max_concurrent_calls)
            tools += [user_tool(spec, f"agent.tools[{i}]", workers) for i, spec in enumerate(agent.tools)]
        return cls(tools, workers)

    def close(self) -> None:
        """Stop the user tools' worker processes (the registry's user tools cannot run after)."""
        if self.workers is not None:
            self.workers.close()

    def get(self, recipient: str | None) -> Tool | None:
        return self.tools.get(recipient or "")

    def prompt_keywords(self) -> dict[str, Any]:
        """`tools` (function tools, OpenAI format) and `builtin_tools` for harmony's `render_prompt`."""
        functions = [
            {
                "type": "function",
                "function": {
                    "name": t.name.removeprefix("functions."),
                    "description": t.description,
                    **({"parameters": dict(t.parameters)} if t.parameters is not None else {}),
                },
            }
            for t in self.tools.values()
            if not t.builtin
        ]
        builtin = {t.name: t.description for t in self.tools.values() if t.builtin}
        return {"tools": functions or None, "builtin_tools": builtin or None}
