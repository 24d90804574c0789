"""One JSON-RPC call to a pod with the standard library alone: podctl's fast path.

`PodClient` is the client to use: typed results, events, many calls on one connection. Importing
it (msgspec, the method table, `socket`) costs ~30 ms here (this module ~10 ms), more than
everything else `podctl status` or `podctl notify` does on top of typer's own start. `call`
connects the same way (the same owner and peer checks), sends one request and returns the
reply's `result` as plain JSON data, raising what PodClient raises: PodNotRunning, RpcError and
its per-code subclasses, FrameTooLarge (before sending anything), ConnectionClosed,
UnsafeSocket, TimeoutError, OSError.
"""

from __future__ import annotations

import _socket
import errno
import json
import os
import time

from protocol.errors import (
    INTERNAL_ERROR,
    LOST,
    PARSE_ERROR,
    ConnectionClosed,
    FrameTooLarge,
    RpcError,
    error_for,
)
from protocol.framing import DEFAULT_MAX_FRAME_BYTES, MAX_REPLY_BYTES, LineFramer, Oversize
from protocol.sockets import connect

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from typing import Any

_ID = 1  # the one request on the connection
# What callers read of a result without looking (SPEC §5): one without it is malformed, where
# podctl's `result["paused"]` ended in a KeyError traceback (a socket that is not a pod's).
RESULT_FIELDS: dict[str, tuple[str, ...]] = {
    "run": ("run_id",),
    "notify": ("notification_id", "wakes"),
    "pause": ("paused",),
    "resume": ("run_id",),
    "cancel": ("cancelled",),
    "compact": ("session_id",),
    # `podctl stop` looked up the unit of status["pid"]: a KeyError traceback for `{}`.
    "status": ("name", "pid", "state"),
}
# The types of the status fields podctl reads (SPEC 5, and `mcp`, `sandbox_notes`), when given:
# `"queue": "x"` from a socket that is not a pod's ended `podctl status` and `wait` in a traceback.
STATUS_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "pid": int,
    "state": str,
    "queue": dict,
    "usage": dict,
    "budget": dict,
    "scope": list,
    "children": list,
    "sandbox_notes": list,
    "mcp": list,
    "started_at": (int, float),
}


def call(
    target: str | os.PathLike[str],
    method: str,
    params: dict[str, Any] | None = None,
    timeout: float | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Any:
    """Call `method` on the pod `target` (a name or a socket path); its result as JSON data."""
    sock = connect(target, timeout)
    try:
        sock.sendall(request(method, params, max_frame_bytes))
        result = _answer(sock, os.fspath(target), timeout)
        missing = [key for key in RESULT_FIELDS.get(method, ()) if key not in result]
        if missing:
            raise RpcError(PARSE_ERROR, f"the pod's reply is malformed: no {missing[0]!r}")
        wrong = malformed_status(result) if method == "status" else None
        if wrong:
            raise RpcError(PARSE_ERROR, f"the pod's reply is malformed: {wrong}")
        return result
    except LOST as exc:  # the pod went mid-call: as when it closes without answering
        raise ConnectionClosed(f"pod {os.fspath(target)!r} closed the connection") from exc
    finally:
        sock.close()


def malformed_status(status: dict[str, Any]) -> str | None:
    """What in a status result is not of a pod's shape (STATUS_TYPES; queue counts, scope rules
    and MCP servers too), or None."""
    for key, kind in STATUS_TYPES.items():
        value = status.get(key)
        if (value is not None or key in RESULT_FIELDS["status"]) and not isinstance(value, kind):
            return f"its {key!r} is {json.dumps(value)[:40]}"
    counts = (status.get("queue") or {}).values()
    if not all(isinstance(n, int) for n in counts):
        return "a 'queue' count is no integer"
    for key in ("scope", "mcp"):
        if not all(isinstance(item, dict) for item in status.get(key) or ()):
            return f"an item of {key!r} is no object"
    return None


def request(method: str, params: dict[str, Any] | None, max_frame_bytes: int) -> bytes:
    """The request frame, as PodClient writes it (no `params` when there are none)."""
    body = _encode(params) if params else b""
    frame = b'{"jsonrpc":"2.0","id":%d,"method":%b%b}' % (
        _ID,
        _encode(method),
        b',"params":' + body if body else b"",
    )
    if len(frame) > max_frame_bytes:
        # The pod would discard it after reading it all: say so before sending a byte.
        raise FrameTooLarge(len(frame), max_frame_bytes)
    return frame + b"\n"


def _encode(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _answer(sock: _socket.socket, target: str, timeout: float | None) -> Any:
    framer = LineFramer(max_frame_bytes=MAX_REPLY_BYTES)
    # `timeout` bounds the whole answer, not each read: a socket that is not a pod's and never
    # stops talking (an endless line, events, replies to other ids) kept every read short and
    # `podctl status` waiting for ever.
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(errno.ETIMEDOUT, f"pod {target!r} did not answer in time")
            sock.settimeout(left)
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionClosed(f"pod {target!r} closed the connection")
        for line in framer.feed(data):
            if isinstance(line, Oversize):
                raise RpcError(
                    PARSE_ERROR, f"reply of {line.size} bytes exceeds the client's limit"
                )
            reply = _decode(line)
            if reply.get("method") == "event" and "params" in reply:
                continue  # not subscribed: none should come, and none is the answer
            # No id: the pod could not read ours (e.g. a request it found too large).
            if reply.get("id", None) in (_ID, None):
                return _result(reply)


def _decode(line: bytes) -> dict[str, Any]:
    try:
        # UTF-8, as the wire is (SPEC 5): json.loads guesses UTF-16 or -32 from NUL bytes, so a
        # socket's garbage said "'utf-16-be' codec can't decode", and UTF-16 JSON was taken.
        reply = json.loads(line.decode())
    except ValueError as exc:  # (UnicodeDecodeError included)
        raise RpcError(PARSE_ERROR, f"the pod's reply is not JSON: {exc}") from None
    if not isinstance(reply, dict):
        raise RpcError(PARSE_ERROR, "the pod's reply is not a JSON object")
    return reply


def _result(reply: dict[str, Any]) -> Any:
    error = reply.get("error")
    if error is not None:
        if not (
            isinstance(error, dict)
            and isinstance(error.get("code"), int)
            and isinstance(error.get("message"), str)
        ):
            raise RpcError(PARSE_ERROR, f"the pod's error reply is malformed: {error!r}")
        raise error_for(error["code"], error["message"], error.get("data"))
    if "result" not in reply:
        raise RpcError(INTERNAL_ERROR, "reply has neither result nor error")
    result = reply["result"]
    if not isinstance(result, dict):  # every method's result is an object (SPEC §5)
        # `null` or a string from a socket that is not a pod's: podctl then indexed it
        # (`result["paused"]`) and ended in a TypeError traceback.
        raise RpcError(PARSE_ERROR, "the pod's reply is malformed: its result is not an object")
    return result
