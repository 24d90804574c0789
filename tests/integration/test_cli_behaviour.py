"""podctl behaviour from issue 9 (items 15, 17, 18, 20, 21, 22), against real pods.

Pods started with `podctl spawn` are not tracked by the `env` fixture, so each test that spawns
kills what is left in its `finally`.
"""

import contextlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from poddaemon.registry import Registry, make_entry, process_start_time
from poddaemon.scope import Scope
from tests.conftest import ROOT, Env, PodProcess, drained, wait_until


def kill_leftover_pods(home: Path) -> None:
    """Safety net: never leave a pod running if a test failed half-way."""
    for pid_file in (home / "run" / "pods").glob("*/pid"):
        with contextlib.suppress(ValueError, OSError):
            os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)


@pytest.fixture
def cleanup(env: Env) -> Iterator[Env]:
    try:
        yield env
    finally:
        kill_leftover_pods(env.home)


# --- item 15: history shows the newest entries --------------------------------------------------


def seqs(stdout: str) -> list[int]:
    return [int(line.split()[0]) for line in stdout.splitlines()]


def test_history_and_sessions_show_never_pass_escape_sequences_to_the_terminal(
    env: Env,
) -> None:
    """A file the pod read (a repository under review, say) holds terminal escape sequences:
    `podctl history` and `podctl sessions show` print what the tool returned, and printed them
    raw, so the file could retitle the user's terminal, clear it or write its clipboard (OSC
    52). Control characters are shown as \\xNN instead."""
    hostile = "hello \x1b]0;PWNED\x07 \x1b[2J \x1b]52;c;ZWNobyBwd25lZA==\x07 \x9b31m end"
    (env.work / "README.md").write_text(hostile + "\n")
    env.model.script(
        {"tool_calls": [{"name": "read_file", "arguments": {"path": "README.md"}}]},
        {"text": "read it \x1b[8m"},
    )
    pod = env.start("esc", tools=["read_file"])
    assert pod.call("run", input="review \x07 this", wait=True)["outcome"] == "finished"
    sid = pod.call("status")["session_id"]
    for args in (("history", "esc", "--all"), ("sessions", "show", sid)):
        shown = env.podctl(*args)
        assert shown.returncode == 0, shown.stderr
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown.stdout), args
        assert "hello \\x1b]0;PWNED\\x07" in shown.stdout, args  # shown, not hidden
        assert "read it \\x1b[8m" in shown.stdout and "review \\x07 this" in shown.stdout


def test_error_messages_and_json_never_pass_escape_sequences_to_the_terminal(env: Env) -> None:
    """A provider's error body (a proxy, a hostile endpoint) echoes escape sequences: `podctl
    send` and `podctl compact` quoted the pod's error text raw on stderr, and the `--json`
    outputs carried C1 controls (CSI is U+009B) as they are. Shown as \\xNN / \\u00NN instead."""
    hostile = "bad \x1b]52;c;ZWNobyBwd25lZA==\x07 \x1b[2J \x9b31m end"
    env.model.script(
        {"text": "fine \x9b31m"},
        {"fault": {"kind": "status", "status": 400, "message": hostile}},
        {"fault": {"kind": "status", "status": 400, "message": hostile}},
    )
    env.start("esc")
    controls = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
    assert env.podctl("send", "esc", "one").returncode == 0
    sent = env.podctl("send", "esc", "two")
    assert sent.returncode == 1
    assert "bad \\x1b]52;c;" in sent.stderr and not controls.search(sent.stderr), sent.stderr
    compacted = env.podctl("compact", "esc")
    assert compacted.returncode != 0
    assert "bad \\x1b]52;c;" in compacted.stderr, compacted.stderr
    assert not controls.search(compacted.stderr), compacted.stderr
    shown = env.podctl("history", "esc", "--all", "--json")
    assert shown.returncode == 0, shown.stderr
    assert not controls.search(shown.stdout)
    texts = [e.get("item", {}).get("text") for e in json.loads(shown.stdout)["entries"]]
    assert "fine \x9b31m" in texts  # the same JSON, escaped


def test_history_shows_the_newest_and_says_how_many_are_cut(env: Env) -> None:
    env.start("hist")
    for text in ("one", "two"):
        sent = env.podctl("send", "hist", text)
        assert sent.returncode == 0, sent.stderr
    every = env.podctl("history", "hist", "--all")
    assert every.returncode == 0 and every.stderr == ""
    all_seqs = seqs(every.stdout)
    assert all_seqs[0] == 1 and all_seqs == sorted(all_seqs) and len(all_seqs) > 6

    tail = env.podctl("history", "hist", "--limit", "3")
    assert tail.returncode == 0
    assert seqs(tail.stdout) == all_seqs[-3:]  # the old podctl showed seq 1, 2, 3
    assert (
        tail.stderr
        == f"podctl: {len(all_seqs) - 3} earlier entries not shown (--all shows every entry)\n"
    )
    assert " run_end " in tail.stdout.splitlines()[-1]

    both = env.podctl("history", "hist", "--all", "--limit", "3")  # --all was dropped quietly
    assert both.returncode == 2 and "--all and --limit exclude each other" in both.stderr

    default = env.podctl("history", "hist")  # fewer than 50 entries: all of them, no note
    assert seqs(default.stdout) == all_seqs and default.stderr == ""

    since = env.podctl("history", "hist", "--since", str(all_seqs[2]))
    assert seqs(since.stdout) == all_seqs[3:] and since.stderr == ""

    as_json = json.loads(env.podctl("history", "hist", "--limit", "2", "--json").stdout)
    assert [e["seq"] for e in as_json["entries"]] == all_seqs[-2:]
    assert as_json["earlier"] == len(all_seqs) - 2 and as_json["next"] == all_seqs[-1]


# --- item 17 and SPEC §6: ls lists unresponsive pods, children under their parent ---------------


class SilentSocket:
    """A listening Unix socket that accepts and never answers (a stuck pod)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(8)

    def close(self) -> None:
        self.sock.close()


class GarbageSocket(SilentSocket):
    """Answers every connection with a line that is not JSON-RPC, then hangs up."""

    answer = b"this is not json\n"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(self.answer)


class EmptyResultSocket(GarbageSocket):
    """Answers every request with an empty result: JSON-RPC, but no pod's."""

    answer = b'{"jsonrpc":"2.0","id":1,"result":{}}\n'


def test_ls_lists_unresponsive_pods_and_children_under_their_parent(env: Env) -> None:
    env.start("boss")
    run = env.home / "run"
    registry = Registry(run)
    fakes = {"hung": SilentSocket, "broken": GarbageSocket}
    servers = []
    try:
        for name, kind in fakes.items():
            sock = run / "pods" / name / "sock"
            servers.append(kind(sock))
            # Registered like a child of boss, held by this (live) test process.
            entry = make_entry(name, str(sock), Scope(allow=(), deny=()), parent="boss")
            registry.register(entry)
        table = env.podctl("ls")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split()[:3] == ["NAME", "PID", "STATE"]
        assert [line.split()[0] for line in lines[1:]] == ["boss", "broken", "hung"]
        assert lines[1].startswith("boss ")
        for line in lines[2:]:  # indented under boss, shown rather than hidden
            assert line.startswith("  ") and line.split()[1:3] == [str(os.getpid()), "unresponsive"]
            assert line.split()[5] == "boss"
        listed = json.loads(env.podctl("ls", "--json").stdout)
        by_name = {st["name"]: st for st in listed}
        assert by_name["boss"]["state"] == "idle"
        assert by_name["hung"]["state"] == "unresponsive" and "2 s" in by_name["hung"]["error"]
        assert by_name["broken"]["state"] == "unresponsive"
    finally:
        for server in servers:
            server.close()
        for name in fakes:
            registry.release(name, os.getpid())


def test_a_manifest_given_for_the_pod_is_said_to_be_no_socket(env: Env) -> None:
    """Found by QA: `podctl send reviewer.toml hi` said "nothing listens on reviewer.toml", as
    for a dead pod's socket; the file is a manifest, not a pod."""
    manifest = env.manifest("asked")
    sent = env.podctl("send", str(manifest), "hi")
    assert sent.returncode == 3, sent.stderr
    assert sent.stderr == (
        f"podctl: pod '{manifest}' is not running: {manifest} is not a socket "
        "(a manifest? `podctl spawn` it, then name the pod)\n"
    )


def test_status_and_stop_of_a_socket_that_is_no_pods_say_so(env: Env) -> None:
    """A socket under the runtime dir that answers `{}` to `status`: `podctl status` printed an
    empty status and exit 0, and `podctl stop` ended in a KeyError traceback (its unit was
    looked up from status["pid"])."""
    server = EmptyResultSocket(env.home / "run" / "pods" / "impostor" / "sock")
    try:
        status = env.podctl("status", "impostor")
        stop = env.podctl("stop", "impostor")
    finally:
        server.close()
    assert status.returncode == 1 and status.stdout == ""
    assert status.stderr == "podctl: the pod's reply is malformed: no 'name' (-32700)\n"
    assert stop.returncode == 1 and stop.stderr.startswith("podctl: "), stop.stderr
    assert "Traceback" not in stop.stderr


def test_ls_lists_a_registered_pod_whose_socket_does_not_listen_yet_as_starting(env: Env) -> None:
    """A pod holds its name from the registry claim on, and listens only once its SessionStart
    hooks and MCP servers are done, which may take minutes: it was missing from ls."""
    registry = Registry(env.home / "run")
    sock = env.home / "run" / "pods" / "slow" / "sock"
    registry.register(make_entry("slow", str(sock), Scope(allow=(), deny=())))
    try:
        listed = json.loads(env.podctl("ls", "--json").stdout)
    finally:
        registry.release("slow", os.getpid())
    (row,) = listed
    assert (row["name"], row["pid"], row["state"]) == ("slow", os.getpid(), "starting")


@contextlib.contextmanager
def registered_not_listening(env: Env, name: str) -> Iterator[None]:
    """What a pod starting up shows before it listens: its registry entry and its pid file
    (this process's, taken away again before the teardown's safety net kills pid files)."""
    registry = Registry(env.home / "run")
    sock = env.home / "run" / "pods" / name / "sock"
    registry.register(make_entry(name, str(sock), Scope(allow=(), deny=())))
    sock.parent.mkdir(parents=True, exist_ok=True)
    (sock.parent / "pid").write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        (sock.parent / "pid").unlink()
        registry.release(name, os.getpid())


def test_a_pod_still_starting_is_said_to_be_starting_not_not_running(env: Env) -> None:
    """`podctl status` of a pod that `ls` lists as starting said "is not running: no socket at
    …", which `ls` contradicted. Still exit 3 (it cannot answer yet), with what is going on
    and how to wait for it; a pod without an entry is not running."""
    with registered_not_listening(env, "slow"):
        told = env.podctl("status", "slow")
    assert told.returncode == 3, told.stderr
    assert told.stderr == (
        "podctl: pod 'slow' is starting: its socket does not listen yet (podctl wait slow)\n"
    )
    gone = env.podctl("status", "slow")
    assert gone.returncode == 3 and "'slow' is not running" in gone.stderr, gone.stderr


def test_notify_and_send_to_a_pod_still_starting_wait_until_it_listens(env: Env) -> None:
    """A pod whose optional MCP server is slow to start listens only after it: `notify` and
    `send` in the meantime (a CI hook, a cron job) exited 3 at once and the event was lost to
    a script that does not retry, though the pod was running and took input seconds later.
    They wait for it now, as they wait for a unit pod that systemd restarts."""
    hang = "import time; time.sleep(600)"
    extra = f"""
[[mcp.servers]]
name = "slow"
command = {json.dumps([sys.executable, "-c", hang])}
start_timeout = 3
"""
    proc = env.popen(str(env.manifest("slowmcp", extra=extra)))
    try:
        pid_file = env.home / "run" / "pods" / "slowmcp" / "pid"
        wait_until(pid_file.exists, 20, "the pod's claim")
        assert env.podctl("status", "slowmcp").returncode == 3  # not listening yet
        notified = env.podctl("notify", "slowmcp", "build 7 failed")
        assert notified.returncode == 0, notified.stderr
        assert notified.stderr.startswith(
            "podctl: pod 'slowmcp' is starting; waiting until it listens\n"
        ), notified.stderr
        history = env.podctl("history", "slowmcp", "--json")
        items = [e for e in json.loads(history.stdout)["entries"] if e["kind"] == "system_item"]
        assert [e["text"] for e in items] == ["build 7 failed"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_wait_waits_for_a_pod_that_is_still_starting(env: Env) -> None:
    """`podctl wait` of a pod that `ls` lists as starting (SessionStart hooks, MCP servers at
    work) exited 3, "not running", at once: a script's `podctl spawn … &` then `podctl wait`
    (README: "blocks until the pod is idle") gave up on a pod that was coming up."""
    with registered_not_listening(env, "slow"):
        waited = env.podctl("wait", "slow", "--timeout", "1")
    assert waited.returncode == 4, waited.stderr
    assert "is starting" in waited.stderr and "still starting after 1 s" in waited.stderr
    gone = env.podctl("wait", "slow", "--timeout", "1")  # its entry gone: not running
    assert gone.returncode == 3, gone.stderr


@contextlib.contextmanager
def restart_lock_held(env: Env, name: str) -> Iterator[None]:
    """As `podctl restart NAME` holds it from the stop to the start."""
    import filelock

    pod_dir = env.home / "run" / "pods" / name
    pod_dir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(pod_dir / "restart.lock")
    with lock:
        yield


def test_wait_waits_through_a_podctl_restart(env: Env) -> None:
    """`podctl wait` between the stop and the start of a `podctl restart` (no pod of that name
    registered) exited 3 and told to run `podctl wait`: a script's `podctl wait p || alert`
    alerted at every restart (found by QA)."""
    pod = env.start("rs")
    assert env.podctl("stop", "rs").returncode == 0
    with restart_lock_held(env, "rs"):
        waiting = env.podctl_popen("wait", "rs", "--timeout", "60")
        try:
            assert waiting.stderr is not None
            assert "is starting" in waiting.stderr.readline()  # (the old code: not running)
            env.restart(pod)
        except BaseException:
            waiting.kill()
            raise
    assert waiting.wait(60) == 0, waiting.stderr.read()


def _stopping(env: Env, name: str) -> tuple[PodProcess, "subprocess.Popen[str]", Path]:
    """Pod `name` held stopping: a Notification hook waits for a gate file (returned) and
    `podctl stop` (returned) waits for the hook."""
    gate = env.work / "gate"
    hook = env.home / "hold.sh"
    hook.write_text(f"#!/bin/sh\nwhile [ ! -e {gate} ]; do sleep 0.02; done\n")
    hook.chmod(0o755)
    pod = env.start(name, extra=f'[[hooks.Notification]]\ncommand = "{hook}"\n')
    assert env.podctl("notify", name, "hold the stop").returncode == 0
    stop = env.podctl_popen("stop", name)
    wait_until(lambda: pod.call("status")["state"] == "stopping", 20, "the pod to be stopping")
    return pod, stop, gate


def test_input_to_a_pod_shutting_down_is_not_running_not_an_error(env: Env) -> None:
    """`notify` and `send` to a pod that is stopping got -32004 with exit 1, which a script
    reads as "it may have taken it"; it took nothing: exit 3, as for a pod not running."""
    _, stop, gate = _stopping(env, "sd")
    try:
        for args in (["notify", "sd", "late"], ["send", "sd", "late"]):
            told = env.podctl(*args)
            assert told.returncode == 3, told.stderr
            assert "is shutting down and takes no input; nothing was sent" in told.stderr
    finally:
        gate.touch()
        assert stop.wait(60) == 0


def test_input_to_a_pod_podctl_restart_is_stopping_goes_to_the_pod_it_starts(env: Env) -> None:
    """The same during a `podctl restart`: the input waits for the pod it starts, as it waits
    for a unit that systemd restarts."""
    pod, stop, gate = _stopping(env, "sd")
    with restart_lock_held(env, "sd"):
        notify = env.podctl_popen("notify", "sd", "build 9 failed")
        try:
            gate.touch()
            assert stop.wait(60) == 0
            again = env.restart(pod)
        except BaseException:
            notify.kill()
            raise
    _, err = notify.communicate(timeout=60)
    assert notify.returncode == 0, err
    items = again.call("history", limit=1000)["entries"]
    assert [e["text"] for e in items if e["kind"] == "system_item"][-1] == "build 9 failed"


# --- item 18: exit codes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["send", "ghost", ""],
        ["send", "ghost", "  \n"],
        ["notify", "ghost", ""],
        # an empty --client-key ("$BUILD_ID" unset): no retry would be idempotent
        ["notify", "ghost", "hi", "--client-key", ""],
        ["send", "ghost", "hi", "--client-key="],
        ["send", "--no-such-option", "ghost", "hi"],
        ["history", "ghost", "--limit", "0"],
        ["history", "ghost", "--since", "-1"],
        ["attach", "ghost", "--since", "-1"],
        ["send"],
        # a name no pod can have (spawn refuses it): not "not running"
        ["status", "Ghost"],
        ["send", "bad name", "hi"],
        ["wait", "ghost", "--timeout", "-1"],
        ["dev", "fake-model", "--port", "99999"],
        # an empty manifest path (`"$MANIFEST"` unset): the pod read "." as the manifest
        ["spawn", ""],
        ["spawn", "", "--foreground"],
        ["unit", "install", ""],
    ],
    ids=" ".join,
)
def test_usage_errors_exit_2_before_looking_for_the_pod(env: Env, args: list[str]) -> None:
    proc = env.podctl(*args)
    assert proc.returncode == 2, proc.stderr
    assert "not running" not in proc.stderr


def test_a_warning_said_at_start_up_is_in_the_pods_log_too(env: Env) -> None:
    """`podctl spawn` shows start-up warnings; `podctl logs` shows them later as well (they
    were written before stderr moved to stderr.log, and were nowhere once spawn had ended)."""
    missing = env.work / "not-there-yet"
    path = env.manifest("warned", read=[str(missing)])
    spawn = env.podctl("spawn", str(path))
    assert spawn.returncode == 0, spawn.stderr
    assert f"{missing} does not exist" in spawn.stderr
    try:
        logs = env.podctl("logs", "warned")
        assert f"{missing} does not exist" in logs.stdout, logs.stdout
        assert logs.stdout.index("does not exist") < logs.stdout.index("ready on")
    finally:
        assert env.podctl("stop", "warned").returncode == 0


def test_notify_prints_the_id_alone_whatever_the_pod_was_doing(env: Env) -> None:
    """`nid=$(podctl notify pod msg)` in a script: the id, and nothing else, on stdout (an idle
    pod's '(woke the pod)' went there too)."""
    env.start("told")
    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}\n")
    env.model.script({"text": "noted", "gate": "busy"})
    idle = env.podctl("notify", "told", "first")  # wakes it: its turn waits on the gate
    env.model.wait_for_requests(1)
    busy = env.podctl("notify", "told", "second")
    env.model.open_gate("busy")
    assert uuid.fullmatch(idle.stdout) and idle.stderr == "(woke the pod)\n", idle
    assert uuid.fullmatch(busy.stdout) and busy.stderr == "", busy


def test_notify_and_send_with_a_client_key_are_taken_once(env: Env) -> None:
    """A cron job that may run twice: the socket had client_key, podctl did not. A keyed
    `send` retried after its run ended gets that run's reply (it waited for an event that had
    already gone)."""
    pod = env.start("keyed")
    env.model.script({"text": "the summary"})
    first = env.podctl("send", "keyed", "summarise", "--client-key", "nightly-1")
    again = env.podctl("send", "keyed", "summarise", "--client-key", "nightly-1", timeout=30)
    assert (first.returncode, first.stdout) == (0, "the summary\n"), first.stderr
    assert (again.returncode, again.stdout) == (0, "the summary\n"), again.stderr
    noted = [env.podctl("notify", "keyed", "built", "--client-key", "ci-481") for _ in range(2)]
    assert noted[0].returncode == 0 and noted[0].stdout == noted[1].stdout, noted
    clash = env.podctl("notify", "keyed", "other text", "--client-key", "ci-481")
    assert clash.returncode == 1 and "-32006" in clash.stderr, clash
    inputs = [e for e in pod.call("history", since=0)["entries"] if e["kind"] == "user_input"]
    items = [e for e in pod.call("history", since=0)["entries"] if e["kind"] == "system_item"]
    assert len(inputs) == 1 and [i["text"] for i in items] == ["built"]
    env.model.wait_for_requests(2)  # the run, then the turn the notification woke (once)
    assert len(env.model.requests) == 2


def test_keyed_send_retried_prints_every_round_as_the_first_did(env: Env) -> None:
    """A keyed `send` answered from the log (its run has ended) printed `run.finished`'s text,
    the last round's only: the first send streamed "looking" and "the summary", its retry "the
    summary". A first send did the same whenever its run ended before podctl had read the
    pod's log, which is every time for a pod of some 40,000 entries and a quick model."""
    env.model.script(
        {"text": "looking", "tool_calls": [{"name": "list_dir", "arguments": {}}]},
        {"text": "the summary"},
    )
    env.start("keyed")
    first = env.podctl("send", "keyed", "summarise", "--client-key", "nightly-1")
    again = env.podctl("send", "keyed", "summarise", "--client-key", "nightly-1", timeout=30)
    assert (first.returncode, first.stdout) == (0, "looking\nthe summary\n"), first.stderr
    assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, "")
    as_json = env.podctl("send", "keyed", "summarise", "--client-key", "nightly-1", "--json")
    assert json.loads(as_json.stdout)["text"] == "the summary"  # run.finished's, as ever


# podctl whose keyed `send` touches the file $JOINED once its `run` was answered (it has
# subscribed by then), then goes on as ever.
JOINED_MARK = (
    "import os; from cli import main, runs\n"
    "found = runs.run_end_in_log\n"
    "def marked(*args, **kwargs):\n"
    "    open(os.environ['JOINED'], 'a').close(); return found(*args, **kwargs)\n"
    "runs.run_end_in_log = marked; main.main()"
)


def test_keyed_send_retried_while_its_run_goes_on_prints_its_whole_reply(
    env: Env, tmp_path: Path
) -> None:
    """A keyed `send` retried while its run was under way (the first one Ctrl-C'd, or killed
    by a job's timeout, mid-answer) printed only what streamed after it subscribed: "the
    summary" without the "looking" said before, or a sentence's tail cut mid-word ("ive six
    seven"), exit 0, as if that were the reply. It prints the whole reply, as a retry of a
    run that has ended does."""
    env.model.script(
        {"text": "looking", "tool_calls": [{"name": "list_dir", "arguments": {}}]},
        {"text": "the summary", "gate": "g"},
    )
    env.start("keyed")
    first = env.podctl("send", "keyed", "summarise", "--client-key", "k", "--no-wait")
    assert first.returncode == 0, first
    env.model.wait_for_requests(2)  # "looking" is said and logged; the next round waits on g
    mark = tmp_path / "joined"
    retry = subprocess.Popen(
        [sys.executable, "-c", JOINED_MARK, "send", "keyed", "summarise", "--client-key", "k"],
        env={**env.env, "JOINED": str(mark)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(mark.exists, what="the retry to be answered")
        env.model.open_gate("g")
        out, err = retry.communicate(timeout=30)
    finally:
        retry.kill()
    assert (retry.returncode, out, err) == (0, "looking\nthe summary\n", "")


# podctl with Ctrl-C pressed while a keyed `send` reads the pod's log (after its run was
# taken), plain or (with "typer") through the typer app.
CTRL_C_IN_LOG = (
    "import os, signal, sys, time; from cli import main, plain, runs\n"
    "if sys.argv[1] == 'typer': plain.parse = lambda argv: None\n"
    "del sys.argv[1]\n"
    "def interrupted(*args, **kwargs):\n"
    "    os.kill(os.getpid(), signal.SIGINT); time.sleep(10)\n"
    "runs.run_end_in_log = interrupted; main.main()"
)


@pytest.mark.parametrize("way", ["plain", "typer"])
def test_ctrl_c_after_a_keyed_send_was_taken_says_its_run_goes_on(env: Env, way: str) -> None:
    """Ctrl-C while a keyed `send` read the pod's log (for a retry's reply: a third of a
    second for a pod of ~40,000 entries) came before `send`'s own handling: exit 130 and not a
    word, where it says which run was taken and goes on (podctl cancel)."""
    env.model.script({"text": "done", "gate": "g"})
    pod = env.start("taken")
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_LOG, way, "send", "taken", "hi", "--client-key", "k"],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 130 and done.stdout == "", done
    assert re.fullmatch(
        r"podctl: stopped waiting; run (\S+) goes on \(podctl cancel taken\)\n", done.stderr
    ), done.stderr
    env.model.open_gate("g")
    wait_until(lambda: pod.call("status")["state"] == "idle", what="the run to end")
    ends = [e for e in pod.call("history")["entries"] if e["kind"] == "run_end"]
    assert [(e["run_id"], e["outcome"]) for e in ends] == [(done.stderr.split()[4], "finished")]


@pytest.mark.parametrize(
    "args",
    [["send", "ghost", "hi"], ["notify", "ghost", "hi"], ["status", "ghost"], ["pause", "ghost"]],
    ids=" ".join,
)
def test_exit_status_holds_when_stderr_cannot_be_written(env: Env, args: list[str]) -> None:
    """A pod not running is exit 3 (SPEC §6) to a script that sends stderr to a full disk too:
    the message's write failed, and podctl exited 1 for that instead."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", *args],
            env=env.env,
            stdout=subprocess.PIPE,
            stderr=full,
            text=True,
            timeout=60,
        )
    assert (done.returncode, done.stdout) == (3, "")


def test_cancelled_run_exits_1_and_missing_pod_3(env: Env) -> None:
    env.start("talk")
    env.model.script({"gate": "hold", "text": "too late"})
    send = env.podctl_popen("send", "talk", "wait for it")
    try:
        env.model.wait_for_requests(1)
        cancelled = env.podctl("cancel", "talk")
        assert (cancelled.returncode, cancelled.stdout) == (0, "cancelled\n"), cancelled.stderr
        out, err = send.communicate(timeout=30)
        assert send.returncode == 1, (out, err)
        assert "cancelled" in err
    finally:
        env.model.open_gate("hold")
        if send.poll() is None:
            send.kill()
            send.wait()
    assert env.podctl("send", "ghost", "hi").returncode == 3


def test_send_steer_streams_the_reply_of_the_run_it_joins(env: Env) -> None:
    """`send` streams the reply and exits by the run's outcome (SPEC §6); `--steer` only
    chooses the mode (into the active run), `--no-wait` alone only submits."""
    pod = env.start("steer")
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "g"},
        {"text": "took the steer"},
    )
    with pod.client() as c:
        run = c.run("work")
    env.model.wait_for_requests(1)
    send = env.podctl_popen("send", "steer", "--steer", "be brief")
    try:
        wait_until(lambda: "be brief" in str(pod.call("history")), what="the steer")
        env.model.open_gate("g")
        out, err = send.communicate(timeout=30)
    finally:
        env.model.open_gate("g")
        if send.poll() is None:
            send.kill()
            send.wait()
    assert (send.returncode, out) == (0, "took the steer\n"), err
    assert "be brief" in str(env.model.requests[1]["body"])
    idle = env.podctl("send", "steer", "--steer", "hello", "--json")  # an idle pod: a new run
    assert idle.returncode == 0, idle.stderr
    finished = json.loads(idle.stdout)
    assert (finished["outcome"], finished["text"]) == ("finished", "ok: hello")
    assert finished["run_id"] != run.run_id
    submitted = env.podctl("send", "steer", "--steer", "--no-wait", "again")
    assert submitted.returncode == 0 and submitted.stdout.split()[1] == "started"


# --- item 20: the fake model prints the base_url each kind needs --------------------------------


def test_dev_fake_model_prints_working_base_urls(env: Env) -> None:
    script = env.home / "script.json"
    script.write_text(json.dumps({"replies": [{"text": "scripted hello"}]}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "dev", "fake-model", "--script", str(script)],
        env=env.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("fake model listening on http://127.0.0.1:")
        urls = {}
        for line in lines[1:]:
            found = re.search(r'base_url = "([^"]+)"', line)
            assert found, lines
            urls["anthropic" if '"anthropic"' in line else "openai"] = found.group(1)
        assert urls["openai"].endswith("/v1") and urls["openai"] == urls["anthropic"] + "/v1"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        request = urllib.request.Request(
            urls["openai"] + "/chat/completions",  # what the openai SDK appends to base_url
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            answer = json.loads(reply.read())
        assert answer["choices"][0]["message"]["content"] == "scripted hello"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""


def test_dev_fake_model_with_a_bad_script_exits_1(env: Env) -> None:
    script = env.home / "bad.json"
    script.write_text(json.dumps({"replies": [{"txt": "typo"}]}))
    proc = env.podctl("dev", "fake-model", "--script", str(script))
    assert proc.returncode == 1 and proc.stderr.startswith("podctl: ") and "txt" in proc.stderr


def test_dev_fake_model_on_a_taken_port_says_how_to_get_a_free_one(env: Env) -> None:
    """Found by QA: "Address already in use" alone; the option that avoids it went unsaid."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = env.podctl("dev", "fake-model", "--port", str(port))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"podctl: cannot listen on 127.0.0.1:{port}: ")
    assert proc.stderr.endswith("; --port 0 picks a free one\n"), proc.stderr


def test_spawn_of_a_fifo_says_at_once_that_the_pod_waits_for_a_writer(cleanup: Env) -> None:
    """`podctl spawn FIFO`: the pod reads it as `cat` does, so a spawn nobody writes the
    manifest for said nothing for 30 s; now it says why it waits, and one written goes on."""
    env = cleanup
    text = env.manifest("piped").read_text()
    fifo = env.home / "m.toml"
    os.mkfifo(fifo)
    spawn = env.podctl_popen("spawn", str(fifo))
    assert spawn.stderr is not None
    ready, _, _ = select.select([spawn.stderr], [], [], 20)
    assert ready, "podctl spawn said nothing while the pod waits for the FIFO"
    assert spawn.stderr.readline() == (
        f"podctl: {fifo} is a FIFO: the pod reads its manifest from whatever writes into it"
        " (waiting up to 30 s)\n"
    )
    fifo.write_text(text)  # (opening it waits for the pod to open it too)
    out, err = spawn.communicate(timeout=30)
    assert spawn.returncode == 0 and out.startswith("piped\t"), err
    assert env.podctl("stop", "piped").returncode == 0


def test_spawn_in_the_foreground_of_a_process_substitution_says_nothing_of_a_fifo(
    cleanup: Env,
) -> None:
    """`podctl spawn --foreground <(envsubst < m.toml)`: `/dev/fd/63` is a pipe too, which its
    shell writes; no word of waiting for a writer, which would only mislead."""
    env = cleanup
    manifest = env.manifest("subst")
    python = sys.executable  # (the shell's $0)
    spawn = subprocess.Popen(
        ["bash", "-c", f'exec "$0" -m cli.main spawn --foreground <(cat {manifest})', python],
        env=env.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert spawn.stderr is not None
        said = []
        while not (line := spawn.stderr.readline()).startswith("PODDAEMON-READY"):
            assert line, f"the pod ended before READY: {''.join(said)}"
            said.append(line)
        assert not any("FIFO" in line for line in said), said
    finally:
        spawn.terminate()
        spawn.wait(10)


# --- item 22: stop returns once the name and scope are free -------------------------------------


def test_a_pod_that_does_not_run_is_said_with_the_way_on(cleanup: Env) -> None:
    """Found by QA: "not running" alone, for a pod that ran here (`podctl restart` starts it
    again) and for a name mistyped (which one was meant)."""
    env = cleanup
    assert env.podctl("spawn", str(env.manifest("reviewer"))).returncode == 0
    assert env.podctl("stop", "reviewer").returncode == 0
    stopped = env.podctl("send", "reviewer", "hi")
    assert stopped.returncode == 3
    assert stopped.stderr.endswith(
        " (its configuration is kept: `podctl restart reviewer` starts it)\n"
    ), stopped.stderr
    typo = env.podctl("status", "reveiwer")
    assert typo.returncode == 3
    assert typo.stderr.endswith(" (did you mean 'reviewer'?)\n"), typo.stderr
    unknown = env.podctl("status", "zzz")
    assert unknown.stderr.endswith("/pods/zzz/sock\n"), unknown.stderr  # nothing close: as ever


def test_a_pod_whose_start_failed_is_not_said_to_have_run(cleanup: Env) -> None:
    """Found by QA: a spawn that failed at start-up (an MCP server's `${VAR}` unset) keeps
    the pod's configuration, and `podctl status` said "it ran here", of a pod that never ran.
    `podctl restart` starts that configuration: it fails the same way until the variable is
    set, then the pod runs."""
    env = cleanup
    hello = json.dumps([sys.executable, "-c", "pass"])
    extra = f'[[mcp.servers]]\nname = "s"\ncommand = {hello}\nenv = {{ T = "${{PODCTL_T}}" }}\n'
    failed = env.podctl("spawn", str(env.manifest("never", extra=extra)))
    assert failed.returncode != 0 and "${PODCTL_T} is not set" in failed.stderr, failed.stderr
    status = env.podctl("status", "never")
    assert status.returncode == 3
    assert "ran here" not in status.stderr, status.stderr
    assert status.stderr.endswith(
        " (its configuration is kept: `podctl restart never` starts it)\n"
    ), status.stderr
    again = env.podctl("restart", "never")
    assert again.returncode != 0 and "${PODCTL_T} is not set" in again.stderr, again.stderr
    env.env["PODCTL_T"] = "set"
    fixed = env.podctl("restart", "never")
    assert fixed.returncode == 0, fixed.stderr
    assert env.podctl("stop", "never").returncode == 0


def test_podctl_works_from_a_directory_removed_since(cleanup: Env) -> None:
    """Found by QA: from a shell whose directory was removed, `spawn` of an absolute manifest
    failed with a bare "No such file or directory" (so did `restart`), and `stop` of a pod
    not running exited 1 for it instead of 3."""
    env = cleanup
    manifest = env.manifest("homeless")
    gone = env.home / "gone"

    def podctl(*args: str) -> "subprocess.CompletedProcess[str]":
        gone.mkdir()
        script = f'cd "{gone}" && rmdir "{gone}" && exec "$0" -m cli.main "$@"'
        return subprocess.run(
            ["sh", "-c", script, sys.executable, *args],
            env=env.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    spawned = podctl("spawn", str(manifest))
    assert spawned.returncode == 0, spawned.stderr
    restarted = podctl("restart", "homeless")
    assert restarted.returncode == 0, restarted.stderr
    assert podctl("stop", "homeless").returncode == 0
    missing = podctl("stop", "homeless")
    assert missing.returncode == 3, missing.stderr
    assert "pod 'homeless' is not running" in missing.stderr


def test_stop_then_spawn_succeeds_every_time(cleanup: Env) -> None:
    env = cleanup
    manifest = env.manifest("again")
    registry = Registry(env.home / "run")
    for attempt in range(5):
        spawned = env.podctl("spawn", str(manifest))
        assert spawned.returncode == 0, f"attempt {attempt}: {spawned.stderr}"
        # Stop it right after a run starts (the SDK still importing, or the model request
        # blocked): teardown used to release the registry only after `stop` had returned.
        env.model.script({"gate": f"never-{attempt}", "text": "unused"})
        before = len(env.model.requests)  # counted first: a warm pod asks at once
        queued = env.podctl("send", "--no-wait", "again", "work")
        assert queued.returncode == 0, queued.stderr
        if attempt % 2:
            env.model.wait_for_requests(before + 1)
        pid = registry.get("again").pid  # type: ignore[union-attr]
        stopped = env.podctl("stop", "again")
        assert (stopped.returncode, stopped.stdout) == (0, "stopped again\n"), stopped.stderr
        assert registry.get("again") is None, f"attempt {attempt}: still registered after stop"
        # Stopped means ended: its last line is written (`stop && logs` missed it).
        assert not alive(pid), f"attempt {attempt}: pid {pid} still running after stop"
        last = env.podctl("logs", "again").stdout.splitlines()[-1]
        assert last.endswith("shut down"), last
    assert env.podctl("spawn", str(manifest)).returncode == 0
    assert env.podctl("stop", "again").returncode == 0


# --- item 21: no escape codes into a pipe -------------------------------------------------------


def test_demo_prints_no_escape_codes_into_a_pipe(tmp_path: Path) -> None:
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("PODDAEMON_")}
    clean_env.pop("NO_COLOR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "poddaemon.demo"],
        cwd=ROOT,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    home = re.search(r"`rm -rf (\S+)`", proc.stdout)
    if home:
        shutil.rmtree(home.group(1), ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== spawn the pod" in proc.stdout and "[x] review the README" in proc.stdout
    assert "\x1b" not in proc.stdout + proc.stderr
    # The commands it shows run as shown when pasted (the message was shown unquoted).
    assert "$ podctl send demo 'Tick off the README review in TODO.md.'\n" in proc.stdout


def alive(pid: int) -> bool:
    """The process runs its own code: not a zombie waiting for its reaper, nor one the kernel
    is tearing down (PF_EXITING: its last line is written, its files about to be closed; a big
    process takes milliseconds to unmap, and `stop` returned within them, 1 run in ~15)."""
    return process_start_time(pid) is not None


def test_an_interrupted_demo_stops_its_pod(tmp_path: Path) -> None:
    """Ctrl-C in `make demo` once its pod runs: the pod is stopped, not left running in a
    throwaway home the user was never told of (it was, with a traceback)."""
    from poddaemon.registry import Registry

    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("PODDAEMON_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "poddaemon.demo"],
        cwd=ROOT,
        env=clean_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: SIGINT to it is a terminal's Ctrl-C
    )
    home: Path | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            found = re.match(r"\$ podctl spawn (/\S+)/demo/pod\.toml", line)
            if found:
                home = Path(found.group(1))
            if line.startswith("$ podctl ls"):  # the spawn returned: the pod is running
                break
        assert home is not None
        pod_pid = int((home / "run" / "pods" / "demo" / "pid").read_text())
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert Registry(home / "run").live() == [], out + err  # its claim released: stopped
        assert not (home / "run" / "pods" / "demo" / "sock").exists()
        wait_until(lambda: not alive(pod_pid), 10, "the pod process to end")
        assert proc.returncode == 130, out + err
        assert "Traceback" not in err, err
        assert f"`rm -rf {home}`" in out  # where its files are, as after a whole run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if home is not None:
            kill_leftover_pods(home)
            shutil.rmtree(home, ignore_errors=True)


def test_spawn_warns_about_a_base_url_that_cannot_be_right(cleanup: Env) -> None:
    env = cleanup
    manifest = env.manifest("root")
    text = manifest.read_text().replace(env.model.openai_base_url, env.model.url)
    manifest.write_text(text)  # the fake model's root: openai kinds need /v1
    spawned = env.podctl("spawn", str(manifest))
    assert spawned.returncode == 0, spawned.stderr  # a warning, not a failure
    assert f"use '{env.model.openai_base_url}'" in spawned.stderr
    assert spawned.stderr.count(f"use '{env.model.openai_base_url}'") == 1  # said once
    from protocol import PodClient

    with PodClient.connect("root", timeout=10) as client:  # the same warning as an alert
        client.subscribe(0)
        alert = next(e for e in client.events() if e.type == "alert")
    assert alert.data["level"] == "warning" and "/v1" in alert.data["message"]
    assert env.podctl("stop", "root").returncode == 0


# --- restart: a pod that could not start again is not stopped -------------------------------


def test_restart_without_the_api_key_leaves_the_pod_running(env: Env) -> None:
    """`podctl restart` starts the pod with its own shell's environment. When the provider's key
    variable is missing there (the quick start sets it only for `spawn`), it used to stop the pod
    and then fail to start it: the restart must refuse before stopping anything."""
    pod = env.start("keep")
    without_key = {k: v for k, v in env.env.items() if k != "FAKE_API_KEY"}
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "restart", "keep"],
        env=without_key,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "FAKE_API_KEY" in out.stderr and "left running" in out.stderr
    assert out.stderr.count("\n") == 1  # one line
    assert pod.proc.poll() is None and pod.call("status")["pid"] == pod.proc.pid
    again = env.podctl("restart", "keep")  # with the key: stopped and started again
    assert again.returncode == 0, again.stderr
    assert pod.proc.wait(20) == 0


def test_restart_with_a_corrupt_registry_leaves_the_pod_running(env: Env) -> None:
    """pods.json corrupt: no pod can register, so a restart stopped the pod and then failed to
    start it ("corrupt pod registry"), leaving nothing running. It is refused before the stop,
    as a missing API key is."""
    pod = env.start("keep")
    registry = env.home / "run" / "pods.json"
    good = registry.read_bytes()
    registry.write_text("garbage")
    try:
        out = env.podctl("restart", "keep")
    finally:
        registry.write_bytes(good)
    assert out.returncode == 1, out.stderr
    (line,) = out.stderr.splitlines()
    assert "left running" in line and "corrupt pod registry" in line
    assert pod.proc.poll() is None and pod.call("status")["pid"] == pod.proc.pid


def test_restarts_of_one_pod_at_once_all_succeed_and_leave_one_pod(cleanup: Env) -> None:
    """Restarts of one pod at once, by name and by socket path: three of four said it was not
    running (exit 3) while the fourth restarted it. They take turns now."""
    env = cleanup
    sock = env.start("busy").socket
    restarts = [env.podctl_popen("restart", target) for target in ("busy", sock) * 3]
    results = [(p.wait(60), *p.communicate()) for p in restarts]
    assert [code for code, _, _ in results] == [0] * 6, results
    # Stopped, its runtime dir gone (a reboot empties it), its kept configuration left:
    # restarts at once still take turns (the lock lives in that dir, which is made again).
    assert env.podctl("stop", "busy").returncode == 0
    shutil.rmtree(env.home / "run" / "pods" / "busy")
    restarts = [env.podctl_popen("restart", "busy") for _ in range(4)]
    results = [(p.wait(60), *p.communicate()) for p in restarts]
    assert [code for code, _, _ in results] == [0] * 4, results
    live = Registry(env.home / "run").get("busy")
    assert live is not None
    assert all(out.splitlines()[-1] == f"busy\t{live.socket}" for _, out, _ in results), results
    assert env.podctl("status", "busy", "--json").returncode == 0
    assert [e.name for e in Registry(env.home / "run").live()] == ["busy"]
    assert env.podctl("stop", "busy").returncode == 0


def test_ctrl_c_while_a_restarted_pod_starts_says_it_is_left_stopped(env: Env) -> None:
    """Ctrl-C once `podctl restart` had stopped the pod and was starting it again: the start
    was undone and podctl ended with a silent 130 after "stopped NAME", as if cut short
    before the stop. It says the pod is left stopped, and how to start it."""
    flag, starting = env.work / "slow-start", env.work / "starting"
    hook = f"if [ -e {flag} ]; then touch {starting}; sleep 60; fi"
    pod = env.start("again", extra=f"[[hooks.SessionStart]]\ncommand = {json.dumps(hook)}\n")
    flag.touch()  # the restarted pod waits in its SessionStart hook
    proc = env.podctl_popen("restart", "again")
    try:
        wait_until(lambda: proc.poll() is not None or starting.exists(), 30, "the new start")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert pod.proc.wait(10) == 0  # stopped by the restart
    assert (proc.returncode, out) == (130, "stopped again\n"), err
    assert err.splitlines()[-1:] == [
        "podctl: interrupted: pod 'again' was stopped and not started again (podctl restart again)"
    ]
    assert env.podctl("status", "again").returncode == 3


def _podctl_into(env: Env, stdout: int, *args: str) -> "subprocess.CompletedProcess[str]":
    """`podctl ARGS` with its stdout on the descriptor `stdout` (a full disk, a pipe whose
    reader went)."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env=env.env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )


def test_restart_whose_stdout_fails_still_starts_the_pod_again(env: Env) -> None:
    """`podctl restart p >/dev/full` (or into a pipe whose reader went): "stopped p" could not
    be written, and that error ended the restart between its stop and its start, leaving
    the pod stopped. The output's failure is said (status 1); the pod runs again."""
    pod = env.start("again")
    read_end, write_end = os.pipe()
    os.close(read_end)  # `podctl restart again | true`
    try:
        with open("/dev/full", "w") as full:
            for stdout in (full.fileno(), write_end):
                done = _podctl_into(env, stdout, "restart", "again")
                assert done.returncode == 1, done.stderr
                assert env.podctl("status", "again").returncode == 0, done.stderr
    finally:
        os.close(write_end)
    assert pod.proc.wait(10) == 0
    assert env.podctl("stop", "again").returncode == 0


def test_spawn_whose_stdout_fails_says_the_pod_runs(env: Env) -> None:
    """`podctl spawn p.toml >/dev/full`: "No space left on device", exit 1, read as a start
    that failed, while the pod ran (a retry then fails on its name). It says the pod runs."""
    manifest = env.manifest("full")
    try:
        with open("/dev/full", "w") as full:
            done = _podctl_into(env, full.fileno(), "spawn", str(manifest))
        assert (done.returncode, done.stderr) == (
            1,
            "podctl: cannot write the output: No space left on device; pod 'full' was started "
            "and runs (podctl stop full)\n",
        )
        assert env.podctl("status", "full").returncode == 0
    finally:
        env.podctl("stop", "full")


def test_restart_of_a_name_never_run_leaves_nothing_behind(env: Env) -> None:
    """`podctl restart nope` says it is not running (exit 3); it left a `restart-nope.lock`
    in the runtime dir, one per name ever tried."""
    runtime = env.home / "run"
    before = set(runtime.iterdir()) if runtime.exists() else set()
    out = env.podctl("restart", "nope")
    assert out.returncode == 3 and "not running" in out.stderr, out.stderr
    assert set(runtime.iterdir()) == before if runtime.exists() else not before


def test_send_to_a_paused_pod_says_why_it_waits(env: Env) -> None:
    """A paused pod starts nothing: `podctl send` and `podctl wait` wait for a resume, and
    say so at once instead of hanging silently; the run's answer comes once it is resumed."""
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "g"},
        {"text": "first done"},
        {"text": "second done"},
    )
    pod = env.start("held")
    with pod.client() as c:
        c.run("first")
        env.model.wait_for_requests(1)
        assert c.pause().paused
        env.model.open_gate("g")
        wait_until(lambda: c.status().state == "paused", what="the pod paused")
    send = env.podctl_popen("send", "held", "second")
    assert send.stderr is not None
    ready, _, _ = select.select([send.stderr], [], [], 20)
    assert ready, "podctl send said nothing while it waits"
    note = send.stderr.readline()
    assert note == (
        "podctl: pod 'held' is paused: the run waits for `podctl resume held`"
        " (or a cancel of the paused run)\n"
    )
    wait = env.podctl("wait", "held", "--timeout", "0.3")  # as quick to say so
    assert wait.returncode == 4, wait.stderr
    assert wait.stderr.startswith("podctl: pod 'held' is paused: it is idle once resumed")
    with pod.client() as c:
        c.resume()
    out, _ = send.communicate(timeout=30)
    assert send.returncode == 0 and out == "second done\n"


def test_keyed_send_retried_after_its_run_ended_does_not_say_it_waits(env: Env) -> None:
    """A keyed `send` is answered as the first time, `queued` for a run that was queued then,
    however long ago it ended: retried while the pod is paused (by a later run), it printed
    the old run's reply *and* "the run waits for `podctl resume`", which it never would."""
    env.model.script_when("busy", {"text": "busy done", "gate": "g1"})
    env.model.script_when("nightly", {"text": "the summary"})
    env.model.script_when(
        "later", {"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "g2"}
    )
    pod = env.start("held")
    with pod.client() as c:
        c.run("busy")
        env.model.wait_for_requests(1)
        first = env.podctl("send", "held", "nightly", "--client-key", "k", "--no-wait")
        assert first.returncode == 0 and first.stdout.endswith(" queued\n"), first
        env.model.open_gate("g1")
        wait_until(lambda: c.status().state == "idle", what="both runs to end")
        c.run("later")
        env.model.wait_for_requests(3)
        assert c.pause().paused
        env.model.open_gate("g2")
        wait_until(lambda: c.status().state == "paused", what="the pod paused")
    again = env.podctl("send", "held", "nightly", "--client-key", "k", timeout=30)
    assert (again.returncode, again.stdout, again.stderr) == (0, "the summary\n", "")


def test_wait_on_a_pod_out_of_budget_says_why_its_queue_does_not_empty(env: Env) -> None:
    """A pod with no budget left takes a notification and starts no run for it: `podctl wait`
    waited forever, and at its timeout said the pod was "still idle", what it waits for."""
    env.model.script({"text": "spent", "usage": {"input": 100, "output": 10}})
    pod = env.start("broke", extra="[budget]\nmax_total_tokens = 50\n")
    with pod.client() as c:
        assert c.run_wait("spend it").outcome == "finished"
        c.notify("anyone there?", source="ops")
    status = json.loads(env.podctl("status", "broke", "--json").stdout)
    assert status["budget"] == {"limit": 50, "spent": 110, "tree_spent": 110, "left": 0}
    wait = env.podctl("wait", "broke", "--timeout", "0.3")
    assert wait.returncode == 4, wait.stderr
    assert wait.stderr == (
        "podctl: pod 'broke' has no token budget left (budget.max_total_tokens = 50): its "
        "queued inputs wait until a child's unused grant comes back, or until it restarts "
        "with a larger budget\n"
        "podctl: pod 'broke' still idle with 1 input queued after 0.3 s\n"
    )


def test_send_starts_each_model_rounds_text_on_a_line_of_its_own(env: Env) -> None:
    """Text before a tool call and the answer after it are two messages, not one run-on line."""
    env.start("rounds")
    env.model.script(
        {"text": "Let me look.", "tool_calls": [{"name": "list_dir", "arguments": {}}]},
        {"text": "Found it."},
    )
    out = env.podctl("send", "rounds", "where is it?")
    assert (out.returncode, out.stdout) == (0, "Let me look.\nFound it.\n"), out.stderr


def test_send_says_on_stderr_that_the_model_call_is_retried(env: Env) -> None:
    """A provider that fails and is retried does not leave `send` silent, as if hung; the
    reply on stdout stays only the model's text."""
    env.start("retries")
    env.model.script(
        {"fault": {"kind": "status", "status": 503, "retry_after": 0.05}},
        {"text": "made it"},
    )
    out = env.podctl("send", "retries", "try hard")
    assert (out.returncode, out.stdout) == (0, "made it\n"), out.stderr
    assert re.search(r"^podctl: model call failed; retry #1 in \d+\.\ds: .*503", out.stderr, re.M)


def test_send_says_which_limit_the_run_reached(env: Env) -> None:
    """`podctl send` exits 2 on `limit_reached` and says which limit it was (max_turns here,
    the budget elsewhere), as it says an error's message: "reached its limit" alone left the
    user to look for it in `podctl history`."""
    env.model.script(*[{"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}] * 3)
    env.start("limited", "--set", "worker.max_turns=2")
    result = env.podctl("send", "limited", "loop")
    assert result.returncode == 2, result.stderr
    assert "reached its limit: reached max_turns (2)" in result.stderr, result.stderr


def test_send_shows_the_answers_escape_sequences_to_a_terminal_and_passes_them_to_a_pipe(
    env: Env,
) -> None:
    """A file the model read can make it echo an escape sequence (OSC 52 writes the clipboard):
    to a terminal, `podctl send` shows control characters as \\xNN; to a pipe, the answer is
    verbatim (it is data)."""
    import pty

    answer = "look \x1b]52;c;ZWNobyBwd25lZA==\x07 here\n"
    env.model.script({"text": answer}, {"text": answer})
    env.start("esc")
    piped = env.podctl("send", "esc", "go")
    assert piped.returncode == 0 and piped.stdout == answer, piped
    main, tty = pty.openpty()
    with subprocess.Popen(
        [sys.executable, "-m", "cli.main", "send", "esc", "again"],
        env=env.env,
        stdout=tty,
        stderr=subprocess.PIPE,
    ) as proc:
        os.close(tty)
        shown = b""
        with contextlib.suppress(OSError):  # EIO once podctl has exited
            while chunk := os.read(main, 4096):
                shown += chunk
        assert proc.wait(30) == 0
    os.close(main)
    assert b"\x1b" not in shown and b"look \\x1b]52;c;ZWNobyBwd25lZA==\\x07 here" in shown, shown


def test_a_relative_poddaemon_home_reaches_the_pods_hooks_as_the_same_home(
    cleanup: Env,
) -> None:
    """`PODDAEMON_HOME=pd… podctl spawn`: the pod's hooks (and commands) run in its pwd and
    inherit the variable. Left relative, `podctl status` from a hook looked under <pwd>/pd…
    and said its own pod was not running."""
    env = cleanup
    out = env.work / "hook.out"
    podctl = f"{shlex.quote(sys.executable)} -m cli.main"
    path = env.manifest(
        "rel",
        extra=(
            "[sandbox]\nmode = 'off'\n[[hooks.UserPromptSubmit]]\n"
            f"command = {json.dumps(f'{podctl} status rel > {out} 2>&1')}\n"
        ),
    )
    relative = {**env.env, "PODDAEMON_HOME": env.home.name}

    def podctl_here(*args: str) -> "subprocess.CompletedProcess[str]":
        return subprocess.run(
            [sys.executable, "-m", "cli.main", *args],
            env=relative,
            cwd=env.home.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )

    spawn = podctl_here("spawn", str(path))
    assert spawn.returncode == 0, spawn.stderr
    send = podctl_here("send", "rel", "hi")
    assert send.returncode == 0, send.stderr
    assert "state:" in out.read_text() and "not running" not in out.read_text()
    assert podctl_here("stop", "rel").returncode == 0


def test_spawn_terminated_while_waiting_stops_the_pod_it_started(cleanup: Env) -> None:
    """`timeout 10 podctl spawn m.toml`, a cancelled CI job: SIGTERM to podctl while its pod
    starts. podctl died on the spot, and the pod (a session of its own) went on starting for
    nobody; from a FIFO manifest nobody writes, it waited for ever."""
    env = cleanup
    fifo = env.home / "nobody-writes.toml"
    os.mkfifo(fifo)

    def starting() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                args = (proc / "cmdline").read_bytes().split(b"\0")
                if proc.name.isdigit() and str(fifo).encode() in args and b"run" in args:
                    found.append(int(proc.name))
        return found

    spawn = env.podctl_popen("spawn", str(fifo))
    try:
        wait_until(starting, what="the pod started by podctl spawn")
        spawn.send_signal(signal.SIGTERM)
        assert spawn.wait(15) == 128 + signal.SIGTERM
        wait_until(lambda: not starting(), what="the pod gone with podctl")
    finally:
        spawn.kill()
        for pid in starting():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_pause_says_pausing_until_the_run_stops_then_paused(env: Env) -> None:
    """The pause reply's one bool is true for a pod paused already too: `podctl pause` of a
    paused pod said "pausing", as if it had yet to stop. It asks the pod's state now."""
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "g"},
        {"text": "done"},
    )
    pod = env.start("held")
    assert env.podctl("pause", "held").stdout == "nothing to pause\n"
    pod.call("run", input="go")
    env.model.wait_for_requests(1)
    first = env.podctl("pause", "held")  # the run is in its model call: not at a safe point yet
    assert (first.returncode, first.stdout) == (0, "pausing\n"), first.stderr
    env.model.open_gate("g")
    wait_until(lambda: pod.call("status")["state"] == "paused", what="the pod paused")
    again = env.podctl("pause", "held")
    assert (again.returncode, again.stdout) == (0, "paused\n"), again.stderr
    pod.call("resume")
    drained(pod)


def test_history_of_a_stopped_pod_points_at_its_sessions_on_disk(env: Env) -> None:
    """`podctl history` of a stopped pod said "not running" alone (found by QA), where its
    sessions are all on disk and `podctl sessions` reads them."""
    pod = env.start("gone")
    assert pod.call("run", input="remember this", wait=True)["outcome"] == "finished"
    sid = pod.call("status")["session_id"]
    assert pod.stop() == 0
    asked = env.podctl("history", "gone")
    assert asked.returncode == 3, asked.stderr
    assert asked.stderr.endswith(
        "; its sessions are on disk: podctl sessions list gone, podctl sessions show ID\n"
    ), asked.stderr
    listed = env.podctl("sessions", "list", "gone")
    assert listed.returncode == 0 and sid in listed.stdout, listed
    shown = env.podctl("sessions", "show", sid)
    assert shown.returncode == 0 and "remember this" in shown.stdout, shown
