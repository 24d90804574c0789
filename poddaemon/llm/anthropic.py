"""Anthropic Messages API adapter (``provider.kind = "anthropic"``)."""

import os
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec

from poddaemon.history import AssistantMessage, Item, ToolCall, ToolResult, Usage
from poddaemon.llm import (
    assembled,
    ended_early,
    field,
    int_field,
    items,
    map_stop,
    order_items,
    text_field,
    tool_arguments,
    tool_input,
    until_cut,
    whole_body,
)
from poddaemon.llm.incremental import IncrementalRender
from poddaemon.llm.retry import (
    KEEP_ALIVE,
    AttemptEvent,
    ProviderSettings,
    RetryingClient,
    api_key_env_name,
    sdk_timeout,
)
from poddaemon.llm.types import (
    ModelRequest,
    ProviderError,
    ReasoningDelta,
    TextDelta,
)

# ---------------------------------------------------------------------------------------------
# Rendering (pure)


_ID_CHAR = re.compile(r"[^a-zA-Z0-9_-]")


def wire_id(call_id: str) -> str:
    """A call's id as the API takes it back (it refuses any outside [a-zA-Z0-9_-]+): another
    server's ids ("call:1", "fc.1 a") and a compaction provider fed another kind's history
    made every later request fail. Mapped the same way for the call and its result."""
    return _ID_CHAR.sub("_", call_id) or "toolu_"


class Fold:
    """Anthropic messages built one ordered item at a time. Roles must alternate, so items
    merge into the message before them: `feed` replaces a message it extends rather than change
    it (a copy of the fold shares the messages), and user blocks wait in `user_blocks` until
    the next assistant message or `finish`."""

    __slots__ = ("messages", "user_blocks")

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.user_blocks: list[dict[str, Any]] = []

    def copy(self) -> "Fold":
        other = Fold()
        other.messages = list(self.messages)
        other.user_blocks = list(self.user_blocks)
        return other

    def flush_user(self) -> None:
        if self.user_blocks:
            # tool_result blocks must open the user message that follows the tool_use turn.
            results = [b for b in self.user_blocks if b["type"] == "tool_result"]
            others = [b for b in self.user_blocks if b["type"] != "tool_result"]
            self.messages.append({"role": "user", "content": results + others})
            self.user_blocks = []

    def feed(self, item: Item) -> None:
        if isinstance(item, AssistantMessage):
            content: list[dict[str, Any]] = []
            if item.text:
                content.append({"type": "text", "text": item.text})
            for call in item.tool_calls:
                content.append(
                    {
                        "type": "tool_use",
                        "id": wire_id(call.id),
                        "name": call.name,
                        "input": tool_input(call.arguments),
                    }
                )
            if not content:
                return  # an empty assistant turn is rejected; its neighbours simply merge
            self.flush_user()
            messages = self.messages
            if messages and messages[-1]["role"] == "assistant":
                messages[-1] = {"role": "assistant", "content": messages[-1]["content"] + content}
            else:
                messages.append({"role": "assistant", "content": content})
        elif isinstance(item, ToolResult):
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": wire_id(item.call_id),
                "content": item.output if item.output else "(no output)",
            }
            if item.is_error:
                block["is_error"] = True
            self.user_blocks.append(block)
        else:  # UserMessage | SystemNote: both in the user role
            if item.text:
                self.user_blocks.append({"type": "text", "text": item.text})

    def finish(self) -> list[dict[str, Any]]:
        self.flush_user()
        return self.messages


def render_messages(req: ModelRequest) -> list[dict[str, Any]]:
    """History as Anthropic messages: strictly alternating roles, tool_result blocks first in a
    user message, system notes as user text blocks, reasoning never sent back. From scratch:
    the adapter renders incrementally (`new_renderer`), with the same result."""
    fold = Fold()
    for item in order_items(req.items):
        fold.feed(item)
    return fold.finish()


def new_renderer() -> IncrementalRender[Fold]:
    return IncrementalRender(Fold, Fold.feed, Fold.copy)


def render_request(
    req: ModelRequest, model: str, renderer: IncrementalRender[Fold] | None = None
) -> dict[str, Any]:
    """The keyword arguments for ``client.messages.create``."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "messages": render_messages(req)
        if renderer is None
        else renderer.render(req.items).finish(),
        "stream": True,
    }
    if req.system:
        body["system"] = req.system
    if req.tools:
        body["tools"] = [
            {"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in req.tools
        ]
    if req.temperature is not None:
        body["temperature"] = req.temperature
    return body


def usage_from(raw: Any, into: Usage | None = None) -> Usage:
    """Anthropic usage, as the API reports it: ``input_tokens`` EXCLUDES cached tokens (total
    input = input + cache_read + cache_write). Fields given in a later event (message_delta's
    cumulative counts) overwrite earlier ones; absent fields keep their value."""
    usage = into if into is not None else Usage()
    for src, dst in (
        ("input_tokens", "input"),
        ("output_tokens", "output"),
        ("cache_read_input_tokens", "cache_read"),
        ("cache_creation_input_tokens", "cache_write"),
    ):
        value = field(raw, src)
        if isinstance(value, int):
            setattr(usage, dst, value)
    return usage


# ---------------------------------------------------------------------------------------------
# Client


def normalize_base_url(url: str | None) -> str | None:
    """Anthropic's SDK appends ``/v1/messages`` itself; a configured trailing ``/v1`` is
    tolerated (SPEC §3) by stripping it."""
    if url is None:
        return None
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


async def _events(stream: Any, answered: Callable[[], bool]) -> AsyncIterator[Any]:
    """The stream's events (see `until_cut`); a message sent whole (see `whole_body`) is read
    as the events that would have streamed it."""
    message = await whole_body(stream, "a Messages API answer", "content")
    if message is None:
        async for event in until_cut(stream, answered):
            yield event
        return
    for event in message_events(message):
        yield event


def message_events(message: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A Messages API answer as its stream's events: each content block starts whole (a tool
    call's input as one JSON delta), then the stop reason, then the end."""
    yield {"type": "message_start", "message": {"usage": field(message, "usage")}}
    for index, block in enumerate(items(message, "content")):
        yield {"type": "content_block_start", "index": index, "content_block": block}
        if field(block, "type") == "tool_use":
            arguments = msgspec.json.encode(field(block, "input", {})).decode()
            delta = {"type": "input_json_delta", "partial_json": arguments}
            yield {"type": "content_block_delta", "index": index, "delta": delta}
    yield {"type": "message_delta", "delta": {"stop_reason": field(message, "stop_reason")}}
    yield {"type": "message_stop"}


class AnthropicClient(RetryingClient):
    sdk_module = "anthropic"

    def __init__(self, cfg: ProviderSettings, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        self._renderer = new_renderer()  # only the items added since the last call are rendered

    def _build(self, sdk: Any) -> Any:
        name = api_key_env_name(self.cfg)
        key = os.environ.get(name)
        if not key:
            raise ProviderError("auth", f"environment variable {name} is not set")
        return sdk.AsyncAnthropic(
            api_key=key,
            base_url=normalize_base_url(self.cfg.base_url),
            max_retries=0,
            timeout=sdk_timeout(sdk, self.cfg),
        )

    async def _attempt(self, client: Any, req: ModelRequest) -> AsyncIterator[AttemptEvent]:
        body = render_request(req, self.cfg.model, self._renderer)
        from anthropic import AsyncStream

        # post() rather than messages.create(): the body is already plain JSON (temperature
        # included, which 2.x dropped from create()'s signature), and create()'s transform
        # walks it on the event loop (~0.4 ms per history message). Events come as the
        # decoded JSON (`object`), not pydantic models (see openai_chat).
        stream = await client.post(
            "/v1/messages",
            cast_to=object,
            body=body,
            stream=True,
            stream_cls=AsyncStream[object],
        )
        try:
            text: list[str] = []
            reasoning: list[str] = []
            tools: dict[int, tuple[str, str, list[str]]] = {}  # block index -> id, name, json
            usage = Usage()
            stop_raw: str | None = None
            stopped = False
            events = 0

            def answered() -> bool:  # message_delta brought the stop reason: the answer is whole
                return stop_raw is not None

            async for event in _events(stream, answered):
                events += 1
                kind = field(event, "type")
                if kind == "content_block_delta":
                    delta = field(event, "delta")
                    dtype = field(delta, "type")
                    if dtype == "text_delta" and (piece := field(delta, "text")):
                        text.append(piece)
                        yield TextDelta(piece)
                    elif dtype == "thinking_delta" and (piece := field(delta, "thinking")):
                        reasoning.append(piece)
                        yield ReasoningDelta(piece)
                    elif dtype == "input_json_delta":
                        entry = tools.get(int_field(event, "index"))
                        if entry is not None:
                            entry[2].append(text_field(delta, "partial_json"))
                        yield None
                    else:
                        yield None
                elif kind == "content_block_start":
                    block = field(event, "content_block")
                    btype = field(block, "type")
                    if btype == "tool_use":
                        tools[int_field(event, "index")] = (
                            text_field(block, "id"),
                            text_field(block, "name"),
                            [],
                        )
                        yield None
                    elif btype == "text" and (piece := field(block, "text")):
                        text.append(piece)
                        yield TextDelta(piece)
                    elif btype == "thinking" and (piece := field(block, "thinking")):
                        reasoning.append(piece)
                        yield ReasoningDelta(piece)
                    else:
                        yield None
                elif kind == "message_start":
                    usage_from(field(field(event, "message"), "usage"), usage)
                    yield None
                elif kind == "message_delta":
                    stop_raw = field(field(event, "delta"), "stop_reason", stop_raw)
                    usage_from(field(event, "usage"), usage)
                    yield None
                elif kind == "message_stop":
                    stopped = True
                    break
                elif kind == "ping":
                    yield KEEP_ALIVE
                else:
                    yield None
            if not stopped and stop_raw is None:  # a cut after message_delta keeps the answer
                raise ended_early(stream, "stream ended before message_stop", events)
            # A server that gives a tool_use no id (some compatible ones do): sent back as "",
            # the API refuses every later request of the session (ids match [a-zA-Z0-9_-]+).
            calls = tuple(
                ToolCall(
                    id=cid or f"toolu_{index}", name=name, arguments=tool_arguments("".join(parts))
                )
                for index, (cid, name, parts) in sorted(tools.items())
            )
            yield assembled(text, reasoning, calls, map_stop(stop_raw, bool(calls)), usage)
        finally:
            await stream.close()
