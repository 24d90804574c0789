"""Issue 9, items 6 and 7: a pod's directories are private, and permission problems are one line.

Real `poddaemon run` processes. The ownership cases need root: as root the test hands
directories to a second real uid (nobody, 65534) and also runs the pod *as* that uid (with the
system python 3.11 and this checkout's installed packages on PYTHONPATH).
"""

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from poddaemon.readyline import EXIT_REFUSED
from tests.conftest import ROOT, Env

OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to hand a directory to a second uid"
)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def start_fails(env: Env, manifest: Path, **extra_env: str) -> str:
    """Run the pod expecting a start-up failure: its whole stderr (asserted one line, exit 1)."""
    proc = subprocess.run(
        [sys.executable, "-m", "poddaemon", "run", str(manifest)],
        env={**env.env, **extra_env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("poddaemon: ") and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


# --- 0700 whatever the umask ---------------------------------------------------------------------


@contextlib.contextmanager
def pod_under_umask(env: Env, name: str, umask: int, *args: str) -> Iterator[tuple[str, str]]:
    """A pod started under `umask` that has made its first session: (its socket, the session
    id). Shut down (exit 0) when the block ends."""
    from protocol import PodClient

    proc = env.popen(str(env.manifest(name)), *args, preexec_fn=lambda: os.umask(umask))
    assert proc.stderr is not None
    line = proc.stderr.readline()
    try:
        assert line.startswith("PODDAEMON-READY"), line + proc.stderr.read()
        sock = line.rstrip("\n").split("\t")[2]
        with PodClient.connect(sock) as c:
            c.run_wait("make a session")
            session = c.status().session_id
        assert session is not None
        yield sock, session
        with PodClient.connect(sock) as c:
            c.shutdown()
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()


def test_every_directory_is_created_0700_under_umask_0(env: Env) -> None:
    home = env.home / "fresh"  # does not exist yet: the pod creates all of it
    env.env["PODDAEMON_HOME"] = str(home)
    with pod_under_umask(env, "private", 0, "--stderr-log") as (sock, _):
        dirs = [
            home,
            home / "data",
            home / "data" / "sessions",
            home / "run",
            home / "run" / "pods",
            home / "run" / "pods" / "private",
            home / "log",
        ]
        assert {str(d): oct(mode(d)) for d in dirs} == {str(d): "0o700" for d in dirs}
        assert oct(mode(home / "run" / "pods.json")) == "0o600"
        assert oct(mode(Path(sock))) == "0o600"
        # A kept configuration grants scope on `podctl restart`: nobody else may write it, even
        # where its directory was made beforehand and readable by others.
        files = [home / "run" / "pods" / "private" / "pid", home / "data" / "pods" / "private.toml"]
        assert {str(f): oct(mode(f)) for f in files} == {str(f): "0o600" for f in files}


def test_files_a_pod_reopens_are_0600_under_a_read_only_umask(env: Env) -> None:
    """Under umask 0277 (new files read-only for their owner) the session log and stderr.log
    were made 0400: `podctl restart` (`--resume`) then failed to reopen the session ("Permission
    denied", exit 78) and the restarted pod could not append to its stderr.log, for any uid but
    root. Like the registry and the kept configuration, they are 0600 whatever the umask."""
    with pod_under_umask(env, "readonly", 0o277, "--stderr-log") as (sock, session):
        files = [
            env.home / "data" / "sessions" / f"{session}.jsonl",
            Path(sock).parent / "stderr.log",  # (a link to the log dir's readonly.log)
            env.home / "log" / "readonly.log",
        ]
        assert {str(f): oct(mode(f)) for f in files} == {str(f): "0o600" for f in files}


# --- refused directories (as root, handing them to a second uid) -------------------------------


@needs_root
def test_a_home_owned_by_another_user_is_refused(env: Env) -> None:
    manifest = env.manifest("hijack")
    home = env.home / "theirs"
    home.mkdir(mode=0o700)
    os.chown(home, OTHER_UID, OTHER_UID)
    err = start_fails(env, manifest, PODDAEMON_HOME=str(home))
    assert err.startswith(
        f"poddaemon: home directory {home} is owned by uid {OTHER_UID}, not by you (uid 0)"
    )
    assert not (home / "run").exists()  # nothing was created in it


@needs_root
def test_a_data_dir_owned_by_another_user_is_refused(env: Env) -> None:
    manifest = env.manifest("hijack")
    data = env.home / "otherdata"
    data.mkdir(mode=0o700)
    os.chown(data, OTHER_UID, OTHER_UID)
    err = start_fails(env, manifest, PODDAEMON_DATA_DIR=str(data))
    assert f"data directory {data} is owned by uid {OTHER_UID}" in err


@needs_root
@pytest.mark.parametrize("where", ["target", "above it", "before a .."])
def test_a_scope_target_through_another_users_symlink_is_refused(env: Env, where: str) -> None:
    """A second user who may write in a shared tree planted a link where a scope target was
    to be (or on its way) pointing at root's private directory: the target was resolved
    through it and root's pod got write access there, its `bash` reading and planting files."""
    secret = env.home / "secret"
    secret.mkdir(mode=0o700)
    shared = env.home / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # a tree both users write in, no sticky bit
    link = shared / "proj"
    link.symlink_to(env.home if where == "above it" else secret)
    os.lchown(link, OTHER_UID, OTHER_UID)
    target = {
        "target": str(link),
        "above it": f"{link}/secret",
        "before a ..": f"{link}/../secret",  # resolved while the manifest is read
    }[where]
    manifest = env.manifest("victim", write=[str(env.work), target], pwd=str(env.work))
    proc = env.popen(str(manifest))
    assert proc.stderr is not None
    first = proc.stderr.readline()
    if first.startswith("PODDAEMON-READY"):  # it took the link's target as its scope
        proc.terminate()
    _, rest = proc.communicate(timeout=30)
    assert first == (
        f"poddaemon: {manifest}: scope.allow[1].target: {target} is reached through the "
        f"symlink {link}, owned by uid {OTHER_UID}, who could repoint it: refusing it\n"
    )
    assert (proc.returncode, rest) == (EXIT_REFUSED, "")


def test_a_write_scope_other_users_may_write_in_is_warned_about(env: Env) -> None:
    """The registry is one per user: a pod of another user's writing the same tree started,
    both did, without a word, though SPEC §4 refuses overlapping write scopes."""
    shared = env.home / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    manifest = env.manifest("sharer", write=[str(env.work), str(shared)], pwd=str(env.work))
    proc = env.popen(str(manifest))
    assert proc.stderr is not None
    lines = []
    while not (line := proc.stderr.readline()).startswith("PODDAEMON-READY") and line:
        lines.append(line)
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert lines == [
        f"poddaemon: warning: {manifest}: scope.allow[1]: {shared} is writable by others "
        "(mode 0777): pods of other users (not in this user's registry) may write there too, "
        "unchecked\n"
    ]


def test_a_runtime_dir_writable_by_others_is_refused(env: Env) -> None:
    manifest = env.manifest("hijack")
    runtime = env.home / "openrun"
    runtime.mkdir()
    os.chmod(runtime, 0o777)
    err = start_fails(env, manifest, PODDAEMON_RUNTIME_DIR=str(runtime))
    assert f"runtime directory {runtime} is writable by group or others (mode 0777)" in err
    assert not (runtime / "pods.json").exists()


def test_stop_in_a_runtime_dir_others_can_write_signals_no_process(env: Env) -> None:
    """A pod that cannot be asked on its socket is sent SIGTERM, at the pid its registry
    entry names: in a runtime dir others can write, anyone could plant an entry naming any
    process of ours (its start time is in /proc), and `podctl stop` killed it. It is refused
    there, as `ls`, `send` and `spawn` are."""
    from poddaemon.registry import Registry, make_entry
    from poddaemon.scope import Scope

    victim = subprocess.Popen(["sleep", "60"])
    runtime = env.home / "run"
    try:
        sock = str(runtime / "pods" / "victim" / "sock")
        Registry(runtime).register(make_entry("victim", sock, Scope((), ()), pid=victim.pid))
        os.chmod(runtime, 0o777)
        try:
            proc = env.podctl("stop", "victim")
        finally:
            os.chmod(runtime, 0o700)
        assert victim.poll() is None, proc.stderr
        assert proc.returncode == 1, proc.stderr
        (line,) = proc.stderr.splitlines()
        assert f"runtime directory {runtime} is writable by group or others" in line
    finally:
        victim.kill()
        victim.wait()


# --- as a second real uid ----------------------------------------------------------------------


def _python_for_other_uid() -> str | None:
    """An interpreter uid 65534 may run, of this Python's minor version (the compiled
    dependencies installed for this one load in it); pyenv's lives under /root."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(candidate):
            continue
        out = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if out.returncode == 0 and out.stdout.strip() == str(sys.version_info[:2]):
            return candidate
    return None


def guest_manifest(work: Path, base_url: str, tools: tuple[str, ...] = ()) -> str:
    """The manifest of pod "guest" (run as OTHER_UID): `work` its pwd and its write scope."""
    listed = "tools = [" + ", ".join(f'"{t}"' for t in tools) + "]\n" if tools else ""
    return (
        "[pod]\n"
        'name = "guest"\n'
        f'pwd = "{work}"\n'
        "[provider]\n"
        'kind = "openai"\n'
        'model = "fake-model"\n'
        f'base_url = "{base_url}"\n'
        'api_key_env = "FAKE_API_KEY"\n'
        "[worker]\n"
        'instruction = "test"\n'
        f"{listed}"
        "[[scope.allow]]\n"
        f'target = "{work}"\n'
        'permission = "write"\n'
    )


class Other:
    """A directory tree owned by uid 65534 holding a manifest, and a way to run the pod as it."""

    def __init__(self, env: Env, base: Path, python: str) -> None:
        self.env = env
        self.base = base
        self.python = python
        self.mine = base / "nobody"
        (self.mine / "work").mkdir(parents=True, mode=0o700)
        self.manifest = self.mine / "pod.toml"
        self.manifest.write_text(guest_manifest(self.mine / "work", env.model.openai_base_url))
        for p in [self.mine, *self.mine.rglob("*")]:
            os.chown(p, OTHER_UID, OTHER_UID)

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        return self._as_other(["-m", "poddaemon", "run", str(self.manifest)], env)

    def podctl(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return self._as_other(["-m", "cli", *args], env)

    def _as_other(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        site = sysconfig.get_paths()["purelib"]
        full = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.mine),
            "FAKE_API_KEY": "test-key",
            "PYTHONPATH": f"{site}{os.pathsep}{ROOT}",
            "PODDAEMON_CONFIG_DIR": str(self.mine / "config"),
            "PODDAEMON_DATA_DIR": str(self.mine / "data"),
            **env,
        }
        return subprocess.run(
            [self.python, *argv],
            env=full,
            cwd=self.mine,
            user=OTHER_UID,
            group=OTHER_UID,
            capture_output=True,
            text=True,
            timeout=60,
        )


@pytest.fixture
def other(env: Env) -> Iterator[Other]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the pod as a second uid")
    python = _python_for_other_uid()
    if python is None:
        pytest.skip(f"no system python {sys.version_info[:2]} that uid {OTHER_UID} can run")
    base = env.home / "x"
    base.mkdir()
    os.chmod(env.home, 0o755)  # let uid 65534 reach its own tree (root still owns the path)
    os.chmod(base, 0o755)
    yield Other(env, base, python)
    shutil.rmtree(base, ignore_errors=True)


def test_another_users_pod_socket_is_refused_in_one_clear_line(env: Env, other: Other) -> None:
    # Said "[Errno 13] Permission denied: '<socket>'": the path twice, and no hint of why.
    sock = env.start("roots").socket
    proc = other.podctl("status", str(sock))
    assert (proc.returncode, proc.stderr) == (
        1,
        f"podctl: cannot talk to pod '{sock}': socket {sock} is out of your reach (permission "
        "denied): another user's, most likely\n",
    )


def one_line_failure(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode in (1, EXIT_REFUSED), proc.stderr  # a failure, or a refusal
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("poddaemon: ") and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_other_uid_accepts_a_home_of_its_own(other: Other) -> None:
    # The control case for the refusals below: the same uid, the same checks, its own home.
    home = other.mine / "home"
    probe = subprocess.run(
        [other.python, "-c", "from protocol import paths; paths.ensure_private_dirs()"],
        env={
            "PYTHONPATH": f"{sysconfig.get_paths()['purelib']}{os.pathsep}{ROOT}",
            "PODDAEMON_HOME": str(home),
        },
        cwd=other.mine,
        user=OTHER_UID,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert probe.returncode == 0, probe.stderr
    assert os.stat(home).st_uid == OTHER_UID and mode(home / "run") == 0o700


def test_other_uid_refuses_a_home_owned_by_root(other: Other) -> None:
    home = other.base / "roots"  # root's, readable by everyone: a hijacker's set-up
    home.mkdir(mode=0o755)
    (home / "config").mkdir(mode=0o755)  # its defaults unreadable: not what is said first
    (home / "config" / "defaults.toml").write_text("")
    os.chmod(home / "config" / "defaults.toml", 0o600)
    err = one_line_failure(
        other.run(PODDAEMON_HOME=str(home), PODDAEMON_CONFIG_DIR=str(home / "config"))
    )
    assert err.startswith(
        f"poddaemon: home directory {home} is owned by uid 0, not by you (uid {OTHER_UID})"
    )


def test_other_uid_with_an_unreadable_lock_file_gets_one_line(other: Other) -> None:
    runtime = other.mine / "run"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, OTHER_UID, OTHER_UID)
    lock = runtime / "pods.json.lock"
    lock.write_text("")
    os.chmod(lock, 0o600)  # root's: uid 65534 may not open it
    err = one_line_failure(other.run(PODDAEMON_RUNTIME_DIR=str(runtime)))
    assert f"cannot open the registry lock {lock}: permission denied" in err


def test_other_uid_with_a_squatted_tmp_runtime_dir_gets_one_line(other: Other) -> None:
    squat = Path(f"/tmp/runtime-{OTHER_UID}")  # platformdirs' fallback without XDG_RUNTIME_DIR
    if os.path.lexists(squat):
        pytest.skip(f"{squat} exists already; not touching it")
    squat.mkdir(mode=0o700)  # root's: the fallback belongs to someone else
    try:
        err = one_line_failure(other.run(XDG_RUNTIME_DIR=""))
    finally:
        shutil.rmtree(squat, ignore_errors=True)
    assert err.startswith(f"poddaemon: runtime directory {squat} is owned by uid 0")


@pytest.mark.parametrize("command", [["ls"], ["status", "anypod"], ["sessions", "list"]])
def test_other_uid_gets_one_line_for_a_home_it_cannot_reach(
    other: Other, command: list[str]
) -> None:
    # Whether it exists or not, a home behind another user's closed door is not ours to use.
    hidden = other.base / "hidden"
    hidden.mkdir(mode=0o700)  # root's
    home = hidden / "home"
    proc = other.podctl(*command, PODDAEMON_HOME=str(home))
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("podctl: ") and line.endswith(
        f"home directory {home} is out of your reach (permission denied): refusing it"
    )
    if command == ["ls"]:  # and the pod itself, once
        err = one_line_failure(other.run(PODDAEMON_HOME=str(home)))
        assert err == (
            f"poddaemon: home directory {home} is out of your reach (permission denied): "
            "refusing it\n"
        )


@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["status", "anypod"],
        ["notify", "anypod", "hi"],
        ["sessions", "list"],  # session logs there may be another user's forgeries
        ["sessions", "verify", "01a20bcd-effe-76ac-9445-142c4fb87450"],
        ["logs", "anypod"],
        ["restart", "anypod"],  # its kept configuration grants scope
        ["stop", "anypod"],  # it signals the pid a registry entry names
        ["stop", "--tree", "anypod"],
    ],
)
def test_podctl_refuses_a_home_others_can_write_in_one_line(env: Env, command: list[str]) -> None:
    os.chmod(env.home, 0o777)
    try:
        proc = env.podctl(*command)
    finally:
        os.chmod(env.home, 0o700)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "writable by group or others" in line and str(env.home) in line
    assert "Traceback" not in proc.stderr


@needs_root
def test_podctl_refuses_a_home_owned_by_another_user(env: Env) -> None:
    os.chown(env.home, OTHER_UID, OTHER_UID)
    try:
        proc = env.podctl("ls")
    finally:
        os.chown(env.home, 0, 0)
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert f"owned by uid {OTHER_UID}" in line


def test_other_uid_with_a_sessions_dir_it_cannot_write_is_refused_before_ready(
    other: Other,
) -> None:
    """A sessions directory the pod may not write in refuses it at start-up (exit 78, the
    directory named), not after READY at its first input (a unit would restart it in a loop)."""
    sessions = other.mine / "data" / "sessions"
    sessions.mkdir(parents=True, mode=0o700)
    os.chown(other.mine / "data", OTHER_UID, OTHER_UID)
    os.chown(sessions, OTHER_UID, OTHER_UID)
    os.chmod(sessions, 0o500)  # its own, but read-only
    proc = other.run(PODDAEMON_RUNTIME_DIR=str(other.mine / "run"))  # (not /tmp/runtime-65534)
    err = one_line_failure(proc)
    assert proc.returncode == EXIT_REFUSED
    assert err == f"poddaemon: cannot write session logs in {sessions}: Permission denied\n"
    assert "READY" not in proc.stdout and os.listdir(sessions) == []


@pytest.mark.parametrize("command", [["spawn"], ["ls"], ["status", "anypod"], ["sessions", "list"]])
def test_a_home_whose_name_is_not_utf8_is_refused_in_one_line(
    env: Env, tmp_path: Path, command: list[str]
) -> None:
    """PODDAEMON_HOME=/tmp/h\\xe9: its paths go into the registry, the kept configurations and
    the wire, all UTF-8. `podctl spawn` ended in a UnicodeEncodeError traceback (podctl's own,
    or the pod's writing the registry after it had started)."""
    home = os.fsdecode(os.fsencode(tmp_path) + b"/h\xe9")
    os.mkdir(home, 0o700)
    env.env["PODDAEMON_HOME"] = home
    args = [*command, str(env.manifest())] if command == ["spawn"] else command
    proc = env.podctl(*args)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("poddaemon: " if command == ["spawn"] else "podctl: "), line
    shown = home.encode("utf-8", "backslashreplace").decode()
    assert line.endswith(f"home directory {shown} is not UTF-8: refusing it"), line
