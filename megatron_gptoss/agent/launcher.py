"""The sandbox launcher: a small process, started early with an empty environment, that runs Python code
in sandboxes for the trainer. It imports only the standard library and `linux_sandbox` (next to it), so it
never holds CUDA or the trainer's state, and forking it is safe.

    trainer ──JSON line {id, code, timeout_s, limits}──> launcher (one thread per call)
        launcher: fresh directory ──> stage process ──fork──> pid 1 of new namespaces ──exec──> python main.py
                  reads stdout / stderr up to the output limit, kills at the wall-time limit
    trainer <──JSON line {id, stdout, ..., timed_out, truncated, out_of_memory}── launcher

Run as `python -E -s -S launcher.py CONFIG_JSON` (the server) or `... launcher.py --stage SPEC_JSON` (one
sandbox's stage, started by the server). The server first runs one trial sandbox and reports, in its first
line, which layers work: `{"hello": true, "layers": {layer: null or why it is missing}}`.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

if __package__:
    from megatron_gptoss.agent import linux_sandbox as ls
else:  # run by path: linux_sandbox.py is next to this file
    import linux_sandbox as ls  # type: ignore[no-redef]

DEVICES = ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"]
# Read-only system paths every interpreter needs (skipped where absent); the interpreter's own prefix is
# added by the trainer.
SYSTEM_READ_PATHS = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime"]
USER_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
KILL_GRACE_S = 5.0  # seconds a killed stage may take to be reaped
MEMORY_POLL_S = 0.05  # seconds between two sums of the sandbox's resident memory
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
DISK_POLL_S = 0.25  # seconds between two sums of the sandbox directory's disk usage
MAX_DISK_ENTRIES = 10_000  # files and directories a sandbox may create


def disk_bytes(top: str) -> float:
    """Bytes the files below `top` occupy on disk (allocated blocks); infinity past MAX_DISK_ENTRIES
    entries (counting them all would take too long)."""
    total, entries, stack = 0, 0, [top]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    if entries > MAX_DISK_ENTRIES:
                        return float("inf")
                    st = entry.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return total


def resident_bytes(pid1: int) -> int:
    """Resident bytes of every process in the pid namespace whose init is host pid `pid1` (RLIMIT_AS
    bounds each process; this bounds their sum)."""
    try:
        namespace = os.readlink(f"/proc/{pid1}/ns/pid")
    except OSError:
        return 0
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                continue
            with open(f"/proc/{entry}/statm") as f:
                total += int(f.read().split()[1]) * PAGE_BYTES
        except (OSError, IndexError, ValueError):
            continue
    return total


# ---- stage: one sandbox ----------------------------------------------------------------------------------


def _report(fd: int, **fields: object) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def stage_main(spec: dict) -> int:
    """Apply every layer, in order, then exec the interpreter on `main.py` as pid 1 of the new pid
    namespace; report {"pid"}, then {"exit"} or {"signal"}, or {"error", "layer"} on the status fd."""
    fd = spec["status_fd"]
    root = os.geteuid() == 0
    try:
        ls.enter_namespaces(user_namespace=not root)
    except ls.SetupError as err:
        _report(fd, error=str(err), layer=err.layer)
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            if root:
                ls.drop_privileges(spec["uid"])
            ls.die_with_parent()
            os.chdir(spec["dir"])
            limits = spec["limits"]
            ls.set_limits(
                memory_bytes=limits["memory_bytes"],
                cpu_s=limits["cpu_s"],
                processes=limits["processes"],
                file_bytes=limits["file_bytes"],
                open_files=limits["open_files"],
            )
            ls.restrict_filesystem(spec["read_paths"], [spec["dir"], *DEVICES], ls.landlock_abi())
            ls.install_seccomp()
            os.set_inheritable(fd, False)  # closed by a successful exec, kept to report a failed one
            env = {**USER_ENV, "HOME": spec["dir"], "TMPDIR": spec["dir"], "TEMP": spec["dir"]}
            os.execve(spec["python"], [spec["python"], "-I", "main.py"], env)
        except ls.SetupError as err:
            _report(fd, error=str(err), layer=err.layer)
        except BaseException as err:
            _report(fd, error=f"exec: {err}", layer="exec")
        os._exit(125)
    _report(fd, pid=pid)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        _report(fd, signal=os.WTERMSIG(status))
    else:
        _report(fd, exit=os.WEXITSTATUS(status))
    return 0


# ---- server ----------------------------------------------------------------------------------------------


class Server:
    """Serves requests from stdin, one thread per call; replies are written whole under a lock."""

    def __init__(self, config: dict):
        self.python = config["python"]
        self.read_paths = SYSTEM_READ_PATHS + list(config["read_paths"])
        self.uid_base = config["uid_base"]
        self.out_lock = threading.Lock()
        self.slot_lock = threading.Lock()
        self.free_slots = list(range(1024))

    def send(self, message: dict) -> None:
        line = (json.dumps(message) + "\n").encode()
        with self.out_lock:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    def _uid(self, slot: int) -> int:
        """A real uid no other running sandbox of any launcher on this host is likely to hold."""
        return self.uid_base + (os.getpid() % 4096) * 1024 + slot

    def run(self, code: str, timeout_s: float, limits: dict, temp_root: str | None) -> dict:
        with self.slot_lock:
            slot = self.free_slots.pop()
        top = tempfile.mkdtemp(prefix="sandbox-", dir=temp_root or None)
        try:
            return self._run_in(top, self._uid(slot), code, timeout_s, limits)
        finally:
            shutil.rmtree(top, ignore_errors=True)
            with self.slot_lock:
                self.free_slots.append(slot)

    def _run_in(self, top: str, uid: int, code: str, timeout_s: float, limits: dict) -> dict:
        os.chmod(top, 0o700)
        with open(os.path.join(top, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        status_r, status_w = os.pipe()
        spec = {
            "status_fd": status_w,
            "dir": top,
            "uid": uid,
            "python": self.python,
            "read_paths": self.read_paths,
            "limits": {**limits, "cpu_s": max(1, int(limits["cpu_s"]))},
        }
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "-S", os.path.abspath(__file__), "--stage", json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            env={},
            cwd=top,
        )
        os.close(status_w)
        out, status, stopped = self._collect(proc, status_r, start + timeout_s, limits, top)
        wall = time.monotonic() - start
        exit_code = None
        if "exit" in status and stopped is None:
            exit_code = status["exit"]
        elif "signal" in status and stopped is None:
            exit_code = -status["signal"]
        return {
            "stdout": out[1].decode("utf-8", errors="replace"),
            "stderr": out[2].decode("utf-8", errors="replace"),
            "exit_code": exit_code,
            "timed_out": stopped == "timeout",
            "truncated": stopped == "output",
            "out_of_memory": stopped == "memory",
            "out_of_disk": stopped == "disk",
            "error": status.get("error"),
            "layer": status.get("layer"),
            "wall_s": wall,
        }

    def _collect(
        self, proc: subprocess.Popen, status_r: int, deadline: float, limits: dict, top: str
    ) -> tuple[dict[int, bytes], dict, str | None]:
        """Read stdout, stderr and the status pipe until all close, or stop the sandbox when the deadline
        passes ("timeout"), the output exceeds its limit ("output"), its processes together hold more
        resident memory than `memory_bytes` ("memory", polled every MEMORY_POLL_S) or its directory
        more than `disk_bytes` ("disk", every DISK_POLL_S); ({1: stdout, 2: stderr}, status, why it was
        stopped or None)."""
        budget, memory = limits["output_bytes"], limits["memory_bytes"]
        assert proc.stdout is not None and proc.stderr is not None
        out = {1: b"", 2: b""}
        status: dict = {}
        status_buf = b""
        stopped = None
        next_poll = time.monotonic() + MEMORY_POLL_S
        next_disk_poll = time.monotonic() + DISK_POLL_S
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
                if now >= next_poll:
                    next_poll = now + MEMORY_POLL_S
                    if status.get("pid") and resident_bytes(status["pid"]) > memory:
                        stopped = "memory"
                        break
                if now >= next_disk_poll:
                    next_disk_poll = now + DISK_POLL_S
                    if disk_bytes(top) > limits["disk_bytes"]:
                        stopped = "disk"
                        break
                for key, _ in sel.select(timeout=min(deadline, next_poll) - now):
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
                status_buf = self._parse_status(status_buf, status)
            if stopped is not None:
                self._kill(proc, status)
        finally:
            sel.close()
            os.close(status_r)
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._parse_status(status_buf + b"\n", status)
        return out, status, stopped

    @staticmethod
    def _parse_status(buf: bytes, status: dict) -> bytes:
        *lines, rest = buf.split(b"\n")
        for line in lines:
            if line.strip():
                status.update(json.loads(line))
        return rest

    @staticmethod
    def _kill(proc: subprocess.Popen, status: dict) -> None:
        """SIGKILL the sandbox's pid 1 (the kernel then kills every process of its pid namespace) and the
        stage."""
        for pid in (status.get("pid"), proc.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

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
        self.send({"hello": True, "layers": self.trial()})
        for line in sys.stdin:
            if line.strip():
                request = json.loads(line)
                threading.Thread(target=self.handle, args=(request,), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--stage":
        return stage_main(json.loads(argv[2]))
    ls.die_with_parent()  # the launcher ends with the trainer
    Server(json.loads(argv[1])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
