"""OpenAI Responses API adapter (``provider.kind = "openai_responses"``), stateless
(``store: false``): the whole history is sent each time, reasoning is not sent back."""

from collections.abc import AsyncIterator, Iterator
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
    sendable_arguments,
    text_field,
    tool_arguments,
    whole_body,
)
from poddaemon.llm.incremental import IncrementalRender, encode_body, encoded_renderer
from poddaemon.llm.openai_chat import build_openai_client, tool_output_text
from poddaemon.llm.retry import (
    AttemptEvent,
    ProviderSettings,
    RetryingClient,
    classify_error_code,
)
from poddaemon.llm.types import (
    ModelRequest,
    ReasoningDelta,
    StopReason,
    TextDelta,
)

# ---------------------------------------------------------------------------------------------
# Rendering (pure)


def render_item(out: list[dict[str, Any]], item: Item) -> None:
    """Append `item`'s input items (earlier ones are never touched)."""
    if isinstance(item, AssistantMessage):
        if item.text:
            out.append({"type": "message", "role": "assistant", "content": item.text})
        for call in item.tool_calls:
            out.append(
                {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": sendable_arguments(call.arguments),
                }
            )
    elif isinstance(item, ToolResult):
        out.append(
            {
                "type": "function_call_output",
                "call_id": item.call_id,
                "output": tool_output_text(item),
            }
        )
    else:  # UserMessage | SystemNote: both in the user role
        out.append({"type": "message", "role": "user", "content": item.text})


def render_input(req: ModelRequest) -> list[dict[str, Any]]:
    """The whole history rendered from scratch (the adapter renders incrementally, same result)."""
    out: list[dict[str, Any]] = []
    for item in order_items(req.items):
        render_item(out, item)
    return out


def new_renderer() -> IncrementalRender[list[bytes]]:
    return encoded_renderer(render_item)


def encode_request(
    req: ModelRequest, model: str, renderer: IncrementalRender[list[bytes]]
) -> bytes:
    """`render_request`'s body as JSON, the history rendered and encoded incrementally."""
    body = render_request(msgspec.structs.replace(req, items=[]), model)
    return encode_body(body, "input", renderer.render(req.items))


def render_request(req: ModelRequest, model: str) -> dict[str, Any]:
    """The keyword arguments for ``client.responses.create``."""
    body: dict[str, Any] = {
        "model": model,
        "input": render_input(req),
        "max_output_tokens": req.max_tokens,
        "store": False,
        "stream": True,
    }
    if req.system:
        body["instructions"] = req.system
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": False,
            }
            for t in req.tools
        ]
    if req.temperature is not None:
        body["temperature"] = req.temperature
    return body


def usage_from(raw: Any) -> Usage:
    """Responses usage: ``input_tokens`` INCLUDES cached tokens (reported as the API gives
    them); ``input_tokens_details.cached_tokens`` is reported as cache_read."""
    details = field(raw, "input_tokens_details")
    return Usage(
        input=int_field(raw, "input_tokens"),
        output=int_field(raw, "output_tokens"),
        cache_read=int_field(details, "cached_tokens"),
        cache_write=int_field(details, "cache_write_tokens"),
    )


def stop_from(response: Any, has_tool_calls: bool) -> tuple[StopReason, str]:
    """Responses has no stop reason: a status plus, when incomplete, ``incomplete_details``."""
    status = field(response, "status")
    if status == "incomplete":
        reason = field(field(response, "incomplete_details"), "reason")
        return map_stop(reason or "incomplete", has_tool_calls)
    if status in (None, "completed"):
        return map_stop("tool_use" if has_tool_calls else "end_turn")
    return ("other", f"response status: {status}")


# ---------------------------------------------------------------------------------------------
# Client


_REASONING_DELTAS = ("response.reasoning_summary_text.delta", "response.reasoning_text.delta")


class _ToolAcc:
    __slots__ = ("args", "final", "id", "name")

    def __init__(self, call_id: str, name: str) -> None:
        self.id = call_id
        self.name = name
        self.args: list[str] = []
        self.final: str | None = None


async def _events(stream: Any) -> AsyncIterator[Any]:
    """The stream's events; a response sent whole (see `whole_body`) is read as the events
    that would have streamed it."""
    response = await whole_body(stream, "a Responses API answer", "output")
    if response is None:
        async for event in stream:
            yield event
        return
    for event in response_events(response):
        yield event


def response_events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A Responses API answer as its stream's events: each output item's text, reasoning
    (its summary, else its full text) and function calls, then the end its status says."""
    for index, item in enumerate(items(response, "output")):
        kind = field(item, "type")
        if kind == "message":
            for part in items(item, "content"):
                if field(part, "type") == "output_text":
                    yield {"type": "response.output_text.delta", "delta": field(part, "text")}
        elif kind == "reasoning":
            for part in items(item, "summary") or items(item, "content"):
                yield {"type": "response.reasoning_text.delta", "delta": field(part, "text")}
        elif kind == "function_call":
            yield {"type": "response.output_item.done", "output_index": index, "item": item}
    status = field(response, "status")
    end = status if status in ("failed", "incomplete") else "completed"
    yield {"type": f"response.{end}", "response": response}


class OpenAIResponsesClient(RetryingClient):
    sdk_module = "openai"

    def __init__(self, cfg: ProviderSettings, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        self._renderer = new_renderer()  # only the items added since the last call are rendered

    def _build(self, sdk: Any) -> Any:
        return build_openai_client(sdk, self.cfg)

    async def _attempt(self, client: Any, req: ModelRequest) -> AsyncIterator[AttemptEvent]:
        from openai import AsyncStream

        # post() rather than create(), events as decoded JSON: see openai_chat.
        stream = await client.post(
            "/responses",
            cast_to=object,
            content=encode_request(req, self.cfg.model, self._renderer),
            stream=True,
            stream_cls=AsyncStream[object],
        )
        try:
            text: list[str] = []
            reasoning: list[str] = []
            tools: dict[int, _ToolAcc] = {}  # output_index -> call
            events = 0
            async for event in _events(stream):
                events += 1
                kind = field(event, "type")
                piece = field(event, "delta")
                if kind == "response.output_text.delta" and piece:
                    text.append(piece)
                    yield TextDelta(piece)
                elif kind in _REASONING_DELTAS and piece:
                    reasoning.append(piece)
                    yield ReasoningDelta(piece)
                elif kind in ("response.output_item.added", "response.output_item.done"):
                    item = field(event, "item")
                    if field(item, "type") == "function_call":
                        index = int_field(event, "output_index")
                        acc = tools.get(index)
                        if acc is None:
                            acc = tools[index] = _ToolAcc(
                                text_field(item, "call_id"), text_field(item, "name")
                            )
                        if kind == "response.output_item.done":
                            final = field(item, "arguments")  # None: not given, use the deltas
                            acc.final = None if final is None else text_field(item, "arguments")
                    yield None
                elif kind == "response.function_call_arguments.delta":
                    acc = tools.get(int_field(event, "output_index"))
                    if acc is not None:
                        acc.args.append(text_field(event, "delta"))
                    yield None
                elif kind in ("response.completed", "response.incomplete"):
                    response = field(event, "response")
                    calls = tuple(
                        ToolCall(
                            id=acc.id or f"call_{index}",
                            name=acc.name,
                            arguments=tool_arguments(
                                acc.final if acc.final is not None else "".join(acc.args)
                            ),
                        )
                        for index, acc in sorted(tools.items())
                    )
                    stop = stop_from(response, bool(calls))
                    usage = usage_from(field(response, "usage"))
                    yield assembled(text, reasoning, calls, stop, usage)
                    return
                elif kind == "response.failed":
                    error = field(field(event, "response"), "error")
                    raise classify_error_code(
                        str(field(error, "code", "failed")), str(field(error, "message", ""))
                    )
                elif kind == "error":
                    raise classify_error_code(
                        str(field(event, "code", "error")), str(field(event, "message", ""))
                    )
                else:
                    yield None
            raise ended_early(stream, "stream ended before response.completed", events)
        finally:
            await stream.close()
