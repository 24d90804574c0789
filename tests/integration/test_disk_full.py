"""A full disk: the caller gets the error, subscribers an alert, the pod stops, nothing is lost."""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import RpcError
from tests.conftest import Env


@pytest.fixture
def small_data_dir(env: Env) -> Iterator[Path]:
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    data = env.home / "data"
    data.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(data)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield data
    finally:
        env.cleanup()
        subprocess.run(["umount", "-l", str(data)], check=False)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_disk_full_is_reported_and_nothing_acknowledged_is_lost(
    env: Env, small_data_dir: Path
) -> None:
    pod = env.start("full")
    with pod.client() as c:
        first = c.run_wait("before the disk filled up")
    assert first.outcome == "finished"
    filler = fill(small_data_dir)
    with pod.client() as watcher, pod.client() as c:
        watcher.subscribe()
        with pytest.raises(RpcError) as err:
            c.run("x" * 64 * 1024)  # needs new pages: the append cannot fit
        assert "could not persist" in err.value.message
        assert "No space left on device" in err.value.message
        alert = next(e for e in watcher.events() if e.type == "alert")
    assert alert.data["level"] == "error" and "No space left" in alert.data["message"]
    assert pod.proc.wait(20) == 1  # it stops rather than run without a log, and says it failed
    filler.unlink()
    again = env.restart(pod, "--resume")
    entries = again.call("history")["entries"]
    assert any(e["kind"] == "run_end" and e["run_id"] == first.run_id for e in entries)
    assert not any(e.get("text", "").startswith("xxxx") for e in entries)  # never acknowledged
