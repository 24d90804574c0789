"""OpenAI Chat Completions adapter (``provider.kind = "openai"``): OpenAI itself and any
compatible server (vLLM, llama.cpp, Ollama, ...)."""

import os
from collections.abc import AsyncIterator, Callable
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
    until_cut,
    whole_body,
)
from poddaemon.llm.incremental import (
    IncrementalRender,
    encode_body,
    encoded_renderer,
    json_encode,
)
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


def tool_output_text(result: ToolResult) -> str:
    """Neither OpenAI format has an error flag on tool output: say it in the text."""
    if result.is_error:
        return f"[tool error] {result.output}"
    return result.output


def render_item(messages: list[dict[str, Any]], item: Item) -> None:
    """Append `item`'s message (one per item; earlier messages are never touched)."""
    if isinstance(item, AssistantMessage):
        msg: dict[str, Any] = {"role": "assistant"}
        if item.tool_calls:
            msg["content"] = item.text or None
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": sendable_arguments(call.arguments),
                    },
                }
                for call in item.tool_calls
            ]
        else:
            msg["content"] = item.text
        messages.append(msg)
    elif isinstance(item, ToolResult):
        messages.append(
            {"role": "tool", "tool_call_id": item.call_id, "content": tool_output_text(item)}
        )
    else:  # UserMessage | SystemNote: both in the user role
        messages.append({"role": "user", "content": item.text})


def system_messages(req: ModelRequest) -> list[dict[str, Any]]:
    return [{"role": "system", "content": req.system}] if req.system else []


def render_messages(req: ModelRequest) -> list[dict[str, Any]]:
    """The whole history rendered from scratch (the adapter renders incrementally, same result)."""
    messages = system_messages(req)
    for item in order_items(req.items):
        render_item(messages, item)
    return messages


def new_renderer() -> IncrementalRender[list[bytes]]:
    return encoded_renderer(render_item)


def encode_request(
    req: ModelRequest,
    model: str,
    renderer: IncrementalRender[list[bytes]],
    *,
    max_tokens_field: str = "max_completion_tokens",
) -> bytes:
    """`render_request`'s body as JSON, the history rendered and encoded incrementally."""
    body = render_request(
        msgspec.structs.replace(req, items=[]), model, max_tokens_field=max_tokens_field
    )
    system = [json_encode(m) for m in body["messages"]]
    return encode_body(body, "messages", system + renderer.render(req.items))


def render_request(
    req: ModelRequest, model: str, *, max_tokens_field: str = "max_completion_tokens"
) -> dict[str, Any]:
    """The keyword arguments for ``client.chat.completions.create``.

    OpenAI's own API wants ``max_completion_tokens`` (reasoning models reject ``max_tokens``);
    many compatible servers only know ``max_tokens``. The client picks by ``base_url``.
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": render_messages(req),
        max_tokens_field: req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in req.tools
        ]
    if req.temperature is not None:
        body["temperature"] = req.temperature
    return body


def usage_from(raw: Any) -> Usage:
    """Chat usage: ``prompt_tokens`` INCLUDES cached tokens (reported as the API gives them);
    ``prompt_tokens_details.cached_tokens`` is reported as cache_read."""
    details = field(raw, "prompt_tokens_details")
    return Usage(
        input=int_field(raw, "prompt_tokens"),
        output=int_field(raw, "completion_tokens"),
        cache_read=int_field(details, "cached_tokens"),
        cache_write=int_field(details, "cache_write_tokens"),
    )


# ---------------------------------------------------------------------------------------------
# Client


def build_openai_client(sdk: Any, cfg: ProviderSettings) -> Any:
    name = api_key_env_name(cfg)
    key = os.environ.get(name)
    if not key:
        raise ProviderError("auth", f"environment variable {name} is not set")
    return sdk.AsyncOpenAI(
        api_key=key,
        base_url=cfg.base_url,
        max_retries=0,
        timeout=sdk_timeout(sdk, cfg),
    )


async def _chunks(stream: Any, answered: Callable[[], bool]) -> AsyncIterator[Any]:
    """The stream's chunks (see `until_cut`). A completion sent whole (see `whole_body`) is
    read as one chunk whose choices carry their `message` as the stream's `delta` (the same
    fields: content, reasoning, refusal, tool_calls)."""
    completion = await whole_body(stream, "a Chat Completions answer", "choices")
    if completion is not None:
        choices = [
            {**choice, "delta": field(choice, "message")}
            for choice in items(completion, "choices")
            if isinstance(choice, dict)
        ]
        yield {"choices": choices, "usage": field(completion, "usage")}
        return
    async for chunk in until_cut(stream, answered):
        yield chunk


class _ToolAcc:
    __slots__ = ("args", "id", "name")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.args: list[str] = []


class OpenAIChatClient(RetryingClient):
    sdk_module = "openai"

    def __init__(self, cfg: ProviderSettings, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        self._max_tokens_field = "max_completion_tokens" if cfg.base_url is None else "max_tokens"
        self._renderer = new_renderer()  # only the items added since the last call are rendered

    def _build(self, sdk: Any) -> Any:
        return build_openai_client(sdk, self.cfg)

    async def _attempt(self, client: Any, req: ModelRequest) -> AsyncIterator[AttemptEvent]:
        body = encode_request(
            req, self.cfg.model, self._renderer, max_tokens_field=self._max_tokens_field
        )
        from openai import AsyncStream

        # post() rather than create(): our body is already plain JSON, and create()'s
        # transform walks it on the event loop (~0.4 ms per history message). Chunks come as
        # the decoded JSON (`object`), not pydantic models: building a ChatCompletionChunk
        # costs ~70 µs of the model thread per chunk (and its schema ~10 ms at the first),
        # for the few fields read here.
        stream = await client.post(
            "/chat/completions",
            cast_to=object,
            content=body,
            stream=True,
            stream_cls=AsyncStream[object],
        )
        try:
            text: list[str] = []
            reasoning: list[str] = []
            tools: dict[int, _ToolAcc] = {}
            usage = Usage()
            finish: str | None = None
            events = 0

            def answered() -> bool:  # its finish_reason came: the answer is whole
                return finish is not None

            async for chunk in _chunks(stream, answered):
                events += 1
                raw_usage = field(chunk, "usage")
                if raw_usage is not None:
                    usage = usage_from(raw_usage)
                produced = moved = False
                for choice in field(chunk, "choices", []):
                    if int_field(choice, "index") != 0:
                        continue
                    delta = field(choice, "delta")
                    # Not in the OpenAI schema; DeepSeek, vLLM and others stream it.
                    thought = field(delta, "reasoning_content") or field(delta, "reasoning")
                    if isinstance(thought, str) and thought:
                        reasoning.append(thought)
                        produced = True
                        yield ReasoningDelta(thought)
                    for piece in (field(delta, "content"), field(delta, "refusal")):
                        if isinstance(piece, str) and piece:
                            text.append(piece)
                            produced = True
                            yield TextDelta(piece)
                    for tc in field(delta, "tool_calls", []):
                        index = field(tc, "index")
                        if not isinstance(index, int):  # some servers omit it: one per chunk
                            index = len(tools) - 1 if tools and not field(tc, "id") else len(tools)
                        acc = tools.setdefault(index, _ToolAcc())
                        acc.id = text_field(tc, "id", acc.id)
                        fn = field(tc, "function")
                        acc.name = text_field(fn, "name", acc.name) if not acc.name else acc.name
                        acc.args.append(text_field(fn, "arguments"))
                        moved = True
                    finish = field(choice, "finish_reason", finish)
                if not produced:  # a tool call's arguments, the finish: the answer moves on
                    moved = moved or finish is not None or raw_usage is not None
                    yield None if moved else KEEP_ALIVE
            if finish is None:
                raise ended_early(stream, "stream ended without a finish_reason", events)
            calls = tuple(
                ToolCall(
                    id=acc.id or f"call_{index}",
                    name=acc.name,
                    arguments=tool_arguments("".join(acc.args)),
                )
                for index, acc in sorted(tools.items())
            )
            yield assembled(text, reasoning, calls, map_stop(finish, bool(calls)), usage)
        finally:
            await stream.close()
