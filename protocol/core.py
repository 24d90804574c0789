"""The sans-IO half of PodClient, shared by the sync and the async client.

It turns calls into request bytes and received bytes into replies and events, and declares every
client method once, from the method table: the two clients only move bytes.
"""

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

import msgspec

from protocol import methods
from protocol.errors import (
    INTERNAL_ERROR,
    PARSE_ERROR,
    FrameTooLarge,
    RpcError,
    error_for,
)
from protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_REPLY_BYTES,
    LineFramer,
    Oversize,
)
from protocol.methods import Method

# Where they lived before protocol.sockets: kept importable from here.
from protocol.sockets import check_peer as check_peer
from protocol.sockets import check_socket_owner as check_socket_owner
from protocol.sockets import resolve_socket as resolve_socket
from protocol.types import (
    CancelParams,
    Event,
    NoParams,
    Params,
    PodEventParams,
    Response,
    SubscribeParams,
)
from protocol.unreadable import UNREADABLE

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")
PT = TypeVar("PT", bound=Params)

_encoder = msgspec.json.Encoder()
_response_decoder = msgspec.json.Decoder(Response)
_event_decoder = msgspec.json.Decoder(Event)


def clean_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


class ClientCore:
    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._next_id = 0
        self._framer = LineFramer(max_frame_bytes=MAX_REPLY_BYTES)
        self._inflight: dict[int, None] = {}  # sent and not yet answered, oldest first
        self._forgotten: set[int] = set()  # given up on: their replies are dropped as they come
        self.replies: dict[int | str | None, Response] = {}
        self.events: deque[Event] = deque()
        self._subscribes: set[int] = set()  # ids of subscribe requests not yet answered
        self.subscribed = False  # a subscribe succeeded: events will come

    def _frame(self, head: bytes, params: Params | dict[str, Any] | None) -> bytes:
        body = _encoder.encode(params) if params is not None else b"{}"
        frame = head + (b',"params":' + body if body != b"{}" else b"") + b"}"
        if len(frame) > self.max_frame_bytes:
            # The pod would discard it after reading it all: say so before sending a byte.
            raise FrameTooLarge(len(frame), self.max_frame_bytes)
        return frame + b"\n"

    def request(self, method: str, params: Params | dict[str, Any] | None) -> tuple[int, bytes]:
        rid = self._next_id + 1
        frame = self._frame(
            b'{"jsonrpc":"2.0","id":%d,"method":%b' % (rid, _encoder.encode(method)), params
        )
        self._next_id = rid
        self._inflight[rid] = None
        if method == "subscribe":
            self._subscribes.add(rid)
        return rid, frame

    def notification(self, method: str, params: Params | dict[str, Any] | None) -> bytes:
        return self._frame(b'{"jsonrpc":"2.0","method":%b' % _encoder.encode(method), params)

    def feed(self, data: bytes) -> None:
        for line in self._framer.feed(data):
            if isinstance(line, Oversize):
                raise RpcError(
                    PARSE_ERROR, f"reply of {line.size} bytes exceeds the client's limit"
                )
            try:
                reply = _response_decoder.decode(line)
                event = (
                    _event_decoder.decode(reply.params)
                    if reply.method == "event" and not isinstance(reply.params, msgspec.UnsetType)
                    else None
                )
            except UNREADABLE as exc:
                # What no pod sends (a socket path that is not a pod's, answering in its own
                # format): a typed error, as oneshot's, not a msgspec traceback out of podctl.
                raise RpcError(PARSE_ERROR, f"the pod's reply is malformed: {exc}") from None
            if event is not None:
                self.events.append(event)
            elif reply.id is None and self._unanswered() is not None:
                # The pod could not read the id of a request (e.g. one it found too large): the
                # answer belongs to the oldest request still waiting, or its caller hangs.
                self.replies[self._unanswered()] = reply
            elif isinstance(reply.id, int) and reply.id in self._forgotten:
                self._forgotten.discard(reply.id)  # its caller gave up: nobody takes it
            else:
                self.replies[reply.id] = reply

    def _unanswered(self) -> int | None:
        return next((rid for rid in self._inflight if rid not in self.replies), None)

    def has_reply(self, request_id: int) -> bool:
        return request_id in self.replies

    def forget(self, request_id: int) -> None:
        """The caller gave up on `request_id` (timeout, cancel): a late reply is dropped."""
        self._inflight.pop(request_id, None)
        if self.replies.pop(request_id, None) is None:
            self._forgotten.add(request_id)  # (an id is never reused: it is dropped when it comes)
        if request_id in self._subscribes:  # it may have reached the pod: events may come
            self._subscribes.discard(request_id)
            self.subscribed = True

    def take(self, request_id: int, result_type: type[T]) -> T:
        self._inflight.pop(request_id, None)
        reply = self.replies.pop(request_id)
        if not isinstance(reply.error, msgspec.UnsetType):
            self._subscribes.discard(request_id)
            raise error_for(reply.error.code, reply.error.message, reply.error.data)
        if isinstance(reply.result, msgspec.UnsetType):
            raise RpcError(INTERNAL_ERROR, "reply has neither result nor error")
        try:
            result = msgspec.json.decode(reply.result, type=result_type)
        except UNREADABLE as exc:
            # A result not of the method's shape (`null`, a string: a socket that is not a
            # pod's): a typed error, as a malformed envelope is, not a msgspec traceback.
            self._subscribes.discard(request_id)
            raise RpcError(PARSE_ERROR, f"the pod's reply is malformed: {exc}") from None
        if request_id in self._subscribes:
            self._subscribes.discard(request_id)
            self.subscribed = True
        return result

    def check_subscribed(self) -> None:
        """Waiting for events on a connection that never subscribed would wait for ever."""
        if not self.subscribed and not self.events:
            raise RuntimeError("no events will come: call subscribe() on this connection first")


# --- client methods, declared once for both clients --------------------------------------------


class SyncCaller:
    def _invoke(self, method: Method[Params, R], params: Params) -> R:
        raise NotImplementedError


class AsyncCaller:
    async def _invoke(self, method: Method[Params, R], params: Params) -> R:
        raise NotImplementedError


class Rpc(Generic[P, R]):
    """A client method: its arguments build the params Struct, its result is the method's.

    On a PodClient it returns the result; on an AsyncPodClient, an awaitable of it.
    """

    def __init__(self, method: Method[PT, R], build: Callable[P, PT]) -> None:
        self.method: Method[Params, R] = method
        self.build = build
        self.name = method.name

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.name = name  # run_wait, not run, in reprs and tracebacks

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> "Rpc[P, R]": ...
    @overload
    def __get__(self, obj: AsyncCaller, owner: type[Any]) -> Callable[P, Awaitable[R]]: ...
    @overload
    def __get__(self, obj: SyncCaller, owner: type[Any]) -> Callable[P, R]: ...
    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        method, build = self.method, self.build

        def call(*args: P.args, **kwargs: P.kwargs) -> Any:
            return obj._invoke(method, build(*args, **kwargs))

        call.__name__ = self.name
        call.__qualname__ = f"{type(obj).__name__}.{self.name}"
        return call


class ClientMethods:
    """One attribute per method of `protocol.methods.METHODS` (a test checks it stays so)."""

    run = Rpc(methods.RUN, methods.run_params)
    run_wait = Rpc(methods.RUN_WAIT, methods.run_wait_params)
    notify = Rpc(methods.NOTIFY, methods.notify_params)
    resume = Rpc(methods.RESUME, NoParams)
    pause = Rpc(methods.PAUSE, NoParams)
    cancel = Rpc(methods.CANCEL, CancelParams)
    status = Rpc(methods.STATUS, NoParams)
    history = Rpc(methods.HISTORY, methods.history_params)
    usage = Rpc(methods.USAGE, NoParams)
    subscribe = Rpc(methods.SUBSCRIBE, SubscribeParams)
    compact = Rpc(methods.COMPACT, NoParams)
    pod_event = Rpc(methods.POD_EVENT, PodEventParams)
    shutdown = Rpc(methods.SHUTDOWN, NoParams)
