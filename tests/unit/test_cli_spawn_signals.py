"""`podctl spawn` stopped by SIGTERM while it starts the pod (`cli.spawn.spawn_detached`): the
pod goes with it, even when the signal comes before podctl knows the pod's pid."""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

import pytest

import cli.spawn
from cli.spawn import Execd

if TYPE_CHECKING:
    from cli.spawn import Started


def test_a_sigterm_while_the_pod_is_being_started_stops_the_pod(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[Started] = []

    def start(cmd: list[str], stderr: int) -> Started:
        # The pod exists, podctl is still inside start() (Popen waits for the exec): a
        # SystemExit raised here left the pod running for nobody.
        proc = Execd([sys.executable, "-c", "import time; time.sleep(60)"], stderr)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)
        return proc

    monkeypatch.setattr(cli.spawn, "start", start)
    try:
        with pytest.raises(SystemExit) as stopped:
            cli.spawn.spawn_detached(["unused"], timeout=30)
        assert stopped.value.code == 128 + signal.SIGTERM
        assert started[0].wait(10) == -signal.SIGTERM  # stopped by podctl, not left starting
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    # The handler is podctl's own only while it waits: SIGTERM's disposition is back.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_without_a_signal_nothing_is_held_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def start(cmd: list[str], stderr: int) -> Started:
        code = "import os; os.write(2, b'early\\nPODDAEMON-READY\\tpod\\t/run/x.sock\\n')"
        return Execd([sys.executable, "-c", code], stderr)

    monkeypatch.setattr(cli.spawn, "start", start)
    assert cli.spawn.spawn_detached(["unused"], timeout=30) == ("pod", "/run/x.sock", b"early\n")
