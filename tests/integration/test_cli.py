"""podctl as users run it: real subprocesses, PODDAEMON_HOME in a short temp dir.

The first tests need no pod. The end-to-end test starts a real `poddaemon` (through
`podctl spawn`) against the in-process fake model server.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from poddaemon.testing.cleanup import kill_spawned

REPO = Path(__file__).resolve().parents[2]
COMMANDS = [
    [],
    ["spawn"],
    ["ls"],
    ["status"],
    ["stop"],
    ["rpc"],
    ["send"],
    ["notify"],
    ["attach"],
    ["history"],
    ["pause"],
    ["resume"],
    ["cancel"],
    ["sessions"],
    ["sessions", "list"],
    ["sessions", "show"],
    ["sessions", "verify"],
    ["dev"],
    ["dev", "fake-model"],
]

POD_COMMANDS = [
    ["status", "ghost"],
    ["stop", "ghost"],
    ["stop", "--tree", "ghost"],
    ["rpc", "ghost", "status"],
    ["rpc", "ghost", "history", '{"limit": 1}'],
    ["send", "ghost", "hello"],
    ["send", "--no-wait", "ghost", "hello"],
    ["send", "--steer", "ghost", "hello"],
    ["notify", "ghost", "hello"],
    ["attach", "ghost"],
    ["history", "ghost"],
    ["pause", "ghost"],
    ["resume", "ghost"],
    ["cancel", "ghost"],
]


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pc", dir="/tmp"))
    try:
        yield path
    finally:
        kill_spawned(path / "run")  # a fork server a spawn started, and pods a test left
        shutil.rmtree(path, ignore_errors=True)


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODDAEMON_")}
    env["PODDAEMON_HOME"] = str(home)
    env.update(extra)
    return env


def podctl(
    home: Path,
    *args: str,
    stdin: str | None = None,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=REPO,
        env=env_for(home, **(env or {})),
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- no pod needed ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "podctl")
def test_every_command_has_help(home: Path, command: list[str]) -> None:
    proc = podctl(home, *command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: podctl" in proc.stdout


def test_console_script_runs() -> None:
    script = Path(sys.executable).parent / "podctl"
    if not script.exists():
        pytest.skip("podctl console script not installed")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "spawn" in proc.stdout


@pytest.mark.parametrize("command", POD_COMMANDS, ids=" ".join)
def test_missing_pod_exits_3_with_one_line(home: Path, command: list[str]) -> None:
    proc = podctl(home, *command)
    assert proc.returncode == 3, proc.stderr
    # One line, saying where podctl looked (an XDG_RUNTIME_DIR or PODDAEMON_HOME that differs
    # from the pod's is then plain to see).
    sock = home / "run" / "pods" / "ghost" / "sock"
    assert proc.stderr == f"podctl: pod 'ghost' is not running: no socket at {sock}\n"
    assert proc.stdout == ""


@pytest.mark.parametrize("command", [["send", "hello"], ["attach"], ["history"]], ids=" ".join)
def test_a_socket_that_is_no_pods_is_one_line_not_a_traceback(
    home: Path, command: list[str]
) -> None:
    # POD may be a socket path: one of this user's that answers in another format (the fork
    # server's `{"error": "..."}`) made these commands end in a msgspec traceback.
    reply = b'{"jsonrpc":"2.0","id":1,"error":"bad request"}\n'
    proc = _podctl_against(home, reply, command)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == (
        "podctl: the pod's reply is malformed: Expected `object`, got `str` - at `$.error`"
        " (-32700)\n"
    )


@pytest.mark.parametrize(
    ("command", "result"),
    [
        (command, result)
        for result in (b"null", b'"text"')
        for command in (["status"], ["notify", "hi"], ["pause"], ["rpc", "status"], ["send", "hi"])
    ]
    + [(["attach"], b"null")]
    + [(command, b"{}") for command in (["notify", "hi"], ["pause"], ["cancel"], ["compact"])]
    # A status of no pod's shape: status_text and wait's queue count ended in tracebacks.
    + [
        (command, b'{"name":"x","pid":1,"state":"idle",%b}' % field)
        for field in (b'"queue":"zz"', b'"queue":{"runs":"abc"}', b'"scope":5', b'"mcp":[1]')
        for command in (["status"], ["wait", "--timeout", "1"])
    ]
    + [(["status"], b'{"name":1,"pid":"1","state":null}')],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v.decode(),
)
def test_a_result_that_is_no_object_is_one_line_not_a_traceback(
    home: Path, command: list[str], result: bytes
) -> None:
    """A socket that answers JSON-RPC with a `result` of no pod's shape (`null`, a string,
    `{}`): podctl indexed it (`result["paused"]`: a TypeError or KeyError traceback) or,
    through PodClient, let msgspec's ValidationError out. Every method's result is an object
    with its fields (SPEC §5)."""
    proc = _podctl_against(home, b'{"jsonrpc":"2.0","id":1,"result":%b}\n' % result, command)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.startswith("podctl: the pod's reply is malformed: "), proc.stderr
    assert proc.stderr.count("\n") == 1


def _podctl_against(
    home: Path, reply: bytes, command: list[str]
) -> "subprocess.CompletedProcess[str]":
    """`podctl COMMAND` aimed at a socket of this user's that is no pod's: it reads the
    request, sends `reply` and hangs up."""
    import socket
    import threading

    path = home / "other.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        return podctl(home, command[0], str(path), *command[1:])
    finally:
        thread.join(10)
        server.close()


def test_stale_socket_counts_as_not_running(home: Path) -> None:
    import socket

    pod_dir = home / "run" / "pods" / "stale"
    pod_dir.mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(pod_dir / "sock"))
    sock.close()  # the file stays, nobody listens
    proc = podctl(home, "status", "stale")
    message = f"podctl: pod 'stale' is not running: nothing listens on {pod_dir / 'sock'}\n"
    assert (proc.returncode, proc.stderr) == (3, message)
    ls = podctl(home, "ls", "--json")
    assert ls.returncode == 0 and json.loads(ls.stdout) == []


def imported_modules(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["status", "nosuchpod"],
        ["notify", "nosuchpod", "hi"],
        ["send", "nosuchpod", "hi"],
        ["send", "--no-wait", "nosuchpod", "hi"],
    ],
    ids=" ".join,
)
def test_start_up_never_imports_heavy_modules(home: Path, args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cli.main", *args],
        cwd=REPO,
        env=env_for(home),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == (0 if args == ["--help"] else 3)
    modules = imported_modules(proc.stderr)
    # status POD, notify and send run without typer (cli/plain.py); the rest through it. send
    # follows its run with a PodClient (msgspec); with --no-wait it makes one call.
    assert ("typer" in modules) == (args == ["--help"])
    heavy = {m for m in modules if m.split(".")[0] in {"openai", "anthropic", "asyncio", "uvloop"}}
    assert not heavy
    if args[0] != "send" or "--no-wait" in args:  # one call (protocol.oneshot): no msgspec,
        # ~10 ms with what it brings; it crept back in once, through protocol.framing
        assert not {m for m in modules if m.split(".")[0] == "msgspec"}
    assert not {m for m in modules if m.startswith(("poddaemon.store", "poddaemon.testing"))}


def test_rpc_with_invalid_json_params_is_a_usage_error(home: Path) -> None:
    proc = podctl(home, "rpc", "ghost", "status", "{not json")
    assert proc.returncode == 2
    assert proc.stderr.startswith("podctl: invalid JSON params:")
    # What Python's json takes but is no JSON the pod can read (it answered -32700), and a
    # nesting that was a RecursionError traceback.
    for params, said in [
        ('{"limit": NaN}', "NaN is not JSON"),
        ('{"limit": -Infinity}', "-Infinity is not JSON"),
        ('{"limit": 1e999}', "1e999 is out of range"),
        ('{"a": ' + "[" * 10_000 + "]" * 10_000 + "}", "nested too deeply"),
    ]:
        proc = podctl(home, "rpc", "ghost", "history", params)
        assert (proc.returncode, proc.stderr) == (2, f"podctl: invalid JSON params: {said}\n")
    proc = podctl(home, "rpc", "ghost", "status", "[1, 2]")
    assert (proc.returncode, proc.stderr) == (2, "podctl: JSON params must be an object\n")
    # `-` is stdin, as for send: what is wrong there is said so too, before any pod is asked.
    for stdin, said in [
        ("", "empty JSON params"),
        ("[1]\n", "JSON params must be an object"),
        ("{oops", "invalid JSON params: Expecting property name"),
    ]:
        proc = podctl(home, "rpc", "ghost", "status", "-", stdin=stdin)
        assert proc.returncode == 2 and proc.stderr.startswith(f"podctl: {said}"), proc.stderr
    proc = podctl(home, "rpc", "ghost", "status", "-", stdin='{"a": 1}')
    assert proc.returncode == 3 and "not running" in proc.stderr  # read, then sent


@pytest.mark.parametrize("command", ["send", "notify"])
def test_a_message_on_stdin_larger_than_any_frame_is_refused_unread(
    home: Path, command: str
) -> None:
    # All of stdin was read into memory first (a runaway pipe: gigabytes), then refused.
    proc = podctl(home, command, "ghost", "-", stdin="x" * ((8 << 20) + 1))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "podctl: stdin holds more than 8 MiB, more than one request to a pod carries; "
        "a pod takes at most its worker.max_input_bytes of input in one message "
        "(256 KiB unless its manifest says more): save it in a file the pod can read and send "
        "its path\n"
    )


@pytest.mark.parametrize("name", ["Bad Name", "../pods/x"])
def test_unit_remove_of_a_name_no_pod_can_have_is_a_usage_error(home: Path, name: str) -> None:
    # Asked of the user manager first: with none, "no systemd user manager answers" (exit 1),
    # and with one, "no unit for pod" (exit 1) for what is a typo.
    proc = podctl(home, "unit", "remove", name)
    assert proc.returncode == 2, proc.stderr
    assert "Error: Invalid value for 'NAME':" in proc.stderr and "manager" not in proc.stderr


@pytest.mark.parametrize("command", [["wait", "ghost"], ["mcp-serve"]], ids=" ".join)
def test_a_nan_timeout_is_a_usage_error(home: Path, command: list[str]) -> None:
    # click's min= lets NaN through: `wait --timeout nan` ended in a ValueError traceback from
    # settimeout(), `mcp-serve --timeout nan` served with every call's timeout NaN.
    proc = podctl(home, *command, "--timeout", "nan")
    assert proc.returncode == 2
    assert proc.stderr.endswith(
        "Error: Invalid value for '--timeout': nan is not a number of seconds\n"
    )


def test_send_of_empty_stdin_is_a_usage_error(home: Path) -> None:
    proc = podctl(home, "send", "ghost", "-", stdin="\n")
    assert (proc.returncode, proc.stderr) == (2, "podctl: empty message\n")


def test_ls_without_pods(home: Path) -> None:
    proc = podctl(home, "ls")
    assert proc.returncode == 0 and proc.stdout == ""
    assert podctl(home, "status", "--json").stdout.strip() == "[]"


def test_spawn_of_missing_manifest_prints_the_pods_error(home: Path) -> None:
    missing = home / "nope.toml"
    proc = podctl(home, "spawn", str(missing))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert str(missing) in proc.stderr
    assert not (home / "run" / "pods").exists() or not list((home / "run" / "pods").iterdir())


def test_spawn_rejects_session_with_resume(home: Path) -> None:
    proc = podctl(home, "spawn", "x.toml", "--session", "abc", "--resume")
    assert proc.returncode == 2 and "exclude each other" in proc.stderr


@pytest.mark.parametrize("override", ["foo", "pod.name", "pod..name=x", "=1", "a b=1"])
def test_spawn_rejects_a_malformed_set_as_a_usage_error(home: Path, override: str) -> None:
    proc = podctl(home, "spawn", "x.toml", "--set", override)
    assert (proc.returncode, proc.stderr) == (
        2,
        f"podctl: --set {override}: expected section.key=value\n",
    )


def test_sessions_verify_and_show(home: Path) -> None:
    from poddaemon.store.file import SessionLog

    sessions = home / "data" / "sessions"
    log = SessionLog.create(sessions, "s1", {"pod": "p", "system_prompt": "be brief"})
    log.append("user_input", {"run_id": "r1", "text": "hello", "mode": "queue"})
    log.close()
    listed = podctl(home, "sessions")
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:2] == ["s1", "p"]
    SessionLog.create(sessions, "s2", {"pod": "q", "system_prompt": "be brief"}).close()
    only_p = podctl(home, "sessions", "list", "p", "--json")
    assert [info["id"] for info in json.loads(only_p.stdout)] == ["s1"]
    none = podctl(home, "sessions", "list", "nopod")
    assert (none.returncode, none.stdout) == (0, "")
    assert none.stderr == "podctl: no sessions of pod nopod\n"
    ok = podctl(home, "sessions", "verify", "s1")
    assert ok.returncode == 0
    assert ok.stdout.startswith("ok: 2 entries, head ") and len(ok.stdout.split()[-1]) == 12
    shown = podctl(home, "sessions", "show", "s1")
    assert shown.stdout.splitlines() == ["1 session_start pod=p", "2 user_input [run r1] hello"]
    as_json = podctl(home, "sessions", "show", "s1", "--json")
    assert [json.loads(line)["kind"] for line in as_json.stdout.splitlines()] == [
        "session_start",
        "user_input",
    ]
    path = sessions / "s1.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1].replace("hello", "HELLO"))
    bad = podctl(home, "sessions", "verify", "s1")
    assert bad.returncode == 1 and "line 2" in bad.stderr and bad.stderr.startswith("podctl: ")
    missing = podctl(home, "sessions", "verify", "nope")
    assert missing.returncode == 1 and "nope" in missing.stderr
    # Not a session id at all (a path): a usage error, not a damaged log (both exited 1).
    malformed = podctl(home, "sessions", "verify", str(path))
    assert malformed.returncode == 2 and "invalid session id" in malformed.stderr


@pytest.mark.parametrize("pod", ["P", "p.toml", "/run/pods/p/sock", "\udcff"])
def test_sessions_list_of_what_names_no_pod_is_a_usage_error(home: Path, pod: str) -> None:
    """`podctl sessions list P` (a typo of pod p, whose sessions are there) said "no sessions
    of pod P" and exited 0, as if p had never run: a script read it as nothing to look at."""
    from poddaemon.store.file import SessionLog

    SessionLog.create(home / "data" / "sessions", "s1", {"pod": "p", "system_prompt": "x"}).close()
    typo = podctl(home, "sessions", "list", pod)
    assert (typo.returncode, typo.stdout) == (2, "")
    assert "is not a valid pod name" in typo.stderr and "Traceback" not in typo.stderr
    assert podctl(home, "sessions", "list", "p").stdout.splitlines()[1].split()[:2] == ["s1", "p"]


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_sessions_on_what_is_not_a_file_is_one_line_and_never_hangs(home: Path, kind: str) -> None:
    sessions = home / "data" / "sessions"
    sessions.mkdir(parents=True)
    odd = sessions / "odd.jsonl"
    os.mkdir(odd) if kind == "directory" else os.mkfifo(odd)  # a fifo: a read would wait
    for command in ("verify", "show"):
        done = podctl(home, "sessions", command, "odd", timeout=20)
        assert done.returncode == 1, done.stderr
        assert done.stderr == f"podctl: {odd}: not a regular file\n", done.stderr


def test_sessions_verify_and_show_read_an_enormous_log_in_little_memory(home: Path) -> None:
    from poddaemon.store.file import SessionLog

    log = SessionLog.create(home / "data" / "sessions", "big", {"pod": "p", "system_prompt": ""})
    for i in range(1600):  # ~100 MB
        log.append("user_input", {"run_id": f"r{i}", "text": "x" * 65536, "mode": "queue"})
    log.close()
    size = log.path.stat().st_size
    measure = (  # the peak memory of the podctl it runs
        "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], stdout=-3);"
        "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    for command in ("verify", "show"):
        run = [sys.executable, "-m", "cli.main", "sessions", command, "big"]
        done = subprocess.run(
            [sys.executable, "-c", measure, *run],
            cwd=REPO,
            env=env_for(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
        code, peak = map(int, done.stdout.split())
        assert code == 0, done.stderr
        assert peak < size / 2, (
            f"podctl sessions {command}: {peak >> 20} MiB for a {size >> 20} MiB log"
        )


# --- end to end with a real pod -----------------------------------------------------------------


def write_manifest(home: Path, name: str, base_url: str) -> Path:
    work = home / "w"
    work.mkdir(exist_ok=True)
    manifest = home / f"{name}.toml"
    manifest.write_text(
        f"""
[pod]
name = "{name}"
pwd = "{work}"

[provider]
kind = "openai"
model = "fake"
base_url = "{base_url}"
api_key_env = "PODCTL_TEST_KEY"

[[scope.allow]]
target = "{work}"
permission = "write"
"""
    )
    return manifest


def kill_leftover_pods(home: Path) -> None:
    """Safety net: never leave a pod running if a test failed half-way."""
    for pid_file in (home / "run" / "pods").glob("*/pid"):
        with contextlib.suppress(ValueError, OSError):
            os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)


def test_spawn_ls_status_rpc_send_stop(home: Path) -> None:
    from poddaemon.testing.fake_model import FakeModel

    key = {"PODCTL_TEST_KEY": "dummy"}
    with FakeModel() as fake:
        manifest = write_manifest(home, "e2e", fake.openai_base_url)
        try:
            spawned = podctl(home, "spawn", str(manifest), env=key)
            assert spawned.returncode == 0, spawned.stderr
            name, sock = spawned.stdout.rstrip("\n").split("\t")
            assert name == "e2e" and Path(sock).is_socket()

            table = podctl(home, "ls").stdout.splitlines()
            assert table[0].split()[:3] == ["NAME", "PID", "STATE"]
            row = next(line.split() for line in table[1:] if line.split()[0] == "e2e")
            assert row[3] == "fake" and row[4] == str(home / "w")

            status = json.loads(podctl(home, "status", "e2e", "--json").stdout)
            assert status["name"] == "e2e" and status["model"] == "fake"
            assert podctl(home, "status", "e2e").stdout.startswith("name:")

            raw = podctl(home, "rpc", "e2e", "status")
            assert raw.returncode == 0 and json.loads(raw.stdout)["pid"] == status["pid"]
            bad = podctl(home, "rpc", "e2e", "no_such_method")
            assert bad.returncode == 1 and bad.stderr.endswith("(-32601)\n")

            sent = podctl(home, "send", "e2e", "hello", timeout=90)
            assert (sent.returncode, sent.stdout) == (0, "ok: hello\n"), sent.stderr
            piped = podctl(home, "send", "e2e", "-", "--json", stdin="again\n", timeout=90)
            final = json.loads(piped.stdout)
            assert piped.returncode == 0 and final["outcome"] == "finished"
            assert final["text"] == "ok: again"

            hist = podctl(home, "history", "e2e").stdout.splitlines()
            assert any(" user_input " in line and line.endswith(" hello") for line in hist)

            again = podctl(home, "spawn", str(manifest), env=key)
            assert again.returncode == 1 and "e2e" in again.stderr

            stopped = podctl(home, "stop", "e2e")
            assert (stopped.returncode, stopped.stdout) == (0, "stopped e2e\n"), stopped.stderr
            assert not Path(sock).exists()
            gone = podctl(home, "status", "e2e")
            assert gone.returncode == 3
        finally:
            kill_leftover_pods(home)


def test_spawn_of_a_manifest_whose_name_starts_with_a_dash(home: Path) -> None:
    # `podctl spawn -- -x.toml` handed `-x.toml` to `poddaemon run` as an option: it printed
    # its own usage ("the following arguments are required: manifest") and exited 2.
    from poddaemon.testing.fake_model import FakeModel

    with FakeModel() as fake:
        manifest = write_manifest(home, "dash", fake.openai_base_url)
        manifest.rename(home / "-dash.toml")
        try:
            spawned = subprocess.run(
                [sys.executable, "-m", "cli.main", "spawn", "--resume", "--", "-dash.toml"],
                cwd=home,
                env={**env_for(home, PODCTL_TEST_KEY="dummy"), "PYTHONPATH": str(REPO)},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert spawned.returncode == 0, spawned.stderr
            assert spawned.stdout.split("\t")[0] == "dash"
            status = json.loads(podctl(home, "status", "dash", "--json").stdout)
            assert status["name"] == "dash"
            assert podctl(home, "stop", "dash").returncode == 0
        finally:
            kill_leftover_pods(home)


def _attach(home: Path, name: str) -> "subprocess.Popen[str]":
    """`podctl attach NAME --since 0`, reading its output from the pipes."""
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "attach", name, "--since", "0"],
        cwd=REPO,
        env=env_for(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_send_exit_codes_and_attach(home: Path) -> None:
    from poddaemon.testing.fake_model import FakeModel

    key = {"PODCTL_TEST_KEY": "dummy"}
    with FakeModel() as fake:
        manifest = write_manifest(home, "talk", fake.openai_base_url)
        attach: subprocess.Popen[str] | None = None
        try:
            spawned = podctl(home, "spawn", str(manifest), "--set", "worker.max_turns=1", env=key)
            assert spawned.returncode == 0, spawned.stderr
            attach = _attach(home, "talk")

            # One model round that asks for a tool: max_turns=1 ends the run limit_reached.
            fake.script(
                {"text": "looking", "tool_calls": [{"name": "list_dir", "arguments": "{}"}]}
            )
            limited = podctl(home, "send", "talk", "look around", timeout=90)
            assert limited.returncode == 2, (limited.stdout, limited.stderr)
            assert "limit" in limited.stderr

            # A provider refusal ends the run with an error: exit 1, the error on stderr.
            fake.script({"fault": {"kind": "status", "status": 400}})
            failed = podctl(home, "send", "talk", "fail please", timeout=90)
            assert failed.returncode == 1 and failed.stderr.startswith("podctl: run ")

            done = podctl(home, "send", "talk", "bye", timeout=90)
            assert (done.returncode, done.stdout) == (0, "ok: bye\n"), done.stderr

            queued = podctl(home, "send", "--no-wait", "talk", "later")
            run_id, state = queued.stdout.split()
            assert queued.returncode == 0 and state in ("started", "queued")

            # attach rendered all of it, live; the last run ends the stream we read.
            assert attach.stdout is not None
            seen: list[str] = []
            for line in attach.stdout:
                seen.append(line.rstrip("\n"))
                if line.startswith(f"[run {run_id}] finished"):
                    break
            assert any(line == "⚙ list_dir {}" for line in seen), seen
            assert any("] finished: limit_reached" in line for line in seen), "\n".join(seen)
            assert any(
                line.endswith("finished: error") or "finished: error" in line for line in seen
            )
            assert "ok: bye" in seen
            attach.send_signal(signal.SIGINT)
            assert attach.wait(timeout=10) == 130  # Ctrl-C, as for send and wait

            stopped = podctl(home, "stop", "--tree", "talk")
            assert (stopped.returncode, stopped.stdout) == (0, "stopped talk\n"), stopped.stderr
        finally:
            if attach is not None and attach.poll() is None:
                attach.kill()
                attach.wait()
            kill_leftover_pods(home)


def test_attach_shows_a_model_chosen_tool_name_without_escape_sequences(home: Path) -> None:
    """The model names the tool it calls: `podctl attach` printed that name raw, so an OSC 52
    in it wrote the clipboard of whoever was watching. It is shown with \\xNN like the rest."""
    from poddaemon.testing.fake_model import FakeModel

    evil = "ev\x1b]52;c;aGk=\x07il"
    with FakeModel() as fake:
        manifest = write_manifest(home, "esc", fake.openai_base_url)
        attach: subprocess.Popen[str] | None = None
        try:
            spawned = podctl(home, "spawn", str(manifest), env={"PODCTL_TEST_KEY": "dummy"})
            assert spawned.returncode == 0, spawned.stderr
            fake.script({"tool_calls": [{"name": evil, "arguments": "{}"}]}, {"text": "done"})
            sent = podctl(home, "send", "esc", "go", timeout=90)
            assert (sent.returncode, sent.stdout) == (0, "done\n"), sent.stderr
            attach = _attach(home, "esc")
            assert attach.stdout is not None
            seen: list[str] = []
            for line in attach.stdout:
                seen.append(line)
                if "] finished: " in line:
                    break
            shown = "".join(seen)
            assert "\x1b" not in shown and "\x07" not in shown, shown
            assert "⚙ ev\\x1b]52;c;aGk=\\x07il {}\n" in seen, shown
            assert "✗ ev\\x1b]52;c;aGk=\\x07il: " in shown
            attach.send_signal(signal.SIGINT)
            assert attach.wait(timeout=10) == 130  # Ctrl-C, as for send and wait
        finally:
            if attach is not None and attach.poll() is None:
                attach.kill()
                attach.wait()
            kill_leftover_pods(home)


# One streamed chat answer whose text holds a lone surrogate (`\ud800`, valid JSON) and a stray
# low one, then a tool call whose name holds one: what no fake scripted through msgspec can send.
_SURROGATE_STREAM = [
    b'{"choices":[{"index":0,"delta":{"content":"a\\ud800b \\udcff"},"finish_reason":null}]}',
    b'{"choices":[{"index":0,"delta":{"content":" c"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}',
    b"[DONE]",
]


@contextlib.contextmanager
def surrogate_server() -> Iterator[str]:
    """An OpenAI-compatible server that answers every request with `_SURROGATE_STREAM`."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for data in _SURROGATE_STREAM:
                self.wfile.write(b"data: " + data + b"\n\n")
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_a_lone_surrogate_in_the_models_stream_is_shown_not_fatal(home: Path) -> None:
    """The SDK decodes the model's `\\ud800` into a lone surrogate, which no event frame nor log
    line can encode: the run ended in an internal error and `podctl send` waited forever for its
    end. The model's text goes on, the surrogate shown as text, and the pod stays usable."""
    with surrogate_server() as url:
        manifest = write_manifest(home, "sur", url)
        try:
            spawned = podctl(home, "spawn", str(manifest), env={"PODCTL_TEST_KEY": "dummy"})
            assert spawned.returncode == 0, spawned.stderr
            for _ in range(2):  # and again: the pod's event stream still works
                sent = podctl(home, "send", "sur", "hi", timeout=60)
                assert (sent.returncode, sent.stdout) == (0, "a\\ud800b \\udcff c\n"), sent.stderr
            shown = podctl(home, "history", "sur").stdout
            assert "assistant a\\ud800b \\udcff c" in shown, shown
        finally:
            kill_leftover_pods(home)


def test_send_to_a_terminal_that_cannot_hold_the_answer_shows_it_escaped(home: Path) -> None:
    """A stdout whose encoding cannot hold the model's text (a Latin-1 or ASCII locale) made
    `podctl send` stop mid-answer with `an argument is not UTF-8 text (lone surrogate U+4E2D)`,
    exit 2: what it cannot hold is shown as \\uXXXX, and the answer goes on."""
    from poddaemon.testing.fake_model import FakeModel

    with FakeModel() as fake:
        manifest = write_manifest(home, "enc", fake.openai_base_url)
        try:
            spawned = podctl(home, "spawn", str(manifest), env={"PODCTL_TEST_KEY": "dummy"})
            assert spawned.returncode == 0, spawned.stderr
            fake.script({"text": "中文 ok"})
            sent = podctl(home, "send", "enc", "hi", env={"PYTHONIOENCODING": "ascii"})
            assert (sent.returncode, sent.stdout) == (0, "\\u4e2d\\u6587 ok\n"), sent.stderr
        finally:
            kill_leftover_pods(home)


def test_a_lone_surrogate_in_a_providers_error_ends_the_run(home: Path) -> None:
    """A provider's error body with a `\\ud800` escape: its message could not be published as an
    alert, the model call's task died on it and the run stayed `running` for ever (`podctl send`
    never returned). The run ends in error, the message shown with the text `\\ud800`."""
    from poddaemon.testing.fake_model import FakeModel

    body = '{"error": {"message": "bad \\ud800 key", "type": "invalid_request_error"}}'
    fault = {"kind": "status", "status": 400, "body": body, "content_type": "application/json"}
    with FakeModel() as fake:
        manifest = write_manifest(home, "perr", fake.openai_base_url)
        try:
            spawned = podctl(home, "spawn", str(manifest), env={"PODCTL_TEST_KEY": "dummy"})
            assert spawned.returncode == 0, spawned.stderr
            fake.script({"fault": fault})
            failed = podctl(home, "send", "perr", "hi", timeout=30)
            assert failed.returncode == 1, failed.stderr
            assert "bad \\ud800 key" in failed.stderr, failed.stderr
            done = podctl(home, "send", "perr", "again", timeout=30)
            assert (done.returncode, done.stdout) == (0, "ok: again\n"), done.stderr
        finally:
            kill_leftover_pods(home)
