"""A real `systemd --user` manager with journald, for tests and benchmarks (../shared/SYSTEMD.md).

`UserManager.start(home)` runs this file under `unshare --mount --propagation private`. Inside
that private mount namespace it mounts tmpfs on /run/systemd (with the `system/` directory that
makes systemd believe it was booted with systemd), /run/log and /run/user, starts journald,
puts itself into a dedicated cgroup (`podtest-<pid>.slice/user@<uid>.service` in the unified and
the name=systemd hierarchies: never the root cgroup, where the manager would adopt every process
of the machine) and starts the manager there. It prints `MANAGER-READY <manager pid>` and holds
everything until its stdin closes; then it stops the manager, kills what is left in its cgroups,
removes them and exits (the namespace, and its mounts, go with it).

`UserManager.run(cmd)` runs a command in that namespace, as the manager's user, with its
environment: `systemctl --user`, `journalctl`, `podctl`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CGROUP_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")
SYSTEMD = "/lib/systemd/systemd"
JOURNALD = "/lib/systemd/systemd-journald"
READY = "MANAGER-READY"
SETUP_TIMEOUT = 20.0


def unavailable() -> str | None:
    """Why a real user manager cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "setting up a systemd user manager needs root (mounts, cgroups)"
    for tool in ("unshare", "nsenter", "systemctl", "journalctl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    for path in (SYSTEMD, JOURNALD, *CGROUP_ROOTS):
        if not os.path.exists(path):
            return f"{path} does not exist (no systemd, or not a hybrid cgroup layout)"
    return None


def manager_env(home: Path, uid: int = 0) -> dict[str, str]:
    runtime = f"/run/user/{uid}"
    return {
        "HOME": str(home),
        "USER": "root" if uid == 0 else str(uid),
        "LOGNAME": "root" if uid == 0 else str(uid),
        "XDG_RUNTIME_DIR": runtime,
        "DBUS_SESSION_BUS_ADDRESS": f"unix:path={runtime}/bus",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
    }


class UserManager:
    def __init__(self, proc: subprocess.Popen[str], pid: int, home: Path) -> None:
        self.proc = proc  # the holder process inside the namespace
        self.pid = pid  # the manager
        self.home = home
        self.env = manager_env(home)

    @classmethod
    def start(cls, home: Path) -> UserManager:
        proc = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                sys.executable,
                __file__,
                str(home),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the holder bounds its own set-up by SETUP_TIMEOUT
        if not line.startswith(READY):
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise RuntimeError(f"user manager did not start: {line.strip()} {err.strip()}")
        return cls(proc, int(line.split()[1]), home)

    def command(self, cmd: list[str], env: dict[str, str] | None = None) -> list[str]:
        """`cmd` wrapped to run inside the namespace with the manager's environment."""
        full = {**self.env, **(env or {})}
        return [
            "nsenter",
            f"--mount=/proc/{self.proc.pid}/ns/mnt",
            "--",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in full.items()),
            *cmd,
        ]

    def run(
        self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 60, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(cmd, env), capture_output=True, text=True, timeout=timeout, **kw
        )

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", "--user", *args])

    def prop(self, unit: str, name: str) -> str:
        return self.systemctl("show", "-p", name, "--value", unit).stdout.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# --- inside the namespace ---------------------------------------------------------------------


def _mount_tmpfs(target: str, mode: str = "0755") -> None:
    os.makedirs(target, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode={mode}", "tmpfs", target], check=True)


def _wait_for(path: str, proc: subprocess.Popen[bytes] | None, what: str) -> None:
    deadline = time.monotonic() + SETUP_TIMEOUT
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {path} did not appear")
        time.sleep(0.01)


def _cgroup_procs(path: str) -> list[int]:
    with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
        return [int(p) for p in f.read().split()]
    return []


def _remove_cgroup(top: str) -> None:
    """Kill everything under `top`, then rmdir it depth-first."""
    for _ in range(50):
        pids = [p for d, _, _ in os.walk(top) for p in _cgroup_procs(d)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for d, _, _ in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(d)


def _holder(home: Path) -> int:
    uid = os.getuid()
    slice_name = f"podtest-{os.getpid()}.slice"
    service_dirs = [os.path.join(r, slice_name, f"user@{uid}.service") for r in CGROUP_ROOTS]
    journald_dirs = [os.path.join(r, slice_name, "journald") for r in CGROUP_ROOTS]
    journald: subprocess.Popen[bytes] | None = None
    manager: subprocess.Popen[bytes] | None = None
    try:
        _mount_tmpfs("/run/systemd")
        os.makedirs("/run/systemd/system")  # "booted with systemd", in this namespace only
        os.makedirs("/run/systemd/journald.conf.d")
        Path("/run/systemd/journald.conf.d/test.conf").write_text(
            "[Journal]\nStorage=volatile\nReadKMsg=no\nForwardToSyslog=no\nForwardToKMsg=no\n"
            "ForwardToConsole=no\nForwardToWall=no\nRateLimitBurst=0\n"
        )
        _mount_tmpfs("/run/log")
        os.makedirs("/run/log/journal")
        with contextlib.suppress(KeyError):
            import grp

            os.chown("/run/log/journal", 0, grp.getgrnam("systemd-journal").gr_gid)
        os.chmod("/run/log/journal", 0o2755)
        _mount_tmpfs("/run/user")
        runtime = f"/run/user/{uid}"
        os.makedirs(runtime, mode=0o700)
        for d in service_dirs + journald_dirs:
            os.makedirs(d)

        def enter(dirs: list[str]) -> None:
            for d in dirs:
                with open(os.path.join(d, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        journald = subprocess.Popen(
            [JOURNALD],
            preexec_fn=lambda: enter(journald_dirs),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for("/run/systemd/journal/stdout", journald, "systemd-journald")
        env = manager_env(home, uid)
        manager = subprocess.Popen(
            [SYSTEMD, "--user", "--log-target=journal-or-kmsg"],
            env=env,
            preexec_fn=lambda: enter(service_dirs),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for(f"{runtime}/systemd/private", manager, "systemd --user")
        subprocess.run(
            ["systemctl", "--user", "is-system-running", "--wait"],
            env=env,
            capture_output=True,
            timeout=SETUP_TIMEOUT,
        )
        print(f"{READY} {manager.pid}", flush=True)
        sys.stdin.read()  # hold until the test closes our stdin
        return 0
    finally:
        if manager is not None and manager.poll() is None:
            manager.terminate()  # stops its units (SIGTERM to the pods)
            try:
                manager.wait(20)
            except subprocess.TimeoutExpired:
                manager.kill()
                manager.wait(5)
        if journald is not None and journald.poll() is None:
            journald.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                journald.wait(5)
        for root in CGROUP_ROOTS:
            _remove_cgroup(os.path.join(root, slice_name))


if __name__ == "__main__":
    sys.exit(_holder(Path(sys.argv[1])))
