"""Compaction with real pods, the real SDKs and the fake model (SPEC §3, §5, §8)."""

import fcntl
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from poddaemon.compaction import SUMMARY_TAG, TRIMMED_NOTE
from poddaemon.podlog import CRASH_ENV
from poddaemon.store.file import list_sessions, read_session
from poddaemon.store.log import GENESIS, encode_entry, new_session_id
from protocol.types import Event
from tests.conftest import (
    PROVIDER_KINDS,
    Env,
    PodProcess,
    StartFailed,
    collect_run,
    events_until,
    wait_until,
)

MARKER = "Your context is about to be compacted"
INPUT = "THE TASK: read data.txt thirty times, then say done."


def compaction_toml(threshold: int, retained: int = 2) -> str:
    return f"[compaction]\ncompact_threshold = {threshold}\ncompact_retained_turns = {retained}\n"


def tool_replies(n: int) -> list[dict[str, Any]]:
    call = {"name": "read_file", "arguments": {"path": "data.txt"}}
    return [{"tool_calls": [call]} for _ in range(n)] + [{"text": "all done"}]


def write_data(env: Env) -> None:
    lines = (f"line {i:04d} of the data file\n" for i in range(80))
    (env.work / "data.txt").write_text("".join(lines))


# --- reading the three wire formats -----------------------------------------------------------


def user_texts(kind: str, body: dict[str, Any]) -> list[str]:
    """The texts of the user-role items in request order (tool results left out)."""
    out: list[str] = []
    if kind == "openai_responses":
        for item in body["input"]:
            if item.get("role") == "user":
                content = item["content"]
                out.append(content if isinstance(content, str) else content[0]["text"])
        return out
    for msg in body["messages"]:
        if msg["role"] != "user":
            continue
        content = msg["content"]
        if isinstance(content, str):
            out.append(content)
        else:
            out += [b["text"] for b in content if b.get("type") == "text"]
    return out


def check_wire(kind: str, body: dict[str, Any]) -> None:
    """What each API rejects: tool calls without their results (or results without calls),
    and for Anthropic roles that do not alternate, starting with the user."""
    calls: list[str] = []
    results: list[str] = []
    if kind == "openai_responses":
        for item in body["input"]:
            if item.get("type") == "function_call":
                calls.append(item["call_id"])
            elif item.get("type") == "function_call_output":
                assert item["call_id"] in calls, "a result before its call"
                results.append(item["call_id"])
    elif kind == "openai":
        open_: set[str] = set()
        for msg in body["messages"]:
            if msg["role"] == "assistant":
                assert not open_, "an assistant message before every tool call was answered"
                open_ = {c["id"] for c in msg.get("tool_calls") or []}
                calls += list(open_)
            elif msg["role"] == "tool":
                assert msg["tool_call_id"] in open_, "a tool message that answers no call"
                open_.discard(msg["tool_call_id"])
                results.append(msg["tool_call_id"])
            elif msg["role"] == "user":
                assert not open_, "a user message between a call and its result"
    else:
        roles = [m["role"] for m in body["messages"]]
        assert roles[0] == "user"
        assert all(a != b for a, b in itertools.pairwise(roles)), roles
        previous: set[str] = set()
        for msg in body["messages"]:
            blocks = msg["content"]
            if msg["role"] == "assistant":
                previous = {b["id"] for b in blocks if b["type"] == "tool_use"}
                calls += list(previous)
            else:
                answered = [b["tool_use_id"] for b in blocks if b["type"] == "tool_result"]
                assert set(answered) == previous, "tool_use not answered in the next message"
                assert [b["type"] for b in blocks[: len(answered)]] == ["tool_result"] * len(
                    answered
                ), "tool_result blocks must come first"
                results += answered
                previous = set()
    assert sorted(calls) == sorted(results)


def is_summary_request(kind: str, body: dict[str, Any]) -> bool:
    texts = user_texts(kind, body)
    return bool(texts) and MARKER in texts[-1]


def subscribe(pod: PodProcess) -> tuple[list[Event], threading.Thread]:
    events: list[Event] = []
    client = pod.client(timeout=120)
    client.subscribe(since=0)

    def go() -> None:
        with client:
            events.extend(collect_run(client))

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return events, thread


# --- the run ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_a_30_round_run_compacts_mid_run_and_every_request_after_is_valid(
    env: Env, kind: str
) -> None:
    write_data(env)
    pod = env.start(kind=kind, extra=compaction_toml(3000))
    # Summary requests take these, never the run's replies (the text must not echo the prompt).
    env.model.script_when(MARKER, *[{"text": f"SUMMARY {i}"} for i in range(20)])
    env.model.script(*tool_replies(30))
    events, thread = subscribe(pod)
    with pod.client(timeout=120) as c:
        run = c.run(INPUT)
    thread.join(120)
    assert not thread.is_alive()
    finished = [e for e in events if e.type == "run.finished"]
    assert len(finished) == 1 and finished[0].data["outcome"] == "finished", finished
    assert finished[0].run_id == run.run_id
    compactions = [e for e in events if e.type == "compaction.finished"]
    assert len(compactions) >= 2
    for e in compactions:
        assert e.run_id == run.run_id and e.data["after_tokens"] < e.data["before_tokens"]
    started = [e.data["call_id"] for e in events if e.type == "tool.started"]
    assert len(started) == len(set(started)) == 30  # no tool call executed twice

    bodies = [r["body"] for r in env.model.requests]
    summaries = [i for i, b in enumerate(bodies) if is_summary_request(kind, b)]
    assert len(summaries) == len(compactions)
    for after in bodies[summaries[0] + 1 :]:  # every request after the first compaction
        if is_summary_request(kind, after):
            continue
        texts = user_texts(kind, after)
        assert texts[0].startswith(SUMMARY_TAG), texts[0][:80]
        assert texts[1] == INPUT
    for body in bodies:
        check_wire(kind, body)

    # The chain on disk: each old session intact, linked by compacted_from, newest is live.
    sessions = env.home / "data" / "sessions"
    infos = {i.id: i for i in list_sessions(sessions)}
    status = pod.call("status")
    chain = [status["session_id"]]
    while infos[chain[-1]].compacted_from:
        chain.append(infos[chain[-1]].compacted_from)
    assert len(chain) == len(compactions) + 1
    results = 0
    for sid in chain:
        entries = read_session(sessions, sid).entries
        results += sum(e["kind"] == "tool_result" for e in entries)
        assert sum(e["kind"] == "run_end" for e in entries) == (1 if sid == chain[0] else 0)
    assert results == 30
    usage = pod.call("usage")
    assert usage["totals"]["calls"] == len(bodies)  # the summaries' calls count too
    shown = env.podctl("sessions", "show", "--chain", chain[0])
    assert shown.returncode == 0, shown.stderr
    heads = [line.split()[2] for line in shown.stdout.splitlines() if line.startswith("== ")]
    assert heads == chain[::-1]
    assert f"(compacted from {chain[1]})" in shown.stdout


def test_notifications_acked_before_a_compaction_are_in_the_first_request_after_it(
    env: Env,
) -> None:
    write_data(env)
    pod = env.start(extra=compaction_toml(1500, retained=1))
    env.model.script(*tool_replies(4))
    env.model.script_when(MARKER, {"text": "SUMMARY", "gate": "summary"})
    with pod.client() as c:
        c.run(INPUT)
    wait_until(lambda: any(is_summary_request("openai", r["body"]) for r in env.model.requests))
    with pod.client() as c:
        ack = c.notify("deploy finished on staging", source="ci")
    assert ack.notification_id
    env.model.open_gate("summary")
    wait_until(lambda: pod.call("status")["state"] == "idle", timeout=30)
    bodies = [r["body"] for r in env.model.requests]
    (i,) = [n for n, b in enumerate(bodies) if is_summary_request("openai", b)]
    texts = user_texts("openai", bodies[i + 1])
    assert texts[0].startswith(SUMMARY_TAG) and texts[1] == INPUT
    assert any("deploy finished on staging" in t for t in texts)


def test_a_run_fed_a_report_every_round_stays_compacted(env: Env) -> None:
    """Every notification the run received was kept verbatim through every compaction: the
    context grew past the threshold for good, and each round asked for a summary again."""
    write_data(env)
    pod = env.start(extra=compaction_toml(3000, retained=1))
    rounds = 16
    env.model.script_when(MARKER, *[{"text": f"SUMMARY {i}"} for i in range(rounds)])
    replies = tool_replies(rounds)
    for i, reply in enumerate(replies[:-1]):
        reply["gate"] = f"round {i}"  # each round answers after its report is acknowledged
    env.model.script(*replies)
    events, thread = subscribe(pod)
    with pod.client() as c:
        c.run(INPUT)
        for i in range(rounds):
            c.notify(f"CI report {i}:\n" + "a line of the build log\n" * 60, source="ci")
            env.model.open_gate(f"round {i}")
    thread.join(60)
    assert [e.data["outcome"] for e in events if e.type == "run.finished"] == ["finished"]
    bodies = [r["body"] for r in env.model.requests]
    summaries = [i for i, b in enumerate(bodies) if is_summary_request("openai", b)]
    assert 1 <= len(summaries) <= rounds // 2, len(summaries)  # not one every round
    after = [
        len(json.dumps(b))
        for b in bodies[summaries[0] + 1 :]
        if not is_summary_request("openai", b)
    ]
    # Bounded: about the threshold (3000 tokens of 4 bytes) plus a round; it grew without end.
    assert max(after) < 20_000, after
    for body in bodies:
        check_wire("openai", body)


# --- crashes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["summary", "first_line", "complete"])
def test_kill_9_during_a_compaction_restores_a_valid_session(env: Env, point: str) -> None:
    write_data(env)
    if point != "summary":
        env.env[CRASH_ENV] = point
    pod = env.start(extra=compaction_toml(1500, retained=1))
    env.env.pop(CRASH_ENV, None)
    env.model.script(*tool_replies(4))
    env.model.script_when(MARKER, {"text": "SUMMARY", "gate": "summary"})
    with pod.client() as c:
        c.run(INPUT)
    wait_until(lambda: any(is_summary_request("openai", r["body"]) for r in env.model.requests))
    with pod.client() as c:
        note = c.notify("acknowledged during the compaction", source="ci")
    if point == "summary":
        pod.kill9()  # the summary has not returned
    else:
        env.model.open_gate("summary")
        wait_until(lambda: pod.proc.poll() is not None, what="the crash point")
    sessions = env.home / "data" / "sessions"
    ids = [i.id for i in list_sessions(sessions) if i.pod == "pod"]
    assert len(ids) == (2 if point == "complete" else 1), ids
    for sid in ids:  # every session on disk verifies; a half-written one is not listed
        read_session(sessions, sid)
    assert not [p for p in sessions.iterdir() if p.suffix == ".tmp"] or point == "first_line"

    env.model.reset()
    env.model.open_gate("summary")
    again = env.restart(pod, "--resume")
    status = again.call("status")
    assert status["session_id"] == ids[0]  # the newest of the chain

    def delivered() -> bool:
        bodies = [r["body"] for r in env.model.requests]
        texts = [t for b in bodies for t in user_texts("openai", b)]
        return any("acknowledged during the compaction" in t for t in texts)

    wait_until(delivered, timeout=30, what="the acknowledged notification (never lost)")
    assert note.notification_id
    entries = read_session(sessions, ids[0]).entries
    assert any(e["kind"] == "run_end" and e.get("interrupted") for e in entries) or (
        entries[0].get("compacted_from") and entries[0].get("active_run")
    )
    again.stop()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_the_run_a_crash_cut_off_while_it_compacted_keeps_its_input_after_the_restart(
    env: Env, kind: str
) -> None:
    """Found by QA: killed during the summary call, the pod restarted, and the run its restart
    note started compacted first from that note on: the acknowledged input went into the
    summary, and the model was told to "continue where you left off" with no task in sight.
    SPEC §3: the compacted history keeps the current run's input verbatim."""
    write_data(env)
    pod = env.start(kind=kind, extra=compaction_toml(1500, retained=1))
    env.model.script(*tool_replies(4))
    env.model.script_when(MARKER, {"text": "SUMMARY", "gate": "summary"})
    with pod.client() as c:
        c.run(INPUT)
    wait_until(lambda: any(is_summary_request(kind, r["body"]) for r in env.model.requests))
    pod.kill9()  # the summary has not returned

    env.model.reset()
    env.model.script_when(MARKER, {"text": "SUMMARY AFTER THE RESTART"})
    env.model.script({"text": "taken up"})
    again = env.restart(pod, "--resume")
    wait_until(lambda: len(env.model.requests) >= 2, what="the summary, then the run's request")
    summary, request = (r["body"] for r in env.model.requests[:2])
    assert is_summary_request(kind, summary) and not is_summary_request(kind, request)
    check_wire(kind, request)
    texts = user_texts(kind, request)
    assert "SUMMARY AFTER THE RESTART" in texts[0]
    assert INPUT in texts, texts
    assert "The pod restarted while your previous run was in progress" in texts[-1]
    again.stop()


def test_a_start_removes_the_temp_files_a_crash_left_but_none_being_written(env: Env) -> None:
    """Found by QA: a compacted session's `.tmp`, left by a power cut while it was written
    (empty, or its first line torn), names no pod: only one whose first line named this pod
    was ever removed (and only at its next compaction), so such a file stayed for good. A
    start now removes them, and its own pod's, but never one a writer holds locked (another
    pod compacting now) nor a readable one of another pod (its own start removes it)."""
    sessions = env.home / "data" / "sessions"
    sessions.mkdir(parents=True, mode=0o700)

    def tmp(pod: str | None, first: bytes = b"") -> Path:
        path = sessions / f"{new_session_id()}.jsonl.tmp"
        if pod is not None:
            first, _ = encode_entry(1, 1.0, "session_start", GENESIS, {"pod": pod})
        path.write_bytes(first)
        return path

    empty, torn, ours = tmp(None), tmp(None, b'{"seq":1,"ts":1.0,"ki'), tmp("pod")
    others, written_now = tmp("other"), tmp(None)
    fd = os.open(written_now, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a writer holds its temp file until the rename
        pod = env.start()
        pod.call("status")  # answered once the start's clean-up (right after READY) is done
        left = sorted(p.name for p in sessions.iterdir() if p.suffix == ".tmp")
    finally:
        os.close(fd)
    assert left == sorted([others.name, written_now.name])
    assert not any(p.exists() for p in (empty, torn, ours))
    pod.stop()


# --- guards and the method -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_summary_request_refused_as_too_long_is_retried_without_its_oldest_rounds(
    env: Env, kind: str
) -> None:
    """Found by QA: with the pod's own model as the summarizer, the summary request carries
    the very context that needs compacting, and a provider refused it as too long: the same
    request three times, the breaker tripped and automatic compaction was off for good. As
    Codex and Claude Code do, the request now drops its oldest rounds until it fits."""
    write_data(env)
    pod = env.start(kind=kind, extra=compaction_toml(1500, retained=1))
    too_long = {
        "fault": {"kind": "status", "status": 400, "message": "prompt is too long: 9999 > 999"}
    }
    env.model.script_when(MARKER, too_long, too_long, *[{"text": f"SUMMARY {i}"} for i in range(9)])
    env.model.script(*tool_replies(6))
    events, thread = subscribe(pod)
    with pod.client(timeout=60) as c:
        done = c.run_wait(INPUT)
    thread.join(60)
    assert (done.outcome, done.text) == ("finished", "all done"), done.error
    types = [e.type for e in events]
    assert "compaction.failed" not in types and "compaction.finished" in types, types
    bodies = [r["body"] for r in env.model.requests]
    summaries = [b for b in bodies if is_summary_request(kind, b)][:3]
    assert len(summaries) == 3
    sizes = [len(json.dumps(b)) for b in summaries]
    assert sizes[0] > sizes[1] > sizes[2], sizes  # each without more of the oldest rounds
    for body in summaries:
        check_wire(kind, body)
    first = user_texts(kind, summaries[0])
    assert first[0] == INPUT
    for body in summaries[1:]:  # the summarizer is told its start is missing
        texts = user_texts(kind, body)
        assert texts[0] == TRIMMED_NOTE and MARKER in texts[-1] and INPUT not in texts
    # The new session keeps what compaction keeps, whatever the summary was made from.
    after = user_texts(kind, bodies[bodies.index(summaries[2]) + 1])
    assert after[0].startswith(SUMMARY_TAG) and after[1] == INPUT


def test_failing_summaries_trip_the_breaker_and_a_manual_compact_resets_it(env: Env) -> None:
    write_data(env)
    pod = env.start(extra=compaction_toml(1500, retained=1))
    failing = {"fault": {"kind": "status", "status": 400, "message": "bad summary"}}
    env.model.script_when(MARKER, failing, failing, failing)
    env.model.script(*tool_replies(6))
    events, thread = subscribe(pod)
    with pod.client(timeout=60) as c:
        c.run(INPUT)
    thread.join(60)
    failed = [e for e in events if e.type == "compaction.failed"]
    alerts = [e for e in events if e.type == "alert" and e.data["source"] == "compaction"]
    assert len(failed) == 3 and len(alerts) == 1, [e.type for e in events]
    finished = [e for e in events if e.type == "run.finished"]
    assert finished[-1].data["outcome"] == "finished"  # the run went on without compacting
    bodies = [r["body"] for r in env.model.requests]
    assert sum(is_summary_request("openai", b) for b in bodies) == 3
    out = env.podctl("compact", "pod")
    assert out.returncode == 0, out.stderr
    new_id = out.stdout.split()[-1]
    assert pod.call("status")["session_id"] == new_id
    env.model.script(*tool_replies(4))
    with pod.client(timeout=60) as c:
        c.run_wait("again")
    bodies = [r["body"] for r in env.model.requests]
    assert sum(is_summary_request("openai", b) for b in bodies) >= 5  # automatic again


def test_a_useless_summary_is_not_repeated_in_that_run(env: Env) -> None:
    write_data(env)
    pod = env.start(extra=compaction_toml(1500, retained=1))
    env.model.script_when(MARKER, {"text": "padding " * 20000}, {"text": "padding " * 20000})
    env.model.script(*tool_replies(6))
    with pod.client(timeout=60) as c:
        result = c.run_wait(INPUT)
    assert result.outcome == "finished"
    bodies = [r["body"] for r in env.model.requests]
    assert sum(is_summary_request("openai", b) for b in bodies) == 1


def test_compact_of_a_pod_with_no_history_says_there_is_nothing_to_compact(env: Env) -> None:
    """It printed "compacted: session " (an empty id) for a pod that had not started one."""
    env.start()
    out = env.podctl("compact", "pod")
    assert (out.returncode, out.stdout, out.stderr) == (0, "nothing to compact yet\n", "")
    assert env.model.requests == []  # no summary was asked for
    # No session yet: null, as status and history say it (it was "").
    assert env.pods[-1].call("compact") == {"session_id": None}
    as_json = env.podctl("compact", "pod", "--json")
    assert json.loads(as_json.stdout) == {"session_id": None}


def test_podctl_cancel_stops_a_compact_whose_summary_hangs(env: Env) -> None:
    """The pod said "running" and `podctl cancel` "nothing to cancel": only a stop ended a
    `podctl compact` whose summary call hung (up to its timeouts times its retries)."""
    pod = env.start()
    with pod.client() as c:
        assert c.run_wait("some history").outcome == "finished"
        sid = c.status().session_id
    env.model.script_when(MARKER, {"text": "never", "gate": "never"})
    compact = env.podctl_popen("compact", "pod")
    env.model.wait_for_requests(2)  # the run's, then the summary's, held at its gate
    cancelled = env.podctl("cancel", "pod")
    assert (cancelled.returncode, cancelled.stdout) == (0, "cancelled\n"), cancelled.stderr
    _, err = compact.communicate(timeout=30)
    assert compact.returncode == 1 and "compaction failed: cancelled" in err, err
    status = pod.call("status")
    assert (status["state"], status["session_id"]) == ("idle", sid)


def test_compact_is_busy_during_a_run_and_resume_picks_the_newest_of_the_chain(
    env: Env,
) -> None:
    pod = env.start()
    env.model.script({"text": "first answer"})
    with pod.client() as c:
        c.run_wait("hello")
        env.model.script({"text": "slow", "gate": "g"})
        c.run("second")
        wait_until(lambda: len(env.model.requests) >= 2)
        busy = env.podctl("compact", "pod")
        assert busy.returncode != 0 and "idle" in busy.stderr
    env.model.open_gate("g")
    wait_until(lambda: pod.call("status")["state"] == "idle")
    old = pod.call("status")["session_id"]
    out = env.podctl("compact", "pod", "--json")
    assert out.returncode == 0, out.stderr
    new = json.loads(out.stdout)["session_id"]
    assert new != old
    pod.stop()
    again = env.restart(pod, "--resume")
    assert again.call("status")["session_id"] == new
    history = again.call("history")
    assert history["entries"][0]["compacted_from"] == old and history["previous"] == old
    # History paging walks back across the chain: the old session, intact, by its id.
    shown = env.podctl("history", "pod", "--all", "--json")
    assert json.loads(shown.stdout)["previous"] == old
    back = env.podctl("history", "pod", "--session", old, "--json")
    assert back.returncode == 0, back.stderr
    kinds = [e["kind"] for e in json.loads(back.stdout)["entries"]]
    assert kinds.count("run_end") == 2 and "session_start" in kinds
    assert env.podctl("sessions", "verify", old).returncode == 0
    again.stop()


def test_sessions_show_chain_shows_what_is_left_when_an_old_session_was_removed(
    env: Env,
) -> None:
    """Nothing removes old sessions but the user; once the oldest of a chain was gone,
    `sessions show --chain NEWEST` printed nothing but "no session OLDEST" and exited 1."""
    pod = env.start()
    chain = []
    for n in range(3):
        with pod.client() as c:
            c.run_wait(f"task {n}")
            chain.append(c.status().session_id)
        if n < 2:
            env.model.script_when(MARKER, {"text": f"SUMMARY {n}"})
            assert env.podctl("compact", "pod").returncode == 0
    oldest, middle, newest = chain
    assert len(set(chain)) == 3
    (env.home / "data" / "sessions" / f"{oldest}.jsonl").unlink()
    shown = env.podctl("sessions", "show", "--chain", newest)
    assert shown.returncode == 0, shown.stderr
    heads = [line.split()[2] for line in shown.stdout.splitlines() if line.startswith("== ")]
    assert heads == [middle, newest]
    assert f"(compacted from {oldest})" in shown.stdout
    assert shown.stderr == f"podctl: {middle} continues session {oldest}, which is not on disk\n"
    missing = env.podctl("sessions", "show", "--chain", oldest)  # the one asked for: an error
    assert missing.returncode == 1 and "no session" in missing.stderr


def test_the_compaction_provider_makes_the_summary_and_its_usage_counts(env: Env) -> None:
    write_data(env)
    extra = compaction_toml(1500, retained=1) + (
        "[compaction.provider]\n"
        'kind = "anthropic"\n'
        'model = "summarizer"\n'
        f'base_url = "{env.model.url}"\n'
        'api_key_env = "FAKE_API_KEY"\n'
    )
    pod = env.start(extra=extra)  # the pod itself speaks openai
    env.model.script_when(MARKER, {"text": "SUMMARY", "usage": {"input": 777, "output": 55}})
    env.model.script(*tool_replies(4))
    with pod.client(timeout=60) as c:
        result = c.run_wait(INPUT)
    assert result.outcome == "finished"
    paths = [r["path"] for r in env.model.requests]
    assert paths.count("/v1/messages") == 1 and "/v1/chat/completions" in paths
    summary = next(r for r in env.model.requests if r["path"] == "/v1/messages")
    assert summary["body"]["model"] == "summarizer"
    calls = pod.call("usage")["calls"]
    (mine,) = [c for c in calls if c["model"] == "summarizer"]
    assert (mine["input"], mine["output"]) == (777, 55)
    assert result.usage.input >= 777  # the run's usage includes its compaction


def test_a_compaction_provider_timeout_names_the_compaction_provider_setting(env: Env) -> None:
    """Found by QA: the summary call timed out at `[compaction.provider]` first_byte_timeout,
    and the error and its alert named `provider.first_byte_timeout`, the pod's own."""
    extra = (
        "[compaction.provider]\n"
        'kind = "openai"\n'
        'model = "summarizer"\n'
        f'base_url = "{env.model.url}/v1"\n'
        'api_key_env = "FAKE_API_KEY"\n'
        "first_byte_timeout = 0.5\n"
        "max_retries = 0\n"
    )
    pod = env.start(extra=extra)
    with pod.client() as c:
        assert c.run_wait("some history").outcome == "finished"
    env.model.script_when(MARKER, {"fault": {"kind": "hang", "seconds": 5}})
    with pod.client() as watcher:
        watcher.subscribe()
        failed = env.podctl("compact", "pod")
        alerts = [
            e.data["message"]
            for e in events_until(watcher, lambda e: e.type == "compaction.failed")
            if e.type == "alert"
        ]
    assert failed.returncode == 1
    setting = "(compaction.provider.first_byte_timeout)"
    assert setting in failed.stderr, failed.stderr
    assert alerts and all(setting in a for a in alerts), alerts


def test_a_missing_compaction_provider_key_fails_start_up_naming_it(env: Env) -> None:
    extra = compaction_toml(1500) + (
        '[compaction.provider]\nkind = "anthropic"\nmodel = "s"\napi_key_env = "NO_SUCH_KEY"\n'
    )
    with pytest.raises(StartFailed) as failed:
        env.start(extra=extra)
    assert "compaction.provider.api_key_env" in failed.value.stderr
    assert "NO_SUCH_KEY" in failed.value.stderr


def test_precompact_and_sessionstart_compact_hooks_run(env: Env) -> None:
    pre = env.work / "precompact.log"
    extra = (
        "[[hooks.PreCompact]]\n"
        f"command = {json.dumps(f'cat >> {pre}; echo >> {pre}')}\n"
        "[[hooks.SessionStart]]\n"
        "command = '''input=$(cat); case \"$input\" in *compact*) echo COMPACT-CONTEXT;; esac'''\n"
    )
    pod = env.start(extra=extra)
    env.model.script({"text": "first"})
    with pod.client() as c:
        c.run_wait("hello")
    out = env.podctl("compact", "pod")
    assert out.returncode == 0, out.stderr
    (event,) = [json.loads(line) for line in pre.read_text().splitlines() if line.strip()]
    assert event["hook_event_name"] == "PreCompact" and event["trigger"] == "manual"

    # The SessionStart hook of the compacted session adds its context for the next request.
    # (it runs in the background: a run may start before it answers, so try a few runs)
    def context_seen() -> bool:
        with pod.client() as c:
            c.run_wait("again")
        last = env.model.requests[-1]["body"]
        return any("COMPACT-CONTEXT" in t for t in user_texts("openai", last))

    wait_until(context_seen, timeout=10, what="the SessionStart(compact) context")


def test_after_a_useless_compaction_a_rejected_request_ends_the_run_context_full(
    env: Env,
) -> None:
    write_data(env)
    pod = env.start(extra=compaction_toml(1500, retained=1))
    env.model.script_when(MARKER, {"text": "padding " * 20000})
    too_long = "prompt is too long: 250000 tokens > 200000 maximum"
    env.model.script(
        *tool_replies(4)[:4], {"fault": {"kind": "status", "status": 400, "message": too_long}}
    )
    with pod.client(timeout=60) as c:
        result = c.run_wait(INPUT)
    assert result.outcome == "error" and result.error is not None
    assert result.error.startswith("context full: ") and too_long in result.error
    bodies = [r["body"] for r in env.model.requests]
    assert sum(is_summary_request("openai", b) for b in bodies) == 1  # not tried again


@pytest.mark.parametrize("stop", ["content_filter", "refusal"])
def test_a_summary_stopped_by_a_content_filter_never_replaces_the_context(
    env: Env, stop: str
) -> None:
    """A refusal ("I can't help with that") came back as the summary and became the whole
    context: every earlier message was replaced by it."""
    kind = "anthropic" if stop == "refusal" else "openai"
    pod = env.start(kind=kind)
    env.model.script({"text": "the precious answer"})
    with pod.client() as c:
        c.run_wait("the precious question")
        sid = c.status().session_id
    refused = {"text": "I cannot help with", "stop": "content_filter"}
    env.model.script_when(MARKER, refused)
    out = env.podctl("compact", "pod")
    assert out.returncode == 1 and "the summary was stopped" in out.stderr, out.stderr
    assert pod.call("status")["session_id"] == sid  # the old session stays
    env.model.script({"text": "next"})
    with pod.client() as c:
        c.run_wait("go on")
    texts = " ".join(user_texts(kind, env.model.requests[-1]["body"]))
    assert "the precious question" in texts and "I cannot help with" not in texts


def test_a_summary_answer_that_calls_a_tool_never_replaces_the_context(env: Env) -> None:
    """Told not to call a tool, a model that went on working answered "Let me read the file
    first" with a call: that preamble was kept as the summary, the whole context."""
    pod = env.start()
    env.model.script({"text": "the precious answer"})
    with pod.client() as c:
        c.run_wait("the precious question")
        sid = c.status().session_id
    working = {"text": "Let me read data.txt first.", "tool_calls": [{"name": "list_dir"}]}
    env.model.script_when(MARKER, working)
    out = env.podctl("compact", "pod")
    assert out.returncode == 1 and "called a tool instead of summarizing" in out.stderr
    assert pod.call("status")["session_id"] == sid  # the old session stays
    env.model.script({"text": "next"})
    with pod.client() as c:
        c.run_wait("go on")
    texts = " ".join(user_texts("openai", env.model.requests[-1]["body"]))
    assert "the precious question" in texts and "Let me read data.txt" not in texts


def test_a_summary_cut_off_at_the_output_limit_is_kept_marked_partial(env: Env) -> None:
    pod = env.start()
    env.model.script({"text": "first"})
    with pod.client() as c:
        c.run_wait("hello")
    env.model.script_when(MARKER, {"text": "the work so far: half of it", "stop": "max_tokens"})
    assert env.podctl("compact", "pod").returncode == 0
    env.model.script({"text": "next"})
    with pod.client() as c:
        c.run_wait("go on")
    texts = " ".join(user_texts("openai", env.model.requests[-1]["body"]))
    assert "the work so far: half of it" in texts and "cut off at the output limit" in texts
    with pod.client(timeout=10) as c:
        c.subscribe(since=0)
        last = c.run("(an event after the alert, to know when to stop)")
        alerts = []
        for event in c.events():
            if event.type == "alert":
                alerts.append(event.data["message"])
            if event.type == "run.finished" and event.run_id == last.run_id:
                break
    assert any("hit the output limit" in a for a in alerts), alerts


def test_why_compaction_failed_and_went_off_is_in_the_pods_log(env: Env) -> None:
    """An empty summary, and the breaker turning automatic compaction off, were events only:
    unlike a provider's failure, nothing reached the pod's log (a unit's journal), so a pod
    nobody subscribed to grew uncompacted without a word anywhere."""
    write_data(env)
    pod = env.start(extra=compaction_toml(1500, retained=1))
    env.model.script_when(MARKER, {"text": ""}, {"text": ""}, {"text": ""})
    env.model.script(*tool_replies(6))
    with pod.client(timeout=60) as c:
        assert c.run_wait(INPUT).outcome == "finished"
    # A thread reads the pod's stderr: its newest lines may not be read when the reply is.
    wait_until(lambda: "automatic compaction is off" in pod.text(), what="the breaker's line")
    text = pod.text()
    assert text.count("compaction failed: the summary was empty") == 3, text


def test_a_compaction_renders_the_instruction_again_so_now_is_not_the_start_day(
    env: Env,
) -> None:
    """SPEC §3's instruction says "Today is {{ now.date() }}". It was rendered once, at start:
    a pod living for days, compacted many times, told the model the day it started on, for
    good. The new session of a compaction starts from the instruction rendered anew (and its
    first entry keeps that prompt, the one its calls carry)."""
    from datetime import datetime

    pod = env.start(instruction="You are a test pod. Now: {{ now.isoformat() }}")
    with pod.client() as c:
        c.run_wait("hello")
    out = env.podctl("compact", "pod", "--json")
    assert out.returncode == 0, out.stderr
    with pod.client() as c:
        c.run_wait("again")
    work = [r["body"] for r in env.model.requests if not is_summary_request("openai", r["body"])]
    before, after = (b["messages"][0]["content"] for b in (work[0], work[-1]))
    stamp = [datetime.fromisoformat(s.rsplit("Now: ", 1)[1]) for s in (before, after)]
    assert stamp[1] > stamp[0], (before, after)
    first = pod.call("history", since=0, limit=1)["entries"][0]
    assert first["kind"] == "session_start" and first["system_prompt"] == after
    assert first["session_id"] == json.loads(out.stdout)["session_id"]


@pytest.mark.parametrize("how", ["tool_call", "content_filter", "cut", "no_usage"])
def test_a_summary_call_that_came_to_nothing_counts_against_the_budget(env: Env, how: str) -> None:
    """A summary answered with a tool call or a refusal, cut mid-answer, or with no usage
    reported: each cost the provider the whole context, yet the pod counted nothing, and a
    capped pod went on compacting (manually, or automatically at every round) for free past
    `max_total_tokens`."""
    pod = env.start(extra="[budget]\nmax_total_tokens = 200\n")
    env.model.script({"text": "the answer", "usage": {"input": 10, "output": 10}})
    with pod.client() as c:
        c.run_wait("the question: " + "x" * 1000)
    summary = "summary " * 100
    reply: dict[str, Any] = {
        "tool_call": {"text": "Let me", "tool_calls": [{"name": "list_dir"}]},
        "content_filter": {"text": "no", "stop": "content_filter"},
        "cut": {"text": summary, "fault": {"kind": "cut", "after_chunks": 2}},
        "no_usage": {"text": summary, "usage": {"input": 0, "output": 0}},
    }[how]
    if how in ("tool_call", "content_filter"):
        reply["usage"] = {"input": 300, "output": 5}
    env.model.script_when(MARKER, reply, reply)
    env.podctl("compact", "pod")
    assert pod.call("status")["budget"]["spent"] > 200
    again = env.podctl("compact", "pod")
    assert again.returncode == 1 and "budget exhausted" in again.stderr, again.stderr
    bodies = [r["body"] for r in env.model.requests]
    assert sum(is_summary_request("openai", b) for b in bodies) == 1


def test_retried_summary_attempts_cut_mid_answer_count_against_the_budget(env: Env) -> None:
    """A summary call whose attempts break mid-answer (a tool call's arguments, nothing shown)
    is retried; each attempt was billed by the provider, as a model call's are, yet only the
    run's model calls counted them: the summary's retries were free."""
    pod = env.start(extra="[budget]\nmax_total_tokens = 100000\n")
    env.model.script({"text": "the answer", "usage": {"input": 10, "output": 10}})
    with pod.client() as c:
        c.run_wait("the question: " + "x" * 1000)
    call = {"name": "write_file", "arguments": {"path": "a.txt", "content": "x" * 400}}
    cut = {"tool_calls": [call], "fault": {"kind": "cut", "after_chunks": 2}}
    env.model.script_when(MARKER, *[cut] * 4)
    out = env.podctl("compact", "pod")
    assert out.returncode == 1, out.stdout
    bodies = [r["body"] for r in env.model.requests]
    assert sum(is_summary_request("openai", b) for b in bodies) == 4
    assert pod.call("usage")["totals"]["calls"] == 1 + 4  # the run's, then every attempt once


def refused_as_too_long(env: Env) -> PodProcess:
    """A pod with a summarizer of a larger window, whose run's tool results took the context
    from under the threshold past the model's window: the provider refused the request, and
    the run ended "context full"."""
    write_data(env)
    extra = compaction_toml(50_000, retained=1) + (
        "[compaction.provider]\n"
        'kind = "anthropic"\n'
        'model = "summarizer"\n'
        f'base_url = "{env.model.url}"\n'
        'api_key_env = "FAKE_API_KEY"\n'
    )
    pod = env.start(extra=extra)
    too_long = "prompt is too long: 250000 tokens > 200000 maximum"
    env.model.script(
        *tool_replies(2)[:2], {"fault": {"kind": "status", "status": 400, "message": too_long}}
    )
    env.model.script_when(MARKER, {"text": "SUMMARY"})
    with pod.client(timeout=60) as c:
        first = c.run_wait(INPUT)
    assert first.outcome == "error" and first.error is not None
    assert first.error.startswith("context full: ")
    return pod


def compacts_before_the_next_run(env: Env, pod: PodProcess) -> None:
    """The next run of a pod refused as too long goes on from a summary, made first."""
    env.model.script({"text": "on it"})
    with pod.client(timeout=60) as c:
        second = c.run_wait("Go on with the task.")
    assert (second.outcome, second.text) == ("finished", "on it")
    paths = [r["path"] for r in env.model.requests]
    assert paths.count("/v1/messages") == 1  # the summary, before the second run's request
    texts = user_texts("openai", env.model.requests[-1]["body"])
    assert texts[0].startswith(SUMMARY_TAG) and texts[-1] == "Go on with the task."


def test_a_context_the_provider_rejected_as_too_long_is_compacted_before_the_next_run(
    env: Env,
) -> None:
    """One round's tool results took the context from under the threshold past the model's
    window: the provider refused the request, and the run ended "context full". Its size was
    still the last call's, under the threshold, so no later run compacted first: every one
    failed "context full" for good, though `[compaction.provider]` (a larger window) could
    summarize it."""
    pod = refused_as_too_long(env)
    compacts_before_the_next_run(env, pod)


def test_a_context_refused_as_too_long_is_compacted_first_after_a_restart(env: Env) -> None:
    """Found by QA: that mark lived in memory only. The pod restarted (a unit's restart, a
    crash) after the run that ended "context full", and its first run sent the same too-long
    history again (the last call's size, under the threshold, is all the log told): one
    more run failed before any compaction."""
    pod = refused_as_too_long(env)
    pod.stop()
    again = env.restart(pod, "--resume")
    compacts_before_the_next_run(env, again)
    again.stop()
