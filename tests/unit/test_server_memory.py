"""Pages a client's buffers took are given back (malloc_trim) once it is gone, whether it was
dropped or left holding a big partial frame; one trim per loop pass, however many went."""

import asyncio
from typing import Any

import pytest

from poddaemon import server
from poddaemon.events import EventBus
from poddaemon.server import TRIM_AFTER_PARTIAL_BYTES, Connection, RpcServer
from protocol.methods import METHODS


class Transport:
    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(server, "_give_back_memory", lambda: calls.append(1))
    return calls


def _connection(rpc: RpcServer) -> Connection:
    conn = Connection(rpc)
    conn.transport = Transport()  # type: ignore[assignment]
    return conn


async def test_clients_gone_with_big_partial_frames_get_one_trim(trims: list[int]) -> None:
    handlers: dict[str, Any] = {name: (lambda p, c: {}) for name in METHODS}
    rpc = RpcServer(handlers, EventBus())
    big = b'{"jsonrpc":"2.0","id":1,"method":"status"' + b" " * TRIM_AFTER_PARTIAL_BYTES
    conns = [_connection(rpc) for _ in range(3)]
    for conn in conns:
        conn.data_received(big)
    assert rpc.partial_bytes >= 3 * TRIM_AFTER_PARTIAL_BYTES
    conns[0].eof_received()  # its partial frame is read as a last line: still a big one
    for conn in conns:
        conn.connection_lost(None)
    assert rpc.partial_bytes == 0
    await asyncio.sleep(0)
    assert trims == [1]


async def test_a_small_client_going_does_not_trim(trims: list[int]) -> None:
    handlers: dict[str, Any] = {name: (lambda p, c: {}) for name in METHODS}
    conn = _connection(RpcServer(handlers, EventBus()))
    conn.data_received(b'{"jsonrpc":"2.0","id":1,"method":"status"')
    conn.connection_lost(None)
    await asyncio.sleep(0)
    assert trims == []
