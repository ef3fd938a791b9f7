"""The sandbox launcher: a small process, started early with an empty environment, that runs Python code
in sandboxes for the trainer. It imports only the standard library and `linux_sandbox` (next to it), so it
never holds CUDA or the trainer's state, and forking it is safe.

    trainer ──JSON line {id, code, timeout_s, limits}──> launcher (one thread per call)
        launcher: empty directory + main.py ──> stage (sandbox_stage.py: namespaces, tmpfs root on the
                                                directory, pid 1 of the sandbox, memory and disk watch)
                  reads stdout / stderr up to the output limit, kills the stage at the wall-time limit,
                  removes the directory
    trainer <──JSON line {id, stdout, ..., timed_out, truncated, out_of_memory, out_of_disk, error}── launcher

Run as `python -E -s -S launcher.py CONFIG_JSON`. It first runs one trial sandbox and reports, in its first
line, which layers work: `{"hello": true, "layers": {layer: null or why it is missing}, "landlock_abi": N}`.
It stops when the trainer does (its stdin closes or the trainer's pid ends): it kills the running sandboxes
and removes their directories, then exits. It is a child subreaper and reaps every child, sandbox
processes orphaned by a stage included.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

if __package__:
    from megatron_gptoss.agent import linux_sandbox as ls
else:  # run by path: linux_sandbox.py is next to this file
    import linux_sandbox as ls  # type: ignore[no-redef]

# Read-only system paths every interpreter needs (skipped where absent); the interpreter's own prefix is
# added by the trainer.
SYSTEM_READ_PATHS = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime"]
KILL_GRACE_S = 5.0  # seconds a stage may take to end once killed, or once its sandbox closed its output
SLOTS = 1024  # sandboxes one launcher runs at once at most (each has a uid of its own)
# The stage's command: its module imported (from its cached bytecode), not run as a script (compiled anew)
STAGE_COMMAND = [
    sys.executable,
    "-E",
    "-s",
    "-S",
    "-c",
    f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import sandbox_stage; "
    "sys.exit(sandbox_stage.main(sys.argv))",
]


# ---- server ----------------------------------------------------------------------------------------------


class Stage:
    """A started stage: its process, a pidfd to signal it by (its pid may be reaped and reused at any
    time: the reaper thread waits on every child), and a future of its wait status."""

    def __init__(self, proc: subprocess.Popen, pidfd: int, exited: Future):
        self.proc, self.pidfd, self.exited = proc, pidfd, exited

    def kill(self) -> None:
        """SIGKILL the stage (its sandbox's pid 1, and so every process of the sandbox, dies with it)."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int:
        """The stage's wait status, killing it first if it has not ended within `timeout` seconds."""
        try:
            status = self.exited.result(timeout=timeout)
        except FutureTimeout:
            self.kill()
            status = self.exited.result()
        self.proc.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must never wait for it
        return status


class Children:
    """The launcher's children, all reaped by one thread. The launcher is a child subreaper, so processes
    orphaned below it (a sandbox's pid 1 whose stage was killed) are reaped here too, never left as
    zombies."""

    def __init__(self) -> None:
        ls.become_subreaper()
        self._lock = threading.Lock()
        self._waiting: dict[int, Future] = {}
        self._spawned = threading.Event()
        threading.Thread(target=self._reap, name="launcher-reaper", daemon=True).start()

    def spawn(self, argv: list[str], **popen: object) -> Stage:
        exited: Future = Future()
        with self._lock:  # held until the pid is registered: the reaper looks it up under the lock
            proc = subprocess.Popen(argv, **popen)  # type: ignore[call-overload]
            self._waiting[proc.pid] = exited
            pidfd = os.pidfd_open(proc.pid)  # not reaped yet: the reaper reaps under the lock
        self._spawned.set()
        return Stage(proc, pidfd, exited)

    def _reap(self) -> None:
        while True:
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # a child ended, left unreaped
            except ChildProcessError:  # no child: wait for the next spawn
                self._spawned.wait()
                self._spawned.clear()
                continue
            if ended is None:
                continue
            with self._lock:
                try:
                    pid, status = os.waitpid(ended.si_pid, 0)
                except ChildProcessError:  # reaped by Popen itself (its exec failed)
                    continue
                exited = self._waiting.pop(pid, None)
            if exited is not None:
                exited.set_result(status)


class Server:
    """Serves requests from stdin, one thread per call; replies are written whole under a lock."""

    def __init__(self, config: dict):
        self.python = config["python"]
        self.read_paths = SYSTEM_READ_PATHS + list(config["read_paths"])
        self.uid_base = config["uid_base"]
        cap = config.get("landlock_abi")
        self.landlock_abi = ls.landlock_abi() if cap is None else min(cap, ls.landlock_abi())
        self.out_lock = threading.Lock()
        self.slot_lock = threading.Lock()
        self.free_slots = deque(range(SLOTS))  # first in, first out: a slot's uid rests between sandboxes
        self.children = Children()
        self.stages: set[Stage] = set()  # running, under slot_lock
        self.calls: list[threading.Thread] = []
        self.stopping = False

    def send(self, message: dict) -> None:
        line = (json.dumps(message) + "\n").encode()
        with self.out_lock:
            try:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
            except OSError:  # the trainer is gone: no one to answer
                pass

    def stop(self) -> None:
        """Kill every running sandbox and wait (KILL_GRACE_S at most) for the calls to end, each removing
        its directory."""
        with self.slot_lock:
            self.stopping = True
            stages = list(self.stages)
        for stage in stages:
            stage.kill()
        deadline = time.monotonic() + KILL_GRACE_S
        for call in self.calls:
            call.join(timeout=max(0.0, deadline - time.monotonic()))

    def _uid(self, slot: int) -> int:
        """A host uid no other running sandbox of any launcher on this host is likely to hold."""
        return self.uid_base + (os.getpid() % 4096) * SLOTS + slot

    def run(self, code: str, timeout_s: float, limits: dict, temp_root: str | None) -> dict:
        """Run `code` in a sandbox; the reply's "error" names what failed (None when the code ran), and
        "fatal" is set when no sandbox could be started here at all (the temporary directory)."""
        try:
            top = tempfile.mkdtemp(prefix="sandbox-", dir=temp_root or None)
        except OSError as err:
            return {
                "error": f"cannot create the sandbox's directory: {err}",
                "layer": "launcher",
                "fatal": True,
            }
        with self.slot_lock:
            slot = self.free_slots.popleft()
        try:
            reply = self._run_in(top, self._uid(slot), code, timeout_s, limits)
        except Exception as err:
            reply = {"error": f"launcher: {type(err).__name__}: {err}", "layer": "launcher"}
        finally:
            with self.slot_lock:
                self.free_slots.append(slot)
        try:  # the sandbox wrote only to its tmpfs, gone with its mount namespace: main.py is all there is
            os.unlink(os.path.join(top, "main.py"))
            os.rmdir(top)
        except OSError as err:
            if not reply.get("error"):
                reply.update(error=f"cannot remove the sandbox's directory {top}: {err}", layer="cleanup")
        return reply

    def _run_in(self, top: str, uid: int, code: str, timeout_s: float, limits: dict) -> dict:
        with open(os.path.join(top, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        status_r, status_w = os.pipe()
        spec = {
            "status_fd": status_w,
            "dir": top,
            "uid": uid,
            "python": self.python,
            "read_paths": self.read_paths,
            "landlock_abi": self.landlock_abi,
            "limits": {**limits, "cpu_s": max(1, int(limits["cpu_s"]))},
        }
        start = time.monotonic()
        try:
            stage = self.children.spawn(
                [*STAGE_COMMAND, "--stage", json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                env={},
                cwd="/",
                start_new_session=True,
            )
        finally:
            os.close(status_w)
        with self.slot_lock:
            self.stages.add(stage)
        try:
            if self.stopping:
                stage.kill()
            out, status, stopped = self._collect(stage, status_r, start + timeout_s, limits["output_bytes"])
        finally:
            with self.slot_lock:
                self.stages.discard(stage)
            os.close(stage.pidfd)
        stopped = stopped or status.get("stopped")
        exit_code = None
        if "exit" in status and stopped is None:
            exit_code = status["exit"]
        elif "signal" in status and stopped is None:
            exit_code = -status["signal"]
        error, layer = status.get("error"), status.get("layer")
        if error is None and stopped is None and exit_code is None:
            error, layer = (
                f"the sandbox's stage ended without a report (status {stage.proc.returncode})",
                "stage",
            )
        return {
            "stdout": out[1].decode("utf-8", errors="replace"),
            "stderr": out[2].decode("utf-8", errors="replace"),
            "exit_code": exit_code,
            "timed_out": stopped == "timeout",
            "truncated": stopped == "output",
            "out_of_memory": stopped == "memory",
            "out_of_disk": stopped == "disk",
            "error": error,
            "layer": layer,
            "wall_s": time.monotonic() - start,
        }

    def _collect(
        self, stage: Stage, status_r: int, deadline: float, budget: int
    ) -> tuple[dict[int, bytes], dict, str | None]:
        """Read stdout, stderr and the status pipe until all close, or kill the stage (and so the
        sandbox) when the deadline passes ("timeout") or the output exceeds `budget` bytes ("output");
        ({1: stdout, 2: stderr}, status, why it was stopped or None). The stage is reaped before this
        returns."""
        proc = stage.proc
        assert proc.stdout is not None and proc.stderr is not None
        out = {1: b"", 2: b""}
        status: dict = {}
        status_buf = b""
        stopped = None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, 1)
        sel.register(proc.stderr, selectors.EVENT_READ, 2)
        sel.register(status_r, selectors.EVENT_READ, 3)
        try:
            while sel.get_map() and stopped is None:
                now = time.monotonic()
                if now >= deadline:
                    stopped = "timeout"
                    break
                for key, _ in sel.select(timeout=deadline - now):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data == 3:
                        status_buf += chunk
                    else:
                        room = budget - len(out[1]) - len(out[2])
                        out[key.data] += chunk[: max(room, 0)]
                        if len(chunk) > room:
                            stopped = "output"
            if stopped is not None:
                stage.kill()
        finally:
            sel.close()
            os.close(status_r)
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
        stage.wait(KILL_GRACE_S)
        for line in status_buf.split(b"\n"):
            if line.strip():
                status.update(json.loads(line))
        return out, status, stopped

    def handle(self, request: dict) -> None:
        try:
            reply = self.run(
                request["code"], request["timeout_s"], request["limits"], request.get("temp_root")
            )
        except Exception as err:
            reply = {"error": f"launcher: {type(err).__name__}: {err}", "layer": "launcher"}
        self.send({"id": request["id"], **reply})

    def trial(self) -> dict:
        """Which layers work: run `print(1)` in a sandbox; {layer: None or the reason it is missing}."""
        layers: dict = dict(ls.kernel_layers())
        if os.geteuid() == 0:
            layers.pop("user namespace")
        limits = {
            "memory_bytes": 1 << 30,
            "cpu_s": 10,
            "processes": 16,
            "file_bytes": 1 << 20,
            "open_files": 64,
            "output_bytes": 4096,
            "disk_bytes": 1 << 20,
        }
        reply = self.run("print(1)", 30.0, limits, None)
        if reply["error"]:
            layers[reply["layer"]] = reply["error"]
        elif reply["exit_code"] != 0 or reply["stdout"] != "1\n":
            layers["trial"] = (
                f"a trial sandbox failed: exit {reply['exit_code']}, {reply['stderr'][-2000:]!r}"
            )
        return layers

    def serve(self) -> None:
        """Answer requests until stdin closes, then `stop`."""
        self.send({"hello": True, "layers": self.trial(), "landlock_abi": self.landlock_abi})
        for line in sys.stdin:
            if line.strip():
                call = threading.Thread(target=self.handle, args=(json.loads(line),), daemon=True)
                self.calls = [c for c in self.calls if c.is_alive()] + [call]
                call.start()
        self.stop()

    def stop_with(self, pid: int) -> None:
        """`stop` and exit when process `pid` (the trainer) ends, however it ends."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None
        if pidfd is not None:
            select.select([pidfd], [], [])
        self.stop()
        os._exit(0)


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    server = Server(config)
    trainer = config.get("trainer_pid") or os.getppid()
    threading.Thread(target=server.stop_with, args=(trainer,), name="launcher-watch", daemon=True).start()
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
