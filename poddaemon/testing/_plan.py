"""Scripted replies for the fake model server: validation and the format-neutral plan.

A *reply* is the JSON object a test scripts; a *plan* is that reply resolved against one request
(default text, ids, usage, chunking) so each wire format only has to render it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Reply = dict[str, Any]
Stop = Literal["end", "max_tokens", "content_filter"]
EventKind = Literal["pre", "delta", "final"]
"""How the server treats a streamed event: `delta` events carry text, reasoning or tool
arguments and are what a `cut` fault counts; `final` events are the ones a cut never sends."""
Event = tuple[EventKind, bytes]

REPLY_KEYS = frozenset(
    {
        "text",
        "reasoning",
        "tool_calls",
        "stop",
        "usage",
        "gate",
        "fault",
        "delay",
        "stream",
        "content_type",
    }
)
USAGE_KEYS = frozenset({"input", "output", "cache_read", "cache_write"})
STOPS = frozenset({"end", "max_tokens", "content_filter"})
DEFAULT_PREFIX = "ok: "
DEFAULT_ECHO_CHARS = 200

_encode = msgspec.json.encode


def dumps(obj: object) -> bytes:
    """Compact JSON (msgspec: a few times faster than `json.dumps` on the hot path)."""
    return _encode(obj)


def validate_reply(reply: object) -> Reply:
    """Check one scripted reply; raise `ValueError` naming the bad field."""
    if not isinstance(reply, dict):
        raise ValueError(f"a reply must be an object, got {type(reply).__name__}")
    unknown = set(reply) - REPLY_KEYS
    if unknown:
        raise ValueError(f"unknown reply field(s) {sorted(unknown)}; allowed: {sorted(REPLY_KEYS)}")
    for key in ("text", "reasoning", "gate", "content_type"):
        if key in reply and not isinstance(reply[key], str):
            raise ValueError(f"reply.{key} must be a string")
    if "stream" in reply and not isinstance(reply["stream"], bool):
        raise ValueError("reply.stream must be true or false")
    if "stop" in reply and reply["stop"] not in STOPS:
        raise ValueError(f"reply.stop must be one of {sorted(STOPS)}, got {reply['stop']!r}")
    if "delay" in reply and (
        not isinstance(reply["delay"], int | float) or isinstance(reply["delay"], bool)
    ):
        raise ValueError("reply.delay must be a number of seconds")
    calls = reply.get("tool_calls", [])
    if not isinstance(calls, list):
        raise ValueError("reply.tool_calls must be a list")
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"reply.tool_calls[{i}] needs a string name")
        extra = set(call) - {"name", "arguments", "id"}
        if extra:
            raise ValueError(f"reply.tool_calls[{i}]: unknown field(s) {sorted(extra)}")
        if "id" in call and not isinstance(call["id"], str):
            raise ValueError(f"reply.tool_calls[{i}].id must be a string")
    usage = reply.get("usage", {})
    if not isinstance(usage, dict) or set(usage) - USAGE_KEYS:
        raise ValueError(f"reply.usage must be an object with keys among {sorted(USAGE_KEYS)}")
    for key, value in usage.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"reply.usage.{key} must be a non-negative integer")
    if "fault" in reply:
        _validate_fault(reply["fault"])
    return reply


def _validate_fault(fault: object) -> None:
    if not isinstance(fault, dict):
        raise ValueError("reply.fault must be an object")
    kind = fault.get("kind")
    allowed: set[str]
    if kind == "status":
        allowed = {"kind", "status", "retry_after", "message", "type", "body", "content_type"}
        for key in ("body", "content_type"):
            if key in fault and not isinstance(fault[key], str):
                raise ValueError(f"reply.fault.{key} must be a string")
        status = fault.get("status")
        if status == 200 and "body" in fault:  # a 200 whose body is no answer (an error object)
            pass
        elif not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(
                "reply.fault.status must be an HTTP error status (400-599), or 200 with a body"
            )
        if "retry_after" in fault and not isinstance(fault["retry_after"], int | float):
            raise ValueError("reply.fault.retry_after must be a number of seconds")
    elif kind == "hang":
        allowed = {"kind", "seconds", "headers"}
        if not isinstance(fault.get("seconds"), int | float):
            raise ValueError("reply.fault.seconds must be a number")
    elif kind == "cut":
        allowed = {"kind", "after_chunks", "finals"}
        for key, value in (
            ("after_chunks", fault.get("after_chunks")),
            ("finals", fault.get("finals", 0)),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"reply.fault.{key} must be a non-negative integer")
    else:
        raise ValueError(f"reply.fault.kind must be status, hang or cut, got {kind!r}")
    extra = set(fault) - allowed
    if extra:
        raise ValueError(f"reply.fault ({kind}): unknown field(s) {sorted(extra)}")


def _text_of(content: object, part_types: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") in part_types
            and isinstance(part.get("text"), str)
        ]
        return "\n".join(texts)
    return ""


def last_user_text(body: object) -> str:
    """The text of the last user message with any text, in any of the three request formats."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):  # chat completions and anthropic messages
        for msg in reversed(messages):
            if isinstance(msg, dict) and msg.get("role") == "user":
                text = _text_of(msg.get("content"), ("text", "input_text"))
                if text:
                    return text
        return ""
    items = body.get("input")  # responses
    if isinstance(items, str):
        return items
    if isinstance(items, list):
        for item in reversed(items):
            if (
                isinstance(item, dict)
                and item.get("role") == "user"
                and item.get("type", "message") == "message"
            ):
                text = _text_of(item.get("content"), ("input_text", "text"))
                if text:
                    return text
    return ""


@dataclass(slots=True)
class PlannedCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Usage:
    input: int
    output: int
    cache_read: int = 0
    cache_write: int = 0

    @property
    def prompt_total(self) -> int:
        """Input tokens the OpenAI way: cached and cache-written tokens included."""
        return self.input + self.cache_read + self.cache_write


@dataclass(slots=True)
class Plan:
    """One answer, resolved and ready to render in any wire format."""

    serial: int
    model: str
    text: str
    reasoning: str
    tool_calls: list[PlannedCall]
    stop: Stop
    usage: Usage
    chunk_size: int
    reasoning_tokens: int = 0
    created: int = 0
    signature: str = field(default="")

    def chunks(self, text: str) -> Iterator[str]:
        size = self.chunk_size
        for start in range(0, len(text), size):
            yield text[start : start + size]


def make_plan(
    reply: Reply | None,
    body: Any,
    body_len: int,
    serial: int,
    call_id_prefix: str,
    chunk_size: int,
    created: int,
) -> Plan:
    """Resolve a reply (None: the default echo) against the request it answers."""
    reply = reply or {}
    raw_calls = reply.get("tool_calls") or []
    calls: list[PlannedCall] = []
    for i, call in enumerate(raw_calls):
        args = call.get("arguments", {})
        arguments = args if isinstance(args, str) else dumps(args).decode()
        call_id = call.get("id") or f"{call_id_prefix}{serial}_{i}"
        calls.append(PlannedCall(id=call_id, name=call["name"], arguments=arguments))
    reasoning = reply.get("reasoning", "")
    if "text" in reply:
        text = reply["text"]
    elif calls or reasoning:
        text = ""
    else:
        text = DEFAULT_PREFIX + last_user_text(body)[:DEFAULT_ECHO_CHARS]
    given = reply.get("usage") or {}
    produced = len(text) + len(reasoning) + sum(len(c.arguments) + len(c.name) for c in calls)
    usage = Usage(
        input=given.get("input", max(1, body_len // 4)),
        output=given.get("output", max(1, produced // 4)),
        cache_read=given.get("cache_read", 0),
        cache_write=given.get("cache_write", 0),
    )
    model = body.get("model") if isinstance(body, dict) else None
    return Plan(
        serial=serial,
        model=model if isinstance(model, str) else "fake-model",
        text=text,
        reasoning=reasoning,
        tool_calls=calls,
        stop=reply.get("stop", "end"),
        usage=usage,
        chunk_size=chunk_size,
        reasoning_tokens=min(usage.output, len(reasoning) // 4),
        created=created,
        signature=f"fake-signature-{serial}" if reasoning else "",
    )
