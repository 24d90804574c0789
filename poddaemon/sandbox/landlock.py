"""The Landlock syscalls through ctypes: ABI detection and confining the calling thread.

Nothing here decides *what* to allow (that is `policy.py`); this module only turns a list of
(path, access bits) rules into a Landlock domain. The uAPI constants come from
`include/uapi/linux/landlock.h`; they are stable across kernels, newer ABIs only add bits.
"""

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Iterable

__all__ = [
    "FS",
    "NET_BIND_TCP",
    "NET_CONNECT_TCP",
    "SCOPE_ABSTRACT_UNIX_SOCKET",
    "SCOPE_SIGNAL",
    "LandlockError",
    "abi_version",
    "fs_access_for_abi",
    "restrict",
    "restrict_scope",
]

# Syscall numbers: x86_64 and every architecture using the generic table (arm64, riscv, ...)
# share 444-446 for Landlock.
_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_PR_SET_NO_NEW_PRIVS = 38

_PR_CAPBSET_DROP = 24
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_RULE_NET_PORT = 2


class FS:
    """`LANDLOCK_ACCESS_FS_*` bits."""

    EXECUTE = 1 << 0
    WRITE_FILE = 1 << 1
    READ_FILE = 1 << 2
    READ_DIR = 1 << 3
    REMOVE_DIR = 1 << 4
    REMOVE_FILE = 1 << 5
    MAKE_CHAR = 1 << 6
    MAKE_DIR = 1 << 7
    MAKE_REG = 1 << 8
    MAKE_SOCK = 1 << 9
    MAKE_FIFO = 1 << 10
    MAKE_BLOCK = 1 << 11
    MAKE_SYM = 1 << 12
    REFER = 1 << 13  # ABI 2: link/rename across directories
    TRUNCATE = 1 << 14  # ABI 3
    IOCTL_DEV = 1 << 15  # ABI 5

    # Rights that make sense on a regular file; the kernel rejects the others (EINVAL) there.
    FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV


NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1


def fs_access_for_abi(abi: int) -> int:
    """Every filesystem right the kernel of `abi` knows (and so can deny)."""
    if abi < 1:
        return 0
    bits = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        bits |= FS.REFER
    if abi >= 3:
        bits |= FS.TRUNCATE
    if abi >= 5:
        bits |= FS.IOCTL_DEV
    return bits


class LandlockError(OSError):
    """A Landlock syscall failed."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),  # ABI 4
        ("scoped", ctypes.c_uint64),  # ABI 6
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uAPI
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.syscall.restype = ctypes.c_long
    return _LIBC


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise LandlockError(err, os.strerror(err))
    return ret


def _syscall(*args: object) -> int:
    return _check(int(_libc().syscall(*args)))


# Test seam: lower the ABI the kernel reports (0 = no Landlock), never raise it. An environment
# variable so real pod processes in integration tests can simulate an older kernel; it cannot
# lift a domain a process already runs in, so it is no way out of the sandbox.
FAKE_ABI_ENV = "PODDAEMON_TEST_LANDLOCK_ABI"


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        abi = _syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)
    except LandlockError as e:
        if e.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            abi = 0  # not built in, disabled at boot, or blocked by a seccomp filter
        else:
            raise
    fake = os.environ.get(FAKE_ABI_ENV)
    if fake:
        abi = min(abi, int(fake))
    return abi


def restrict(
    rules: Iterable[tuple[str, int]],
    *,
    abi: int,
    deny_tcp: bool,
    scoped: bool,
) -> list[str]:
    """Confine the calling thread (and everything it later starts) to `rules`.

    Every filesystem right the ABI knows is handled, so whatever no rule grants is denied.
    `deny_tcp` (ABI >= 4) handles TCP bind/connect with no port rule: no TCP at all. `scoped`
    (ABI >= 6) keeps abstract unix sockets and signals inside the domain. Returns the paths that
    could not be opened (gone since the policy was built); they are simply not granted.
    """
    handled_fs = fs_access_for_abi(abi)
    attr = _RulesetAttr(handled_fs, 0, 0)
    if deny_tcp and abi >= 4:
        attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP
    if scoped and abi >= 6:
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
    # The struct grew with each ABI; pass only the size this kernel knows (E2BIG otherwise).
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    ruleset = _syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    missing: list[str] = []
    try:
        for path, access in rules:
            try:
                fd = _open_unlinked(path)
            except OSError:
                missing.append(path)
                continue
            try:
                mode = os.fstat(fd).st_mode
                allowed = access & handled_fs
                if not stat.S_ISDIR(mode):
                    allowed &= FS.FILE_ONLY
                if stat.S_ISLNK(mode) or not allowed:
                    continue  # O_NOFOLLOW opened a symlink itself: it grants nothing
                beneath = _PathBeneathAttr(allowed, fd)
                _syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(beneath), 0)
            finally:
                os.close(fd)
        # Without no_new_privs an unprivileged process may not restrict itself, and a setuid
        # program could otherwise run outside the rules it was started under.
        _check(int(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)))
        _syscall(_SYS_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)
    return missing


def _open_unlinked(path: str) -> int:
    """An O_PATH descriptor of the absolute `path`, following no symlink on the way: the
    policy's paths were resolved when it was built, so a link met now is a directory swapped
    since (another user renaming one in a tree they may write, with a link to elsewhere put in
    its place), and Landlock would grant wherever it points. OSError then (ELOOP, ENOTDIR). A
    link as the last component is opened itself (it grants nothing)."""
    flags = os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open("/", flags | os.O_DIRECTORY)
    try:
        parts = [p for p in path.split("/") if p]
        for name in parts[:-1]:
            nxt = os.open(name, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags, dir_fd=fd) if parts else os.dup(fd)
    finally:
        os.close(fd)


def restrict_scope() -> None:
    """One more layer that only scopes signals and abstract unix sockets (ABI >= 6): what the
    calling thread starts afterwards can no longer signal the processes left in the layers
    below, its starter among them. Filesystem and network rights stay what they were."""
    attr = _RulesetAttr(0, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    ruleset = _syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(24), 0)
    try:
        _syscall(_SYS_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)


# Capabilities that let root step around a Landlock domain: CAP_SYS_PTRACE lets a confined
# process read /proc/<pid>/environ of processes outside it (the pod's API key), CAP_NET_RAW and
# CAP_NET_ADMIN reach the network without TCP, CAP_DAC_READ_SEARCH opens files by handle,
# CAP_SYS_ADMIN/SYS_MODULE/SYS_RAWIO/BPF/PERFMON/MKNOD reach the kernel or devices directly.
# No path names what the rest act on, so Landlock cannot confine them: CAP_IPC_OWNER reads and
# writes every user's SysV shared memory and message queues, CAP_SYS_BOOT reboots the machine or
# kexecs another kernel, CAP_SYS_TIME sets its clock, CAP_SYS_NICE starves it with real-time
# priority, CAP_LINUX_IMMUTABLE makes files immutable (read-only ones in the scope, even), and
# CAP_SYSLOG, CAP_SYS_PACCT, CAP_AUDIT_CONTROL, CAP_MAC_ADMIN/MAC_OVERRIDE, CAP_SYS_TTY_CONFIG,
# CAP_WAKE_ALARM and CAP_BLOCK_SUSPEND read or change machine-wide state.
_ROOT_ESCAPE_CAPS = (2, 9, 12, 13, 15, 16, 17, 19, 20, 21, 22, 23, 25, 26, 27, 30, 32, 33, 34,
                     35, 36, 38, 39)  # fmt: skip


def drop_escape_caps() -> None:
    """For root only: drop those capabilities from the bounding set, so the commands this
    process executes never hold them (an unprivileged user has none to drop)."""
    libc = _libc()
    for cap in _ROOT_ESCAPE_CAPS:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) < 0:
            err = ctypes.get_errno()
            if err != errno.EINVAL:  # EINVAL: a capability this kernel does not know
                raise LandlockError(err, os.strerror(err))
