"""Replies that may only leave once the log is durable: group commit.

A reply waits here until an fsync that started after it was queued has finished; one fsync
releases every reply queued before it began, however many clients sent them. If the log fails,
every waiting reply becomes the error instead (nothing unsynced is ever acknowledged)."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from protocol import errors
from protocol.errors import RpcError


class DurableReplies:
    def __init__(
        self,
        sync: Callable[[], Awaitable[None]],
        failure: Callable[[], str | None],
        on_error: Callable[[str], None],
    ) -> None:
        self._sync = sync  # fsync everything written so far
        self._failure = failure  # why the log can no longer be trusted, or None
        self._on_error = on_error  # told when an fsync fails
        self._waiting: list[tuple[asyncio.Future[Any], Any]] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, future: asyncio.Future[Any], outcome: Any) -> None:
        self._waiting.append((future, outcome))
        self.flush_soon()

    def flush_soon(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._flush())

    async def drain(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _flush(self) -> None:
        while True:
            batch, self._waiting = self._waiting, []
            failure = self._failure()
            if failure is not None:
                error = RpcError(errors.INTERNAL_ERROR, f"could not persist: {failure}")
                for future, _ in batch:
                    settle(future, error)
                return
            try:
                await self._sync()
            except OSError as exc:
                self._on_error(f"session log fsync failed: {exc}")
                self._waiting[:0] = batch
                continue
            for future, outcome in batch:
                settle(future, outcome)
            if not self._waiting:
                return


def settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
