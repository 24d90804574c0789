"""Pure rendering of ModelRequest into the three wire formats, and the stop/usage helpers."""

import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from poddaemon.history import (
    AssistantMessage,
    Item,
    SystemNote,
    ToolCall,
    ToolResult,
    Usage,
    UserMessage,
)
from poddaemon.llm import (
    CredentialsError,
    assembled,
    check_credentials,
    make_client,
    map_stop,
    order_items,
    raise_error_body,
    text_field,
    unique_ids,
)
from poddaemon.llm import anthropic as anth
from poddaemon.llm import openai_chat as chat
from poddaemon.llm import openai_responses as resp
from poddaemon.llm.types import ModelRequest, ProviderError, ToolSpec

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [ToolSpec(name="read_file", description="Read a file", parameters=SCHEMA)]

# A history with a parallel batch whose results have a notification committed between them,
# an assistant message carrying reasoning, an error result and a call without arguments.
HISTORY: list[Item] = [
    UserMessage(text="look at a and b"),
    AssistantMessage(
        text="Reading both.",
        reasoning="secret thoughts",
        tool_calls=(
            ToolCall(id="c1", name="read_file", arguments='{"path": "a"}'),
            ToolCall(id="c2", name="read_file", arguments='{"path": "b"}'),
        ),
    ),
    ToolResult(call_id="c1", name="read_file", output="A"),
    SystemNote(text="child x finished"),
    ToolResult(call_id="c2", name="read_file", output="no such file", is_error=True),
    AssistantMessage(
        reasoning="more thoughts", tool_calls=(ToolCall(id="c3", name="now", arguments="{}"),)
    ),
    ToolResult(call_id="c3", name="now", output="noon"),
    AssistantMessage(text="Done."),
    UserMessage(text="thanks"),
]


def request(items: list[Item] | None = None, **kw: Any) -> ModelRequest:
    return ModelRequest(
        system=kw.pop("system", "be brief"),
        items=HISTORY if items is None else items,
        tools=kw.pop("tools", TOOLS),
        max_tokens=kw.pop("max_tokens", 1000),
        **kw,
    )


# ---------------------------------------------------------------------------------------------
# order_items


def test_order_items_moves_notes_after_the_batch() -> None:
    kinds = [type(i).__name__ + ":" + getattr(i, "call_id", "") for i in order_items(HISTORY)]
    assert kinds[2:6] == [
        "ToolResult:c1",
        "ToolResult:c2",
        "SystemNote:",
        "AssistantMessage:",
    ]


def test_order_items_keeps_order_without_tool_calls() -> None:
    items: list[Item] = [UserMessage(text="a"), SystemNote(text="b"), AssistantMessage(text="c")]
    assert order_items(items) == items


def test_order_items_flushes_notes_of_an_unanswered_batch() -> None:
    items: list[Item] = [
        AssistantMessage(tool_calls=(ToolCall(id="x", name="t", arguments="{}"),)),
        SystemNote(text="note"),
    ]
    assert order_items(items) == items


# ---------------------------------------------------------------------------------------------
# Anthropic


def test_anthropic_request_shape() -> None:
    body = anth.render_request(request(temperature=0.2), "claude-x")
    assert body["model"] == "claude-x"
    assert body["system"] == "be brief"
    assert body["max_tokens"] == 1000
    assert body["temperature"] == 0.2
    assert body["stream"] is True
    assert body["tools"] == [
        {"name": "read_file", "description": "Read a file", "input_schema": SCHEMA}
    ]


def test_anthropic_optional_fields_omitted() -> None:
    body = anth.render_request(request([UserMessage(text="hi")], system="", tools=[]), "m")
    assert "system" not in body and "tools" not in body and "temperature" not in body
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_anthropic_messages() -> None:
    msgs = anth.render_messages(request())
    roles = ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert [m["role"] for m in msgs] == roles
    assert msgs[1]["content"] == [
        {"type": "text", "text": "Reading both."},
        {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a"}},
        {"type": "tool_use", "id": "c2", "name": "read_file", "input": {"path": "b"}},
    ]
    # Both results first, in one user message, then the note that arrived between them.
    assert msgs[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "c1", "content": "A"},
        {"type": "tool_result", "tool_use_id": "c2", "content": "no such file", "is_error": True},
        {"type": "text", "text": "child x finished"},
    ]
    assert msgs[3]["content"] == [{"type": "tool_use", "id": "c3", "name": "now", "input": {}}]
    # Consecutive user-role items merge into one message, results first.
    assert msgs[4]["content"] == [{"type": "tool_result", "tool_use_id": "c3", "content": "noon"}]
    assert msgs[6]["content"] == [{"type": "text", "text": "thanks"}]
    assert "thoughts" not in json.dumps(msgs)


def test_anthropic_merges_user_role_items_and_skips_empty_assistant() -> None:
    items: list[Item] = [
        UserMessage(text="a"),
        AssistantMessage(reasoning="only thinking"),
        SystemNote(text="b"),
        UserMessage(text="c"),
    ]
    assert anth.render_messages(request(items)) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b"},
                {"type": "text", "text": "c"},
            ],
        }
    ]


def test_anthropic_malformed_arguments_stay_visible() -> None:
    items: list[Item] = [
        AssistantMessage(tool_calls=(ToolCall(id="c", name="t", arguments="{oops"),)),
        ToolResult(call_id="c", name="t", output="", is_error=True),
    ]
    msgs = anth.render_messages(request(items))
    assert msgs[0]["content"][0]["input"] == {"_raw_arguments": "{oops"}
    assert msgs[1]["content"][0]["content"] == "(no output)"


@pytest.mark.parametrize(
    ("raw", "sent"),
    [
        ('{"path":  "a"}', '{"path":  "a"}'),  # an object: its exact text (prompt caching)
        ("{oops", '{"_raw_arguments":"{oops"}'),
        ("[1, 2]", '{"_raw_arguments":"[1, 2]"}'),  # JSON, but not an object
        ("", "{}"),
        ("[" * 100_000, json.dumps({"_raw_arguments": "[" * 100_000}, separators=(",", ":"))),
    ],
)
def test_openai_kinds_send_back_arguments_that_parse_to_an_object(raw: str, sent: str) -> None:
    """OpenAI-compatible servers that parse the arguments (Ollama, llama.cpp) refuse a request
    with malformed ones: a model that emitted them once would wedge its whole session."""
    items: list[Item] = [
        AssistantMessage(tool_calls=(ToolCall(id="c", name="t", arguments=raw),)),
        ToolResult(call_id="c", name="t", output="bad arguments", is_error=True),
    ]
    msgs = chat.render_messages(request(items))
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == sent
    (call,) = [i for i in resp.render_input(request(items)) if i["type"] == "function_call"]
    assert call["arguments"] == sent
    assert isinstance(json.loads(sent), dict)


def test_anthropic_usage_as_reported() -> None:
    usage = anth.usage_from(
        {
            "input_tokens": 10,
            "output_tokens": 1,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 5,
        }
    )
    assert usage == Usage(input=10, output=1, cache_read=100, cache_write=5)
    # message_delta carries cumulative output (and sometimes input) counts.
    anth.usage_from(SimpleNamespace(output_tokens=42, input_tokens=None), usage)
    assert usage == Usage(input=10, output=42, cache_read=100, cache_write=5)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (None, None),
        ("http://127.0.0.1:9", "http://127.0.0.1:9"),
        ("http://127.0.0.1:9/v1", "http://127.0.0.1:9"),
        ("http://127.0.0.1:9/v1/", "http://127.0.0.1:9"),
        ("https://proxy/anthropic/", "https://proxy/anthropic"),
    ],
)
def test_anthropic_base_url(url: str | None, expected: str | None) -> None:
    assert anth.normalize_base_url(url) == expected


# ---------------------------------------------------------------------------------------------
# Chat Completions


def test_chat_request_shape() -> None:
    body = chat.render_request(request(temperature=0.0), "gpt-x")
    assert body["model"] == "gpt-x"
    assert body["max_completion_tokens"] == 1000
    assert body["temperature"] == 0.0
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "read_file", "description": "Read a file", "parameters": SCHEMA},
        }
    ]
    compat = chat.render_request(request(), "m", max_tokens_field="max_tokens")
    assert compat["max_tokens"] == 1000 and "max_completion_tokens" not in compat


def test_chat_messages() -> None:
    msgs = chat.render_messages(request())
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "look at a and b"}
    assert msgs[2] == {
        "role": "assistant",
        "content": "Reading both.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "a"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "b"}'},
            },
        ],
    }
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "A"}
    assert msgs[4] == {"role": "tool", "tool_call_id": "c2", "content": "[tool error] no such file"}
    assert msgs[5] == {"role": "user", "content": "child x finished"}
    assert msgs[6]["content"] is None and msgs[6]["tool_calls"][0]["id"] == "c3"
    assert msgs[7] == {"role": "tool", "tool_call_id": "c3", "content": "noon"}
    assert msgs[8] == {"role": "assistant", "content": "Done."}
    assert msgs[9] == {"role": "user", "content": "thanks"}
    assert len(msgs) == 10
    assert "thoughts" not in json.dumps(msgs)


def test_chat_usage_cached_tokens() -> None:
    raw = SimpleNamespace(
        prompt_tokens=120,
        completion_tokens=7,
        prompt_tokens_details=SimpleNamespace(cached_tokens=100, cache_write_tokens=None),
    )
    assert chat.usage_from(raw) == Usage(input=120, output=7, cache_read=100, cache_write=0)
    assert chat.usage_from({"prompt_tokens": 3, "completion_tokens": 4}) == Usage(input=3, output=4)


# ---------------------------------------------------------------------------------------------
# Responses


def test_responses_request_shape() -> None:
    body = resp.render_request(request(), "gpt-r")
    assert body["model"] == "gpt-r"
    assert body["instructions"] == "be brief"
    assert body["store"] is False
    assert body["stream"] is True
    assert body["max_output_tokens"] == 1000
    assert "temperature" not in body
    assert body["tools"] == [
        {
            "type": "function",
            "name": "read_file",
            "description": "Read a file",
            "parameters": SCHEMA,
            "strict": False,
        }
    ]
    assert "instructions" not in resp.render_request(request(system=""), "m")


def test_responses_input() -> None:
    items = resp.render_input(request())
    assert [i["type"] for i in items] == [
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "message",
        "function_call",
        "function_call_output",
        "message",
        "message",
    ]
    assert items[0] == {"type": "message", "role": "user", "content": "look at a and b"}
    assert items[1] == {"type": "message", "role": "assistant", "content": "Reading both."}
    assert items[2] == {
        "type": "function_call",
        "call_id": "c1",
        "name": "read_file",
        "arguments": '{"path": "a"}',
    }
    assert items[5] == {
        "type": "function_call_output",
        "call_id": "c2",
        "output": "[tool error] no such file",
    }
    assert items[6] == {"type": "message", "role": "user", "content": "child x finished"}
    assert "thoughts" not in json.dumps(items)


def test_responses_usage_and_stop() -> None:
    raw = {"input_tokens": 50, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 40}}
    assert resp.usage_from(raw) == Usage(input=50, output=5, cache_read=40)
    assert resp.stop_from({"status": "completed"}, False) == ("end_turn", "")
    assert resp.stop_from({"status": "completed"}, True) == ("tool_use", "")
    incomplete = {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    assert resp.stop_from(incomplete, False) == ("max_tokens", "")
    filtered = {"status": "incomplete", "incomplete_details": {"reason": "content_filter"}}
    assert resp.stop_from(filtered, False) == ("content_filter", "")
    assert resp.stop_from({"status": "cancelled"}, False) == ("other", "response status: cancelled")


# ---------------------------------------------------------------------------------------------
# Shared helpers


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("end_turn", "end_turn"),
        ("stop", "end_turn"),
        ("stop_sequence", "end_turn"),
        ("tool_use", "tool_use"),
        ("tool_calls", "tool_use"),
        ("max_tokens", "max_tokens"),
        ("length", "max_tokens"),
        ("max_output_tokens", "max_tokens"),
        ("content_filter", "content_filter"),
        ("refusal", "content_filter"),
        ("model_context_window_exceeded", "context_overflow"),
    ],
)
def test_map_stop(raw: str, expected: str) -> None:
    assert map_stop(raw) == (expected, "")


def test_map_stop_unknown_and_tool_calls() -> None:
    assert map_stop("pause_turn") == ("other", "stop reason: pause_turn")
    assert map_stop(None) == ("other", "no stop reason given")
    assert map_stop("stop", has_tool_calls=True) == ("tool_use", "")
    assert map_stop("length", has_tool_calls=True) == ("max_tokens", "")


# ---------------------------------------------------------------------------------------------
# make_client / check_credentials


class Cfg:
    def __init__(self, kind: str, api_key_env: str | None = None) -> None:
        self.kind = kind
        self.model = "m"
        self.base_url: str | None = None
        self.api_key_env = api_key_env
        self.max_retries = 4
        self.connect_timeout = 10.0
        self.first_byte_timeout = 120.0
        self.stream_idle_timeout = 120.0
        self.retry_initial_delay = 0.5
        self.retry_max_delay = 30.0
        self.retry_total_timeout = 300.0


@pytest.mark.parametrize(
    ("kind", "var"),
    [
        ("anthropic", "ANTHROPIC_API_KEY"),
        ("openai", "OPENAI_API_KEY"),
        ("openai_responses", "OPENAI_API_KEY"),
    ],
)
def test_check_credentials_default_vars(kind: str, var: str) -> None:
    with pytest.raises(CredentialsError) as info:
        check_credentials(Cfg(kind), environ={})
    assert str(info.value) == f"provider.api_key_env: environment variable {var} is not set"
    assert isinstance(info.value, ValueError)
    check_credentials(Cfg(kind), environ={var: "k"})
    with pytest.raises(CredentialsError):
        check_credentials(Cfg(kind), environ={var: ""})


def test_check_credentials_override() -> None:
    with pytest.raises(CredentialsError, match="MY_KEY"):
        check_credentials(Cfg("anthropic", "MY_KEY"), environ={"ANTHROPIC_API_KEY": "k"})
    check_credentials(Cfg("anthropic", "MY_KEY"), environ={"MY_KEY": "k"})


def test_make_client_imports_no_sdk() -> None:
    before = {m for m in ("openai", "anthropic") if m in sys.modules}
    clients = [make_client(Cfg(k)) for k in ("anthropic", "openai", "openai_responses")]
    assert [type(c).__name__ for c in clients] == [
        "AnthropicClient",
        "OpenAIChatClient",
        "OpenAIResponsesClient",
    ]
    assert {m for m in ("openai", "anthropic") if m in sys.modules} == before
    with pytest.raises(ValueError, match="unknown provider kind"):
        make_client(Cfg("gemini"))


def test_chat_max_tokens_field_by_base_url() -> None:
    from poddaemon.llm.openai_chat import OpenAIChatClient

    official = Cfg("openai")
    compatible = Cfg("openai")
    compatible.base_url = "http://127.0.0.1:8000/v1"
    assert OpenAIChatClient(official)._max_tokens_field == "max_completion_tokens"
    assert OpenAIChatClient(compatible)._max_tokens_field == "max_tokens"


def test_a_call_id_repeated_in_one_response_is_made_unique() -> None:
    def calls(*ids: str) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(id=i, name="read_file", arguments="{}") for i in ids)

    unique = calls("a", "b")
    assert unique_ids(unique) is unique  # the usual case: untouched
    renamed = unique_ids(calls("x", "x", "x_2", "x"))
    assert [c.id for c in renamed] == ["x", "x_3", "x_2", "x_4"]  # never an id already there
    stop = map_stop("tool_calls", True)
    response = assembled([], [], calls("dup", "dup"), stop, Usage())
    assert [c.id for c in response.message.tool_calls] == ["dup", "dup_2"]


def test_a_field_that_must_be_text_comes_as_text_whatever_the_server_sent() -> None:
    """`"name": 5, "arguments": 7` ended the run with a TypeError when the pieces were joined:
    as JSON text, the call is refused in words the model reads (unknown tool, not an object)."""
    fn = {"name": 5, "arguments": 7, "id": "c1"}
    assert (text_field(fn, "name"), text_field(fn, "arguments"), text_field(fn, "id")) == (
        "5",
        "7",
        "c1",
    )
    assert text_field(SimpleNamespace(arguments={"a": 1}), "arguments") == '{"a":1}'
    assert text_field({}, "name") == "" and text_field({"name": None}, "name", "x") == "x"


def test_an_anthropic_answer_sent_whole_becomes_its_stream_events() -> None:
    message = {
        "type": "message",
        "content": [
            {"type": "thinking", "thinking": "hmm"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "tu_1", "name": "grep", "input": {"pattern": "x"}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 9, "output_tokens": 4},
    }
    events = list(anth.message_events(message))
    assert [e["type"] for e in events] == [
        "message_start",
        *["content_block_start"] * 3,
        "content_block_delta",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"] == message["usage"]
    assert json.loads(events[4]["delta"]["partial_json"]) == {"pattern": "x"}
    assert events[5]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("body", "kind", "said"),
    [
        (
            {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
            "transient",
            "busy",
        ),
        (
            {"error": {"message": "upstream exploded", "type": "server_error"}},
            "transient",
            "upstream exploded",
        ),
        ({"error": {"message": "bad key", "code": "invalid_api_key"}}, "auth", "bad key"),
        ({"error": "model 'x' not found"}, "fatal", "model 'x' not found"),
    ],
)
def test_an_error_sent_whole_with_200_fails_the_call_as_a_stream_error(
    body: dict[str, Any], kind: str, said: str
) -> None:
    with pytest.raises(ProviderError) as raised:
        raise_error_body(body)
    assert raised.value.kind == kind and said in str(raised.value)


def test_an_answer_that_carries_an_error_field_is_an_answer() -> None:
    raise_error_body({"object": "response", "output": [], "error": None, "status": "completed"})
    raise_error_body({"choices": [], "error": {"message": "partial"}})  # the choices decide


def test_a_responses_answer_sent_whole_becomes_its_stream_events() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "grep", "arguments": "{}"}
    response = {
        "status": "incomplete",
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
            {"type": "message", "content": [{"type": "output_text", "text": "Hi."}]},
            call,
        ],
    }
    events = list(resp.response_events(response))
    assert [(e["type"], e.get("delta")) for e in events] == [
        ("response.reasoning_text.delta", "hmm"),
        ("response.output_text.delta", "Hi."),
        ("response.output_item.done", None),
        ("response.incomplete", None),
    ]
    assert events[2]["item"] is call and events[2]["output_index"] == 2
    assert list(resp.response_events({"output": "junk"})) == [
        {"type": "response.completed", "response": {"output": "junk"}}
    ]
