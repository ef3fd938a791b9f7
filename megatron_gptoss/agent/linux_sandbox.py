"""The Linux mechanisms of the Python sandbox, through ctypes and the standard library only.

This module is imported by the launcher script (`launcher.py`, run by path in a clean interpreter), so it
imports nothing from the project. Each function applies one layer to the calling process and raises
`SetupError` naming the layer when the kernel refuses it; nothing degrades silently.

    drop_privileges(real_uid)    root only: a real uid of the sandbox's own, so RLIMIT_NPROC applies (it
                                 never does to real uid 0), and no capability left
    enter_namespaces(...)        network + pid + IPC + UTS namespaces (unshare), in a user namespace of
                                 their own when the caller is not root; the next fork is pid 1
    set_limits(...)              setrlimit: address space, CPU seconds, processes (in the user
                                 namespace), file size, open files, no core dumps
    restrict_filesystem(...)     Landlock: read+execute below the given read paths, everything below the
                                 given write paths, nothing else; TCP bind/connect denied (ABI >= 4);
                                 abstract unix sockets and signals scoped to the sandbox (ABI >= 6)
    install_seccomp()            seccomp-bpf: sockets other than AF_UNIX, ptrace, namespace changes,
                                 mounts, io_uring, BPF, keyrings, module and kexec calls fail with an
                                 errno; a foreign architecture's system calls kill the process
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
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS_LOCKED = 1 << 0, 1 << 2, 1 << 5
SECBIT_NO_CAP_AMBIENT_RAISE = 1 << 6
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
INNER_ID = 1000  # the uid and gid user code sees inside its user namespace

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

# seccomp-bpf
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
X32_SYSCALL_BIT = 0x40000000
AF_UNIX = 1
# System calls user code never needs, per architecture (x86_64 numbers, aarch64 numbers).
_DENIED = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
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
_SOCKET = {"socket": (41, 198), "socketpair": (53, 199)}
_CLONE, _CLONE3 = (56, 220), (435, 435)


class SetupError(Exception):
    """A sandbox layer could not be applied; the message starts with the layer's name."""

    def __init__(self, layer: str, reason: str):
        super().__init__(f"{layer}: {reason}")
        self.layer = layer


def _check(layer: str, result: int) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise SetupError(layer, f"{errno.errorcode.get(code, code)} ({os.strerror(code)})")
    return result


def _prctl(layer: str, option: int, arg: int | ctypes.c_void_p = 0) -> int:
    return _check(layer, LIBC.prctl(option, arg, 0, 0, 0))


def arch() -> str:
    """The machine's architecture as the seccomp tables name it ("x86_64", "aarch64", or another)."""
    machine = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


# ---- layers -------------------------------------------------------------------------------------------


def drop_privileges(real_uid: int) -> None:
    """Root only: real uid `real_uid` and no capability at all, the effective uid kept at 0 (so files the
    interpreter needs below a private home stay readable by their owner bits; Landlock decides which).

    The kernel exempts only real uid 0 and capability holders from RLIMIT_NPROC, and counts it per real
    uid: with a real uid of its own, each sandbox has its own process budget. The securebits keep an
    execve as effective uid 0 from granting capabilities back."""
    bits = SECBIT_NOROOT | SECBIT_NO_SETUID_FIXUP | SECBIT_NO_CAP_AMBIENT_RAISE
    _prctl("capabilities", PR_SET_SECUREBITS, bits | bits << 1 | SECBIT_KEEP_CAPS_LOCKED)
    try:
        os.setgroups([])
        os.setresuid(real_uid, 0, 0)
    except OSError as err:
        raise SetupError("unprivileged uid", str(err)) from None
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl("capabilities", PR_CAPBSET_DROP, cap)
    header = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all empty
    _check("capabilities", LIBC.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)))


def enter_namespaces(*, user_namespace: bool) -> None:
    """New network, pid, IPC and UTS namespaces, inside a new user namespace where `user_namespace` (a
    caller that is not root needs one; the caller is mapped to INNER_ID inside). The network namespace
    has only a loopback that is down; the pid namespace starts with the caller's next child."""
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
        (CLONE_NEWNET, "network namespace"),
        (CLONE_NEWPID, "pid namespace"),
        (CLONE_NEWIPC, "ipc namespace"),
        (CLONE_NEWUTS, "uts namespace"),
    ):
        _check(name, LIBC.unshare(flag))


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (the launcher kills the parent to stop a sandbox)."""
    _prctl("prctl", PR_SET_PDEATHSIG, 9)


def set_limits(*, memory_bytes: int, cpu_s: int, processes: int, file_bytes: int, open_files: int) -> None:
    """setrlimit with soft = hard: past the CPU limit the kernel sends SIGKILL (SIGXCPU is ignored by a
    pid namespace's init); RLIMIT_NPROC counts this user's processes and threads in its namespace."""
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


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, Landlock absent or disabled)."""
    result = LIBC.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    return max(int(result), 0)


def _fs_rights(abi: int) -> int:
    return _FS_RIGHTS_BY_ABI[max(v for v in _FS_RIGHTS_BY_ABI if v <= abi)]


def restrict_filesystem(read_paths: list[str], write_paths: list[str], abi: int) -> None:
    """Landlock: allow reading (and executing) below `read_paths`, everything below `write_paths`, and no
    other file access; with ABI >= 4 no TCP bind or connect; with ABI >= 6 abstract unix sockets and
    signals only within the sandbox. Paths that do not exist are skipped. Sets no_new_privs."""
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


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF program (code, jt, jf, k) of the filter for `machine` ("x86_64" or "aarch64")."""
    if machine not in AUDIT_ARCH:
        raise SetupError("seccomp", f"no system call table for architecture {machine!r}")
    col = 0 if machine == "x86_64" else 1
    eperm = SECCOMP_RET_ERRNO | errno.EPERM
    prog = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH[machine]),
        (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":  # the x32 ABI shares the architecture tag
        prog += [(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for numbers in _DENIED.values():
        prog += [(BPF_JEQ_K, 0, 1, numbers[col]), (BPF_RET_K, 0, 0, eperm)]
    # clone3 passes its flags in memory the filter cannot read: ENOSYS makes libc fall back to clone
    prog += [(BPF_JEQ_K, 0, 1, _CLONE3[col]), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS)]
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
