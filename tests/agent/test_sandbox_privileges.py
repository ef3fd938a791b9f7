"""The sandbox holds no privilege to lose: hostile code run as root-started sandboxes cannot regain root,
change the metadata of host files it can see, reach host unix sockets, signal the trainer, or outlive the
thread that started the launcher; an old Landlock ABI is refused unless accepted. Each test checks the
host afterwards. The "host files" are temporary files this module creates (owned by the test's user)."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_gptoss.agent import SandboxLauncher, run_python
from megatron_gptoss.agent import launcher as launcher_module
from megatron_gptoss.agent.sandbox import interpreter_read_paths
from megatron_gptoss.config import SandboxConfig
from megatron_gptoss.errors import ToolError

LIMITS = SandboxConfig(cpu_s=5, processes=12)
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's uid switch is tested as root")

# Every way to change a file's metadata or content; each line prints "name OK" or "name ERRNO".
TAMPER = """
import errno, os, sys
path = sys.argv[1] if len(sys.argv) > 1 else PATH
def attempt(name, f):
    try:
        f()
        print(name, "OK")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
attempt("chmod", lambda: os.chmod(path, 0o4777))
attempt("chown", lambda: os.chown(path, 65534, 65534))
attempt("utime", lambda: os.utime(path, (0, 0)))
attempt("setxattr", lambda: os.setxattr(path, "user.sandbox", b"1"))
attempt("removexattr", lambda: os.removexattr(path, "user.host"))
attempt("truncate", lambda: os.truncate(path, 0))
attempt("write", lambda: open(path, "r+b").write(b"sandbox"))
attempt("rename", lambda: os.rename(path, path + ".moved"))
attempt("unlink", lambda: os.unlink(path))
attempt("read", lambda: open(path, "rb").read())
"""


def _snapshot(path: Path) -> tuple:
    """Content, mode, owner, times and xattrs of `path`, read without touching its atime."""
    st = os.stat(path)
    xattrs = {name: os.getxattr(path, name) for name in os.listxattr(path)}
    fd = os.open(path, os.O_RDONLY | os.O_NOATIME)
    try:
        content = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    return (content, st.st_mode, st.st_uid, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, xattrs)


def _host_file(directory: Path) -> Path:
    """A root-owned file whose atime is older than its mtime (a read through a writable mount would
    update it), with an xattr."""
    path = directory / "host_file"
    path.write_bytes(b"host data")
    os.chmod(path, 0o644)
    os.setxattr(path, "user.host", b"kept")
    os.utime(path, ns=(1_000_000_000_000_000_000, 1_100_000_000_000_000_000))
    return path


@pytest.fixture(scope="module")
def visible_dir(tmp_path_factory):
    """A host directory the sandboxes of `launcher` see read-only (as they see the interpreter)."""
    directory = tmp_path_factory.mktemp("visible")
    os.chmod(directory, 0o755)
    return directory


@pytest.fixture(scope="module")
def launcher(visible_dir):
    started = SandboxLauncher(read_paths=[*interpreter_read_paths(), str(visible_dir)])
    yield started
    started.close()


def _run(launcher, code, timeout_s=5.0, limits=LIMITS):
    return run_python(code, timeout_s=timeout_s, limits=limits, launcher=launcher)


def _tamper(launcher, path: Path) -> dict[str, str]:
    result = _run(launcher, TAMPER.replace("PATH", repr(str(path))))
    assert result.exit_code == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


def test_host_files_metadata_and_content_cannot_change(launcher, visible_dir, tmp_path):
    visible = _host_file(visible_dir)
    hidden = _host_file(tmp_path)
    before = {path: _snapshot(path) for path in (visible, hidden)}
    seen = _tamper(launcher, visible)
    assert seen.pop("read") == "OK"  # visible, read-only: every change refused, the read leaves atime be
    assert set(seen.values()) <= {"EROFS", "EPERM", "EACCES"}, seen
    assert set(_tamper(launcher, hidden).values()) == {"ENOENT"}  # the rest of the host: not there at all
    assert {path: _snapshot(path) for path in (visible, hidden)} == before
    assert sorted(p.name for p in visible_dir.iterdir()) == ["host_file"]


def test_no_root_to_regain_and_threads_within_the_limit(launcher):
    code = textwrap.dedent(
        """
        import ctypes, errno, json, os, threading
        libc = ctypes.CDLL(None, use_errno=True)
        print("ids", json.dumps([os.getresuid(), os.getresgid(), os.getgroups()]))
        calls = {"setresuid": lambda: os.setresuid(0, 0, 0), "setresgid": lambda: os.setresgid(0, 0, 0),
                 "setgroups": lambda: os.setgroups([0]), "setuid": lambda: os.setuid(0)}
        for name, call in calls.items():
            try:
                call()
                print(name, "OK")
            except OSError as e:
                print(name, errno.errorcode[e.errno])
        caps = (ctypes.c_uint32 * 6)()
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        assert libc.capget(header, caps) == 0
        print("capabilities", list(caps))
        print("no_new_privs", libc.prctl(39, 0, 0, 0, 0))
        stop = threading.Event()
        n = 0
        while n < 2000:
            try:
                threading.Thread(target=stop.wait, daemon=True).start()
            except RuntimeError:
                break
            n += 1
        print("threads", n)
        stop.set()
        """
    )
    result = _run(launcher, code)
    assert result.exit_code == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    uids, gids, groups = json.loads(lines["ids"])
    uid = uids[0]
    assert uids == gids == [uid] * 3 and uid >= LIMITS.uid_base and groups == []
    assert {lines[name] for name in ("setresuid", "setresgid", "setgroups", "setuid")} == {"EPERM"}
    assert lines["capabilities"] == "[0, 0, 0, 0, 0, 0]" and lines["no_new_privs"] == "1"
    assert 0 < int(lines["threads"]) < LIMITS.processes
    deadline = time.monotonic() + 2.0
    while _processes_of_uid(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_of_uid(uid) == []


def test_kernel_surfaces_refused(launcher):
    code = textwrap.dedent(
        """
        import ctypes, errno, os, platform
        libc = ctypes.CDLL(None, use_errno=True)
        numbers = {"x86_64": (321, 425, 323), "aarch64": (280, 425, 282)}[platform.machine()]
        params = (ctypes.c_uint32 * 30)()
        calls = {
            "unshare": lambda: libc.unshare(0x10000000),  # CLONE_NEWUSER
            "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
            "ptrace": lambda: libc.ptrace(0, 0, None, None),  # PTRACE_TRACEME
            "bpf": lambda: libc.syscall(numbers[0], 0, None, 0),
            "io_uring_setup": lambda: libc.syscall(numbers[1], 1, ctypes.byref(params)),
            "userfaultfd": lambda: libc.syscall(numbers[2], 0),
        }
        for name, call in calls.items():
            print(name, call(), errno.errorcode[ctypes.get_errno()])
        """
    )
    result = _run(launcher, code)
    assert result.exit_code == 0, result.stderr
    assert [line.split(" ", 1)[1] for line in result.stdout.splitlines()] == ["-1 EPERM"] * 6, result.stdout


def _processes_of_uid(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        line = next(x for x in status.splitlines() if x.startswith("Uid:"))
        if uid in map(int, line.split()[1:]):
            found.append(int(entry.name))
    return found


def test_host_unix_socket_unreachable(launcher, tmp_path):
    path = tmp_path / "host.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        os.chmod(path, 0o777)
        server.listen()
        server.settimeout(0.2)
        code = (
            "import socket, errno\ns = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({str(path)!r})\n    print('connected')\n"
            "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
        )
        result = _run(launcher, code)
        assert result.stdout == "ENOENT\n", result
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever reached the listener


def test_hostname_home_and_tmpdir_are_the_sandboxes_own(launcher, tmp_path):
    code = (
        "import os, socket, tempfile\nprint(socket.gethostname(), os.environ['TMPDIR'], os.environ['HOME'])\n"
        "fd, name = tempfile.mkstemp()\nos.write(fd, b'x')\nprint(name.startswith('/tmp/'), os.getcwd())\n"
    )
    result = _run(launcher, code)
    assert result.stdout == "sandbox /tmp /home/sandbox\nTrue /home/sandbox\n", result
    assert socket.gethostname() != "sandbox"


def test_old_landlock_abi_refused_unless_allowed(caplog, visible_dir):
    """Landlock ABI 5 (no signal scoping) and 2 (no truncate right), simulated: refused by default with the
    missing protections named; accepted with allow_weak_kernel, a warning, and the other layers hold."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append(1))
    host_file = _host_file(visible_dir)
    before = _snapshot(host_file)
    try:
        for abi in (5, 2):
            weak = SandboxLauncher(read_paths=[*interpreter_read_paths(), str(visible_dir)], landlock_abi=abi)
            try:
                assert weak.landlock_abi == abi and weak.missing_layers() == {}
                with pytest.raises(
                    ToolError, match=rf"Landlock ABI is {abi}, below 6: missing .*signals and "
                ):
                    _run(weak, "print(1)")
                with pytest.raises(ToolError, match="allow_weak_kernel"):
                    _run(weak, "print(1)")
                allowed = replace(LIMITS, allow_weak_kernel=True)
                with caplog.at_level(logging.WARNING, logger="megatron_gptoss.agent.sandbox"):
                    code = (
                        "import errno, os, signal\nos.kill(0, signal.SIGTERM)\n"
                        "try:\n    os.kill(-1, signal.SIGTERM)\n"
                        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
                        f"try:\n    os.truncate({str(host_file)!r}, 0)\n"
                        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
                    )
                    result = _run(weak, code, limits=allowed)
                assert result.exit_code == 0 and result.stdout.split()[0] == "ESRCH", result
                assert result.stdout.split()[1] in {"EROFS", "EACCES"}, result
                assert "allow_weak_kernel" in caplog.text
                caplog.clear()
            finally:
                weak.close()
        time.sleep(0.1)
        assert received == []  # neither kill(0) nor kill(-1) reached this process
        assert _snapshot(host_file) == before
    finally:
        signal.signal(signal.SIGTERM, previous)
        host_file.unlink()


def test_launcher_outlives_the_thread_that_started_it():
    box: list[SandboxLauncher] = []
    thread = threading.Thread(target=lambda: box.append(SandboxLauncher()))
    thread.start()
    thread.join()
    try:
        time.sleep(0.2)
        assert box[0].alive
        result = run_python("print(6 * 7)", timeout_s=5.0, launcher=box[0])
        assert (result.stdout, result.exit_code) == ("42\n", 0)
    finally:
        box[0].close()


SUBREAPER = """
import ctypes, json, os, subprocess, sys, time
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans come to this process
config = {"python": sys.executable, "read_paths": json.loads(sys.argv[2]), "uid_base": 1_500_000_000}
launcher = subprocess.Popen([sys.executable, "-E", "-s", "-S", sys.argv[1], json.dumps(config)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={}, cwd="/")
assert json.loads(launcher.stdout.readline())["layers"]
spawner = "import os, time\\nfor _ in range(4):\\n    if os.fork() == 0:\\n        time.sleep(60)\\n"
spawner += "time.sleep(60)\\n"
limits = {"memory_bytes": 1 << 30, "cpu_s": 10, "processes": 16, "file_bytes": 1 << 20, "open_files": 64,
          "output_bytes": 4096, "disk_bytes": 1 << 20}
timed_out = []
for i, code in enumerate([spawner, "while True:\\n    pass\\n"]):
    request = {"id": i, "code": code, "timeout_s": 0.4, "limits": limits}
    launcher.stdin.write((json.dumps(request) + "\\n").encode())
    launcher.stdin.flush()
    timed_out.append(json.loads(launcher.stdout.readline())["timed_out"])
time.sleep(0.5)
zombies = []
for entry in os.listdir("/proc"):
    try:
        fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        continue
    if fields[0] == "Z" and int(fields[1]) in (os.getpid(), launcher.pid):
        zombies.append(int(entry))
print(json.dumps({"timed_out": timed_out, "zombies": zombies, "alive": launcher.poll() is None}))
launcher.kill()
"""


def test_stopped_sandboxes_leave_no_zombies_under_a_subreaper_trainer():
    """A trainer that is a child subreaper (as torchrun's agents may be) gets no zombie from sandboxes
    stopped at their wall-time limit."""
    script = [sys.executable, "-c", SUBREAPER, launcher_module.__file__, json.dumps(interpreter_read_paths())]
    done = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"timed_out": [True] * 2, "zombies": [], "alive": True}
