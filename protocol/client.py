"""PodClient: a blocking client for a pod's control socket (no asyncio import: podctl stays fast).

    with PodClient.connect("reviewer") as pod:
        pod.notify("build failed", source="ci")

Its RPC methods (run, notify, status, ...) are declared once for both clients in
`protocol.core.ClientMethods`, from the method table.

One thread at a time: two threads calling one PodClient would read each other's replies. Give
each thread its own client, or use `protocol.aio.AsyncPodClient`, which takes many calls at
once on one connection.
"""

import _socket
import errno
import select
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import msgspec

from protocol.core import ClientCore, ClientMethods, SyncCaller
from protocol.errors import LOST, ConnectionClosed
from protocol.framing import DEFAULT_MAX_FRAME_BYTES
from protocol.methods import Method
from protocol.sockets import connect
from protocol.types import Event, Params

T = TypeVar("T")


class PodClient(ClientMethods, SyncCaller):
    def __init__(
        self, sock: _socket.socket, target: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self._sock = sock
        self._core = ClientCore(max_frame_bytes)
        self.target = target
        self._broken = False  # a request was cut off part-sent: see _send
        self._gone = False  # the pod closed the connection: see _lost

    @classmethod
    def connect(
        cls,
        target: str | Path,
        timeout: float | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> "PodClient":
        """Connect to a pod by name (looked up under the runtime dir) or by socket path.

        Refuses (UnsafeSocket) a socket that another user owns or serves, before sending anything.
        """
        sock = connect(target, timeout)
        return cls(sock, str(target), max_frame_bytes)

    def close(self) -> None:
        """Close the connection; a call made afterwards raises ConnectionClosed."""
        self._sock.close()

    def __enter__(self) -> "PodClient":
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- transport -----------------------------------------------------------------------------

    def _closed(self) -> ConnectionClosed:
        return ConnectionClosed(f"pod {self.target!r} closed the connection")

    def _lost(self) -> ConnectionClosed:
        """The pod's end went: nothing more can pass, so the socket is given back now. Kept
        until close(), a program that caught the error and connected again leaked a descriptor
        each time."""
        self._gone = True
        self._sock.close()
        return self._closed()

    def _usable(self) -> None:
        if self._gone:
            raise self._closed()
        if self._broken:
            raise ConnectionClosed(
                f"the connection to pod {self.target!r} was closed: a request was cut off "
                "part-sent (a timeout or an interrupt); connect again"
            )
        if self._sock.fileno() < 0:  # closed by us
            raise ConnectionClosed(f"the connection to pod {self.target!r} was closed")

    def _send(self, data: bytes) -> None:
        self._usable()
        try:
            self._sock.sendall(data)
        except LOST as exc:  # the pod went: the same error as when it goes while we read
            raise self._lost() from exc
        except BaseException:
            # Cut off part-sent (a timeout, Ctrl-C): the pod would read the next request as the
            # rest of this one's line, and answer it as this one's (a reply dropped: that call
            # waited for ever). Nothing more can be sent on this connection.
            self._broken = True
            self._sock.close()
            raise

    def _receive(self) -> None:
        self._usable()
        try:
            data = self._sock.recv(1 << 16)
        except LOST as exc:  # it went with our request unread (ECONNRESET)
            raise self._lost() from exc
        if not data:
            raise self._lost()
        self._core.feed(data)

    def _roundtrip(self, method: str, params: Params | dict[str, Any] | None, rtype: type[T]) -> T:
        request_id, data = self._core.request(method, params)
        # The connection's timeout bounds the whole answer, not each read: a socket that is not
        # a pod's and never stops talking (an endless line, events, replies to other ids) kept
        # every read short, and the call waiting for ever.
        timeout = self._sock.gettimeout()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._send(data)
            while not self._core.has_reply(request_id):
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            errno.ETIMEDOUT, f"pod {self.target!r} did not answer in time"
                        )
                    self._sock.settimeout(left)
                self._receive()
        except BaseException:
            self._core.forget(request_id)
            raise
        finally:
            if deadline is not None and self._sock.fileno() >= 0:
                self._sock.settimeout(timeout)
        return self._core.take(request_id, rtype)

    def _invoke(self, method: Method[Params, T], params: Params) -> T:
        return self._roundtrip(method.name, params, method.result)

    def call(self, method: str, params: dict[str, Any] | None, result_type: type[T]) -> T:
        return self._roundtrip(method, params, result_type)

    def call_raw(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """Any method, untyped result (podctl rpc)."""
        return self.call(method, params, msgspec.Raw)

    def send_notification(self, method: str, params: dict[str, Any] | None = None) -> None:
        """A JSON-RPC notification: executed by the pod, never answered."""
        self._send(self._core.notification(method, params))

    def events(self) -> Iterator[Event]:
        """Events on this connection, after `subscribe`; blocks until each arrives.

        RuntimeError when this connection never subscribed: nothing would ever arrive."""
        self._core.check_subscribed()
        while True:
            while self._core.events:
                yield self._core.events.popleft()
            self._receive()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event on this connection (after `subscribe`), or None when none arrives
        within `timeout` seconds (None: as `events()`, no limit but the connection's own), so
        a follower can look up from the stream now and then. RuntimeError as for `events()`."""
        self._core.check_subscribed()
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = None
        while not self._core.events:
            if deadline is not None:
                if poller is None:  # poll, not select: a descriptor past 1023 is fine
                    poller = select.poll()
                    poller.register(self._sock, select.POLLIN)
                left_ms = max(0.0, deadline - time.monotonic()) * 1000
                if not poller.poll(left_ms):
                    return None
            self._receive()
        return self._core.events.popleft()
