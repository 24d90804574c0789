"""File metadata outside the scope: Landlock has no right for chmod, chown or utimes, so the
command runner mounts everything but the write grants read-only in a namespace of its own
(poddaemon/sandbox/mounts.py). Real pods, real bash; the fallback (no namespace) is the control
that shows the refusals came from the read-only view."""

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from poddaemon.sandbox import available
from poddaemon.sandbox.mounts import TEST_SEAM
from tests.conftest import Env, wait_until
from tests.integration.test_pod_sandbox import bash_results, status_of
from tests.integration.test_private_dirs import OTHER_UID, guest_manifest

pytestmark = pytest.mark.skipif(available() == 0, reason="this kernel has no Landlock")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown; a second uid)")

OLD = 946_684_800  # 2000-01-01: a time no command here sets


def metadata(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_mode, st.st_uid, st.st_gid, int(st.st_mtime)


def changes(target: Path) -> list[str]:
    return [
        f"chmod 0666 {target}",
        f"chown {OTHER_UID} {target}",
        f"chgrp {OTHER_UID} {target}",
        f"touch -d 2001-02-03 {target}",
        f"chmod u+s {target}",
    ]


@pytest.fixture
def victim(env: Env) -> Iterator[Path]:
    """A file outside every scope, like ~/.bashrc or a system file."""
    outside = env.home / "outside"
    outside.mkdir()
    path = outside / "victim"
    path.write_text("untouched\n")
    os.chmod(path, 0o644)
    os.utime(path, (OLD, OLD))
    yield path


@needs_root
def test_metadata_outside_the_scope_cannot_change_and_inside_it_can(env: Env, victim: Path) -> None:
    project = env.work / "project"
    project.mkdir()
    mine = project / "mine.txt"
    mine.write_text("in scope\n")
    os.utime(mine, (OLD, OLD))
    before = metadata(victim)
    dir_before = metadata(victim.parent)
    attacks = [*changes(victim), f"chmod 0777 {victim.parent}"]
    inside = [
        *changes(mine),
        f"cat {mine}",
        f"echo made > {project}/made.txt && cat {project}/made.txt",
        'echo tmp > "$TMPDIR/t" && chmod 0600 "$TMPDIR/t" && cat "$TMPDIR/t"',
        "echo x > /dev/null && head -c1 /dev/zero | wc -c",
        f"cat {victim}",  # contents outside: refused as before (Landlock; a write now EROFS)
        f"echo x >> {victim}",
    ]
    outputs = bash_results(env, "metadata", attacks + inside, pwd=str(project))
    for command, output in zip(attacks, outputs, strict=False):
        assert status_of(output) != 0, f"changed outside the scope: {command!r}: {output}"
        assert "Read-only file system" in output, output
    assert metadata(victim) == before and metadata(victim.parent) == dir_before
    done = outputs[len(attacks) :]
    for command, output in zip(inside[:-2], done, strict=False):
        assert status_of(output) == 0, f"failed inside the scope: {command!r}: {output}"
    st = os.stat(mine)
    assert (st.st_uid, st.st_gid) == (OTHER_UID, OTHER_UID)
    assert st.st_mode & 0o7777 == 0o4666 and int(st.st_mtime) != OLD
    assert "made" in done[6] and "tmp" in done[7] and done[8].split()[0] == "1"
    assert status_of(done[-2]) != 0 and "Permission denied" in done[-2], done[-2]
    assert status_of(done[-1]) != 0, done[-1]
    assert victim.read_text() == "untouched\n"
    # Nothing to report: the read-only view was made.
    status = " ".join(env.podctl("status", "metadata").stdout.split())
    assert "not protected" not in status and "stay changeable" not in status, status


def test_without_the_namespace_the_pod_runs_and_status_says_what_is_unprotected(
    env: Env, victim: Path
) -> None:
    """The fallback (user namespaces disabled, seccomp, a runner already in a Landlock
    domain): Landlock alone, and `podctl status` says so. Also the control for the test above:
    the same chmod then goes through."""
    env.env[TEST_SEAM] = "1"
    outputs = bash_results(env, "fallback", [f"chmod 0600 {victim}", f"cat {victim}"])
    assert status_of(outputs[0]) == 0, outputs[0]
    assert os.stat(victim).st_mode & 0o777 == 0o600
    assert status_of(outputs[1]) != 0  # contents stay refused
    status = " ".join(env.podctl("status", "fallback").stdout.split())
    assert "file modes, owners and times outside the write scope are not protected" in status
    assert f"refused by the test seam {TEST_SEAM}" in status
    if os.geteuid() == 0:  # nothing hides root's secrets in /etc then: said too
        assert "/etc/shadow" in status and "stay readable by commands" in status, status


def test_mode_off_makes_no_namespace(env: Env, victim: Path) -> None:
    extra = '[sandbox]\nmode = "off"\n'
    (output,) = bash_results(env, "unboxed", [f"chmod 0600 {victim}"], extra=extra)
    assert status_of(output) == 0, output
    assert os.stat(victim).st_mode & 0o777 == 0o600


# --- as a second uid (a user namespace maps only that uid) ---------------------------------------


@pytest.fixture
def guest(env: Env) -> Iterator[tuple[Path, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the pod as a second uid")
    # This interpreter, not the system one with PYTHONPATH (as test_private_dirs does): the
    # command runner starts with `python -I`, which ignores PYTHONPATH.
    python = sys.executable
    probe = [python, "-I", "-c", "import msgspec, poddaemon"]
    if subprocess.run(probe, user=OTHER_UID, capture_output=True, cwd="/").returncode != 0:
        pytest.skip(f"uid {OTHER_UID} cannot run {python} with this checkout")
    os.chmod(env.home, 0o755)  # let the guest reach its own tree (root still owns the path)
    mine = env.home / "guest"
    (mine / "work").mkdir(parents=True)
    (mine / ".bashrc").write_text("# rc\n")
    os.chmod(mine / ".bashrc", 0o644)
    (mine / "work" / "notes.txt").write_text("notes\n")
    for p in [mine, *mine.rglob("*")]:
        os.chown(p, OTHER_UID, OTHER_UID)
    os.chmod(mine, 0o755)
    yield mine, python


def test_a_user_pod_cannot_open_up_its_own_files_outside_the_scope(
    env: Env, guest: tuple[Path, str]
) -> None:
    """`chmod 0666 ~/.bashrc` or `chmod 777 ~` would let another local user plant code."""
    mine, python = guest
    bashrc, work = mine / ".bashrc", mine / "work"
    commands = [
        f"chmod 0666 {bashrc}",
        f"chmod 0777 {mine}",
        f"touch -d 2001-02-03 {bashrc}",
        f"chmod 0600 {work}/notes.txt",  # inside the scope: works
        "id -u && grep CapEff /proc/self/status",  # its uid, no capability left
    ]
    calls = [
        {"name": "bash", "arguments": {"command": f"{c}; echo EXIT-STATUS:$?"}} for c in commands
    ]
    env.model.script({"tool_calls": calls}, {"text": "done"})
    manifest = mine / "pod.toml"
    manifest.write_text(guest_manifest(work, env.model.openai_base_url, ("bash",)))
    os.chown(manifest, OTHER_UID, OTHER_UID)
    before = metadata(bashrc), metadata(mine)[:3]  # the pod adds its home there: a new mtime
    as_guest = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(mine),
        "FAKE_API_KEY": "test-key",
        "PODDAEMON_HOME": str(mine / "home"),
    }
    pod = subprocess.Popen(
        [python, "-m", "poddaemon", "run", str(manifest)],
        env=as_guest,
        cwd=mine,
        user=OTHER_UID,
        group=OTHER_UID,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert pod.stderr is not None
        line = pod.stderr.readline()
        assert line.startswith("PODDAEMON-READY"), line + pod.stderr.read()

        def podctl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [python, "-m", "cli.main", *args],
                env=as_guest,
                cwd=mine,
                user=OTHER_UID,
                group=OTHER_UID,
                capture_output=True,
                text=True,
                timeout=60,
            )

        sent = podctl("send", "guest", "attack")
        assert sent.returncode == 0, sent.stderr
        status = " ".join(podctl("status", "guest").stdout.split())
    finally:
        os.killpg(pod.pid, 15)
        pod.wait(20)
    outputs = [
        entry["item"]["output"]
        for log in (mine / "home").rglob("*.jsonl")
        for entry in map(json.loads, log.read_text().splitlines())
        if entry.get("kind") == "tool_result"
    ]
    assert len(outputs) == len(commands), outputs
    for command, output in zip(commands[:3], outputs, strict=False):
        assert status_of(output) != 0 and "Read-only file system" in output, (command, output)
    assert status_of(outputs[3]) == 0 and outputs[4].split()[0] == str(OTHER_UID), outputs
    assert "CapEff:\t0000000000000000" in outputs[4], outputs[4]
    assert metadata(bashrc) == before[0] and metadata(mine)[:3] == before[1]
    assert os.stat(work / "notes.txt").st_mode & 0o777 == 0o600
    assert "not protected" not in status, status
    wait_until(lambda: pod.poll() is not None)


SHM_KEY = 0x5EED_0D0D
SHMGET = (
    "python3 -c 'import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
    f"print(libc.shmget({SHM_KEY}, 0, 0) >= 0, os.strerror(ctypes.get_errno()))'"
)


@pytest.fixture
def segment() -> Iterator[int]:
    """A 0600 System V shared memory segment of the test process (unconfined), by a known key."""
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(SHM_KEY, 4096, 0o1000 | 0o600)  # IPC_CREAT
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    yield shmid
    libc.shmctl(shmid, 0, None)  # IPC_RMID


def test_commands_cannot_reach_system_v_ipc_outside_their_own(env: Env, segment: int) -> None:
    # No path for Landlock to judge: a command attached to an unconfined process's 0600
    # segment (any process's, as root) and read and wrote it. The runner has an IPC namespace.
    shared = "ipcmk -M 4096 >/dev/null && ipcs -m | grep -c 4096"  # their own still works
    outputs = bash_results(env, "ipc", [SHMGET, shared], pwd=str(env.work))
    assert outputs[0].startswith("False No such file or directory"), outputs[0]
    assert status_of(outputs[1]) == 0 and outputs[1].split()[0] == "1", outputs[1]
    control = subprocess.run(SHMGET, shell=True, capture_output=True, text=True)
    assert control.stdout.startswith("True"), control


@needs_root
def test_a_second_uid_with_supplementary_groups_is_told_they_are_not_mapped(env: Env) -> None:
    """The user namespace maps only the runner's uid and primary gid (an unprivileged
    gid_map holds one line): chgrp to another of the user's groups fails with EINVAL and
    `cp -a` silently gives the copy the primary group. Status must say so."""
    from poddaemon import runner

    root = os.path.dirname(os.path.dirname(os.path.abspath(runner.__file__)))
    os.chmod(env.home, 0o755)  # let the guest reach its grant (root still owns the path)
    grant = env.home / "grant"
    grant.mkdir()
    os.chown(grant, OTHER_UID, OTHER_UID)
    script = (
        f"import json, os, sys; sys.path.insert(0, {root!r}); from poddaemon import runner; "
        f"notes = runner.read_only_view([{str(grant)!r}]); "
        f"open({str(grant / 'f')!r}, 'w').close(); "
        f"err = ''\ntry: os.chown({str(grant / 'f')!r}, -1, 100)\n"
        "except OSError as e: err = e.strerror\n"
        "print(json.dumps([notes, err]))"
    )
    probe = subprocess.run(
        [sys.executable, "-I", "-c", script],
        user=OTHER_UID,
        group=OTHER_UID,
        extra_groups=[100],
        capture_output=True,
        text=True,
        cwd="/",
    )
    if probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr:
        pytest.skip(f"uid {OTHER_UID} cannot run {sys.executable} with this checkout")
    assert probe.returncode == 0, probe.stderr
    notes, err = json.loads(probe.stdout)
    assert err == "Invalid argument", err  # the behaviour the note describes
    text = " ".join(notes)
    assert "supplementary groups (100) are not mapped" in text, notes
    assert "stay changeable" not in text and "not protected" not in text, notes


@needs_root
def test_podctl_homes_under_roots_directories_are_accepted_inside_a_second_uid_runner(
    env: Env,
) -> None:
    """Inside the runner's user namespace root's directories (`/`, `/home`) read as 65534:
    `podctl`/`poddaemon run` in a non-root pod's bash refused every home ("inside /home, owned
    by uid 65534, who could swap it")."""
    from poddaemon import runner

    uid = 4242  # neither root nor the overflow uid
    root = os.path.dirname(os.path.dirname(os.path.abspath(runner.__file__)))
    os.chmod(env.home, 0o755)
    home = env.home / "guest-home"
    home.mkdir(mode=0o700)
    os.chown(home, uid, uid)
    script = (
        f"import os, sys; sys.path.insert(0, {root!r}); from pathlib import Path; "
        "from poddaemon import runner; from protocol.paths import check_dir; "
        f"assert runner.read_only_view([{str(home)!r}]) == []; "
        f"check_dir(Path({str(home)!r}), 'home directory'); print(os.stat('/').st_uid)"
    )
    probe = python_as(uid, script)
    assert probe.stdout.split() == ["65534"]  # the view was made: root's / reads as 65534


def python_as(uid: int, script: str) -> "subprocess.CompletedProcess[str]":
    """`script` run by this interpreter (-I) as `uid`, from /: it must succeed."""
    probe = subprocess.run(
        [sys.executable, "-I", "-c", script],
        user=uid,
        group=uid,
        capture_output=True,
        text=True,
        cwd="/",
    )
    if "ModuleNotFoundError" in probe.stderr:
        pytest.skip(f"uid {uid} cannot run {sys.executable} with this checkout")
    assert probe.returncode == 0, probe.stderr
    return probe


@needs_root
def test_a_second_uid_runner_inside_another_runners_view_keeps_its_uid(env: Env) -> None:
    """A non-root pod started from a non-root pod's bash: its runner's unshare(CLONE_NEWUSER)
    succeeded, then the maps could not be written (/proc is read-only in the outer view) and
    the commands ran unmapped, as uid 65534. The fallback is Landlock alone, identity kept."""
    from poddaemon import runner

    uid = 4242
    root = os.path.dirname(os.path.dirname(os.path.abspath(runner.__file__)))
    os.chmod(env.home, 0o755)
    grant = env.home / "inner"
    grant.mkdir()
    os.chown(grant, uid, uid)
    inner = (
        f"import json, os, sys; sys.path.insert(0, {root!r}); from poddaemon import runner; "
        f"notes = runner.read_only_view([{str(grant)!r}]); print(json.dumps([notes, os.getuid()]))"
    )
    outer = (
        f"import os, sys; sys.path.insert(0, {root!r}); from poddaemon import runner; "
        f"assert runner.read_only_view([{str(grant)!r}]) == []; "
        f"os.execv(sys.executable, [sys.executable, '-I', '-c', {inner!r}])"
    )
    probe = python_as(uid, outer)
    notes, seen_uid = json.loads(probe.stdout)
    assert seen_uid == uid, (seen_uid, notes)
    assert "not protected" in " ".join(notes) and "Read-only file system" in notes[0], notes
