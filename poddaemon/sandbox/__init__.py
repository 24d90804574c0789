"""Kernel confinement (Landlock) for everything a pod starts (SPEC §3 [sandbox], §5 status).

`build_policy` (pure: scope -> rules) and `apply_policy` (the syscalls) are separate so a policy
can be built in the pod and applied in another process: the command runner calls
`apply_policy(policy_json)` at its start, before any thread, and everything it then starts is
confined. `python -I -m poddaemon.sandbox.exec POLICY_FILE -- cmd ...` does the same for one
command. See docs/sandbox.md for the design and its measured costs.
"""

import os

import msgspec

from poddaemon.sandbox import landlock, seccomp
from poddaemon.sandbox.policy import (
    Grant,
    PathRule,
    Policy,
    build_pod_policy,
    build_policy,
    system_grants,
)

__all__ = [
    "Grant",
    "PathRule",
    "Policy",
    "SandboxError",
    "SandboxUnavailable",
    "apply_policy",
    "available",
    "build_pod_policy",
    "build_policy",
    "describe",
    "system_grants",
]

NO_SANDBOX = "none"


class SandboxError(Exception):
    """The sandbox could not be applied; the message is one line for the user."""


class SandboxUnavailable(SandboxError):
    """`mode = "enforce"` on a kernel that cannot do what the policy asks."""


def available() -> int:
    """The kernel's Landlock ABI version, or 0 without Landlock (also under the test seam
    `PODDAEMON_TEST_LANDLOCK_ABI`, which can only lower it)."""
    return landlock.abi_version()


def describe(abi: int) -> str:
    """What `status.sandbox` shows for a domain made on `abi` (0: none)."""
    return f"landlock-abi-{abi}" if abi > 0 else NO_SANDBOX


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def apply_policy(policy_json: bytes) -> str:
    """Confine the calling process to the JSON-encoded `Policy`; returns what `status.sandbox`
    should say ("landlock-abi-7", or "none" when mode is off or best_effort without Landlock).

    Landlock binds the calling thread and what it starts later, so this must run before any
    other thread exists in the process: with more than one thread it refuses. `enforce` raises
    `SandboxUnavailable` where the kernel lacks Landlock, or where `network = false` can be
    enforced neither by Landlock TCP rules (ABI 4) nor by the seccomp filter (x86_64, arm64);
    `best_effort` then confines as far as it can.
    """
    policy = msgspec.json.decode(policy_json, type=Policy)
    if policy.mode == "off":
        return NO_SANDBOX
    abi = available()
    problem = None
    if abi == 0:
        problem = "this kernel has no Landlock (Linux >= 5.13 with landlock enabled in lsm=)"
    elif not policy.network and abi < 4 and not seccomp.supported():
        problem = f"network = false needs Landlock ABI 4 (Linux 6.7); this kernel has ABI {abi}"
    if problem is not None:
        if policy.mode == "enforce":
            raise SandboxUnavailable(f"sandbox mode enforce: {problem}")
        if abi == 0:
            return NO_SANDBOX
    threads = _thread_count()
    if threads > 1:
        raise SandboxError(
            f"sandbox: apply_policy must run before any thread starts ({threads} running)"
        )
    try:
        if os.geteuid() == 0:
            landlock.drop_escape_caps()
        landlock.restrict(
            ((r.path, r.access) for r in policy.rules),
            abi=abi,
            deny_tcp=not policy.network,
            scoped=policy.scoped,
        )
    except landlock.LandlockError as e:
        raise SandboxError(f"sandbox: landlock failed: {e.strerror}") from None
    if not policy.network and seccomp.supported():
        # Landlock stops TCP only; this stops UDP and every other IP socket too.
        try:
            seccomp.deny_inet_sockets()
        except seccomp.SeccompError as e:
            raise SandboxError(f"sandbox: seccomp failed: {e.strerror}") from None
    return describe(abi)
