"""A local fake model server speaking the real wire formats, for tests and offline trials.

Real HTTP/1.1 on 127.0.0.1 (stdlib `ThreadingHTTPServer`, keep-alive, chunked SSE):

- ``POST /v1/chat/completions``  OpenAI Chat Completions (streaming and not)
- ``POST /v1/responses``         OpenAI Responses (streaming and not)
- ``POST /v1/messages``          Anthropic Messages (streaming and not)
- ``POST /_fake/script`` (``{"replies": [...]}``, appended; with ``"when": marker`` (Python:
  ``script_when``) they answer only requests whose last user text contains the marker, with
  ``"model": M`` only requests for model M, see ``script_model``), ``GET /_fake/requests``,
  ``POST /_fake/gate/<name>``, ``POST /_fake/reset``, ``GET /_fake/health``

As OpenAI does, its two OpenAI routes answer 400 to a request whose tools hold an array schema
without ``items`` (the scripted reply is consumed all the same).

Each model request (faulty or not) is recorded as ``{path, body, headers}`` and consumes the next
scripted reply; with an empty script the answer is ``ok: <last user text, 200 chars>``. A reply:

- ``text``, ``reasoning`` (chat: ``delta.reasoning_content``; responses: a reasoning item with a
  summary; anthropic: a ``thinking`` block with a signature), streamed in pieces of the
  server's chunk size (``--chunk-size``; not a reply field).
- ``tool_calls: [{name, arguments: object | raw JSON str, id?}]``; ids default to
  ``call_<serial>_<i>`` (OpenAI) / ``toolu_<serial>_<i>`` (Anthropic).
- ``stop: "end" | "max_tokens" | "content_filter"`` -> chat ``stop``/``tool_calls``, ``length``,
  ``content_filter``; responses ``completed``, ``incomplete`` (``max_output_tokens`` /
  ``content_filter``); anthropic ``end_turn``/``tool_use``, ``max_tokens``, ``refusal``.
- ``usage: {input, output, cache_read, cache_write}``: provider-neutral and non-overlapping
  (``input`` = uncached input). Anthropic reports them as they are; the OpenAI formats report
  ``prompt_tokens``/``input_tokens`` = input + cache_read + cache_write, as OpenAI does. Missing
  numbers default to request bytes // 4 (input), produced chars // 4 (output), 0 (caches).
- ``gate: name``: the answer waits until the gate is opened (gates stay open until reset).
- ``delay: seconds`` between streamed deltas.
- ``stream: false``: answer in one JSON body even when the request asked to stream (as some
  OpenAI-compatible servers do); ``content_type``: the event stream's Content-Type header
  instead of ``text/event-stream`` (a server or proxy that mislabels it).
- ``fault``: ``{kind: "status", status, retry_after?, message?, type?, body?, content_type?}``
  (the API's error JSON, ``Retry-After`` header; ``body``: this text instead, verbatim, as
  ``content_type``, default ``text/plain``: a proxy's HTML page, Ollama's ``{"error": "..."}``;
  ``status`` 200 only with a ``body``: an error object sent as if it were the answer);
  ``{kind: "hang", seconds, headers?}`` (stall, then drop the connection; ``headers``
  defaults to true for streams); ``{kind: "cut", after_chunks, finals?}`` (stream that many deltas,
  then drop the connection; ``finals``: how many of the terminal events still go out first,
  default none: chat's finish_reason chunk, its usage chunk, ``[DONE]``; anthropic's
  ``message_delta``, ``message_stop``; non-streaming: half the body).

Python: ``with FakeModel().start() as fake: fake.script({...}); ...``.
Standalone: ``python -m poddaemon.testing.fake_model [--host H] [--port N] [--script F.json]``
prints ``FAKE-MODEL-READY\\t<url>`` and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import msgspec

from poddaemon.testing import _anthropic_wire, _openai_wire
from poddaemon.testing._plan import (
    Event,
    Plan,
    Reply,
    dumps,
    last_user_text,
    make_plan,
    validate_reply,
)

__all__ = ["READY_PREFIX", "FakeModel", "main"]

READY_PREFIX = "FAKE-MODEL-READY"
DEFAULT_CHUNK_SIZE = 20
_MAX_LINE = 65536
_MAX_HEADERS = 100


@dataclass(frozen=True, slots=True)
class _Route:
    call_id_prefix: str
    request_id_header: bytes
    render: Callable[[Plan], dict[str, Any]]
    stream: Callable[[Plan], Iterator[Event]]
    error: Callable[[int, str, str | None], dict[str, Any]]


_ROUTES: dict[str, _Route] = {
    "/v1/chat/completions": _Route(
        "call_",
        b"x-request-id",
        _openai_wire.chat_completion,
        _openai_wire.chat_stream,
        _openai_wire.error_body,
    ),
    "/v1/responses": _Route(
        "call_",
        b"x-request-id",
        _openai_wire.response_object,
        _openai_wire.responses_stream,
        _openai_wire.error_body,
    ),
    "/v1/messages": _Route(
        "toolu_",
        b"request-id",
        _anthropic_wire.message_object,
        _anthropic_wire.messages_stream,
        _anthropic_wire.error_body,
    ),
}

_decode = msgspec.json.decode
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
)
_JSON_CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
)


class FakeModel:
    """The fake model server, run in a background thread.

    Thread-safe: every piece of shared state sits behind one condition variable, which also
    wakes `wait_for_requests`, gated requests and hanging faults.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        verbose: bool = False,
    ) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        self._host = host
        self._port = port
        self.chunk_size = chunk_size
        self.verbose = verbose
        self._cv = threading.Condition()
        self._queue: collections.deque[Reply] = collections.deque()
        # marker -> replies for requests whose last user text contains the marker
        self._keyed: dict[str, collections.deque[Reply]] = {}
        # Requests naming one of these models take their replies from its own queue (empty:
        # the echo answer), so pods of a tree can be scripted apart.
        self._by_model: dict[str, collections.deque[Reply]] = {}
        self._requests: list[dict[str, Any]] = []
        self._opened: set[str] = set()
        self._generation = 0
        self._stopping = False
        self._serial = 0
        self._connections: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> FakeModel:
        if self._server is not None:
            raise RuntimeError("FakeModel already started")
        server = _Server((self._host, self._port), _Handler)
        server.fake = self
        self._server = server
        self._port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-model",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; wake gated and hanging requests; drop every open connection."""
        server = self._server
        if server is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            connections = list(self._connections)
        server.shutdown()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> FakeModel:
        return self if self._server is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------ public API

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """Base URL without ``/v1``: what the anthropic SDK takes as ``base_url``."""
        return f"http://{self._host}:{self._port}"

    @property
    def openai_base_url(self) -> str:
        """``url + "/v1"``: what the openai SDK takes as ``base_url``."""
        return self.url + "/v1"

    def script(self, *replies: Reply) -> None:
        """Append replies to the queue; each model request consumes one, in order."""
        checked = [validate_reply(r) for r in replies]
        with self._cv:
            self._queue.extend(checked)

    def script_when(self, marker: str, *replies: Reply) -> None:
        """Replies for requests whose last user text contains `marker` (e.g. a summary
        prompt): such requests never consume the main queue; with none left for them they get
        the default answer."""
        checked = [validate_reply(r) for r in replies]
        with self._cv:
            self._keyed.setdefault(marker, collections.deque()).extend(checked)

    def script_model(self, model: str, *replies: Reply) -> None:
        """Append replies for requests whose `model` is `model` only (the rest use `script`)."""
        checked = [validate_reply(r) for r in replies]
        with self._cv:
            self._by_model.setdefault(model, collections.deque()).extend(checked)

    @property
    def pending(self) -> int:
        """How many scripted replies are still queued."""
        with self._cv:
            return len(self._queue)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every model request so far, ``{path, body, headers}``, oldest first (a copy)."""
        with self._cv:
            return list(self._requests)

    def wait_for_requests(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Block until at least `n` model requests arrived; raise `TimeoutError` otherwise."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._requests) >= n, timeout):
                raise TimeoutError(
                    f"fake model: {len(self._requests)} request(s) after {timeout}s, wanted {n}"
                )
            return list(self._requests)

    def open_gate(self, name: str) -> None:
        """Release requests blocked on gate `name`; it stays open until `reset()`."""
        with self._cv:
            self._opened.add(name)
            self._cv.notify_all()

    def reset(self) -> None:
        """Forget replies, recorded requests and opened gates; requests still blocked on a
        gate or hanging are released by dropping their connection."""
        with self._cv:
            self._queue.clear()
            self._keyed.clear()
            self._by_model.clear()
            self._requests.clear()
            self._opened.clear()
            self._generation += 1
            self._cv.notify_all()

    # ------------------------------------------------------------ used by the handler

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._cv:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _take(self, path: str, body: Any, headers: dict[str, str]) -> tuple[Reply | None, int, int]:
        """Record a request and pop its reply: (reply or None, serial, generation)."""
        with self._cv:
            self._requests.append({"path": path, "body": body, "headers": headers})
            keyed = self._keyed_queue(body)
            queue = self._queue if keyed is None else keyed
            model = body.get("model") if isinstance(body, dict) else None
            if keyed is None and isinstance(model, str):
                queue = self._by_model.get(model, self._queue)
            reply = queue.popleft() if queue else None
            self._serial += 1
            self._cv.notify_all()
            return reply, self._serial, self._generation

    def _keyed_queue(self, body: Any) -> collections.deque[Reply] | None:
        if not self._keyed:
            return None
        text = last_user_text(body)
        for marker, queue in self._keyed.items():
            if marker in text:
                return queue
        return None

    def _wait_gate(self, name: str, generation: int) -> bool:
        """Wait until gate `name` opens; False if released by `reset()`/`stop()` instead."""
        with self._cv:
            self._cv.wait_for(
                lambda: name in self._opened or self._stopping or self._generation != generation
            )
            return not self._stopping and self._generation == generation

    def _pause(self, seconds: float, generation: int) -> bool:
        """Sleep up to `seconds`; return early (False) on `reset()`/`stop()`."""
        with self._cv:
            interrupted = self._cv.wait_for(
                lambda: self._stopping or self._generation != generation, seconds
            )
            return not interrupted

    def _replies_from_control(self, raw: bytes) -> list[Reply]:
        payload = _decode(raw) if raw else {}
        replies = payload.get("replies") if isinstance(payload, dict) else None
        if not isinstance(replies, list):
            raise ValueError('expected {"replies": [...]}')
        return [validate_reply(r) for r in replies]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # idle keep-alive connections would otherwise block server_close()
    fake: FakeModel

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError) or self.fake._stopping:
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # small SSE writes must leave at once
    server: _Server
    fields: dict[str, str]  # this request's headers, names lower-cased

    def setup(self) -> None:
        super().setup()
        self.server.fake._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.fake._track(self.connection, False)

    def handle_one_request(self) -> None:
        """Read one request and dispatch it to ``do_<METHOD>``.

        A lean replacement for the stdlib's, whose `email`-based header parsing costs ~60 µs
        a request (this one ~12 µs): the fake's own latency is part of every benchmark.
        """
        line = self.rfile.readline(_MAX_LINE + 1)
        if not line:
            self.close_connection = True
            return
        parts = line.split()
        if len(line) > _MAX_LINE or len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self.close_connection = True
            self._send_json(400, {"error": {"message": "bad request line"}})
            return
        self.requestline = line.decode("latin-1").rstrip("\r\n")
        self.command, self.path, self.request_version = (p.decode("latin-1") for p in parts)
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS):
            raw = self.rfile.readline(_MAX_LINE + 1)
            if raw in (b"\r\n", b"\n", b""):
                break
            key, sep, value = raw.partition(b":")
            if sep:
                headers[key.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        self.fields = headers
        connection = headers.get("connection", "").lower()
        self.close_connection = connection == "close" or (
            self.request_version == "HTTP/1.0" and connection != "keep-alive"
        )
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.close_connection = True
            self._send_json(411, {"error": {"message": "send a Content-Length"}})
            return
        if headers.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self._read_body()
            self._send_json(405, {"error": {"message": f"method {self.command} not allowed"}})
        else:
            method()
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.fake.verbose:
            sys.stderr.write(f"fake-model: {format % args}\n")

    # ------------------------------------------------------------ plumbing

    def _send(
        self,
        status: int,
        body: bytes,
        extra: Iterable[bytes] = (),
        content_type: str = "application/json",
    ) -> None:
        reason = self.responses.get(status, ("Error",))[0]
        head = [
            b"HTTP/1.1 %d %s\r\n" % (status, reason.encode()),
            b"Content-Type: %s\r\n" % content_type.encode(),
            b"Content-Length: %d\r\n" % len(body),
            *extra,
        ]
        if self.close_connection:
            head.append(b"Connection: close\r\n")
        self.wfile.write(b"".join(head) + b"\r\n" + body)
        if self.server.fake.verbose:
            self.log_request(status, len(body))

    def _send_json(self, status: int, obj: object) -> None:
        self._send(status, dumps(obj))

    def _abort(self) -> None:
        """Drop the connection without finishing the response (a torn stream)."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def _read_body(self) -> bytes:
        length = int(self.fields.get("content-length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    # ------------------------------------------------------------ methods

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        self._read_body()
        if path == "/_fake/requests":
            self._send_json(200, self.server.fake.requests)
        elif path == "/_fake/health":
            self._send_json(200, {"ok": True})
        else:
            self._send_json(404, {"error": {"message": f"no GET route {path}"}})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        raw = self._read_body()
        try:
            if path.startswith("/_fake/"):
                self._control(path, raw)
                return
            route = _ROUTES.get(path)
            if route is None:
                self._send_json(
                    404, {"error": {"message": f"no route {path}", "type": "not_found"}}
                )
                return
            self._model(path, route, raw)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _control(self, path: str, raw: bytes) -> None:
        fake = self.server.fake
        if path == "/_fake/script":
            try:
                replies = fake._replies_from_control(raw)
            except (ValueError, msgspec.DecodeError) as exc:
                self._send_json(400, {"error": str(exc)})
                return
            payload = _decode(raw) if raw else {}
            when = payload.get("when") if isinstance(payload, dict) else None
            model = payload.get("model") if isinstance(payload, dict) else None
            if isinstance(when, str) and when:
                fake.script_when(when, *replies)
            elif isinstance(model, str):  # {"model": M, "replies": [...]}: for that model only
                fake.script_model(model, *replies)
            else:
                fake.script(*replies)
            self._send_json(200, {"queued": fake.pending})
        elif path == "/_fake/reset":
            fake.reset()
            self._send_json(200, {"ok": True})
        elif path.startswith("/_fake/gate/") and len(path) > len("/_fake/gate/"):
            fake.open_gate(path[len("/_fake/gate/") :])
            self._send_json(200, {"ok": True})
        else:
            self._send_json(404, {"error": f"no control route {path}"})

    def _model(self, path: str, route: _Route, raw: bytes) -> None:
        fake = self.server.fake
        headers = self.fields
        try:
            body = _decode(raw)
        except msgspec.DecodeError as exc:
            fake._take(path, raw.decode("utf-8", "replace"), headers)
            self._send_json(400, route.error(400, f"invalid JSON body: {exc}", None))
            return
        reply, serial, generation = fake._take(path, body, headers)
        refusal = _openai_wire.schema_refusal(body) if route.call_id_prefix == "call_" else None
        if refusal is not None:  # as OpenAI refuses it, whatever was scripted
            self._send_json(400, route.error(400, refusal, "invalid_request_error"))
            return
        rid = route.request_id_header + b": req_%d\r\n" % serial
        reply = reply or {}
        # `stream: false` in a reply: a server that answers in one JSON body whatever was asked.
        stream = isinstance(body, dict) and body.get("stream") is True and reply.get("stream", True)
        gate = reply.get("gate")
        if gate is not None and not fake._wait_gate(gate, generation):
            self._abort()
            return
        fault = reply.get("fault") or {}
        kind = fault.get("kind")
        if kind == "status":
            self._status_fault(route, fault, rid)
            return
        if kind == "hang":
            if fault.get("headers", stream):  # default: headers for a stream, nothing if not
                head = _SSE_HEAD if stream else _JSON_CHUNKED_HEAD
                self.wfile.write(head + rid + b"\r\n")
            fake._pause(float(fault["seconds"]), generation)
            self._abort()
            return
        plan = make_plan(
            reply or None,
            body,
            len(raw),
            serial,
            route.call_id_prefix,
            fake.chunk_size,
            int(time.time()),
        )
        cut = fault.get("after_chunks") if kind == "cut" else None
        if stream:
            delay = float(reply.get("delay", 0))
            finals = int(fault.get("finals", 0))
            head = _SSE_HEAD
            if "content_type" in reply:
                head = head.replace(
                    b"text/event-stream; charset=utf-8", reply["content_type"].encode()
                )
            self._stream(route.stream(plan), head + rid, cut, finals, delay, generation)
        elif cut is not None:
            payload = dumps(route.render(plan))
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            self.wfile.write(head % len(payload) + rid + b"\r\n" + payload[: len(payload) // 2])
            self._abort()
        else:
            self._send(200, dumps(route.render(plan)), (rid,))

    def _status_fault(self, route: _Route, fault: dict[str, Any], rid: bytes) -> None:
        status = int(fault["status"])
        message = fault.get("message") or f"fake model: scripted HTTP {status}"
        extra = [rid]
        retry_after = fault.get("retry_after")
        if retry_after is not None:
            extra.append(b"Retry-After: %s\r\n" % format(retry_after, "g").encode())
        body = fault.get("body")
        if body is not None:
            self._send(status, body.encode(), extra, fault.get("content_type", "text/plain"))
            return
        self._send(status, dumps(route.error(status, message, fault.get("type"))), extra)

    def _stream(
        self,
        events: Iterator[Event],
        head: bytes,  # the status line and headers, the request id's among them
        cut: int | None,
        finals: int,
        delay: float,
        generation: int,
    ) -> None:
        # One write (one TCP segment) per delta: events leading up to a delta travel with it,
        # as they would from a real server, without a syscall and a wake-up per tiny event.
        write = self.wfile.write
        fake = self.server.fake
        pending = [head, b"\r\n"]
        deltas = 0
        for kind, data in events:
            if cut is not None and (
                (kind == "final" and finals <= 0) or (kind == "delta" and deltas >= cut)
            ):
                write(b"".join(pending))
                self._abort()
                return
            if kind == "final":
                finals -= 1
            pending.append(b"%x\r\n%s\r\n" % (len(data), data))
            if kind == "delta":
                write(b"".join(pending))
                pending.clear()
                deltas += 1
                if delay > 0 and not fake._pause(delay, generation):
                    self._abort()
                    return
        pending.append(b"0\r\n\r\n")
        write(b"".join(pending))
        if self.server.fake.verbose:
            self.log_request(200, "-")


# ---------------------------------------------------------------- standalone


def _load_script(path: str) -> list[Reply]:
    with open(path, "rb") as fh:
        payload = _decode(fh.read())
    replies = payload.get("replies") if isinstance(payload, dict) else payload
    if not isinstance(replies, list):
        raise ValueError(f'{path}: expected a list of replies or {{"replies": [...]}}')
    return [validate_reply(r) for r in replies]


def main(argv: list[str] | None = None) -> int:
    """Run the fake model server in the foreground until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m poddaemon.testing.fake_model",
        description="Fake LLM server (OpenAI Chat/Responses, Anthropic Messages) for tests.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    parser.add_argument(
        "--script", metavar="FILE.json", help='replies: a list or {"replies": [...]}'
    )
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("-v", "--verbose", action="store_true", help="log requests to stderr")
    args = parser.parse_args(argv)
    try:
        replies = _load_script(args.script) if args.script else []
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        print(f"fake-model: bad script: {exc}", file=sys.stderr)
        return 2
    fake = FakeModel(args.host, args.port, chunk_size=args.chunk_size, verbose=args.verbose)
    fake.script(*replies)
    done = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: done.set())
    try:
        fake.start()
        print(f"{READY_PREFIX}\t{fake.url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while not done.wait(1.0):
                pass
    finally:
        fake.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
