"""A connection handles at most MAX_IN_FLIGHT requests at once: the rest wait, unread, and are
all answered in order as room frees up (a client flooding slow requests cannot make the pod hold
thousands of them at once)."""

import asyncio
from typing import Any

import msgspec

from poddaemon.events import EventBus, Subscription
from poddaemon.server import MAX_IN_FLIGHT, Connection, RpcServer
from protocol.methods import METHODS


class Transport:
    """What the connection uses of an asyncio transport; records replies and reading state."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.reading = True
        self.pauses = 0

    def write(self, data: bytes) -> None:
        self.frames.extend(msgspec.json.decode(line) for line in data.splitlines())

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        assert self.reading, "paused twice"
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        assert not self.reading, "resumed while reading"
        self.reading = True


class SlowHistory:
    """A `history` handler that answers only when released, counting how many wait at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = 0
        self.most = 0

    async def __call__(self, params: Any, conn: Any) -> Any:
        self.waiting += 1
        self.most = max(self.most, self.waiting)
        await self.release.wait()
        self.waiting -= 1
        return {"entries": [], "next": 0}


def _server(history: SlowHistory) -> RpcServer:
    handlers: dict[str, Any] = {name: (lambda p, conn: {}) for name in METHODS}
    handlers["history"] = history
    handlers["status"] = lambda p, conn: {"state": "idle"}
    return RpcServer(handlers, EventBus())


def _request(rid: int, method: str = "history") -> bytes:
    return b'{"jsonrpc":"2.0","id":%d,"method":"%s"}\n' % (rid, method.encode())


async def _passes(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_flood_of_slow_requests_is_handled_in_bounded_batches_and_all_answered() -> None:
    history = SlowHistory()
    conn = Connection(_server(history))
    transport = Transport()
    conn.transport = transport  # type: ignore[assignment]
    total = 3 * MAX_IN_FLIGHT + 5
    conn.data_received(b"".join(_request(i) for i in range(total)) + _request(total, "status"))
    await _passes()
    assert history.waiting == MAX_IN_FLIGHT  # the rest wait, unparsed
    assert not transport.reading  # and the client's further bytes stay in its socket
    assert transport.frames == []  # even `status`, which waits its turn behind them

    history.release.set()
    for _ in range(200):
        await _passes(1)
        if len(transport.frames) == total + 1:
            break
    assert sorted(f["id"] for f in transport.frames) == list(range(total + 1))
    assert all("result" in f for f in transport.frames)
    assert history.most == MAX_IN_FLIGHT
    assert transport.reading and transport.pauses == 1


async def test_a_batch_counts_its_items_and_the_lines_after_it_wait_their_turn() -> None:
    history = SlowHistory()
    conn = Connection(_server(history))
    transport = Transport()
    conn.transport = transport  # type: ignore[assignment]
    items = [{"jsonrpc": "2.0", "id": i, "method": "history"} for i in range(MAX_IN_FLIGHT + 10)]
    conn.data_received(msgspec.json.encode(items) + b"\n" + _request(999, "status"))
    await _passes()
    assert history.waiting == MAX_IN_FLIGHT
    assert not transport.reading and transport.frames == []

    history.release.set()
    for _ in range(200):
        await _passes(1)
        if len(transport.frames) == 2:
            break
    (batch,) = [f for f in transport.frames if isinstance(f, list)]
    (status,) = [f for f in transport.frames if isinstance(f, dict)]
    assert sorted(r["id"] for r in batch) == list(range(MAX_IN_FLIGHT + 10))
    assert status == {"jsonrpc": "2.0", "id": 999, "result": {"state": "idle"}}
    assert history.most == MAX_IN_FLIGHT and transport.reading


async def test_requests_under_the_limit_are_answered_at_once_and_reading_goes_on() -> None:
    history = SlowHistory()
    conn = Connection(_server(history))
    transport = Transport()
    conn.transport = transport  # type: ignore[assignment]
    conn.data_received(_request(1) + _request(2, "status"))
    await _passes()
    assert transport.frames == [{"jsonrpc": "2.0", "id": 2, "result": {"state": "idle"}}]
    assert transport.reading and transport.pauses == 0
    history.release.set()
    await _passes()
    assert [f["id"] for f in transport.frames] == [2, 1]


class FullTransport(Transport):
    """Its buffer passes the high-water mark at the `full_at`-th reply (as uvloop's write then
    calls `pause_writing`) and holds `unread` bytes from then on."""

    def __init__(self, conn: Connection, full_at: int, unread: int = 0) -> None:
        super().__init__()
        self.conn, self.full_at, self.unread = conn, full_at, unread
        self.aborted = False

    def write(self, data: bytes) -> None:
        super().write(data)
        if len(self.frames) == self.full_at:
            self.conn.pause_writing()

    def get_write_buffer_size(self) -> int:
        return self.unread if len(self.frames) >= self.full_at else 0

    def abort(self) -> None:
        self.aborted = True


async def test_replies_piling_up_unread_hold_its_requests_until_it_reads_them() -> None:
    """A client pipelining faster than it reads is slowed down; it was disconnected once 16 MiB
    of replies piled up, though it read them all along."""
    conn = Connection(_server(SlowHistory()))
    transport = FullTransport(conn, full_at=3)
    conn.transport = transport  # type: ignore[assignment]
    conn.data_received(b"".join(_request(i, "status") for i in range(10)))
    await _passes()
    assert [f["id"] for f in transport.frames] == [0, 1, 2]  # the rest wait, unhandled
    assert not transport.reading
    conn.data_received(_request(10, "status"))  # (what uvloop had read before pausing)
    await _passes()
    assert len(transport.frames) == 3

    transport.full_at = -1
    conn.resume_writing()  # it read its replies
    await _passes()
    assert [f["id"] for f in transport.frames] == list(range(11))
    assert transport.reading and not transport.aborted


async def test_a_client_past_max_unread_bytes_is_still_dropped_with_an_alert() -> None:
    """Replies to requests read before the push-back began (`history` pages being read) can
    still pass the bound."""
    history = SlowHistory()
    server = _server(history)
    server.max_unread_bytes = 100
    events: list[Any] = []
    server.bus.subscribe(Subscription(events.append, lambda: False, 0))
    conn = Connection(server)
    transport = FullTransport(conn, full_at=1, unread=1000)
    conn.transport = transport  # type: ignore[assignment]
    conn.data_received(_request(1) + _request(2))
    await _passes()
    assert history.waiting == 2
    history.release.set()
    await _passes()
    assert len(transport.frames) == 1 and transport.aborted
    assert any(b"disconnected client" in frame and b"unread" in frame for frame in events)


async def test_a_stop_answers_every_request_still_owed_then_closes() -> None:
    """JSON-RPC owes an answer to each request read: a stop closed the connection on a history
    page still at work, a prompt still waiting on its hook and a reply waiting for the log,
    and their clients got EOF instead (found by a QA pass)."""
    from poddaemon.acks import Pending

    history = SlowHistory()
    server = _server(history)
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    server.handlers["run"] = lambda p, conn: Pending()  # settled by the machine, one day
    server.handlers["usage"] = lambda p, conn: never  # a bare future (a durable ack)
    conn = Connection(server)
    closed: list[str] = []

    class Closing(Transport):
        def close(self) -> None:
            closed.append("close")
            asyncio.get_running_loop().call_soon(conn.connection_lost, None)

        def abort(self) -> None:
            closed.append("abort")

    transport = Closing()
    conn.transport = transport  # type: ignore[assignment]
    server.connections.add(conn)
    conn.data_received(
        _request(1) + b'{"jsonrpc":"2.0","id":2,"method":"run","params":{"input":"x"}}\n'
        b'{"jsonrpc":"2.0","id":3,"method":"usage"}\n'
    )
    await _passes()
    assert transport.frames == [] and history.waiting == 1
    server.close()
    await server.drain()
    answers = {f["id"]: f["error"]["code"] for f in transport.frames}
    assert answers == {1: -32004, 2: -32004, 3: -32004}
    assert closed == ["close"] and server.connections == set()
