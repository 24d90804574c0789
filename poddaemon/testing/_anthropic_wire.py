"""Anthropic Messages wire format for the fake model server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from poddaemon.testing._plan import Event, Plan, dumps

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}

_STOP = {"end": "end_turn", "max_tokens": "max_tokens", "content_filter": "refusal"}


def error_body(status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    kind = err_type or _ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _stop_reason(plan: Plan) -> str:
    if plan.stop == "end" and plan.tool_calls:
        return "tool_use"
    return _STOP[plan.stop]


def _usage(plan: Plan, output: int) -> dict[str, Any]:
    u = plan.usage
    return {
        "input_tokens": u.input,
        "cache_creation_input_tokens": u.cache_write,
        "cache_read_input_tokens": u.cache_read,
        "output_tokens": output,
    }


def _parsed_input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return {}


def message_object(plan: Plan) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if plan.reasoning:
        content.append(
            {"type": "thinking", "thinking": plan.reasoning, "signature": plan.signature}
        )
    if plan.text:
        content.append({"type": "text", "text": plan.text})
    content.extend(
        {"type": "tool_use", "id": c.id, "name": c.name, "input": _parsed_input(c.arguments)}
        for c in plan.tool_calls
    )
    return {
        "id": f"msg_{plan.serial}",
        "type": "message",
        "role": "assistant",
        "model": plan.model,
        "content": content,
        "stop_reason": _stop_reason(plan),
        "stop_sequence": None,
        "usage": _usage(plan, plan.usage.output),
    }


def _event(name: bytes, payload: dict[str, Any]) -> bytes:
    return b"event: " + name + b"\ndata: " + dumps(payload) + b"\n\n"


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return _event(
        b"content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def _start(index: int, block: dict[str, Any]) -> bytes:
    return _event(
        b"content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def _stop(index: int) -> bytes:
    return _event(b"content_block_stop", {"type": "content_block_stop", "index": index})


def messages_stream(plan: Plan) -> Iterator[Event]:
    start = message_object(plan)
    start.update(content=[], stop_reason=None, usage=_usage(plan, 1))
    yield "pre", _event(b"message_start", {"type": "message_start", "message": start})
    yield "pre", b'event: ping\ndata: {"type": "ping"}\n\n'
    index = 0
    if plan.reasoning:
        yield "pre", _start(index, {"type": "thinking", "thinking": "", "signature": ""})
        for piece in plan.chunks(plan.reasoning):
            yield "delta", _delta(index, {"type": "thinking_delta", "thinking": piece})
        yield "pre", _delta(index, {"type": "signature_delta", "signature": plan.signature})
        yield "pre", _stop(index)
        index += 1
    if plan.text:
        yield "pre", _start(index, {"type": "text", "text": ""})
        for piece in plan.chunks(plan.text):
            yield "delta", _delta(index, {"type": "text_delta", "text": piece})
        yield "pre", _stop(index)
        index += 1
    for call in plan.tool_calls:
        yield (
            "pre",
            _start(index, {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}),
        )
        for piece in plan.chunks(call.arguments):
            yield "delta", _delta(index, {"type": "input_json_delta", "partial_json": piece})
        yield "pre", _stop(index)
        index += 1
    delta = {"stop_reason": _stop_reason(plan), "stop_sequence": None}
    usage = _usage(plan, plan.usage.output)
    yield (
        "final",
        _event(b"message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
    )
    yield "final", b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
