"""Issue 4: durable sessions. Real pod processes killed with SIGKILL at chosen points, then
restored (`--resume` or `--session ID`): nothing acknowledged is lost, every tool call gets a
result, the interrupted run ends once and says so, and the log verifies. Plus damaged logs
(torn tail, flipped byte), a second writer (fork), a restored pause, a session held by a live
pod, and history/usage/sessions over the socket and through podctl."""

import contextlib
import json
import os
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from poddaemon.machine import HELD_RESTART_NOTE, MAX_TAKEN_UP_IN_ROW, RESTART_NOTE
from poddaemon.podlog import POWER_CUT_ENV
from poddaemon.store.file import SessionLog, read_session
from poddaemon.store.log import GENESIS, encode_entry, new_session_id
from poddaemon.turn import INTERRUPTED, INTERRUPTED_COMMAND
from protocol.errors import ConnectionClosed
from tests.conftest import (
    PAUSABLE,
    Env,
    PodProcess,
    StartFailed,
    collect_run,
    paused_at_a_safe_point,
    wait_until,
)

REPS = range(3)


# --- helpers ------------------------------------------------------------------------------------


def sessions_dir(env: Env) -> Path:
    return env.home / "data" / "sessions"


def all_history(pod: PodProcess, page: int = 7) -> list[dict[str, Any]]:
    """Every entry of the pod's session, fetched in pages through `since`/`next`."""
    out: list[dict[str, Any]] = []
    since = 0
    while True:
        result = pod.call("history", since=since, limit=page)
        if not result["entries"]:
            assert result["next"] == since
            return out
        out += result["entries"]
        assert result["next"] == result["entries"][-1]["seq"]
        since = result["next"]


def settled(pod: PodProcess) -> bool:
    """Idle with nothing acknowledged still waiting (no queued run, no pending notification)."""
    s = pod.call("status")
    return s["state"] == "idle" and s["queue"] == {"runs": 0, "notifications": 0}


def requests_since(env: Env, n: int) -> str:
    return "\n".join(str(r["body"]) for r in env.model.requests[n:])


def check_pairing(entries: list[dict[str, Any]]) -> None:
    """Every tool call of an `assistant` entry has exactly one `tool_result`, before the next
    `assistant` entry; no result answers an unknown call."""
    open_ids: list[str] = []
    seen: set[str] = set()
    for e in entries:
        if e["kind"] == "session_start":  # a fork starts with the calls still open in it
            open_ids = [c["id"] for c in e.get("open_calls", [])]
        elif e["kind"] == "assistant":
            assert not open_ids, f"seq {e['seq']}: calls {open_ids} have no result"
            open_ids = [c["id"] for c in e["item"].get("tool_calls", [])]
        elif e["kind"] == "tool_result":
            cid = e["item"]["call_id"]
            assert cid in open_ids, f"seq {e['seq']}: result for unknown or answered call {cid}"
            assert cid not in seen
            seen.add(cid)
            open_ids.remove(cid)
    assert not open_ids, f"calls {open_ids} have no result"


def check_runs_end_once(entries: list[dict[str, Any]]) -> None:
    started = [e["run_id"] for e in entries if e["kind"] == "run_start"]
    ended = [e["run_id"] for e in entries if e["kind"] == "run_end"]
    queued = [e["run_id"] for e in entries if e["kind"] == "user_input" and e["mode"] == "queue"]
    for run_id in set(started) | set(queued):
        assert ended.count(run_id) >= 1, f"run {run_id} never ended"
    # A paused run ends once per time it ran; otherwise exactly once.
    for run_id in set(ended):
        outcomes = [
            e["outcome"] for e in entries if e["kind"] == "run_end" and e["run_id"] == run_id
        ]
        assert all(o == "paused" for o in outcomes[:-1]), (run_id, outcomes)


def verify_ok(env: Env, session_id: str) -> None:
    result = env.podctl("sessions", "verify", session_id)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")


def restart(env: Env, pod: PodProcess, how: str, session_id: str) -> PodProcess:
    args = ("--resume",) if how == "resume" else ("--session", session_id)
    return env.restart(pod, *args)


def check_restored(
    env: Env,
    pod: PodProcess,
    session_id: str,
    *,
    runs: dict[str, str],
    notes: tuple[str, ...] = (),
    interrupted: str | None,
    before: int,
) -> list[dict[str, Any]]:
    """After a restore: every acknowledged input is in the log and reached the model, the log
    pairs calls with results, the interrupted run ended once with `interrupted: true`."""
    wait_until(lambda: settled(pod), what="the restored pod to process what was pending")
    status = pod.call("status")
    assert status["session_id"] == session_id
    entries = all_history(pod)
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    inputs = {
        e["run_id"]: e["text"]
        for e in entries
        if e["kind"] == "user_input" and e["mode"] == "queue"
    }
    for run_id, text in runs.items():
        assert inputs.get(run_id) == text, f"acknowledged run {run_id} ({text!r}) missing"
    items = [e["text"] for e in entries if e["kind"] == "system_item"]
    for text in notes:
        assert text in items, f"acknowledged notification {text!r} missing"
    # Each acknowledged input reached the model (before the crash, or after the restore).
    every_request = requests_since(env, 0)
    for text in [*runs.values(), *notes]:
        assert text in every_request, f"{text!r} never reached the model"
    check_pairing(entries)
    check_runs_end_once(entries)
    for run_id in runs:
        assert any(e["kind"] == "run_end" and e["run_id"] == run_id for e in entries)
    if interrupted is not None:
        ends = [e for e in entries if e["kind"] == "run_end" and e["run_id"] == interrupted]
        assert len(ends) == 1 and ends[0]["interrupted"] is True, ends
        assert ends[0]["outcome"] == "error"
        # The restored pod told the model, and the model was asked again after the restart.
        after = requests_since(env, before)
        assert "The pod restarted" in after
    verify_ok(env, session_id)
    return entries


@contextlib.contextmanager
def reap_group(pidfile: Path) -> Iterator[None]:
    """Kill the process group whose leader's pid the tool command wrote (a SIGKILLed pod
    cannot kill the `bash` tool's own process group)."""
    try:
        yield
    finally:
        if pidfile.exists() and pidfile.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pidfile.read_text()), signal.SIGKILL)


def how_for(rep: int) -> str:
    return "session" if rep == 2 else "resume"


# --- kill -9 at chosen points -------------------------------------------------------------------


@pytest.mark.parametrize("rep", REPS)
def test_kill_mid_stream(env: Env, rep: int) -> None:
    env.model.script({"text": "never delivered", "gate": "hold"})
    pod = env.start("streamer")
    text = f"mid-stream input {rep}"
    with pod.client() as c:
        run = c.run(text)
        env.model.wait_for_requests(1)
        sid = c.status().session_id
    assert sid
    pod.kill9()
    before = len(env.model.requests)
    again = restart(env, pod, how_for(rep), sid)
    entries = check_restored(
        env, again, sid, runs={run.run_id: text}, interrupted=run.run_id, before=before
    )
    # The restored context carries the interrupted input to the model again.
    assert text in requests_since(env, before)
    assert not [e for e in entries if e["kind"] == "assistant" and e["run_id"] == run.run_id]


def test_a_graceful_stop_mid_run_is_picked_up_like_a_crash(env: Env) -> None:
    """`systemctl restart` / `podctl restart` stop the pod cleanly: the run it cut short was
    acknowledged, so the next start tells the model and goes on, as after kill -9."""
    env.model.script({"text": "never delivered", "gate": "hold"})
    pod = env.start("stopped")
    text = "work cut short by a stop"
    with pod.client() as c:
        run = c.run(text)
        env.model.wait_for_requests(1)
        sid = c.status().session_id
    assert sid and pod.stop() == 0
    before = len(env.model.requests)
    again = restart(env, pod, "resume", sid)
    check_restored(env, again, sid, runs={run.run_id: text}, interrupted=run.run_id, before=before)
    assert text in requests_since(env, before)


def test_a_pod_killed_in_every_run_stops_taking_the_work_up_by_itself(env: Env) -> None:
    """A run that crashes the pod each time (a command that takes all the memory) under
    `Restart=on-failure`: each start takes the cut-off work up again and spends a model call
    no usage entry ever counts. After MAX_TAKEN_UP_IN_ROW the note waits for the next input."""
    env.model.script(*[{"text": "never delivered", "gate": "hold"}] * (MAX_TAKEN_UP_IN_ROW + 1))
    pod = env.start("looping")
    with pod.client() as c:
        c.run("work that kills the pod")
        sid = c.status().session_id
    for n in range(1, MAX_TAKEN_UP_IN_ROW + 1):
        env.model.wait_for_requests(n)  # the call in flight when the pod dies
        pod.kill9()
        pod = restart(env, pod, "resume", sid)
    env.model.wait_for_requests(MAX_TAKEN_UP_IN_ROW + 1)
    pod.kill9()
    pod = restart(env, pod, "resume", sid)
    wait_until(lambda: "runs in a row were cut off" in pod.text(), what="the alert")
    (note,) = [e for e in all_history(pod) if e["kind"] == "system_item"][-1:]
    held = HELD_RESTART_NOTE.format(in_row=MAX_TAKEN_UP_IN_ROW + 1)
    assert note["text"] == held and note["context"] is True  # it wakes nothing
    assert pod.call("status")["state"] == "idle"
    before = len(env.model.requests)
    env.model.script({"text": "looked"})
    assert pod.call("run", input="look at it again", wait=True)["text"] == "looked"
    (request,) = env.model.requests[before:]  # no run of its own: it came with the input
    assert held in str(request["body"]) and "look at it again" in str(request["body"])
    verify_ok(env, sid)


def test_a_crash_loop_stops_though_every_start_forks_the_session(env: Env) -> None:
    """An instruction that renders `now` differs at every start, so every restore continues in
    a fork. The fork started the count of runs cut off in a row again: the loop never ended."""
    env.model.script(*[{"text": "never delivered", "gate": "hold"}] * (MAX_TAKEN_UP_IN_ROW + 1))
    pod = env.start("forkloop", instruction="It is {{ now }}.")
    with pod.client() as c:
        c.run("work that kills the pod")
    sessions = set()
    for n in range(1, MAX_TAKEN_UP_IN_ROW + 2):
        env.model.wait_for_requests(n)  # the call in flight when the pod dies
        pod.kill9()
        pod = env.restart(pod, "--resume")
        sessions.add(pod.call("status")["session_id"])
    assert len(sessions) == MAX_TAKEN_UP_IN_ROW + 1  # a fork at each start
    wait_until(lambda: "runs in a row were cut off" in pod.text(), what="the alert")
    assert pod.call("status")["state"] == "idle"
    assert len(env.model.requests) == MAX_TAKEN_UP_IN_ROW + 1
    for sid in sessions:
        verify_ok(env, sid)


@pytest.mark.parametrize("rep", REPS)
def test_kill_mid_tool(env: Env, rep: int) -> None:
    pidfile = env.work / "tool.pid"
    command = f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 300"
    env.model.script(
        {
            "tool_calls": [
                {"name": "bash", "arguments": {"command": command}},
                {"name": "read_file", "arguments": {"path": "never-read.txt"}},
            ]
        }
    )
    pod = env.start("tooler", tools=["bash", "read_file"])
    text = f"mid-tool input {rep}"
    with reap_group(pidfile):
        with pod.client() as c:
            c.subscribe()
            run = c.run(text)
            started = next(e for e in c.events() if e.type == "tool.started")
            wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="bash")
            sid = c.status().session_id
        pod.kill9()
        before = len(env.model.requests)
        again = restart(env, pod, how_for(rep), sid)
        entries = check_restored(
            env, again, sid, runs={run.run_id: text}, interrupted=run.run_id, before=before
        )
    # Both calls of the batch (the one running and the one never started) are closed.
    (assistant,) = [e for e in entries if e["kind"] == "assistant" and e["run_id"] == run.run_id]
    call_ids = [c["id"] for c in assistant["item"]["tool_calls"]]
    assert call_ids[0] == started.data["call_id"] and len(call_ids) == 2
    results = [e for e in entries if e["kind"] == "tool_result"]
    assert [r["item"]["call_id"] for r in results] == call_ids  # and no others
    for r, said in zip(results, (INTERRUPTED_COMMAND, INTERRUPTED), strict=True):
        assert r["item"]["output"] == said and r["item"]["is_error"]
    # The synthetic results sit before the run's end, and the model saw them after the restart.
    end = next(e for e in entries if e["kind"] == "run_end" and e["run_id"] == run.run_id)
    assert results[-1]["seq"] < end["seq"]
    assert INTERRUPTED in requests_since(env, before)


@pytest.mark.parametrize("rep", REPS)
def test_kill_right_after_run_ack(env: Env, rep: int) -> None:
    pod = env.start("acker")
    with pod.client() as c:
        c.run_wait("warm up")  # the session exists before the crash
        sid = c.status().session_id
        text = f"acknowledged run {rep}"
        run = c.run(text, client_key=f"key-{rep}")
        pod.kill9()
    before = len(env.model.requests)
    again = restart(env, pod, how_for(rep), sid)
    entries = check_restored(
        env, again, sid, runs={run.run_id: text}, interrupted=None, before=before
    )
    # Whether it ran before the crash, was interrupted, or ran after the restore: it ended
    # once, and if it was interrupted it says so.
    ends = [e for e in entries if e["kind"] == "run_end" and e["run_id"] == run.run_id]
    assert len(ends) == 1
    assert ends[0]["outcome"] == "finished" or ends[0].get("interrupted") is True
    # A client retrying after the crash with the same key gets the original run, not a new one.
    with again.client() as c:
        retry = c.run(text, client_key=f"key-{rep}")
        assert retry.run_id == run.run_id
    assert [e["text"] for e in all_history(again) if e["kind"] == "user_input"].count(text) == 1


@pytest.mark.parametrize("rep", REPS)
def test_kill_right_after_notify_ack(env: Env, rep: int) -> None:
    pod = env.start("notified")
    with pod.client() as c:
        c.run_wait("warm up")
        sid = c.status().session_id
        text = f"acknowledged notification {rep}"
        c.notify(text, source="ci")
        pod.kill9()
    before = len(env.model.requests)
    again = restart(env, pod, how_for(rep), sid)
    entries = check_restored(
        env, again, sid, runs={}, notes=(text,), interrupted=None, before=before
    )
    delivered = {i for e in entries if e["kind"] == "inputs_delivered" for i in e["ids"]}
    note = next(e for e in entries if e["kind"] == "system_item" and e["text"] == text)
    assert note["id"] in delivered


def test_kill_right_after_a_cancel_ack_does_not_resume_the_cancelled_run(env: Env) -> None:
    """`cancel` answered `{cancelled: true}` while the run's command was still being killed
    (~0.3 s): a crash then restored the run as interrupted, and the restored pod told the model
    to "continue where you left off", the very work the user had just cancelled."""
    pidfile = env.work / "tool.pid"
    command = f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 300"
    env.model.script({"tool_calls": [{"name": "bash", "arguments": {"command": command}}]})
    pod = env.start("canceller", tools=["bash"])
    with reap_group(pidfile):
        with pod.client() as c:
            c.subscribe()
            run = c.run("a job the user will cancel")
            next(e for e in c.events() if e.type == "tool.started")
            sid = c.status().session_id
        with pod.client() as c:
            assert c.cancel().cancelled
        pod.kill9()
    before = len(env.model.requests)
    again = restart(env, pod, "resume", sid)
    wait_until(lambda: settled(again), what="the restored pod to settle")
    entries = all_history(again)
    check_pairing(entries)
    check_runs_end_once(entries)
    (end,) = [e for e in entries if e["kind"] == "run_end" and e["run_id"] == run.run_id]
    assert end["outcome"] == "cancelled" and not end.get("interrupted")
    assert len(env.model.requests) == before  # no run was started to pick the work up


def notify_until_the_pod_dies(sock_path: str, tag: str, acked: list[tuple[str, str]]) -> None:
    """One client: notify, wait for the ack, repeat, until the connection breaks. Records
    (message, notification_id) of every acknowledgement it received."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(sock_path)
        buf = b""
        for i in range(100_000):
            message = f"{tag} note {i}"
            req = {"jsonrpc": "2.0", "id": i, "method": "notify", "params": {"message": message}}
            try:
                sock.sendall(json.dumps(req).encode() + b"\n")
                while b"\n" not in buf:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buf += data
            except OSError:
                return
            line, _, buf = buf.partition(b"\n")
            reply = json.loads(line)
            assert reply["id"] == i and "result" in reply, reply
            acked.append((message, reply["result"]["notification_id"]))


@pytest.mark.parametrize("at", [20, 60])
def test_power_cut_between_write_and_fsync_loses_no_acknowledged_entry(env: Env, at: int) -> None:
    """8 clients notify as fast as they are acknowledged; at the `at`-th group commit the pod
    meets a power cut between writing a batch and fsyncing it (the test seam cuts the log back to
    what the last fsync covered, then kills -9). Every notification acknowledged before is in
    the restored session, with the id it was acknowledged with: a reply never leaves before the
    fsync that covers its entry."""
    env.model.script({"text": "busy", "gate": "never"})  # a run keeps the pod busy: no turns
    env.env[POWER_CUT_ENV] = str(at)
    pod = env.start("powercut", extra="[notify]\nmax_pending = 1000000\n")
    del env.env[POWER_CUT_ENV]
    with pod.client() as c:
        c.run("keep busy")
        env.model.wait_for_requests(1)
        sid = c.status().session_id
    assert sid
    acked: list[list[tuple[str, str]]] = [[] for _ in range(8)]
    clients = [
        threading.Thread(target=notify_until_the_pod_dies, args=(pod.socket, f"c{i}", acked[i]))
        for i in range(8)
    ]
    for t in clients:
        t.start()
    for t in clients:
        t.join(60)
    assert pod.proc.wait(10) == -signal.SIGKILL
    said = pod.final_text().splitlines()  # (its last lines may still be on their way to us)
    cut = [line for line in said if line.startswith("test power cut: ")]
    assert cut and int(cut[0].split()[3]) > 0, pod.text()  # written, unsynced, then lost
    every = [a for client in acked for a in client]
    assert len(every) >= at // 2  # the load ran a while before the cut
    again = env.restart(pod, "--session", sid)
    committed = {
        e["text"]: e["id"] for e in all_history(again, page=10_000) if e["kind"] == "system_item"
    }
    missing = [(m, nid) for m, nid in every if committed.get(m) != nid]
    assert not missing, f"{len(missing)} of {len(every)} acknowledged notifications lost"
    verify_ok(env, sid)


@pytest.mark.parametrize("ahead", [True, False], ids=["file-made-ahead", "run-sent-at-ready"])
def test_power_cut_before_the_first_commit_leaves_no_session(env: Env, ahead: bool) -> None:
    """The first input starts the session, and one commit makes it durable: its file only when
    the pod made the file ahead (sent once it is made), else the new file then its directory
    (sent at READY, the run may come first). A power cut before that commit leaves empty files
    at most: the run was never acknowledged, listings skip them, and `--resume` starts a new
    session."""
    env.env[POWER_CUT_ENV] = "1"
    env.env["PODDAEMON_LOG_LEVEL"] = "DEBUG"
    pod = env.start("firstcut")
    del env.env[POWER_CUT_ENV]
    made = _made_ahead(pod) if ahead else None
    with pod.client() as c, pytest.raises(ConnectionClosed):
        c.run("never acknowledged")
    assert pod.proc.wait(10) == -signal.SIGKILL
    said = pod.final_text().splitlines()  # (its last lines may still be on their way to us)
    assert any(line.startswith("test power cut: ") for line in said), pod.text()
    # The session's file, and (sent at READY) the one made ahead for it if the run came first.
    left = list(sessions_dir(env).iterdir())
    assert left == [made] if made else left
    assert all(p.stat().st_size == 0 for p in left)
    listed = env.podctl("sessions", "list").stdout
    assert not any(p.stem in listed for p in left)
    again = env.restart(pod, "--resume")
    assert again.call("status")["session_id"] is None
    again.call("run", input="again")  # acknowledged: durable, and named in the registry
    sid = again.call("status")["session_id"]
    assert sid and sid not in {p.stem for p in left}
    assert _registry(env)["firstcut"]["session"] == sid
    wait_until(lambda: settled(again), what="the run to finish")
    verify_ok(env, sid)


def _made_ahead(pod: PodProcess) -> Path:
    """The first session's file the pod made after READY (PODDAEMON_LOG_LEVEL=DEBUG says)."""
    mark = "the first session's file is made: "
    line = wait_until(
        lambda: next((x for x in pod.stderr if mark in x), None), what="the file made ahead"
    )
    return Path(line.split(mark, 1)[1].strip())


def test_the_first_sessions_file_is_made_ahead_and_never_taken_for_a_session(env: Env) -> None:
    """Right after READY a pod with no session makes its first session's file, empty and
    durable, and names it in the registry, so the first input's commit fsyncs one file (not a
    new name's directory too) and waits for no registry update. Empty, it is no session:
    status says none, listings skip it. The first run's session is
    written there; a pod stopped before any input removes it; one killed leaves it empty, and
    `--resume` passes over it (and removes it: the start reclaims the dead pod's entry)."""
    env.env["PODDAEMON_LOG_LEVEL"] = "DEBUG"
    pod = env.start("ahead")
    made = _made_ahead(pod)
    assert made.parent == sessions_dir(env) and made.stat().st_size == 0
    assert pod.call("status")["session_id"] is None
    assert made.stem not in env.podctl("sessions", "list").stdout
    # Named in the registry ahead as well: no other pod may take it, and the first input
    # names nothing.
    wait_until(
        lambda: _registry(env)["ahead"]["session"] == made.stem, what="the registry naming it"
    )
    pod.call("run", input="first", wait=True)
    assert pod.call("status")["session_id"] == made.stem
    assert _registry(env)["ahead"]["session"] == made.stem
    verify_ok(env, made.stem)
    assert pod.stop() == 0

    idle = env.start("idle")
    unused = _made_ahead(idle)
    assert idle.stop() == 0
    assert not unused.exists()

    killed = env.start("killed")
    left = _made_ahead(killed)
    killed.kill9()
    assert left.exists() and left.stat().st_size == 0
    again = env.restart(killed, "--resume")
    assert again.call("status")["session_id"] is None
    assert not left.exists()  # empty: nothing acknowledged was in it
    again.call("run", input="after the kill", wait=True)
    sid = again.call("status")["session_id"]
    assert sid and sid != left.stem
    assert {p.stem for p in sessions_dir(env).iterdir() if p.stat().st_size} == {made.stem, sid}


def test_a_file_made_ahead_and_removed_is_made_anew(env: Env) -> None:
    """Someone clears the empty file before the first input: the session is created anew under
    the same name rather than written into the unnamed file (where an acknowledged input
    would be lost with the pod)."""
    env.env["PODDAEMON_LOG_LEVEL"] = "DEBUG"
    pod = env.start("cleared")
    made = _made_ahead(pod)
    made.unlink()
    pod.call("run", input="first", wait=True)
    assert pod.call("status")["session_id"] == made.stem
    assert made.stat().st_size > 0
    verify_ok(env, made.stem)


@pytest.mark.parametrize("rep", REPS)
def test_kill_between_two_queued_runs(env: Env, rep: int) -> None:
    env.model.script({"text": "first never finishes", "gate": "first"})
    pod = env.start("queuer")
    with pod.client() as c:
        first = c.run(f"first run {rep}")
        env.model.wait_for_requests(1)
        second = c.run(f"second run {rep}")
        assert second.state == "queued"
        sid = c.status().session_id
    pod.kill9()
    before = len(env.model.requests)
    again = restart(env, pod, how_for(rep), sid)
    entries = check_restored(
        env,
        again,
        sid,
        runs={first.run_id: f"first run {rep}", second.run_id: f"second run {rep}"},
        interrupted=first.run_id,
        before=before,
    )
    end = next(e for e in entries if e["kind"] == "run_end" and e["run_id"] == second.run_id)
    assert end["outcome"] == "finished" and end["text"].startswith("ok: ")
    assert not end.get("interrupted")
    # The first run is closed before the second starts.
    first_end = next(e for e in entries if e["kind"] == "run_end" and e["run_id"] == first.run_id)
    second_start = next(
        e for e in entries if e["kind"] == "run_start" and e["run_id"] == second.run_id
    )
    assert first_end["seq"] < second_start["seq"]


def test_kill_after_a_steer_ack(env: Env) -> None:
    env.model.script({"text": "never delivered", "gate": "hold"})
    pod = env.start("steerer")
    with pod.client() as c:
        run = c.run("the task")
        env.model.wait_for_requests(1)
        steer = c.run("a steer that must not be lost", mode="steer")
        assert (steer.state, steer.run_id) == ("steered", run.run_id)
        sid = c.status().session_id
    pod.kill9()
    before = len(env.model.requests)
    again = env.restart(pod, "--resume")
    check_restored(
        env, again, sid, runs={run.run_id: "the task"}, interrupted=run.run_id, before=before
    )
    assert "a steer that must not be lost" in requests_since(env, before)


def test_kill_twice_while_restoring(env: Env) -> None:
    """A crash during the run that a restore started is restored just the same."""
    env.model.script(
        {"text": "never delivered", "gate": "one"}, {"text": "never either", "gate": "two"}
    )
    pod = env.start("twice")
    with pod.client() as c:
        run = c.run("survive two crashes")
        env.model.wait_for_requests(1)
        sid = c.status().session_id
    pod.kill9()
    again = env.restart(pod, "--resume")
    env.model.wait_for_requests(2)
    second_run = again.call("status")["run_id"]
    assert second_run and second_run != run.run_id
    again.kill9()
    before = len(env.model.requests)
    third = env.restart(again, "--resume")
    entries = check_restored(
        env,
        third,
        sid,
        runs={run.run_id: "survive two crashes"},
        interrupted=run.run_id,
        before=before,
    )
    ends = [e for e in entries if e["kind"] == "run_end" and e["run_id"] == second_run]
    assert len(ends) == 1 and ends[0]["interrupted"] is True
    assert "survive two crashes" in requests_since(env, before)


# --- damaged logs -------------------------------------------------------------------------------


def test_the_fields_spec_names_are_written_even_when_empty(env: Env) -> None:
    """SPEC §8: session_start carries the rendered system prompt, the config, the initial
    history and the forked_from / compacted_from links; run_end its outcome and `interrupted`.
    Empty, null or false, they were left out of the line altogether: a reader found no
    `history` key in a fresh session, and no `interrupted` in a run that ended normally."""
    pod = env.start("fresh")
    with pod.client() as c:
        c.run_wait("one")
        sid = c.status().session_id
    path = sessions_dir(env) / f"{sid}.jsonl"
    start = json.loads(path.read_bytes().split(b"\n", 1)[0])
    assert start["kind"] == "session_start" and start["seq"] == 1
    assert {"system_prompt", "config"} <= start.keys(), start.keys()
    assert start.get("history", "absent") == [], start.keys()
    assert start.get("forked_from", "absent") is None, start.keys()
    assert start.get("compacted_from", "absent") is None, start.keys()
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    [end] = [e for e in lines if e["kind"] == "run_end"]
    assert end["outcome"] == "finished" and end.get("interrupted", "absent") is False, end
    assert pod.stop() == 0
    verify_ok(env, sid)


def test_torn_last_line_is_cut_with_an_alert(env: Env) -> None:
    pod = env.start("torn")
    with pod.client() as c:
        c.run_wait("one")
        c.run_wait("two")
        sid = c.status().session_id
    assert pod.stop() == 0
    path = sessions_dir(env) / f"{sid}.jsonl"
    original = read_session(sessions_dir(env), sid).entries
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # the last entry loses its tail and its newline
    again = env.restart(pod, "--resume")
    with again.client() as c:
        c.subscribe(since=0)
        alert = next(e for e in c.events() if e.type == "alert")
    assert alert.data["level"] == "warning"
    assert "torn" in alert.data["message"] and f"line {len(original)}" in alert.data["message"]
    assert "torn last line" in again.text()
    wait_until(lambda: settled(again), what="the restored pod to settle")
    entries = all_history(again)
    assert entries[: len(original) - 1] == original[:-1]
    assert entries[len(original) - 1]["hash"] != original[-1]["hash"]
    check_pairing(entries)
    verify_ok(env, sid)


def test_flipped_byte_in_the_middle_refuses_to_start(env: Env) -> None:
    pod = env.start("flipped")
    with pod.client() as c:
        c.run_wait("precious words")
        c.run_wait("more")
        sid = c.status().session_id
    assert pod.stop() == 0
    path = sessions_dir(env) / f"{sid}.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lineno = next(i for i, line in enumerate(lines, 1) if b"precious words" in line)
    assert lineno < len(lines)
    lines[lineno - 1] = lines[lineno - 1].replace(b"precious words", b"precious wordz")
    damaged = b"".join(lines)
    path.write_bytes(damaged)
    with pytest.raises(StartFailed) as failed:
        env.restart(pod, "--resume")
    assert failed.value.code != 0
    assert f"line {lineno}" in failed.value.stderr and sid in failed.value.stderr
    assert path.read_bytes() == damaged  # left untouched for a human to look at
    verify = env.podctl("sessions", "verify", sid)
    assert verify.returncode != 0 and f"line {lineno}" in verify.stderr + verify.stdout


def test_a_fifo_named_as_a_session_is_never_waited_on(env: Env) -> None:
    """A fifo under a session's name (or a compaction's `.tmp` name) was opened to read its
    first line, blocking: `--resume` hung before READY, for good, saying nothing."""
    pod = env.start("fifo")
    with pod.client() as c:
        c.run_wait("kept")
        sid = c.status().session_id
    assert pod.stop() == 0
    fifo = new_session_id()  # newer than the pod's own: `--resume` looks at what it holds
    os.mkfifo(sessions_dir(env) / f"{fifo}.jsonl")
    os.mkfifo(sessions_dir(env) / f"{new_session_id()}.jsonl.tmp")
    again = env.restart(pod, "--resume")
    assert again.call("status")["session_id"] == sid
    assert f"session log(s) {fifo} written since name no pod" in again.text()
    assert again.stop() == 0
    with pytest.raises(StartFailed) as failed:
        env.restart(pod, "--session", fifo)
    assert f"{fifo}.jsonl: not a regular file" in failed.value.stderr, failed.value.stderr


def test_a_damaged_pod_name_in_a_compacted_sessions_first_line_refuses_resume(env: Env) -> None:
    """One flipped byte in the pod name of the newest session's first line: that session named
    another pod, so `--resume` took the one it was compacted from for this pod's newest and
    went on there, silently leaving behind what was acknowledged after the compaction."""
    pod = env.start()
    with pod.client() as c:
        c.run_wait("before the compaction")
        old = c.status().session_id
    env.model.script_when("Your context is about to be compacted", {"text": "SUMMARY"})
    assert env.podctl("compact", "pod").returncode == 0
    with pod.client() as c:
        c.run_wait("acknowledged after the compaction")
        new = c.status().session_id
    assert pod.stop() == 0
    path = sessions_dir(env) / f"{new}.jsonl"
    data = path.read_bytes()
    assert data.count(b'"pod":"pod"') == 1
    path.write_bytes(data.replace(b'"pod":"pod"', b'"pod":"pof"'))
    old_data = (sessions_dir(env) / f"{old}.jsonl").read_bytes()
    with pytest.raises(StartFailed) as failed:
        env.restart(pod, "--resume")
    assert failed.value.code != 0
    assert new in failed.value.stderr and old in failed.value.stderr, failed.value.stderr
    assert "damaged" in failed.value.stderr
    assert (sessions_dir(env) / f"{old}.jsonl").read_bytes() == old_data  # not written on


def _stopped_after_a_run(env: Env, name: str) -> tuple[PodProcess, str]:
    """A pod stopped after one finished run, and its session's id."""
    pod = env.start(name)
    with pod.client() as c:
        c.run_wait("precious words")
        sid = c.status().session_id
    assert pod.stop() == 0
    return pod, sid


def test_a_session_log_copied_under_another_id_refuses_to_start(env: Env) -> None:
    """The copy's chain verified whole: the pod wrote its acknowledged input into the copy
    while `status` named, and `history` paged, the original (which never got it)."""
    pod, sid = _stopped_after_a_run(env, "copied")
    other = new_session_id()
    copy = sessions_dir(env) / f"{other}.jsonl"
    shutil.copyfile(sessions_dir(env) / f"{sid}.jsonl", copy)
    data = copy.read_bytes()
    with pytest.raises(StartFailed) as failed:
        env.restart(pod, "--session", other)
    assert failed.value.code != 0
    assert "line 1" in failed.value.stderr and f"session {sid}'s" in failed.value.stderr
    assert copy.read_bytes() == data
    verify = env.podctl("sessions", "verify", other)
    assert verify.returncode == 1 and "line 1" in verify.stderr
    assert env.podctl("sessions", "verify", sid).returncode == 0


def test_resume_continues_the_original_and_not_a_newer_copy_of_it(env: Env) -> None:
    pod, sid = _stopped_after_a_run(env, "copyresume")
    copy = new_session_id()
    shutil.copyfile(sessions_dir(env) / f"{sid}.jsonl", sessions_dir(env) / f"{copy}.jsonl")
    again = env.restart(pod, "--resume")  # the copy is newer: it was picked, and refused
    assert again.call("status")["session_id"] == sid
    assert f"session log(s) {copy} written since name no pod" in again.text()
    assert again.stop() == 0


# --- a second writer ----------------------------------------------------------------------------


def test_second_writer_forks_into_a_linked_session(env: Env) -> None:
    pod = env.start("forker")
    with pod.client() as c:
        c.subscribe()
        first = c.run_wait("before the intruder")
        assert first.outcome == "finished"
        old = c.status().session_id
        intruder, _, _ = SessionLog.open(sessions_dir(env), old, list)
        with intruder:
            intruder.append("system_item", {"id": "x1", "source": "other", "text": "intruder"})
        second = c.run_wait("after the intruder")
        assert (second.outcome, second.text) == ("finished", "ok: after the intruder")
        new = c.status().session_id
        alert = next(e for e in c.events() if e.type == "alert")
    assert new and new != old
    assert alert.data["source"] == "session" and old in alert.data["message"]
    start = read_session(sessions_dir(env), new).entries[0]
    assert start["kind"] == "session_start" and start["forked_from"] == old
    # The forked session carries the conversation so far; the intruder's entry stays behind.
    assert "before the intruder" in str(env.model.requests[-1]["body"])
    assert all(item.get("text") != "intruder" for item in start["history"])
    old_entries = read_session(sessions_dir(env), old).entries
    assert old_entries[-1]["text"] == "intruder"
    assert not any(e.get("text") == "after the intruder" for e in old_entries)
    entries = all_history(pod)
    assert entries[0]["forked_from"] == old
    check_pairing(entries)
    verify_ok(env, old)
    verify_ok(env, new)
    listed = env.podctl("sessions", "list")
    assert f"forked {old}" in listed.stdout
    # After a crash, --resume picks the fork (the pod's newest session), not the old one.
    pod.kill9()
    again = env.restart(pod, "--resume")
    assert again.call("status")["session_id"] == new
    assert again.call("run", input="third", wait=True)["outcome"] == "finished"


def intrude(env: Env, session_id: str) -> None:
    """Another writer appends a valid entry to the session."""
    intruder, _, _ = SessionLog.open(sessions_dir(env), session_id, list)
    with intruder:
        intruder.append("system_item", {"id": "x1", "source": "other", "text": "intruder"})


def test_fork_in_the_middle_of_a_run_keeps_the_run(env: Env) -> None:
    """The other writer strikes while a run is waiting for the model: the pod forks at its next
    commit, in the middle of the run. The run goes on in the fork (still `running`), and a crash
    there is restored like any other: the open tool call is closed, the run ends interrupted."""
    pidfile = env.work / "tool.pid"
    command = f"echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 300"
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": command}}], "gate": "g"}
    )
    pod = env.start("midfork", tools=["bash", "read_file"])
    with reap_group(pidfile):
        with pod.client() as c:
            run = c.run("work through a fork")
            env.model.wait_for_requests(1)
            old = c.status().session_id
            intrude(env, old)
            env.model.open_gate("g")
            wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="bash")
            status = c.status()
        new = status.session_id
        assert new != old
        assert (status.state, status.run_id) == ("running", run.run_id)
        pod.kill9()
        before = len(env.model.requests)
        again = env.restart(pod, "--resume")
        check_restored(
            env,
            again,
            new,
            runs={},
            interrupted=run.run_id,
            before=before,
        )


def test_a_session_file_removed_under_the_pod_takes_no_acknowledgement_with_it(
    env: Env,
) -> None:
    """Someone removes the live session's file (a clean-up gone wrong). What the pod
    acknowledges afterwards must not go to a file that no name reaches: it continues in a new
    session first (forked from the lost one), so a crash loses nothing it acknowledged."""
    env.model.script({"text": "slow answer", "gate": "g"})
    pod = env.start("removed")
    with pod.client() as c:
        run = c.run("a run in flight")
        env.model.wait_for_requests(1)
        old = c.status().session_id
        (sessions_dir(env) / f"{old}.jsonl").unlink()
        text = "acknowledged after the file was removed"
        c.notify(text, source="ci")
        new = c.status().session_id
        pod.kill9()
    assert new != old
    before = len(env.model.requests)
    again = env.restart(pod, "--resume")
    check_restored(env, again, new, runs={}, interrupted=run.run_id, before=before)
    assert text in requests_since(env, before)


def test_restoring_a_session_compacted_since_forks_so_resume_finds_what_it_acknowledged(
    env: Env,
) -> None:
    """`--session OLD` where OLD was compacted into NEW since: what the pod acknowledges now
    must be where the next `--resume` looks. Writing on in OLD (a session NEW continues, so no
    chain end) left a queued run acknowledged there that `--resume` (a unit, `podctl restart`)
    passed over for NEW: never processed, and no word said."""
    pod = env.start("goback", extra="[compaction]\ncompact_threshold = 100000\n")
    with pod.client() as c:
        c.run_wait("before the compaction")
        old = c.status().session_id
    new = pod.call("compact")["session_id"]
    assert pod.stop() == 0
    env.model.script({"text": "never delivered", "gate": "hold"})
    back = env.restart(pod, "--session", old)
    text = "queued in the restored old session"
    asked = len(env.model.requests)
    with back.client() as c:
        c.run("a run in flight")
        env.model.wait_for_requests(asked + 1)
        queued = c.run(text)
        assert queued.state == "queued"
        forked = c.status().session_id
    back.kill9()
    before = len(env.model.requests)
    env.model.open_gate("hold")
    again = env.restart(back, "--resume")
    wait_until(lambda: settled(again), what="the acknowledged queued run")
    assert text in requests_since(env, before)
    assert again.call("status")["session_id"] == forked
    assert forked not in (old, new)
    entries = all_history(again)
    assert entries[0]["forked_from"] == old
    check_pairing(entries)
    check_runs_end_once(entries)
    verify_ok(env, forked)


def test_a_pod_restored_from_another_pods_session_keeps_what_it_acknowledged_its_own(
    env: Env,
) -> None:
    """`b --session <a's session>` wrote on in a's session: after a crash `b --resume` looked
    for sessions naming b, found none and started empty (its acknowledged queued run never
    ran), and `a --resume` then ran b's input as a, with a's scope and tools."""
    a = env.start("a")
    with a.client() as c:
        c.run_wait("a's own work")
        sid = c.status().session_id
    assert a.stop() == 0
    env.model.script({"text": "never delivered", "gate": "hold"})
    b = env.start("b", "--session", sid, write=[str(env.home / "b")])
    text = "b's queued input"
    with b.client() as c:
        c.run("b's run in flight")
        env.model.wait_for_requests(2)
        assert c.run(text).state == "queued"
        forked = c.status().session_id
    b.kill9()
    env.model.open_gate("hold")
    before = len(env.model.requests)
    again = env.restart(b, "--resume")
    wait_until(lambda: settled(again), what="b's acknowledged queued run")
    assert text in requests_since(env, before)
    assert again.call("status")["session_id"] == forked != sid
    check_pairing(all_history(again))
    assert again.stop() == 0
    before = len(env.model.requests)
    a_again = env.restart(a, "--resume")
    wait_until(lambda: settled(a_again), what="a to settle")
    assert a_again.call("status")["session_id"] == sid  # a's own session, as it left it
    assert text not in requests_since(env, before)


def test_a_pod_restoring_another_pods_crashed_session_writes_nothing_into_it(env: Env) -> None:
    """`a` killed in a model call, then `b --session <a's session>`: what the restore closes
    (a's interrupted run, the note that takes it up) went into a's file before b forked, so
    `a --resume` later found it there too. It goes to b's fork; a's file stays as a left it."""
    env.model.script({"text": "never delivered", "gate": "hold"})
    a = env.start("a")
    with a.client() as c:
        c.run("a's work, cut short")
        env.model.wait_for_requests(1)
        sid = c.status().session_id
    a.kill9()
    path = sessions_dir(env) / f"{sid}.jsonl"
    left = path.read_bytes()
    env.model.open_gate("hold")
    b = env.start("b", "--session", sid, write=[str(env.home / "b")])
    wait_until(lambda: settled(b), what="b to settle")
    assert path.read_bytes() == left
    entries = all_history(b)
    start = entries[0]
    assert start["forked_from"] == sid  # holding a's run closed: no longer active
    assert start.get("active_run") is None
    check_pairing(entries)
    check_runs_end_once(entries)
    verify_ok(env, b.call("status")["session_id"])


def test_a_pod_started_from_another_pods_session_takes_its_conversation_not_its_work(
    env: Env,
) -> None:
    """`b --session <a's session>` where a was cut off mid-run with a run queued (found by QA):
    b took the run up by itself, under a note saying "the pod restarted while your previous run
    was in progress" (false: b never ran it), and started a's queued run, spending tokens on
    a's work with nobody asking. A copy keeps the conversation; what was under way ends there
    and a note (waking nothing) tells the model so at b's next request."""
    env.model.script({"text": "never delivered", "gate": "hold"})
    a = env.start("a")
    with a.client() as c:
        c.run("a's task, cut short")
        env.model.wait_for_requests(1)
        assert c.run("a's queued task").state == "queued"
        c.notify("a's unread notification")
        sid = c.status().session_id
    a.kill9()
    env.model.open_gate("hold")
    before = len(env.model.requests)
    b = env.start("b", "--session", sid, write=[str(env.home / "b")])
    assert settled(b)
    assert len(env.model.requests) == before  # nothing ran by itself
    entries = all_history(b)
    fork = sessions_dir(env) / f"{b.call('status')['session_id']}.jsonl"
    start = json.loads(fork.read_text().splitlines()[0])  # what the restore made of a's state
    assert start["forked_from"] == sid and start.get("active_run") is None
    assert start.get("pending_runs", []) == [] and start.get("paused_run") is None
    (note,) = start.get("pending_inputs", [])  # a's undelivered notification is not among them
    assert note["context"] and "was not taken up here" in note["text"], note
    assert RESTART_NOTE not in json.dumps(entries)
    check_pairing(entries)
    with b.client() as c:
        assert c.run_wait("b's own task").outcome == "finished"
    asked = requests_since(env, before)
    assert "b's own task" in asked and "a's task, cut short" in asked  # the conversation
    assert "was not taken up here" in asked  # the note, with b's own input
    assert "a's queued task" not in asked and "a's unread notification" not in asked


def test_fork_keeps_client_keys(env: Env) -> None:
    pod = env.start("keyfork")
    with pod.client() as c:
        first = c.run_wait("keyed input", client_key="k1")
        old = c.status().session_id
        intrude(env, old)
        c.run_wait("forks the session")
        assert c.status().session_id != old
        retry = c.run_wait("keyed input", client_key="k1")
    assert retry.run_id == first.run_id
    assert len(env.model.requests) == 2  # the two runs; the keyed retry made no model call


def test_fork_keeps_usage_calls(env: Env) -> None:
    env.model.script({"text": "a", "usage": {"input": 10, "output": 1}})
    pod = env.start("usagefork")
    with pod.client() as c:
        c.run_wait("one")
        old = c.status().session_id
        intrude(env, old)
        c.run_wait("two")
        assert c.status().session_id != old
        usage = c.usage()
    assert usage.totals.calls == len(usage.calls) == 2
    assert usage.totals.input == sum(u.input for u in usage.calls)


# --- a paused run survives a restart ------------------------------------------------------------


@pytest.mark.parametrize("stop", ["shutdown", "kill9"])
def test_paused_run_is_restored_paused_and_resumes(env: Env, stop: str) -> None:
    env.model.script(PAUSABLE, {"text": "resumed after the restart"})
    pod = env.start("napper")
    run_id = paused_at_a_safe_point(env, pod, "work, then nap")
    sid = pod.call("status")["session_id"]
    if stop == "kill9":
        pod.kill9()
    else:
        assert pod.stop() == 0
    again = env.restart(pod, "--resume")
    with again.client() as c:
        status = c.status()
        assert (status.state, status.run_id, status.session_id) == ("paused", run_id, sid)
        c.subscribe()
        assert c.resume().run_id == run_id
        events = collect_run(c, run_id)
    assert [e.type for e in events].count("run.finished") == 1
    assert events[-1].data == {**events[-1].data, "outcome": "finished"}
    assert events[-1].data["text"] == "resumed after the restart"
    entries = all_history(again)
    check_pairing(entries)
    check_runs_end_once(entries)
    assert [e["outcome"] for e in entries if e["kind"] == "run_end"] == ["paused", "finished"]
    verify_ok(env, sid)


@pytest.mark.parametrize("fork", [False, True], ids=["same-session", "forked"])
def test_a_pause_acknowledged_before_a_crash_keeps_the_run_paused(env: Env, fork: bool) -> None:
    """`pause` answered `{paused: true}` while the model call was still out (the safe point
    comes after it): a crash then lost the pause. The restored pod ended the run interrupted
    and went on working at once, where the user had asked it to stop. (`fork`: the session
    moves to a fork between the pause and the crash; the pause goes with it.)"""
    env.model.script({"text": "never delivered", "gate": "hold"}, {"text": "resumed at last"})
    pod = env.start("pauser")
    with pod.client() as c:
        run = c.run("work the user will pause")
        env.model.wait_for_requests(1)
        assert c.pause().paused
        assert c.status().state == "running"  # short of its safe point
        if fork:
            (sessions_dir(env) / f"{c.status().session_id}.jsonl").unlink()
            c.notify("a note that moves the session to a fork", source="ci")
        sid = c.status().session_id
    pod.kill9()
    env.model.open_gate("hold")
    before = len(env.model.requests)
    again = env.restart(pod, "--resume")
    with again.client() as c:
        status = c.status()
        assert (status.state, status.run_id, status.session_id) == ("paused", run.run_id, sid)
        assert len(env.model.requests) == before  # nothing started
        c.subscribe()
        assert c.resume().run_id == run.run_id
        events = collect_run(c, run.run_id)
    assert events[-1].data["outcome"] == "finished"
    entries = all_history(again)
    check_pairing(entries)
    check_runs_end_once(entries)
    ends = [e for e in entries if e["kind"] == "run_end" and e["run_id"] == run.run_id]
    assert [(e["outcome"], e.get("interrupted")) for e in ends] == [
        ("paused", True),
        ("finished", False),
    ]
    verify_ok(env, sid)


def test_a_resume_acknowledged_before_the_pause_was_reached_holds_across_a_crash(
    env: Env,
) -> None:
    """`pause`, then `resume` while the model call is still out: the resume takes the pause
    back (it was refused as "not paused", and the run then paused for good), and a crash
    before the safe point must not bring the pause back: the run is taken up again."""
    env.model.script({"text": "never delivered", "gate": "hold"}, {"text": "went on"})
    pod = env.start("changed-mind")
    with pod.client() as c:
        run = c.run("work paused and resumed")
        env.model.wait_for_requests(1)
        assert c.pause().paused
        assert c.resume().run_id == run.run_id
        assert c.status().state == "running"
    pod.kill9()
    env.model.open_gate("hold")
    before = len(env.model.requests)
    again = env.restart(pod, "--resume")
    wait_until(lambda: settled(again), what="the interrupted run taken up and finished")
    assert len(env.model.requests) > before  # taken up, not left paused
    entries = all_history(again)
    check_pairing(entries)
    check_runs_end_once(entries)
    assert again.call("status")["state"] == "idle"


# --- one session, one writer --------------------------------------------------------------------


def test_a_session_held_by_a_live_pod_cannot_be_opened(env: Env) -> None:
    holder = env.start("holder")
    with holder.client() as c:
        c.run_wait("make a session")
        sid = c.status().session_id
    other = env.home / "other"
    with pytest.raises(StartFailed) as failed:
        env.start("thief", "--session", sid, write=[str(other)])
    assert failed.value.code != 0
    assert "'holder'" in failed.value.stderr and sid in failed.value.stderr
    assert "stop it first (podctl stop holder), or start from another session" in (
        failed.value.stderr
    )  # the way on
    assert holder.call("status")["session_id"] == sid
    assert holder.call("run", input="still mine", wait=True)["outcome"] == "finished"
    verify_ok(env, sid)


def test_a_pod_restored_from_another_pods_session_shows_its_history(env: Env) -> None:
    """`podctl spawn b.toml --session <a's session>`: b writes on in a's session, and its own
    `podctl history` failed ("is not a session of this pod"); so did `--session` for that
    session once b had compacted into a session of its own (the command podctl suggests)."""
    first = env.start("first")
    with first.client() as c:
        c.run_wait("remember 42")
        sid = c.status().session_id
    assert first.stop() == 0
    unrelated = env.start("unrelated", write=[str(env.home / "u")])
    with unrelated.client() as c:
        c.run_wait("not yours")
        unrelated_sid = c.status().session_id
    second = env.start("second", "--session", sid, write=[str(env.home / "s")])
    # its log says why it forked, readably (it said "session … is pod 'first''s; …")
    assert f"session {sid} belongs to pod 'first'; continuing in session" in second.text()
    shown = env.podctl("history", "second", "--all", "--json")
    assert shown.returncode == 0, shown.stderr
    # second goes on in a session of its own, forked from first's, which it pages back to.
    assert json.loads(shown.stdout)["previous"] == sid
    back = env.podctl("history", "second", "--session", sid, "--json")
    assert back.returncode == 0, back.stderr
    assert "remember 42" in [e.get("text") for e in json.loads(back.stdout)["entries"]]

    compacted = env.podctl("compact", "second", "--json")
    assert compacted.returncode == 0, compacted.stderr
    shown = env.podctl("history", "second", "--all", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["previous"] != sid  # the fork, which continues first's
    back = env.podctl("history", "second", "--session", sid, "--json")
    assert back.returncode == 0, back.stderr
    assert "remember 42" in [e.get("text") for e in json.loads(back.stdout)["entries"]]
    refused = env.podctl("history", "second", "--session", unrelated_sid)
    assert refused.returncode == 1
    assert f"{unrelated_sid} is not a session of this pod" in refused.stderr


# --- history, usage, sessions over the socket and podctl ----------------------------------------


def test_history_paging_usage_and_podctl_sessions(env: Env) -> None:
    env.model.script(
        {"text": "a", "usage": {"input": 10, "output": 1}},
        {
            "tool_calls": [{"name": "list_dir", "arguments": {}}],
            "usage": {"input": 20, "output": 2},
        },
        {"text": "b", "usage": {"input": 30, "output": 3}},
    )
    pod = env.start("pager")
    with pod.client() as c:
        assert c.history().entries == []  # no session before the first input
        first = c.run_wait("first")
        second = c.run_wait("second")
        assert (first.text, second.text) == ("a", "b")
        sid = c.status().session_id
        whole = c.history(since=0, limit=10_000)
        entries = whole.entries
        assert whole.next == entries[-1]["seq"] == len(entries)
        for size in (1, 2, 5):
            paged = all_history(pod, page=size)
            assert paged == entries
        tail = c.history(since=len(entries) - 2)
        assert [e["seq"] for e in tail.entries] == [len(entries) - 1, len(entries)]
        empty = c.history(since=len(entries))
        assert (empty.entries, empty.next) == ([], len(entries))
        usage = c.usage()
        pod_usage = pod.call("usage")
    check_pairing(entries)
    assert entries[0]["kind"] == "session_start" and entries[0]["session_id"] == sid
    calls = [(u.input, u.output, u.cache_read, u.cache_write) for u in usage.calls]
    assert calls == [(10, 1, 0, 0), (20, 2, 0, 0), (30, 3, 0, 0)]
    assert [u.run_id for u in usage.calls] == [first.run_id, second.run_id, second.run_id]
    assert all(u.model == "fake-model" for u in usage.calls)
    usage_seqs = [e["seq"] for e in entries if e["kind"] == "llm_usage"]
    assert [u.seq for u in usage.calls] == usage_seqs
    t = usage.totals
    assert (t.input, t.output, t.cache_read, t.cache_write, t.calls) == (60, 6, 0, 0, 3)
    assert pod.call("status")["usage"]["input"] == 60

    shown = env.podctl("history", "pager")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == len(entries)
    assert lines[0].startswith("1 session_start") and lines[-1].startswith(
        f"{len(entries)} run_end"
    )
    # --since with --limit is the RPC's page: the first N after SEQ; it says how many follow.
    limited = env.podctl("history", "pager", "--since", "2", "--limit", "3")
    n = len(entries)
    assert [line.split()[0] for line in limited.stdout.splitlines()] == ["3", "4", "5"]
    assert f"{n - 5} later entries not shown (--since 5 shows the next page)" in limited.stderr

    listed = env.podctl("sessions", "list")
    assert listed.returncode == 0 and sid in listed.stdout and "pager" in listed.stdout
    show = env.podctl("sessions", "show", sid)
    assert show.returncode == 0 and len(show.stdout.splitlines()) == len(entries)
    verify_ok(env, sid)
    assert env.podctl("sessions", "verify", "no-such-session").returncode != 0

    # Usage is part of the session: a restored pod reports the same calls and totals.
    pod.kill9()
    again = env.restart(pod, "--resume")
    assert again.call("usage") == pod_usage
    assert again.call("status")["usage"] == pod_usage["totals"]


def _registry(env: Env) -> dict[str, Any]:
    path = env.home / "run" / "pods.json"
    return json.loads(path.read_text())["pods"] if path.exists() else {}


def write_long_session(env: Env, sid: str, pod: str, n: int) -> None:
    """A valid session of `n` entries (long enough that restoring it takes a while), ending in
    an acknowledged run still waiting to start."""
    prev = GENESIS
    start = {"session_id": sid, "pod": pod, "system_prompt": "", "config": {}, "history": []}
    bodies = [("session_start", start)]
    bodies += [("turn_end", {"run_id": "old", "round": i}) for i in range(n - 2)]
    bodies.append(("user_input", {"run_id": "r-pending", "text": "do it once", "mode": "queue"}))
    lines = []
    for seq, (kind, body) in enumerate(bodies, 1):
        line, entry = encode_entry(seq, 1_700_000_000.0, kind, prev, body)
        lines.append(line)
        prev = entry["hash"]
    sessions_dir(env).mkdir(parents=True, exist_ok=True)
    (sessions_dir(env) / f"{sid}.jsonl").write_bytes(b"".join(lines))


def test_two_pods_restoring_one_session_at_once(env: Env) -> None:
    """One session, one writer, even when two pods are started on it at the same time: the
    second is started while the first is still restoring (a long log makes that take ~1 s)."""
    sid = new_session_id()
    write_long_session(env, sid, "first", 150_000)
    path_a = env.manifest("first")
    path_b = env.manifest("second", write=[str(env.home / "other")])
    a = PodProcess(env.popen(str(path_a), "--session", sid), "first")
    env.pods.append(a)
    wait_until(lambda: "first" in _registry(env), what="the first pod to register")
    b = PodProcess(env.popen(str(path_b), "--session", sid), "second")
    env.pods.append(b)
    outcomes: dict[str, str] = {}
    for p in (a, b):
        try:
            p.wait_ready(60)
            outcomes[p.name] = "ready"
        except StartFailed as exc:
            outcomes[p.name] = exc.stderr
    ready = [name for name, outcome in outcomes.items() if outcome == "ready"]
    assert len(ready) == 1, f"both pods started on session {sid}"
    (refused,) = set(outcomes) - set(ready)
    assert f"'{ready[0]}'" in outcomes[refused] and sid in outcomes[refused]
    winner = a if ready[0] == "first" else b
    wait_until(lambda: settled(winner), what="the pending run to be processed")
    assert requests_since(env, 0).count("do it once") == 1


def test_history_of_a_damaged_live_log_says_what_is_wrong(env: Env) -> None:
    """Someone appends a line to the live session's file. `podctl history POD` (no session
    given) said `session_id: <path>: line 0: the last line is not a JSON object` with -32602
    (invalid params): blaming a parameter the user never gave, and naming a line 0."""
    pod = env.start("damaged")
    with pod.client() as c:
        c.run_wait("make a session")
        sid = c.status().session_id
    with open(sessions_dir(env) / f"{sid}.jsonl", "ab") as f:
        f.write(b"junk\n")
    shown = env.podctl("history", "damaged")
    assert shown.returncode == 1
    assert "session log damaged" in shown.stderr and "last line: not a JSON object" in shown.stderr
    assert "line 0" not in shown.stderr and "session_id" not in shown.stderr
    assert "(-32603)" in shown.stderr
    given = env.podctl("history", "damaged", "--session", sid)  # asked for it by name
    assert given.returncode == 1 and "session_id: session log damaged" in given.stderr


def test_an_edited_instruction_applies_at_the_next_resume_in_a_linked_session(env: Env) -> None:
    """Found by QA: `--resume` (a unit's every start, `podctl restart`) kept the system prompt
    the session began with, so an edited instruction never reached the model, while the rest
    of the edited manifest applied. It applies now, in a fork whose first entry holds it."""
    pod = env.start("reprompt", instruction="PROMPT-A")
    with pod.client() as c:
        assert c.run_wait("first task").outcome == "finished"
        old = c.status().session_id
    assert old and pod.stop() == 0
    env.manifest("reprompt", instruction="PROMPT-B")
    again = env.restart(pod, "--resume")
    with again.client() as c:
        assert c.run_wait("second task").outcome == "finished"
        new = c.status().session_id
    body = env.model.requests[-1]["body"]
    assert body["messages"][0] == {"role": "system", "content": "PROMPT-B"}
    assert "first task" in str(body)  # the conversation goes on
    assert new and new != old
    start = read_session(sessions_dir(env), new).entries[0]
    assert (start["forked_from"], start["system_prompt"]) == (old, "PROMPT-B")
    verify_ok(env, old)
    verify_ok(env, new)
    # Unchanged, it stays in its session.
    assert again.stop() == 0
    third = env.restart(again, "--resume")
    assert third.call("status")["session_id"] == new
    assert third.stop() == 0
