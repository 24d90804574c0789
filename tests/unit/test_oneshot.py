"""protocol.oneshot, podctl's one-call client: the same request bytes, answers and errors as
PodClient, against a real Unix socket served by a thread."""

import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from protocol import errors, oneshot
from protocol.core import ClientCore
from protocol.errors import ConnectionClosed, PodNotRunning, RpcError
from protocol.types import CancelParams, NotifyParams


class Server:
    """Accepts one connection, reads one request line, writes `answer`, closes."""

    def __init__(self, path: Path, answer: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.sock.settimeout(10)
        self.answer = answer
        self.request = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            while not self.request.endswith(b"\n"):
                data = conn.recv(1 << 16)
                if not data:
                    break
                self.request += data
            with contextlib.suppress(OSError):  # the client may have gone already
                conn.sendall(self.answer)

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def sock_path() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="os", dir="/tmp"))
    try:
        yield d / "sock"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def serving(path: Path, *frames: Any) -> Iterator[Server]:
    server = Server(path, b"".join(msgspec.json.encode(f) + b"\n" for f in frames))
    try:
        yield server
    finally:
        server.close()


# --- request bytes ------------------------------------------------------------------------------


def test_requests_are_the_bytes_the_typed_client_sends() -> None:
    cases: list[tuple[str, dict[str, Any] | None, Any]] = [
        ("status", None, None),
        ("pause", {}, None),
        ("notify", {"message": 'héllo "x"\n✓'}, NotifyParams('héllo "x"\n✓')),
        ("notify", {"message": "m", "source": "ci"}, NotifyParams("m", "ci")),
        ("cancel", {"run_id": "r1"}, CancelParams("r1")),
        ("history", {"limit": 1}, {"limit": 1}),
    ]
    for method, params, typed in cases:
        _, expected = ClientCore().request(method, typed)
        assert oneshot.request(method, params, 1 << 20) == expected


def test_a_frame_over_the_limit_is_refused_like_the_typed_client() -> None:
    _, frame = ClientCore().request("notify", NotifyParams("x" * 50))
    exact = len(frame) - 1
    oneshot.request("notify", {"message": "x" * 50}, exact)
    with pytest.raises(errors.FrameTooLarge) as info:
        oneshot.request("notify", {"message": "x" * 50}, exact - 1)
    assert "exceeds the frame limit" in info.value.message


def test_a_too_large_request_is_not_sent(sock_path: Path) -> None:
    answer = {"jsonrpc": "2.0", "id": 1, "result": {}}
    with serving(sock_path, answer) as server, pytest.raises(errors.FrameTooLarge):
        oneshot.call(sock_path, "notify", {"message": "x" * 200}, 10, max_frame_bytes=100)
    assert server.request == b""  # connected (as PodClient does), then closed unsent


# --- answers ------------------------------------------------------------------------------------


def test_the_result_comes_back_as_json_data(sock_path: Path) -> None:
    result = {"notification_id": "n1", "wakes": True, "big": 2**70, "f": 1.5, "u": "✓"}
    with serving(sock_path, {"jsonrpc": "2.0", "id": 1, "result": result}) as server:
        got = oneshot.call(str(sock_path), "notify", {"message": "m"}, 10)
    assert got == result
    assert server.request == oneshot.request("notify", {"message": "m"}, 1 << 20)


def test_events_before_the_answer_are_skipped(sock_path: Path) -> None:
    event = {"jsonrpc": "2.0", "method": "event", "params": {"seq": 1, "ts": 1.0, "type": "x"}}
    with serving(sock_path, event, {"jsonrpc": "2.0", "id": 1, "result": {"n": 1}}):
        assert oneshot.call(sock_path, "usage", timeout=10) == {"n": 1}


@pytest.mark.parametrize("result", [None, [1], "text", 5])
def test_a_result_that_is_no_object_is_a_parse_error(sock_path: Path, result: object) -> None:
    # Every method's result is an object (SPEC §5): podctl indexed one that was not.
    answer = {"jsonrpc": "2.0", "id": 1, "result": result}
    with serving(sock_path, answer), pytest.raises(RpcError, match="not an object") as info:
        oneshot.call(sock_path, "pause", timeout=10)
    assert info.value.code == errors.PARSE_ERROR


@pytest.mark.parametrize(
    ("method", "result", "missing"),
    [
        ("pause", {}, "paused"),
        ("notify", {"notification_id": "n"}, "wakes"),
        ("run", {"state": "started"}, "run_id"),
        ("compact", {"id": "s"}, "session_id"),
        ("status", {}, "name"),
        ("status", {"name": "p", "state": "idle"}, "pid"),
    ],
)
def test_a_result_without_what_spec_gives_it_is_a_parse_error(
    sock_path: Path, method: str, result: dict[str, object], missing: str
) -> None:
    # `{}` from a socket that is not a pod's: podctl's result["paused"] was a KeyError traceback.
    answer = {"jsonrpc": "2.0", "id": 1, "result": result}
    with serving(sock_path, answer), pytest.raises(RpcError, match=f"no '{missing}'") as info:
        oneshot.call(sock_path, method, timeout=10)
    assert info.value.code == errors.PARSE_ERROR


@pytest.mark.parametrize(
    ("fields", "wrong"),
    [
        ({"name": None}, "its 'name' is null"),
        ({"pid": "1"}, "its 'pid' is \"1\""),
        ({"queue": "zz"}, "its 'queue' is \"zz\""),
        ({"queue": {"runs": 1e400}}, "a 'queue' count is no integer"),
        ({"scope": [1]}, "an item of 'scope' is no object"),
        ({"started_at": "now"}, "its 'started_at' is \"now\""),
    ],
)
def test_a_status_of_no_pods_shape_is_a_parse_error(
    sock_path: Path, fields: dict[str, object], wrong: str
) -> None:
    result = {"name": "p", "pid": 1, "state": "idle", "queue": {"runs": 0}, **fields}
    answer = {"jsonrpc": "2.0", "id": 1, "result": result}
    with serving(sock_path, answer), pytest.raises(RpcError) as info:
        oneshot.call(sock_path, "status", timeout=10)
    assert info.value.message == f"the pod's reply is malformed: {wrong}"


def test_a_null_id_error_is_the_answer(sock_path: Path) -> None:
    err = {"code": errors.INVALID_REQUEST, "message": "frame too large; discarded"}
    answer = {"jsonrpc": "2.0", "id": None, "error": err}
    with serving(sock_path, answer), pytest.raises(RpcError, match="frame too large") as info:
        oneshot.call(sock_path, "run", {"input": "x"}, 10)
    assert info.value.code == errors.INVALID_REQUEST


def test_application_errors_raise_their_own_class_with_data(sock_path: Path) -> None:
    err = {"code": errors.QUEUE_FULL, "message": "queue full", "data": {"max": 3}}
    answer = {"jsonrpc": "2.0", "id": 1, "error": err}
    with serving(sock_path, answer), pytest.raises(errors.QueueFull) as info:
        oneshot.call(sock_path, "notify", {"message": "m"}, 10)
    assert (info.value.code, info.value.data) == (errors.QUEUE_FULL, {"max": 3})
    assert info.value.message == "queue full"


def test_a_reply_with_neither_result_nor_error_is_an_internal_error(sock_path: Path) -> None:
    with serving(sock_path, {"jsonrpc": "2.0", "id": 1}), pytest.raises(RpcError) as info:
        oneshot.call(sock_path, "status", timeout=10)
    assert info.value.code == errors.INTERNAL_ERROR


@pytest.mark.parametrize(
    "answer",
    [
        b"not json\n",
        b"[1, 2]\n",
        b'{"id": 1, "error": "x"}\n',
        b"\x00\xffHELLO\n",  # said "'utf-16-be' codec can't decode byte 0x65"
        # a status, but not in UTF-8
        '{"jsonrpc":"2.0","id":1,"result":{"name":"p","pid":1,"state":"idle"}}'.encode(
            "utf-16-le"
        )
        + b"\n",
    ],
)
def test_a_malformed_reply_is_a_parse_error(sock_path: Path, answer: bytes) -> None:
    server = Server(sock_path, answer)
    try:
        with pytest.raises(RpcError) as info:
            oneshot.call(sock_path, "status", timeout=10)
    finally:
        server.close()
    assert info.value.code == errors.PARSE_ERROR
    assert "utf-16" not in info.value.message


# --- failures to connect or to answer ------------------------------------------------------------


def test_no_socket_and_a_stale_socket_are_not_running(sock_path: Path) -> None:
    with pytest.raises(PodNotRunning):
        oneshot.call(sock_path, "status", timeout=10)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_path))
    stale.close()  # the file stays, nobody listens
    with pytest.raises(PodNotRunning):
        oneshot.call(sock_path, "status", timeout=10)


def test_a_pod_that_closes_without_answering(sock_path: Path) -> None:
    server = Server(sock_path, b"")
    try:
        with pytest.raises(ConnectionClosed):
            oneshot.call(sock_path, "status", timeout=10)
    finally:
        server.close()


def test_a_pod_that_does_not_answer_times_out(sock_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)  # accepted by the kernel, never answered
    try:
        with pytest.raises(TimeoutError):
            oneshot.call(sock_path, "status", timeout=0.05)
    finally:
        listener.close()


class Chatter:
    """Reads the request, then writes `chunk` again and again until the client goes: a
    socket that is not a pod's and never stops talking, with never an answer in it."""

    def __init__(self, path: Path, chunk: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.sock.settimeout(10)
        self.chunk = chunk
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn, contextlib.suppress(OSError):  # until the client closes
            conn.recv(1 << 16)
            while True:
                conn.sendall(self.chunk)

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


@pytest.mark.parametrize(
    "chunk",
    [
        b"x" * 65536,  # one endless line
        # events, and no answer
        b'{"jsonrpc":"2.0","method":"event","params":{"seq":1,"ts":0,"type":"x","data":{}}}\n' * 50,
        b'{"jsonrpc":"2.0","id":7,"result":{}}\n' * 100,  # answers to another request
    ],
    ids=["endless-line", "events", "other-ids"],
)
@pytest.mark.parametrize("client", ["oneshot", "PodClient"])
def test_a_socket_that_never_stops_talking_times_out(
    sock_path: Path, chunk: bytes, client: str
) -> None:
    """The timeout bounds the whole answer: each read returning at once used to restart it,
    and `podctl status` of such a socket waited for ever."""
    from protocol.client import PodClient

    server = Chatter(sock_path, chunk)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            if client == "oneshot":
                oneshot.call(sock_path, "status", timeout=0.5)
            else:
                with PodClient.connect(sock_path, timeout=0.5) as pod:
                    pod.call_raw("status")
    finally:
        server.close()
    assert time.monotonic() - started < 5
