"""Issue 9, items 1-4 and the client side of 6: the control socket as shell scripts, broken or
hostile clients and other users meet it. Real pods, real sockets, real socat."""

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol import PodClient, RpcError, oneshot
from protocol.aio import AsyncPodClient
from protocol.errors import Busy, FrameTooLarge, NotPaused, QueueFull, UnsafeSocket
from protocol.framing import DEFAULT_MAX_FRAME_BYTES
from tests.conftest import BIG_INPUTS, ROOT, Env, PodProcess, drained, wait_until

NOTIFY_LINE = b'{"jsonrpc":"2.0","id":1,"method":"notify","params":{"message":"hi"}}\n'


def raw(pod: PodProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(pod.socket)
    return sock


def read_until_eof(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(1 << 16):
        out += chunk
    return out


def replies(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def rpc(sock: socket.socket, line: bytes) -> dict[str, Any]:
    """Send one line and read one reply line on a raw socket (no events subscribed)."""
    sock.sendall(line)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1 << 16)
        assert chunk, "the pod closed the connection"
        buf += chunk
    reply: dict[str, Any] = json.loads(buf)
    return reply


def history_notes(pod: PodProcess) -> list[str]:
    with pod.client() as c:
        entries = c.history(limit=1000).entries
    return [str(e) for e in entries if "notification" in str(e.get("kind", ""))]


# --- the method table and typed errors, end to end ----------------------------------------------


def test_application_errors_are_their_own_classes(env: Env) -> None:
    env.model.script({"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "busy"})
    pod = env.start(extra="[notify]\nmax_pending = 1\n")
    with pod.client() as c:
        with pytest.raises(NotPaused) as not_paused:
            c.resume()
        assert isinstance(not_paused.value, RpcError) and not_paused.value.code == -32001
        c.run("keep busy")
        env.model.wait_for_requests(1)
        c.notify("first", source="load")
        try:
            c.notify("second", source="load")
        except QueueFull as exc:  # the point: callers can catch the one error they expect
            assert exc.code == -32002 and "queue full" in exc.message
        else:
            raise AssertionError("no QueueFull")
        with pytest.raises(Busy):  # compact is in the table: answered, not -32601
            c.compact()
        env.model.open_gate("busy")


# --- item 1: a client that half-closes still gets its replies -----------------------------------


@pytest.mark.skipif(shutil.which("socat") is None, reason="socat is not installed")
def test_socat_notify_prints_the_reply(env: Env) -> None:
    pod = env.start()
    for i in range(3):
        line = NOTIFY_LINE.replace(b'"id":1', b'"id":%d' % (i + 1))
        proc = subprocess.run(
            ["socat", "-", f"UNIX-CONNECT:{pod.socket}"],
            input=line,
            capture_output=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        [reply] = replies(proc.stdout)
        assert reply["id"] == i + 1 and reply["result"]["notification_id"], reply


@pytest.mark.skipif(shutil.which("socat") is None, reason="socat is not installed")
def test_socat_run_with_wait_prints_the_outcome(env: Env) -> None:
    """socat waits -t seconds for the reply after its stdin ends; the pod closes once it has
    answered, so socat returns as soon as the run is over."""
    env.model.script({"text": "all good", "delay": 0.3})
    pod = env.start()
    line = b'{"jsonrpc":"2.0","id":1,"method":"run","params":{"input":"check","wait":true}}\n'
    proc = subprocess.run(
        ["socat", "-t", "30", "-", f"UNIX-CONNECT:{pod.socket}"],
        input=line,
        capture_output=True,
        timeout=30,
    )
    [reply] = replies(proc.stdout)
    assert reply["result"]["outcome"] == "finished" and reply["result"]["text"] == "all good"


def test_half_closed_raw_socket_gets_every_reply_then_eof(env: Env) -> None:
    pod = env.start()
    sock = raw(pod)
    lines = [
        b'{"jsonrpc":"2.0","id":1,"method":"status"}\n',
        NOTIFY_LINE.replace(b'"id":1', b'"id":2'),
        # the last line without its newline: EOF ends it
        b'{"jsonrpc":"2.0","id":3,"method":"notify","params":{"message":"no newline"}}',
    ]
    sock.sendall(b"".join(lines))
    sock.shutdown(socket.SHUT_WR)
    got = replies(read_until_eof(sock))
    sock.close()
    assert [r["id"] for r in got] == [1, 2, 3]
    assert all("result" in r for r in got), got
    assert got[2]["result"]["notification_id"]


def pod_sockets(pod: PodProcess) -> set[str]:
    """The sockets the pod holds open (`socket:[inode]`, unique while open)."""
    held = set()
    fd_dir = f"/proc/{pod.proc.pid}/fd"
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith("socket:"):
                held.add(target)
    return held


SUBSCRIBE_LINE = b'{"jsonrpc":"2.0","id":1,"method":"subscribe","params":{}}\n'


def test_a_subscriber_that_closes_is_let_go_by_an_idle_pod(env: Env) -> None:
    """`podctl attach` interrupted: the client closed, and nothing is published for a while.
    The pod used to keep each such connection until an event write failed: an idle pod ran
    out of fds after ~1,000 attaches and answered nobody again."""
    pod = env.start()
    before = pod_sockets(pod)
    for _ in range(30):
        with raw(pod) as sock:
            assert "cursor" in rpc(sock, SUBSCRIBE_LINE)["result"]
    wait_until(lambda: pod_sockets(pod) <= before, what="the pod to let go of 30 subscribers")


def test_a_half_closed_subscriber_gets_events_and_is_let_go_once_it_closes(env: Env) -> None:
    """`printf subscribe | socat`: the client's writing half is shut but it still reads, so
    the events go on; when it closes for good later, the pod lets go of it though nothing is
    published (the pod is kept busy, so the notification starts nothing that would be)."""
    env.model.script({"gate": "g", "text": "done"})
    pod = env.start()
    with pod.client() as c:
        c.run("block")
    env.model.wait_for_requests(1)
    before = pod_sockets(pod)
    sock = raw(pod)
    sock.sendall(SUBSCRIBE_LINE)
    sock.shutdown(socket.SHUT_WR)
    with pod.client() as c:
        c.notify("still listening?")
    got = b""
    while b"notification.committed" not in got:
        chunk = sock.recv(1 << 16)
        assert chunk, f"the pod closed a half-closed subscriber: {got!r}"
        got += chunk
    assert pod_sockets(pod) - before, "the subscriber's connection is held"
    sock.close()
    wait_until(lambda: pod_sockets(pod) <= before, what="the pod to let go of the subscriber")
    env.model.open_gate("g")


@pytest.mark.parametrize("how", ["no newline", "behind 128 requests"])
def test_a_subscribe_read_with_the_eof_still_streams_events(env: Env, how: str) -> None:
    """`printf '{...subscribe...}' | socat` (no newline: the EOF ends the line), or a subscribe
    read behind a full pipeline: the connection was closed right after the subscribe reply,
    before the subscription began, and the client got no event."""
    pod = env.start()
    sock = raw(pod)
    line = SUBSCRIBE_LINE.replace(b'"id":1', b'"id":999')
    if how == "no newline":
        sock.sendall(line.rstrip(b"\n"))
    else:
        sock.sendall(NOTIFY_LINE * 128 + line)
    sock.shutdown(socket.SHUT_WR)
    got = b""
    while b'"id":999' not in got:
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed before the subscribe reply: {got[-300:]!r}"
        got += chunk
    with pod.client() as c:
        c.notify("still streaming?")
    while b"still streaming?" not in got:
        chunk = sock.recv(1 << 16)
        assert chunk, "the pod closed a half-closed subscriber before its first event"
        got += chunk
    sock.close()


@pytest.mark.parametrize(
    ("first", "answer", "run_reply"),
    [
        ("cancel", {"cancelled": False}, {"outcome": "finished"}),
        ("pause", {"paused": False}, {"outcome": "finished"}),
        ("shutdown", {"ok": True}, {"code": -32004}),
    ],
)
def test_pipelined_requests_are_decided_in_the_order_sent(
    env: Env, first: str, answer: dict[str, Any], run_reply: dict[str, Any]
) -> None:
    """`printf 'cancel\nrun\n' | socat`: the cancel came first, so it finds nothing to cancel
    and the run runs (a command handled in a task used to reach the machine after the run,
    and cancelled it); a run after an acknowledged shutdown is refused."""
    pod = env.start()
    sock = raw(pod)
    sock.sendall(
        b'{"jsonrpc":"2.0","id":1,"method":"%b"}\n' % first.encode()
        + b'{"jsonrpc":"2.0","id":2,"method":"run","params":{"input":"hi","wait":true}}\n'
    )
    sock.shutdown(socket.SHUT_WR)
    got = {r["id"]: r for r in replies(read_until_eof(sock))}
    sock.close()
    assert got[1]["result"] == answer
    reply = got[2].get("result") or got[2]["error"]
    assert {k: reply[k] for k in run_reply} == run_reply, got[2]


def test_a_started_run_has_no_position_and_a_queued_one_has(env: Env) -> None:
    """SPEC §5: `{run_id, state, position?}`: the field is there for a queued run only."""
    env.model.script({"gate": "g", "text": "done"})
    pod = env.start()
    sock = raw(pod)
    line = b'{"jsonrpc":"2.0","id":%d,"method":"run","params":{"input":"%b"}}\n'
    started = rpc(sock, line % (1, b"first"))["result"]
    queued = rpc(sock, line % (2, b"second"))["result"]
    assert started.keys() == {"run_id", "state"} and started["state"] == "started"
    assert (queued["state"], queued["position"]) == ("queued", 1)
    env.model.open_gate("g")
    sock.close()


def test_half_closed_run_wait_gets_the_reply_when_the_run_ends(env: Env) -> None:
    env.model.script({"text": "finished late", "gate": "w"})
    pod = env.start()
    sock = raw(pod)
    sock.sendall(b'{"jsonrpc":"2.0","id":7,"method":"run","params":{"input":"go","wait":true}}\n')
    sock.shutdown(socket.SHUT_WR)
    env.model.wait_for_requests(1)  # the run is under way, its reply not yet due
    env.model.open_gate("w")
    [reply] = replies(read_until_eof(sock))
    sock.close()
    assert reply["id"] == 7
    assert reply["result"]["outcome"] == "finished" and reply["result"]["text"] == "finished late"


# --- item 2: an oversize request fails fast -----------------------------------------------------


def test_client_refuses_a_frame_over_the_limit_before_sending(env: Env) -> None:
    pod = env.start()
    with pod.client(timeout=10) as c:
        started = time.monotonic()
        with pytest.raises(FrameTooLarge) as info:
            c.run("x" * (9 * 1024 * 1024))
        assert time.monotonic() - started < 2
        assert str(DEFAULT_MAX_FRAME_BYTES) in info.value.message
        assert isinstance(info.value, RpcError) and info.value.code == -32600
        assert c.status().state == "idle"  # nothing was sent: the connection is as it was


def test_pod_error_for_an_oversize_frame_answers_the_request(env: Env) -> None:
    """A client whose limit is above the pod's: the pod's -32600 ends the call, no hang."""
    pod = env.start()
    with PodClient.connect(pod.socket, timeout=20, max_frame_bytes=64 << 20) as c:
        with pytest.raises(RpcError) as info:
            c.run("x" * (9 * 1024 * 1024))
        assert info.value.code == -32600 and "max_frame_bytes" in info.value.message
        assert c.status().state == "idle"


def test_oversize_frame_error_carries_the_request_id(env: Env) -> None:
    pod = env.start()
    sock = raw(pod)
    big = b'{"jsonrpc":"2.0","id":"big-1","method":"run","params":{"input":"%b"}}\n' % (
        b"y" * (DEFAULT_MAX_FRAME_BYTES + 10)
    )
    reply = rpc(sock, big)
    assert reply["id"] == "big-1" and reply["error"]["code"] == -32600
    assert rpc(sock, b'{"jsonrpc":"2.0","id":2,"method":"status"}\n')["result"]["state"] == "idle"
    sock.close()


def test_oversize_frame_error_after_a_bom_carries_the_request_id(env: Env) -> None:
    """A request file saved "with BOM" whose line is over the limit: its -32600 still names
    the id the caller waits for (it was null: the BOM hid the line's `{` from the id reader)."""
    pod = env.start()
    sock = raw(pod)
    big = b'\xef\xbb\xbf{"jsonrpc":"2.0","id":"big-2","method":"run","params":{"input":"%b"}}\n' % (
        b"y" * (DEFAULT_MAX_FRAME_BYTES + 10)
    )
    reply = rpc(sock, big)
    assert reply["id"] == "big-2" and reply["error"]["code"] == -32600, reply
    assert rpc(sock, b'{"jsonrpc":"2.0","id":2,"method":"status"}\n')["result"]["state"] == "idle"
    sock.close()


def test_podctl_send_of_10mb_from_stdin_fails_fast_with_one_line(env: Env) -> None:
    env.start("big")
    started = time.monotonic()
    proc = env.podctl("send", "big", "-", input="z" * (10 * 1024 * 1024), timeout=60)
    assert time.monotonic() - started < 30
    assert proc.returncode == 2, proc.stderr  # a usage error: no pod takes such a message
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than one request to a pod carries" in lines[0], proc.stderr


def test_podctl_rpc_takes_its_params_from_stdin(env: Env) -> None:
    """`podctl rpc POD run '{"input": …}'` of 200 KB, which the pod takes (256 KiB by
    default), cannot be one argument (the kernel's MAX_ARG_STRLEN is 128 KiB: E2BIG before
    podctl runs), and `-` was refused as invalid JSON. `-` reads the params from stdin."""
    env.start("raw")
    text = "w" * 200_000
    params = json.dumps({"input": text, "wait": True})
    proc = env.podctl("rpc", "raw", "run", "-", input=params)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["outcome"] == "finished" and result["text"] == "ok: " + text[:200]


def test_a_lone_surrogate_is_a_parse_error_that_says_so(env: Env) -> None:
    # msgspec calls it "Input data was truncated", which the line plainly was not.
    pod = env.start()
    sock = raw(pod)
    line = b'{"jsonrpc":"2.0","id":5,"method":"notify","params":{"message":"a\\ud800b"}}\n'
    error = rpc(sock, line)["error"]
    assert error["code"] == -32700 and "lone surrogate" in error["message"], error


def test_a_line_cut_short_is_a_parse_error_that_says_only_that(env: Env) -> None:
    """A request missing its closing brace (a hand-written line, a client that cut it) was
    told it was "truncated, or a \\u escape of a lone surrogate": a riddle for a line with no
    escape at all."""
    pod = env.start()
    sock = raw(pod)
    cut = (
        b'{"jsonrpc":"2.0","id":6,"method":"status"\n',
        b'{"jsonrpc":"2.0","id":7,"method":"notify","params":{"message":"cut\n',
    )
    for line in cut:
        error = rpc(sock, line)["error"]
        assert error["code"] == -32700, error
        assert error["message"] == (
            "parse error: invalid JSON: truncated (the line ends before its JSON value does)"
        ), error


# --- item 3: malformed params keep the connection -----------------------------------------------


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (
            b'{"jsonrpc":"2.0","id":5,"method":"status","params":'
            + b"[" * 1000
            + b"]" * 1000
            + b"}",
            -32700,
        ),
        (b"[" * 1000 + b"]" * 1000, -32700),
        (b'{"jsonrpc":"2.0","id":5,"method":"notify","params":{"message":"a\xffb"}}', -32700),
        (
            b'{"jsonrpc":"2.0","id":5,"method":"notify","params":{"message":'
            + b"[" * 3000
            + b"]" * 3000
            + b"}}",
            -32700,
        ),
        (
            b'[{"jsonrpc":"2.0","id":5,"method":"status","params":'
            + b'{"a":' * 900
            + b"1"
            + b"}" * 900
            + b"}]",
            None,
        ),
    ],
    ids=["deep-params", "deep-batch", "bad-utf8-params", "deep-message", "deep-in-batch"],
)
def test_malformed_line_is_an_error_and_the_connection_stays(
    env: Env, line: bytes, code: int | None
) -> None:
    pod = env.start()
    sock = raw(pod)
    reply = rpc(sock, line + b"\n")
    error = reply[0]["error"] if isinstance(reply, list) else reply["error"]
    assert error["code"] in (-32700, -32600, -32602), reply
    if code is not None:
        assert error["code"] == code
    if not line.startswith(b"[["):
        assert (reply[0] if isinstance(reply, list) else reply)["id"] == 5
    after = rpc(sock, b'{"jsonrpc":"2.0","id":6,"method":"status"}\n')
    assert after["id"] == 6 and after["result"]["state"] == "idle"
    sock.close()


@pytest.mark.parametrize("params", [b'"x"', b"null", b"3"])
def test_params_that_are_neither_object_nor_array_are_an_invalid_request(
    env: Env, params: bytes
) -> None:
    """JSON-RPC 2.0: params, when present, MUST be an object or an array; a request with other
    params is not a valid request (-32600), whatever its method expects."""
    pod = env.start()
    sock = raw(pod)
    line = b'{"jsonrpc":"2.0","id":4,"method":"status","params":%b}\n' % params
    reply = rpc(sock, line)
    assert reply["id"] == 4 and reply["error"]["code"] == -32600, reply
    assert "params" in reply["error"]["message"]
    sock.close()


def test_an_empty_params_array_is_a_call_without_arguments(env: Env) -> None:
    """JSON-RPC 2.0 by-position params with no values: what generic clients send for a call
    without arguments (`"params": []`). It was -32602 "Expected `object`, got `array`" for
    `status`, which takes none; it is answered as if params were absent, so a method that
    needs one still names the field."""
    pod = env.start()
    sock = raw(pod)
    for rid, method in enumerate(("status", "usage", "pause", "history", "cancel"), 1):
        line = b'{"jsonrpc":"2.0","id":%d,"method":"%b","params":[ ]}\n' % (rid, method.encode())
        reply = rpc(sock, line)
        assert reply["id"] == rid and "result" in reply, reply
    reply = rpc(sock, b'{"jsonrpc":"2.0","id":9,"method":"run","params":[]}\n')
    assert reply["error"]["code"] == -32602 and "input" in reply["error"]["message"], reply
    reply = rpc(sock, b'{"jsonrpc":"2.0","id":10,"method":"history","params":[5]}\n')
    assert reply["error"]["code"] == -32602, reply  # values by position: still not taken
    sock.close()


@pytest.mark.parametrize("params", [b'"x"', b"null", b"3"])
def test_a_request_without_id_and_with_unstructured_params_is_answered_invalid(
    env: Env, params: bytes
) -> None:
    """Such a request is not valid, so it is no notification: JSON-RPC 2.0 answers it -32600
    with a null id (its own example: `{"jsonrpc": "2.0", "method": 1, "params": "bar"}`), as
    the pod does for a wrong `jsonrpc` or `method` without an id. It was dropped silently,
    alone or in a batch: `notify` with `"params": "text"` lost its message without a word."""
    pod = env.start()
    sock = raw(pod)
    line = b'{"jsonrpc":"2.0","method":"notify","params":%b}\n' % params
    reply = rpc(sock, line)
    assert reply["id"] is None and reply["error"]["code"] == -32600, reply
    (item,) = rpc(sock, b"[" + line.rstrip() + b"]\n")  # type: ignore[misc]
    assert item["id"] is None and item["error"]["code"] == -32600, item
    assert rpc(sock, b'{"jsonrpc":"2.0","id":6,"method":"status"}\n')["id"] == 6
    sock.close()


def test_an_id_that_is_not_utf8_is_a_parse_error(env: Env) -> None:
    """The frame is not UTF-8 JSON: -32700 (with a null id: none can be read), not the
    -32603 "internal error" it was (reading the id for the reply raised)."""
    pod = env.start()
    sock = raw(pod)
    reply = rpc(sock, b'{"jsonrpc":"2.0","id":"a\xffb","method":"status"}\n')
    assert reply["error"]["code"] == -32700 and reply["id"] is None, reply
    assert rpc(sock, b'{"jsonrpc":"2.0","id":6,"method":"status"}\n')["id"] == 6
    sock.close()


def test_a_line_of_the_wrong_shape_that_is_not_utf8_is_a_parse_error(env: Env) -> None:
    """Found by QA: a JSON string holding invalid UTF-8 got -32600 ("Expected object | array,
    got str"), where the same bytes in a request's params got -32700: malformed first."""
    pod = env.start()
    sock = raw(pod)
    reply = rpc(sock, b'"\xc3\x28"\n')
    assert reply["id"] is None and reply["error"]["code"] == -32700, reply
    assert "UTF-8" in reply["error"]["message"]
    assert rpc(sock, b'"fine"\n')["error"]["code"] == -32600  # the wrong shape, well formed
    sock.close()


def test_an_unreadable_batch_item_is_its_own_error_and_the_others_are_answered(
    env: Env,
) -> None:
    """Invalid UTF-8 in one item (the batch itself parses): that item gets -32600 with its id,
    the items around it run and are answered, in one array."""
    pod = env.start()
    sock = raw(pod)
    batch = (
        b'[{"jsonrpc":"2.0","id":1,"method":"notify","params":{"message":"before"}},'
        b'{"jsonrpc":"2.0","id":2,"method":"st\xffatus"},'
        b'{"jsonrpc":"2.0","id":3,"method":"notify","params":{"message":"after"}}]\n'
    )
    reply: Any = rpc(sock, batch)
    replies = {r["id"]: r for r in reply}
    assert replies[2]["error"]["code"] == -32600
    assert "notification_id" in replies[1]["result"] and "notification_id" in replies[3]["result"]
    sock.close()
    with pod.client() as c:
        texts = [e["text"] for e in c.history().entries if e["kind"] == "system_item"]
    assert texts == ["before", "after"]


def test_a_notification_whose_params_are_not_utf8_is_a_parse_error(env: Env) -> None:
    """Such a line is not JSON, so no notification: it was dropped without a word (and never
    executed), where any other malformed line gets -32700. A shell in a Latin-1 locale
    sending `notify` without an id lost its message silently."""
    pod = env.start()
    sock = raw(pod)
    line = b'{"jsonrpc":"2.0","method":"notify","params":{"message":"caf\xe9"}}\n'
    reply = rpc(sock, line)
    assert reply["id"] is None and reply["error"]["code"] == -32700, reply
    assert "UTF-8" in reply["error"]["message"]
    batch = (
        b'[{"jsonrpc":"2.0","method":"notify","params":{"message":"caf\xe9"}},'
        b'{"jsonrpc":"2.0","method":"notify","params":{"message":"fine"}}]\n'
    )
    (item,) = rpc(sock, batch)  # type: ignore[misc]
    assert item["id"] is None and item["error"]["code"] == -32700, item
    assert rpc(sock, b'{"jsonrpc":"2.0","id":6,"method":"status"}\n')["id"] == 6
    sock.close()
    with pod.client() as c:
        texts = [e["text"] for e in c.history().entries if e["kind"] == "system_item"]
    assert texts == ["fine"]


def test_invalid_utf8_in_a_member_the_pod_skips_is_a_parse_error_too(env: Env) -> None:
    """Invalid UTF-8 in a member the request does not need (a client's own `"trace"` field)
    still makes the line no JSON: -32700, nothing executed, as everywhere else in a line. The
    request was executed: a `notify` was committed from a line another parser refuses."""
    pod = env.start()
    sock = raw(pod)
    line = b'{"jsonrpc":"2.0","id":7,"method":"notify","params":{"message":"a"},"trace":"\xff"}\n'
    reply = rpc(sock, line)
    assert reply["id"] == 7 and reply["error"]["code"] == -32700, reply
    assert "UTF-8" in reply["error"]["message"]
    notification = b'{"jsonrpc":"2.0","method":"notify","params":{"message":"b"},"t":"\xe9"}\n'
    reply = rpc(sock, notification)  # no notification, being no JSON: answered
    assert reply["id"] is None and reply["error"]["code"] == -32700, reply
    batch = (
        b'[{"jsonrpc":"2.0","id":1,"method":"notify","params":{"message":"c"},"t":"\xe9"},'
        b'{"jsonrpc":"2.0","id":2,"method":"notify","params":{"message":"fine \xc3\xa9"}}]\n'
    )
    reply_items: Any = rpc(sock, batch)
    by_id = {r["id"]: r for r in reply_items}
    assert by_id[1]["error"]["code"] == -32700 and "notification_id" in by_id[2]["result"]
    sock.close()
    with pod.client() as c:
        texts = [e["text"] for e in c.history().entries if e["kind"] == "system_item"]
    assert texts == ["fine \u00e9"]


def test_any_json_number_is_an_id_and_is_echoed(env: Env) -> None:
    # JSON-RPC 2.0: an id is a string, a number or null; a number may have a fraction (it
    # SHOULD not) or an exponent. Such a request is valid and its reply echoes the id.
    pod = env.start()
    sock = raw(pod)
    for rid in (b"1.5", b"1e3", b"-0.25"):
        reply = rpc(sock, b'{"jsonrpc":"2.0","id":%b,"method":"pause"}\n' % rid)
        assert reply["id"] == json.loads(rid) and reply["result"] == {"paused": False}, reply
    error = rpc(sock, b'{"jsonrpc":"2.0","id":2.5,"method":"nope"}\n')
    assert (error["id"], error["error"]["code"]) == (2.5, -32601)
    bad = rpc(sock, b'{"jsonrpc":"2.0","id":3.5,"method":"run","params":{"input":1}}\n')
    assert (bad["id"], bad["error"]["code"]) == (3.5, -32602)
    invalid = rpc(sock, b'{"jsonrpc":"2.0","id":4.5}\n')  # no method: its id still read
    assert (invalid["id"], invalid["error"]["code"]) == (4.5, -32600)
    sock.close()


@pytest.mark.skipif(shutil.which("socat") is None, reason="socat is not installed")
@pytest.mark.parametrize("first_line", [b"", b"\r\n"], ids=["request", "blank"])
def test_a_request_file_saved_with_a_bom_and_crlf_is_answered(
    env: Env, tmp_path: Path, first_line: bytes
) -> None:
    """A request file an editor saved as "UTF-8 with BOM" and CRLF line ends, sent with
    `socat - UNIX-CONNECT:$sock < req.json`: RFC 8259 lets a parser ignore the byte order mark,
    as the pod ignores the CR. It was a -32700 "invalid character (byte 0)" naming nothing."""
    pod = env.start()
    request = tmp_path / "req.json"
    request.write_bytes(
        b"\xef\xbb\xbf"
        + first_line
        + b'{"jsonrpc":"2.0","id":1,"method":"status"}\r\n'
        + b'{"jsonrpc":"2.0","id":2,"method":"usage"}\r\n'
    )
    with request.open("rb") as stdin:
        proc = subprocess.run(
            ["socat", "-t", "30", "-", f"UNIX-CONNECT:{pod.socket}"],
            stdin=stdin,
            capture_output=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    answers = replies(proc.stdout)
    assert [a["id"] for a in answers] == [1, 2], answers
    assert answers[0]["result"]["state"] == "idle" and "totals" in answers[1]["result"], answers


@pytest.mark.parametrize(
    ("method", "params", "field"),
    [
        # a negative seq or an empty page (they were cut to 1 or 0 silently)
        ("history", '{"limit":0}', "params.limit"),
        ("history", '{"limit":-1}', "params.limit"),
        ("history", '{"since":-10}', "params.since"),
        ("subscribe", '{"since":-1}', "params.since"),
        # blank text: it cost a model turn (which Anthropic's API refuses); podctl refused it
        ("run", '{"input":""}', "params.input"),
        ("run", '{"input":" \\n\\t","wait":true}', "params.input"),
        ("notify", '{"message":""}', "params.message"),
        ("notify", '{"message":"  ","source":"ci"}', "params.message"),
        # a report only a child makes: forged names, kinds and outcomes were shown to the model
        ("pod_event", '{"pod":"../../x","kind":"errored"}', "params.pod"),
        ("pod_event", '{"pod":"kid","kind":"rm -rf"}', "params.kind"),
        ("pod_event", '{"pod":"kid","kind":"run.finished","outcome":"pwned"}', "params.outcome"),
    ],
)
def test_wrong_params_are_invalid_params_naming_the_field_and_commit_nothing(
    env: Env, method: str, params: str, field: str
) -> None:
    # SPEC §5: wrong params are -32602 naming the field.
    pod = env.start()
    sock = raw(pod)
    line = b'{"jsonrpc":"2.0","id":3,"method":"%s","params":%s}\n'
    reply = rpc(sock, line % (method.encode(), params.encode()))
    assert reply["error"]["code"] == -32602, reply
    assert field in reply["error"]["message"]
    page = rpc(sock, b'{"jsonrpc":"2.0","id":4,"method":"history","params":{"limit":20000}}\n')
    assert page["result"]["next"] == 0  # a page over the cap is cut, not refused
    assert page["result"]["entries"] == []  # and nothing was committed
    assert pod.call("status")["state"] == "idle"
    sock.close()


# --- item 4: memory per connection is bounded --------------------------------------------------


def test_a_client_that_reads_nothing_is_pushed_back_then_gets_every_reply(env: Env) -> None:
    """Its replies piling up unread, the pod stops reading its requests (as a socket pushes
    back) instead of answering on without end; once it reads, every request is answered. It
    was disconnected at 16 MiB unread: a client pipelining 100,000 requests while a second
    thread read the replies lost its connection."""
    pod = env.start()
    request = b'{"jsonrpc":"2.0","id":%d,"method":"status"}\n'
    stream = b"".join(request % i for i in range(200_000))  # ~200 MB of replies: past any bound
    with pod.client() as watcher:
        watcher.subscribe()
        hog = raw(pod)
        hog.setblocking(False)
        sent, stalled_since = 0, None
        while stalled_since is None or time.monotonic() - stalled_since < 1.0:
            assert sent < len(stream), "the pod read every request without pushing back"
            try:
                sent += hog.send(stream[sent : sent + 65536])
                stalled_since = None
            except BlockingIOError:  # its socket is full: the pod reads us no more
                stalled_since = stalled_since or time.monotonic()
                time.sleep(0.01)
        assert watcher.status().state == "idle"  # everyone else is unaffected
        with open(f"/proc/{pod.proc.pid}/status") as f:
            rss_kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        assert rss_kb < 150 * 1024  # its unread replies: ~1 MiB, then reading it stopped
        # Now it reads: the rest of its requests goes out as the pod takes them, and each one
        # gets its reply, in order.
        hog.setblocking(True)
        hog.settimeout(60)
        rest = threading.Thread(target=hog.sendall, args=(stream[sent:],), daemon=True)
        rest.start()
        buf, want = b"", 0
        while want < 200_000:
            chunk = hog.recv(1 << 20)
            assert chunk, "the pod closed the connection"
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                assert json.loads(line)["id"] == want
                want += 1
        rest.join(10)
        hog.close()
        seen = []
        while (event := watcher.next_event(timeout=0.5)) is not None:
            seen.append(event.type)
        assert "alert" not in seen  # (a dropped client is said in an alert)


def test_a_client_pipelining_thousands_of_history_requests_gets_every_reply(env: Env) -> None:
    # `history` is handled off the loop, one session read per request. Read and dispatched all
    # at once, 20,000 of them took the pod's memory from ~45 to ~500 MB and starved everyone;
    # now at most server.MAX_IN_FLIGHT run at once (tests/unit/test_server_backlog.py) and the
    # pod stops reading the client meanwhile: here, on a real socket, it reads on again and
    # every request is answered.
    env.model.script({"text": "one turn of history"})
    pod = env.start()
    with pod.client() as c:
        c.run_wait("hello")
    count = 5000
    line = b'{"jsonrpc":"2.0","id":%d,"method":"history","params":{"limit":1}}\n'
    flood = raw(pod)
    got: list[dict[str, Any]] = []

    def read_all() -> None:
        buf = b""
        while len(got) < count:
            chunk = flood.recv(1 << 20)
            assert chunk, "the pod closed the connection"
            buf += chunk
            *lines, buf = buf.split(b"\n")
            got.extend(json.loads(x) for x in lines)

    reader = threading.Thread(target=read_all)
    reader.start()
    flood.sendall(b"".join(line % i for i in range(count)))
    with pod.client() as other:  # answered while the flood is being worked through
        assert other.status().name == pod.name
    reader.join(120)
    flood.close()
    assert not reader.is_alive()
    assert sorted(r["id"] for r in got) == list(range(count))
    assert all(r["result"]["entries"][0]["seq"] == 1 for r in got)


def _with_a_big_note(env: Env) -> tuple[PodProcess, str]:
    """A pod whose session holds a 6 MiB notification, delivered: its history pages are big."""
    pod = env.start("pod", *BIG_INPUTS)
    note = "n" * (6 << 20)
    with pod.client() as c:
        c.notify(note)
    drained(pod)
    return pod, note


def test_a_client_pipelining_big_history_pages_while_it_reads_gets_every_reply(env: Env) -> None:
    """Pages were made as fast as the pod could read the log and written at once: a few pages
    of a session holding a 6 MiB notification passed MAX_UNREAD_BYTES together, and a client
    that read all along (socat, the README's recipe) was disconnected, its replies lost. Now a
    connection's pages are made one at a time, each once the last one was read."""
    pod, note = _with_a_big_note(env)
    count = 8
    sock = raw(pod)
    sock.sendall(
        b"".join(b'{"jsonrpc":"2.0","id":%d,"method":"history"}\n' % i for i in range(count))
    )
    sock.shutdown(socket.SHUT_WR)
    got = replies(read_until_eof(sock))
    sock.close()
    assert sorted(r["id"] for r in got) == list(range(count))
    assert all(any(e.get("text") == note for e in r["result"]["entries"]) for r in got)


def test_a_batch_of_read_only_requests_holds_a_bounded_reply(env: Env) -> None:
    """A batch's replies are held until its last one: 40 pages of 8 MiB took the pod to 1 GB,
    and a longer batch (a line of 45 KB) could exhaust the machine's memory. Past 16 MiB of
    read-only replies, the batch's further ones are left out with an error saying so."""
    pod, note = _with_a_big_note(env)
    count = 10
    sock = raw(pod)
    batch = [{"jsonrpc": "2.0", "id": i, "method": "history"} for i in range(count)]
    sock.sendall(json.dumps(batch).encode() + b"\n")
    sock.shutdown(socket.SHUT_WR)
    data = read_until_eof(sock)
    sock.close()
    assert len(data) < 20 << 20
    (got,) = replies(data)
    assert sorted(r["id"] for r in got) == list(range(count))
    pages = [r for r in got if "result" in r]
    left_out = [r["error"] for r in got if "error" in r]
    assert len(pages) == 2 and len(left_out) == count - 2
    assert all(e["code"] == -32603 and "send it on its own" in e["message"] for e in left_out)
    with pod.client() as c:  # on its own, a page is given
        assert any(e.get("text") == note for e in c.history().entries)
    # Small replies count too: 100,000 `status` in one 8 MiB line made a 62 MB reply.
    sock = raw(pod)
    statuses = [{"jsonrpc": "2.0", "id": i, "method": "status"} for i in range(100_000)]
    sock.sendall(json.dumps(statuses, separators=(",", ":")).encode() + b"\n")
    sock.shutdown(socket.SHUT_WR)
    data = read_until_eof(sock)
    sock.close()
    assert len(data) < 48 << 20
    (got,) = replies(data)
    assert len(got) == 100_000 and "result" in got[0] and "error" in got[-1]


def test_a_batch_of_more_items_than_the_limit_is_refused_whole(env: Env) -> None:
    """A line of 8 MiB of `1,` items (4 million) made a 460 MB reply and took the pod to
    ~2 GB: a batch past server.MAX_BATCH_ITEMS is one -32600 that says so, nothing in it
    executed, and the connection stays usable."""
    pod = env.start()
    sock = raw(pod)
    notify = b'{"jsonrpc":"2.0","id":0,"method":"notify","params":{"message":"in the batch"}}'
    line = b"[" + notify + b",1" * 100_000 + b"]\n"
    reply = rpc(sock, line)
    assert reply["id"] is None and reply["error"]["code"] == -32600, reply
    assert "100001 items exceeds 100000" in reply["error"]["message"]
    assert rpc(sock, b'{"jsonrpc":"2.0","id":6,"method":"status"}\n')["id"] == 6
    sock.close()
    with pod.client() as c:
        assert [e for e in c.history().entries if e["kind"] == "system_item"] == []


def test_partial_frames_are_bounded_across_connections(env: Env) -> None:
    """Clients holding unfinished frames (64 MiB for all together) cannot get another client's
    valid request refused: past the bound, the oldest unfinished frames go, with an alert."""
    pod = env.start("pod", *BIG_INPUTS)
    with pod.client() as watcher:
        watcher.subscribe()
        # Valid JSON once finished: white space may pad a request.
        part = b'{"jsonrpc":"2.0","id":1,"method":"status"' + b" " * (7 << 20)
        hogs = [raw(pod) for _ in range(9)]
        for s in hogs:
            s.sendall(part)  # 9 x 7 MiB: within the bound
        # A complete 2 MiB request crosses the bound while it arrives: it is answered.
        victim = raw(pod)
        note = b"v" * (2 << 20)
        line = b'{"jsonrpc":"2.0","id":7,"method":"notify","params":{"message":"%b"}}\n' % note
        assert "notification_id" in rpc(victim, line)["result"]
        alerts = []
        for event in watcher.events():
            if event.type == "alert":
                alerts.append(event.data["message"])
                break
        assert "partial frames" in alerts[0] and "oldest" in alerts[0]
        assert disconnected(hogs[0])  # the oldest hog went
        assert rpc_after_partial(hogs[-1]) == "ok"  # the newest is still served
        assert watcher.status().state in ("idle", "running")
        for s in [*hogs, victim]:
            s.close()


def disconnected(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def rpc_after_partial(sock: socket.socket) -> str:
    """Finish a kept partial frame: its request is answered."""
    reply = rpc(sock, b"}\n")
    return "ok" if "result" in reply else str(reply)


# --- item 6, client side: another user's socket is refused -------------------------------------


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second uid")
NOBODY = 65534


@pytest.fixture
def impostor() -> Iterator[Path]:
    """A socket bound and served by another uid (nobody), as an impostor pod would be."""
    d = Path(tempfile.mkdtemp(prefix="imp", dir="/tmp"))  # /tmp: nobody can reach it
    os.chown(d, NOBODY, NOBODY)
    path = d / "sock"
    code = (
        "import os,socket,sys;os.setgid(65534);os.setuid(65534);"
        "s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);s.listen();print('up',flush=True);"
        "c,_=s.accept();data=c.recv(100);print('GOT',data,flush=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        yield path
    finally:
        proc.kill()
        out = proc.communicate()[0]
        shutil.rmtree(d, ignore_errors=True)
        assert "GOT b'" not in out or "GOT b''" in out, f"the client sent data: {out}"


@needs_root
def test_sync_client_refuses_another_users_socket(impostor: Path) -> None:
    with pytest.raises(UnsafeSocket, match="uid 65534"):
        PodClient.connect(impostor, timeout=5)


@needs_root
def test_one_call_client_makes_both_checks(impostor: Path) -> None:
    """podctl's standard-library client (protocol.oneshot): the file's owner, then the peer's."""
    with pytest.raises(UnsafeSocket, match="uid 65534"):
        oneshot.call(impostor, "status", timeout=5)
    os.chown(impostor, 0, 0)
    with pytest.raises(UnsafeSocket, match=r"the process \(pid \d+\) behind socket .* uid 65534"):
        oneshot.call(impostor, "status", timeout=5)


@needs_root
def test_async_client_refuses_another_users_socket(impostor: Path) -> None:
    async def go() -> None:
        with pytest.raises(UnsafeSocket, match="uid 65534"):
            await AsyncPodClient.connect(impostor)

    asyncio.run(go())


@needs_root
def test_client_refuses_a_socket_served_by_another_user(impostor: Path) -> None:
    """The file is ours (root's) but the process listening on it is not: SO_PEERCRED says so."""
    os.chown(impostor, 0, 0)
    with pytest.raises(UnsafeSocket, match=r"the process \(pid \d+\) behind socket .* uid 65534"):
        PodClient.connect(impostor, timeout=5)


@needs_root
def test_client_refuses_a_socket_file_chowned_to_another_user(env: Env) -> None:
    """The socket file's owner counts too (a swapped file over a live pod's name)."""
    pod = env.start()
    os.chown(pod.socket, NOBODY, NOBODY)
    with pytest.raises(UnsafeSocket, match=f"socket {pod.socket} belongs to uid 65534"):
        PodClient.connect(pod.socket, timeout=5)
    proc = env.podctl("notify", pod.socket, "deploy token=s3cret")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "belongs to uid 65534" in proc.stderr
    os.chown(pod.socket, 0, 0)
    assert history_notes(pod) == []  # nothing was delivered


@pytest.fixture
def roots_socket() -> Iterator[Path]:
    """A socket root binds and serves in a directory everyone may enter: any uid can connect."""
    d = Path(tempfile.mkdtemp(prefix="root", dir="/tmp"))
    os.chmod(d, 0o755)
    path = d / "sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o777)
    server.listen()
    got: list[bytes] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5)
                got.append(conn.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        server.close()
        thread.join(10)
        shutil.rmtree(d, ignore_errors=True)
        assert got in ([], [b""]), f"the client sent data: {got}"


def _python_for(uid: int) -> str | None:
    """A system python of this minor version that `uid` may run (pyenv's lives under /root)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        probe = (
            subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
                user=uid,
            )
            if os.path.exists(candidate)
            else None
        )
        if probe is not None and probe.stdout.strip() == str(sys.version_info[:2]):
            return candidate
    return None


@needs_root
def test_a_user_refuses_a_socket_root_owns(roots_socket: Path) -> None:
    """SPEC §2: a client checks that the socket belongs to its own uid; root's is not its own
    (a root pod would refuse this user anyway, after the request had gone out)."""
    python = _python_for(NOBODY)
    if python is None:
        pytest.skip(f"no system python {sys.version_info[:2]} that uid {NOBODY} can run")
    code = (
        "import sys\n"
        "from protocol import oneshot\n"
        "from protocol.errors import UnsafeSocket\n"
        "try:\n"
        "    oneshot.call(sys.argv[1], 'status', timeout=5)\n"
        "except UnsafeSocket as exc:\n"
        "    print(exc)\n"
    )
    site = sysconfig.get_paths()["purelib"]
    proc = subprocess.run(
        [python, "-c", code, str(roots_socket)],
        env={"PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "PATH": "/usr/bin:/bin"},
        cwd="/",
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.stdout.strip() == (
        f"socket {roots_socket} belongs to uid 0, not to you (uid {NOBODY}): refusing to use it"
    ), proc.stdout + proc.stderr


def test_own_socket_is_accepted(env: Env) -> None:
    pod = env.start()
    with PodClient.connect(pod.socket, timeout=5) as c:
        assert msgspec.to_builtins(c.status())["state"] == "idle"


def readme_shell_recipe() -> tuple[str, list[str]]:
    """The README's "From a shell" paragraph and its commands (the code spans with socat)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("From a shell")
    paragraph = text[start : text.index("\n- ", start)]
    return paragraph, [span for span in paragraph.split("`")[1::2] if "socat" in span]


@pytest.mark.skipif(shutil.which("socat") is None, reason="socat is not installed")
def test_readme_shell_recipes_work_as_printed(env: Env) -> None:
    paragraph, (status_line, wait_tail) = readme_shell_recipe()
    assert "`sock`" in paragraph and "podctl spawn" in paragraph  # says where $sock comes from
    spawned = env.podctl("spawn", str(env.manifest("shell")))
    assert spawned.returncode == 0, spawned.stderr
    try:
        shell_env = {**env.env, "sock": spawned.stdout.split("\t")[1].strip()}
        status = subprocess.run(
            ["bash", "-uc", status_line], env=shell_env, capture_output=True, timeout=30
        )
        [reply] = replies(status.stdout)
        assert reply["result"]["name"] == "shell", (status.stdout, status.stderr)

        # A run that outlasts socat's default half second after EOF: `-t 600` gets its answer.
        env.model.script({"text": "done", "gate": "slow"})
        run = '{"jsonrpc":"2.0","id":1,"method":"run","params":{"input":"go","wait":true}}'
        waiting = subprocess.Popen(
            ["bash", "-uc", f"printf '%s\\n' '{run}' | {wait_tail}"],
            env=shell_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        env.model.wait_for_requests(1)
        time.sleep(1)  # past socat's default -t 0.5: only the README's -t keeps it listening
        env.model.open_gate("slow")
        out, err = waiting.communicate(timeout=30)
        [reply] = replies(out)
        assert reply["result"]["outcome"] == "finished", (out, err)
    finally:
        env.podctl("stop", "shell")


def test_a_burst_of_clients_waits_in_the_backlog_of_a_pod_that_is_busy(env: Env) -> None:
    """The pod listened with the loop's default backlog of 100: while it was busy (stopped
    here), the 102nd connection of a burst failed with EAGAIN, and the project's own async
    client took such a socket for one served by another user (found by a QA pass)."""
    pod = env.start("popular")
    clients = []
    os.kill(pod.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            sock.connect(pod.socket)  # queued, not accepted yet: BlockingIOError past the backlog
            clients.append(sock)
    finally:
        os.kill(pod.proc.pid, signal.SIGCONT)
    for sock in clients[::50] + clients[-1:]:
        sock.setblocking(True)
        sock.settimeout(30)
        sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"status"}\n')
        assert json.loads(sock.makefile("rb").readline())["result"]["name"] == "popular"
    for sock in clients:
        sock.close()


def test_a_pod_out_of_descriptors_is_not_said_to_be_not_running(env: Env) -> None:
    """Clients that leak connections use up a pod's open-file limit: it accepts each newcomer
    and drops it at once (it has no descriptor to serve it with). podctl said the pod "is not
    running: it went away" with exit 3, the status of a pod to start again; it runs, and
    answers again once the connections go."""
    import resource

    pod = env.start("crowded")
    pid = pod.proc.pid
    with pod.client() as c:  # settled: its SDK imported, its model connection open
        assert c.run_wait("warm up").outcome == "finished"
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (64, 64))
    hogs: list[socket.socket] = []

    def full() -> bool:
        """One more connection is dropped unanswered: the pod has no descriptor left."""
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(0.5)
        sock.connect(pod.socket)
        hogs.append(sock)
        with contextlib.suppress(TimeoutError):
            return sock.recv(1) == b""
        return False

    try:
        for _ in range(80):  # more than 64 descriptors' worth, at once
            hogs.append(socket.socket(socket.AF_UNIX))
            hogs[-1].connect(pod.socket)
        wait_until(full, what="the pod at its open-file limit")
        proc = env.podctl("status", "crowded")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"pod 'crowded' (pid {pid}) runs but dropped the connection" in proc.stderr
        assert "open-file limit" in proc.stderr and len(proc.stderr.splitlines()) == 1
    finally:
        for sock in hogs:
            sock.close()
    wait_until(lambda: env.podctl("status", "crowded").returncode == 0)


def test_a_socket_with_no_peer_is_a_failed_connection_not_another_users(tmp_path: Path) -> None:
    """An asyncio connect that meets a full backlog (EAGAIN) looks done, with no peer behind
    it: SO_PEERCRED then says pid 0, uid -1, and the client refused the pod's socket as
    served by another user."""
    from protocol.sockets import check_peer

    with socket.socket(socket.AF_UNIX) as unconnected, pytest.raises(ConnectionError) as err:
        check_peer(unconnected, tmp_path / "sock")
    assert not isinstance(err.value, UnsafeSocket)
    assert "the pod did not take the connection (too many at once)" in str(err.value)


def test_a_subscribe_in_a_batch_streams_after_the_batchs_reply(env: Env) -> None:
    """SPEC §5: subscribe answers `{cursor}`, then events follow. In a batch the reply waits
    for every item (here a run with wait), and the events came first, before the cursor."""
    env.model.script({"text": "batched"})
    pod = env.start("batcher")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(pod.socket)
        sock.settimeout(30)
        batch = [
            {"jsonrpc": "2.0", "id": "s", "method": "subscribe"},
            {"jsonrpc": "2.0", "id": "w", "method": "run", "params": {"input": "b", "wait": True}},
        ]
        sock.sendall(json.dumps(batch).encode() + b"\n")
        lines = sock.makefile("rb")
        first = json.loads(lines.readline())
        assert isinstance(first, list), first  # the batch's reply, before any event
        replies = {r["id"]: r["result"] for r in first}
        assert replies["w"]["text"] == "batched"
        events = []
        while not events or events[-1]["params"]["type"] != "run.finished":
            events.append(json.loads(lines.readline()))
    assert all(e["method"] == "event" for e in events)
    assert events[0]["params"]["seq"] > replies["s"]["cursor"]
