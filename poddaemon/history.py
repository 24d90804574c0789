"""Provider-neutral conversation items: what the session log stores and adapters translate."""

from typing import Any, cast

import msgspec


class ToolCall(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    name: str
    arguments: str  # raw JSON text, exactly as the model produced it


class Usage(msgspec.Struct, kw_only=True):
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0

    def add(self, other: "Usage") -> None:
        self.input += other.input
        self.output += other.output
        self.cache_read += other.cache_read
        self.cache_write += other.cache_write

    @property
    def total(self) -> int:
        return self.input + self.output


class UserMessage(msgspec.Struct, tag="user", kw_only=True, frozen=True):
    text: str


class SystemNote(msgspec.Struct, tag="system", kw_only=True, frozen=True):
    """Notifications, child reports and interruption notes; rendered in the user role."""

    text: str


class AssistantMessage(msgspec.Struct, tag="assistant", kw_only=True, frozen=True):
    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


class ToolResult(msgspec.Struct, tag="tool_result", kw_only=True, frozen=True):
    call_id: str
    name: str
    output: str
    is_error: bool = False


Item = UserMessage | SystemNote | AssistantMessage | ToolResult

_item_decoder: msgspec.json.Decoder[Item] = msgspec.json.Decoder(Item)


_ITEM_TYPES: dict[str, type[Item]] = {
    "user": UserMessage,
    "system": SystemNote,
    "assistant": AssistantMessage,
    "tool_result": ToolResult,
}


def item_from_builtins(obj: Any) -> Item:
    # Converting to the concrete Struct by its tag is ~20x cheaper than to the Union, whose
    # type info msgspec rebuilds on every call; restore converts every item of a session.
    kind = obj.get("type") if isinstance(obj, dict) else None
    target = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if target is None:
        return cast(Item, msgspec.convert(obj, Item))  # raises a clear ValidationError
    return msgspec.convert(obj, target)


def item_to_builtins(item: Item) -> Any:
    return msgspec.to_builtins(item)


def decode_item(data: bytes) -> Item:
    return _item_decoder.decode(data)
