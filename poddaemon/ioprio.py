"""A process's I/O scheduling priority (what `ionice` sets), which Python's `os` does not
expose: the ioprio_get and ioprio_set system calls, through libc's syscall(2).

The value is the kernel's own: the class in the bits above 13 (0 none: from the nice value,
1 realtime, 2 best-effort, 3 idle) and the level below. Known on x86-64, i386 and the
architectures of the generic syscall table (arm64, riscv64…); elsewhere `of` says None and
nothing is carried over.
"""

import ctypes
import os
import platform

_WHO_PROCESS = 1
# (ioprio_get, ioprio_set) by machine
_SYSCALLS = {
    "x86_64": (252, 251),
    "i386": (290, 289),
    "i686": (290, 289),
    "aarch64": (31, 30),
    "riscv64": (31, 30),
    "loongarch64": (31, 30),
}
_NUMBERS = _SYSCALLS.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
_long = ctypes.c_long  # syscall(2) reads its variadic arguments as longs


def of(pid: int) -> int | None:
    """The I/O priority of process `pid` (0: this one); None where it cannot be known (an
    architecture not above, a process gone)."""
    if _NUMBERS is None:
        return None
    value: int = _libc.syscall(_long(_NUMBERS[0]), _long(_WHO_PROCESS), _long(pid))
    return None if value < 0 else value


def set_own(value: int) -> None:
    """Give this process I/O priority `value`; OSError when not allowed (the realtime class
    needs CAP_SYS_NICE or CAP_SYS_ADMIN) or not known here."""
    if _NUMBERS is None:
        raise OSError("the I/O priority cannot be set on this architecture")
    if _libc.syscall(_long(_NUMBERS[1]), _long(_WHO_PROCESS), _long(0), _long(value)) < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"ioprio_set({value:#x}): {os.strerror(errno)}")
