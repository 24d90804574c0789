"""Model adapters: one per wire format, all behind the ``ModelClient`` interface.

``make_client`` is cheap: it imports neither SDK (each adapter imports its SDK in a thread on
first use or in ``warm()``). The pure helpers here are shared by the three renderers.
"""

import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from poddaemon.history import AssistantMessage, Item, ToolCall, ToolResult, Usage
from poddaemon.llm.retry import ProviderSettings, api_key_env_name, classify_error_code
from poddaemon.llm.types import (
    ModelClient,
    ModelRequest,
    ModelResponse,
    ProviderError,
    ReasoningDelta,
    RetryScheduled,
    StopReason,
    StreamEvent,
    TextDelta,
    ToolSpec,
)
from protocol.unreadable import UNREADABLE

if TYPE_CHECKING:
    from poddaemon.config.manifest import Manifest

__all__ = [
    "CredentialsError",
    "ModelClient",
    "ModelRequest",
    "ModelResponse",
    "ProviderError",
    "ProviderSettings",
    "ReasoningDelta",
    "RetryScheduled",
    "StopReason",
    "StreamEvent",
    "TextDelta",
    "ToolSpec",
    "check_credentials",
    "check_manifest_credentials",
    "make_client",
    "map_stop",
    "order_items",
]


class CredentialsError(ValueError):
    """The provider's API key is missing; the message names the environment variable."""


def check_credentials(cfg: ProviderSettings, environ: Mapping[str, str] | None = None) -> None:
    """Raise CredentialsError unless the API key variable for ``cfg`` is set and non-empty."""
    env = os.environ if environ is None else environ
    name = api_key_env_name(cfg)
    key = env.get(name)
    if not key:
        raise CredentialsError(f"provider.api_key_env: environment variable {name} is not set")
    if key != key.strip() or not key.isascii() or not key.isprintable():
        # The HTTP stack refuses such a header only at the first request ("Illegal header
        # value b'Bearer <the key>'"), as a connection error, retried, key and all.
        raise CredentialsError(
            f"provider.api_key_env: environment variable {name} holds whitespace at an end "
            "(a line break from a file?), a control or a non-ASCII character: no HTTP header "
            "can carry it"
        )


def check_manifest_credentials(
    manifest: "Manifest", environ: Mapping[str, str] | None = None
) -> None:
    """`check_credentials` for the pod's provider and its compaction provider, if it has one
    (the message then names `compaction.provider.api_key_env`)."""
    check_credentials(manifest.provider, environ)
    compaction = manifest.compaction
    if compaction is not None and compaction.provider is not None:
        try:
            check_credentials(compaction.provider, environ)
        except CredentialsError as exc:
            message = str(exc).replace("provider.", "compaction.provider.", 1)
            raise CredentialsError(message) from None


def make_client(cfg: ProviderSettings) -> ModelClient:
    """The adapter for ``cfg.kind``; no SDK is imported until ``warm()`` or the first stream."""
    if cfg.kind == "anthropic":
        from poddaemon.llm.anthropic import AnthropicClient

        return AnthropicClient(cfg)
    if cfg.kind == "openai":
        from poddaemon.llm.openai_chat import OpenAIChatClient

        return OpenAIChatClient(cfg)
    if cfg.kind == "openai_responses":
        from poddaemon.llm.openai_responses import OpenAIResponsesClient

        return OpenAIResponsesClient(cfg)
    raise ValueError(f"provider.kind: unknown provider kind {cfg.kind!r}")


# ---------------------------------------------------------------------------------------------
# Pure helpers shared by the renderers


def order_items(items: list[Item]) -> list[Item]:
    """History in the order every provider accepts.

    Each assistant message's tool calls must be answered by their results before anything else
    in the user role; user messages and system notes that were committed between the results
    of one batch (a notification arriving while tools ran) move after the batch's last result.
    """
    out: list[Item] = []
    pending: set[str] = set()
    deferred: list[Item] = []
    for item in items:
        if isinstance(item, AssistantMessage):
            out.extend(deferred)
            deferred.clear()
            out.append(item)
            pending = {call.id for call in item.tool_calls}
        elif isinstance(item, ToolResult):
            out.append(item)
            pending.discard(item.call_id)
            if not pending:
                out.extend(deferred)
                deferred.clear()
        elif pending:
            deferred.append(item)
        else:
            out.append(item)
    out.extend(deferred)
    return out


_STOP_MAP: dict[str, StopReason] = {
    "end_turn": "end_turn",
    "stop": "end_turn",
    "stop_sequence": "end_turn",
    "completed": "end_turn",
    "tool_use": "tool_use",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "max_tokens": "max_tokens",
    "length": "max_tokens",
    "max_output_tokens": "max_tokens",
    "content_filter": "content_filter",
    "refusal": "content_filter",
    "model_context_window_exceeded": "context_overflow",
}


def map_stop(raw: str | None, has_tool_calls: bool = False) -> tuple[StopReason, str]:
    """(normalized stop reason, detail) for a provider's stop/finish reason.

    A response that carries tool calls but says it simply stopped (some compatible servers
    answer ``stop`` with tool calls) is reported as ``tool_use``: the calls must run.
    """
    stop = _STOP_MAP.get(raw or "")
    if stop is None:
        return ("other", f"stop reason: {raw}" if raw else "no stop reason given")
    if stop == "end_turn" and has_tool_calls:
        return ("tool_use", "")
    return (stop, "")


def assembled(
    text: list[str],
    reasoning: list[str],
    calls: tuple[ToolCall, ...],
    stop: tuple[StopReason, str],
    usage: Usage,
) -> ModelResponse:
    """The response a stream's pieces add up to; `stop` as `map_stop` gives it."""
    reason, detail = stop
    # A negative count (a broken or hostile server) would refund a capped pod's budget: spent
    # went below zero and the pod called on past `max_total_tokens`. None counts less than 0.
    usage = Usage(
        input=max(0, usage.input),
        output=max(0, usage.output),
        cache_read=max(0, usage.cache_read),
        cache_write=max(0, usage.cache_write),
    )
    message = AssistantMessage(
        text="".join(text), reasoning="".join(reasoning), tool_calls=unique_ids(calls)
    )
    return ModelResponse(message=message, stop=reason, usage=usage, detail=detail)


def unique_ids(calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
    """The calls, a repeated id renamed `<id>_2`, `_3`, …: each result answers one call by its
    id, so two calls of one response sharing it (some local models do) would share a result,
    and a restore could close only one of them. The renamed id is what the history and the
    next request carry (letters, digits, `_`: valid for every provider that took the first)."""
    seen = {c.id for c in calls}
    if len(seen) == len(calls):
        return calls
    out: list[ToolCall] = []
    used: set[str] = set()
    for call in calls:
        if call.id in used:
            n = 2
            while f"{call.id}_{n}" in seen or f"{call.id}_{n}" in used:
                n += 1
            call = msgspec.structs.replace(call, id=f"{call.id}_{n}")
        used.add(call.id)
        out.append(call)
    return tuple(out)


async def until_cut(events: AsyncIterator[Any], whole: Callable[[], bool]) -> AsyncIterator[Any]:
    """A provider stream's events; a broken connection once ``whole()`` holds ends them instead
    of failing the call. The answer is whole once its stop reason came: only the usage (Chat
    Completions sends it after the finish_reason, Anthropic with it) and the stream's terminator
    can still be missing, and a run that ends in error would lose the answer and count no usage
    either. Only the stream's own errors are caught, not those of the code reading it."""
    it = aiter(events)
    while True:
        try:
            event = await anext(it)
        except StopAsyncIteration:
            return
        except Exception:
            if not whole():
                raise
            return
        yield event


async def whole_body(stream: Any, api: str, holds: str) -> dict[str, Any] | None:
    """The answer, when the server sent it whole as one JSON object to a request that asked for
    a stream (some compatible servers ignore `stream: true`); None for an event stream. A JSON
    Content-Type over what is not JSON is an event stream mislabeled: the stream then reads the
    body from where aread() kept it. An object without the list every answer of the `api`
    `holds` is another API's answer (a Chat Completions server behind `kind = "anthropic"`):
    read as an answer, it ended the run `finished` with no text."""
    response = stream.response
    if "json" not in response.headers.get("content-type", ""):
        return None
    try:
        body = msgspec.json.decode(await response.aread())
    except UNREADABLE:
        return None
    if not isinstance(body, dict):
        return None
    raise_error_body(body)
    if not isinstance(body.get(holds), list):
        keys = ", ".join(sorted(k[:40] for k in body)[:6]) or "none"
        ctype = response.headers.get("content-type", "").split(";", 1)[0]
        raise ProviderError(
            "transient",
            f"the answer (HTTP {response.status_code}, {ctype}) is not {api}: a JSON object"
            f" with no `{holds}` list (its keys: {keys}); do provider.kind and"
            " provider.base_url name this server's API?",
        )
    return body


def ended_early(stream: Any, what: str, events: int) -> ProviderError:
    """The error for a stream that ended before its answer: `what` it lacked. One that held
    no event at all says what came instead: a base_url that points at a web page (a UI's
    port, a captive portal) is answered 200 with HTML, which no event parser reads."""
    if events:
        return ProviderError("transient", what)
    response = stream.response
    ctype = response.headers.get("content-type", "").split(";", 1)[0] or "no Content-Type"
    return ProviderError(
        "transient",
        f"{what}: the answer (HTTP {response.status_code}, {ctype}) held no event; "
        "does provider.base_url point at the API?",
    )


def raise_error_body(body: dict[str, Any]) -> None:
    """An error object sent with 200 in place of an answer (OpenAI's `{"error": {message,
    type, code}}`, Ollama's `{"error": "..."}`, Anthropic's `{"type": "error", "error":
    {...}}`) fails the call as a stream's error event does: it is not an empty answer."""
    error = body.get("error")
    if error is None or any(k in body for k in ("choices", "output", "content")):
        return
    if isinstance(error, dict):
        code = str(error.get("code") or error.get("type") or "error")
        raise classify_error_code(code, str(error.get("message") or ""))
    raise classify_error_code("error", str(error))


def items(obj: Any, name: str) -> list[Any]:
    """A field that must be a list (a server's answer read whole): anything else is none."""
    value = field(obj, name)
    return value if isinstance(value, list) else []


def field(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` or ``obj[name]``: SDK models and plain dicts alike; None counts as missing."""
    if obj is None:
        return default
    value = obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)
    return default if value is None else value


def text_field(obj: Any, name: str, default: str = "") -> str:
    """A field that must be text: a server sending another JSON type (`"name": 5`) gets its
    value as JSON text, which the tool call's checks then refuse in words the model reads (it
    ended the run with a TypeError from joining the pieces)."""
    value = field(obj, name, default)
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def int_field(obj: Any, name: str) -> int:
    value = field(obj, name, 0)
    return value if isinstance(value, int) else 0


def tool_arguments(raw: str) -> str:
    """Arguments as the model produced them; a call with none becomes ``{}``."""
    return raw if raw.strip() else "{}"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the JSON object every provider wants back in the history.
    Malformed ones (not JSON, or JSON but not an object) stay visible to the model as
    ``{"_raw_arguments": <the text>}`` rather than dropped."""
    if not arguments.strip():
        return {}
    value = _json_object(arguments)
    return value if value is not None else {"_raw_arguments": arguments}


def sendable_arguments(arguments: str) -> str:
    """The arguments text to send back to an OpenAI-style API: exactly as the model produced
    it when that is a JSON object, else `tool_input`'s object. Servers that parse it (Ollama,
    llama.cpp) refuse a request carrying malformed arguments, so a model that emitted them
    once would have every later request of its session refused."""
    if _json_object(arguments) is not None:
        return arguments
    return msgspec.json.encode(tool_input(arguments)).decode()


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(text)
    except UNREADABLE:
        return None
    return value if isinstance(value, dict) else None
