"""Spawn trees, the child's side (SPEC §9): deliver reports, follow the parent.

Reports (`run.finished`, `errored`, `shutdown`) are committed to the child's own log as `outbox`
entries by the machine; the session state lists those not yet acknowledged, so a restored child
knows what is undelivered. `Outbox` sends each, once durable, to the spawner's socket with
`pod_event` (its `event_id` stable: the spawner accepts an id once) and commits `outbox_acked`
when the spawner answers; failures are retried with backoff until it does, across restarts of
either side.

`watch_parent` follows the spawner's process with a pidfd: when it ends (however: shutdown,
crash, `kill -9`) a child whose `on_parent_exit` is "stop" shuts down, reporting to nobody.
"""

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from poddaemon.entries import Entry, OutboxItem
from protocol import errors
from protocol.errors import RpcError

if TYPE_CHECKING:
    from poddaemon.pod import Pod

log = logging.getLogger("poddaemon.outbox")

RETRY_INITIAL = 0.05
RETRY_MAX = 2.0
CALL_TIMEOUT = 10.0
# A report's text as sent, in UTF-8 bytes: well inside the spawner's frame limit (8 MiB) even
# when JSON escapes every character (6 bytes each). A longer final text was never delivered:
# refused by the frame limit on every retry, it held up every later report for good.
REPORT_TEXT_MAX = 1 << 20


class Outbox:
    def __init__(self, pod: "Pod", callback: str, name: str) -> None:
        self.pod = pod
        self.callback = callback
        self.name = name
        self.enabled = True  # False once the spawner is gone for good (on_parent_exit = stop)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def observe(self, entry: Entry) -> None:
        if isinstance(entry, OutboxItem):
            self._wake.set()

    def start(self) -> None:
        self._wake.set()  # a restored child may have reports waiting
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # Bounded: a stop must never hang on delivery (undelivered reports wait in the log).
            await asyncio.wait({self._task}, timeout=2.0)

    async def flush(self, timeout: float) -> bool:
        """Try to deliver what is left before the pod exits; True if nothing is."""
        deadline = time.monotonic() + timeout
        delay = RETRY_INITIAL
        while self.enabled and self.pod.failure is None and self.pod.state.outbox:
            try:
                async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                    await self._deliver()
            except RpcError as exc:
                if exc.code == errors.SHUTTING_DOWN:
                    return False  # the spawner is going too: the report waits in our log
            except Exception as exc:
                log.debug("report delivery failed: %s", exc)
            if not self.pod.state.outbox:
                break
            if time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)
        return not self.pod.state.outbox

    async def _run(self) -> None:
        delay = RETRY_INITIAL
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.enabled or not self.pod.state.outbox:
                continue
            try:
                await self._deliver()
                delay = RETRY_INITIAL
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError  # a cancel some awaited call swallowed
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("report delivery failed (retrying in %.2fs): %s", delay, exc)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, RETRY_MAX)
                self._wake.set()

    async def _deliver(self) -> None:
        # A report leaves only once it is durable in our own log: the reports committed before
        # this fsync began. One committed meanwhile waits for the next (woken by its commit).
        items = list(self.pod.state.outbox.values())
        await self.pod.synced()
        if self.pod.failure is not None:
            return  # the log failed: it may not hold them (a restored pod delivers what it does)
        outbox = self.pod.state.outbox
        items = [item for item in items if item.event_id in outbox]  # not acked meanwhile
        if not items:
            return
        from protocol.aio import AsyncPodClient  # a child's only: not every pod's start-up

        async with await AsyncPodClient.connect(self.callback) as client:
            for item in items:
                params: dict[str, Any] = {
                    "pod": self.name,
                    "kind": item.event_kind,
                    "event_id": item.event_id,
                    "usage": dict(item.usage),
                }
                for key in ("run_id", "text", "outcome"):
                    value = getattr(item, key)
                    if value is not None:
                        params[key] = value
                if item.text is not None:
                    params["text"] = _cut(item.text, self.name)
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
                # lands as the call completes, and this task would then never stop.
                async with asyncio.timeout(CALL_TIMEOUT):
                    raw = await client.call_raw("pod_event", params)
                msgspec.json.decode(raw)
                self.pod.feed(self.pod.machine.outbox_acked([item.event_id]))


def _cut(text: str, name: str) -> str:
    """`text` cut to REPORT_TEXT_MAX bytes of UTF-8 (never inside a character), saying where the
    whole of it is."""
    data = text.encode("utf-8", "replace")
    if len(data) <= REPORT_TEXT_MAX:
        return text
    head = data[:REPORT_TEXT_MAX].decode("utf-8", "ignore")
    return (
        f"{head}\n[report text cut: {len(data)} bytes, the first {REPORT_TEXT_MAX} shown; the "
        f"whole text is in pod {name}'s history]"
    )


async def watch_parent(pid: int, on_exit: Callable[[], None]) -> None:
    """Call `on_exit` when process `pid` ends (at once if it is already gone)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        on_exit()
        return
    loop = asyncio.get_running_loop()
    ended = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await ended
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    on_exit()
