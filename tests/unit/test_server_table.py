"""The server's start-up check against the method table, and reading an id from a frame's head."""

from typing import Any

import pytest

from poddaemon.events import EventBus
from poddaemon.server import RpcServer, id_from_head
from protocol.methods import METHODS


def handlers(*names: str) -> dict[str, Any]:
    return {name: (lambda p, conn: None) for name in names}


def test_server_accepts_handlers_matching_the_table() -> None:
    RpcServer(handlers(*METHODS), EventBus())


def test_server_names_a_method_without_handler_and_a_handler_without_method() -> None:
    names = [n for n in METHODS if n != "compact"] + ["frobnicate"]
    with pytest.raises(ValueError) as info:
        RpcServer(handlers(*names), EventBus())
    message = str(info.value)
    assert "methods without a handler ['compact']" in message
    assert "handlers without a method ['frobnicate']" in message


@pytest.mark.parametrize(
    ("head", "rid"),
    [
        (b'{"jsonrpc":"2.0","id":12,"method":"run","params":{"input":"xxxx', 12),
        (b' {"id" : "a-1" ,"method":"run","params":{"input":"xx', "a-1"),
        (b'{"method":"id","params":{"id":3},"id":-4}', -4),  # nested and value "id"s skipped
        (b'{"a":"\\"id\\":9","id":5,', 5),  # an escaped quote inside a string
        (b'{"params":{"id":3,"input":"xxxx', None),  # only a nested id so far
        (b'{"id":123', None),  # the number may go on past the head
        (b'[{"id":1},', None),  # a batch has no one id
        (b'{"id":{"x":1},', None),  # not a valid id
        (b"not json", None),
        (b'{"id":"a\xffb","method":"status"}', None),  # not UTF-8: no id to give back
        (b'{"id":2.5,"method":"run","params":{"input":"xx', 2.5),  # any JSON number
        (b'{"id":-1e3,"method":"run"', -1000.0),
        (b'{"id":"job \\"7\\" \\u00e9","method":"run"', 'job "7" \u00e9'),  # escapes
        (b'{"id":"\\ud800","method":"run"', None),  # a lone surrogate: no string to give back
    ],
)
def test_id_from_head(head: bytes, rid: float | str | None) -> None:
    assert id_from_head(head) == rid
