"""Issue 9, start-up and shutdown: the code that starts, the exit status, `--resume`, the claim.

Each test drives real `poddaemon` / `podctl` processes against the fake model.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Env, StartFailed

BIN = Path(sys.executable).parent


def test_spawn_from_a_dir_with_a_poddaemon_folder_starts_the_installed_pod(env: Env) -> None:
    # A `poddaemon/` package where the user stands must not be what `podctl spawn` runs.
    cwd = env.home / "checkout"
    bogus = cwd / "poddaemon"
    bogus.mkdir(parents=True)
    (bogus / "__init__.py").write_text("")
    (bogus / "__main__.py").write_text(
        "import sys\nprint('BOGUS POD', file=sys.stderr)\nsys.exit(7)\n"
    )
    manifest = env.manifest("real")
    podctl = BIN / "podctl"
    spawned = subprocess.run(
        [str(podctl), "spawn", str(manifest)],
        cwd=cwd,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert spawned.returncode == 0, spawned.stderr
    assert "BOGUS" not in spawned.stderr
    name, sock = spawned.stdout.rstrip("\n").split("\t")
    assert name == "real" and sock == str(env.home / "run" / "pods" / "real" / "sock")
    status = subprocess.run(
        [str(podctl), "status", "real", "--json"],
        cwd=cwd,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert '"name": "real"' in status.stdout
    stopped = subprocess.run(
        [str(podctl), "stop", "real"],
        cwd=cwd,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stopped.returncode == 0, stopped.stderr


# --- item 8: a damaged complete last line is corruption, not a torn write -------------------------


def test_flipped_byte_in_the_complete_last_line_refuses_to_restore(env: Env) -> None:
    pod = env.start("lastline")
    with pod.client() as c:
        c.run_wait("acknowledged and fsync'd")
        sid = c.status().session_id
    assert pod.stop() == 0
    path = env.home / "data" / "sessions" / f"{sid}.jsonl"
    data = bytearray(path.read_bytes())
    lineno = data.count(b"\n")
    assert data.endswith(b"}\n")
    data[-2] ^= 0x01  # the last line keeps its newline but is no longer JSON
    path.write_bytes(bytes(data))
    with pytest.raises(StartFailed) as failed:
        env.restart(pod, "--session", sid)
    assert failed.value.code != 0
    assert f"line {lineno}" in failed.value.stderr and sid in failed.value.stderr
    assert path.read_bytes() == bytes(data)  # nothing cut
    verify = env.podctl("sessions", "verify", sid)
    assert verify.returncode != 0
    assert f"line {lineno}" in verify.stderr and "ok:" not in verify.stdout
