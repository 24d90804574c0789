"""The pod stages the entries of a loop pass and writes them with one `os.write`: before the
group commit's fsync, at the end of the pass, and before any reply or event leaves the pod, so
that nothing a client hears of is missing from the session file (checked at every write to a
client, with a real pod, its server and its log)."""

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from poddaemon.server import Connection, RpcServer
from poddaemon.store.log import verify
from tests.unit.test_restore import runnable_pod


def _line(method: str, params: dict[str, Any], rid: int) -> bytes:
    return msgspec.json.encode({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})


class Blocked:
    """A model whose call never ends: the pod stays busy and notifications only commit."""

    async def stream(self, request: Any) -> AsyncIterator[Any]:
        await asyncio.get_running_loop().create_future()
        yield None


class Client:
    """A connection's transport that checks, at every write, that the session file holds every
    entry the log has counted."""

    def __init__(self, pod: Any) -> None:
        self.pod = pod
        self.frames: list[bytes] = []

    def write(self, frame: bytes) -> None:
        log = self.pod.plog.log
        if log is not None:
            entries = verify(Path(log.path).read_bytes()).entries
            assert entries[-1]["seq"] == log.seq, "a client heard before the file held it"
        self.frames.append(frame)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int) -> None:
        pass


async def _until(done: Any, passes: int = 50) -> None:
    """Let the loop run until `done()` holds (a bounded number of passes: no timing)."""
    for _ in range(passes):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the pod did not get there")


def _acked(conn: Connection) -> list[int]:
    replies = [msgspec.json.decode(f) for f in conn.transport.frames]  # type: ignore[attr-defined]
    return [r["id"] for r in replies if "notification_id" in r.get("result", {})]


async def test_a_pass_of_notifications_is_one_write_and_no_client_hears_before_the_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        pod = runnable_pod(tmp, Blocked())
        server = RpcServer(pod.handlers(), pod.bus, before_send=pod.plog.flush)
        watcher, sender = Connection(server), Connection(server)
        for conn in (watcher, sender):
            conn.transport = Client(pod)  # type: ignore[assignment]
        sender.data_received(_line("run", {"input": "work"}, 1) + b"\n")
        await _until(lambda: pod.pod_state == "running" and pod._inflight is not None)

        writes: list[int] = []
        real_write = os.write

        def counting(fd: int, data: Any) -> int:
            if fd == pod.plog.log.fileno():
                writes.append(len(data))
            return real_write(fd, data)

        def notify(first: int) -> bytes:
            ids = range(first, first + 8)
            return b"".join(_line("notify", {"message": f"n{i}"}, i) + b"\n" for i in ids)

        monkeypatch.setattr(os, "write", counting)
        sender.data_received(notify(10))  # one pass: 8 entries staged, then one commit
        await _until(lambda: len(_acked(sender)) == 8)
        assert len(writes) == 1  # nobody watching: the 8 lines in one write
        watcher.start_events(pod.bus.seq)
        sender.data_received(notify(20))  # each event makes the pod write what it speaks of
        await _until(lambda: len(_acked(sender)) == 16)
        monkeypatch.undo()
        assert _acked(sender) == [*range(10, 18), *range(20, 28)]
        events = [msgspec.json.decode(f) for f in watcher.transport.frames]  # type: ignore[attr-defined]
        heard = [e["params"]["data"]["message"] for e in events]
        assert heard == [f"n{i}" for i in range(20, 28)]
        assert pod.plog.log.durable_seq == pod.plog.log.seq
        pod._inflight.cancel()
        await _until(lambda: pod._inflight is None)
        await pod.plog.close()
