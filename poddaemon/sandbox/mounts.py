"""A private, read-only view of the filesystem for the command runner, outside the write grants.

Landlock has no right for file metadata: a confined command can still `chmod`, `chown` and
`utimensat` files it cannot open (`chmod 0666 ~/.bashrc`; as root, `chmod u+s` on any system
file). A read-only mount refuses those with EROFS. So the runner, before `apply_policy` (a
Landlock domain forbids mount(2)), takes a mount namespace of its own (and, not being root, a
user namespace mapping only its own uid and gid, as bubblewrap does), binds each write grant
onto itself so it stays a writable mount of its own, and remounts every other mount read-only.

Parsing (`parse_mountinfo`, `remount_flags`, `to_remount`) is pure; `isolate` makes the
syscalls. Standard library only: the runner imports this before anything else.
"""

import contextlib
import ctypes
import errno
import os
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["Mount", "MountError", "isolate", "parse_mountinfo", "remount_flags", "to_remount"]

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1 << 10
MS_NODIRATIME = 1 << 11
MS_BIND = 1 << 12
MS_REC = 1 << 14
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

# Per-mount options as mountinfo spells them. In a user namespace these are locked: a remount
# must repeat them or it fails with EPERM. No atime option given keeps the current one.
_OPTION_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}

# Seam for tests: the namespace "cannot be made", as on a kernel without user namespaces.
TEST_SEAM = "PODDAEMON_TEST_NO_MOUNT_NS"


class Mount(NamedTuple):
    path: str  # the mount point, unescaped
    options: frozenset[str]  # its per-mount options (rw/ro, nosuid, relatime, ...)


class MountError(OSError):
    """The private read-only view could not be made; the message says which step failed."""


_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """A mountinfo path field as a path: the kernel writes space, tab, newline and backslash
    as octal escapes (`\\040`)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Every mount in /proc/self/mountinfo's `text`, in its order (a later line for the same
    point is mounted on top). Field 5 is the mount point, field 6 the per-mount options."""
    out: list[Mount] = []
    for line in text.split("\n"):  # not splitlines(): \x85, \u2028 are left unescaped
        fields = line.split(" ")
        if len(fields) < 6:
            continue
        out.append(Mount(unescape(fields[4]), frozenset(fields[5].split(","))))
    return out


def remount_flags(options: Iterable[str]) -> int:
    """The mount(2) flags that make a mount with `options` read-only and change nothing else."""
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for opt in options:
        flags |= _OPTION_FLAGS.get(opt, 0)
    return flags


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def to_remount(mounts: Sequence[Mount], writable: Iterable[str]) -> list[Mount]:
    """The mounts to make read-only: each visible mount point once (the one on top), unless it
    is already read-only or lies at or below a write grant (those stay as they are)."""
    grants = list(writable)
    top: dict[str, Mount] = {}
    for m in mounts:
        top.pop(m.path, None)  # re-insert: the order stays that of the topmost mount
        top[m.path] = m
    return [
        m
        for m in top.values()
        if "ro" not in m.options and not any(_within(m.path, g) for g in grants)
    ]


def minimal(paths: Iterable[str]) -> list[str]:
    """Sorted, without paths below another one (a bind of the parent already carries them)."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not any(_within(p, q) for q in out):
            out.append(p)
    return out


_libc: ctypes.CDLL | None = None


def _call(what: str, fn: str, *args: object) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, fn)(*args) != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, flags: int) -> None:
    src = os.fsencode(source) if source is not None else None
    _call(f"mount {target}", "mount", src, os.fsencode(target), None, ctypes.c_ulong(flags), None)


def _mount_fs(fstype: str, target: str, flags: int, data: str) -> None:
    args = (b"none", os.fsencode(target), fstype.encode(), ctypes.c_ulong(flags), data.encode())
    _call(f"mount {fstype} on {target}", "mount", *args)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise MountError(e.errno or errno.EPERM, f"{path}: {e.strerror}") from None


def _user_namespace(uid: int, gid: int) -> None:
    # The identity map: files keep their owners and commands their uid; the namespace's
    # capabilities (what lets us mount) are lost at exec.
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC
    _call("unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWIPC)", "unshare", flags)
    _write("/proc/self/setgroups", "deny")  # required before gid_map without CAP_SETGID
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _trial(uid: int, gid: int) -> None:
    """Raise the MountError the namespace would fail with, found in a forked child (this
    process is single-threaded here: unshare(CLONE_NEWUSER) requires it anyway)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            _user_namespace(uid, gid)
            _mount(None, "/", MS_REC | MS_PRIVATE)
        except OSError as e:
            os.write(w, f"{e.errno or errno.EPERM}\0{e.strerror}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if why:
        number, _, text = why.partition("\0")
        raise MountError(int(number), text)
    if status != 0:
        raise MountError(errno.EPERM, "the namespace trial failed")


def isolate(
    writable: Iterable[str], hidden: Iterable[str] = (), readonly: Iterable[str] = ()
) -> list[str]:
    """Give this process (single-threaded: unshare(CLONE_NEWUSER) requires it) a mount
    namespace where only `writable` (existing paths) stays writable, except the `readonly`
    areas inside it (delegated to a child pod), and `hidden` reads as empty (root's secrets in
    /etc). Returns the mount points that could not be made read-only or hidden, with why (empty:
    all of them). Raises MountError when the namespace cannot be made at all; nothing is
    read-only then."""
    if os.environ.get(TEST_SEAM):
        raise MountError(errno.EPERM, f"unshare: refused by the test seam {TEST_SEAM}")
    uid, gid = os.getuid(), os.getgid()
    # An IPC namespace too: System V shared memory, queues and semaphores have no path for
    # Landlock to judge (a command could attach to another process's 0600 segment, any
    # process's as root); the commands share theirs with each other, with nothing else.
    if os.geteuid() == 0:
        _call("unshare(CLONE_NEWNS|CLONE_NEWIPC)", "unshare", CLONE_NEWNS | CLONE_NEWIPC)
    else:
        # A user namespace cannot be left: one whose maps cannot be written (a runner inside
        # another runner's view, where /proc is read-only, or a Landlock domain) would leave
        # the commands unmapped (uid 65534). So try it in a child first.
        _trial(uid, gid)
        _user_namespace(uid, gid)
    # Nothing we do here may leak back to the host's namespace through shared propagation.
    _mount(None, "/", MS_REC | MS_PRIVATE)
    all_grants = {os.path.realpath(p) for p in writable if os.path.lexists(p)}
    grants = minimal(all_grants)
    # Denied paths inside a grant (a delegated area): read-only binds of their own; a grant
    # nested in one gets a bind of its own again, after it.
    denied = [p for p in minimal(readonly) if any(_within(p, g) for g in grants)]
    nested = [g for g in all_grants if any(_within(g, d) and g != d for d in denied)]
    for path in grants:  # a mount of its own, so the remounts below leave it writable
        _mount(path, path, MS_BIND | MS_REC)
    left: list[str] = []
    for path in denied:
        try:
            _mount(path, path, MS_BIND | MS_REC)
        except MountError as e:
            left.append(f"{path} ({os.strerror(e.errno or errno.EPERM)})")
    for path in minimal(nested):
        _mount(path, path, MS_BIND | MS_REC)
    with open("/proc/self/mountinfo", "rb") as f:  # bytes: a path may hold \r or non-UTF-8
        mounts = parse_mountinfo(os.fsdecode(f.read()))
    top = {m.path: m for m in mounts}
    ro = [top[d] for d in denied if d in top and "ro" not in top[d].options]
    for m in [*to_remount(mounts, grants), *ro]:
        try:
            _mount(None, m.path, remount_flags(m.options))
        except MountError as e:
            left.append(f"{m.path} ({os.strerror(e.errno or errno.EPERM)})")
    for path in hidden:  # read as empty: /dev/null over a file, an empty read-only tmpfs over
        try:  # a directory (one rule for all of /etc: a rule per entry holds each file as it
            # was at the start, and /etc's files are replaced by renames)
            if os.path.isdir(path):
                _mount_fs("tmpfs", path, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0")
            else:
                _mount("/dev/null", path, MS_BIND)
        except MountError as e:
            left.append(f"{path} (not hidden: {os.strerror(e.errno or errno.EPERM)})")
    # Re-resolve the working directory: the old one may lie on the mount a bind now covers.
    with contextlib.suppress(OSError):
        os.chdir(os.getcwd())
    return left
