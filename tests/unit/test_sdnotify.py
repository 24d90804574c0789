"""sd_notify helpers: watchdog interval, STATUS lines, journal detection and priorities."""

import asyncio
import logging
import os
import socket
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from poddaemon import sdnotify


def test_watchdog_interval_is_half_the_timeout() -> None:
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "3000000"}) == 1.5
    assert sdnotify.watchdog_interval({}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    pid = str(os.getpid())
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": pid}) == 1.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None


def test_status_lines() -> None:
    assert sdnotify.status_line("idle", None, None) == "idle"
    assert sdnotify.status_line("running", "r1", None) == "running run r1"
    assert sdnotify.status_line("paused", None, "r2") == "paused (run r2)"


def test_notify_without_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify")
    assert sdnotify.notify("READY=1") is False  # never raises


def test_supervise_pings_and_reports_state(monkeypatch: pytest.MonkeyPatch) -> None:
    addr = os.path.join(tempfile.mkdtemp(dir="/tmp"), "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(addr)
        listener.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", addr)
        monkeypatch.setenv("WATCHDOG_USEC", "100000")  # ping every 0.05 s
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        pod = SimpleNamespace(pod_state="idle", state=SimpleNamespace(active_run=None))

        async def drive() -> list[bytes]:
            task = asyncio.create_task(sdnotify.supervise(pod))
            got: list[bytes] = []
            loop = asyncio.get_running_loop()
            while len(got) < 3:
                got.append(await loop.run_in_executor(None, listener.recv, 200))
                if len(got) == 2:
                    pod.pod_state, pod.state.active_run = "running", "r9"
            while not any(b"STATUS=running run r9" in m for m in got):
                got.append(await loop.run_in_executor(None, listener.recv, 200))
            task.cancel()
            return got

        got = asyncio.run(drive())
    assert got[0] == b"WATCHDOG=1\nSTATUS=idle"
    assert got[1] == b"WATCHDOG=1"
    assert any(b"STATUS=running run r9" in m for m in got)


def test_journal_detection_matches_device_and_inode(tmp_path: Path) -> None:
    f = tmp_path / "stream"
    with f.open("w") as out:
        st = os.fstat(out.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert sdnotify.stderr_is_journal(env, out.fileno())
        assert not sdnotify.stderr_is_journal({"JOURNAL_STREAM": "1:2"}, out.fileno())
        assert not sdnotify.stderr_is_journal({}, out.fileno())


def test_journal_formatter_prefixes_every_line() -> None:
    fmt = sdnotify.JournalFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "a\nb", None, None)
    assert fmt.format(record) == "<3>ERROR a\n<3>b"
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hi", None, None)
    assert fmt.format(record) == "<6>INFO hi"


def test_claim_keeps_the_supervisor_from_children(monkeypatch: pytest.MonkeyPatch) -> None:
    addr = os.path.join(tempfile.mkdtemp(dir="/tmp"), "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(addr)
        listener.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", addr)
        monkeypatch.setenv("WATCHDOG_USEC", "4000000")
        monkeypatch.setattr(sdnotify, "_claimed", None)
        sdnotify.claim()
        try:
            assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
            assert sdnotify.notify("READY=1")  # the pod itself still reaches its supervisor
            assert listener.recv(100) == b"READY=1"
            assert sdnotify.watchdog_interval() == 2.0
        finally:
            monkeypatch.setattr(sdnotify, "_claimed", None)


def test_supervise_keeps_pinging_when_the_state_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    addr = os.path.join(tempfile.mkdtemp(dir="/tmp"), "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(addr)
        listener.settimeout(5)
        monkeypatch.setattr(
            sdnotify, "_claimed", {"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "100000"}
        )
        broken = SimpleNamespace()  # no pod_state, no state

        async def drive() -> list[bytes]:
            task = asyncio.create_task(sdnotify.supervise(broken))
            loop = asyncio.get_running_loop()
            got = [await loop.run_in_executor(None, listener.recv, 200) for _ in range(3)]
            task.cancel()
            return got

        got = asyncio.run(drive())
    assert got[0] == b"WATCHDOG=1\nSTATUS=unknown"
    assert got[1:] == [b"WATCHDOG=1", b"WATCHDOG=1"]
