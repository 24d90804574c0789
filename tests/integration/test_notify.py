"""Issue 5: `notify` from any local process, `pod_event`, and the event stream under load.

Real pod processes, real sender processes, the fake model recording every request. The model
sees a notification inside one `<notifications>` block line `- [time] from SOURCE: MESSAGE`.
"""

import asyncio
import contextlib
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from poddaemon.machine import NOTIFY_QUIET
from protocol import PodClient, RpcError
from protocol.aio import AsyncPodClient
from protocol.types import Event
from tests.conftest import (
    BIG_INPUTS,
    ROOT,
    Env,
    PodProcess,
    collect_run,
    drained,
    events_until,
    flood,
)

NOTE_LINE = re.compile(r"^- \[[^\]]*\] from (\S+): (.*)$", re.M)
GATED_TOOL_CALL = {"tool_calls": [{"name": "list_dir", "arguments": {}}]}


# --- helpers -----------------------------------------------------------------------------------


def user_texts(body: dict[str, Any]) -> list[str]:
    """The user-role texts of a Chat Completions request (notifications are rendered there)."""
    out: list[str] = []
    for m in body.get("messages", []):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        else:
            out += [p.get("text", "") for p in content or [] if isinstance(p, dict)]
    return out


def notes_in(body: dict[str, Any]) -> list[tuple[str, str]]:
    """Every (source, first line of message) in the request's <notifications> blocks."""
    return [
        (m.group(1), m.group(2))
        for text in user_texts(body)
        if text.startswith("<notifications>")
        for m in NOTE_LINE.finditer(text)
    ]


def newest_block(body: dict[str, Any]) -> list[tuple[str, str]]:
    """The notifications the request delivers for the first time (its last notifications block)."""
    blocks = [t for t in user_texts(body) if t.startswith("<notifications>")]
    return [(m.group(1), m.group(2)) for m in NOTE_LINE.finditer(blocks[-1])] if blocks else []


def all_history(client: PodClient, page: int = 500) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    since = 0
    while True:
        result = client.history(since=since, limit=page)
        if not result.entries:
            return entries
        assert len(result.entries) <= page
        entries += result.entries
        since = result.next


def system_items(client: PodClient) -> list[dict[str, Any]]:
    return [e for e in all_history(client) if e["kind"] == "system_item"]


def bodies(env: Env) -> list[dict[str, Any]]:
    return [r["body"] for r in env.model.requests]


def assert_contiguous(seqs: list[int], first: int, last: int) -> None:
    assert len(seqs) == len(set(seqs)), "duplicate events"
    assert seqs == list(range(first, last + 1)), "missing or reordered events"


# --- many processes, one busy pod --------------------------------------------------------------

SENDER = r"""
import json, sys
from protocol import PodClient
sock, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with PodClient.connect(sock, timeout=60) as c:
    c.status()
    print("ready", flush=True)
    sys.stdin.readline()  # the barrier: the test releases every sender at once
    ids = [c.notify(f"{k}:{i}", source=f"sender-{k}").notification_id for i in range(n)]
print(json.dumps(ids), flush=True)
"""


def test_8_processes_x_200_notifies_during_a_run(env: Env) -> None:
    senders, per_sender = 8, 200
    total = senders * per_sender
    env.model.script({**GATED_TOOL_CALL, "gate": "g"})  # then: "ok: ..." answers, no tools
    pod = env.start("crowd", extra="[notify]\nmax_pending = 5000\n")
    with pod.client() as c:
        run = c.run("work while they talk")
        env.model.wait_for_requests(1)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", SENDER, pod.socket, str(k), str(per_sender)],
                env=env.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for k in range(senders)
        ]
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline() == "ready\n"
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            acked: dict[str, list[str]] = {}
            for k, p in enumerate(procs):
                out, _ = p.communicate(timeout=60)
                assert p.returncode == 0
                acked[f"sender-{k}"] = json.loads(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert sum(len(v) for v in acked.values()) == total
        status = c.status()
        assert (status.state, status.run_id) == ("running", run.run_id)
        assert status.queue.notifications == total
        assert len(env.model.requests) == 1  # still blocked on the gate

        env.model.open_gate("g")
        drained(pod)

        # All 1,600 are in history, each sender's in the order it sent them.
        items = system_items(c)
        assert len(items) == total
        for source, ids in acked.items():
            mine = [e for e in items if e["source"] == source]
            assert [e["id"] for e in mine] == ids
            n = source.removeprefix("sender-")
            assert [e["text"] for e in mine] == [f"{n}:{i}" for i in range(per_sender)]

    # ... and reached the model: the run's next round first, then notification turns, at most
    # 100 new ones per request, each exactly once, each sender's still in order.
    reqs = bodies(env)
    assert len(newest_block(reqs[1])) == 100  # round 2 of the gated run carried the first batch
    assert all(len(newest_block(b)) <= 100 for b in reqs)
    seen = notes_in(reqs[-1])
    assert len(seen) == total and len(set(seen)) == total
    for k in range(senders):
        order = [int(msg.split(":")[1]) for src, msg in seen if src == f"sender-{k}"]
        assert order == list(range(per_sender))
    assert len(reqs) == 1 + total // 100  # nothing left behind, no empty turns


# --- idle pod: wake, bursts, paused ------------------------------------------------------------


@pytest.mark.parametrize("how", ["pipelined", "batch", "loop"])
def test_burst_of_50_on_an_idle_pod_is_one_turn(env: Env, how: str) -> None:
    pod = env.start("bursty")
    with pod.client() as watcher:
        watcher.subscribe()
        ids, together = _send_burst(pod, how, [f"event {i}" for i in range(50)])
        assert len(set(ids)) == 50
        events = collect_run(watcher)
    drained(pod)
    with pod.client() as c:
        entries = all_history(c)
    assert [e["id"] for e in entries if e["kind"] == "system_item"] == ids
    if not together:
        # The loop was held up for longer than the pod waits for more (a loaded machine): not
        # a burst arriving together, so more than one turn may take it, a request each.
        assert [e["kind"] for e in entries].count("run_start") == len(env.model.requests)
        return
    assert [e.type for e in events].count("run.started") == 1
    assert len(env.model.requests) == 1
    assert [e["kind"] for e in entries].count("run_start") == 1
    block = newest_block(bodies(env)[0])
    assert block == [("burst", f"event {i}") for i in range(50)]
    assert "<notifications> 50 notifications arrived" in json.dumps(bodies(env)[0])


def _send_burst(pod: PodProcess, how: str, messages: list[str]) -> tuple[list[str], bool]:
    """Notify each message as fast as `how` allows; the acknowledged ids, in order, and whether
    they arrived together: no two of them further apart than NOTIFY_QUIET."""
    if how == "loop":  # one call after the other, each waiting for its ack
        ids, spans = [], []  # spans: from sending one to the next one's ack, the most that
        with pod.client() as c:  # their arrivals at the pod can be apart
            sent = time.monotonic()
            for m in messages:
                ids.append(c.notify(m, source="burst").notification_id)
                acked = time.monotonic()
                spans.append(acked - sent)
                sent = acked
        pairs = [a + b for a, b in itertools.pairwise(spans)]
        return ids, max(pairs) < NOTIFY_QUIET
    requests = [
        {"jsonrpc": "2.0", "id": i, "method": "notify", "params": {"message": m, "source": "burst"}}
        for i, m in enumerate(messages)
    ]
    if how == "batch":  # one JSON-RPC batch: one line, one reply line
        frames = msgspec.json.encode(requests) + b"\n"
    else:  # every request written at once on one connection, answered one by one
        frames = b"".join(msgspec.json.encode(r) + b"\n" for r in requests)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(pod.socket)
        sock.sendall(frames)
        replies = _read_replies(sock, 1 if how == "batch" else len(messages))
    if how == "batch":
        (replies,) = replies
    assert all("result" in r for r in replies), replies
    return [r["result"]["notification_id"] for r in sorted(replies, key=lambda r: r["id"])], True


def _read_replies(sock: socket.socket, n: int) -> list[Any]:
    buf = b""
    while buf.count(b"\n") < n:
        chunk = sock.recv(1 << 16)
        assert chunk, "pod closed the connection"
        buf += chunk
    return [json.loads(line) for line in buf.splitlines()]


def test_single_notify_wakes_an_idle_pod(env: Env) -> None:
    pod = env.start("sleeper")
    with pod.client() as c:
        c.subscribe()
        ack = c.notify("disk almost full on /var", source="monitor")
        assert ack.wakes is True and ack.notification_id
        events = collect_run(c)
    assert [e.type for e in events].count("run.started") == 1
    committed = [e for e in events if e.type == "notification.committed"]
    assert committed[0].data == {
        "notification_id": ack.notification_id,
        "source": "monitor",
        "message": "disk almost full on /var",
    }
    assert events[-1].data["outcome"] == "finished"
    drained(pod)
    assert len(env.model.requests) == 1
    (text,) = [t for t in user_texts(bodies(env)[0]) if t.startswith("<notifications>")]
    assert text.startswith("<notifications> notification arrived")
    assert text.rstrip().endswith("</notifications>")
    assert NOTE_LINE.findall(text) == [("monitor", "disk almost full on /var")]
    with pod.client() as c:
        (item,) = system_items(c)
    assert (item["id"], item["source"], item["text"]) == (
        ack.notification_id,
        "monitor",
        "disk almost full on /var",
    )


def test_paused_pod_keeps_notifications_until_resume(env: Env) -> None:
    env.model.script({**GATED_TOOL_CALL, "gate": "p"}, {"text": "resumed"})
    pod = env.start("napper")
    with pod.client() as c:
        c.subscribe()
        run = c.run("work")
        env.model.wait_for_requests(1)
        assert c.pause().paused
        env.model.open_gate("p")
        assert collect_run(c, run.run_id)[-1].data["outcome"] == "paused"

        ack = c.notify("please also check the logs", source="ops")
        assert ack.wakes is False
        # No turn starts on its own: watch the stream for well over the burst window (50 ms,
        # at most 1 s) and see only the commit. (An absence can only be observed for a while.)
        quiet = _events_for(pod, since=ack_seq(c, ack.notification_id) - 1, seconds=1.2)
        assert [e.type for e in quiet] == ["notification.committed"]
        status = c.status()
        assert (status.state, status.queue.notifications) == ("paused", 1)
        assert len(env.model.requests) == 1

        assert c.resume().run_id == run.run_id
        events = collect_run(c, run.run_id)
    started = [e for e in events if e.type == "run.started"]
    assert [e.run_id for e in started] == [run.run_id]
    assert (events[-1].data["outcome"], events[-1].data["text"]) == ("finished", "resumed")
    assert len(env.model.requests) == 2
    assert ("ops", "please also check the logs") in newest_block(bodies(env)[1])
    drained(pod)
    assert len(env.model.requests) == 2


def test_notify_during_a_runs_last_round_gets_its_own_turn(env: Env) -> None:
    # The run's only round is already at the model: there is no next round to carry the
    # notification, so the pod must take it up in a turn of its own right after the run.
    env.model.script({"text": "final answer", "gate": "last"})
    pod = env.start("latecomer")
    with pod.client() as c:
        c.subscribe()
        run = c.run("answer me")
        env.model.wait_for_requests(1)
        ack = c.notify("one more thing", source="late")
        assert ack.wakes is False
        env.model.open_gate("last")
        first = collect_run(c, run.run_id)
        assert first[-1].data["text"] == "final answer"
        second = collect_run(c)
    started = [e.run_id for e in second if e.type == "run.started"]
    assert len(started) == 1 and started[0] != run.run_id
    drained(pod)
    assert len(env.model.requests) == 2
    assert newest_block(bodies(env)[1]) == [("late", "one more thing")]


def test_paused_pod_holds_a_new_run_and_gives_it_the_notifications(env: Env) -> None:
    """A paused pod starts nothing: a new run queues behind the paused one, notifications wait;
    once the paused run is cancelled, the new run starts and carries them."""
    env.model.script({**GATED_TOOL_CALL, "gate": "p"}, {"text": "fresh start"})
    pod = env.start("newrun")
    with pod.client() as c:
        c.subscribe()
        paused = c.run("old work")
        env.model.wait_for_requests(1)
        assert c.pause().paused
        env.model.open_gate("p")
        assert collect_run(c, paused.run_id)[-1].data["outcome"] == "paused"
        assert c.notify("heads up", source="ops").wakes is False
        fresh = c.run("new work")
        assert (fresh.state, fresh.position) == ("queued", 1)
        assert c.status().state == "paused" and len(env.model.requests) == 1
        assert c.cancel(paused.run_id).cancelled
        events = collect_run(c, fresh.run_id)
    assert events[-1].data["text"] == "fresh start"
    drained(pod)
    assert len(env.model.requests) == 2
    texts = user_texts(bodies(env)[1])
    new = texts.index("new work")
    # In the order they came: the notification before the input, the cancel's note after it.
    assert "heads up" in texts[new - 1] and "was cancelled" in texts[new + 1], texts


def ack_seq(c: PodClient, notification_id: str) -> int:
    """The seq of the notification.committed event for `notification_id` on subscribed `c`."""
    for event in c.events():
        if event.type == "notification.committed":
            assert event.data["notification_id"] == notification_id
            return event.seq
    raise AssertionError("event stream ended")


def _events_for(pod: PodProcess, since: int, seconds: float) -> list[Event]:
    """Events after `since` that arrive within `seconds` on a fresh subscription."""
    out: list[Event] = []
    with PodClient.connect(pod.socket, timeout=seconds) as c:
        c.subscribe(since=since)
        try:
            for event in c.events():
                out.append(event)
        except TimeoutError:
            pass
    return out


# --- the queue limit, idempotency, child events ------------------------------------------------


def test_max_pending_exceeded_is_32002_then_recovers(env: Env) -> None:
    env.model.script({**GATED_TOOL_CALL, "gate": "busy"})
    pod = env.start("bounded", extra="[notify]\nmax_pending = 5\n")
    with pod.client() as c:
        c.run("keep busy")
        env.model.wait_for_requests(1)
        acks = [c.notify(f"n{i}", source="load") for i in range(5)]
        with pytest.raises(RpcError) as err:
            c.notify("n5", source="load")
        assert err.value.code == -32002
        assert "queue full" in err.value.message and "max_pending = 5" in err.value.message
        assert c.status().queue.notifications == 5

        env.model.open_gate("busy")
        drained(pod)
        items = system_items(c)
        assert [(e["id"], e["text"]) for e in items] == [
            (a.notification_id, f"n{i}") for i, a in enumerate(acks)
        ]
        assert ("load", "n5") not in [(e["source"], e["text"]) for e in items]
        assert newest_block(bodies(env)[1]) == [("load", f"n{i}") for i in range(5)]

        again = c.notify("n6", source="load")
        assert again.wakes is True
        drained(pod)
    assert newest_block(bodies(env)[-1]) == [("load", "n6")]


def test_an_input_over_max_input_bytes_is_refused_and_a_request_carries_at_most_that(
    env: Env,
) -> None:
    """A notification larger than the model's window, once delivered, stayed in the context:
    every later run failed on it, and so did each compaction's summary. It is refused at the
    door now, and the notifications one request carries are bounded by the same bytes."""
    env.model.script({**GATED_TOOL_CALL, "gate": "busy"})
    pod = env.start("capped", "--set", "worker.max_input_bytes=3000")
    big = "é" * 1501  # 3,002 bytes in UTF-8, in 1,501 characters
    with pod.client() as c:
        c.run("keep busy")
        env.model.wait_for_requests(1)
        for send, size in (
            (lambda: c.notify(big, source="ci"), "3,004 bytes with params.source"),
            (lambda: c.run(big, mode="steer"), "3,002 bytes"),
        ):
            with pytest.raises(RpcError) as err:
                send()
            assert err.value.code == -32602
            assert f"{size}, over worker.max_input_bytes (3,000)" in err.value.message
        fits = [f"{ch}" * 1400 for ch in "abc"]
        for text in fits:
            c.notify(text, source="ci")
        assert c.status().queue.notifications == 3
        env.model.open_gate("busy")
        drained(pod)
    blocks = [newest_block(b) for b in bodies(env)[1:]]
    assert blocks[0] == [("ci", fits[0]), ("ci", fits[1])]  # 2,800 bytes: the third waits
    assert blocks[1] == [("ci", fits[2])]  # and comes in the run's next round
    assert all(big not in json.dumps(b) for b in bodies(env))
    out = env.podctl("notify", "capped", "x" * 3001)
    assert out.returncode == 1 and "over worker.max_input_bytes" in out.stderr, out.stderr


def test_a_retried_key_gets_its_original_result_under_a_lower_max_input_bytes(
    env: Env,
) -> None:
    """An input committed under a larger bound (a pod restarted with a lower one, or one
    upgraded to the default) was refused -32602, 'nothing committed', when its sender retried
    it with its key: it was committed, and runs. The retry gets its original result."""
    pod = env.start("lowered", "--set", "worker.max_input_bytes=100")
    text = "y" * 50
    with pod.client() as c:
        run = c.run(text, client_key="run-key")
        note = c.notify(text, source="ci", client_key="note-key")
    drained(pod)
    pod.stop()
    pod = env.restart(pod, "--resume", "--set", "worker.max_input_bytes=10")
    with pod.client() as c:
        assert c.run(text, client_key="run-key").run_id == run.run_id
        assert c.notify(text, source="ci", client_key="note-key") == note
        with pytest.raises(RpcError) as err:  # a new key is judged by the bound of now
            c.notify(text, source="ci", client_key="other-key")
        assert err.value.code == -32602


def test_a_notifications_source_counts_against_max_input_bytes(env: Env) -> None:
    """A sender chooses the source, and the model reads it with the message: a huge source
    with a one-byte message passed the bound and reached the model whole, the context the
    bound protects overflowing as it did before it. It counts, at the door and per request."""
    env.model.script({**GATED_TOOL_CALL, "gate": "busy"})
    pod = env.start("sourced", "--set", "worker.max_input_bytes=3000")
    with pod.client() as c:
        c.run("keep busy")
        env.model.wait_for_requests(1)
        with pytest.raises(RpcError) as err:
            c.notify("x", source="s" * 3000)
        assert err.value.code == -32602
        assert "3,001 bytes with params.source, over" in err.value.message
        c.notify("a" * 500, source="s" * 1000)
        c.notify("b" * 500, source="t" * 1001)  # 3,001 bytes with the first: it waits
        env.model.open_gate("busy")
        drained(pod)
    blocks = [newest_block(b) for b in bodies(env)[1:]]
    assert blocks[:2] == [[("s" * 1000, "a" * 500)], [("t" * 1001, "b" * 500)]]
    assert all("s" * 3000 not in json.dumps(b) for b in bodies(env))


def test_steers_waiting_are_bounded_by_max_input_bytes_per_request(env: Env) -> None:
    """Each steer was under the bound, but every one waiting went into one model request: a
    burst overflowed the context for good, as one huge input did. They come a request's
    worth at a time, in order, each once, and the run goes on until all have come."""
    env.model.script({**GATED_TOOL_CALL, "gate": "busy"})
    pod = env.start("steered", "--set", "worker.max_input_bytes=3000")
    steers = [ch * 1400 for ch in "abc"]
    with pod.client() as c:
        c.run("keep busy")
        env.model.wait_for_requests(1)
        for text in steers:
            assert c.run(text, mode="steer").state == "steered"
        env.model.open_gate("busy")
        drained(pod)
    requests = [user_texts(b) for b in bodies(env)]
    assert [t for t in requests[1] if t in steers] == steers[:2]  # 2,800 bytes: c waits
    assert [t for t in requests[2] if t in steers] == steers  # (a and b are history now)
    assert len(requests) == 3


def test_a_childs_report_reaches_the_model_within_max_input_bytes(env: Env) -> None:
    """A report (pod_event) cannot be refused as an oversize notify is, its child sending it
    again for ever, and its text went to the model whole: a child's megabyte answer stayed in
    the parent's context for good. The model reads the bound's worth; the entry keeps it all."""
    pod = env.start("parent", "--set", "worker.max_input_bytes=1000")
    text = "k" * 5000
    assert pod.call("pod_event", pod="kid", kind="run.finished", event_id="e1", text=text)
    drained(pod)
    seen = "\n".join(user_texts(bodies(env)[0]))
    assert "k" * 1000 in seen and "k" * 1001 not in seen
    assert "4,000 more bytes cut (worker.max_input_bytes)" in seen
    with pod.client() as c:
        assert [e["detail"] for e in system_items(c)] == [text]


def test_client_key_makes_notify_idempotent(env: Env) -> None:
    env.model.script({**GATED_TOOL_CALL, "gate": "k"})
    pod = env.start("keyed")
    with pod.client() as c:
        c.run("busy")
        env.model.wait_for_requests(1)
        first = c.notify("deploy 42 done", source="cd", client_key="deploy-42")
        retry = c.notify("deploy 42 done", source="cd", client_key="deploy-42")
        assert retry.notification_id == first.notification_id
        with pytest.raises(RpcError) as err:
            c.notify("deploy 43 done", source="cd", client_key="deploy-42")
        assert err.value.code == -32006 and "deploy-42" in err.value.message
        assert c.status().queue.notifications == 1
        env.model.open_gate("k")
        drained(pod)
        # Still the same answer once it was delivered (the key outlives the pending state).
        late = c.notify("deploy 42 done", source="cd", client_key="deploy-42")
        assert late.notification_id == first.notification_id
        items = system_items(c)
    assert [(e["id"], e["text"]) for e in items] == [(first.notification_id, "deploy 42 done")]
    seen = [n for b in bodies(env) for n in newest_block(b)]
    assert seen.count(("cd", "deploy 42 done")) == 1


def test_an_empty_client_key_is_refused_not_ignored(env: Env) -> None:
    """An empty key made no retry idempotent (two notifications, two runs) and said nothing:
    a cron line's `--client-key "$BUILD_ID"` with the variable unset ran its job twice."""
    pod = env.start("emptykey")
    with pod.client() as c:
        for method, params in (
            ("notify", {"message": "m", "client_key": ""}),
            ("run", {"input": "i", "client_key": ""}),
        ):
            with pytest.raises(RpcError) as err:
                c.call_raw(method, params)
            assert err.value.code == -32602 and "client_key" in err.value.message
        assert c.status().queue.notifications == 0
        assert system_items(c) == []


def test_client_key_retry_is_not_acknowledged_before_the_original_is_durable(env: Env) -> None:
    # The original and its retry, pipelined: the original's ack goes out the moment its fsync
    # completes, so a retry acknowledged before it was acknowledged before the entry was durable
    # ("acknowledged means durable"), and would stand even if that fsync failed.
    pod = env.start("keyrace")
    request = {
        "jsonrpc": "2.0",
        "method": "notify",
        "params": {"message": "m", "source": "ci", "client_key": "job-1"},
    }
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(pod.socket)
        sock.sendall(b"".join(msgspec.json.encode({**request, "id": i}) + b"\n" for i in (1, 2)))
        replies = _read_replies(sock, 2)
    assert len({r["result"]["notification_id"] for r in replies}) == 1
    assert [r["id"] for r in replies] == [1, 2]


def test_pod_event_is_a_child_event_and_a_notification(env: Env) -> None:
    pod = env.start("parent")
    with pod.client() as c:
        c.subscribe()
        ack = c.pod_event("kid", "run.finished", run_id="r-123", text="tests pass")
        assert ack.accepted is True
        events = collect_run(c)
    child = [e for e in events if e.type == "child.event"]
    assert len(child) == 1
    assert child[0].run_id == "r-123"
    assert child[0].data == {"pod": "kid", "kind": "run.finished", "text": "tests pass"}
    committed = [e for e in events if e.type == "notification.committed"]
    assert [e.data["source"] for e in committed] == ["pod:kid"]
    assert "tests pass" in committed[0].data["message"]
    drained(pod)
    (block,) = [newest_block(b) for b in bodies(env)]
    assert len(block) == 1 and block[0][0] == "pod:kid" and "tests pass" in block[0][1]


def test_a_refused_pod_event_leaves_no_child_event(env: Env) -> None:
    env.model.script({**GATED_TOOL_CALL, "gate": "full"})
    pod = env.start("fullparent", extra="[notify]\nmax_pending = 1\n")
    with pod.client() as c:
        c.run("busy")
        env.model.wait_for_requests(1)
        c.notify("fills the queue", source="load")
        c.subscribe()
        with pytest.raises(RpcError) as err:
            c.pod_event("kid", "run.finished", text="refused report")
        assert err.value.code == -32002
        env.model.open_gate("full")
        events = collect_run(c)
    # The child was told no (it will retry): subscribers must not see a report the pod refused.
    assert [e for e in events if e.type == "child.event"] == []


def test_notify_to_a_pod_out_of_budget_does_not_claim_to_wake_it(env: Env) -> None:
    env.model.script({"text": "spent", "usage": {"input": 100, "output": 10}})
    pod = env.start("broke", extra="[budget]\nmax_total_tokens = 50\n")
    with pod.client() as c:
        assert c.run_wait("spend it").outcome == "finished"
        try:
            ack = c.notify("anyone there?", source="ops")
        except RpcError as exc:  # refusing it outright would be honest too
            assert exc.code == -32007
            return
        status = c.status()
    # Accepted: it is kept (durable, pending) but no turn can run, so it must not say it wakes.
    assert (status.state, status.queue.notifications) == ("idle", 1)
    assert ack.wakes is False


# --- the event stream: reconnects, gaps, slow subscribers --------------------------------------


def test_resubscribe_with_since_misses_and_repeats_nothing(env: Env) -> None:
    env.model.script(
        {"text": "a" * 600, "gate": "a"},  # 30 deltas, produced while nobody listens
        {"text": "b" * 600, "gate": "b"},  # produced while the second connection catches up
    )
    pod = env.start("streamer")
    with pod.client() as first:
        first.subscribe(since=0)
        run_a = first.run("first")
        seen = events_until(first, lambda e: e.type == "run.started" and e.run_id == run_a.run_id)
    last = seen[-1].seq
    with pod.client() as c:  # while disconnected: notifications, a queued run, run A's output
        acks = [c.notify(f"while away {i}", source="away") for i in range(20)]
        run_b = c.run("second")
        assert run_b.state == "queued"
        env.model.open_gate("a")
        env.model.wait_for_requests(2)  # A finished; B is blocked on its gate
    with pod.client() as again:
        cursor = again.subscribe(since=last).cursor
        assert cursor > last
        env.model.open_gate("b")
        rest = events_until(again, lambda e: e.type == "run.finished" and e.run_id == run_b.run_id)
        rest += events_until(again, lambda e: e.type == "state.changed")
    seqs = [e.seq for e in seen] + [e.seq for e in rest]
    assert_contiguous(seqs, seqs[0], rest[-1].seq)  # from the pod's first event on
    assert "gap" not in [e.type for e in rest]
    texts = {
        r: "".join(e.data["text"] for e in rest if e.type == "text.delta" and e.run_id == r)
        for r in (run_a.run_id, run_b.run_id)
    }
    assert texts == {run_a.run_id: "a" * 600, run_b.run_id: "b" * 600}
    committed = [e.data["notification_id"] for e in rest if e.type == "notification.committed"]
    assert committed == [a.notification_id for a in acks]
    assert rest[-1].data == {"state": "idle"}


FLOODABLE = "[notify]\nmax_pending = 100000\n"


def test_replay_buffer_overflow_is_a_gap_event(env: Env) -> None:
    pod = env.start("flood", extra=FLOODABLE)
    flood(pod, 10_100)  # the pod holds the last 10,000 events
    drained(pod)  # the turns the flood woke are over: the window below stays put
    with pod.client() as c:
        head = c.subscribe(since=0).cursor
        events = events_until(c, lambda e: e.seq >= head)
    assert events[0].type == "gap" and events[0].data["since"] < events[0].seq  # (this life's 0)
    oldest = events[0].seq + 1
    assert head - oldest + 1 == 10_000
    assert_contiguous([e.seq for e in events[1:]], oldest, head)
    with pod.client() as c:  # a cursor the pod still holds: no gap
        c.subscribe(since=head - 50)
        tail = events_until(c, lambda e: e.seq >= head)
    assert_contiguous([e.seq for e in tail], head - 49, head)


def test_a_cursor_kept_across_a_restart_gets_a_gap_not_the_wrong_events(env: Env) -> None:
    """A client keeps its cursor, the pod restarts and publishes again: resuming with the old
    cursor must say `gap` (each life numbered from 1, so the new events at or below the old
    cursor were skipped silently, and the rest replayed as if nothing had been missed)."""
    pod = env.start("lives")
    with pod.client() as c:
        assert c.run_wait("first life").outcome == "finished"
        cursor = c.subscribe().cursor
        assert c.run_wait("missed: before the restart").outcome == "finished"
    assert pod.stop() == 0
    again = env.restart(pod, "--resume")
    with again.client() as c:
        for text in ("after 1", "after 2"):
            assert c.run_wait(text).outcome == "finished"
        head = c.subscribe(since=cursor).cursor
        events = events_until(c, lambda e: e.seq >= head)
    assert events[0].type == "gap" and events[0].data == {"since": cursor}
    finished = [e.data["text"] for e in events if e.type == "run.finished"]
    assert len(finished) == 2  # both runs of this life, none skipped


def test_a_subscriber_that_never_reads_does_not_slow_the_pod(env: Env) -> None:
    # A 2 MB notification is one 2 MB event frame: more than the never-reading connection's
    # socket buffer plus the pod's per-connection high-water mark (1 MiB), so that connection is
    # congested from then on. The turn it starts streams 10,100 text deltas: more than the 10,000
    # events the pod holds for replay, so the stuck one must be left behind, not buffered for.
    big = "B" * 2_000_000
    deltas = 10_100
    text = "".join(f"{i:019d}." for i in range(deltas))
    env.model.script({"text": text}, {"text": "short and sweet"})
    pod = env.start("sluggish", *BIG_INPUTS, extra=FLOODABLE)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(pod.socket)
    request = {"jsonrpc": "2.0", "id": 1, "method": "subscribe", "params": {"since": 0}}
    stuck.sendall(msgspec.json.encode(request) + b"\n")  # ... and never reads
    latencies: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        with pod.client(timeout=10) as p:
            while not stop.is_set():
                t0 = time.monotonic()
                p.status()
                latencies.append(time.monotonic() - t0)
                stop.wait(0.01)  # pacing, so the probe measures the pod rather than loading it

    try:
        with pod.client() as reader:
            cursor = reader.subscribe().cursor
            pinger = threading.Thread(target=ping, daemon=True)
            pinger.start()
            t0 = time.monotonic()
            assert reader.notify(big, source="firehose").wakes
            events = collect_run(reader)
            elapsed = time.monotonic() - t0
            stop.set()
            pinger.join(10)
            assert events[-1].data["outcome"] == "finished"
            assert elapsed < 30, f"the run took {elapsed:.1f}s"
            assert latencies and max(latencies) < 2.0, f"status took {max(latencies):.2f}s"
            # The reader got every event: no gap, nothing missing, the whole text.
            assert "gap" not in [e.type for e in events]
            assert_contiguous([e.seq for e in events], cursor + 1, events[-1].seq)
            assert events[0].type == "notification.committed"
            assert events[0].data["message"] == big
            assert "".join(e.data["text"] for e in events if e.type == "text.delta") == text
            # The pod goes on serving: another run, promptly.
            assert reader.run_wait("again").text == "short and sweet"
        flood(pod, 10_100)  # more events than the pod holds: the stuck one must be left behind
        drained(pod)  # the turns the flood woke are over: no event after `head` below
        with pod.client() as h:
            head = h.subscribe().cursor
        # When the stuck subscriber reads at last, it finds what it was given before it was
        # left behind, then `gap` (the pod did not hoard its events), then the held tail.
        stuck.settimeout(30)
        got = _drain_events(stuck, head)
        (at,) = [i for i, e in enumerate(got) if e["type"] == "gap"]
        before, gap, after = got[:at], got[at], got[at + 1 :]
        assert_contiguous([e["seq"] for e in before], before[0]["seq"], gap["data"]["since"])
        assert [e["type"] for e in before][-1:] == ["notification.committed"]
        assert_contiguous([e["seq"] for e in after], gap["seq"] + 1, head)
        assert head - gap["seq"] == 10_000
    finally:
        stop.set()
        stuck.close()


def _drain_events(sock: socket.socket, head: int) -> list[dict[str, Any]]:
    buf = b""
    events: list[dict[str, Any]] = []
    while not events or events[-1]["seq"] < head:
        chunk = sock.recv(1 << 20)
        assert chunk, "pod closed the connection"
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if msg.get("method") == "event":
                events.append(msg["params"])
    return events


# --- clients: podctl, sync, async, examples ----------------------------------------------------


def test_podctl_notify_prints_the_id(env: Env) -> None:
    pod = env.start("cli")
    out = env.podctl("notify", "cli", "nightly build failed", "--source", "jenkins")
    assert out.returncode == 0, out.stderr
    nid = out.stdout.split()[0]
    drained(pod)
    with pod.client() as c:
        (item,) = system_items(c)
    assert (item["id"], item["source"], item["text"]) == (nid, "jenkins", "nightly build failed")
    assert env.podctl("notify", "nobody", "hello").returncode == 3


def test_sync_and_async_clients_notify(env: Env) -> None:
    env.model.script({**GATED_TOOL_CALL, "gate": "c"})
    pod = env.start("clients")
    with PodClient.connect("clients") as c:  # by name, through the runtime dir
        c.run("busy")
        env.model.wait_for_requests(1)
        sync_ack = c.notify("from sync", source="sync-client")

    async def main() -> tuple[str, bool]:
        async with await AsyncPodClient.connect("clients") as ac:
            acks = await asyncio.gather(
                *(ac.notify(f"from async {i}", source="async-client") for i in range(5))
            )
            assert len({a.notification_id for a in acks}) == 5
            return acks[0].notification_id, acks[0].wakes

    async_id, async_wakes = asyncio.run(main())
    assert sync_ack.wakes is False and async_wakes is False  # the pod is running
    env.model.open_gate("c")
    drained(pod)
    with pod.client() as c:
        items = system_items(c)
    assert items[0]["id"] == sync_ack.notification_id
    assert async_id in [e["id"] for e in items]
    block = newest_block(bodies(env)[1])
    assert ("sync-client", "from sync") in block
    assert sorted(m for s, m in block if s == "async-client") == [
        f"from async {i}" for i in range(5)
    ]


EXAMPLES = ROOT / "examples"


def test_watch_and_notify_once(env: Env) -> None:
    pod = env.start("watcher")
    watched = env.home / "watched"
    watched.mkdir()
    (watched / "a.txt").write_text("a")
    (watched / "b.txt").write_text("b")
    state = env.home / "watch-state.json"

    def once(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "watch_and_notify.py"),
                str(watched),
                "watcher",
                "--once",
                "--state",
                str(state),
                *extra,
            ],
            env=env.env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    first = once()
    assert first.returncode == 0, first.stderr
    drained(pod)
    b = watched / "b.txt"
    b.write_text("bb")
    st = os.stat(b)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    (watched / "a.txt").unlink()
    (watched / "c.txt").write_text("c")
    second = once()
    assert second.returncode == 0, second.stderr
    drained(pod)
    third = once()
    assert (third.returncode, third.stdout.strip()) == (0, "no changes")

    with pod.client() as c:
        items = system_items(c)
    assert [e["source"] for e in items] == [f"watch:{watched}"] * 2
    assert [e["id"] for e in items] == [first.stdout.split()[0], second.stdout.split()[0]]
    assert items[0]["text"].splitlines()[1:] == ["+ a.txt", "+ b.txt"]
    assert items[1]["text"].splitlines() == [
        f"3 file(s) changed in {watched}:",
        "- a.txt",
        "~ b.txt",
        "+ c.txt",
    ]
    assert "~ b.txt" in json.dumps(bodies(env)[-1])


def test_watch_and_notify_says_what_is_wrong_with_its_state_file(env: Env) -> None:
    """Found by QA: a --state in a missing directory was saved after the notify went, and
    "notify failed" was said of a notification the pod had (a retry sent it twice); a state
    file that was not the script's was a traceback."""
    pod = env.start("stately")
    watched = env.home / "watched"
    watched.mkdir()

    def once(state: Path) -> subprocess.CompletedProcess[str]:
        script = str(EXAMPLES / "watch_and_notify.py")
        cmd = [sys.executable, script, str(watched), "stately", "--once", "--state", str(state)]
        return subprocess.run(cmd, env=env.env, capture_output=True, text=True, timeout=30)

    nowhere = env.home / "nodir" / "w.json"
    refused = once(nowhere)
    assert refused.returncode == 2 and f"no directory {nowhere.parent}" in refused.stderr
    for junk in ("garbage", "[]", '{"a": 1}'):
        state = env.home / "junk.json"
        state.write_text(junk)
        refused = once(state)
        assert refused.returncode == 2, refused.stderr
        assert "Traceback" not in refused.stderr
        assert "cannot read it" in refused.stderr or "not a state file" in refused.stderr
    with pod.client() as c:
        assert system_items(c) == []  # nothing was sent for any of them


def test_watch_and_notify_reports_a_file_whose_name_is_not_utf8(env: Env) -> None:
    """A file named in Latin-1 (an unpacked archive, a Samba share) in the watched directory
    made every `--once` run end in a UnicodeEncodeError traceback, its state never saved, and
    the polling watcher die: Python keeps such a name's bytes as lone surrogates, which no
    JSON encoder sends. Its bytes are now shown as \\xNN; the baseline keeps the real name."""
    pod = env.start("watcher")
    watched = env.home / "watched"
    watched.mkdir()
    os.close(os.open(bytes(watched) + b"/caf\xe9.txt", os.O_CREAT | os.O_WRONLY, 0o600))
    (watched / "ok.txt").write_text("ok")
    args = [sys.executable, str(EXAMPLES / "watch_and_notify.py"), str(watched), "watcher"]
    args += ["--once", "--state", str(env.home / "watch-state.json")]

    first = subprocess.run(args, env=env.env, capture_output=True, text=True, timeout=30)
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr
    assert first.stdout.endswith("\t2 change(s)\n"), first.stdout
    drained(pod)
    again = subprocess.run(args, env=env.env, capture_output=True, text=True, timeout=30)
    assert (again.returncode, again.stdout) == (0, "no changes\n"), again.stderr

    with pod.client() as c:
        (item,) = system_items(c)
    assert item["id"] == first.stdout.split()[0]
    assert item["text"].splitlines()[1:] == ["+ caf\\xe9.txt", "+ ok.txt"]


def test_watch_and_notify_outlives_a_pod_that_goes_before_it_answers(env: Env) -> None:
    """A pod that closed the connection before answering (restarted, crashed mid-call) raised
    ConnectionClosed, which the watcher did not catch: the polling watcher died with a
    traceback, and `--once` printed one instead of its one-line "notify failed" (exit 1).
    Here a socket stands in for such a pod: it takes each request and hangs up."""
    path = env.home / "gone.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(8)

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                conn.recv(65536)
                conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    watched = env.home / "watched"
    watched.mkdir()
    (watched / "a.txt").write_text("a")
    args = [sys.executable, str(EXAMPLES / "watch_and_notify.py"), str(watched), str(path)]
    args += ["--since", "0"]
    try:
        once = subprocess.run(
            [*args, "--once"], env=env.env, capture_output=True, text=True, timeout=30
        )
        assert once.returncode == 1, once
        assert once.stderr.startswith("notify failed: ") and "Traceback" not in once.stderr
        assert len(once.stderr.splitlines()) == 1, once.stderr

        polling = subprocess.Popen(
            [*args, "--interval", "0.1"], env=env.env, stderr=subprocess.PIPE, text=True
        )
        try:
            assert polling.stderr is not None
            # Two failures in a row: it outlived the first and tried again.
            lines = [polling.stderr.readline() for _ in range(2)]
            assert all(x.startswith("notify failed, will retry: ") for x in lines), lines
            assert polling.poll() is None
        finally:
            polling.kill()
            polling.wait(10)
    finally:
        listener.close()


def test_watch_and_notify_run_by_a_python_without_the_venv_says_so_in_one_line() -> None:
    """Its shebang finds the system's python3, which lacks msgspec: one line saying to use the
    venv, not a ModuleNotFoundError traceback (`-S`: this venv's site-packages left out)."""
    proc = subprocess.run(
        [sys.executable, "-S", str(EXAMPLES / "watch_and_notify.py"), ".", "pod", "--once"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert ".venv/bin/python" in proc.stderr and "msgspec" in proc.stderr, proc.stderr


def test_ci_notify_script(env: Env) -> None:
    pod = env.start("ci-target")
    run = subprocess.run(
        ["sh", str(EXAMPLES / "ci_notify.sh"), "ci-target", "pipeline 7 failed"],
        env={**env.env, "PODCTL": str(Path(sys.executable).parent / "podctl")},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    drained(pod)
    with pod.client() as c:
        (item,) = system_items(c)
    assert (item["id"], item["source"]) == (run.stdout.split()[0], "ci")


def test_the_examples_exit_as_podctl_does(env: Env) -> None:
    """Found by QA: the watcher exited 1 for a pod that is not running and the CI hook 64 for a
    usage error, where podctl exits 3 and 2: a script around both had two meanings to test."""
    watched = env.home / "watched"
    watched.mkdir()
    (watched / "a.txt").write_text("a")
    watcher = [sys.executable, str(EXAMPLES / "watch_and_notify.py"), str(watched), "ghost"]
    ghost = subprocess.run(
        [*watcher, "--once", "--since", "0"],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ghost.returncode == 3, ghost
    assert ghost.stderr.startswith("notify failed: pod 'ghost' is not running"), ghost.stderr
    usage = subprocess.run(
        ["sh", str(EXAMPLES / "ci_notify.sh"), "only-a-pod"],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert usage.returncode == 2 and usage.stderr.startswith("usage: "), usage
