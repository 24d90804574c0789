"""AsyncPodClient: the asyncio twin of PodClient; many calls may be in flight on one connection."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import msgspec

from protocol.core import ClientCore, clean_params, resolve_socket
from protocol.errors import ConnectionClosed, PodNotRunning
from protocol.types import (
    AcceptedResult,
    CancelResult,
    CompactResult,
    Event,
    HistoryResult,
    NotifyResult,
    OkResult,
    PauseResult,
    ResumeResult,
    RunResult,
    RunWaitResult,
    StatusResult,
    SubscribeResult,
    UsageResult,
)

T = TypeVar("T")


class AsyncPodClient:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: str
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._core = ClientCore()
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._event_ready = asyncio.Event()
        self._closed: BaseException | None = None
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())
        self.target = target

    @classmethod
    async def connect(cls, target: str | Path) -> "AsyncPodClient":
        path = resolve_socket(target)
        try:
            reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 26)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            raise PodNotRunning(str(target), f"no socket at {path}") from exc
        return cls(reader, writer, str(target))

    async def close(self) -> None:
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._read_task
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
                    if request_id in self._core.replies and not fut.done():
                        fut.set_result(None)
                if self._core.events:
                    self._event_ready.set()
            self._closed = ConnectionClosed(f"pod {self.target!r} closed the connection")
        except Exception as exc:  # surfaced to every waiting caller below
            self._closed = exc
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(self._closed)
        self._event_ready.set()

    async def call(self, method: str, params: dict[str, Any] | None, result_type: type[T]) -> T:
        if self._closed:
            raise self._closed
        request_id, data = self._core.request(method, params)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        try:
            self._writer.write(data)
            await fut
        finally:
            del self._waiters[request_id]
        return self._core.take(request_id, result_type)

    async def call_raw(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return await self.call(method, params, msgspec.Raw)

    async def send_notification(self, method: str, params: dict[str, Any] | None = None) -> None:
        self._writer.write(self._core.notification(method, params))
        await self._writer.drain()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            while self._core.events:
                yield self._core.events.popleft()
            if self._closed:
                raise self._closed
            self._event_ready.clear()
            await self._event_ready.wait()

    async def run(
        self,
        input: str,
        mode: Literal["queue", "steer"] = "queue",
        client_key: str | None = None,
    ) -> RunResult:
        params = clean_params({"input": input, "mode": mode, "client_key": client_key})
        return await self.call("run", params, RunResult)

    async def run_wait(
        self,
        input: str,
        mode: Literal["queue", "steer"] = "queue",
        client_key: str | None = None,
    ) -> RunWaitResult:
        params = clean_params({"input": input, "mode": mode, "client_key": client_key})
        return await self.call("run", {**params, "wait": True}, RunWaitResult)

    async def notify(
        self, message: str, source: str | None = None, client_key: str | None = None
    ) -> NotifyResult:
        params = clean_params({"message": message, "source": source, "client_key": client_key})
        return await self.call("notify", params, NotifyResult)

    async def resume(self) -> ResumeResult:
        return await self.call("resume", None, ResumeResult)

    async def pause(self) -> PauseResult:
        return await self.call("pause", None, PauseResult)

    async def cancel(self, run_id: str | None = None) -> CancelResult:
        return await self.call("cancel", clean_params({"run_id": run_id}), CancelResult)

    async def status(self) -> StatusResult:
        return await self.call("status", None, StatusResult)

    async def history(self, since: int = 0, limit: int | None = None) -> HistoryResult:
        params = clean_params({"since": since, "limit": limit})
        return await self.call("history", params, HistoryResult)

    async def usage(self) -> UsageResult:
        return await self.call("usage", None, UsageResult)

    async def subscribe(self, since: int | None = None) -> SubscribeResult:
        return await self.call("subscribe", clean_params({"since": since}), SubscribeResult)

    async def compact(self) -> CompactResult:
        return await self.call("compact", None, CompactResult)

    async def pod_event(
        self, pod: str, kind: str, run_id: str | None = None, text: str | None = None
    ) -> AcceptedResult:
        params = clean_params({"pod": pod, "kind": kind, "run_id": run_id, "text": text})
        return await self.call("pod_event", params, AcceptedResult)

    async def shutdown(self) -> OkResult:
        return await self.call("shutdown", None, OkResult)
