"""9. systemd: a pod as a unit of a real `systemd --user` manager (tests/integration/
systemd_manager.py sets one up, with journald, in a private mount namespace).

- `systemctl --user start` of a pod unit until it returns (Type=notify: after READY) vs
  `podctl spawn` of the same manifest until READY, both run through the same `nsenter`.
- Restart after `kill -9` of the pod: until its socket answers again (READY), and until the
  resumed run's first model request reaches the fake model. `RestartSec=` is set to 0.1 s by a
  drop-in here so the number is the pod's own restart cost (installed units wait 2 s).
"""

import os
import signal
import sys
import time
from pathlib import Path

from bench.harness import PY, Home, Row, Section, median

ROUNDS = 5
RESTART_SEC = 0.1


def _answers(sock: str) -> bool:
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(sock)
            s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"status"}\n')
            return b'"result"' in s.recv(65536)
    except OSError:
        return False


def _until(predicate: "object", timeout: float = 30.0, step: float = 0.002) -> float:
    """Poll `predicate` until true; seconds it took. Raises TimeoutError at the deadline."""
    assert callable(predicate)
    t0 = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(step)
    return time.perf_counter() - t0


def run(sec: Section) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.integration.systemd_manager import UserManager, unavailable

    reason = unavailable()
    if reason:
        sec.note(f"skipped: {reason}")
        return
    with Home() as home:
        assert home.fake is not None
        (home.path / "h").mkdir()
        config = home.path / "config"
        config.mkdir(mode=0o700)
        (config / "env").write_text("FAKE_API_KEY=bench-key\n")
        (config / "env").chmod(0o600)
        try:
            manager = UserManager.start(home.path / "h")
        except (RuntimeError, OSError) as exc:
            sec.note(f"skipped: cannot run a systemd user manager here: {exc}")
            return
        try:
            _measure(sec, home, manager)
        finally:
            manager.stop()


def _measure(sec: Section, home: Home, manager: "object") -> None:
    from tests.integration.systemd_manager import UserManager

    assert isinstance(manager, UserManager) and home.fake is not None
    podenv = {
        "PODDAEMON_HOME": str(home.path),
        "PYTHONPATH": home.env["PYTHONPATH"],
        "FAKE_API_KEY": "bench-key",  # for podctl spawn; the unit reads <config>/env
    }

    def podctl(*args: str) -> None:
        out = manager.run([PY, "-m", "cli.main", *args], podenv)
        if out.returncode != 0:
            raise RuntimeError(f"podctl {' '.join(args)}: {out.stderr.strip()}")

    def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
        t = time.perf_counter()
        out = manager.run(cmd, env)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")
        return (time.perf_counter() - t) * 1e3

    unit_manifest = home.manifest("unitbench")
    spawn_manifest = home.manifest("spawnbench")
    podctl("unit", "install", str(unit_manifest))
    unit = "poddaemon-unitbench.service"
    dropin = manager.home / ".config" / "systemd" / "user" / f"{unit}.d"
    dropin.mkdir(parents=True)
    # Many starts in a row: lift the start rate limit (5 per 10 s) that would refuse them.
    (dropin / "bench.conf").write_text(
        f"[Unit]\nStartLimitIntervalSec=0\n[Service]\nRestartSec={RESTART_SEC}\n"
    )
    manager.systemctl("daemon-reload")
    sock = str(home.path / "run" / "pods" / "unitbench" / "sock")
    spawn_sock = str(home.path / "run" / "pods" / "spawnbench" / "sock")

    starts: list[float] = []
    spawns: list[float] = []
    for _ in range(ROUNDS):  # interleaved: load on the machine hits both alike
        starts.append(timed(["systemctl", "--user", "start", unit]))
        assert _answers(sock), "the unit was active before its pod answered"
        manager.systemctl("stop", unit)
        spawns.append(timed([PY, "-m", "cli.main", "spawn", str(spawn_manifest)], podenv))
        podctl("stop", "spawnbench")
        _until(lambda: not os.path.exists(spawn_sock))
    sec.add(
        Row(
            "systemctl --user start to active, median",
            median(starts),
            "ms",
            median(spawns),
            "podctl spawn to READY",
        )
    )

    # Restart after kill -9: to READY, and to the first model request of the resumed run.
    manager.systemctl("start", unit)
    ready: list[float] = []
    first_request: list[float] = []
    for i in range(ROUNDS):
        home.fake.reset()
        home.fake.script({"text": "held", "gate": f"hold{i}"})
        out = manager.run(
            [PY, "-m", "cli.main", "send", "unitbench", f"work {i}", "--no-wait"], podenv
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        home.fake.wait_requests(1)
        pid = int(manager.prop(unit, "MainPID"))
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        home.fake.open_gate(f"hold{i}")
        _until(lambda p=pid: manager.prop(unit, "MainPID") not in ("0", str(p)) and _answers(sock))
        ready.append((time.perf_counter() - t0) * 1e3)
        home.fake.wait_requests(2)
        first_request.append((time.perf_counter() - t0) * 1e3)
        podctl("wait", "unitbench", "--timeout", "30")
    sec.add(
        Row(
            "kill -9 to READY again (RestartSec=0.1 s), median",
            median(ready),
            "ms",
            median(spawns),
            "podctl spawn to READY",
        )
    )
    sec.add(
        Row(
            "kill -9 to the resumed run's first model request, median",
            median(first_request),
            "ms",
            median(ready),
            "kill -9 to READY",
        )
    )
    sec.note(
        f"{ROUNDS} rounds each; starts {', '.join(f'{x:.0f}' for x in starts)} ms; "
        f"spawns {', '.join(f'{x:.0f}' for x in spawns)} ms; "
        f"restarts to READY {', '.join(f'{x:.0f}' for x in ready)} ms "
        "(READY here: the new pod's socket answers; it includes systemd noticing the death); "
        "READY to first request is mostly the provider SDK's import, done lazily at that request"
    )
    manager.systemctl("stop", unit)
