"""Tear-down for tests and benchmarks that run `podctl spawn` in a throwaway home."""

import contextlib
import os
import signal
from pathlib import Path


def kill_spawned(runtime: Path) -> None:
    """SIGKILL what `podctl spawn` left in this runtime dir: its pods (their pid files) and the
    fork server (its pid is in its lock file); a run that failed half-way leaves them running."""
    for path in [*runtime.glob("pods/*/pid"), *runtime.glob("forkserver.*.lock")]:
        with contextlib.suppress(OSError, ValueError):
            pid = int(path.read_text())
            if pid > 1:
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """`pid` runs: it exists and is neither a zombie nor dead (from /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
