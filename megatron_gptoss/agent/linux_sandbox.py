"""The Linux mechanisms of the Python sandbox, through ctypes and the standard library only.

This module is imported by the launcher script (`launcher.py`, run by path in a clean interpreter), so it
imports nothing from the project. Each function applies one layer to the calling process and raises
`SetupError` naming the layer when the kernel refuses it; nothing degrades silently.

    enter_namespaces(...)        mount, network, pid, IPC, UTS and cgroup namespaces (unshare), inside a
                                 user namespace of their own when the caller is not root; the next fork is
                                 pid 1; the sandbox's own hostname
    build_root(top, ...)         in the stage's mount namespace: a tmpfs of `size_bytes` on `top` holding
                                 read-only, nosuid bind mounts of the interpreter, the system libraries and
                                 a few devices, and the only writable directories (home, /tmp, /dev/shm)
    enter_root(top)              pid 1: a mount namespace whose root is that tmpfs (pivot_root); no other
                                 host directory is reachable, so neither are host unix sockets
    drop_privileges(uid)         real, effective, saved and filesystem uids and gids a non-root id with no
                                 mapping back to 0 (root: a host uid of the sandbox's own; not root: the
                                 caller's, seen as INNER_ID), no supplementary groups, no capability, an
                                 empty bounding set, no_new_privs
    set_limits(...)              setrlimit: address space, CPU seconds, processes (counted per uid),
                                 file size, open files, no core dumps
    restrict_filesystem(...)     Landlock: read+execute below the given read paths, everything below the
                                 given write paths, nothing else; TCP bind/connect denied (ABI >= 4);
                                 abstract unix sockets and signals scoped to the sandbox (ABI >= 6)
    install_seccomp()            seccomp-bpf: sockets other than AF_UNIX, ptrace, namespace changes,
                                 mounts, io_uring, BPF, keyrings, module and kexec calls fail with EPERM;
                                 AIO, inotify, fanotify, memfd and SysV shared memory and message queues
                                 with ENOSYS; a foreign architecture's system calls kill the process
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import struct

LIBC = ctypes.CDLL(None, use_errno=True)

# prctl options
PR_SET_PDEATHSIG = 1
PR_GET_SECCOMP = 21
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# securebits: uid 0 gets no capabilities from an exec, ambient capabilities cannot be raised; all locked
SECBIT_NOROOT, SECBIT_NO_CAP_AMBIENT_RAISE = 1 << 0, 1 << 6
SECBIT_LOCKS = (1 << 1) | (1 << 3) | (1 << 5) | (1 << 7)
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
SECCOMP_MODE_FILTER = 2

# clone / unshare flags
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
NAMESPACE_FLAGS = (
    (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID)
    | CLONE_NEWNET
    | CLONE_NEWTIME
)
INNER_ID = 1000  # the uid and gid user code sees inside its user namespace (a trainer that is not root)

# mounts
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1 << 10, 1 << 11, 1 << 12, 1 << 14
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442
_PIVOT_ROOT = (155, 41)
# mount flags a bind mount inherits from its source (locked inside a user namespace): kept on remount
_KEPT_FLAGS = {
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
SANDBOX_HOME = "/home/sandbox"  # working directory, HOME and main.py's directory inside the sandbox
WRITABLE_DIRS = (SANDBOX_HOME, "/tmp", "/dev/shm")  # the only writable places, all on the tmpfs

# Landlock (include/uapi/linux/landlock.h); the three system calls have one number on every architecture
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
# Every filesystem right each ABI version knows (v2 adds REFER, v3 TRUNCATE, v5 IOCTL_DEV).
_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
# What each Landlock ABI version adds to the sandbox. Below MIN_LANDLOCK_ABI tools are refused unless
# `sandbox.allow_weak_kernel` accepts the kernel (the other layers then stand in for the missing ones).
LANDLOCK_PROTECTIONS = {
    2: "renaming and linking files across directories (REFER)",
    3: "truncation of files (TRUNCATE)",
    4: "TCP bind and connect rules",
    5: "ioctl on devices (IOCTL_DEV)",
    6: "signals and abstract unix sockets scoped to the sandbox",
}
MIN_LANDLOCK_ABI = 6  # Linux 6.12

# seccomp-bpf
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
X32_SYSCALL_BIT = 0x40000000
AF_UNIX = 1
# System calls user code never needs, per architecture (x86_64 numbers, aarch64 numbers): EPERM.
_DENIED = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": _PIVOT_ROOT,
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "acct": (163, 89),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "quotactl": (179, 60),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "syslog": (103, 116),
}
# Facilities whose use the sandbox cannot account or that draw on budgets shared with the host (the
# host's AIO requests, a user's inotify instances, memory outside the tmpfs and the processes): ENOSYS,
# so libraries take their fallback. None: the architecture has no such call.
_UNAVAILABLE: dict[str, tuple[int | None, int | None]] = {
    "io_setup": (206, 0),
    "inotify_init": (253, None),
    "inotify_init1": (294, 26),
    "fanotify_init": (300, 262),
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
    "msgget": (68, 186),
}
_SOCKET = {"socket": (41, 198), "socketpair": (53, 199)}
_CLONE, _CLONE3 = (56, 220), (435, 435)


class SetupError(Exception):
    """A sandbox layer could not be applied; the message starts with the layer's name."""

    def __init__(self, layer: str, reason: str):
        super().__init__(f"{layer}: {reason}")
        self.layer = layer


def _check(layer: str, result: int, what: str = "") -> int:
    if result < 0:
        code = ctypes.get_errno()
        where = f"{what}: " if what else ""
        raise SetupError(layer, f"{where}{errno.errorcode.get(code, code)} ({os.strerror(code)})")
    return result


def _prctl(layer: str, option: int, arg: int | ctypes.c_void_p = 0) -> int:
    return _check(layer, LIBC.prctl(option, arg, 0, 0, 0))


def arch() -> str:
    """The machine's architecture as the seccomp tables name it ("x86_64", "aarch64", or another)."""
    machine = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _column() -> int:
    return 1 if arch() == "aarch64" else 0


# ---- namespaces and the sandbox's root -------------------------------------------------------------------


def enter_namespaces(*, user_namespace: bool, hostname: str) -> None:
    """New mount, network, pid, IPC, UTS and cgroup namespaces, inside a new user namespace where
    `user_namespace` (a caller that is not root needs one; the caller is mapped to INNER_ID inside, and no
    other id). The network namespace has only a loopback that is down; the pid namespace starts with the
    caller's next child; the UTS namespace is named `hostname`."""
    uid, gid = os.geteuid(), os.getegid()
    if user_namespace:
        _check("user namespace", LIBC.unshare(CLONE_NEWUSER))
        try:
            for path, text in (
                ("/proc/self/setgroups", "deny"),
                ("/proc/self/uid_map", f"{INNER_ID} {uid} 1"),
                ("/proc/self/gid_map", f"{INNER_ID} {gid} 1"),
            ):
                with open(path, "w") as f:
                    f.write(text)
        except OSError as err:
            raise SetupError("user namespace", f"cannot write the id maps: {err}") from None
    for flag, name in (
        (CLONE_NEWNS, "mount namespace"),
        (CLONE_NEWNET, "network namespace"),
        (CLONE_NEWPID, "pid namespace"),
        (CLONE_NEWIPC, "ipc namespace"),
        (CLONE_NEWUTS, "uts namespace"),
        (CLONE_NEWCGROUP, "cgroup namespace"),
    ):
        _check(name, LIBC.unshare(flag))
    raw = hostname.encode()
    _check("uts namespace", LIBC.sethostname(raw, len(raw)), "sethostname")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if x is None else x.encode() for x in (source, target, fstype)]
    raw = None if data is None else data.encode()
    _check("mount", LIBC.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), raw), target)


def _lock_down(target: str, attrs: int) -> None:
    """Apply mount attributes `attrs` (MOUNT_ATTR_*) to the bind mount at `target` and every mount below
    it; kernels before 5.12 (no mount_setattr) get a remount of the top mount."""
    attr = ctypes.create_string_buffer(struct.pack("=QQQQ", attrs, 0, 0, 0), 32)
    result = LIBC.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, attr, 32)
    if result == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:
        _check("mount", result, f"mount_setattr {target}")
    kept = os.statvfs(target).f_flag
    flags = MS_REMOUNT | MS_BIND | sum(ms for st, ms in _KEPT_FLAGS.items() if kept & st)
    flags |= (MS_RDONLY if attrs & MOUNT_ATTR_RDONLY else 0) | (MS_NOSUID if attrs & MOUNT_ATTR_NOSUID else 0)
    _mount(None, target, None, flags | (MS_NODEV if attrs & MOUNT_ATTR_NODEV else 0))


def _replicate(path: str, top: str, attrs: int) -> None:
    """Make host `path` appear at the same path below `top`: a symbolic link as the same link, a file or
    directory as a bind mount with attributes `attrs`. A path that does not exist is skipped."""
    if not os.path.lexists(path):
        return
    target = top + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.mkdir(target, 0o755)
    else:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    _mount(path, target, None, MS_BIND | MS_REC)
    _lock_down(target, attrs)


def build_root(
    top: str,
    *,
    read_paths: list[str],
    devices: list[str],
    size_bytes: int,
    inodes: int,
    owner: int,
    files: dict[str, bytes],
) -> None:
    """In the caller's own mount namespace (after `enter_namespaces`): mount a tmpfs of at most
    `size_bytes` bytes and `inodes` files and directories on `top`, and lay out the sandbox's root in it:
    each of `read_paths` (absolute; nested ones skipped) read-only, nosuid and nodev, `devices` read-only
    and nosuid, the WRITABLE_DIRS owned by uid and gid `owner` (mode 0700), and `files` ({absolute path:
    content}; below the writable dirs owned by `owner`, elsewhere read-only to it)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_bytes},nr_inodes={inodes},mode=755")
    bound: list[str] = []
    try:
        for path in sorted(set(read_paths)):
            if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound):
                _replicate(path, top, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
                bound.append(path)
        for device in devices:
            _replicate(device, top, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
        for directory in WRITABLE_DIRS:
            os.makedirs(top + directory, mode=0o755, exist_ok=True)
            os.chmod(top + directory, 0o700)
            os.chown(top + directory, owner, owner)
        for path, content in files.items():
            os.makedirs(os.path.dirname(top + path), mode=0o755, exist_ok=True)
            fd = os.open(top + path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, content)
                if any(path.startswith(d + "/") for d in WRITABLE_DIRS):
                    os.fchown(fd, owner, owner)
            finally:
                os.close(fd)
    except OSError as err:
        raise SetupError("root filesystem", str(err)) from None


def enter_root(top: str) -> None:
    """Make the tmpfs on `top` (from `build_root`) this process's root, in a mount namespace of its own
    from which the host's tree is detached."""
    _check("mount namespace", LIBC.unshare(CLONE_NEWNS))
    os.chdir(top)
    _check("pivot_root", LIBC.syscall(_PIVOT_ROOT[_column()], b".", b"."))
    _check("pivot_root", LIBC.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")


def tmpfs_usage(fd: int) -> tuple[int, bool]:
    """(bytes used, whether it is full: no block or no inode left) of the tmpfs holding open dir `fd`."""
    st = os.fstatvfs(fd)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_bfree == 0 or st.f_ffree == 0


# ---- privileges and limits -------------------------------------------------------------------------------


def drop_privileges(uid: int | None) -> None:
    """Leave no privilege to lose. `uid` given (the caller is root): no supplementary groups, and every
    gid and uid (real, effective, saved, filesystem) `uid`, which the kernel follows by clearing the
    capabilities; None (inside a user namespace that maps INNER_ID only): the ids stay. Then the bounding
    set is emptied, no capability is left, securebits keep an exec from granting any, and no_new_privs is
    set. Raises SetupError if setuid(0) still succeeds afterwards."""
    for cap in range(64):  # up to the first number the kernel does not know (EINVAL)
        if LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            if ctypes.get_errno() == errno.EINVAL and cap > 0:
                break
            _check("capabilities", -1, f"drop capability {cap} from the bounding set")
    bits = SECBIT_NOROOT | SECBIT_NO_CAP_AMBIENT_RAISE | SECBIT_LOCKS
    _prctl("capabilities", PR_SET_SECUREBITS, bits)
    try:
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
    except OSError as err:
        raise SetupError("unprivileged uid", str(err)) from None
    header = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all empty
    _check("capabilities", LIBC.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)))
    _prctl("no_new_privs", PR_SET_NO_NEW_PRIVS, 1)
    try:
        os.setuid(0)
    except OSError:
        return
    raise SetupError("unprivileged uid", "setuid(0) still succeeds")


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (set again after a uid change clears
    it)."""
    _prctl("prctl", PR_SET_PDEATHSIG, 9)


def become_subreaper() -> None:
    """Orphaned descendants of this process become its children (so it, not an ancestor, reaps them)."""
    _prctl("prctl", PR_SET_CHILD_SUBREAPER, 1)


def set_limits(*, memory_bytes: int, cpu_s: int, processes: int, file_bytes: int, open_files: int) -> None:
    """setrlimit with soft = hard: past the CPU limit the kernel sends SIGKILL (SIGXCPU is ignored by a
    pid namespace's init); RLIMIT_NPROC counts the processes and threads of this uid, which no other
    sandbox holds (its own host uid, or its own user namespace)."""
    limits = {
        resource.RLIMIT_AS: memory_bytes,
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_NPROC: processes,
        resource.RLIMIT_FSIZE: file_bytes,
        resource.RLIMIT_NOFILE: open_files,
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_MEMLOCK: 0,
    }
    for which, value in limits.items():
        try:
            resource.setrlimit(which, (value, value))
        except (OSError, ValueError) as err:
            raise SetupError("setrlimit", f"resource {which} to {value}: {err}") from None


# ---- Landlock --------------------------------------------------------------------------------------------


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, Landlock absent or disabled)."""
    result = LIBC.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    return max(int(result), 0)


def missing_landlock_protections(abi: int) -> list[str]:
    """The protections of LANDLOCK_PROTECTIONS up to MIN_LANDLOCK_ABI that Landlock ABI `abi` lacks."""
    return [
        f"{what} (ABI {version})"
        for version, what in sorted(LANDLOCK_PROTECTIONS.items())
        if abi < version <= MIN_LANDLOCK_ABI
    ]


def _fs_rights(abi: int) -> int:
    return _FS_RIGHTS_BY_ABI[max(v for v in _FS_RIGHTS_BY_ABI if v <= abi)]


def restrict_filesystem(read_paths: list[str], write_paths: list[str], abi: int) -> None:
    """Landlock at ABI `abi`: allow reading (and executing) below `read_paths`, everything below
    `write_paths`, and no other file access; with ABI >= 4 no TCP bind or connect; with ABI >= 6 abstract
    unix sockets and signals only within the sandbox. Paths that do not exist are skipped. Sets
    no_new_privs."""
    if abi < 1:
        raise SetupError("landlock", "the kernel offers no Landlock (ABI 0)")
    handled = _fs_rights(abi)
    attr = struct.pack("=Q", handled)
    if abi >= 4:
        attr += struct.pack("=Q", NET_BIND_TCP | NET_CONNECT_TCP)
    if abi >= 6:
        attr += struct.pack("=Q", SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(
        "landlock", LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), 0)
    )
    try:
        for paths, rights in ((read_paths, FS_READ), (write_paths, handled)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    allowed = rights if os.path.isdir(path) else rights & FILE_ONLY & handled
                    rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
                    _check(
                        "landlock",
                        LIBC.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0),
                    )
                finally:
                    os.close(fd)
        _prctl("no_new_privs", PR_SET_NO_NEW_PRIVS, 1)
        _check("landlock", LIBC.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0))
    finally:
        os.close(ruleset)


# ---- seccomp ---------------------------------------------------------------------------------------------


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF program (code, jt, jf, k) of the filter for `machine` ("x86_64" or "aarch64")."""
    if machine not in AUDIT_ARCH:
        raise SetupError("seccomp", f"no system call table for architecture {machine!r}")
    col = 0 if machine == "x86_64" else 1
    eperm, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    prog = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH[machine]),
        (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":  # the x32 ABI shares the architecture tag
        prog += [(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT), (BPF_RET_K, 0, 0, enosys)]
    for numbers in _DENIED.values():
        prog += [(BPF_JEQ_K, 0, 1, numbers[col]), (BPF_RET_K, 0, 0, eperm)]
    for pair in _UNAVAILABLE.values():
        number = pair[col]
        if number is not None:
            prog += [(BPF_JEQ_K, 0, 1, number), (BPF_RET_K, 0, 0, enosys)]
    # clone3 passes its flags in memory the filter cannot read: ENOSYS makes libc fall back to clone
    prog += [(BPF_JEQ_K, 0, 1, _CLONE3[col]), (BPF_RET_K, 0, 0, enosys)]
    prog += [
        (BPF_JEQ_K, 0, 4, _CLONE[col]),
        (BPF_LD_W_ABS, 0, 0, 16),  # args[0] (low 32 bits): the clone flags
        (BPF_JSET_K, 0, 1, NAMESPACE_FLAGS),
        (BPF_RET_K, 0, 0, eperm),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    for numbers in _SOCKET.values():
        prog += [
            (BPF_JEQ_K, 0, 4, numbers[col]),
            (BPF_LD_W_ABS, 0, 0, 16),  # args[0]: the address family
            (BPF_JEQ_K, 0, 1, AF_UNIX),
            (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
            (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT),
        ]
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    return prog


def install_seccomp() -> None:
    """Install the filter of `seccomp_program` on this process (and every process it starts)."""
    if LIBC.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0:
        raise SetupError("seccomp", "the kernel has no seccomp (PR_GET_SECCOMP failed)")
    prog = seccomp_program(arch())
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(raw, len(raw))
    fprog = ctypes.create_string_buffer(struct.pack("@HP", len(prog), ctypes.addressof(filt)))
    _prctl("no_new_privs", PR_SET_NO_NEW_PRIVS, 1)
    _check("seccomp", LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0))


def kernel_layers() -> dict[str, str | None]:
    """What this kernel offers without trying a sandbox: {layer: None if present, else why not}. The
    launcher also runs one trial sandbox, which finds the layers a kernel refuses at run time."""
    abi = landlock_abi()
    seccomp = LIBC.prctl(PR_GET_SECCOMP, 0, 0, 0, 0)
    return {
        "landlock": None if abi >= 1 else "the kernel offers no Landlock (landlock_create_ruleset: ABI 0)",
        "seccomp": (
            None
            if seccomp >= 0 and arch() in AUDIT_ARCH
            else f"no seccomp filter for this kernel or architecture ({arch()})"
        ),
        "user namespace": (
            None
            if os.path.exists("/proc/self/ns/user")
            else "the kernel has no user namespaces (/proc/self/ns/user missing)"
        ),
    }
