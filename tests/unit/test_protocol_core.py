"""The sans-IO client core: request bytes out, replies and events demultiplexed from frames in."""

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import errors
from protocol.aio import AsyncPodClient
from protocol.client import PodClient
from protocol.core import ClientCore, ClientMethods, Rpc, SyncCaller, clean_params, resolve_socket
from protocol.errors import RpcError
from protocol.methods import METHODS, Method
from protocol.types import (
    CancelParams,
    Event,
    NotifyParams,
    NotifyResult,
    Params,
    RunParams,
    RunResult,
    StatusResult,
    SubscribeParams,
)

T = TypeVar("T")


def reply(rid: int, result: object) -> bytes:
    return msgspec.json.encode({"jsonrpc": "2.0", "id": rid, "result": result}) + b"\n"


def error_reply(rid: int | None, code: int, message: str, data: object = None) -> bytes:
    err: dict[str, object] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return msgspec.json.encode({"jsonrpc": "2.0", "id": rid, "error": err}) + b"\n"


def event_frame(seq: int, type: str, data: dict[str, object], run_id: str | None = None) -> bytes:
    params: dict[str, object] = {"seq": seq, "ts": 1.5, "type": type, "data": data}
    if run_id is not None:
        params["run_id"] = run_id
    msg = {"jsonrpc": "2.0", "method": "event", "params": params}
    return msgspec.json.encode(msg) + b"\n"


# --- requests ---------------------------------------------------------------------------------


def test_request_ids_increase_and_frames_are_one_json_line() -> None:
    core = ClientCore()
    ids = []
    for method in ("status", "run", "notify"):
        rid, frame = core.request(method, {"x": 1})
        assert frame.endswith(b"\n") and frame.count(b"\n") == 1
        msg = msgspec.json.decode(frame)
        assert msg == {"jsonrpc": "2.0", "id": rid, "method": method, "params": {"x": 1}}
        ids.append(rid)
    assert ids == [1, 2, 3]


@pytest.mark.parametrize("params", [None, {}])
def test_params_omitted_when_empty(params: dict[str, object] | None) -> None:
    core = ClientCore()
    _, frame = core.request("status", params)
    assert msgspec.json.decode(frame) == {"jsonrpc": "2.0", "id": 1, "method": "status"}
    note = msgspec.json.decode(core.notification("pause", params))
    assert note == {"jsonrpc": "2.0", "method": "pause"}


def test_notification_has_no_id_and_does_not_consume_one() -> None:
    core = ClientCore()
    note = msgspec.json.decode(core.notification("notify", {"message": "hi"}))
    assert "id" not in note and note["params"] == {"message": "hi"}
    assert core.request("status", None)[0] == 1


def test_clean_params_drops_none_but_keeps_falsy_values() -> None:
    got = clean_params({"input": "", "mode": None, "wait": False, "since": 0})
    assert got == {"input": "", "wait": False, "since": 0}


def test_resolve_socket_path_vs_name() -> None:
    assert str(resolve_socket("/tmp/x/pod.sock")) == "/tmp/x/pod.sock"
    assert str(resolve_socket("./pod.sock")) == "pod.sock"
    assert "/reviewer/" in resolve_socket("reviewer")


# --- replies and events -----------------------------------------------------------------------


def test_replies_and_events_demultiplexed_from_interleaved_frames() -> None:
    core = ClientCore()
    r1, _ = core.request("run", {"input": "a"})
    r2, _ = core.request("notify", {"message": "b"})
    stream = (
        event_frame(1, "run.started", {}, "R")
        + reply(r2, {"notification_id": "n1", "wakes": False})
        + event_frame(2, "text.delta", {"text": "hel"}, "R")
        + reply(r1, {"run_id": "R", "state": "started"})
        + event_frame(3, "state.changed", {"state": "running"})
    )
    # Cut the stream at awkward places: frames straddle reads.
    for i in range(0, len(stream), 7):
        core.feed(stream[i : i + 7])
    assert [e.seq for e in core.events] == [1, 2, 3]
    assert [e.type for e in core.events] == ["run.started", "text.delta", "state.changed"]
    assert core.events[1] == Event(
        seq=2, ts=1.5, type="text.delta", data={"text": "hel"}, run_id="R"
    )
    assert core.events[2].run_id is None
    assert set(core.replies) == {r1, r2}
    assert core.take(r1, RunResult) == RunResult(run_id="R", state="started")
    assert core.take(r2, NotifyResult) == NotifyResult(notification_id="n1", wakes=False)
    assert core.replies == {}


def test_take_raises_rpc_error_with_code_message_and_data() -> None:
    core = ClientCore()
    rid, _ = core.request("resume", None)
    core.feed(error_reply(rid, errors.NOT_PAUSED, "the pod is not paused", {"hint": 1}))
    with pytest.raises(RpcError) as info:
        core.take(rid, RunResult)
    assert info.value.code == -32001
    assert info.value.message == "the pod is not paused"
    assert info.value.data == {"hint": 1}
    assert "the pod is not paused (-32001)" in str(info.value)
    assert rid not in core.replies


def test_error_without_id_and_nothing_in_flight_is_stored_under_none() -> None:
    core = ClientCore()
    core.feed(error_reply(None, errors.PARSE_ERROR, "parse error: bad"))
    assert core.replies[None].error.code == -32700  # type: ignore[union-attr]


def test_reply_with_neither_result_nor_error_is_an_internal_error() -> None:
    core = ClientCore()
    rid, _ = core.request("status", None)
    core.feed(b'{"jsonrpc":"2.0","id":1}\n')
    with pytest.raises(RpcError) as info:
        core.take(rid, StatusResult)
    assert info.value.code == errors.INTERNAL_ERROR


def test_typed_result_decoding_rejects_a_wrong_shape() -> None:
    core = ClientCore()
    rid, _ = core.request("run", {"input": "x"})
    core.feed(reply(rid, {"run_id": "R", "state": "exploded"}))
    # A typed error, as for a malformed envelope: msgspec's own escaped podctl as a traceback.
    with pytest.raises(RpcError, match=r"^the pod's reply is malformed: .*state") as info:
        core.take(rid, RunResult)
    assert info.value.code == errors.PARSE_ERROR


def test_typed_status_result() -> None:
    core = ClientCore()
    rid, _ = core.request("status", None)
    status = {
        "name": "p",
        "pid": 42,
        "state": "idle",
        "session_id": None,
        "provider": "openai",
        "model": "m",
        "pwd": "/w",
        "scope": [{"target": "/w", "permission": "write"}],
        "queue": {"runs": 1, "notifications": 2},
        "usage": {"input": 3, "output": 4, "calls": 1},
        "children": [],
        "started_at": 1.0,
        "version": "0.1",
    }
    core.feed(reply(rid, status))
    got = core.take(rid, StatusResult)
    assert got.queue.notifications == 2 and got.usage.output == 4 and got.run_id is None
    assert got.scope[0].recursive is True


def test_oversize_reply_is_an_error() -> None:
    core = ClientCore()
    core._framer.max_frame_bytes = 16
    with pytest.raises(RpcError) as info:
        core.feed(reply(1, {"text": "x" * 100}))
    assert info.value.code == errors.PARSE_ERROR and "exceeds" in info.value.message


@pytest.mark.parametrize(
    "line",
    [
        b'{"jsonrpc":"2.0","id":1,"error":"bad request"}\n',  # the fork server's own format
        b'{"jsonrpc":"2.0","method":"event","params":{"seq":"x"}}\n',  # an event of no shape
        b"[1, 2\n",  # not JSON
        b'"\xff"\n',  # not UTF-8
    ],
)
def test_a_reply_no_pod_would_send_is_a_parse_error(line: bytes) -> None:
    # `podctl send <some other socket>`: msgspec's own error escaped as a traceback.
    core = ClientCore()
    core.request("status", None)
    with pytest.raises(RpcError) as info:
        core.feed(line)
    assert info.value.code == errors.PARSE_ERROR
    assert info.value.message.startswith("the pod's reply is malformed: ")


@given(n=st.integers(1, 20), cut=st.integers(1, 50))
def test_every_reply_lands_under_its_id(n: int, cut: int) -> None:
    core = ClientCore()
    rids = [core.request("status", None)[0] for _ in range(n)]
    stream = b"".join(reply(r, {"n": r}) for r in reversed(rids))
    for i in range(0, len(stream), cut):
        core.feed(stream[i : i + cut])
    assert sorted(core.replies) == rids
    for r in rids:
        assert msgspec.json.decode(core.replies[r].result) == {"n": r}  # type: ignore[arg-type]


# --- params types -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ptype", "body", "field"),
    [
        (RunParams, b'{"inputx":1}', "inputx"),
        (RunParams, b'{"input":"a","wiat":true}', "wiat"),
        (NotifyParams, b'{"message":"m","sauce":"ci"}', "sauce"),
        (CancelParams, b'{"runid":"x"}', "runid"),
        (SubscribeParams, b'{"since":1,"until":2}', "until"),
    ],
)
def test_params_reject_unknown_fields_naming_them(ptype: type, body: bytes, field: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(body, type=ptype)
    assert field in str(info.value)


def test_params_missing_and_wrongly_typed_fields_are_named() -> None:
    with pytest.raises(msgspec.ValidationError, match="input"):
        msgspec.json.decode(b"{}", type=RunParams)
    with pytest.raises(msgspec.ValidationError, match="mode"):
        msgspec.json.decode(b'{"input":"a","mode":"shove"}', type=RunParams)


def test_params_defaults() -> None:
    run = msgspec.json.decode(b'{"input":"a"}', type=RunParams)
    assert (run.mode, run.client_key, run.wait) == ("queue", None, False)
    assert msgspec.json.decode(b'{"message":"m"}', type=NotifyParams).source == "user"
    # Every method decodes an empty params object when it has no required field.
    for name, method in METHODS.items():
        if name in ("run", "notify", "pod_event"):
            continue
        msgspec.json.decode(b"{}", type=method.params)


# --- error classes, the frame limit, id:null replies (issue 9) --------------------------------


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (errors.NOT_PAUSED, errors.NotPaused),
        (errors.QUEUE_FULL, errors.QueueFull),
        (errors.NOT_RUNNING, errors.NotRunning),
        (errors.SHUTTING_DOWN, errors.ShuttingDown),
        (errors.SCOPE_DENIED, errors.ScopeDenied),
        (errors.CONFLICTING_CLIENT_KEY, errors.ConflictingClientKey),
        (errors.BUDGET_EXHAUSTED, errors.BudgetExhausted),
        (errors.BUSY, errors.Busy),
        (errors.HOOK_REFUSED, errors.HookRefused),
    ],
)
def test_application_errors_raise_their_own_class(code: int, cls: type[RpcError]) -> None:
    core = ClientCore()
    rid, _ = core.request("notify", {"message": "m"})
    core.feed(error_reply(rid, code, "nope", {"x": 1}))
    with pytest.raises(cls) as info:
        core.take(rid, NotifyResult)
    assert isinstance(info.value, RpcError)
    assert (info.value.code, info.value.message, info.value.data) == (code, "nope", {"x": 1})


def test_other_codes_stay_plain_rpc_errors() -> None:
    core = ClientCore()
    rid, _ = core.request("nope", None)
    core.feed(error_reply(rid, errors.METHOD_NOT_FOUND, "method not found: nope"))
    with pytest.raises(RpcError) as info:
        core.take(rid, NotifyResult)
    assert type(info.value) is RpcError and info.value.code == -32601


def test_a_frame_over_the_limit_is_refused_before_sending() -> None:
    core = ClientCore(max_frame_bytes=100)
    with pytest.raises(errors.FrameTooLarge) as info:
        core.request("run", RunParams("x" * 100))
    assert info.value.code == errors.INVALID_REQUEST
    assert "exceeds the frame limit of 100 bytes" in info.value.message
    with pytest.raises(errors.FrameTooLarge):
        core.notification("notify", NotifyParams("x" * 100))
    rid, frame = core.request("run", RunParams("x" * 20))  # the refused one used no id
    assert rid == 1 and len(frame) - 1 <= 100


def test_frame_limit_is_inclusive() -> None:
    _, frame = ClientCore().request("run", RunParams("x"))
    exact = len(frame) - 1
    ClientCore(max_frame_bytes=exact).request("run", RunParams("x"))
    with pytest.raises(errors.FrameTooLarge):
        ClientCore(max_frame_bytes=exact - 1).request("run", RunParams("x"))


def test_null_id_error_answers_the_oldest_request_still_waiting() -> None:
    core = ClientCore()
    r1, _ = core.request("status", None)
    r2, _ = core.request("run", {"input": "big"})
    core.feed(reply(r1, {"n": 1}))
    core.feed(error_reply(None, errors.INVALID_REQUEST, "frame too large"))
    assert core.has_reply(r2) and None not in core.replies
    with pytest.raises(RpcError, match="frame too large"):
        core.take(r2, RunResult)
    assert msgspec.json.decode(core.replies[r1].result) == {"n": 1}  # type: ignore[arg-type]


def test_a_forgotten_request_gets_no_null_id_answer() -> None:
    core = ClientCore()
    r1, _ = core.request("status", None)
    r2, _ = core.request("status", None)
    core.forget(r1)  # e.g. timed out
    core.feed(error_reply(None, errors.PARSE_ERROR, "bad"))
    assert core.has_reply(r2) and not core.has_reply(r1)


# --- the client methods come from the method table ---------------------------------------------


def test_client_methods_cover_the_method_table_exactly() -> None:
    bound = {name: attr for name, attr in vars(ClientMethods).items() if isinstance(attr, Rpc)}
    assert {rpc.method.name for rpc in bound.values()} == set(METHODS)
    for name, rpc in bound.items():
        assert rpc.method.name == name.removesuffix("_wait")
        assert rpc.method.params is METHODS[rpc.method.name].params


class Recorder(ClientMethods, SyncCaller):
    def __init__(self) -> None:
        self.core = ClientCore()
        self.sent: list[dict[str, object]] = []

    def _invoke(self, method: Method[Params, T], params: Params) -> T:
        _, frame = self.core.request(method.name, params)
        self.sent.append(msgspec.json.decode(frame))
        return None  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("call", "method", "params"),
    [
        (lambda c: c.run("hi"), "run", {"input": "hi"}),
        (
            lambda c: c.run("hi", mode="steer", client_key="k"),
            "run",
            {"input": "hi", "mode": "steer", "client_key": "k"},
        ),
        (lambda c: c.run_wait("hi"), "run", {"input": "hi", "wait": True}),
        (lambda c: c.notify("m"), "notify", {"message": "m"}),
        (lambda c: c.notify("m", source=None), "notify", {"message": "m"}),
        (
            lambda c: c.notify("m", "ci", "k"),
            "notify",
            {"message": "m", "source": "ci", "client_key": "k"},
        ),
        (lambda c: c.history(), "history", None),
        (lambda c: c.history(since=3, limit=None), "history", {"since": 3}),
        (lambda c: c.history(0, 5), "history", {"limit": 5}),
        (lambda c: c.cancel("r1"), "cancel", {"run_id": "r1"}),
        (lambda c: c.subscribe(7), "subscribe", {"since": 7}),
        (lambda c: c.subscribe(), "subscribe", None),
        (
            lambda c: c.pod_event("kid", "run.finished", text="t"),
            "pod_event",
            {"pod": "kid", "kind": "run.finished", "text": "t"},
        ),
        (lambda c: c.status(), "status", None),
        (lambda c: c.compact(), "compact", None),
        (lambda c: c.shutdown(), "shutdown", None),
    ],
)
def test_client_methods_send_what_the_api_says(
    call: Callable[[Recorder], object], method: str, params: dict[str, object] | None
) -> None:
    rec = Recorder()
    call(rec)
    [sent] = rec.sent
    assert sent["method"] == method
    assert sent.get("params") == params


# --- both clients over a real socket: an id:null error ends the call --------------------------


def null_id_server(sock: socket.socket) -> threading.Thread:
    """Reads one request line, answers it with an error whose id is null (as a pod does for a
    frame it could not read), then with nothing."""

    def serve() -> None:
        buf = b""
        while not buf.endswith(b"\n"):
            buf += sock.recv(1 << 16)
        sock.sendall(error_reply(None, errors.INVALID_REQUEST, "frame too large; discarded"))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_sync_client_takes_a_null_id_error_as_its_answer() -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX)
    mine.settimeout(10)
    thread = null_id_server(theirs)
    client = PodClient(mine, "pair")
    with pytest.raises(RpcError, match="frame too large") as info:
        client.run("x")
    assert info.value.code == errors.INVALID_REQUEST
    thread.join()
    client.close()
    theirs.close()


def test_async_client_takes_a_null_id_error_as_its_answer() -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX)
    thread = null_id_server(theirs)

    async def go() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        client = AsyncPodClient(reader, writer, "pair")
        with pytest.raises(RpcError, match="frame too large"):
            await asyncio.wait_for(client.run("x"), 10)
        await client.close()

    asyncio.run(go())
    thread.join()
    theirs.close()


def test_a_late_reply_to_a_forgotten_request_is_dropped() -> None:
    """A call that timed out or was cancelled: its reply, when it comes, is not kept for the
    life of the client (a history page can be 64 MiB)."""
    core = ClientCore()
    gave_up, _ = core.request("history", None)
    core.forget(gave_up)
    core.feed(reply(gave_up, {"entries": []}))
    assert core.replies == {}
    answered, _ = core.request("status", None)
    core.feed(reply(answered, {"n": 1}))
    core.forget(answered)  # given up on after it came: dropped too
    assert core.replies == {}


def test_closing_an_async_client_fails_its_waiting_calls_and_later_ones() -> None:
    """close() left the calls other tasks were waiting on (and events()) hanging for ever."""
    mine, theirs = socket.socketpair(socket.AF_UNIX)  # a pod that never answers

    async def go() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        client = AsyncPodClient(reader, writer, "pair")
        waiting = asyncio.create_task(client.status())
        await asyncio.sleep(0)  # sent, waiting for its answer
        await client.close()
        with pytest.raises(errors.ConnectionClosed):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(errors.ConnectionClosed):
            await asyncio.wait_for(client.status(), 10)

    asyncio.run(go())
    theirs.close()


def test_a_closed_sync_client_says_so() -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX)
    client = PodClient(mine, "pair")
    client.close()
    with pytest.raises(errors.ConnectionClosed, match="was closed"):  # (not OSError EBADF)
        client.status()
    theirs.close()


def test_a_sync_request_cut_off_part_sent_closes_the_connection() -> None:
    """A send cut off by the client's timeout (or Ctrl-C) left half a frame on the wire: the
    pod read the next request as the rest of that line, answered it under the first one's id
    (dropped), and the next call waited for ever. The connection is closed instead."""
    mine, theirs = socket.socketpair(socket.AF_UNIX)  # a pod that does not read (stopped)
    mine.settimeout(0.05)
    client = PodClient(mine, "pair")
    with pytest.raises(TimeoutError):
        client.notify("x" * (4 << 20))
    with pytest.raises(errors.ConnectionClosed, match="cut off part-sent"):
        client.status()
    assert mine.fileno() < 0  # not left open until the caller closes it
    theirs.close()


def test_an_async_connection_that_failed_is_closed_without_waiting_for_close() -> None:
    """A reply no pod would send (or the pod's end of it gone) ends the connection for every
    caller, but its socket stayed open until close(): a program that reconnects on the error
    leaked a descriptor each time, and the server kept its end."""
    mine, theirs = socket.socketpair(socket.AF_UNIX)
    theirs.settimeout(10)

    async def go() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        client = AsyncPodClient(reader, writer, "pair")
        waiting = asyncio.create_task(client.status())
        await asyncio.to_thread(theirs.recv, 1 << 16)  # the request
        theirs.sendall(b"not json\n")
        with pytest.raises(RpcError, match="malformed"):
            await asyncio.wait_for(waiting, 10)
        assert await asyncio.to_thread(theirs.recv, 1) == b""  # our end is closed
        await client.close()  # (still fine to call)

    asyncio.run(go())
    theirs.close()


def test_a_sync_connection_the_pod_closed_gives_its_socket_back_at_once() -> None:
    """The same for the sync client: once the pod's end went, the socket stayed open until
    close(), so a program reconnecting on ConnectionClosed leaked a descriptor each time."""
    mine, theirs = socket.socketpair(socket.AF_UNIX)
    mine.settimeout(10)
    client = PodClient(mine, "pair")
    theirs.close()  # the pod went
    with pytest.raises(errors.ConnectionClosed, match="closed the connection"):
        client.status()
    assert mine.fileno() < 0
    with pytest.raises(errors.ConnectionClosed, match="closed the connection"):
        client.status()  # and says so again, not "was closed" by us
    client.close()  # (still fine to call)


def test_a_cancellation_landing_while_the_client_closes_is_not_swallowed() -> None:
    """`close()` awaited its read task under suppress(CancelledError): a cancellation of the
    caller landing there (a pod's `spawn_pod` call cancelled as its `run` call's connection
    closed) was swallowed with the read task's, and the caller went on as if never cancelled."""
    mine, theirs = socket.socketpair(socket.AF_UNIX)
    went_on: list[bool] = []

    async def go() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        client = AsyncPodClient(reader, writer, "pair")

        async def caller() -> None:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # lands in close()'s first await
            await client.close()
            went_on.append(True)

        task = asyncio.create_task(caller())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert writer.is_closing()  # closed all the same

    asyncio.run(go())
    theirs.close()
    assert went_on == []
