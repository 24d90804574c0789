"""The real openai/anthropic SDKs, through our adapters, against the local fake model server."""

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from poddaemon.config.manifest import ProviderConfig
from poddaemon.history import ToolResult, Usage, UserMessage
from poddaemon.llm import make_client
from poddaemon.llm.types import (
    ModelClient,
    ModelRequest,
    ModelResponse,
    ProviderError,
    ReasoningDelta,
    RetryScheduled,
    StreamEvent,
    TextDelta,
    ToolSpec,
)
from poddaemon.testing.fake_model import FakeModel

KINDS = ["anthropic", "openai", "openai_responses"]
KEY_VAR = "PODDAEMON_TEST_FAKE_KEY"
LONG_TEXT = "The quick brown fox jumps over the lazy dog, again and again and again."
TOOLS = [
    ToolSpec(
        name="read_file",
        description="Read a file",
        parameters={"type": "object", "properties": {"path": {"type": "string"}}},
    ),
    ToolSpec(name="now", description="The time", parameters={"type": "object"}),
]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModel]:
    with FakeModel() as server:
        yield server


@pytest.fixture(autouse=True)
def _fresh(fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.reset()
    monkeypatch.setenv(KEY_VAR, "sk-fake")


def config(fake: FakeModel, kind: str, **overrides: Any) -> ProviderConfig:
    settings: dict[str, Any] = {
        "kind": kind,
        "model": "fake-1",
        "base_url": fake.url if kind == "anthropic" else fake.openai_base_url,
        "api_key_env": KEY_VAR,
        "max_retries": 3,
        "connect_timeout": 2.0,
        "first_byte_timeout": 5.0,
        "stream_idle_timeout": 5.0,
        "retry_initial_delay": 0.001,
        "retry_max_delay": 0.01,
        "retry_total_timeout": 10.0,
    }
    settings.update(overrides)
    return ProviderConfig(**settings)


def request(text: str = "hello") -> ModelRequest:
    return ModelRequest(
        system="You are terse.",
        items=[UserMessage(text=text)],
        tools=TOOLS,
        max_tokens=256,
        temperature=0.5,
    )


async def run(
    client: ModelClient, req: ModelRequest | None = None
) -> tuple[list[StreamEvent], ProviderError | None]:
    events: list[StreamEvent] = []
    stream: AsyncIterator[StreamEvent] = client.stream(req or request())
    try:
        async for event in stream:
            events.append(event)
    except ProviderError as exc:
        return events, exc
    finally:
        await client.aclose()
    return events, None


def final(events: list[StreamEvent]) -> ModelResponse:
    assert isinstance(events[-1], ModelResponse), events
    assert sum(isinstance(e, ModelResponse) for e in events) == 1
    return events[-1]


def texts(events: list[StreamEvent], kind: type[TextDelta] | type[ReasoningDelta]) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


# ---------------------------------------------------------------------------------------------
# Happy paths


@pytest.mark.parametrize("kind", KINDS)
async def test_text_and_usage(fake: FakeModel, kind: str) -> None:
    fake.script(
        {"text": LONG_TEXT, "usage": {"input": 10, "output": 7, "cache_read": 30, "cache_write": 4}}
    )
    client = make_client(config(fake, kind))
    await client.warm()
    events, err = await run(client)
    assert err is None
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 1  # streamed, not one blob
    response = final(events)
    assert response.message.text == LONG_TEXT == texts(events, TextDelta)
    assert response.message.tool_calls == ()
    assert (response.stop, response.detail) == ("end_turn", "")
    if kind == "anthropic":  # input excludes cached tokens, as Anthropic reports it
        assert response.usage == Usage(input=10, output=7, cache_read=30, cache_write=4)
    else:  # OpenAI's input includes them
        assert response.usage == Usage(input=44, output=7, cache_read=30, cache_write=4)

    (sent,) = fake.requests
    body = sent["body"]
    assert body["stream"] is True and body["model"] == "fake-1"
    assert body["temperature"] == 0.5
    if kind == "anthropic":
        assert sent["path"] == "/v1/messages"
        assert body["system"] == "You are terse." and body["max_tokens"] == 256
        assert body["tools"][0]["input_schema"]["type"] == "object"
    elif kind == "openai":
        assert sent["path"] == "/v1/chat/completions"
        assert body["stream_options"] == {"include_usage": True}
        assert body["messages"][0] == {"role": "system", "content": "You are terse."}
        assert body["max_tokens"] == 256  # a compatible server (base_url set)
    else:
        assert sent["path"] == "/v1/responses"
        assert body["instructions"] == "You are terse." and body["store"] is False
        assert body["max_output_tokens"] == 256


async def test_anthropic_base_url_with_v1_is_tolerated(fake: FakeModel) -> None:
    fake.script({"text": "hi"})
    cfg = config(fake, "anthropic", base_url=fake.url + "/v1/")
    events, err = await run(make_client(cfg))
    assert err is None and final(events).message.text == "hi"
    assert fake.requests[0]["path"] == "/v1/messages"


@pytest.mark.parametrize("kind", KINDS)
async def test_parallel_tool_calls(fake: FakeModel, kind: str) -> None:
    fake.script(
        {
            "text": "Let me look.",
            "tool_calls": [
                {"name": "read_file", "arguments": {"path": "a/long/path/to/some/file.txt"}},
                {"name": "read_file", "arguments": {"path": "b.txt"}},
                {"name": "now", "arguments": {}},
            ],
        }
    )
    events, err = await run(make_client(config(fake, kind)))
    assert err is None
    response = final(events)
    assert response.stop == "tool_use"
    assert response.message.text == "Let me look."
    calls = response.message.tool_calls
    assert [c.name for c in calls] == ["read_file", "read_file", "now"]
    assert len({c.id for c in calls}) == 3 and all(c.id for c in calls)
    assert calls[0].arguments.replace(" ", "") == '{"path":"a/long/path/to/some/file.txt"}'
    assert calls[1].arguments.replace(" ", "") == '{"path":"b.txt"}'
    assert calls[2].arguments == "{}"

    # The history with the calls and their results goes back out and is accepted.
    fake.script({"text": "done"})
    follow = ModelRequest(
        system="",
        items=[
            UserMessage(text="hello"),
            response.message,
            *[ToolResult(call_id=c.id, name=c.name, output="x") for c in calls],
        ],
        tools=TOOLS,
        max_tokens=64,
    )
    events, err = await run(make_client(config(fake, kind)), follow)
    assert err is None and final(events).message.text == "done"


@pytest.mark.parametrize("kind", KINDS)
async def test_reasoning_deltas(fake: FakeModel, kind: str) -> None:
    thought = "First think about the question carefully, then answer it."
    fake.script({"reasoning": thought, "text": "42"})
    events, err = await run(make_client(config(fake, kind)))
    assert err is None
    assert texts(events, ReasoningDelta) == thought
    first_text = next(i for i, e in enumerate(events) if isinstance(e, TextDelta))
    assert all(not isinstance(e, ReasoningDelta) for e in events[first_text:])
    response = final(events)
    assert response.message.reasoning == thought and response.message.text == "42"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("stop", "expected"), [("max_tokens", "max_tokens"), ("content_filter", "content_filter")]
)
async def test_stop_mapping(fake: FakeModel, kind: str, stop: str, expected: str) -> None:
    fake.script({"text": "partial answer", "stop": stop})
    events, err = await run(make_client(config(fake, kind)))
    assert err is None
    assert final(events).stop == expected


# ---------------------------------------------------------------------------------------------
# Failures and retries


@pytest.mark.parametrize("kind", KINDS)
async def test_429_then_success(fake: FakeModel, kind: str) -> None:
    fake.script(
        {"fault": {"kind": "status", "status": 429, "retry_after": 0.01}},
        {"text": "after the wait"},
    )
    events, err = await run(make_client(config(fake, kind, retry_max_delay=1.0)))
    assert err is None
    retry = events[0]
    assert isinstance(retry, RetryScheduled)
    assert (retry.attempt, retry.delay) == (1, 0.01)  # the server's Retry-After
    assert "HTTP 429" in retry.error
    assert final(events).message.text == "after the wait"
    assert len(fake.requests) == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_500_until_the_cap(fake: FakeModel, kind: str) -> None:
    fake.script(*[{"fault": {"kind": "status", "status": 500}}] * 5)
    events, err = await run(make_client(config(fake, kind, max_retries=2)))
    assert [e.attempt for e in events if isinstance(e, RetryScheduled)] == [1, 2]
    assert len(events) == 2
    assert err is not None and err.kind == "transient" and err.status == 500
    assert err.message.startswith("provider failed after 3 attempts: HTTP 500")
    assert len(fake.requests) == 3


@pytest.mark.parametrize("kind", KINDS)
async def test_auth_and_context_overflow_are_not_retried(fake: FakeModel, kind: str) -> None:
    fake.script({"fault": {"kind": "status", "status": 401, "message": "bad key"}})
    events, err = await run(make_client(config(fake, kind)))
    assert events == [] and err is not None and (err.kind, err.status) == ("auth", 401)
    too_long = "prompt is too long: 250000 tokens > 200000 maximum"
    fake.script({"fault": {"kind": "status", "status": 400, "message": too_long}})
    events, err = await run(make_client(config(fake, kind)))
    assert events == [] and err is not None and err.kind == "context_overflow"
    assert too_long in err.message
    assert len(fake.requests) == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_cut_stream_after_output_is_interrupted(fake: FakeModel, kind: str) -> None:
    fake.script({"text": LONG_TEXT, "fault": {"kind": "cut", "after_chunks": 2}}, {"text": "no"})
    events, err = await run(make_client(config(fake, kind)))
    assert err is not None and err.kind == "interrupted"
    assert all(isinstance(e, TextDelta) for e in events)
    assert len(events) == 2
    assert texts(events, TextDelta) == LONG_TEXT[:40]  # nothing repeated, nothing retried
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    ("kind", "finals", "usage"),
    [
        ("openai", 1, Usage()),  # the finish_reason chunk came; its usage chunk did not
        ("openai", 2, Usage(input=30, output=7)),  # all but [DONE]
        ("anthropic", 1, Usage(input=30, output=7)),  # message_delta came, message_stop did not
        ("openai_responses", 1, Usage(input=30, output=7)),  # response.completed, then the cut
    ],
)
async def test_cut_stream_after_the_stop_reason_keeps_the_answer(
    fake: FakeModel, kind: str, finals: int, usage: Usage
) -> None:
    """The answer is complete once the stop reason came: a connection dropped before the
    stream's terminator loses no answer and calls the model no second time."""
    cut = {"kind": "cut", "after_chunks": 1000, "finals": finals}
    fake.script({"text": LONG_TEXT, "usage": {"input": 30, "output": 7}, "fault": cut})
    events, err = await run(make_client(config(fake, kind)))
    assert err is None
    response = final(events)
    assert response.message.text == LONG_TEXT == texts(events, TextDelta)
    assert (response.stop, response.usage) == ("end_turn", usage)
    assert len(fake.requests) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_a_server_that_ignores_stream_true_is_read_whole(fake: FakeModel, kind: str) -> None:
    """Some compatible servers answer a streaming request with one JSON body: the answer is
    read from it (one delta of its whole text), not retried as a stream that never came."""
    call = {"id": "call_9", "name": "read_file", "arguments": {"path": "a.txt"}}
    usage = {"input": 30, "output": 7}
    fake.script(
        {"text": LONG_TEXT, "reasoning": "hmm", "usage": usage, "stream": False},
        {"tool_calls": [call], "stream": False},
    )
    events, err = await run(make_client(config(fake, kind)))
    assert err is None
    assert events[:-1] == [ReasoningDelta("hmm"), TextDelta(LONG_TEXT)]
    response = final(events)
    assert response.message.text == LONG_TEXT and response.message.reasoning == "hmm"
    assert (response.stop, response.usage) == ("end_turn", Usage(input=30, output=7))
    events, err = await run(make_client(config(fake, kind)))
    assert err is None
    (tool_call,) = final(events).message.tool_calls
    assert (tool_call.id, tool_call.name, json.loads(tool_call.arguments)) == (
        "call_9",
        "read_file",
        {"path": "a.txt"},
    )
    assert final(events).stop == "tool_use"
    assert len(fake.requests) == 2 and all(r["body"]["stream"] for r in fake.requests)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_error_object_sent_with_200_fails_the_call_with_its_message(
    fake: FakeModel, kind: str
) -> None:
    """A proxy that answers 200 with an error object: the call fails with the server's words
    (openai_responses took it for an empty answer, chat retried a 'stream without a
    finish_reason')."""
    body = json.dumps({"error": {"message": "model 'nope' not found", "type": "invalid_request"}})
    fault = {"kind": "status", "status": 200, "body": body, "content_type": "application/json"}
    fake.script({"fault": fault})
    _, err = await run(make_client(config(fake, kind)))
    assert isinstance(err, ProviderError) and err.kind == "fatal", err
    assert "model 'nope' not found" in str(err)
    assert len(fake.requests) == 1  # not retried: it would say the same


async def test_a_chat_event_stream_labelled_json_is_still_read_as_events(fake: FakeModel) -> None:
    fake.script({"text": LONG_TEXT, "content_type": "application/json"})
    events, err = await run(make_client(config(fake, "openai")))
    assert err is None
    assert final(events).message.text == LONG_TEXT == texts(events, TextDelta)
    assert len(fake.requests) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_cut_stream_before_output_is_retried(fake: FakeModel, kind: str) -> None:
    fake.script({"text": LONG_TEXT, "fault": {"kind": "cut", "after_chunks": 0}}, {"text": "ok"})
    events, err = await run(make_client(config(fake, kind)))
    assert err is None
    assert isinstance(events[0], RetryScheduled)
    assert final(events).message.text == "ok" == texts(events, TextDelta)


@pytest.mark.parametrize("kind", KINDS)
async def test_hang_before_first_byte(fake: FakeModel, kind: str) -> None:
    fake.script(*[{"fault": {"kind": "hang", "seconds": 5}}] * 2)
    cfg = config(fake, kind, first_byte_timeout=0.2, max_retries=1)
    events, err = await run(make_client(cfg))
    assert [type(e) for e in events] == [RetryScheduled]
    assert err is not None and err.kind == "transient"
    assert "after 2 attempts" in err.message and "within 0.2s" in err.message


@pytest.mark.parametrize("kind", KINDS)
async def test_stall_after_output(fake: FakeModel, kind: str) -> None:
    fake.script({"text": LONG_TEXT, "delay": 5})
    events, err = await run(make_client(config(fake, kind, stream_idle_timeout=0.2)))
    assert events == [TextDelta(LONG_TEXT[:20])]
    assert err is not None and err.kind == "stalled"
    assert len(fake.requests) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_tool_arguments_streaming_slowly_after_text_are_no_stall(
    fake: FakeModel, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After some text, a tool call's arguments arrive piece by piece, each within the idle
    timeout, the whole taking longer than it: the answer moves on, so no `stalled` (a slow
    model writing a file through write_file was cut off when only deltas counted)."""
    monkeypatch.setattr(fake, "chunk_size", 8)
    path = "p" * 40  # arguments of ~50 characters: several pieces 0.1 s apart
    call = {"name": "list_dir", "arguments": {"path": path}}
    fake.script({"text": "Writing.", "tool_calls": [call], "delay": 0.1})
    events, err = await run(make_client(config(fake, kind, stream_idle_timeout=0.25)))
    assert err is None, err
    assert json.loads(final(events).message.tool_calls[0].arguments) == {"path": path}


@pytest.mark.parametrize("kind", KINDS)
async def test_missing_key_is_an_auth_error(
    fake: FakeModel, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_VAR)
    events, err = await run(make_client(config(fake, kind)))
    assert events == [] and err is not None and err.kind == "auth"
    assert KEY_VAR in err.message
    assert fake.requests == []


@pytest.mark.parametrize("kind", KINDS)
async def test_consumer_stopping_early_closes_the_stream(fake: FakeModel, kind: str) -> None:
    fake.script({"text": LONG_TEXT, "delay": 5}, {"text": "next"})
    client = make_client(config(fake, kind))
    stream = client.stream(request())
    first = await anext(stream)
    assert first == TextDelta(LONG_TEXT[:20])
    await stream.aclose()  # type: ignore[attr-defined]
    # The client stays usable after an abandoned stream.
    events, err = await run(client)
    assert err is None and final(events).message.text == "next"


# ---------------------------------------------------------------------------------------------
# Warm-up

# In a fresh interpreter: warm() the adapter, then stream one request, recording what that first
# request still imported and which processes it started.
_FIRST_AFTER_WARM = """
import asyncio, json, subprocess, sys
spawned = []
_init = subprocess.Popen.__init__
def _record(self, *args, **kwargs):
    spawned.append(repr(args[0] if args else kwargs.get("args")))
    _init(self, *args, **kwargs)
subprocess.Popen.__init__ = _record
from poddaemon.config.manifest import ProviderConfig
from poddaemon.history import UserMessage
from poddaemon.llm import make_client
from poddaemon.llm.types import ModelRequest, ModelResponse

async def main():
    client = make_client(ProviderConfig(**json.loads(sys.argv[1])))
    await client.warm()
    before = set(sys.modules)
    spawned.clear()
    req = ModelRequest(system="s", items=[UserMessage(text="hi")], tools=[], max_tokens=64)
    events = [e async for e in client.stream(req)]
    assert isinstance(events[-1], ModelResponse), events
    await client.aclose()
    return sorted(set(sys.modules) - before)

print(json.dumps({"imported": asyncio.run(main()), "spawned": spawned}))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_first_request_after_warm_up_imports_and_spawns_nothing(fake: FakeModel, kind: str) -> None:
    """warm() (run right after READY) does the SDK's lazy first-use work too: the first run of
    a pod must not pay for an import (anyio's backend, ~8 ms) or a process (openai's platform
    header runs `uname -p`)."""
    settings = {
        f: getattr(config(fake, kind), f)
        for f in ("kind", "model", "base_url", "api_key_env", "max_retries")
    }
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_AFTER_WARM, json.dumps(settings)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    got = json.loads(out)
    assert got == {"imported": [], "spawned": []}
    assert len(fake.requests) == 1


WHOLE_WITH_OBJECT_ARGUMENTS = {
    "openai": {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_7",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": {"path": "a.txt"}},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
    },
    "openai_responses": {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [
            {
                "type": "function_call",
                "call_id": "call_7",
                "name": "read_file",
                "arguments": {"path": "a.txt"},
            }
        ],
        "usage": {"input_tokens": 10, "output_tokens": 5},
    },
}


@pytest.mark.parametrize("kind", ["openai", "openai_responses"])
async def test_tool_arguments_sent_as_a_json_object_are_read_as_its_text(
    fake: FakeModel, kind: str
) -> None:
    """A compatible server that sends a call's `arguments` as a JSON object rather than the
    string the API specifies: the call keeps them, as their JSON text (openai_responses ended
    the run with "AttributeError: 'dict' object has no attribute 'strip'")."""
    body = json.dumps(WHOLE_WITH_OBJECT_ARGUMENTS[kind])
    fault = {"kind": "status", "status": 200, "body": body, "content_type": "application/json"}
    fake.script({"fault": fault})
    events, err = await run(make_client(config(fake, kind)))
    assert err is None, err
    (tool_call,) = final(events).message.tool_calls
    assert (tool_call.id, tool_call.name) == ("call_7", "read_file")
    assert json.loads(tool_call.arguments) == {"path": "a.txt"}
