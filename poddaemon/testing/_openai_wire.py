"""OpenAI wire formats for the fake model server: Chat Completions and Responses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from poddaemon.testing._plan import Event, EventKind, Plan, dumps

# ---------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
}


def error_body(status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    kind = err_type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


# ---------------------------------------------------------------- chat completions

_FINISH = {"end": "stop", "max_tokens": "length", "content_filter": "content_filter"}


def schema_refusal(body: Any) -> str | None:
    """OpenAI's 400 message for a request whose tools hold an array schema without `items`
    (it refuses the whole request: every call of a pod offering such a tool fails), or None.
    Chat's `tools[].function.parameters` and Responses' `tools[].parameters`."""
    tools = body.get("tools") if isinstance(body, dict) else None
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, dict):
            continue
        nested = tool.get("function")
        function: dict[str, Any] = nested if isinstance(nested, dict) else tool
        where = _bare_array(function.get("parameters"), ())
        if where is not None:
            name = function.get("name")
            return (
                f"Invalid schema for function '{name}': In context={where}, "
                "array schema missing items."
            )
    return None


def _bare_array(schema: Any, context: tuple[str, ...]) -> tuple[str, ...] | None:
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if (kind == "array" or (isinstance(kind, list) and "array" in kind)) and not (
        "items" in schema or "prefixItems" in schema
    ):
        return context
    subs: list[tuple[tuple[str, ...], Any]] = []
    for key in ("properties", "$defs", "definitions"):
        value = schema.get(key)
        if isinstance(value, dict):
            subs += [((*context, key, name), sub) for name, sub in value.items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        value = schema.get(key)
        if isinstance(value, list):
            subs += [((*context, key, str(i)), sub) for i, sub in enumerate(value)]
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            subs.append(((*context, key), schema[key]))
    for where, sub in subs:
        if (found := _bare_array(sub, where)) is not None:
            return found
    return None


def _finish_reason(plan: Plan) -> str:
    if plan.stop == "end" and plan.tool_calls:
        return "tool_calls"
    return _FINISH[plan.stop]


def _chat_usage(plan: Plan) -> dict[str, Any]:
    u = plan.usage
    prompt = u.prompt_total
    return {
        "prompt_tokens": prompt,
        "completion_tokens": u.output,
        "total_tokens": prompt + u.output,
        "prompt_tokens_details": {
            "cached_tokens": u.cache_read,
            "cache_write_tokens": u.cache_write,
        },
        "completion_tokens_details": {"reasoning_tokens": plan.reasoning_tokens},
    }


def chat_completion(plan: Plan) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": plan.text or None, "refusal": None}
    if plan.reasoning:
        message["reasoning_content"] = plan.reasoning
    if plan.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in plan.tool_calls
        ]
    return {
        "id": f"chatcmpl-{plan.serial}",
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _finish_reason(plan),
                "logprobs": None,
            }
        ],
        "usage": _chat_usage(plan),
    }


def chat_stream(plan: Plan) -> Iterator[Event]:
    head = (
        b'data: {"id":"chatcmpl-%d","object":"chat.completion.chunk","created":%d,"model":%s,'
        % (plan.serial, plan.created, dumps(plan.model))
    )

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return head + b'"choices":[' + dumps(choice) + b"]}\n\n"

    yield "pre", chunk({"role": "assistant", "content": ""})
    for piece in plan.chunks(plan.reasoning):
        yield "delta", chunk({"reasoning_content": piece})
    for piece in plan.chunks(plan.text):
        yield "delta", chunk({"content": piece})
    for index, call in enumerate(plan.tool_calls):
        start = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        yield "pre", chunk({"tool_calls": [start]})
        for piece in plan.chunks(call.arguments):
            yield (
                "delta",
                chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
            )
    yield "final", chunk({}, _finish_reason(plan))
    # Usage always comes, in its own choice-less chunk, as with stream_options.include_usage.
    yield "final", head + b'"choices":[],"usage":' + dumps(_chat_usage(plan)) + b"}\n\n"
    yield "final", b"data: [DONE]\n\n"


# ---------------------------------------------------------------- responses

_INCOMPLETE = {"max_tokens": "max_output_tokens", "content_filter": "content_filter"}


def _responses_usage(plan: Plan) -> dict[str, Any]:
    u = plan.usage
    prompt = u.prompt_total
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": u.cache_read,
            "cache_write_tokens": u.cache_write,
        },
        "output_tokens": u.output,
        "output_tokens_details": {"reasoning_tokens": plan.reasoning_tokens},
        "total_tokens": prompt + u.output,
    }


def _reasoning_item(plan: Plan, status: str) -> dict[str, Any]:
    summary = [{"type": "summary_text", "text": plan.reasoning}] if status == "completed" else []
    return {"id": f"rs_{plan.serial}", "type": "reasoning", "summary": summary, "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(plan: Plan, status: str) -> dict[str, Any]:
    content = [_text_part(plan.text)] if status != "in_progress" else []
    return {
        "id": f"msg_{plan.serial}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(plan: Plan, index: int, status: str) -> dict[str, Any]:
    call = plan.tool_calls[index]
    return {
        "id": f"fc_{plan.serial}_{index}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status != "in_progress" else "",
        "status": status,
    }


def _final_output(plan: Plan, item_status: str) -> list[dict[str, Any]]:
    output: list[dict[str, Any]] = []
    if plan.reasoning:
        output.append(_reasoning_item(plan, "completed"))
    if plan.text:
        output.append(_message_item(plan, item_status))
    output.extend(_call_item(plan, i, "completed") for i in range(len(plan.tool_calls)))
    return output


def _response(plan: Plan, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    done = status != "in_progress"
    incomplete = {"reason": _INCOMPLETE[plan.stop]} if status == "incomplete" else None
    return {
        "id": f"resp_{plan.serial}",
        "object": "response",
        "created_at": plan.created,
        "status": status,
        "model": plan.model,
        "output": output,
        "usage": _responses_usage(plan) if done else None,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": None,
        "top_p": None,
        "tool_choice": "auto",
        "tools": [],
        "completed_at": plan.created if status == "completed" else None,
    }


def _final_status(plan: Plan) -> str:
    return "completed" if plan.stop == "end" else "incomplete"


def response_object(plan: Plan) -> dict[str, Any]:
    status = _final_status(plan)
    return _response(plan, status, _final_output(plan, status))


def responses_stream(plan: Plan) -> Iterator[Event]:
    seq = 0

    def event(kind: EventKind, name: str, payload: dict[str, Any]) -> Event:
        nonlocal seq
        payload["type"] = name
        payload["sequence_number"] = seq
        seq += 1
        return kind, b"event: " + name.encode() + b"\ndata: " + dumps(payload) + b"\n\n"

    yield event("pre", "response.created", {"response": _response(plan, "in_progress", [])})
    yield event("pre", "response.in_progress", {"response": _response(plan, "in_progress", [])})
    status = _final_status(plan)
    index = 0
    if plan.reasoning:
        item_id = f"rs_{plan.serial}"
        at = {"item_id": item_id, "output_index": index}
        yield event(
            "pre",
            "response.output_item.added",
            {"output_index": index, "item": _reasoning_item(plan, "in_progress")},
        )
        part = {"type": "summary_text", "text": ""}
        yield event(
            "pre", "response.reasoning_summary_part.added", {**at, "summary_index": 0, "part": part}
        )
        for piece in plan.chunks(plan.reasoning):
            yield event(
                "delta",
                "response.reasoning_summary_text.delta",
                {**at, "summary_index": 0, "delta": piece},
            )
        yield event(
            "pre",
            "response.reasoning_summary_text.done",
            {**at, "summary_index": 0, "text": plan.reasoning},
        )
        part = {"type": "summary_text", "text": plan.reasoning}
        yield event(
            "pre", "response.reasoning_summary_part.done", {**at, "summary_index": 0, "part": part}
        )
        yield event(
            "pre",
            "response.output_item.done",
            {"output_index": index, "item": _reasoning_item(plan, "completed")},
        )
        index += 1
    if plan.text:
        at = {"item_id": f"msg_{plan.serial}", "output_index": index}
        yield event(
            "pre",
            "response.output_item.added",
            {"output_index": index, "item": _message_item(plan, "in_progress")},
        )
        yield event(
            "pre", "response.content_part.added", {**at, "content_index": 0, "part": _text_part("")}
        )
        for piece in plan.chunks(plan.text):
            yield event(
                "delta",
                "response.output_text.delta",
                {**at, "content_index": 0, "delta": piece, "logprobs": []},
            )
        yield event(
            "pre",
            "response.output_text.done",
            {**at, "content_index": 0, "text": plan.text, "logprobs": []},
        )
        yield event(
            "pre",
            "response.content_part.done",
            {**at, "content_index": 0, "part": _text_part(plan.text)},
        )
        yield event(
            "pre",
            "response.output_item.done",
            {"output_index": index, "item": _message_item(plan, status)},
        )
        index += 1
    for i, call in enumerate(plan.tool_calls):
        at = {"item_id": f"fc_{plan.serial}_{i}", "output_index": index}
        yield event(
            "pre",
            "response.output_item.added",
            {"output_index": index, "item": _call_item(plan, i, "in_progress")},
        )
        for piece in plan.chunks(call.arguments):
            yield event("delta", "response.function_call_arguments.delta", {**at, "delta": piece})
        yield event(
            "pre",
            "response.function_call_arguments.done",
            {**at, "name": call.name, "arguments": call.arguments},
        )
        yield event(
            "pre",
            "response.output_item.done",
            {"output_index": index, "item": _call_item(plan, i, "completed")},
        )
        index += 1
    final = _response(plan, status, _final_output(plan, status))
    yield event("final", f"response.{status}", {"response": final})
