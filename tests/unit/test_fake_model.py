"""The fake model server, driven by the real openai and anthropic SDKs over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI

from poddaemon.testing.fake_model import READY_PREFIX, FakeModel

TORN = (openai.APIError, anthropic.APIError, httpx2.HTTPError)
LONG = "The quick brown fox jumps over the lazy dog, twice over."  # 57 chars: 3 deltas
USER: Any = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server() -> Iterator[FakeModel]:
    with FakeModel().start() as fake:
        yield fake


@pytest.fixture
def fake(server: FakeModel) -> FakeModel:
    server.reset()
    return server


@pytest.fixture(scope="module")
def oai(server: FakeModel) -> OpenAI:
    return OpenAI(base_url=server.openai_base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def ant(server: FakeModel) -> Anthropic:
    return Anthropic(base_url=server.url, api_key="x", max_retries=0)


def _http(fake: FakeModel, method: str, path: str, body: object = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(fake.url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


TWO_CALLS = [
    {"name": "read_file", "arguments": {"path": "/tmp/some/rather/long/path.txt", "limit": 10}},
    {"name": "grep", "arguments": {"pattern": "needle", "paths": ["a", "b"]}, "id": "given_1"},
]
USAGE = {"input": 100, "output": 20, "cache_read": 60, "cache_write": 7}


# ---------------------------------------------------------------- chat completions


def test_chat_non_streaming_text_and_usage(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"text": LONG, "usage": USAGE})
    resp = oai.chat.completions.create(model="m1", messages=USER)
    choice = resp.choices[0]
    assert choice.message.content == LONG
    assert choice.finish_reason == "stop"
    assert resp.model == "m1"
    u = resp.usage
    assert u is not None and u.prompt_tokens_details is not None
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (167, 20, 187)
    assert u.prompt_tokens_details.cached_tokens == 60


def test_chat_streaming_text_in_several_deltas_with_usage(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"text": LONG, "usage": USAGE})
    chunks = list(
        oai.chat.completions.create(
            model="m",
            messages=USER,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(deltas) == 3 and "".join(deltas) == LONG
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 60 and usage.completion_tokens == 20


def test_chat_streaming_two_parallel_tool_calls_and_reasoning(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"reasoning": "Let me look at both files first.", "tool_calls": TWO_CALLS})
    calls: dict[int, dict[str, str]] = {}
    reasoning = ""
    finish = None
    for chunk in oai.chat.completions.create(model="m", messages=USER, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += (tc.function and tc.function.name) or ""
            slot["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == "Let me look at both files first."
    assert finish == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["read_file", "grep"]
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == [
        c["arguments"] for c in TWO_CALLS
    ]
    assert calls[0]["id"].startswith("call_") and calls[1]["id"] == "given_1"


def test_chat_non_streaming_tool_calls_and_reasoning(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"reasoning": "hmm", "tool_calls": TWO_CALLS})
    resp = oai.chat.completions.create(model="m", messages=USER)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert (msg.model_extra or {})["reasoning_content"] == "hmm"
    assert msg.tool_calls is not None
    args = [json.loads(tc.function.arguments) for tc in msg.tool_calls if tc.type == "function"]
    assert args == [c["arguments"] for c in TWO_CALLS]


@pytest.mark.parametrize(
    ("stop", "finish"),
    [("end", "stop"), ("max_tokens", "length"), ("content_filter", "content_filter")],
)
def test_chat_stop_reasons(fake: FakeModel, oai: OpenAI, stop: str, finish: str) -> None:
    fake.script({"text": "a", "stop": stop}, {"text": "b", "stop": stop})
    resp = oai.chat.completions.create(model="m", messages=USER)
    assert resp.choices[0].finish_reason == finish
    stream = oai.chat.completions.create(model="m", messages=USER, stream=True)
    finishes = [c.choices[0].finish_reason for c in stream if c.choices]
    assert finishes[-1] == finish


# ---------------------------------------------------------------- responses


def test_responses_streaming_reasoning_text_tools_usage(fake: FakeModel, oai: OpenAI) -> None:
    fake.script(
        {"reasoning": "Thinking it through.", "text": LONG, "tool_calls": TWO_CALLS, "usage": USAGE}
    )
    seen: list[str] = []
    summary = text = ""
    args: dict[int, str] = {}
    final = None
    for event in oai.responses.create(model="m", input="hi", stream=True):
        seen.append(event.type)
        if event.type == "response.reasoning_summary_text.delta":
            summary += event.delta
        elif event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.function_call_arguments.delta":
            args[event.output_index] = args.get(event.output_index, "") + event.delta
        elif event.type == "response.completed":
            final = event.response
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    assert seen.count("response.output_text.delta") == 3
    assert seen.count("response.output_item.added") == seen.count("response.output_item.done") == 4
    assert summary == "Thinking it through." and text == LONG
    assert [json.loads(a) for _, a in sorted(args.items())] == [c["arguments"] for c in TWO_CALLS]
    assert final is not None and final.status == "completed"
    assert final.usage is not None
    assert final.usage.input_tokens == 167 and final.usage.output_tokens == 20
    assert final.usage.input_tokens_details.cached_tokens == 60
    calls = [item for item in final.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["read_file", "grep"]
    assert calls[1].call_id == "given_1"


def test_responses_stream_helper_accumulates(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"reasoning": "r", "text": LONG, "tool_calls": TWO_CALLS[:1]})
    with oai.responses.stream(model="m", input="hi") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == LONG
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]


def test_responses_non_streaming(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"text": LONG, "tool_calls": TWO_CALLS[:1], "usage": USAGE})
    resp = oai.responses.create(model="m", input=[{"role": "user", "content": "hi"}])
    assert resp.status == "completed" and resp.output_text == LONG
    assert resp.usage is not None and resp.usage.input_tokens_details.cached_tokens == 60
    call = resp.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == TWO_CALLS[0]["arguments"]


@pytest.mark.parametrize(
    ("stop", "reason"), [("max_tokens", "max_output_tokens"), ("content_filter", "content_filter")]
)
def test_responses_incomplete(fake: FakeModel, oai: OpenAI, stop: str, reason: str) -> None:
    fake.script({"text": LONG, "stop": stop}, {"text": LONG, "stop": stop})
    resp = oai.responses.create(model="m", input="hi")
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == reason
    events = list(oai.responses.create(model="m", input="hi", stream=True))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == reason


# ---------------------------------------------------------------- anthropic messages


def test_anthropic_non_streaming(fake: FakeModel, ant: Anthropic) -> None:
    fake.script({"reasoning": "ponder", "text": LONG, "tool_calls": TWO_CALLS, "usage": USAGE})
    msg = ant.messages.create(model="claude-x", max_tokens=100, messages=USER)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, call1, call2 = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "ponder" and thinking.signature
    assert text.type == "text" and text.text == LONG
    assert call1.type == "tool_use" and call1.id.startswith("toolu_")
    assert call1.input == TWO_CALLS[0]["arguments"]
    assert call2.type == "tool_use" and call2.id == "given_1"
    assert msg.stop_reason == "tool_use" and msg.model == "claude-x"
    u = msg.usage
    assert (u.input_tokens, u.output_tokens) == (100, 20)
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (60, 7)


def test_anthropic_streaming_thinking_text_tools(fake: FakeModel, ant: Anthropic) -> None:
    fake.script({"reasoning": "A longer chain of thought.", "text": LONG, "tool_calls": TWO_CALLS})
    kinds: list[str] = []
    with ant.messages.stream(model="m", max_tokens=100, messages=USER) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = stream.get_final_message()
    assert kinds.count("text_delta") == 3 and kinds.count("signature_delta") == 1
    assert kinds.count("thinking_delta") == 2 and "input_json_delta" in kinds
    thinking, text, *calls = final.content
    assert thinking.type == "thinking" and thinking.thinking == "A longer chain of thought."
    assert thinking.signature
    assert text.type == "text" and text.text == LONG
    assert [c.input for c in calls if c.type == "tool_use"] == [c["arguments"] for c in TWO_CALLS]
    assert final.stop_reason == "tool_use"


def test_anthropic_streaming_usage_raw_events(fake: FakeModel, ant: Anthropic) -> None:
    fake.script({"text": "hi", "usage": USAGE})
    events = list(ant.messages.create(model="m", max_tokens=9, messages=USER, stream=True))
    start, delta = events[0], events[-2]
    assert start.type == "message_start" and delta.type == "message_delta"
    assert start.message.usage.cache_read_input_tokens == 60
    assert start.message.usage.cache_creation_input_tokens == 7
    assert start.message.usage.input_tokens == 100
    assert delta.usage.output_tokens == 20 and events[-1].type == "message_stop"


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ({"text": "x"}, "end_turn"),
        ({"tool_calls": [{"name": "t", "arguments": {}}]}, "tool_use"),
        ({"text": "x", "stop": "max_tokens"}, "max_tokens"),
        ({"text": "x", "stop": "content_filter"}, "refusal"),
    ],
)
def test_anthropic_stop_reasons(
    fake: FakeModel, ant: Anthropic, reply: dict[str, Any], reason: str
) -> None:
    fake.script(reply, reply)
    msg = ant.messages.create(model="m", max_tokens=9, messages=USER)
    assert msg.stop_reason == reason
    with ant.messages.stream(model="m", max_tokens=9, messages=USER) as stream:
        assert stream.get_final_message().stop_reason == reason


async def test_async_clients_stream(fake: FakeModel) -> None:
    fake.script({"text": LONG}, {"text": LONG, "tool_calls": TWO_CALLS[:1]})
    oai = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
    ant = anthropic.AsyncAnthropic(base_url=fake.url, api_key="x", max_retries=0)
    try:
        stream = await oai.chat.completions.create(model="m", messages=USER, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == LONG
        async with ant.messages.stream(model="m", max_tokens=9, messages=USER) as astream:
            final = await astream.get_final_message()
        assert final.stop_reason == "tool_use" and len(final.content) == 2
    finally:
        await oai.close()
        await ant.close()


def test_delay_spaces_out_deltas(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"text": LONG, "delay": 0.05})
    started = time.monotonic()
    stream = oai.chat.completions.create(model="m", messages=USER, stream=True)
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 3
    assert time.monotonic() - started >= 0.15


# ---------------------------------------------------------------- faults


def test_429_with_retry_after_then_success(fake: FakeModel, oai: OpenAI, ant: Anthropic) -> None:
    fault = {"fault": {"kind": "status", "status": 429, "retry_after": 7}}
    fake.script(fault, {"text": "after"}, fault, {"text": "after too"})
    with pytest.raises(openai.RateLimitError) as oerr:
        oai.chat.completions.create(model="m", messages=USER, stream=True)
    assert oerr.value.response.headers["retry-after"] == "7"
    assert isinstance(oerr.value.body, dict) and "message" in oerr.value.body
    resp = oai.chat.completions.create(model="m", messages=USER)
    assert resp.choices[0].message.content == "after"
    with pytest.raises(anthropic.RateLimitError) as aerr:
        ant.messages.create(model="m", max_tokens=9, messages=USER)
    assert aerr.value.response.headers["retry-after"] == "7"
    assert isinstance(aerr.value.body, dict) and aerr.value.body["type"] == "error"
    block = ant.messages.create(model="m", max_tokens=9, messages=USER).content[0]
    assert block.type == "text" and block.text == "after too"
    assert len(fake.requests) == 4


def test_500_and_custom_message(fake: FakeModel, oai: OpenAI, ant: Anthropic) -> None:
    fake.script(
        {"fault": {"kind": "status", "status": 500}},
        {"fault": {"kind": "status", "status": 400, "message": "prompt is too long"}},
        {"fault": {"kind": "status", "status": 529}},
    )
    with pytest.raises(openai.InternalServerError):
        oai.responses.create(model="m", input="hi")
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        ant.messages.create(model="m", max_tokens=9, messages=USER)
    with pytest.raises(anthropic.APIStatusError) as err:
        ant.messages.create(model="m", max_tokens=9, messages=USER)
    assert err.value.status_code == 529
    assert isinstance(err.value.body, dict)
    assert err.value.body["error"]["type"] == "overloaded_error"


def test_cut_stream_raises_in_each_sdk(fake: FakeModel, oai: OpenAI, ant: Anthropic) -> None:
    cut = {"text": LONG * 3, "fault": {"kind": "cut", "after_chunks": 2}}
    fake.script(cut, cut, cut, cut)
    got: list[str] = []
    with pytest.raises(TORN):
        for chunk in oai.chat.completions.create(model="m", messages=USER, stream=True):
            assert not chunk.choices or chunk.choices[0].finish_reason is None
            got.extend(c.delta.content for c in chunk.choices if c.delta.content)
    assert len(got) == 2
    types: list[str] = []
    with pytest.raises(TORN):
        for event in oai.responses.create(model="m", input="hi", stream=True):
            types.append(event.type)
    assert types.count("response.output_text.delta") == 2 and "response.completed" not in types
    types = []
    with (
        pytest.raises(TORN),
        ant.messages.stream(model="m", max_tokens=9, messages=USER) as stream,
    ):
        for aevent in stream:
            types.append(aevent.type)
    assert "message_stop" not in types and "message_delta" not in types
    with pytest.raises(TORN):  # non-streaming: half a body, then the connection drops
        ant.messages.create(model="m", max_tokens=9, messages=USER)


def test_hang_times_out_client(fake: FakeModel, oai: OpenAI, ant: Anthropic) -> None:
    fake.script(
        {"fault": {"kind": "hang", "seconds": 5}}, {"fault": {"kind": "hang", "seconds": 5}}
    )
    with pytest.raises(openai.APITimeoutError):
        oai.with_options(timeout=0.3).chat.completions.create(model="m", messages=USER)
    slow = ant.with_options(timeout=0.3)
    with (  # a stream hang sends the headers, then silence
        pytest.raises((anthropic.APITimeoutError, httpx2.ReadTimeout)),
        slow.messages.stream(model="m", max_tokens=9, messages=USER) as stream,
    ):
        for _ in stream:
            pass
    fake.script({"text": "alive"})
    assert (
        oai.chat.completions.create(model="m", messages=USER).choices[0].message.content == "alive"
    )


def test_gate_blocks_until_opened(fake: FakeModel, oai: OpenAI) -> None:
    fake.script({"text": "released", "gate": "g1"})
    result: list[str] = []

    def call() -> None:
        resp = oai.chat.completions.create(model="m", messages=USER)
        result.append(resp.choices[0].message.content or "")

    worker = threading.Thread(target=call)
    worker.start()
    recorded = fake.wait_for_requests(1, timeout=5)
    assert recorded[0]["path"] == "/v1/chat/completions"
    assert worker.is_alive() and result == []
    status, _ = _http(fake, "POST", "/_fake/gate/g1")
    assert status == 200
    worker.join(timeout=5)
    assert result == ["released"]


def test_stop_releases_blocked_request() -> None:
    with FakeModel().start() as fake:
        fake.script({"gate": "never"})
        client = OpenAI(base_url=fake.openai_base_url, api_key="x", max_retries=0)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                client.chat.completions.create(model="m", messages=USER)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=call)
        worker.start()
        fake.wait_for_requests(1)
    worker.join(timeout=5)
    assert not worker.is_alive() and isinstance(errors[0], openai.APIConnectionError)


# ---------------------------------------------------------------- recording and control


def test_default_echo_and_recorded_requests(fake: FakeModel, oai: OpenAI, ant: Anthropic) -> None:
    long_text = "y" * 500
    messages = [
        *USER,
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": long_text},
    ]
    resp = oai.chat.completions.create(model="m", messages=messages)
    assert resp.choices[0].message.content == "ok: " + "y" * 200
    blocks: Any = [{"role": "user", "content": [{"type": "text", "text": "block text"}]}]
    msg = ant.messages.create(model="m", max_tokens=9, messages=blocks)
    assert msg.content[0].type == "text" and msg.content[0].text == "ok: block text"
    out = oai.responses.create(
        model="m", input=[{"role": "user", "content": [{"type": "input_text", "text": "resp"}]}]
    )
    assert out.output_text == "ok: resp"
    reqs = fake.wait_for_requests(3)
    assert [r["path"] for r in reqs] == ["/v1/chat/completions", "/v1/messages", "/v1/responses"]
    assert reqs[0]["body"]["messages"][-1]["content"] == long_text
    assert reqs[1]["body"]["max_tokens"] == 9
    headers = reqs[1]["headers"]
    assert "x" in (
        headers.get("x-api-key"),
        headers.get("authorization", "").removeprefix("Bearer "),
    )
    status, listed = _http(fake, "GET", "/_fake/requests")
    assert status == 200 and listed == reqs
    with pytest.raises(TimeoutError):
        fake.wait_for_requests(4, timeout=0.05)


def test_control_endpoints(fake: FakeModel, oai: OpenAI) -> None:
    status, body = _http(
        fake, "POST", "/_fake/script", {"replies": [{"text": "one"}, {"text": "two"}]}
    )
    assert (status, body) == (200, {"queued": 2})
    assert oai.chat.completions.create(model="m", messages=USER).choices[0].message.content == "one"
    status, _ = _http(fake, "POST", "/_fake/reset")
    assert status == 200 and fake.requests == [] and fake.pending == 0
    status, body = _http(fake, "POST", "/_fake/script", {"replies": [{"txt": "typo"}]})
    assert status == 400 and "txt" in body["error"]
    status, _ = _http(fake, "POST", "/v1/nowhere", {})
    assert status == 404


def test_script_validation() -> None:
    fake = FakeModel()
    with pytest.raises(ValueError, match="stop"):
        fake.script({"text": "x", "stop": "sideways"})
    with pytest.raises(ValueError, match="fault"):
        fake.script({"fault": {"kind": "explode"}})
    with pytest.raises(ValueError, match="tool_calls"):
        fake.script({"tool_calls": [{"arguments": {}}]})
    with pytest.raises(ValueError, match=r"fault\.body"):
        fake.script({"fault": {"kind": "status", "status": 502, "body": {"not": "text"}}})
    with pytest.raises(ValueError, match=r"fault\.finals"):
        fake.script({"fault": {"kind": "cut", "after_chunks": 1, "finals": -1}})
    with pytest.raises(ValueError, match=r"fault\.after_chunks"):
        fake.script({"fault": {"kind": "cut", "finals": 1}})
    fake.script({"tool_calls": [{"name": "raw", "arguments": '{"not": "parsed"'}]})
    assert fake.pending == 1


# ---------------------------------------------------------------- standalone


def test_standalone_prints_ready_and_serves(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"replies": [{"text": "from the script"}]}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "poddaemon.testing.fake_model", "--script", str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        prefix, url = proc.stdout.readline().rstrip("\n").split("\t")
        assert prefix == READY_PREFIX and url.startswith("http://127.0.0.1:")
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        first = client.chat.completions.create(model="m", messages=USER)
        second = client.chat.completions.create(model="m", messages=USER)
        assert first.choices[0].message.content == "from the script"
        assert second.choices[0].message.content == "ok: hello there"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
