"""Replies that may only leave once the log is durable: group commit.

A reply waits here until an fsync that started after it was queued has finished. The fsync runs
inline on the loop in a plain callback scheduled by the first reply of a batch; it covers every
entry written before it, and the replies it releases are sent from that same callback, before
the loop reads anything else (no task, no thread hand-off between the fsync and the replies).
While it runs, new requests wait in the socket buffers and are all committed by the next one.
If the log fails, every waiting reply becomes the error instead (nothing unsynced is ever
acknowledged).

The batch is gathered first: the commit waits one more loop pass (a poll that does not block)
while the last one brought new replies, up to GATHER_PASSES. Without it, clients that send
again while a batch is being processed land in the next batch, the clients settle into two
groups that alternate, and every fsync covers half of them (measured with 8 clients: 4.1
requests per fsync, 9,000 acks/s; gathered: 8.0 per fsync, 13,300 acks/s). A lone client pays
one idle pass, a few µs.

Not pipelined: an fsync that runs elsewhere while the loop goes on was tried in the kernel
(Linux AIO `IOCB_CMD_FSYNC`, completion on an eventfd: no thread, no GIL). It lost 10-20% of
acks/s here with 8 clients on 2 cores: the batch committing during an fsync splits the clients
into the same two alternating groups, so there are twice the fsyncs, and their kernel work
competes with the clients for the CPUs.

`Pending` is the reply itself: a settle-once slot whose callback runs synchronously, so the
server can answer a request from the commit callback without an `asyncio.Future` (whose done
callbacks always cost another loop pass).
"""

import asyncio
from collections.abc import Callable
from typing import Any

from protocol import errors
from protocol.errors import RpcError

Outcome = Any  # a result, or an exception to answer with

GATHER_PASSES = 4  # loop passes a commit may wait for more replies to join its batch


class Pending:
    """A reply given later: `settle` hands the outcome to the callback given to `then`, at once
    (or when `then` is called, if it was settled first). Settles once; `cancel` drops it."""

    __slots__ = ("_callback", "_outcome", "_state")

    def __init__(self) -> None:
        self._callback: Callable[[Outcome], None] | None = None
        self._outcome: Outcome = None
        self._state = 0  # 0 waiting, 1 settled, 2 cancelled

    def done(self) -> bool:
        return self._state != 0

    def then(self, callback: Callable[[Outcome], None]) -> None:
        if self._state == 1:
            callback(self._outcome)
        elif self._state == 0:
            self._callback = callback

    def settle(self, outcome: Outcome) -> None:
        if self._state != 0:
            return
        self._state = 1
        callback, self._callback = self._callback, None
        if callback is None:
            self._outcome = outcome
        else:
            callback(outcome)

    def cancel(self) -> None:
        """The asker went away: whatever comes later is dropped."""
        if self._state == 0:
            self._state = 2
            self._callback = None


def settle(reply: "asyncio.Future[Any] | Pending", outcome: Outcome) -> None:
    if isinstance(reply, Pending):
        reply.settle(outcome)
        return
    if reply.done():
        return
    if isinstance(outcome, BaseException):
        reply.set_exception(outcome)
    else:
        reply.set_result(outcome)


class DurableReplies:
    def __init__(
        self,
        sync_now: Callable[[], None],
        failure: Callable[[], str | None],
        on_error: Callable[[str], None],
    ) -> None:
        self._sync_now = sync_now  # fsync everything written so far, inline; OSError on failure
        self._failure = failure  # why the log can no longer be trusted, or None
        self._on_error = on_error  # told when an fsync fails
        self._waiting: list[tuple[asyncio.Future[Any] | Pending, Outcome]] = []
        self._handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gathered = 0  # replies waiting when the commit last looked
        self._passes = 0  # passes this commit has waited

    def add(self, reply: "asyncio.Future[Any] | Pending", outcome: Outcome) -> None:
        self._waiting.append((reply, outcome))
        if self._handle is None:
            self.flush_soon()

    def flush_soon(self) -> None:
        """Commit (fsync, then answer) in a callback of a coming loop pass: every entry written
        before it is covered."""
        if self._handle is None:
            if self._loop is None:  # cached: get_running_loop() costs a getpid() per call
                self._loop = asyncio.get_running_loop()
            self._handle = self._loop.call_soon(self._gather)

    def _gather(self) -> None:
        """Wait a pass more while the last one brought replies (see the module's docstring)."""
        waiting = len(self._waiting)
        if waiting > self._gathered and self._passes < GATHER_PASSES:
            assert self._loop is not None
            self._gathered = waiting
            self._passes += 1
            self._handle = self._loop.call_soon(self._gather)
            return
        self._commit()

    def drain(self) -> None:
        """Commit now what is waiting (at shutdown)."""
        if self._handle is not None:
            self._handle.cancel()
            self._commit()

    def _commit(self) -> None:
        self._handle = None
        self._gathered = self._passes = 0
        batch, self._waiting = self._waiting, []
        failure = self._failure()
        if failure is None:
            try:
                self._sync_now()
            except OSError as exc:
                self._on_error(f"session log fsync failed: {exc}")
                failure = self._failure() or str(exc)
        if failure is not None:
            error = RpcError(errors.INTERNAL_ERROR, f"could not persist: {failure}")
            for reply, _ in batch:
                settle(reply, error)
            return
        for reply, outcome in batch:
            settle(reply, outcome)
