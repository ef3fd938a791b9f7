"""The Python sandbox: each test runs hostile code and checks, from the trainer's side, that nothing
reached the host and that the trainer and its launcher are unharmed."""

import errno
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_gptoss.agent import SandboxLauncher, run_python
from megatron_gptoss.agent import launcher as launcher_module
from megatron_gptoss.agent import linux_sandbox as ls
from megatron_gptoss.config import SandboxConfig
from megatron_gptoss.config.agent import SANDBOX_LIMITS
from megatron_gptoss.errors import ToolError

SECRET_VAR = "MEGATRON_GPTOSS_TEST_SECRET"
LIMITS = SandboxConfig(cpu_s=5, processes=12)


@pytest.fixture(scope="module")
def launcher():
    os.environ[SECRET_VAR] = secrets.token_hex(16)
    started = SandboxLauncher()
    yield started
    started.close()
    os.environ.pop(SECRET_VAR, None)


def _run(launcher, code, timeout_s=5.0, limits=LIMITS):
    return run_python(code, timeout_s=timeout_s, limits=limits, launcher=launcher)


def _unharmed(launcher):
    assert launcher.alive
    result = _run(launcher, "print(6 * 7)")
    assert (result.stdout, result.exit_code) == ("42\n", 0)
    assert subprocess.run(["true"], timeout=10).returncode == 0


def _sandbox_uid_processes(uid_base=SandboxConfig.uid_base):
    """pids of host processes whose real uid is one the launcher gives sandboxes."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            uid_line = next(x for x in (entry / "status").read_text().splitlines() if x.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) >= uid_base:
            found.append(int(entry.name))
    return found


def test_every_layer_works_here(launcher):
    assert launcher.missing_layers() == {}
    result = _run(launcher, "import os; open('f', 'w').write('x'); print(os.getcwd() == os.environ['HOME'])")
    assert (result.stdout, result.exit_code) == ("True\n", 0)


def test_connection_to_host_loopback_refused(launcher):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.3)
        port = server.getsockname()[1]
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
        )
        result = _run(launcher, code)
        assert "connected" not in result.stdout
        assert result.exit_code == 1 and "Error" in result.stderr, result.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever reached the listener
    # the seccomp layer on its own: a socket of any family but AF_UNIX is refused at creation
    code = (
        "import socket, errno\n"
        "try:\n    socket.socket(socket.AF_INET6)\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
    )
    assert _run(launcher, code).stdout == "EAFNOSUPPORT\n"
    # a unix socket pair (AF_UNIX) stays usable for the code's own processes
    result = _run(launcher, "import socket; a, b = socket.socketpair(); a.send(b'ok'); print(b.recv(2))")
    assert result.stdout == "b'ok'\n"


def test_trainer_files_unreadable_and_writes_outside_refused(launcher, tmp_path):
    secret = tmp_path / "run_output.txt"
    secret.write_text("trainer data")
    outside = tmp_path / "written_by_sandbox"
    in_tmp = Path("/tmp") / f"sandbox-escape-{secrets.token_hex(4)}"
    targets = {
        "read_run_dir": f"open({str(secret)!r}).read()",
        "read_repo": f"open({str(Path(__file__).resolve())!r}).read()",
        "read_home": f"os.listdir({os.path.expanduser('~')!r})",
        "write_run_dir": f"open({str(outside)!r}, 'w').write('x')",
        "write_tmp": f"open({str(in_tmp)!r}, 'w').write('x')",
        "read_trainer_environ": f"open('/proc/{os.getpid()}/environ').read()",
    }
    code = "import os\n"
    for name, expr in targets.items():
        code += f"try:\n    {expr}\n    print({name!r}, 'ALLOWED')\n"
        code += f"except OSError as e:\n    print({name!r}, type(e).__name__)\n"
    result = _run(launcher, code)
    assert result.exit_code == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    # the host's paths are not there (the sandbox's /tmp is its own tmpfs) or not readable (the parents
    # of the interpreter's prefix, /root here)
    assert lines.pop("write_tmp") == "ALLOWED"
    assert set(lines) == set(targets) - {"write_tmp"}
    assert set(lines.values()) <= {"FileNotFoundError", "PermissionError"}, lines
    assert not outside.exists() and not in_tmp.exists()
    assert secret.read_text() == "trainer data"


def test_trainer_environment_not_visible(launcher):
    value = os.environ[SECRET_VAR]
    code = (
        "import os\nprint(dict(os.environ))\n"
        "try:\n    print(open('/proc/self/environ').read())\nexcept OSError as e:\n    print(e)\n"
    )
    result = _run(launcher, code)
    assert result.exit_code == 0
    assert value not in result.stdout and SECRET_VAR not in result.stdout
    assert "PATH" in result.stdout  # the sandbox's own environment is there


def test_infinite_loop_stopped_by_wall_time(launcher):
    start = time.monotonic()
    result = _run(launcher, "while True:\n    pass\n", timeout_s=1.0)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - start < 3.0
    _unharmed(launcher)


def test_busy_loop_stopped_by_cpu_limit(launcher):
    result = _run(launcher, "while True:\n    pass\n", timeout_s=10.0, limits=replace(LIMITS, cpu_s=1))
    assert not result.timed_out and result.exit_code == -9  # SIGKILL at the CPU limit, before the wall limit


def test_fork_bomb_stopped_by_process_limit(launcher):
    counting = (
        "import os, time\nn = 0\nwhile True:\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint(n)\n"
    )
    result = _run(launcher, counting)
    assert result.exit_code == 0, result.stderr
    assert 0 < int(result.stdout) < LIMITS.processes
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = _run(launcher, bomb, timeout_s=1.5)
    assert result.timed_out and time.monotonic() - start < 4.0
    deadline = time.monotonic() + 2.0
    while _sandbox_uid_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_uid_processes() == []  # every forked process ended with its sandbox
    _unharmed(launcher)


def test_10gb_allocation_stopped_by_memory_limit(launcher):
    result = _run(launcher, "b = bytearray(10 * 10**9)\nprint('allocated')\n")
    assert result.exit_code == 1 and "MemoryError" in result.stderr and result.stdout == ""
    assert result.wall_s < 5.0
    _unharmed(launcher)


def test_memory_of_many_processes_stopped_by_memory_limit(launcher):
    # each process stays below the per-process limit; together they pass it
    code = (
        "import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n"
        "        b = bytearray(100 * 2**20)\n        time.sleep(30)\n        os._exit(0)\n"
        "time.sleep(30)\n"
    )
    start = time.monotonic()
    result = _run(launcher, code, timeout_s=20.0, limits=replace(LIMITS, memory_bytes=300 * 2**20))
    assert result.out_of_memory and result.exit_code is None and not result.timed_out
    assert time.monotonic() - start < 10.0
    _unharmed(launcher)


def test_many_files_stopped_by_disk_limit(launcher):
    # each file stays below the file-size limit; together they pass the disk limit
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(bytes(2**20))\n    i += 1\n"
    limits = replace(LIMITS, file_bytes=4 * 2**20, disk_bytes=32 * 2**20)
    result = _run(launcher, code, timeout_s=20.0, limits=limits)
    assert result.out_of_disk and result.exit_code is None and not result.timed_out
    result = _run(launcher, "open('big', 'wb').write(bytes(8 * 2**20))", limits=limits)
    assert result.exit_code == 1 and "File too large" in result.stderr, result  # RLIMIT_FSIZE
    _unharmed(launcher)


def test_100mb_output_stopped_by_output_limit(launcher):
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n"
    result = _run(launcher, code)
    assert result.truncated and result.exit_code is None and not result.timed_out
    assert result.stdout == "x" * LIMITS.output_bytes
    assert result.wall_s < 5.0
    _unharmed(launcher)


def test_missing_layer_refuses_to_run(launcher, monkeypatch):
    monkeypatch.setitem(launcher.layers, "landlock", "simulated: the kernel offers no Landlock")
    with pytest.raises(ToolError, match="landlock"):
        _run(launcher, "print(1)")


def test_layer_that_fails_at_start_is_reported(tmp_path):
    broken = SandboxLauncher(python=str(tmp_path / "no-such-python"))
    try:
        assert "exec" in broken.missing_layers()
        with pytest.raises(ToolError, match="refusing to run tools"):
            run_python("print(1)", timeout_s=2.0, launcher=broken)
    finally:
        broken.close()


def test_layers_name_themselves_when_the_kernel_refuses():
    with pytest.raises(ls.SetupError, match="^landlock:"):
        ls.restrict_filesystem(["/usr"], [], abi=0)
    with pytest.raises(ls.SetupError, match="^seccomp:"):
        ls.seccomp_program("riscv64")
    for machine in ("x86_64", "aarch64"):
        prog = ls.seccomp_program(machine)
        assert all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in prog)
        jumps = [(i, jt, jf) for i, (code, jt, jf, _) in enumerate(prog) if code != ls.BPF_RET_K]
        assert all(i + 1 + max(jt, jf) < len(prog) for i, jt, jf in jumps)  # every jump lands inside
        assert prog[-1] == (ls.BPF_RET_K, 0, 0, ls.SECCOMP_RET_ALLOW)


SYSTEM_PYTHON = Path("/usr/bin/python3")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not SYSTEM_PYTHON.exists(),
    reason="needs root (to start the launcher as another user), setpriv and a system python3",
)
def test_launcher_of_a_user_who_is_not_root():
    """A trainer that is not root gets its sandboxes in user namespaces that map only the trainer's uid:
    the same refusals, no root to regain, the trainer's own files it can see unchanged (read-only), and
    the process limit counted inside the namespace (the trainer's own processes do not count)."""
    visible = Path(tempfile.mkdtemp(prefix="sandbox-test-"))  # a directory user 65534 can enter
    try:
        os.chmod(visible, 0o755)
        own_file = visible / "trainer_file"
        own_file.write_text("trainer data")
        os.chown(own_file, 65534, 65534)
        before = os.stat(own_file)
        _run_as_nobody(visible, own_file)
        after = os.stat(own_file)
        assert (after.st_mode, after.st_mtime_ns, after.st_ctime_ns) == (
            before.st_mode,
            before.st_mtime_ns,
            before.st_ctime_ns,
        )
        assert own_file.read_text() == "trainer data" and os.listxattr(own_file) == []
    finally:
        shutil.rmtree(visible)


def _run_as_nobody(visible: Path, own_file: Path) -> None:
    config = {
        "python": str(SYSTEM_PYTHON),
        "read_paths": ["/usr", str(visible)],
        "uid_base": SandboxConfig.uid_base,
    }
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(SYSTEM_PYTHON)]
    command += ["-E", "-s", "-S", str(launcher_module.__file__), json.dumps(config)]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={}, cwd="/")
    try:
        hello = json.loads(proc.stdout.readline())
        assert hello["layers"] == {"landlock": None, "seccomp": None, "user namespace": None}
        limits = {name: getattr(LIMITS, name) for name in SANDBOX_LIMITS}
        tamper = "import os\n"
        for call in ["chmod(F, 0o777)", "utime(F, (0, 0))", "setxattr(F, 'user.x', b'1')", "truncate(F, 0)"]:
            tamper += f"try:\n    os.{call}\n    print('changed')\nexcept OSError as e:\n    print(e.errno)\n"
        codes = [
            "import os; print(os.getuid(), os.getpid())",
            f"open({str(Path(__file__).resolve())!r}).read()",
            "import socket; socket.socket()",
            "import os\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n"
            "    if pid == 0:\n        import time; time.sleep(30); os._exit(0)\n    n += 1\nprint(n)\n",
            "import os\ntry:\n    os.setresuid(0, 0, 0)\n    print('root')\n"
            "except OSError as e:\n    print(e.errno)\n",
            tamper.replace("(F,", f"({str(own_file)!r},"),
        ]
        replies = []
        for i, code in enumerate(codes):
            request = {"id": i, "code": code, "timeout_s": 5.0, "limits": limits}
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            replies.append(json.loads(proc.stdout.readline()))
        assert replies[0]["stdout"] == "1000 1\n"  # an ordinary user, pid 1 of its own namespace
        assert "FileNotFoundError" in replies[1]["stderr"]  # the repository is not in its root
        assert "Address family not supported" in replies[2]["stderr"]
        assert 0 < int(replies[3]["stdout"]) < LIMITS.processes
        assert replies[4]["stdout"] in {f"{errno.EINVAL}\n", f"{errno.EPERM}\n"}, replies[4]
        assert replies[5]["stdout"].split() == [str(errno.EROFS)] * 4, replies[5]  # its own file, read-only
    finally:
        proc.kill()
        proc.wait()
