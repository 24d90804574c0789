"""AsyncPodClient: the asyncio twin of PodClient; many calls may be in flight on one connection.

Its RPC methods (run, notify, status, ...) are declared once for both clients in
`protocol.core.ClientMethods`; here each returns an awaitable.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Generator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import msgspec

from protocol.core import AsyncCaller, ClientCore, ClientMethods
from protocol.errors import LOST, ConnectionClosed
from protocol.framing import DEFAULT_MAX_FRAME_BYTES, MAX_REPLY_BYTES
from protocol.methods import Method
from protocol.sockets import GONE, check_peer, check_socket_owner, not_running_error, resolve_socket
from protocol.types import Event, Params

T = TypeVar("T")

WRITE_BUFFER_BYTES = 1 << 20  # unsent requests held before a call waits for the pod to read


class AsyncPodClient(ClientMethods, AsyncCaller):
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        target: str,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._core = ClientCore(max_frame_bytes)
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._event_ready = asyncio.Event()
        self._closed: BaseException | None = None
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())
        self.target = target

    @classmethod
    def connect(
        cls, target: str | Path, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> "_Connecting":
        """As PodClient.connect: refuses a socket another user owns or serves.

        Await it for the client (`client = await AsyncPodClient.connect(...)`), or use it as
        the twin of `with PodClient.connect(...) as pod:`, `async with AsyncPodClient.connect(
        ...) as pod:`, which closes the connection at the block's end."""
        return _Connecting(cls._open(target, max_frame_bytes))

    @classmethod
    async def _open(cls, target: str | Path, max_frame_bytes: int) -> "AsyncPodClient":
        path = resolve_socket(target)
        try:
            check_socket_owner(path)
            reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_REPLY_BYTES)
        except GONE as exc:
            raise not_running_error(target, path, exc) from exc
        try:
            check_peer(writer.get_extra_info("socket"), path)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, str(target), max_frame_bytes)

    async def close(self) -> None:
        """Close the connection: calls still waiting, and any made later, raise
        ConnectionClosed; so does an `events()` iteration."""
        self._read_task.cancel()
        try:
            # Not `await self._read_task` under suppress(CancelledError): that swallowed the
            # caller's own cancellation landing here too, and its `async with` went on.
            await asyncio.wait({self._read_task})
        finally:
            if self._closed is None:
                self._fail(ConnectionClosed(f"the connection to pod {self.target!r} was closed"))
            self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> "AsyncPodClient":
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _read_loop(self) -> None:
        try:
            while data := await self._reader.read(1 << 16):
                self._core.feed(data)
                for request_id, fut in list(self._waiters.items()):
                    if self._core.has_reply(request_id) and not fut.done():
                        fut.set_result(None)
                if self._core.events:
                    self._event_ready.set()
            self._closed = self._lost()
        except LOST as exc:  # it went with our request unread (ECONNRESET)
            self._closed = self._lost()
            self._closed.__cause__ = exc
        except Exception as exc:  # surfaced to every waiting caller below
            self._closed = exc
        self._fail(self._closed)
        # Nothing can be sent or read on it any more: its descriptor (and the pod's slot for
        # it) is given back now, not when the caller, which got the error, thinks to close().
        self._writer.close()

    def _fail(self, error: BaseException) -> None:
        """The connection is over: every caller waiting, and every later one, gets `error`."""
        self._closed = error
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(error)
        self._event_ready.set()

    def _lost(self) -> ConnectionClosed:
        return ConnectionClosed(f"pod {self.target!r} closed the connection")

    async def _roundtrip(
        self, method: str, params: Params | dict[str, Any] | None, rtype: type[T]
    ) -> T:
        if self._closed:
            raise self._closed
        await self._room()
        request_id, data = self._core.request(method, params)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        try:
            self._writer.write(data)
            await fut
        except BaseException:
            self._core.forget(request_id)
            raise
        finally:
            del self._waiters[request_id]
        return self._core.take(request_id, rtype)

    async def _room(self) -> None:
        """Wait while a pod that reads nothing (stopped, or busy past its limits) leaves our
        unsent requests above WRITE_BUFFER_BYTES: calls made meanwhile wait here instead of
        piling up in memory without bound. One request may take it past the mark."""
        transport = self._writer.transport
        while transport.get_write_buffer_size() > WRITE_BUFFER_BYTES:
            try:
                await self._writer.drain()
            except LOST as exc:
                raise self._closed or self._lost() from exc
            if self._closed:
                raise self._closed

    async def _invoke(self, method: Method[Params, T], params: Params) -> T:
        return await self._roundtrip(method.name, params, method.result)

    async def call(self, method: str, params: dict[str, Any] | None, result_type: type[T]) -> T:
        return await self._roundtrip(method, params, result_type)

    async def call_raw(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return await self.call(method, params, msgspec.Raw)

    async def send_notification(self, method: str, params: dict[str, Any] | None = None) -> None:
        if self._closed:
            raise self._closed
        self._writer.write(self._core.notification(method, params))
        try:
            await self._writer.drain()
        except LOST as exc:
            raise self._lost() from exc

    async def events(self) -> AsyncIterator[Event]:
        """Events on this connection, after `subscribe` (else RuntimeError: none would come)."""
        self._core.check_subscribed()
        while True:
            while self._core.events:
                yield self._core.events.popleft()
            if self._closed:
                raise self._closed
            self._event_ready.clear()
            await self._event_ready.wait()


class _Connecting(Coroutine[Any, Any, AsyncPodClient]):
    """What AsyncPodClient.connect returns: awaitable (the client), and an async context
    manager (the client, closed on exit), so `async with AsyncPodClient.connect(pod)` works
    as the sync `with PodClient.connect(pod)` does, not only `async with await ...`. A
    coroutine still (it delegates to the one it wraps): `asyncio.create_task` takes it."""

    def __init__(self, opening: Coroutine[Any, Any, AsyncPodClient]) -> None:
        self._opening = opening
        self._client: AsyncPodClient | None = None

    def __await__(self) -> Generator[Any, None, AsyncPodClient]:
        return self._opening.__await__()

    def send(self, value: Any) -> Any:
        return self._opening.send(value)

    def throw(self, *args: Any) -> Any:
        return self._opening.throw(*args)

    def close(self) -> None:
        self._opening.close()

    async def __aenter__(self) -> AsyncPodClient:
        self._client = await self._opening
        return self._client

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.close()
