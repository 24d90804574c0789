"""acks: the group commit (one inline fsync per gathered batch, then the replies) and Pending."""

import asyncio
from typing import Any

import pytest

from poddaemon.acks import GATHER_PASSES, DurableReplies, Pending, settle
from protocol import errors
from protocol.errors import RpcError


class Log:
    """Stands in for PodLog: counts fsyncs, can fail one, remembers what each reply saw."""

    def __init__(self) -> None:
        self.written = 0
        self.synced = 0  # what the last fsync covered
        self.fsyncs = 0
        self.fail_next = False
        self.failure: str | None = None

    def sync_now(self) -> None:
        self.fsyncs += 1
        if self.fail_next:
            raise OSError(5, "Input/output error")
        self.synced = self.written

    def fail(self, message: str) -> None:
        self.failure = message


def replies(log: Log) -> DurableReplies:
    return DurableReplies(log.sync_now, lambda: log.failure, log.fail)


async def passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)  # one loop pass


def test_replies_leave_after_the_fsync_that_covers_them_one_fsync_per_batch() -> None:
    async def go() -> None:
        log = Log()
        durable = replies(log)
        seen: list[tuple[int, int]] = []  # (reply, what was durable when it was answered)
        for i in range(5):
            log.written += 1
            p = Pending()
            p.then(lambda outcome: seen.append((outcome, log.synced)))
            durable.add(p, i)
        assert seen == [] and log.fsyncs == 0  # nothing leaves in the pass that wrote it
        await passes(1)
        assert log.fsyncs == 0  # one pass to see whether more join the batch
        await passes(1)
        assert log.fsyncs == 1
        assert seen == [(i, 5) for i in range(5)]  # all five, each after the fsync of all five
        log.written += 1
        later = Pending()
        durable.add(later, "next")
        await passes(2)
        assert log.fsyncs == 2 and later.done()

    asyncio.run(go())


def test_replies_of_the_next_passes_join_the_batch_up_to_a_bound() -> None:
    """Clients that send again while a batch is gathered share its fsync; a steady stream
    (one more reply every pass) still gets its fsync after GATHER_PASSES passes."""

    async def go() -> None:
        log = Log()
        durable = replies(log)
        done: list[Pending] = []
        for _ in range(GATHER_PASSES + 3):
            log.written += 1
            p = Pending()
            durable.add(p, "x")
            done.append(p)
            if log.fsyncs:
                break
            await passes(1)
        assert log.fsyncs == 1
        # Every reply added before the fsync left with it, each covered by it.
        assert sum(p.done() for p in done) == GATHER_PASSES + 1
        assert log.synced == GATHER_PASSES + 1

    asyncio.run(go())


def test_a_failed_fsync_answers_every_waiting_reply_with_the_error() -> None:
    async def go() -> None:
        log = Log()
        durable = replies(log)
        log.fail_next = True
        got: list[Any] = []
        futures = []
        for i in range(3):
            log.written += 1
            if i == 1:
                f: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                futures.append(f)
                durable.add(f, i)
            else:
                p = Pending()
                p.then(got.append)
                durable.add(p, i)
        await passes(2)
        assert log.failure is not None and "fsync failed" in log.failure
        assert len(got) == 2 and all(isinstance(e, RpcError) for e in got)
        assert got[0].code == errors.INTERNAL_ERROR and "could not persist" in got[0].message
        with pytest.raises(RpcError):
            futures[0].result()
        # Once failed, later replies get the error without another fsync.
        fsyncs = log.fsyncs
        p = Pending()
        p.then(got.append)
        durable.add(p, "late")
        await passes(2)
        assert log.fsyncs == fsyncs and isinstance(got[-1], RpcError)

    asyncio.run(go())


def test_drain_commits_at_once() -> None:
    async def go() -> None:
        log = Log()
        durable = replies(log)
        log.written += 1
        p = Pending()
        durable.add(p, "x")
        durable.drain()
        assert log.fsyncs == 1 and p.done()
        await passes(2)
        assert log.fsyncs == 1  # the scheduled commit was cancelled, not run twice

    asyncio.run(go())


def test_pending_settles_once_and_a_cancelled_one_drops_its_outcome() -> None:
    got: list[Any] = []
    p = Pending()
    settle(p, 1)  # settled before anyone listens: kept for `then`
    settle(p, 2)
    p.then(got.append)
    assert got == [1]
    q = Pending()
    q.then(got.append)
    q.cancel()
    settle(q, 3)
    assert got == [1] and q.done()
