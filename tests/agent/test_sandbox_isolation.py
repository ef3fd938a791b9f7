"""No state passes from one sandbox to another, one after the other or running at the same time: a writer
tries every channel (host files' contents, modes, times and xattrs; its files, filesystem and abstract
sockets; /dev/shm; SysV and POSIX IPC; the environment; the hostname) and a reader looks for each. The host
file is a temporary file this module creates, visible read-only to the sandboxes; it is checked afterwards."""

import json
import os
import secrets
import textwrap
import threading
import time

import pytest

from megatron_gptoss.agent import SandboxLauncher, run_python
from megatron_gptoss.agent.sandbox import interpreter_read_paths
from megatron_gptoss.config import SandboxConfig

LIMITS = SandboxConfig(cpu_s=5, processes=12)
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sees a sandbox's files through /proc/PID/root")

COMMON = """
import ctypes, errno, json, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
TOKEN, HOST_FILE, HOLD_S = {token!r}, {host_file!r}, {hold_s!r}
SEM_KEY = int(TOKEN[:6], 16)
PATHS = ["/tmp/" + TOKEN, "/home/sandbox/" + TOKEN, "/dev/shm/" + TOKEN]
SOCKETS = ["/tmp/" + TOKEN + ".sock", "/dev/shm/" + TOKEN + ".sock", "\\0" + TOKEN]
def quiet(f):
    try:
        return f()
    except OSError:
        return None
def works(f):
    try:
        f()
        return True
    except OSError:
        return False
"""

WRITER = """
stamps = {"start": time.time()}
for path in PATHS:
    with open(path, "w") as f:
        f.write(TOKEN)
listeners = []
for address in SOCKETS:
    s = socket.socket(socket.AF_UNIX)
    s.bind(address)
    s.listen()
    listeners.append(s)
semaphore = libc.semget(SEM_KEY, 1, 0o1000 | 0o600)  # IPC_CREAT
queue = libc.mq_open(("/" + TOKEN).encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
os.environ["SANDBOX_CHANNEL"] = TOKEN
name = TOKEN.encode()
tried = {
    "semget": semaphore >= 0,
    "mq_open": queue >= 0,
    "sethostname": libc.sethostname(name, len(name)) == 0,
    "chmod": works(lambda: os.chmod(HOST_FILE, 0o777)),
    "utime": works(lambda: os.utime(HOST_FILE, (1, 1))),
    "setxattr": works(lambda: os.setxattr(HOST_FILE, "user.channel", name)),
    "write": works(lambda: open(HOST_FILE, "w").write(TOKEN)),
    "read": quiet(lambda: open(HOST_FILE).read()),
}
stamps["ready"] = time.time()
open("/tmp/ready", "w").close()
time.sleep(HOLD_S)
stamps["end"] = time.time()
print(json.dumps({"stamps": stamps, "tried": tried}))
"""

READER = """
def look():
    seen = {}
    for path in PATHS:
        if os.path.exists(path):
            seen[path] = "file"
    for address in SOCKETS:
        s = socket.socket(socket.AF_UNIX)
        if works(lambda: s.connect(address)):
            seen[repr(address)] = "socket"
        s.close()
    if libc.semget(SEM_KEY, 0, 0) >= 0:
        seen["semget"] = "semaphore"
    if libc.mq_open(("/" + TOKEN).encode(), os.O_RDONLY) >= 0:
        seen["mq_open"] = "queue"
    if TOKEN in os.environ.get("SANDBOX_CHANNEL", "") or TOKEN in socket.gethostname():
        seen["environment"] = "token"
    st = os.stat(HOST_FILE)
    seen["host_file"] = [st.st_mode, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, os.listxattr(HOST_FILE)]
    return seen
first = time.time()
observations = [look()]
while time.time() < first + HOLD_S:
    time.sleep(0.05)
    observations.append(look())
print(json.dumps({"first": first, "last": time.time(), "seen": observations[-1],
                  "changed": [o for o in observations if o != observations[0]]}))
"""


@pytest.fixture(scope="module")
def host_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("host")
    os.chmod(directory, 0o755)
    path = directory / "host_file"
    path.write_text("host data")
    os.chmod(path, 0o644)
    os.setxattr(path, "user.host", b"kept")
    os.utime(path, ns=(1_000_000_000_000_000_000, 1_100_000_000_000_000_000))
    return path


@pytest.fixture(scope="module")
def launcher(host_file):
    started = SandboxLauncher(read_paths=[*interpreter_read_paths(), str(host_file.parent)])
    yield started
    started.close()


def _program(part: str, token: str, host_file, hold_s: float) -> str:
    return COMMON.format(token=token, host_file=str(host_file), hold_s=hold_s) + textwrap.dedent(part)


def _run(launcher, code):
    result = run_python(code, timeout_s=10.0, limits=LIMITS, launcher=launcher)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _stat(path) -> tuple:
    st = os.stat(path)
    return st.st_mode, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, sorted(os.listxattr(path))


def _wait_until_ready(token: str, timeout_s: float = 10.0) -> None:
    """Wait until a sandbox has written /tmp/ready and /tmp/`token` (seen from the host through
    /proc/PID/root, which only root may follow)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit() and os.path.exists(f"/proc/{entry}/root/tmp/{token}"):
                if os.path.exists(f"/proc/{entry}/root/tmp/ready"):
                    return
        time.sleep(0.02)
    raise TimeoutError(f"no sandbox wrote /tmp/{token} within {timeout_s} s")


def _check_writer(written: dict) -> None:
    tried = written["tried"]
    assert tried["semget"]  # its own semaphore exists, in its own IPC namespace (POSIX queues: refused)
    assert not tried["sethostname"]
    assert [tried[k] for k in ("chmod", "utime", "setxattr", "write")] == [False] * 4  # all refused
    assert tried["read"] == "host data"


def test_nothing_passes_between_sandboxes_one_after_the_other(launcher, host_file):
    token = secrets.token_hex(8)
    host_before = _stat(host_file)
    baseline = _run(launcher, _program(READER, token, host_file, 0.0))
    _check_writer(_run(launcher, _program(WRITER, token, host_file, 0.0)))
    after = _run(launcher, _program(READER, token, host_file, 0.0))
    assert set(after["seen"]) == {"host_file"}, after["seen"]
    assert after["seen"] == baseline["seen"]  # the host file looks the same: no mode, time or xattr moved
    assert _stat(host_file) == host_before and host_file.read_text() == "host data"


def test_nothing_passes_between_sandboxes_running_together(launcher, host_file):
    token = secrets.token_hex(8)
    host_before = _stat(host_file)
    box = []
    writer = threading.Thread(
        target=lambda: box.append(_run(launcher, _program(WRITER, token, host_file, 2.0)))
    )
    writer.start()
    _wait_until_ready(token)
    read = _run(launcher, _program(READER, token, host_file, 0.3))
    writer.join()
    written = box[0]
    _check_writer(written)
    assert written["stamps"]["ready"] < read["last"] < written["stamps"]["end"]  # the reader looked meanwhile
    assert set(read["seen"]) == {"host_file"} and read["changed"] == [], read
    assert _stat(host_file) == host_before and host_file.read_text() == "host data"
