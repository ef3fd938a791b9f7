"""One sandbox's stage: the process the launcher starts per call, as
`python -E -s -S -c "import sandbox_stage; ..." --stage SPEC_JSON`. It imports only the standard library
and `linux_sandbox` (next to it), the fewest modules it can: its start is part of every call.

    stage: namespaces, the tmpfs root on the call's directory ──fork──> pid 1: pivot_root, uid, limits,
           Landlock, seccomp ──exec──> python -I main.py
    stage: watches pid 1 (memory, disk), reaps it, reports on the status fd

The stage dies with the launcher thread that started it, and pid 1 with the stage.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys

if __package__:
    from megatron_gptoss.agent import linux_sandbox as ls
else:  # imported by path: linux_sandbox.py is next to this file
    import linux_sandbox as ls  # type: ignore[no-redef]

DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/urandom", "/dev/random"]
HOSTNAME = "sandbox"
USER_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": ls.SANDBOX_HOME,
    "TMPDIR": "/tmp",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
MONITOR_POLL_S = 0.05  # seconds between two checks of a sandbox's memory and disk
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MAX_DISK_ENTRIES = 10_000  # files and directories a sandbox may create (the tmpfs's inodes)


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


def _report(fd: int, **fields: object) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def stage_main(spec: dict) -> int:
    """Build the sandbox on `spec["dir"]` (which holds main.py), start its pid 1 and watch it; report
    {"exit": status} or {"signal": n}, with {"stopped": "memory" | "disk" | None}, or {"error", "layer"}
    on the status fd."""
    fd = spec["status_fd"]
    limits = spec["limits"]
    root = os.geteuid() == 0
    uid = spec["uid"] if root else ls.INNER_ID
    try:
        ls.die_with_parent()
        with open(os.path.join(spec["dir"], "main.py"), "rb") as f:
            code = f.read()
        ls.enter_namespaces(user_namespace=not root, hostname=HOSTNAME)
        account = f"sandbox:x:{uid}:{uid}:sandbox:{ls.SANDBOX_HOME}:/bin/sh\n".encode()
        ls.build_root(
            spec["dir"],
            read_paths=spec["read_paths"],
            devices=DEVICES,
            size_bytes=limits["disk_bytes"],
            inodes=MAX_DISK_ENTRIES,
            owner=uid,
            files={
                f"{ls.SANDBOX_HOME}/main.py": code,
                "/etc/passwd": account,
                "/etc/group": f"sandbox:x:{uid}:\n".encode(),
                "/etc/hostname": f"{HOSTNAME}\n".encode(),
            },
        )
        disk = os.open(spec["dir"], os.O_RDONLY | os.O_DIRECTORY)
        alive_r, alive_w = os.pipe()
    except ls.SetupError as err:
        _report(fd, error=str(err), layer=err.layer)
        return 125
    except OSError as err:
        _report(fd, error=f"setup: {err}", layer="setup")
        return 125
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _sandbox_main(spec, uid if root else None, alive_r)
    os.close(alive_r)
    status, stopped = _monitor(pid, disk, limits["memory_bytes"])
    if os.WIFSIGNALED(status):
        _report(fd, signal=os.WTERMSIG(status), stopped=stopped)
    else:
        _report(fd, exit=os.WEXITSTATUS(status), stopped=stopped)
    return 0


def _sandbox_main(spec: dict, uid: int | None, alive_r: int) -> None:
    """pid 1 of the sandbox: apply the remaining layers in order, then exec the interpreter; never
    returns."""
    fd = spec["status_fd"]
    limits = spec["limits"]
    try:
        ls.die_with_parent()
        if select.select([alive_r], [], [], 0)[0]:  # the stage ended before the line above took effect
            os._exit(125)
        os.close(alive_r)
        ls.enter_root(spec["dir"])
        os.setsid()
        ls.drop_privileges(uid)
        ls.die_with_parent()  # the uid change cleared it
        os.chdir(ls.SANDBOX_HOME)
        ls.set_limits(
            memory_bytes=limits["memory_bytes"],
            cpu_s=limits["cpu_s"],
            processes=limits["processes"],
            file_bytes=limits["file_bytes"],
            open_files=limits["open_files"],
        )
        write_paths = [*ls.WRITABLE_DIRS, *DEVICES]
        ls.restrict_filesystem([*spec["read_paths"], "/etc"], write_paths, spec["landlock_abi"])
        ls.install_seccomp()
        os.set_inheritable(fd, False)  # closed by a successful exec, kept to report a failed one
        os.execve(spec["python"], [spec["python"], "-I", "main.py"], USER_ENV)
    except ls.SetupError as err:
        _report(fd, error=str(err), layer=err.layer)
    except BaseException as err:
        _report(fd, error=f"exec: {err}", layer="exec")
    os._exit(125)


def _monitor(pid: int, disk: int, memory_bytes: int) -> tuple[int, str | None]:
    """Wait for the sandbox's pid 1 (`pid`); every MONITOR_POLL_S stop it (SIGKILL; the kernel then ends
    every process of its pid namespace) when its tmpfs (open dir `disk`) is full ("disk") or its
    processes' resident memory plus the tmpfs's pages pass `memory_bytes` ("memory"). Returns (its wait
    status, why it was stopped or None); a tmpfs full when it ended counts as "disk" too."""
    pidfd = os.pidfd_open(pid)
    stopped = None
    try:
        while not select.select([pidfd], [], [], MONITOR_POLL_S)[0]:
            used, full = ls.tmpfs_usage(disk)
            if full:
                stopped = "disk"
            elif used + resident_bytes(pid) > memory_bytes:
                stopped = "memory"
            if stopped is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                break
    finally:
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    if stopped is None and ls.tmpfs_usage(disk)[1]:
        stopped = "disk"
    return status, stopped


def main(argv: list[str]) -> int:
    """`... --stage SPEC_JSON`: run one stage."""
    if len(argv) != 3 or argv[1] != "--stage":
        raise SystemExit(f"usage: {argv[0]} --stage SPEC_JSON")
    return stage_main(json.loads(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
