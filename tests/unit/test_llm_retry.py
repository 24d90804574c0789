"""The retry policy: backoff, classification and the retrying stream (no real waiting)."""

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poddaemon.history import AssistantMessage, Usage
from poddaemon.llm.retry import (
    KEEP_ALIVE,
    AttemptEvent,
    backoff_delay,
    classify,
    classify_error_code,
    retry_after_of,
    with_retries,
)
from poddaemon.llm.types import (
    ModelResponse,
    ProviderError,
    RetryScheduled,
    StreamEvent,
    TextDelta,
)

# ---------------------------------------------------------------------------------------------
# backoff_delay


@given(
    attempt=st.integers(min_value=1, max_value=200),
    initial=st.floats(min_value=0.0, max_value=10.0),
    cap=st.floats(min_value=0.0, max_value=100.0),
    seed=st.integers(),
)
def test_backoff_full_jitter_bounds(attempt: int, initial: float, cap: float, seed: int) -> None:
    delay = backoff_delay(attempt, initial, cap, None, random.Random(seed))
    assert 0.0 <= delay <= min(cap, initial * 2.0 ** min(attempt - 1, 62)) + 1e-9


@given(
    retry_after=st.floats(min_value=0.0, max_value=1e6),
    cap=st.floats(min_value=0.0, max_value=100.0),
    attempt=st.integers(min_value=1, max_value=10),
)
def test_backoff_retry_after_honoured_but_capped(
    retry_after: float, cap: float, attempt: int
) -> None:
    assert backoff_delay(attempt, 0.5, cap, retry_after) == min(retry_after, cap)


def test_backoff_grows_and_jitters() -> None:
    rng = random.Random(1)
    ceilings = [max(backoff_delay(n, 1.0, 1000.0, None, rng) for _ in range(200)) for n in (1, 4)]
    assert ceilings[0] <= 1.0 < ceilings[1] <= 8.0
    assert backoff_delay(1, 1.0, 1000.0, -5.0) == 0.0


# ---------------------------------------------------------------------------------------------
# classify: fake exceptions shaped like the SDKs' (class names and attributes only)


class APIStatusError(Exception):
    def __init__(self, status: int, message: str = "", body: Any = None, headers: Any = None):
        super().__init__(f"Error code: {status} - {message}")
        self.status_code = status
        self.body = body
        self.response = type("R", (), {"headers": headers or {}, "status_code": status})()


class APIConnectionError(Exception):
    pass


class APITimeoutError(APIConnectionError):
    pass


class RemoteProtocolError(Exception):  # as httpx(2) raises while reading a torn stream
    pass


class APIError(Exception):  # openai's error event inside a 200 stream
    def __init__(self, message: str, body: Any) -> None:
        super().__init__(message)
        self.body = body


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 529])
def test_classify_transient_status(status: int) -> None:
    err = classify(APIStatusError(status, body={"error": {"message": "busy"}}))
    assert (err.kind, err.status, err.message) == ("transient", status, f"HTTP {status}: busy")


@pytest.mark.parametrize(("status", "kind"), [(401, "auth"), (403, "auth"), (404, "fatal")])
def test_classify_auth_and_fatal(status: int, kind: str) -> None:
    assert classify(APIStatusError(status)).kind == kind


@pytest.mark.parametrize(
    "message",
    [
        "prompt is too long: 210000 tokens > 200000 maximum",
        "This model's maximum context length is 128000 tokens.",
        "Input is too long for requested model.",
    ],
)
def test_classify_context_overflow(message: str) -> None:
    anthropic_style = APIStatusError(400, body={"error": {"type": "x", "message": message}})
    openai_style = APIStatusError(400, body={"message": message, "code": None})
    assert classify(anthropic_style).kind == "context_overflow"
    assert classify(openai_style).kind == "context_overflow"


def test_classify_other_400_is_fatal() -> None:
    err = classify(APIStatusError(400, body={"error": {"message": "tools.0: bad schema"}}))
    assert (err.kind, err.message) == ("fatal", "HTTP 400: tools.0: bad schema")
    coded = APIStatusError(400, body={"code": "context_length_exceeded", "message": "too big"})
    assert classify(coded).kind == "context_overflow"


@pytest.mark.parametrize(
    "exc",
    [
        APIConnectionError("Connection error."),
        APITimeoutError("Request timed out."),
        RemoteProtocolError("peer closed connection without sending complete message body"),
        ConnectionResetError(),
        TimeoutError(),
    ],
)
def test_classify_connection_errors_transient(exc: Exception) -> None:
    assert classify(exc).kind == "transient"


def test_a_timeout_says_so_not_what_the_http_stack_cancelled() -> None:
    """The SDK's APITimeoutError carries httpx/anyio's 'Cancelled via cancel scope ...'."""
    inner = TimeoutError("Cancelled via cancel scope 7fbf31de1300; reason: deadline exceeded")
    exc = APITimeoutError("Request timed out.")
    exc.__cause__ = inner
    err = classify(exc)
    assert err.kind == "transient" and "cancel scope" not in err.message
    assert err.message.startswith("the request timed out"), err.message


def test_classify_stream_error_events() -> None:
    overloaded = APIError("x", {"type": "error", "error": {"type": "overloaded_error"}})
    assert classify(overloaded).kind == "transient"
    assert classify(APIError("x", {"code": "server_error", "message": "oops"})).kind == "transient"
    assert classify(APIError("x", {"code": "invalid_prompt", "message": "no"})).kind == "fatal"
    assert classify_error_code("rate_limit_exceeded", "slow down").kind == "transient"
    assert classify_error_code("context_length_exceeded", "").kind == "context_overflow"
    assert classify(ValueError("bug")).kind == "fatal"
    same = ProviderError("stalled", "quiet")
    assert classify(same) is same


class _Request:
    def __init__(self, url: str) -> None:
        self.url = url


class ConnectError(Exception):  # httpx's, under the SDK's APIConnectionError
    pass


def test_classify_names_the_cause_and_the_endpoint_of_a_connection_error() -> None:
    wrapped = APIConnectionError("Connection error.")
    wrapped.request = _Request("http://127.0.0.1:9/v1/chat/completions?key=secret")  # type: ignore[attr-defined]
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as exc:
            raise ConnectError("All connection attempts failed") from exc
    except ConnectError as exc:
        wrapped.__cause__ = exc
    err = classify(wrapped)
    assert err.kind == "transient"
    assert err.message == (
        "APIConnectionError: [Errno 111] Connection refused (http://127.0.0.1:9/v1/chat/completions)"
    )


def test_classify_keeps_an_error_body_that_is_text() -> None:
    # The openai SDK keeps a body that is not JSON, or an `error` that is a string, as text.
    ollama = APIStatusError(404, body='model "m" not found, try pulling it first')
    assert classify(ollama).message == 'HTTP 404: model "m" not found, try pulling it first'
    page = "<html><head><title>502 Bad Gateway</title></head><body>" + "x" * 5000 + "</body></html>"
    assert classify(APIStatusError(502, body=page)).message == "HTTP 502: 502 Bad Gateway"
    long = APIStatusError(500, body="word " * 1000)
    assert len(classify(long).message) < 320


def test_classify_a_malformed_stream_event_says_so() -> None:
    import json

    with pytest.raises(json.JSONDecodeError) as exc:
        json.loads("{not json")
    err = classify(exc.value)
    assert err.kind == "fatal"
    assert err.message.startswith("malformed event in the provider's stream: Expecting")


def test_retry_after_headers() -> None:
    assert retry_after_of(APIStatusError(429, headers={"retry-after": "2"})) == 2.0
    assert retry_after_of(APIStatusError(429, headers={"retry-after-ms": "250"})) == 0.25
    assert retry_after_of(APIStatusError(429, headers={"retry-after": "soon"})) is None
    http_date = retry_after_of(
        APIStatusError(429, headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})
    )
    assert http_date == 0.0
    assert retry_after_of(APIStatusError(429)) is None
    assert retry_after_of(ValueError()) is None


# ---------------------------------------------------------------------------------------------
# with_retries


@dataclass
class Cfg:
    kind: str = "openai"
    model: str = "m"
    base_url: str | None = None
    api_key_env: str | None = None
    max_retries: int = 4
    connect_timeout: float = 10.0
    first_byte_timeout: float = 5.0
    stream_idle_timeout: float = 5.0
    retry_initial_delay: float = 0.5
    retry_max_delay: float = 30.0
    retry_total_timeout: float = 300.0


FINAL = ModelResponse(message=AssistantMessage(text="hi"), stop="end_turn", usage=Usage(output=1))


@dataclass
class Script:
    """Each attempt runs the next plan: a list of events, exceptions or ("wait", seconds)."""

    plans: list[list[Any]]
    calls: int = 0
    closed: int = 0

    def __call__(self) -> AsyncIterator[AttemptEvent]:
        plan = self.plans[min(self.calls, len(self.plans) - 1)]
        self.calls += 1
        return self._run(plan)

    async def _run(self, plan: list[Any]) -> AsyncIterator[AttemptEvent]:
        try:
            for step in plan:
                if isinstance(step, BaseException):
                    raise step
                if isinstance(step, tuple):
                    await asyncio.sleep(step[1])
                    continue
                yield step
        finally:
            self.closed += 1


@dataclass
class FakeTime:
    now: float = 0.0
    slept: list[float] = field(default_factory=list)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


class RealTime:
    """FakeTime's interface on the real clock."""

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def clock(self) -> float:
        return time.monotonic()


async def collect(
    script: Script, cfg: Cfg, time: FakeTime | RealTime | None = None
) -> tuple[list[StreamEvent], ProviderError | None]:
    time = time or FakeTime()
    events: list[StreamEvent] = []
    try:
        async for ev in with_retries(
            script, cfg, sleep=time.sleep, clock=time.clock, rng=random.Random(0)
        ):
            events.append(ev)
    except ProviderError as exc:
        return events, exc
    return events, None


async def test_success_passes_through() -> None:
    script = Script([[None, TextDelta("h"), None, TextDelta("i"), FINAL, TextDelta("late")]])
    events, err = await collect(script, Cfg())
    assert err is None
    assert events == [TextDelta("h"), TextDelta("i"), FINAL]
    assert script.closed == 1  # the attempt is closed once its response was taken


async def test_retries_before_output() -> None:
    script = Script(
        [
            [None, APIStatusError(429, headers={"retry-after": "0.01"})],
            [APIStatusError(503)],
            [TextDelta("ok"), FINAL],
        ]
    )
    time = FakeTime()
    events, err = await collect(script, Cfg(), time)
    assert err is None
    assert [type(e).__name__ for e in events] == [
        "RetryScheduled",
        "RetryScheduled",
        "TextDelta",
        "ModelResponse",
    ]
    first, second = events[0], events[1]
    assert isinstance(first, RetryScheduled) and isinstance(second, RetryScheduled)
    assert (first.attempt, first.delay) == (1, 0.01)  # Retry-After honoured
    assert second.attempt == 2 and 0.0 <= second.delay <= 1.0 and "HTTP 503" in second.error
    assert time.slept == [first.delay, second.delay]
    assert script.calls == 3 and script.closed == 3


async def test_retry_after_is_capped() -> None:
    script = Script([[APIStatusError(429, headers={"retry-after": "3600"})], [FINAL]])
    events, err = await collect(script, Cfg(retry_max_delay=2.0))
    assert err is None and isinstance(events[0], RetryScheduled) and events[0].delay == 2.0


async def test_no_retry_after_output() -> None:
    script = Script([[TextDelta("par"), RemoteProtocolError("torn")], [FINAL]])
    events, err = await collect(script, Cfg())
    assert events == [TextDelta("par")]
    assert err is not None and err.kind == "interrupted"
    assert "torn" in err.message
    assert script.calls == 1


async def test_not_retried_when_not_transient() -> None:
    for exc, kind in [(APIStatusError(401), "auth"), (APIStatusError(400), "fatal")]:
        script = Script([[exc], [FINAL]])
        events, err = await collect(script, Cfg())
        assert events == [] and err is not None and err.kind == kind and script.calls == 1


async def test_gives_up_after_max_retries() -> None:
    script = Script([[APIStatusError(500, body={"error": {"message": "boom"}})]])
    events, err = await collect(script, Cfg(max_retries=2))
    assert [e.attempt for e in events if isinstance(e, RetryScheduled)] == [1, 2]
    assert err is not None and err.kind == "transient" and err.status == 500
    assert err.message == "provider failed after 3 attempts: HTTP 500: boom"
    assert script.calls == 3


async def test_total_timeout_caps_retries() -> None:
    # Retry-After 10s each time; the total budget of 25s allows two sleeps, not three.
    script = Script([[APIStatusError(503, headers={"retry-after": "10"})]])
    time = FakeTime()
    events, err = await collect(script, Cfg(max_retries=10, retry_total_timeout=25.0), time)
    assert time.slept == [10.0, 10.0]
    assert err is not None and "after 3 attempts" in err.message
    assert "retry_total_timeout" in err.message
    assert len(events) == 2


async def test_total_timeout_bounds_a_retry_waiting_for_its_first_byte() -> None:
    # The first attempt fails at once; the retry meets a provider that never answers. It gives
    # up when retry_total_timeout is spent (real time here), not a first_byte_timeout later.
    script = Script([[APIStatusError(503)], [("wait", 5.0)]])
    cfg = Cfg(
        first_byte_timeout=60.0,
        retry_total_timeout=0.2,
        retry_initial_delay=0.001,
        retry_max_delay=0.001,
    )
    real = RealTime()
    events, err = await collect(script, cfg, real)
    assert [type(e) for e in events] == [RetryScheduled]
    assert err is not None and err.kind == "transient"
    assert re.fullmatch(
        r"provider failed after 2 attempts \(retry_total_timeout 0\.2s\): "
        r"no response from provider within 0\.\d+s \(provider\.retry_total_timeout\)",
        err.message,
    ), err.message


async def test_stream_ending_without_response_is_transient() -> None:
    script = Script([[None], [FINAL]])
    events, err = await collect(script, Cfg())
    assert err is None and isinstance(events[0], RetryScheduled) and events[-1] == FINAL
    script = Script([[TextDelta("x")]])
    events, err = await collect(script, Cfg())
    assert err is not None and err.kind == "interrupted"


async def test_first_byte_timeout_is_retried() -> None:
    script = Script([[("wait", 5.0)], [FINAL]])
    events, err = await collect(script, Cfg(first_byte_timeout=0.01))
    assert err is None
    assert isinstance(events[0], RetryScheduled) and "within 0.01s" in events[0].error
    assert events[-1] == FINAL


async def test_keepalives_do_not_start_output() -> None:
    # A gap before any delta counts against first_byte_timeout, is retried, nothing duplicated.
    script = Script([[None, None, ("wait", 5.0)], [TextDelta("a"), FINAL]])
    events, err = await collect(script, Cfg(first_byte_timeout=0.01))
    assert err is None and events[1:] == [TextDelta("a"), FINAL]


async def test_keepalives_alone_cannot_hold_a_call_past_retry_total_timeout() -> None:
    """A stream that sends only keep-alives (empty chunks, `response.in_progress`) each within
    first_byte_timeout held the run for ever; they stretch the wait to retry_total_timeout."""
    forever = [item for _ in range(1000) for item in (("wait", 0.02), None)]
    script = Script([forever])
    cfg = Cfg(first_byte_timeout=0.1, retry_total_timeout=0.3, max_retries=3)
    events, err = await collect(script, cfg, RealTime())
    assert err is not None and err.kind == "transient"
    assert "only keep-alive events" in err.message, err.message
    assert script.calls == 1 and events == []  # no retry: retry_total_timeout is spent


async def test_idle_timeout_after_output_stalls() -> None:
    script = Script([[TextDelta("a"), ("wait", 5.0), FINAL]])
    events, err = await collect(script, Cfg(stream_idle_timeout=0.01))
    assert events == [TextDelta("a")]
    assert err is not None and err.kind == "stalled"
    assert script.closed == 1


async def test_keep_alives_after_output_do_not_hold_off_the_idle_timeout() -> None:
    """Chunks that carry nothing (OpenAI chunks with an empty delta) after the first text: a
    server that sent them for ever held the run for ever, each one restarting the timer."""
    forever = [item for _ in range(1000) for item in (("wait", 0.02), KEEP_ALIVE)]
    script = Script([[TextDelta("a"), *forever, FINAL]])
    started = time.monotonic()
    events, err = await collect(script, Cfg(stream_idle_timeout=0.2), RealTime())
    assert events == [TextDelta("a")]
    assert err is not None and err.kind == "stalled", err
    assert "0.2s" in err.message and time.monotonic() - started < 5


async def test_parts_of_the_answer_with_nothing_to_show_hold_off_the_idle_timeout() -> None:
    """A tool call's arguments streaming (None: part of the answer, nothing to show yet), each
    piece well within the timeout, all of them longer than it: no stall."""
    pieces = [item for _ in range(10) for item in (("wait", 0.05), None)]
    script = Script([[TextDelta("a"), *pieces, FINAL]])
    events, err = await collect(script, Cfg(stream_idle_timeout=0.2), RealTime())
    assert err is None and events == [TextDelta("a"), FINAL]


async def test_timeout_error_raised_by_the_stream_is_not_ours() -> None:
    script = Script([[TextDelta("a"), TimeoutError("sdk read timeout")]])
    events, err = await collect(script, Cfg())
    assert events == [TextDelta("a")]
    assert err is not None and err.kind == "interrupted"


async def test_cancellation_closes_the_attempt() -> None:
    script = Script([[TextDelta("a"), ("wait", 5.0), FINAL]])
    gen = with_retries(script, Cfg())
    assert await anext(gen) == TextDelta("a")
    task: asyncio.Task[Any] = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gen.aclose()
    assert script.closed == 1
