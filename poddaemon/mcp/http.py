"""The HTTP transport of a `url` server, with the limit the stdio one has: a JSON body over
MAX_LINE fails its message, not the pod. (The SDK reads a JSON body whole, however long: a
server streaming one without end took the pod's memory, ~280 MiB a second, until the call's
timeout. Its SSE events have their own limit.)

Imported once the SDK is (it needs httpx2 and the SDK's defaults)."""

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx2
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

from poddaemon.mcp.stdio import MAX_LINE


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


class _CappedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, limit: int, refused: Callable[[str | None], None]) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self._limit = limit
        self._refused = refused

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if request.method == "POST":  # a message; a GET or DELETE may be refused (405) by design
            status = response.status_code
            self._refused(
                f"HTTP {status} {httpx2.codes.get_reason_phrase(status)}" if status >= 400 else None
            )
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _Capped(response.stream, self._limit)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _ignore(status: str | None) -> None:
    pass


@asynccontextmanager
async def http_transport(
    url: str, limit: int = MAX_LINE, refused: Callable[[str | None], None] = _ignore
) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport to `url`, its bodies capped at `limit` bytes.
    `refused` is told the status of each POST the server refused ("HTTP 401 Unauthorized"),
    and None for each it took: the SDK's error for one says "Server returned an error
    response", whatever the status, so a start that failed for a missing token said only that."""
    timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
    transport = _CappedTransport(limit, refused)
    async with (
        httpx2.AsyncClient(timeout=timeout, transport=transport) as client,
        streamable_http_client(url, http_client=client) as streams,
    ):
        yield streams
