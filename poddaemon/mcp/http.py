"""The HTTP transport of a `url` server, with the limit the stdio one has: a JSON body over
MAX_LINE fails its message, not the pod. (The SDK reads a JSON body whole, however long: a
server streaming one without end took the pod's memory, ~280 MiB a second, until the call's
timeout. Its SSE events have their own limit.) A POST whose connection fails before its answer
fails its message too, not the whole connection. A JSON-RPC batch in a body or an SSE event
reaches the SDK as its messages, one by one, and a reply with neither result nor error as an
error saying so, as over stdio (the SDK reads one message per body or event, and failed both).

Imported once the SDK is (it needs httpx2 and the SDK's defaults)."""

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import msgspec
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT
from mcp_types import CONNECTION_CLOSED

from poddaemon.mcp.stdio import DROPPED, MAX_LINE, batch_items, broken_reply, stand_in
from protocol.unreadable import UNREADABLE

log = logging.getLogger("poddaemon.mcp")

# Requests that change nothing: one whose connection failed before its answer is sent again, once.
IDEMPOTENT = frozenset({"ping", "tools/list"})


class _Capped(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                # StreamError: the SDK fails the one message it answers, the session stays.
                raise httpx2.StreamError(
                    f"the server's answer is over the {self._limit >> 20} MiB limit; "
                    "it was discarded"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


# A reply whose result is an object, as every good one's is: what `messages` passes on without
# decoding (it holds the key only as a key: a string's quotes inside JSON text are escaped).
_OBJECT_RESULT = re.compile(rb'"result"\s*:\s*\{')


def messages(text: bytes) -> list[bytes] | None:
    """The messages one JSON text of the server's (a body, an SSE event's data) carries, as the
    SDK can read them, or None to pass it on as it is: a batch's messages one by one, and in
    place of a reply that breaks the protocol (neither result nor error, a result that is no
    object), an error saying so."""
    if text.lstrip().startswith(b"["):
        return batch_items(text)
    if _OBJECT_RESULT.search(text) or b'"error"' in text or b'"method"' in text:
        return None  # any other message: not decoded twice
    try:
        broken = broken_reply(msgspec.json.decode(text))
    except UNREADABLE:
        return None
    return None if broken is None else [broken]


def sse_events(texts: list[bytes]) -> bytes:
    """Messages as the SSE events of a stream."""
    return b"".join(b"event: message\ndata: " + text + b"\n\n" for text in texts)


_EOL = re.compile(rb"\r\n|\r|\n")


class SseRewriter:
    """An SSE stream, event by event, with the data of each as `messages` has it: a batch is an
    event per message, the event's id on the last (the point a resumed stream goes on from).
    Bytes in, bytes out; an event is held until its end (the SDK's parser holds it too), and a
    stream with one over `limit` bytes is passed on as it is from there (the SDK fails it)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._rest = b""  # the start of a line
        self._event: list[bytes] = []  # the lines of the event being read
        self._size = 0
        self._passing = False
        self.resumable = False  # an event had an id: the SDK resumes the stream from it

    def feed(self, chunk: bytes) -> bytes:
        if self._passing:
            return chunk
        data = self._rest + chunk
        # A CR at the end may be the first half of a CRLF: it waits for the next chunk.
        end = len(data) - 1 if data.endswith(b"\r") else len(data)
        *lines, rest = _EOL.split(data[:end])
        self._rest = rest + data[end:]
        out: list[bytes] = []
        for line in lines:
            if line:
                self._event.append(line)
                self._size += len(line) + 1
                name, value = _field(line)
                self.resumable = self.resumable or (name == b"id" and bool(value))
            else:
                out.append(_event(self._event))
                self._event, self._size = [], 0
        if self._size + len(self._rest) > self._limit:
            self._passing = True
            out.append(self.end())
        return b"".join(out)

    def end(self) -> bytes:
        """What is held, as it came (an event cut short is no event: the SDK drops it)."""
        done = b""
        if not self._passing and self._rest.endswith(b"\r"):
            # The stream's last CR: a line end of its own, not half of a CRLF after all. Held
            # as one, an event ended by it was passed on unread (its batch not split).
            self._rest = self._rest[:-1]
            done = self.feed(b"\n")
        held = b"".join(line + b"\n" for line in self._event) + self._rest
        self._event, self._size, self._rest = [], 0, b""
        return done + held


def _event(lines: list[bytes]) -> bytes:
    """One SSE event (its lines, without the empty one that ends it), rewritten."""
    fields = [_field(line) for line in lines]
    data = [value for name, value in fields if name == b"data"]
    kind = next((value for name, value in reversed(fields) if name == b"event"), b"message")
    texts = messages(b"\n".join(data)) if data and kind == b"message" else None
    if texts is None:
        return b"".join(line + b"\n" for line in lines) + b"\n"
    named = list(zip(lines, (name for name, _ in fields), strict=True))
    ids = [line for line, name in named if name == b"id"]
    others = [line for line, name in named if name not in (b"data", b"id", b"")]  # no comments
    out: list[bytes] = []
    for i, text in enumerate(texts):
        out += [*others, b"data: " + text, *(ids if i == len(texts) - 1 else []), b""]
    if not texts and ids:  # an empty batch: its id still counts
        out += [*ids, b""]
    return b"".join(line + b"\n" for line in out)


def _field(line: bytes) -> tuple[bytes, bytes]:
    """(name, value) of an SSE line; a comment's name is empty."""
    name, _, value = line.partition(b":")
    return name, value[1:] if value.startswith(b" ") else value


class _SseMessages(httpx2.AsyncByteStream):
    """An SSE body as SseRewriter has it. The stream answering request `rid` that ends, or
    fails, before the SDK has its answer (it stops reading there) and cannot be resumed (no
    event had an id) ends with an error answering it, as a POST whose connection fails
    before its answer (DROPPED): the SDK's own error said the server had "refused" the call."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int, rid: int | str | None) -> None:
        self._inner = inner
        self._limit = limit
        self._rid = rid

    async def __aiter__(self) -> AsyncIterator[bytes]:
        rewriter = SseRewriter(self._limit)
        try:
            async for chunk in self._inner:
                if out := rewriter.feed(chunk):
                    yield out
        except httpx2.TransportError as exc:
            if self._rid is None or rewriter.resumable:
                raise
            why = _failure(exc)
        else:
            held = rewriter.end()
            if self._rid is None or rewriter.resumable:
                if held:
                    yield held
                return
            why = "its event stream ended without it"
        # What is held is an event cut short, which is no event.
        yield sse_events([stand_in(self._rid, CONNECTION_CLOSED, why, DROPPED)])

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Decoded(httpx2.AsyncByteStream):
    """A response's body decoded from its content-encoding: an SSE stream a server (or a
    proxy in front of it) sent gzip-compressed was passed on unread, its batches and broken
    replies left to the SDK, which cannot read them. A body that does not decode fails as a
    connection cut short would."""

    def __init__(self, response: httpx2.Response) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx2.DecodingError as exc:
            raise httpx2.ReadError(f"the server's event stream cannot be decoded ({exc})") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class _Failing(httpx2.AsyncByteStream):
    """A body that fails with `message` when read: the SDK fails the one message it answers."""

    def __init__(self, message: str) -> None:
        self._message = message

    async def __aiter__(self) -> AsyncIterator[bytes]:
        raise httpx2.StreamError(self._message)
        yield b""  # an async generator, which never gets here


class _CappedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, name: str, limit: int, refused: Callable[[str | None], None]) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self._name = name
        self._limit = limit
        self._refused = refused

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.method != "POST":  # a GET's stream, a DELETE: the SDK handles their failures
            return self._capped(await self._inner.handle_async_request(request), request)
        message = _message_of(request)
        method = message.get("method")
        for attempt in (1, 2):
            try:
                return await self._post(request, message)
            except httpx2.TransportError as exc:
                # Found by QA: raised to the SDK, it broke the whole connection, and one POST a
                # server (a proxy, a worker recycled) closed unanswered cost its one restart.
                # A server that is gone cannot answer the ping that follows: then it is lost.
                why = _failure(exc)
                if attempt == 1 and method in IDEMPOTENT:
                    log.info("mcp[%s] %s got no answer, %s: sent again", self._name, method, why)
                    continue
                return _dropped(self._name, request, message, why)
        raise AssertionError("unreachable")

    async def _post(self, request: httpx2.Request, message: dict[str, Any]) -> httpx2.Response:
        """One POST of a message; its JSON answer read whole here, so that a connection lost
        during it fails that message (the SDK's read would have raised past it)."""
        response = await self._inner.handle_async_request(request)
        status = response.status_code
        self._refused(
            f"HTTP {status} {httpx2.codes.get_reason_phrase(status)}" if status >= 400 else None
        )
        if status >= 300 or not response.headers.get("content-type", "").startswith(
            "application/json"
        ):
            return self._capped(response, request, _request_id(message))
        try:
            body = await self._read(response)
        except httpx2.DecodingError as exc:  # a body its content-encoding does not decode
            failed = f"the server's answer cannot be read ({exc})"
            return _answer(response, request, _Failing(failed))
        if body is None:
            over = f"the server's answer is over the {self._limit >> 20} MiB limit"
            over += "; it was discarded"
            return _answer(response, request, _Failing(over))
        texts = messages(body)
        if texts is None:
            return _answer(response, request, httpx2.ByteStream(body))
        if body.lstrip().startswith(b"["):  # a batch: the SDK reads many messages from SSE only
            sse = _answer(response, request, httpx2.ByteStream(sse_events(texts)))
            sse.headers["content-type"] = "text/event-stream"
            return sse
        return _answer(response, request, httpx2.ByteStream(texts[0]))

    async def _read(self, response: httpx2.Response) -> bytes | None:
        """The whole body, decoded (gzip and such), or None past the limit (the rest unread)."""
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self._limit:
                    return None
                chunks.append(chunk)
        finally:
            await response.aclose()
        return b"".join(chunks)

    def _capped(
        self, response: httpx2.Response, request: httpx2.Request, rid: int | str | None = None
    ) -> httpx2.Response:
        """`response` with its body capped, or, an SSE stream (answering request `rid`, if a
        POST's), rewritten."""
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.stream = _Capped(response.stream, self._limit)
        elif response.headers.get("content-encoding", "identity") == "identity":
            response.stream = _SseMessages(response.stream, self._limit, rid)
        else:  # compressed (gzip…): decoded here, so that its events can be read
            decoded = _SseMessages(_Decoded(response), self._limit, rid)
            return _answer(response, request, decoded)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _failure(exc: httpx2.TransportError) -> str:
    """What became of a POST's connection, for the message it fails."""
    detail = f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'no detail'}"
    if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout):
        return f"the server cannot be reached ({detail})"
    if isinstance(exc, httpx2.TimeoutException):
        return f"it timed out ({detail})"
    return f"the connection closed ({detail})"


def _message_of(request: httpx2.Request) -> dict[str, Any]:
    """The JSON-RPC message a POST carries ({} if it cannot be read)."""
    try:
        message = msgspec.json.decode(request.content)
    except (httpx2.RequestNotRead, *UNREADABLE):
        return {}
    return message if isinstance(message, dict) else {}


def _request_id(message: dict[str, Any]) -> int | str | None:
    """The id of a request (None for a notification, or a reply of ours)."""
    rid = message.get("id")
    if "method" not in message or isinstance(rid, bool) or not isinstance(rid, int | str):
        return None
    return rid


def _answer(
    response: httpx2.Response, request: httpx2.Request, body: httpx2.AsyncByteStream
) -> httpx2.Response:
    """`response` with `body` in place of its own, which was read and decoded."""
    headers = [
        (k, v)
        for k, v in response.headers.multi_items()
        if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")
    ]
    return httpx2.Response(
        response.status_code,
        headers=headers,
        stream=body,
        request=request,
        extensions=response.extensions,
    )


def _dropped(
    name: str, request: httpx2.Request, message: dict[str, Any], why: str
) -> httpx2.Response:
    """What the SDK gets for a POST whose connection failed before its answer: for a request,
    an error answering it (CONNECTION_CLOSED, which has the server pinged, marked DROPPED for
    the words); for a notification or a reply of ours, nothing (202: none awaits an answer)."""
    rid = _request_id(message)
    if rid is None:
        said = message.get("method") or "a reply to the server"
        log.warning("mcp[%s] %s: the connection closed (%s)", name, said, why)
        return httpx2.Response(202, request=request)
    body = stand_in(rid, CONNECTION_CLOSED, why, DROPPED)
    headers = {"content-type": "application/json"}
    return httpx2.Response(200, headers=headers, content=body, request=request)


def _ignore(status: str | None) -> None:
    pass


@asynccontextmanager
async def http_transport(
    url: str,
    limit: int = MAX_LINE,
    refused: Callable[[str | None], None] = _ignore,
    name: str = "?",
) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport to `url`, its bodies capped at `limit` bytes.
    `refused` is told the status of each POST the server refused ("HTTP 401 Unauthorized"),
    and None for each it took: the SDK's error for one says "Server returned an error
    response", whatever the status, so a start that failed for a missing token said only that.
    `name`, the server's, names it in the log."""
    timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
    transport = _CappedTransport(name, limit, refused)
    async with (
        httpx2.AsyncClient(timeout=timeout, transport=transport) as client,
        streamable_http_client(url, http_client=client) as streams,
    ):
        yield streams
