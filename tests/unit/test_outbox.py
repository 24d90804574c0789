"""A child's reports leave only once its own log holds them: a child whose log failed delivers
none (its spawner reports it `errored` when it dies; a restored child redelivers what its log
holds)."""

import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from poddaemon.entries import OutboxItem
from poddaemon.outbox import Outbox


class Spawner:
    """A socket that answers every `pod_event`, recording what it was told."""

    def __init__(self) -> None:
        self.heard: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            self.heard.append(line)
            reply = {"jsonrpc": "2.0", "id": json.loads(line)["id"], "result": {"accepted": True}}
            writer.write(json.dumps(reply).encode() + b"\n")
        writer.close()

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[str]:
        """Its socket's path, while it listens there."""
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            path = str(Path(d) / "sock")
            server = await asyncio.start_unix_server(self.handle, path)
            try:
                yield path
            finally:
                server.close()
                await server.wait_closed()


async def test_a_child_whose_log_failed_delivers_no_report() -> None:
    report = OutboxItem(event_id="e1", event_kind="run.finished", run_id="r1", outcome="finished")

    async def synced() -> None:  # as PodLog.synced once the log has failed: nothing to wait for
        return None

    pod: Any = SimpleNamespace(
        failure="session log write failed: [Errno 28] No space left on device",
        synced=synced,
        state=SimpleNamespace(outbox={"e1": report}),  # committed, never written
        feed=lambda effects: None,
        machine=SimpleNamespace(outbox_acked=lambda ids: []),
    )
    spawner = Spawner()
    async with spawner.listening() as path:
        outbox = Outbox(pod, path, "child")
        assert await outbox.flush(1.0) is False  # undelivered: it waits in the log
    assert spawner.heard == []


async def test_a_report_committed_during_the_fsync_waits_for_the_next_one() -> None:
    # The fsync `_deliver` awaits covers what was committed before it began; a report committed
    # meanwhile (a run ending as the previous report goes out) is not durable yet, and a power
    # cut now would lose it from our log while the spawner already heard it: it waits.
    first = OutboxItem(event_id="e1", event_kind="run.finished", run_id="r1", outcome="finished")
    later = OutboxItem(event_id="e2", event_kind="run.finished", run_id="r2", outcome="finished")
    outbox_items = {"e1": first}
    syncs: list[list[str]] = []

    async def synced() -> None:
        syncs.append(list(outbox_items))  # what this fsync covers
        outbox_items["e2"] = later  # committed while it runs
        await asyncio.sleep(0)

    acked: list[str] = []

    def outbox_acked(ids: list[str]) -> list[Any]:
        for event_id in ids:
            acked.append(event_id)
            outbox_items.pop(event_id, None)
        return []

    pod: Any = SimpleNamespace(
        failure=None,
        synced=synced,
        state=SimpleNamespace(outbox=outbox_items),
        feed=lambda effects: None,
        machine=SimpleNamespace(outbox_acked=outbox_acked),
    )
    spawner = Spawner()
    async with spawner.listening() as path:
        outbox = Outbox(pod, path, "child")
        await outbox._deliver()
        assert acked == ["e1"]  # e2 was not covered by that fsync
        await outbox._deliver()  # the next fsync covers it
    assert acked == ["e1", "e2"] and syncs == [["e1"], ["e2"]]
    heard = [json.loads(line)["params"]["event_id"] for line in spawner.heard]
    assert heard == ["e1", "e2"]
