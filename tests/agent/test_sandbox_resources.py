"""Resource holes of the sandbox, closed: memory outside the processes (memfd, the tmpfs), disk that a
directory walk cannot see (unlinked open files, trees deeper than PATH_MAX), the host's shared budgets (AIO,
inotify), and failures that must reach the model as a result, never as an exception in the trainer. Each
test checks the host afterwards: the sandboxes' temporary root is empty, the launcher unharmed."""

import os
import textwrap
import threading
import time
from dataclasses import replace

import pytest

from megatron_gptoss.agent import SandboxLauncher, run_python
from megatron_gptoss.config import SandboxConfig
from megatron_gptoss.errors import ConfigError

LIMITS = SandboxConfig(cpu_s=5, processes=12)


@pytest.fixture
def limits(tmp_path):
    """LIMITS with the sandboxes' directories below a fresh `tmp_path`."""
    return replace(LIMITS, temp_root=str(tmp_path))


def _run(launcher, code, limits, timeout_s=10.0):
    return run_python(code, timeout_s=timeout_s, limits=limits, launcher=launcher)


def _host_clean(launcher, limits):
    assert os.listdir(limits.temp_root) == []  # every sandbox's directory is gone
    result = _run(launcher, "print(6 * 7)", limits)
    assert (result.stdout, result.exit_code, result.error) == ("42\n", 0, None)


def test_memfd_refused_and_tmpfs_counted_as_memory(sandbox_launcher, limits):
    small = replace(limits, memory_bytes=128 << 20, disk_bytes=512 << 20, file_bytes=512 << 20)
    code = "import os\ntry:\n    os.memfd_create('m')\nexcept OSError as e:\n    print(e.strerror)\n"
    result = _run(sandbox_launcher, code, small)
    assert result.stdout == "Function not implemented\n", result
    # 360 MiB in /dev/shm: within the disk limit, past the memory limit (files of the tmpfs are memory)
    code = (
        "import time\nwith open('/dev/shm/block', 'wb') as f:\n    for _ in range(360):\n"
        "        f.write(bytes(1 << 20))\nprint('written', flush=True)\ntime.sleep(30)\n"
    )
    result = _run(sandbox_launcher, code, small)
    assert result.out_of_memory and result.exit_code is None and not result.timed_out, result
    _host_clean(sandbox_launcher, limits)


def test_unlinked_open_files_count_against_the_disk_limit(sandbox_launcher, limits):
    small = replace(limits, disk_bytes=16 << 20, file_bytes=64 << 20)
    fill = textwrap.dedent(
        """
        import os, time
        f = open('hidden', 'wb')
        os.unlink('hidden')
        written = 0
        try:
            while True:
                written += f.write(bytes(1 << 20))
                f.flush()
        except OSError as e:
            print(written, e.strerror, flush=True)
        """
    )
    result = _run(sandbox_launcher, fill, small)
    written, reason = result.stdout.split(" ", 1)
    assert int(written) <= small.disk_bytes and reason == "No space left on device\n", result
    result = _run(sandbox_launcher, fill + "time.sleep(30)\n", small)  # held open: seen full, stopped
    assert result.out_of_disk and result.exit_code is None and not result.timed_out, result
    _host_clean(sandbox_launcher, limits)


def test_tree_deeper_than_path_max_counts_and_leaves_nothing(sandbox_launcher, limits):
    small = replace(limits, disk_bytes=16 << 20, file_bytes=64 << 20)
    code = textwrap.dedent(
        """
        import os
        name = 'directory_of_a_deep_tree'
        for _ in range(1200):
            os.mkdir(name)
            os.chdir(name)
        print(1200 * len(name + '/'), flush=True)  # the path's length below the home directory
        with open('data', 'wb') as f:
            while True:
                f.write(bytes(1 << 20))
        """
    )
    result = _run(sandbox_launcher, code, small)
    assert int(result.stdout) > 4096, result  # deeper than PATH_MAX
    assert result.out_of_disk and result.exit_code is None and result.error is None, result
    _host_clean(sandbox_launcher, limits)


def test_host_budgets_aio_and_inotify_refused(sandbox_launcher, limits):
    aio_before = int(open("/proc/sys/fs/aio-nr").read())
    code = textwrap.dedent(
        """
        import ctypes, os, platform
        libc = ctypes.CDLL(None, use_errno=True)
        context = ctypes.c_ulong(0)
        io_setup = {"x86_64": 206, "aarch64": 0}[platform.machine()]
        calls = {
            "io_setup": lambda: libc.syscall(io_setup, 65536, ctypes.byref(context)),
            "inotify_init1": lambda: libc.inotify_init1(0),
            "inotify_init1_x100": lambda: min(libc.inotify_init1(0) for _ in range(100)),
            "fanotify_init": lambda: libc.fanotify_init(0, 0),
        }
        for name, call in calls.items():
            print(name, call(), os.strerror(ctypes.get_errno()))
        """
    )
    result = _run(sandbox_launcher, code, limits)
    assert result.exit_code == 0, result.stderr
    for line in result.stdout.splitlines():
        assert line.split(" ", 1)[1] == "-1 Function not implemented", result.stdout
    assert len(result.stdout.splitlines()) == 4
    assert int(open("/proc/sys/fs/aio-nr").read()) <= aio_before
    _host_clean(sandbox_launcher, limits)


def test_disk_limit_too_small_for_the_code_refused():
    with pytest.raises(ConfigError, match="sandbox.disk_bytes=4096 is too small"):
        SandboxConfig(disk_bytes=4096).validate()


def test_code_that_is_not_utf8_is_an_error_result(sandbox_launcher, limits):
    result = _run(sandbox_launcher, "print('\ud800')", limits)
    assert result.exit_code is None and result.error is not None and "UTF-8" in result.error
    assert result.error in result.stderr  # the model reads it
    _host_clean(sandbox_launcher, limits)


def test_sandbox_directory_lives_below_temp_root_while_it_runs(sandbox_launcher, limits):
    box = []
    thread = threading.Thread(
        target=lambda: box.append(_run(sandbox_launcher, "import time; time.sleep(1)", limits))
    )
    thread.start()
    seen: set[str] = set()
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        seen.update(os.listdir(limits.temp_root))
        time.sleep(0.02)
    thread.join()
    assert len(seen) == 1 and next(iter(seen)).startswith("sandbox-")
    assert box[0].exit_code == 0
    _host_clean(sandbox_launcher, limits)


def test_closing_the_launcher_stops_its_sandboxes_and_removes_their_directories(limits):
    launcher = SandboxLauncher()
    box = []
    thread = threading.Thread(
        target=lambda: box.append(_run(launcher, "import time; time.sleep(30)", limits))
    )
    try:
        thread.start()
        deadline = time.monotonic() + 5.0
        while not os.listdir(limits.temp_root) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
    finally:
        launcher.close()
    thread.join(timeout=10.0)
    assert box and box[0].exit_code is None and box[0].error is not None  # answered, as an error
    assert os.listdir(limits.temp_root) == [] and not launcher.alive
