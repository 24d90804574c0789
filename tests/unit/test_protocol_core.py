"""The sans-IO client core: request bytes out, replies and events demultiplexed from frames in."""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import errors
from protocol.core import ClientCore, clean_params, resolve_socket
from protocol.errors import RpcError
from protocol.methods import METHODS
from protocol.types import (
    CancelParams,
    Event,
    NotifyParams,
    NotifyResult,
    RunParams,
    RunResult,
    StatusResult,
    SubscribeParams,
)


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
    assert "reviewer" in resolve_socket("reviewer").parts


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
    with pytest.raises(msgspec.ValidationError, match=r"state"):
        core.take(rid, RunResult)


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
