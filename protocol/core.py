"""The sans-IO half of PodClient, shared by the sync and the async client.

It turns calls into request bytes and received bytes into replies and events; the two clients
only move bytes.
"""

import os
from collections import deque
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from protocol import paths
from protocol.errors import RpcError
from protocol.framing import LineFramer, Oversize
from protocol.types import Event, Response

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_response_decoder = msgspec.json.Decoder(Response)
_event_decoder = msgspec.json.Decoder(Event)


def resolve_socket(target: str | os.PathLike[str]) -> Path:
    """A pod name maps to its socket under the runtime dir; anything with a slash is a path."""
    text = os.fspath(target)
    if "/" in text:
        return Path(text)
    return paths.socket_path(text)


def clean_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


class ClientCore:
    def __init__(self) -> None:
        self._next_id = 0
        self._framer = LineFramer(max_frame_bytes=64 * 1024 * 1024)
        self.replies: dict[int | str | None, Response] = {}
        self.events: deque[Event] = deque()

    def request(self, method: str, params: dict[str, Any] | None) -> tuple[int, bytes]:
        self._next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": self._next_id, "method": method}
        if params:
            msg["params"] = params
        return self._next_id, _encoder.encode(msg) + b"\n"

    def notification(self, method: str, params: dict[str, Any] | None) -> bytes:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params:
            msg["params"] = params
        return _encoder.encode(msg) + b"\n"

    def feed(self, data: bytes) -> None:
        for line in self._framer.feed(data):
            if isinstance(line, Oversize):
                raise RpcError(-32700, f"reply of {line.size} bytes exceeds the client's limit")
            reply = _response_decoder.decode(line)
            if reply.method == "event" and not isinstance(reply.params, msgspec.UnsetType):
                self.events.append(_event_decoder.decode(reply.params))
            else:
                self.replies[reply.id] = reply

    def take(self, request_id: int, result_type: type[T]) -> T:
        reply = self.replies.pop(request_id)
        if not isinstance(reply.error, msgspec.UnsetType):
            raise RpcError(reply.error.code, reply.error.message, reply.error.data)
        if isinstance(reply.result, msgspec.UnsetType):
            raise RpcError(-32603, "reply has neither result nor error")
        return msgspec.json.decode(reply.result, type=result_type)
