"""Model streams on an event loop of their own, in one thread.

The SDKs parse every streamed chunk in Python; on the pod's loop that parsing sat in front of
acknowledgements (a `notify` ack took ~5 ms during a stream instead of ~0.4 ms). Here the whole
stream runs on a second loop and its events cross over in batches: one wake-up of the pod's loop
however many deltas arrived meanwhile. The SDK import also happens on that thread.
"""

import asyncio
import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import Awaitable
from typing import Any, TypeVar

from poddaemon.llm.types import ModelClient, ModelRequest, ReasoningDelta, StreamEvent, TextDelta

T = TypeVar("T")
_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Channel:
    """Items from the model thread to the pod's loop, waking it at most once per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:  # model thread
        with self._lock:
            self._items.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the pod's loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        with self._lock:
            self._scheduled = False
        self._ready.set()

    async def take(self) -> list[Any]:  # pod's loop
        while True:
            with self._lock:
                if self._items:
                    batch = list(self._items)
                    self._items.clear()
                    return batch
                self._ready.clear()
            await self._ready.wait()


class ThreadedModel:
    """A `ModelClient` that runs another one's streams on a dedicated thread's loop."""

    def __init__(self, inner: ModelClient) -> None:
        self.inner = inner
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _worker_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            try:
                import uvloop

                loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
                loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=loop.run_forever, name="poddaemon-model", daemon=True
            )
            self._thread.start()
            self._loop = loop
        return self._loop

    async def _on_worker(self, coro: Awaitable[T]) -> T:
        future = asyncio.run_coroutine_threadsafe(_as_coro(coro), self._worker_loop())
        return await asyncio.wrap_future(future)

    def stream(self, req: ModelRequest) -> "Events":
        """The request leaves now, on the model thread, not at the first iteration: the pod
        makes its input durable meanwhile (see `Pod._stream`)."""
        channel = _Channel(asyncio.get_running_loop())

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self.inner.stream(req)) as events:  # type: ignore[type-var]
                    async for event in events:
                        channel.put(event)
            except BaseException as exc:  # handed over to the consumer, cancellation included
                channel.put(_Failed(exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise
            finally:
                channel.put(_END)

        return Events(channel, asyncio.run_coroutine_threadsafe(pump(), self._worker_loop()))

    async def warm(self) -> None:
        await self._on_worker(self.inner.warm())

    async def aclose(self) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(Exception):
            await self._on_worker(self.inner.aclose())
        loop.call_soon_threadsafe(loop.stop)
        self._loop = None


class Events:
    """A stream's events on the pod's loop. `aclose` releases the HTTP stream at once, even
    if it was never iterated."""

    def __init__(self, channel: _Channel, future: "concurrent.futures.Future[None]") -> None:
        self._channel = channel
        self._future = future
        self._batch: deque[Any] = deque()

    def __aiter__(self) -> "Events":
        return self

    async def __anext__(self) -> StreamEvent:
        while not self._batch:
            self._batch.extend(_coalesced(await self._channel.take()))
        item = self._batch.popleft()
        if item is _END:
            self._batch.appendleft(_END)  # stays ended
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            self._batch.appendleft(_END)
            raise item.exc
        return item  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        self._future.cancel()
        self._batch = deque([_END])  # ended: what the cancelled pump still sends is not read


def _coalesced(batch: list[Any]) -> list[Any]:
    """Adjacent text (or reasoning) deltas of one batch as one delta: the pod's loop publishes
    one event per delta, and a fast stream would otherwise cost it one per 20-byte chunk."""
    out: list[Any] = []
    for item in batch:
        last = out[-1] if out else None
        if isinstance(item, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + item.text)
        elif isinstance(item, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + item.text)
        else:
            out.append(item)
    return out


async def _as_coro(awaitable: Awaitable[T]) -> T:
    return await awaitable
