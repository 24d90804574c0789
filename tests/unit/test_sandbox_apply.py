"""apply_policy and the launcher in fresh processes (confinement cannot be undone): ABI
detection, the kernel-without-Landlock seam, modes, older ABIs, the one-thread rule."""

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from poddaemon.sandbox import Policy, available, build_policy
from poddaemon.sandbox.landlock import FAKE_ABI_ENV
from poddaemon.scope import Scope

ABI = available()
needs_landlock = pytest.mark.skipif(ABI == 0, reason="this kernel has no Landlock")


@pytest.fixture
def work() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        root = Path(os.path.realpath(d))
        (root / "proj").mkdir()
        (root / "proj" / "in.txt").write_text("inside\n")
        (root / "out.txt").write_text("outside\n")
        yield root


def policy_file(root: Path, **kw: object) -> str:
    scope = Scope.from_config([("proj", "write", True)], cwd=str(root))
    p = build_policy(scope, pwd=str(root / "proj"), tmpdir=None, **kw)  # type: ignore[arg-type]
    path = root / "policy.json"
    path.write_bytes(p.encode())
    return str(path)


def launch(
    root: Path, pol: str, script: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PATH": f"{sys.base_prefix}/bin:/usr/bin:/bin", **(env or {})}
    cmd = [sys.executable, "-I", "-m", "poddaemon.sandbox.exec", pol, "--", "bash", "-c", script]
    return subprocess.run(cmd, cwd=root / "proj", env=full, capture_output=True, text=True)


def test_seam_only_lowers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_ABI_ENV, "99")
    assert available() == ABI
    monkeypatch.setenv(FAKE_ABI_ENV, "0")
    assert available() == 0


@needs_landlock
@pytest.mark.skipif(os.geteuid() != 0, reason="only root has capabilities to drop")
def test_root_commands_lose_the_capabilities_landlock_cannot_see(work: Path) -> None:
    # SysV IPC, the kernel log, reboot/kexec and the clock have no path Landlock could judge.
    r = launch(work, policy_file(work), "grep CapBnd /proc/self/status")
    bounding = int(r.stdout.split()[1], 16)
    named = {"IPC_OWNER": 15, "SYS_BOOT": 22, "SYS_TIME": 25, "SYSLOG": 34, "SYS_ADMIN": 21}
    assert {n for n, bit in named.items() if bounding >> bit & 1} == set()


@needs_landlock
def test_confines_and_says_which_abi(work: Path) -> None:
    r = launch(work, policy_file(work), 'echo "$PODDAEMON_SANDBOX"; cat in.txt; cat ../out.txt')
    assert r.stdout.splitlines()[:2] == [f"landlock-abi-{ABI}", "inside"]
    assert "Permission denied" in r.stderr and r.returncode == 1


def test_enforce_without_landlock_is_a_one_line_error(work: Path) -> None:
    r = launch(work, policy_file(work), "echo ran", env={FAKE_ABI_ENV: "0"})
    assert r.returncode == 126 and r.stdout == ""
    assert r.stderr == (
        "poddaemon.sandbox.exec: sandbox mode enforce: this kernel has no Landlock "
        "(Linux >= 5.13 with landlock enabled in lsm=)\n"
    )


def test_best_effort_without_landlock_runs_unconfined(work: Path) -> None:
    pol = policy_file(work, mode="best_effort")
    r = launch(work, pol, 'echo "$PODDAEMON_SANDBOX"; cat ../out.txt', env={FAKE_ABI_ENV: "0"})
    assert (r.returncode, r.stdout) == (0, "none\noutside\n")


def test_off_never_confines(work: Path) -> None:
    r = launch(work, policy_file(work, mode="off"), 'echo "$PODDAEMON_SANDBOX"; cat ../out.txt')
    assert (r.returncode, r.stdout) == (0, "none\noutside\n")


@needs_landlock
@pytest.mark.parametrize("abi", [1, 2, 3, 4, 5, 6])
def test_older_abis_still_confine(work: Path, abi: int) -> None:
    if abi > ABI:
        pytest.skip(f"kernel has ABI {ABI}")
    r = launch(
        work,
        policy_file(work),
        'echo "$PODDAEMON_SANDBOX"; echo more >> in.txt && cat in.txt; cat ../out.txt',
        env={FAKE_ABI_ENV: str(abi)},
    )
    assert r.stdout == f"landlock-abi-{abi}\ninside\nmore\n"
    assert "Permission denied" in r.stderr


@needs_landlock
def test_network_off_below_abi_4_rests_on_seccomp(work: Path) -> None:
    """Landlock has no TCP rules before ABI 4; the seccomp filter refuses IP sockets anyway."""
    pol = policy_file(work, network=False)
    script = 'echo "$PODDAEMON_SANDBOX"; python3 -c "import socket; socket.socket()"'
    r = launch(work, pol, script, env={FAKE_ABI_ENV: "3"})
    assert r.stdout == "landlock-abi-3\n"
    assert r.returncode == 1 and "PermissionError" in r.stderr


@needs_landlock
def test_refuses_once_a_thread_runs(work: Path) -> None:
    code = (
        "import sys, threading\n"
        "from poddaemon.sandbox import SandboxError, apply_policy\n"
        "ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start()\n"
        "try:\n"
        "    apply_policy(open(sys.argv[1], 'rb').read())\n"
        "except SandboxError as e:\n"
        "    print(e)\n"
        "ev.set(); t.join()\n"
        "print(open(sys.argv[2]).read(), end='')\n"  # still unconfined: nothing was applied
    )
    r = subprocess.run(
        [sys.executable, "-c", code, policy_file(work), str(work / "out.txt")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout == (
        "sandbox: apply_policy must run before any thread starts (2 running)\noutside\n"
    )


def test_launcher_usage_and_missing_command(work: Path) -> None:
    base = [sys.executable, "-I", "-m", "poddaemon.sandbox.exec"]
    r = subprocess.run([*base, "p.json", "true"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("usage:")
    pol = policy_file(work, mode="off")
    r = subprocess.run([*base, pol, "--", "no-such-cmd-x"], capture_output=True, text=True)
    assert r.returncode == 127 and "no-such-cmd-x: command not found" in r.stderr
    r = subprocess.run(
        [*base, str(work / "nope.json"), "--", "true"], capture_output=True, text=True
    )
    assert r.returncode == 126


def test_policy_is_plain_json() -> None:
    """Another process (the runner) may hand apply_policy JSON it did not build with Policy."""
    p = msgspec.json.decode(b'{"rules": [["/usr", 13]]}', type=Policy)
    assert p.rules[0].path == "/usr" and p.rules[0].access == 13
    assert (p.network, p.mode, p.scoped, p.tmpdir, p.notes) == (True, "enforce", True, None, ())
