"""Opening a checked path without a check-then-use race.

The scope is checked on the *resolved* path (`Scope.check`: symlinks and `..` followed). A
resolved path contains no symlink, so it is opened here without following any: by one
`openat2(RESOLVE_NO_SYMLINKS)` where the kernel has it (5.6+), else component by component from
`/` with `O_NOFOLLOW`. A symlink met on the way means the tree changed since the check (say a
directory swapped for a link to outside with `renameat2(RENAME_EXCHANGE)`): refused with ELOOP.
Then what was actually opened is checked again by the kernel's own name for it
(`/proc/self/fd/N`): an object moved out of scope meanwhile is refused too.
"""

import errno
import os
import platform
import threading
from typing import Any

_O_FLAGS_ALWAYS = os.O_CLOEXEC | os.O_NOFOLLOW
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "riscv64": 437, "ppc64le": 437, "s390x": 437}


class _Openat2:
    """`openat2` through libc's `syscall`, or None where the kernel (or seccomp) lacks it.
    Built at the first open: ctypes costs ~2 ms of every pod's start otherwise."""

    def __init__(self) -> None:
        import ctypes

        class OpenHow(ctypes.Structure):
            _fields_ = [
                ("flags", ctypes.c_uint64),
                ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64),
            ]

        self.ctypes: Any = ctypes
        self.how = OpenHow
        # The call's fixed arguments and each open_how, made once (ctypes objects cost ~1 µs of
        # every open to build); none is changed after, so the tools' threads share them. No
        # argtypes: converting through them is slower still.
        self.size = ctypes.c_size_t(ctypes.sizeof(OpenHow))
        self.at_fdcwd = ctypes.c_int(-100)  # the path is absolute anyway
        self.hows: dict[tuple[int, int], Any] = {}
        nr = _SYS_OPENAT2.get(platform.machine())
        self.nr = ctypes.c_long(nr) if nr else None
        self.syscall = ctypes.CDLL(None, use_errno=True).syscall if nr else None
        self.works: bool | None = None if nr else False

    def __call__(self, path: str, flags: int, mode: int) -> int | None:
        """The fd, or None when openat2 is unavailable (then the caller walks)."""
        if self.works is False or self.syscall is None or self.nr is None:
            return None
        key = (flags, mode if flags & os.O_CREAT else 0)
        how = self.hows.get(key)
        if how is None:
            how = self.hows[key] = self.ctypes.byref(self.how(*key, _RESOLVE_NO_SYMLINKS))
        fd: int = self.syscall(self.nr, self.at_fdcwd, os.fsencode(path), how, self.size)
        if fd >= 0:
            self.works = True
            return fd
        err = self.ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM) and self.works is None:
            self.works = False  # no kernel support, or a seccomp filter: walk from now on
            return None
        raise OSError(err, os.strerror(err), path)


_openat2_made: _Openat2 | None = None
_openat2_lock = threading.Lock()


def _openat2() -> _Openat2:
    global _openat2_made
    if _openat2_made is None:
        with _openat2_lock:  # the file tools run in worker threads
            if _openat2_made is None:
                _openat2_made = _Openat2()
    return _openat2_made


def _walk(path: str, flags: int, mode: int) -> int:
    """Open `path` one component at a time from `/`, following no symlink."""
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not parts:
            return os.open(".", flags, mode, dir_fd=fd)
        for name in parts[:-1]:
            # O_PATH|O_NOFOLLOW on a symlink gives the link itself; O_DIRECTORY then fails.
            nxt = os.open(name, os.O_PATH | os.O_DIRECTORY | _O_FLAGS_ALWAYS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_resolved(path: str, flags: int, mode: int = 0o666) -> int:
    """Open the absolute, resolved `path` following no symlink anywhere in it."""
    if not os.path.isabs(path):
        raise ValueError(f"not an absolute path: {path!r}")
    flags |= _O_FLAGS_ALWAYS
    fd = _openat2()(path, flags, mode)
    return fd if fd is not None else _walk(path, flags, mode)


def opened_path(fd: int) -> str:
    """Where the object behind `fd` is now, as the kernel names it."""
    return os.readlink(f"/proc/self/fd/{fd}")


def uses_openat2() -> bool:
    return bool(_openat2().works)
