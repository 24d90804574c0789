"""Our own retry policy for model calls, shared by every adapter.

The SDKs run with ``max_retries=0``; this module decides what is retried, when and for how long:

- only *before* anything was yielded to the caller (no silent replay of output);
- only errors classified ``transient`` (429, 408, 409, 5xx, connection errors, timeouts);
- exponential backoff with full jitter, ``Retry-After`` honoured up to ``retry_max_delay``;
- at most ``max_retries`` retries and ``retry_total_timeout`` seconds overall.

``classify`` works on SDK exceptions by class name and attributes, so neither SDK is imported here.
"""

import asyncio
import contextlib
import importlib
import math
import os
import random
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, Protocol

import msgspec

from poddaemon import collector
from poddaemon.llm.sdkload import load_sdk
from poddaemon.llm.types import (
    ModelRequest,
    ModelResponse,
    ProviderError,
    ReasoningDelta,
    RetryScheduled,
    StreamEvent,
    TextDelta,
)


class ProviderSettings(Protocol):
    """The attributes of ``config.manifest.ProviderConfig`` the adapters read."""

    @property
    def kind(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def base_url(self) -> str | None: ...
    @property
    def api_key_env(self) -> str | None: ...
    @property
    def max_retries(self) -> int: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def first_byte_timeout(self) -> float: ...
    @property
    def stream_idle_timeout(self) -> float: ...
    @property
    def retry_initial_delay(self) -> float: ...
    @property
    def retry_max_delay(self) -> float: ...
    @property
    def retry_total_timeout(self) -> float: ...


# ---------------------------------------------------------------------------------------------
# Backoff


def backoff_delay(
    attempt: int,
    initial: float,
    cap: float,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based).

    Full jitter: uniform in ``[0, min(cap, initial * 2**(attempt-1))]``. A server's Retry-After
    replaces the jittered value (the server knows best) but is capped at ``cap`` as well, so a
    hostile or confused header cannot park the pod for an hour.
    """
    cap = max(0.0, cap)
    if retry_after is not None and math.isfinite(retry_after):
        return min(max(0.0, retry_after), cap)
    exponent = min(max(attempt, 1) - 1, 62)  # 2**62 is plenty and keeps the float finite
    ceiling = min(cap, max(0.0, initial) * float(2**exponent))
    return (rng or random).uniform(0.0, ceiling)


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds from the response's ``retry-after-ms`` / ``retry-after`` header, if any."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    if headers is None:
        return None
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return float(ms) / 1000.0
        value = headers.get("retry-after")
    except (AttributeError, TypeError, ValueError):
        return None
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        import email.utils  # rarely needed; ~3 ms to import at start

        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# ---------------------------------------------------------------------------------------------
# Classification

# Patterns for errors only, compiled (and cached by `re`) at first use: ~1 ms of every start.
_CONTEXT = (
    r"(?i)prompt is too long|context[ _]length|context[ _]window|maximum context|too many tokens"
    r"|input is too long|exceeds? the (?:model's )?(?:maximum )?context|reduce the length"
)
# Names of exception classes (anywhere in the MRO) that mean "the connection failed or timed
# out": the SDKs' wrappers and the raw httpx(2) transport errors seen while reading a stream.
_CONNECTION_CLASSES = frozenset(
    {
        "APIConnectionError",
        "APITimeoutError",
        "TransportError",
        "TimeoutException",
        "NetworkError",
        "RemoteProtocolError",
        "ConnectionError",
        "TimeoutError",
        "IncompleteRead",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "overloaded_error",
        "api_error",
        "rate_limit_error",
        "rate_limit_exceeded",
        "server_error",
        "timeout_error",
        "internal_error",
    }
)
_AUTH_CODES = frozenset({"authentication_error", "permission_error", "invalid_api_key"})


MAX_BODY_CHARS = 300  # of an error body that is not the API's JSON (a proxy's HTML page)
_TITLE = r"(?is)<title[^>]*>(.*?)</title>"
_TAG = r"<[^>]*>"


def _condensed(text: str) -> str:
    """An error body that is not the API's JSON, short enough for a run's error: an HTML
    page's title (or its text), whitespace collapsed, cut at MAX_BODY_CHARS."""
    if "<" in text and ">" in text:
        title = re.search(_TITLE, text)
        text = title.group(1) if title else re.sub(_TAG, " ", text)
    text = " ".join(text.split())
    return text if len(text) <= MAX_BODY_CHARS else text[: MAX_BODY_CHARS - 1] + "…"


def _error_fields(body: object) -> tuple[str, str]:
    """(message, type-or-code) from an error body: ``{"error": {...}}`` or the inner dict, or
    the text itself (the openai SDK keeps a body that is not JSON, or an ``error`` that is a
    string, as Ollama sends, as text)."""
    if isinstance(body, str):
        return (_condensed(body), "")
    if not isinstance(body, dict):
        return ("", "")
    inner = body.get("error", body)
    if not isinstance(inner, dict):
        return (_condensed(str(inner)), "")
    message = inner.get("message")
    code = inner.get("code") or inner.get("type") or ""
    return (message if isinstance(message, str) else "", str(code))


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) and status >= 400 else None


def _url_of(exc: BaseException) -> str | None:
    """Where the failed request went (no query string: it may hold a key), if known."""
    for holder in (exc, getattr(exc, "response", None)):
        try:  # httpx's `.request` raises when it was never set
            url = getattr(getattr(holder, "request", None), "url", None)
        except RuntimeError:
            continue
        if url is not None:
            return str(url).split("?", 1)[0]
    return None


def _root_cause(exc: BaseException) -> str:
    """The innermost message of an exception chain: the SDKs wrap every transport failure in
    'Connection error.', which says neither what failed nor where. Contexts are followed even
    when suppressed (httpcore hides the OSError that says "Connection refused" that way)."""
    text = ""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, BaseExceptionGroup):  # one error per address tried: the last
            current = current.exceptions[-1]
            continue
        if str(current):
            text = str(current)
        current = current.__cause__ or current.__context__
    return text


def classify_error_code(code: str, message: str) -> ProviderError:
    """Map an error code/type from a stream's error event (no HTTP status) to a ProviderError."""
    label = f"{code}: {message}" if message else code
    if code in _TRANSIENT_CODES:
        return ProviderError("transient", label)
    if code in _AUTH_CODES:
        return ProviderError("auth", label)
    if code == "context_length_exceeded" or re.search(_CONTEXT, message):
        return ProviderError("context_overflow", label)
    return ProviderError("fatal", label)


def classify(exc: BaseException) -> ProviderError:
    """Map any exception from an SDK call to a ProviderError (a ProviderError maps to itself)."""
    if isinstance(exc, ProviderError):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = _status_of(exc)
    body_message, code = _error_fields(getattr(exc, "body", None))
    text = body_message or str(exc) or type(exc).__name__
    url = _url_of(exc)
    if status is not None and status >= 400:
        label = f"HTTP {status} from {url}: {text}" if url else f"HTTP {status}: {text}"
        if status in (401, 403):
            return ProviderError("auth", label, status)
        if status == 429 and code == "insufficient_quota":
            # OpenAI's "You exceeded your current quota": a 429 no wait cures (billing does),
            # retried it held every run for minutes before the same error.
            return ProviderError("fatal", label, status)
        if status in (408, 409, 429) or status >= 500:
            return ProviderError("transient", label, status)
        if status in (400, 413, 422) and (
            code == "context_length_exceeded" or re.search(_CONTEXT, f"{text} {exc}")
        ):
            return ProviderError("context_overflow", label, status)
        return ProviderError("fatal", label, status)
    if names & _CONNECTION_CLASSES:
        where = f" ({url})" if url else ""
        if "APITimeoutError" in names:  # its cause is the HTTP stack's ("cancel scope ...")
            return ProviderError(
                "transient",
                f"the request timed out (provider.connect_timeout, or a read timeout){where}",
            )
        cause = _root_cause(exc) or text
        return ProviderError("transient", f"{type(exc).__name__}: {cause}{where}")
    # An error event inside a 200 stream: no HTTP status, but the body says what it was.
    if code:
        return classify_error_code(code, text)
    if "JSONDecodeError" in names:  # an SSE event whose data is not JSON
        return ProviderError("fatal", f"malformed event in the provider's stream: {text}")
    return ProviderError("fatal", f"{type(exc).__name__}: {text}")


# ---------------------------------------------------------------------------------------------
# The retrying stream

class KeepAlive:
    """An event that is no part of the answer (a ping, an OpenAI chunk with an empty delta)."""


KEEP_ALIVE = KeepAlive()

# What one attempt yields: content deltas, the final response, ``None`` for SDK events that
# carry nothing for the caller yet are part of the answer (a tool call's arguments, a block's
# start), or KEEP_ALIVE. Only the first three hold off ``stream_idle_timeout``: a server that
# sent empty chunks for ever held the run for ever.
AttemptEvent = TextDelta | ReasoningDelta | ModelResponse | KeepAlive | None
AttemptFn = Callable[[], AsyncIterator[AttemptEvent]]
Sleep = Callable[[float], Awaitable[None]]


class _Timeout(Exception):
    pass


def _raise(err: ProviderError, cause: BaseException) -> NoReturn:
    if err is cause:
        raise err
    raise err from cause


async def _next_within(it: AsyncIterator[AttemptEvent], seconds: float) -> AttemptEvent:
    """``anext(it)`` or ``_Timeout``; a TimeoutError raised *by* the iterator passes through."""
    try:
        async with asyncio.timeout(seconds) as cm:
            return await anext(it)
    except TimeoutError:
        if cm.expired():
            raise _Timeout() from None
        raise


async def _close(it: AsyncIterator[AttemptEvent]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        # Closing a broken stream may fail again; the first error is the one that matters.
        with contextlib.suppress(Exception):
            await aclose()


def _attempts(n: int) -> str:
    return "1 attempt" if n == 1 else f"{n} attempts"


async def with_retries(
    attempt_fn: AttemptFn,
    cfg: ProviderSettings,
    *,
    sleep: Sleep = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> AsyncGenerator[StreamEvent, None]:
    """Run ``attempt_fn`` until it produces a ModelResponse, retrying per the policy above.

    Yields deltas as they arrive, ``RetryScheduled`` before each backoff sleep, and exactly one
    ModelResponse last. Raises ProviderError: the classified error when it is not retryable,
    ``transient`` naming the attempts when retries are exhausted, ``interrupted`` for any failure
    after output started and ``stalled`` when the stream goes quiet after output started.

    Timers: until the first delta, every wait (for the response, or between keep-alive events)
    is bounded by ``first_byte_timeout`` (in a retry, also by what is left of
    ``retry_total_timeout``) and counts as a transient, retryable failure; keep-alive events
    stretch that phase to ``max(first_byte_timeout, retry_total_timeout)`` at most, from the
    first attempt (a stream that only keeps itself alive would hold the run for ever). After
    the first delta, every gap in the answer is bounded by ``stream_idle_timeout`` (KEEP_ALIVE
    events do not restart it; a tool call's streamed arguments do) and ends the call as
    ``stalled``.
    """
    started = clock()
    patience = max(cfg.first_byte_timeout, cfg.retry_total_timeout)
    attempts = 0
    while True:
        attempts += 1
        output_started = False
        answered = False  # the provider began its answer (billed), shown or not
        last_output = 0.0  # when the answer last moved on: keep-alives do not count
        it = attempt_fn()
        try:
            while True:
                if output_started:
                    limit = cfg.stream_idle_timeout - (clock() - last_output)
                elif attempts == 1:  # a first attempt has the whole first_byte_timeout
                    limit = min(cfg.first_byte_timeout, patience - (clock() - started))
                else:  # a retry never runs past retry_total_timeout (from the first attempt)
                    left = cfg.retry_total_timeout - (clock() - started)
                    limit = min(cfg.first_byte_timeout, left)
                limit = max(0.0, limit)
                try:
                    event = await _next_within(it, limit)
                except _Timeout:
                    if output_started:
                        idle = cfg.stream_idle_timeout
                        raise ProviderError(
                            "stalled",
                            f"provider stream stalled: no data for {idle:g}s after output started "
                            "(provider.stream_idle_timeout)",
                        ) from None
                    if limit < cfg.first_byte_timeout and attempts == 1:
                        raise ProviderError(
                            "transient",
                            f"no output from provider within {patience:g}s (only keep-alive "
                            "events; provider.retry_total_timeout)",
                        ) from None
                    setting = (  # the one that bounded this wait: the user's knob
                        "first_byte_timeout"
                        if limit >= cfg.first_byte_timeout
                        else "retry_total_timeout"
                    )
                    raise ProviderError(
                        "transient",
                        f"no response from provider within {limit:g}s (provider.{setting})",
                    ) from None
                except StopAsyncIteration:
                    raise ProviderError(
                        "transient", "provider stream ended without a final response"
                    ) from None
                if event is KEEP_ALIVE:
                    continue
                last_output = clock()
                answered = True
                if event is None:
                    continue
                if isinstance(event, ModelResponse):
                    yield event
                    return
                assert not isinstance(event, KeepAlive)
                output_started = True
                yield event
        except Exception as exc:
            err = classify(exc)
            if output_started:
                if err.kind in ("stalled", "interrupted"):
                    _raise(err, exc)
                raise ProviderError(
                    "interrupted",
                    f"stream interrupted after output started: {err.message}",
                    err.status,
                ) from exc
            if err.kind != "transient":
                err.answered = answered
                _raise(err, exc)
            if attempts > cfg.max_retries:
                raise ProviderError(
                    "transient",
                    f"provider failed after {_attempts(attempts)}: {err.message}",
                    err.status,
                    answered=answered,
                ) from exc
            delay = backoff_delay(
                attempts, cfg.retry_initial_delay, cfg.retry_max_delay, retry_after_of(exc), rng
            )
            if clock() - started + delay > cfg.retry_total_timeout:
                raise ProviderError(
                    "transient",
                    f"provider failed after {_attempts(attempts)} "
                    f"(retry_total_timeout {cfg.retry_total_timeout:g}s): {err.message}",
                    err.status,
                    answered=answered,
                ) from exc
            yield RetryScheduled(
                attempt=attempts, delay=delay, error=err.message, answered=answered
            )
            await sleep(delay)
        finally:
            await _close(it)


# ---------------------------------------------------------------------------------------------
# Base class for the SDK adapters


class RetryingClient:
    """A ModelClient: lazily imports its SDK (in a thread), builds the SDK's async client once,
    and runs each request through ``with_retries``. Subclasses supply the SDK module name,
    the client construction and one streaming attempt."""

    sdk_module: str = ""

    def __init__(self, cfg: ProviderSettings, *, sleep: Sleep = asyncio.sleep) -> None:
        self.cfg = cfg
        self._sleep = sleep
        self._sdk: Any = None
        self._client: Any = None
        self._platform: Any = None  # the SDK's platform for its headers, found at warm-up
        self._lock = asyncio.Lock()

    async def warm(self) -> None:
        await self._ensure_client()

    async def _ensure_client(self) -> Any:
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    # Built in the thread too: the build still imports (the SDK's client module,
                    # which load_sdk defers), and an import stuck there must not stop this
                    # loop (the pod's stop waits for it to close the client).
                    self._client = await asyncio.to_thread(self._load_and_build)
        return self._client

    def _load_and_build(self) -> Any:
        with collector.paused():  # the SDK's modules live as long as the pod (see collector)
            if self._sdk is None:
                self._sdk = self._load_sdk()
            client = self._build(self._sdk)
        if self._platform is not None and getattr(client, "_platform", 0) is None:
            client._platform = self._platform  # see _load_sdk
        return client

    def _load_sdk(self) -> Any:
        """Import the SDK (in a worker thread) and do there what its first request would
        otherwise do lazily: find the platform for its headers (openai's runs `uname -p`, a
        fork and exec, from a thread it starts for it) and import anyio's asyncio backend
        (~8 ms, at the first connection). Best effort: a step that fails here is simply done
        again where the SDK does it."""
        sdk = load_sdk(self.sdk_module)
        with contextlib.suppress(Exception):
            base = importlib.import_module(f"{self.sdk_module}._base_client")
            self._platform = base.get_platform()
        with contextlib.suppress(Exception):
            importlib.import_module("anyio._backends._asyncio")
        return sdk

    def _build(self, sdk: Any) -> Any:
        raise NotImplementedError

    def _attempt(self, client: Any, req: ModelRequest) -> AsyncIterator[AttemptEvent]:
        raise NotImplementedError

    async def stream(self, req: ModelRequest) -> AsyncGenerator[StreamEvent, None]:
        try:
            client = await self._ensure_client()
        except ProviderError:
            raise
        except Exception as exc:  # e.g. the SDK refused the configuration
            raise ProviderError("fatal", f"cannot create {self.sdk_module} client: {exc}") from exc
        attempts = with_retries(lambda: self._attempt(client, req), self.cfg, sleep=self._sleep)
        key = os.environ.get(api_key_env_name(self.cfg), "").strip()
        try:
            async with contextlib.aclosing(
                attempts
            ):  # a consumer that stops early closes the HTTP stream
                async for event in attempts:
                    if isinstance(event, RetryScheduled):
                        event = msgspec.structs.replace(event, error=redacted(event.error, key))
                    yield event
        except ProviderError as exc:
            if key and key in exc.message:
                message = redacted(exc.message, key)
                raise ProviderError(
                    exc.kind, message, exc.status, answered=exc.answered
                ) from None
            raise

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


MIN_REDACTED_KEY = 8  # shorter "keys" are placeholders (a local server's "ollama"), not secrets


def redacted(text: str, key: str) -> str:
    """``text`` without the API key: a provider or proxy may echo it in an error ("Incorrect
    API key provided: sk-…"), and an error reaches `podctl`, events, the session log and the
    pod's log."""
    if len(key) < MIN_REDACTED_KEY:
        return text
    return text.replace(key, "[redacted API key]")


def sdk_timeout(sdk: Any, cfg: ProviderSettings) -> Any:
    """The SDK's httpx Timeout: our own first-byte/idle timers are tighter; the read timeout is
    only a backstop so a dead socket cannot hang a worker thread forever."""
    backstop = max(cfg.first_byte_timeout, cfg.stream_idle_timeout) + 5.0
    return sdk.Timeout(backstop, connect=cfg.connect_timeout)


def api_key_env_name(cfg: ProviderSettings) -> str:
    if cfg.api_key_env:
        return cfg.api_key_env
    return "ANTHROPIC_API_KEY" if cfg.kind == "anthropic" else "OPENAI_API_KEY"
