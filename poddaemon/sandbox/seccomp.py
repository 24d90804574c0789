"""A tiny seccomp filter for `network = false`: no IPv4/IPv6 sockets at all.

Landlock (ABI >= 4) only knows TCP bind/connect; UDP (DNS tunnels, QUIC) and ICMP would stay
open. This classic-BPF program makes `socket(AF_INET|AF_INET6, ...)` fail with EACCES, and
refuses io_uring (whose IORING_OP_SOCKET bypasses seccomp) and foreign syscall ABIs (i386's
`socketcall`, x32), which a filter for the native table cannot see through. Unix sockets,
pipes and everything else are untouched.
"""

import ctypes
import errno
import os
import platform

__all__ = ["SeccompError", "deny_inet_sockets", "supported"]

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

# BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16

# machine -> (AUDIT_ARCH_*, __NR_socket, __NR_io_uring_setup)
_ARCHES = {
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}
_X32_BIT = 0x40000000
_AF_INET, _AF_INET6 = 2, 10


class SeccompError(OSError):
    """The filter could not be installed."""


class _Filter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def supported() -> bool:
    return platform.machine() in _ARCHES


def _program(arch: int, nr_socket: int, nr_io_uring_setup: int) -> list[tuple[int, int, int, int]]:
    deny = _RET_ERRNO | errno.EACCES
    # (code, jump-if-true, jump-if-false, k); a jump of n lands n instructions past the next.
    return [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 1, 0, arch),  # 1
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),  # 2: another syscall ABI
        (_LD_W_ABS, 0, 0, _OFF_NR),  # 3
        (_JGE_K, 0, 1, _X32_BIT),  # 4
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),  # 5: x32
        (_JEQ_K, 0, 1, nr_io_uring_setup),  # 6
        (_RET_K, 0, 0, deny),  # 7
        (_JEQ_K, 0, 3, nr_socket),  # 8: not socket() -> allow (12)
        (_LD_W_ABS, 0, 0, _OFF_ARG0),  # 9: the address family
        (_JEQ_K, 2, 0, _AF_INET),  # 10: -> deny (13)
        (_JEQ_K, 1, 0, _AF_INET6),  # 11: -> deny (13)
        (_RET_K, 0, 0, _RET_ALLOW),  # 12
        (_RET_K, 0, 0, deny),  # 13
    ]


def deny_inet_sockets() -> None:
    """Install the filter on the calling thread (inherited by everything it starts).
    Needs no_new_privs (set by the Landlock step) unless the caller has CAP_SYS_ADMIN."""
    arch = _ARCHES.get(platform.machine())
    if arch is None:
        raise SeccompError(errno.ENOTSUP, f"no seccomp filter for {platform.machine()}")
    prog = _program(*arch)
    insns = (_Filter * len(prog))(*(_Filter(*i) for i in prog))
    fprog = _Prog(len(prog), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise SeccompError(err, os.strerror(err))
