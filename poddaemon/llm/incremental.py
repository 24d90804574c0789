"""Incremental rendering: each model call renders only the history items added since the last.

History items are immutable and appended only, so a call's items normally extend the previous
call's. `IncrementalOrder` is `order_items` fed one call at a time: items it has placed for good
never move again, only the tail deferred behind an unanswered tool batch is re-placed per call.
The adapters keep their rendered form of the placed items and render just the new ones. A list
that does not extend the previous one (a compaction, an interceptor's rewrite, the summary
call) starts over from scratch: same result, full price once.
"""

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from poddaemon.history import AssistantMessage, Item, ToolResult

S = TypeVar("S")


class IncrementalOrder:
    """`order_items` (see `poddaemon.llm.order_items`) as a stream: `placed + deferred` equals
    `order_items(items)` after `advance(items)`, and `placed` only ever grows until a restart."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.seen: list[Item] = []
        self.placed: list[Item] = []
        self.deferred: list[Item] = []
        self._pending: set[str] = set()

    def advance(self, items: list[Item]) -> bool:
        """Take in `items` (the whole history of this call); False when it did not extend the
        previous call's and everything was placed afresh."""
        n = len(self.seen)
        # List equality checks identity first: for a history that grew this is a pointer walk.
        extends = len(items) >= n and items[:n] == self.seen
        if not extends:
            self.restart()
            n = 0
        for item in items[n:]:
            self._feed(item)
        self.seen.extend(items[n:])
        return extends

    def _feed(self, item: Item) -> None:
        if isinstance(item, AssistantMessage):
            self.placed.extend(self.deferred)
            self.deferred.clear()
            self.placed.append(item)
            self._pending = {call.id for call in item.tool_calls}
        elif isinstance(item, ToolResult):
            self.placed.append(item)
            self._pending.discard(item.call_id)
            if not self._pending:
                self.placed.extend(self.deferred)
                self.deferred.clear()
        elif self._pending:
            self.deferred.append(item)
        else:
            self.placed.append(item)


class IncrementalRender(Generic[S]):
    """A renderer's state `S`, built from the placed items one at a time (`feed`), copied
    (`copy`) to finish a call with the deferred tail without touching what is kept."""

    def __init__(
        self,
        new: Callable[[], S],
        feed: Callable[[S, Item], None],
        copy: Callable[[S], S],
    ) -> None:
        self._new, self._feed, self._copy = new, feed, copy
        self.order = IncrementalOrder()
        self._state = new()
        self._done = 0  # placed items already fed into _state

    def render(self, items: list[Item]) -> S:
        """A fresh state for `items`: the kept state advanced by the new placed items, then a
        copy of it fed the deferred tail. The caller may keep or change the copy."""
        if not self.order.advance(items):
            self._state, self._done = self._new(), 0
        placed = self.order.placed
        for item in placed[self._done :]:
            self._feed(self._state, item)
        self._done = len(placed)
        out = self._copy(self._state)
        for item in self.order.deferred:
            self._feed(out, item)
        return out


# ---------------------------------------------------------------------------------------------
# Pre-encoded bodies: the SDKs send a `bytes` body as it is, so the history's JSON is encoded
# once per item too, not once per call (json.dumps of 1,000 turns is ~1 ms a call).

_encoder = msgspec.json.Encoder()
json_encode = _encoder.encode
RenderItem = Callable[[list[dict[str, Any]], Item], None]


def encoded_renderer(render_item: RenderItem) -> IncrementalRender[list[bytes]]:
    """An incremental renderer whose state is each rendered element's JSON."""

    def feed(parts: list[bytes], item: Item) -> None:
        elements: list[dict[str, Any]] = []
        render_item(elements, item)
        parts.extend(map(_encoder.encode, elements))

    return IncrementalRender(list, feed, list)


def encode_body(body: dict[str, Any], key: str, parts: list[bytes]) -> bytes:
    """`body` as JSON with `key` set to the array whose elements `parts` already are (`key`
    goes last; JSON objects are unordered)."""
    head = _encoder.encode({k: v for k, v in body.items() if k != key})
    sep = b"," if len(head) > 2 else b""
    return b"".join((head[:-1], sep, _encoder.encode(key), b":[", b",".join(parts), b"]}"))
