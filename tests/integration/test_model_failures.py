"""A pod whose model provider misbehaves: real pods, the real SDKs, a local server."""

import json
import re
import socket
import time
from pathlib import Path

import pytest

from tests.conftest import PROVIDER_KINDS, Env, PodProcess, collect_run, events_until

LONG_WAIT = 30  # seconds of Retry-After: far longer than any assertion below waits


def start_patient(env: Env, name: str, kind: str = "openai") -> PodProcess:
    """A pod that honours a long Retry-After (the test manifests cap retry delays at 0.05 s)."""
    path: Path = env.manifest(name, kind=kind)
    text = path.read_text().replace("retry_max_delay = 0.05", f"retry_max_delay = {LONG_WAIT}")
    path.write_text(text)
    pod = PodProcess(env.popen(str(path)), name)
    env.pods.append(pod)
    return pod.wait_ready()


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_pause_while_waiting_to_retry_pauses_now(env: Env, kind: str) -> None:
    """`pause` acknowledged during a long backoff takes effect at once, as `paused` (not after
    minutes of retries, as `error`); `resume` makes the call again."""
    env.model.script({"fault": {"kind": "status", "status": 429, "retry_after": LONG_WAIT}})
    pod = start_patient(env, "backoff", kind)
    with pod.client() as c:
        c.subscribe()
        run = c.run("go")
        events_until(c, lambda e: e.type == "llm.retry")
        started = time.monotonic()
        assert c.pause().paused
        events = collect_run(c, run.run_id)
        assert time.monotonic() - started < LONG_WAIT / 3
        assert events[-1].data["outcome"] == "paused"
        assert c.status().state == "paused"
        assert len(env.model.requests) == 1
        assert c.resume().run_id == run.run_id
        events = collect_run(c, run.run_id)
    assert events[-1].data["outcome"] == "finished"
    assert events[-1].data["text"] == "ok: go"
    assert len(env.model.requests) == 2


def test_pause_during_an_attempt_that_then_fails_pauses_at_the_retry(env: Env) -> None:
    env.model.script(
        {"fault": {"kind": "status", "status": 503, "retry_after": LONG_WAIT}, "gate": "g"}
    )
    pod = start_patient(env, "attempt")
    with pod.client() as c:
        c.subscribe()
        run = c.run("go")
        env.model.wait_for_requests(1)
        assert c.pause().paused
        started = time.monotonic()
        env.model.open_gate("g")
        events = collect_run(c, run.run_id)
    assert time.monotonic() - started < LONG_WAIT / 3
    assert [e.type for e in events].count("llm.retry") == 1
    assert events[-1].data["outcome"] == "paused"
    assert len(env.model.requests) == 1


def test_pause_does_not_cut_an_answer_streaming_after_a_retry(env: Env) -> None:
    """Once a retried call streams, a pause waits for its answer (the run then ends `paused`
    with the answer kept, as for any final answer in flight)."""
    env.model.script(
        {"fault": {"kind": "status", "status": 500}},
        {"text": "the whole answer, streamed slowly", "delay": 0.05},
    )
    pod = env.start("streamer")
    with pod.client() as c:
        c.subscribe()
        run = c.run("go")
        events_until(c, lambda e: e.type == "text.delta")
        assert c.pause().paused
        events = collect_run(c, run.run_id)
    assert events[-1].data["outcome"] == "paused"
    assert events[-1].data["text"] == "the whole answer, streamed slowly"


def test_a_provider_that_is_down_is_named_with_the_cause(env: Env) -> None:
    """`podctl send` to a pod whose model server is not running says where it connected and
    why that failed, not the SDKs' bare 'Connection error.'"""
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1"
        path = env.manifest("offline")
        path.write_text(path.read_text().replace(env.model.openai_base_url, url))
        pod = PodProcess(env.popen(str(path)), "offline")
        env.pods.append(pod)
        pod.wait_ready()
        done = env.podctl("send", "offline", "hello")
    assert done.returncode == 1
    assert "provider failed after 4 attempts" in done.stderr
    assert "Errno 111" in done.stderr and f"({url}/chat/completions)" in done.stderr
    assert pod.call("status")["state"] == "idle"


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_an_error_body_that_is_not_the_apis_json_reaches_the_user(env: Env, kind: str) -> None:
    ollama = json.dumps({"error": 'model "fake-model" not found, try pulling it first'})
    page = "<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"
    env.model.script(
        {
            "fault": {
                "kind": "status",
                "status": 404,
                "body": ollama,
                "content_type": "application/json",
            }
        },
        *[{"fault": {"kind": "status", "status": 502, "body": page, "content_type": "text/html"}}]
        * 4,
    )
    pod = env.start("proxied", kind=kind)
    with pod.client() as c:
        missing = c.run_wait("first")
        gateway = c.run_wait("second")
        after = c.run_wait("third")
    path = {"openai": "/v1/chat/completions", "openai_responses": "/v1/responses"}.get(
        kind, "/v1/messages"
    )
    assert missing.outcome == "error"
    assert missing.error == (
        f'HTTP 404 from {env.model.url}{path}: model "fake-model" not found, try pulling it first'
    )
    assert gateway.outcome == "error"
    assert gateway.error == (
        f"provider failed after 4 attempts: HTTP 502 from {env.model.url}{path}: 502 Bad Gateway"
    )
    assert after.outcome == "finished" and after.text.endswith("third")  # usable again


def test_input_steered_into_a_run_the_provider_failed_is_still_answered(env: Env) -> None:
    """The run ends `error` before its next model request: the acknowledged steer gets a run
    of its own instead of waiting, unseen, for whatever input comes next."""
    env.model.script(
        {"fault": {"kind": "status", "status": 500}, "gate": "g"},
        *[{"fault": {"kind": "status", "status": 500}}] * 3,
    )
    pod = env.start("steered")
    with pod.client() as c:
        c.subscribe()
        run = c.run("first")
        env.model.wait_for_requests(1)
        assert c.run("also this", mode="steer").state == "steered"
        env.model.open_gate("g")
        failed = collect_run(c, run.run_id)
        assert failed[-1].data["outcome"] == "error"
        followed = collect_run(c)
    started = [e for e in followed if e.type == "run.started"]
    assert [e.data["trigger"] for e in started] == ["steer"]
    assert followed[-1].data["outcome"] == "finished"
    assert followed[-1].data["text"] == "ok: also this"
    assert pod.call("status")["state"] == "idle"


@pytest.mark.parametrize("how", ["cut", "cancel"])
def test_calls_cut_short_count_against_the_budget(env: Env, how: str) -> None:
    """A call whose stream breaks (or is cancelled) after the answer started cost the provider
    its request, yet brings no usage (it comes last): a capped pod counts it by estimate, so
    a provider that keeps cutting its streams cannot spend past `max_total_tokens` (every
    such run used to leave the budget untouched: `spent` stayed 0)."""
    answer = "a partial answer that goes on and on " * 4
    if how == "cut":
        env.model.script(*[{"text": answer, "fault": {"kind": "cut", "after_chunks": 1}}] * 3)
    else:
        env.model.script(*[{"text": answer, "delay": 0.2}] * 3)
    pod = env.start("cutter", kind="anthropic", extra="[budget]\nmax_total_tokens = 50\n")
    task = "a task long enough to cost tokens: " + "x" * 400
    with pod.client() as c:
        c.subscribe()
        run = c.run(task)
        if how == "cancel":
            events_until(c, lambda e: e.type == "text.delta")
            assert c.cancel().cancelled
        events = collect_run(c, run.run_id)
    assert events[-1].data["outcome"] == ("error" if how == "cut" else "cancelled")
    _charged_then_refused(env, pod, calls=1)


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_a_reply_the_provider_cut_off_is_said_to_be_cut_at_the_next_request(
    env: Env, kind: str
) -> None:
    """Found by QA: the text streamed before the provider dropped the connection stays the
    model's reply, and the next request showed it as a finished answer; as after a cancel,
    the model is now told that run ended before it finished, and why."""
    env.model.script(
        {"text": "The first half of the answer, then", "fault": {"kind": "cut", "after_chunks": 2}}
    )
    pod = env.start("cut", kind=kind)
    with pod.client() as c:
        assert c.run_wait("answer me").outcome == "error"
        assert c.run_wait("go on").outcome == "finished"
    body = json.dumps(env.model.requests[-1]["body"])
    assert "The run before this one ended with an error before it finished" in body
    assert "its last reply may be cut short" in body


def _charged_then_refused(env: Env, pod: PodProcess, calls: int) -> None:
    """Each of `calls` model calls was charged (~100 tokens of input each: the budget is then
    spent) and counted once; the next run is refused (-32007) and reaches no model."""
    assert pod.call("usage")["totals"]["calls"] == calls
    budget = pod.call("status")["budget"]
    assert budget["spent"] >= 100 * calls, budget
    with pod.client() as c, pytest.raises(Exception) as info:
        c.run("again")
    assert getattr(info.value, "code", None) == -32007
    assert len(env.model.requests) == calls


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_the_api_key_never_reaches_what_the_user_sees(env: Env, kind: str) -> None:
    """A provider (or a proxy before it) that echoes the key in its error ("Incorrect API key
    provided: sk-…"), in a retried error or a final one: neither `podctl send`, nor the
    `llm.retry` and `alert` events, nor the run's error carry it; the error still says what
    the provider said."""
    key = env.env["FAKE_API_KEY"] = "sk-test-9f3c1a7e"
    echoed = f"Incorrect API key provided: {key}. Check your key."
    env.model.script(
        {"fault": {"kind": "status", "status": 503, "message": f"upstream refused {key}"}},
        {"fault": {"kind": "status", "status": 401, "message": echoed}},
    )
    pod = env.start("keyed", kind=kind)
    with pod.client() as c:
        c.subscribe()
        sent = env.podctl("send", "keyed", "hello")
        events = collect_run(c)
    assert sent.returncode == 1
    assert "Incorrect API key provided" in sent.stderr
    seen = sent.stdout + sent.stderr + json.dumps([e.data for e in events])
    assert [e.type for e in events].count("llm.retry") == 1
    assert key not in seen, seen
    assert events[-1].data["outcome"] == "error"
    assert key not in pod.call("history")["entries"].__repr__()


@pytest.mark.parametrize("value", ["sk-test-9f3c1a7e\n", "sk-test-9f3c1a7e\r", " sk-test-9f3c1a7e"])
def test_a_key_no_http_header_can_carry_is_refused_at_start(env: Env, value: str) -> None:
    """A key read from a file with its line break (or a CRLF .env) used to start the pod, then
    fail every run after 4 attempts with the HTTP stack's "Illegal header value b'Bearer
    sk-…'": retried as a connection error, and the key printed. `podctl spawn` now refuses it
    at once, naming the variable, not the key."""
    env.env["FAKE_API_KEY"] = value
    path = env.manifest("badkey")
    spawned = env.podctl("spawn", str(path))
    assert spawned.returncode != 0
    assert "FAKE_API_KEY" in spawned.stderr and "whitespace" in spawned.stderr
    assert "sk-test" not in spawned.stderr + spawned.stdout
    assert env.model.requests == []


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_a_timeout_names_the_setting_that_bounds_it(env: Env, kind: str) -> None:
    """A slow local model (one still loading, one thinking at length) hits a timeout: the
    error says which `[provider]` setting to raise, not only "no response within 120s"."""
    env.model.script(
        {"fault": {"kind": "hang", "seconds": 20}},
        {"text": "a long answer that stops coming " * 4, "delay": 20},
    )
    path = env.manifest(
        "slow", kind=kind, provider_extra="first_byte_timeout = 0.5\nstream_idle_timeout = 0.5"
    )
    path.write_text(path.read_text().replace("max_retries = 3", "max_retries = 0"))
    pod = PodProcess(env.popen(str(path)), "slow")
    env.pods.append(pod)
    pod.wait_ready()
    with pod.client() as c:
        silent = c.run_wait("first")
        stalled = c.run_wait("second")
    assert silent.outcome == "error" and stalled.outcome == "error"
    assert "no response from provider within 0.5s" in silent.error
    assert "provider.first_byte_timeout" in silent.error
    assert "no data for 0.5s after output started" in stalled.error
    assert "provider.stream_idle_timeout" in stalled.error


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_a_pause_waiting_on_a_stream_that_then_fails_pauses_the_run(env: Env, kind: str) -> None:
    """A pause acknowledged while the answer streams waits for it; when the stream then
    stalls (or breaks), the run ends `paused` as asked, and `resume` makes the call again.
    It ended `error` and the pod went idle: the pause, acknowledged, was lost."""
    env.model.script({"text": "an answer that stops half-way " * 4, "delay": 30})
    pod = env.start("stalled", kind=kind, provider_extra="stream_idle_timeout = 0.5")
    with pod.client() as c:
        c.subscribe()
        run = c.run("go")
        events_until(c, lambda e: e.type == "text.delta")
        assert c.pause().paused
        paused = collect_run(c, run.run_id)
        assert paused[-1].data["outcome"] == "paused", paused[-1].data
        alerts = [e.data["message"] for e in paused if e.type == "alert"]
        assert any("stream stalled" in m for m in alerts), alerts
        assert c.status().state == "paused"
        assert c.resume().run_id == run.run_id
        resumed = collect_run(c, run.run_id)
    assert resumed[-1].data["outcome"] == "finished"
    assert resumed[-1].data["text"] == "ok: go"
    assert len(env.model.requests) == 2


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_an_answer_that_holds_no_event_says_what_came_instead(env: Env, kind: str) -> None:
    """A base_url that points at a web page (a UI's port, a captive portal) gets 200 and HTML:
    the error said only "stream ended without a finish_reason". It now names what came and
    the setting to check."""
    page = "<html><head><title>Open WebUI</title></head><body>app</body></html>"
    fault = {"kind": "status", "status": 200, "body": page, "content_type": "text/html"}
    env.model.script(*[{"fault": fault}] * 4)
    pod = env.start("webui", kind=kind)
    with pod.client() as c:
        failed = c.run_wait("hello")
    assert failed.outcome == "error"
    assert "HTTP 200, text/html" in failed.error and "provider.base_url" in failed.error


@pytest.mark.parametrize(
    ("kind", "api", "holds", "body"),
    [
        # A Chat Completions server (Ollama, vLLM) that ignores `stream`, behind the other kinds.
        ("anthropic", "Messages API", "content", "openai"),
        ("openai_responses", "Responses API", "output", "openai"),
        # An Anthropic message behind the chat kind.
        ("openai", "Chat Completions", "choices", "anthropic"),
    ],
)
def test_a_whole_answer_of_another_api_is_an_error_not_an_empty_answer(
    env: Env, kind: str, api: str, holds: str, body: str
) -> None:
    """A JSON body sent whole was read as an answer whatever its shape: a Chat Completions
    answer behind `kind = "anthropic"` ended the run `finished` with no text, and the model was
    never heard. It is now an error naming the API it is not and the settings to check."""
    answer = _whole_answer(body, "from another API", 10, 4)
    fault = {"kind": "status", "status": 200, "body": answer, "content_type": "application/json"}
    env.model.script(*[{"fault": fault}] * 4)
    pod = env.start("mismatch", kind=kind)
    with pod.client() as c:
        failed = c.run_wait("hello")
    assert failed.outcome == "error" and failed.text == ""
    assert f"is not a {api} answer" in failed.error, failed.error
    assert f"no `{holds}` list" in failed.error, failed.error
    assert "provider.kind" in failed.error, failed.error


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_an_answer_cut_at_the_output_limit_names_the_setting(env: Env, kind: str) -> None:
    """`finish_reason: length` (max_tokens, max_output_tokens): the run ends `error` with
    the text so far, and the error names the manifest's knob, `worker.max_tokens`."""
    env.model.script({"text": "the first half of a long answer", "stop": "max_tokens"})
    pod = env.start("capped", kind=kind)
    with pod.client() as c:
        cut = c.run_wait("go")
    assert cut.outcome == "error" and cut.text == "the first half of a long answer"
    assert "output limit (worker.max_tokens)" in cut.error, cut.error


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_attempts_cut_mid_tool_call_count_against_the_budget(env: Env, kind: str) -> None:
    """A stream cut while the model writes a tool call's arguments (a proxy's idle limit
    cutting a long `write_file`) shows nothing yet, so it is retried; but the provider
    answered and bills it. Each such attempt is counted by estimate, as a cut text answer
    is: they were all free, and a capped pod re-sent such tasks without ever reaching its cap."""
    call = {"name": "write_file", "arguments": {"path": "a.txt", "content": "x" * 400}}
    env.model.script(*[{"tool_calls": [call], "fault": {"kind": "cut", "after_chunks": 2}}] * 4)
    pod = env.start(
        "toolcut", kind=kind, tools=["write_file"], extra="[budget]\nmax_total_tokens = 150\n"
    )
    task = "a task long enough to cost tokens: " + "x" * 400
    with pod.client() as c:
        c.subscribe()
        run = c.run(task)
        events = collect_run(c, run.run_id)
    assert [e.type for e in events].count("llm.retry") == 3
    assert events[-1].data["outcome"] == "error"
    _charged_then_refused(env, pod, calls=4)  # once each, not twice, not zero


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_a_huge_error_message_is_cut_short(env: Env, kind: str) -> None:
    """A provider (or a proxy) whose JSON error message is 200 KB (a dump of the request, a
    stack trace): the run's error, the alert and the session log held all of it."""
    message = "invalid request: " + "the request body was: " + "x" * 200_000
    env.model.script({"fault": {"kind": "status", "status": 400, "message": message}})
    pod = env.start("verbose", kind=kind)
    with pod.client() as c:
        c.subscribe()
        failed = c.run_wait("go")
        events = collect_run(c)
    assert failed.outcome == "error"
    assert failed.error.startswith(f"HTTP 400 from {env.model.url}")
    assert "invalid request" in failed.error
    assert failed.error.endswith("…") and len(failed.error) <= 2000
    alerts = [e.data["message"] for e in events if e.type == "alert"]
    assert alerts and all(len(m) <= 2000 for m in alerts)


def _whole_answer(kind: str, text: str, input_tokens: int, output_tokens: int) -> str:
    """An answer sent whole as one JSON body, with the usage numbers as given (the fake
    model's own `usage` takes only sound ones)."""
    if kind == "anthropic":
        return json.dumps(
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "fake-model",
                "content": [{"type": "text", "text": text}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            }
        )
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "fake-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": input_tokens,
                "completion_tokens": output_tokens,
                "total_tokens": input_tokens + output_tokens,
            },
        }
    )


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_negative_usage_count_refunds_no_budget(env: Env, kind: str) -> None:
    """A server that reports a negative token count: the pod counted it as given, `spent`
    went to -999995 and a pod capped at 150 tokens went on calling the model past its cap."""
    answer = _whole_answer(kind, "refund", -1_000_000, 5)
    env.model.script(
        {
            "fault": {
                "kind": "status",
                "status": 200,
                "body": answer,
                "content_type": "application/json",
            }
        },
        {"text": "dear", "usage": {"input": 200, "output": 5}},
    )
    pod = env.start("refund", kind=kind, extra="[budget]\nmax_total_tokens = 150\n")
    with pod.client() as c:
        assert c.run_wait("one").text == "refund"
        assert c.status().budget.spent == 5
        assert c.run_wait("two").text == "dear"
    _charged_then_refused(env, pod, calls=2)


@pytest.mark.parametrize("kind", ["openai", "openai_responses"])
def test_a_429_for_an_exhausted_quota_is_not_retried(env: Env, kind: str) -> None:
    """OpenAI answers 429 `insufficient_quota` to an account out of credit: no wait cures it,
    yet it was retried as a rate limit (every run held for minutes, then the same error)."""
    message = "You exceeded your current quota, please check your plan and billing details."
    quota = {
        "fault": {"kind": "status", "status": 429, "type": "insufficient_quota", "message": message}
    }
    env.model.script(*[quota] * 4)
    pod = env.start("broke", kind=kind)
    with pod.client() as c:
        c.subscribe()
        failed = c.run_wait("go")
        events = collect_run(c)
    assert failed.outcome == "error" and message in (failed.error or "")
    assert "llm.retry" not in [e.type for e in events]
    assert len(env.model.requests) == 1


def test_cached_input_counts_against_the_budget(env: Env) -> None:
    """Anthropic reports cached tokens apart from `input_tokens`: counted as input + output,
    a pod whose calls read 100,000 tokens from the cache counted 2 of them each and never
    reached its cap. Counted whole, the cap holds, and still holds once the pod is restored."""
    cached = {
        "text": "a",
        "usage": {"input": 1, "output": 1, "cache_read": 50000, "cache_write": 50000},
    }
    env.model.script(cached, cached)
    pod = env.start("cached", kind="anthropic", extra="[budget]\nmax_total_tokens = 150000\n")
    with pod.client() as c:
        assert c.run_wait("one").outcome == "finished"
        assert c.status().budget.spent == 100_002
        assert c.run_wait("two").outcome == "finished"
    pod.kill9()
    again = env.restart(pod, "--resume")
    assert again.call("status")["budget"]["spent"] == 200_004
    _charged_then_refused(env, again, calls=2)


@pytest.mark.parametrize("ids", [("", ""), ("call:1", "fc.1 a")])
def test_anthropic_tool_call_ids_go_back_as_the_api_takes_them(
    env: Env, ids: tuple[str, str]
) -> None:
    """A Messages-compatible server whose tool_use ids are empty or hold characters the
    Anthropic API refuses (ids must match [a-zA-Z0-9_-]+): the pod sent them back as they came
    ("" and "_2" for two empty ones), and the API would refuse every later request of the
    session. Chat got `call_<i>` for a missing id."""
    blocks = [{"type": "tool_use", "id": i, "name": "list_dir", "input": {}} for i in ids]
    answer = json.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "fake-model",
            "content": blocks,
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 5},
        }
    )
    body = {"kind": "status", "status": 200, "body": answer, "content_type": "application/json"}
    env.model.script({"fault": body}, {"text": "done"})
    pod = env.start("noids", kind="anthropic", tools=["list_dir"])
    with pod.client() as c:
        assert c.run_wait("go").text == "done"
    sent = [b for m in env.model.requests[-1]["body"]["messages"] for b in m["content"]]
    uses = [b["id"] for b in sent if b.get("type") == "tool_use"]
    results = [b["tool_use_id"] for b in sent if b.get("type") == "tool_result"]
    assert len(set(uses)) == 2 and all(re.fullmatch(r"[a-zA-Z0-9_-]+", i) for i in uses), uses
    assert results == uses
