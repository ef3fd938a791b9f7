"""`run_python`: model-written Python in a sandbox, through a launcher process started before CUDA is.

    run_python(code, timeout_s=...) ──> SandboxLauncher (this process: a reader thread, a future per call)
                                         │ JSON lines over pipes
                                         v
                                        launcher.py (a clean interpreter, started once) ──> a sandbox per call

Call `start_launcher()` early in a process that will use CUDA (the trainer does, before building models):
the launcher is a fresh interpreter started with an empty environment, never a fork of the trainer. The
first `run_python` starts it otherwise. The launcher reports which isolation layers work on this kernel;
where one is missing, every call raises `ToolError` naming it, and no code runs unsandboxed. A kernel whose
Landlock ABI is below `linux_sandbox.MIN_LANDLOCK_ABI` is refused the same way (naming the protections it
lacks) unless `sandbox.allow_weak_kernel` accepts it, with a warning.

What the code does never raises here: a program that cannot be run (text that is not valid UTF-8), a
sandbox that fails to start or to be cleaned up, each returns a PythonResult whose `error` says what
happened (also appended to its stderr, which the model reads).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from megatron_gptoss.agent import linux_sandbox
from megatron_gptoss.config.agent import SANDBOX_LIMITS, SandboxConfig
from megatron_gptoss.errors import ToolError

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("launcher.py")
START_TIMEOUT_S = 60.0  # seconds the launcher may take to start and run its trial sandbox
REPLY_SLACK_S = 15.0  # seconds past a call's timeout before the launcher is presumed stuck
CLOSE_TIMEOUT_S = 10.0  # seconds the launcher may take to stop its sandboxes when closed


@dataclass(frozen=True)
class PythonResult:
    """What a sandboxed run printed and how it ended. `exit_code` is the interpreter's exit status, `-N`
    when a signal N killed it (SIGKILL past the CPU limit), None when the sandbox was stopped: at the
    wall-time limit (`timed_out`), the output limit (`truncated`, the output then cut at the limit), its
    processes together past the memory limit (`out_of_memory`; one process past it sees its allocation
    fail with MemoryError instead) or its files filled the disk limit (`out_of_disk`), or when the run failed
    outside the code's control (`error`: what failed, also the last line of `stderr`)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    out_of_memory: bool = False
    out_of_disk: bool = False
    wall_s: float = 0.0
    error: str | None = None


def _failed(error: str, stdout: str = "", stderr: str = "", wall_s: float = 0.0) -> PythonResult:
    """The result of a run that failed outside the code's control: `error`, also appended to stderr."""
    if stderr and not stderr.endswith("\n"):
        stderr += "\n"
    stderr += f"error: {error}\n"
    return PythonResult(stdout, stderr, None, False, False, wall_s=wall_s, error=error)


def interpreter_read_paths() -> list[str]:
    """The directories the sandboxed interpreter reads: its installation prefixes (read-only)."""
    paths = {
        os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix)
    }
    return sorted(paths)


class SandboxLauncher:
    """A running launcher process and the calls in flight to it (thread-safe)."""

    def __init__(
        self,
        uid_base: int = SandboxConfig.uid_base,
        python: str = sys.executable,
        read_paths: list[str] | None = None,
        landlock_abi: int | None = None,
    ):
        """Start the launcher (this interpreter, in a clean environment); sandboxes run `python` and see,
        read-only, the system libraries and `read_paths` (the interpreter's installation when None).
        `landlock_abi` caps the Landlock ABI the sandboxes use (None: the kernel's), to see how they
        behave on an older kernel."""
        config = {
            "python": python,
            "read_paths": interpreter_read_paths() if read_paths is None else list(read_paths),
            "uid_base": uid_base,
            "landlock_abi": landlock_abi,
            "trainer_pid": os.getpid(),
        }
        self._proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "-S", str(LAUNCHER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={},
            close_fds=True,
            cwd="/",
        )
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next_id = 0
        self._hello: Future = Future()
        self._dead: str | None = None
        self._warned = False
        threading.Thread(target=self._read, name="sandbox-launcher-reader", daemon=True).start()
        try:
            hello = self._hello.result(timeout=START_TIMEOUT_S)
        except FutureTimeout:
            self.close()
            raise ToolError(f"the sandbox launcher did not start within {START_TIMEOUT_S:.0f} s") from None
        self.layers: dict[str, str | None] = hello["layers"]
        self.landlock_abi: int = hello["landlock_abi"]

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            if message.get("hello"):
                self._hello.set_result(message)
                continue
            with self._lock:
                future = self._pending.pop(message["id"], None)
            if future is not None:
                future.set_result(message)
        with self._lock:
            self._dead = f"the sandbox launcher exited (status {self._proc.poll()})"
            pending, self._pending = self._pending, {}
        if not self._hello.done():
            self._hello.set_exception(ToolError(self._dead))
        for future in pending.values():
            future.set_exception(ToolError(self._dead))

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    def missing_layers(self) -> dict[str, str]:
        """{layer: why it is missing} for every isolation layer that does not work here."""
        return {layer: reason for layer, reason in self.layers.items() if reason is not None}

    def check(self, limits: SandboxConfig) -> None:
        """Raise ToolError when sandboxes cannot run here: a missing layer, or a Landlock ABI below
        MIN_LANDLOCK_ABI that `limits.allow_weak_kernel` does not accept (accepted: a warning, once)."""
        missing = self.missing_layers()
        if missing:
            layer, reason = next(iter(missing.items()))
            raise ToolError(f"refusing to run tools: sandbox layer {layer!r} is missing: {reason}")
        weak = linux_sandbox.missing_landlock_protections(self.landlock_abi)
        if not weak:
            return
        what = (
            f"the kernel's Landlock ABI is {self.landlock_abi}, below {linux_sandbox.MIN_LANDLOCK_ABI}: "
            f"missing {'; '.join(weak)}"
        )
        if not limits.allow_weak_kernel:
            raise ToolError(
                f"refusing to run tools: {what}. Set sandbox.allow_weak_kernel: true to run without them "
                "(the mount namespace, the sandbox's own uid and seccomp still apply)"
            )
        if not self._warned:
            self._warned = True
            log.warning("sandbox.allow_weak_kernel: running tools although %s", what)

    def run(self, code: str, *, timeout_s: float, limits: SandboxConfig) -> PythonResult:
        """Run `code` in a fresh sandbox. Raises ToolError when sandboxes cannot run here (`check`) or the
        launcher fails; any failure of this one run is a PythonResult with `error` set."""
        self.check(limits)
        if not timeout_s > 0:
            raise ToolError(f"timeout_s must be > 0, got {timeout_s}")
        try:
            code.encode("utf-8")
        except UnicodeEncodeError as err:
            return _failed(f"the code is not valid UTF-8 text ({err.reason} at character {err.start})")
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise ToolError(self._dead)
            call_id, self._next_id = self._next_id, self._next_id + 1
            self._pending[call_id] = future
            request = {
                "id": call_id,
                "code": code,
                "timeout_s": timeout_s,
                "limits": {name: getattr(limits, name) for name in SANDBOX_LIMITS},
                "temp_root": limits.temp_root or None,
            }
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except (OSError, ValueError) as err:  # ValueError: closed
                self._pending.pop(call_id, None)
                raise ToolError(f"the sandbox launcher is gone: {err}") from None
        try:
            reply = future.result(timeout=timeout_s + REPLY_SLACK_S)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(call_id, None)
            raise ToolError(
                f"the sandbox launcher did not answer within {timeout_s + REPLY_SLACK_S} s"
            ) from None
        if reply.get("fatal"):
            raise ToolError(f"sandboxes cannot run: {reply['error']}")
        if "stdout" not in reply:
            return _failed(f"sandbox {reply.get('layer')}: {reply['error']}")
        if reply.get("error"):
            error = f"sandbox {reply.get('layer')}: {reply['error']}"
            return _failed(error, reply["stdout"], reply["stderr"], reply["wall_s"])
        return PythonResult(
            stdout=reply["stdout"],
            stderr=reply["stderr"],
            exit_code=reply["exit_code"],
            timed_out=reply["timed_out"],
            truncated=reply["truncated"],
            out_of_memory=reply["out_of_memory"],
            out_of_disk=reply["out_of_disk"],
            wall_s=reply["wall_s"],
        )

    def close(self) -> None:
        """Stop the launcher: it kills its running sandboxes and removes their directories (killed after
        CLOSE_TIMEOUT_S)."""
        with self._lock:
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                try:
                    self._proc.stdin.close()  # end of requests: the launcher stops
                except OSError:
                    pass
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()


_launcher_lock = threading.Lock()
_launcher: list[SandboxLauncher] = []  # the process's launcher, started by start_launcher()


def start_launcher(uid_base: int = SandboxConfig.uid_base) -> SandboxLauncher:
    """The process's launcher, started now if it is not running (call before CUDA is initialised)."""
    with _launcher_lock:
        if not _launcher or not _launcher[0].alive:
            if _launcher:
                _launcher.pop().close()
            _launcher.append(SandboxLauncher(uid_base))
            atexit.register(_launcher[0].close)
        return _launcher[0]


def run_python(
    code: str,
    *,
    timeout_s: float,
    limits: SandboxConfig | None = None,
    launcher: SandboxLauncher | None = None,
) -> PythonResult:
    """Run `code` as `python -I main.py` in a fresh sandbox and return what it printed and how it ended.

    The sandbox: a root filesystem of its own, a tmpfs of `limits.disk_bytes` mounted on a new directory
    below `limits.temp_root` (gone before this returns) holding the only writable places (its home and
    working directory, /tmp, /dev/shm) and read-only views of the interpreter's installation and system
    libraries (no other host path, so not the repository, the run's directory, host sockets or /proc); a
    non-root uid of its own with no capability and no way back to root; no network (an empty network
    namespace, sockets other than AF_UNIX refused, TCP denied by Landlock); an environment and hostname of
    its own; its own pid namespace (its processes end with it); limits on wall time (`timeout_s`), CPU
    time, memory (processes and tmpfs together), processes, file size, disk and output (`limits`,
    SandboxConfig's defaults when None). Raises ToolError (never for what the code itself does) when an
    isolation layer is missing on this kernel or the launcher fails."""
    limits = limits if limits is not None else SandboxConfig()
    launcher = launcher if launcher is not None else start_launcher(limits.uid_base)
    return launcher.run(code, timeout_s=timeout_s, limits=limits)
