"""JSON-RPC 2.0 over a Unix stream socket (SPEC §5).

One `asyncio.Protocol` per connection feeds a sans-IO line framer; every request is decoded
into typed params (from `protocol.methods.METHODS`) and dispatched. Synchronous handlers answer
inline (no task per request); coroutine handlers run as tasks, so slow methods never hold up the
connection. No line, however malformed, closes a connection; a client that half-closes still
gets every reply; memory per connection is bounded (unread replies, partial frames).
"""

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import re
import select
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import msgspec

from poddaemon.acks import Pending
from poddaemon.events import EventBus, Subscription
from protocol import errors
from protocol.errors import RpcError
from protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    HEAD_BYTES,
    LineFramer,
    Oversize,
)
from protocol.methods import METHODS
from protocol.types import NoParams, Request, Result
from protocol.unreadable import UNREADABLE

log = logging.getLogger("poddaemon.server")

Handler = Callable[[Any, "Connection"], Result | Awaitable[Result]]

_envelope_decoder = msgspec.json.Decoder(Request | list[msgspec.Raw])
_request_decoder = msgspec.json.Decoder(Request)
_params_decoders = {name: msgspec.json.Decoder(m.params) for name, m in METHODS.items()}
_encoder = msgspec.json.Encoder()
_NO_PARAMS = NoParams()
_PEERCRED = struct.Struct("3i")

# Once this much is queued in a client's socket buffer, stop writing it events and stop reading
# its requests, until it has read its replies.
EVENT_HIGH_WATER = 1 << 20
# A client that has left this much of its replies unread is disconnected: replies to requests
# read before the push-back began (a batch, `history` pages) can still pass the mark above.
MAX_UNREAD_BYTES = 16 * 1024 * 1024
# Incomplete request lines held for all connections together: 40 clients each sending most of
# an 8 MiB frame must not cost 320 MB.
MAX_PARTIAL_BYTES = 64 * 1024 * 1024
# A client that goes holding a partial frame this big: give the freed pages back (see below).
TRIM_AFTER_PARTIAL_BYTES = 1024 * 1024
# Requests of one connection being handled at once. Its further requests wait, unread in its
# socket, until one is answered: a client that writes 20,000 `history` requests at once gets
# them all answered, 128 at a time, instead of 20,000 coroutines and threads' work at once.
MAX_IN_FLIGHT = 128
# Seconds between looks at subscribers that half-closed: whether they have closed for good.
HALF_CLOSED_CHECK = 2.0
# Seconds a stopping pod waits for the replies it owes to be written (a client that does not
# read is not waited for longer): the process exits right after, with what is still buffered.
CLOSE_FLUSH = 1.0
# Items of one batch. Its replies go out together, held until the last: a line of 8 MiB of
# `1,` items (4 million) made a 460 MB reply and a pod of ~2 GB; past this, the batch is
# refused whole, nothing in it executed.
MAX_BATCH_ITEMS = 100_000
# Methods that change nothing: a batch may leave their replies out past its bound.
_READ_ONLY = frozenset({"history", "status", "usage"})
# A UTF-8 byte order mark: what an editor saving "UTF-8 with BOM" puts before a request file's
# first line. RFC 8259 (8.1) lets a parser ignore it; the pod does, at the start of any line.
_BOM = b"\xef\xbb\xbf"
# `"params": []`: by-position params with no values, what generic JSON-RPC clients send for a
# call without arguments; taken as params absent.
_NO_ARGS = re.compile(rb"\s*\[\s*\]\s*")
# A \u escape of a high surrogate (\ud800-\udbff), which must be followed by a low one.
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB]")
# An id value in a frame's head: any JSON number (a fraction or an exponent too, as the ids of
# whole lines) or a string, escapes included.
_ID_VALUE = re.compile(
    rb'\s*:\s*(-?\d{1,18}(?:\.\d{1,18})?(?:[eE][-+]?\d{1,3})?|"(?:[^"\\\x00-\x1f]|\\.){0,200}")\s*[,}]'
)


def _reply(request_id: Any, result: Any) -> bytes:
    return b'{"jsonrpc":"2.0","id":%b,"result":%b}' % (
        _encoder.encode(request_id),
        _encoder.encode(result),
    )


def _error(request_id: Any, code: int, message: str, data: Any = None) -> bytes:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return b'{"jsonrpc":"2.0","id":%b,"error":%b}' % (
        _encoder.encode(request_id),
        _encoder.encode(err),
    )


def _unanswered(frame: bytes) -> None:
    pass


def _params_message(exc: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.input`"; users see "params.input".
    text = str(exc)
    head, sep, where = text.partition(" - at `$")
    field = "params" + where.rstrip("`") if sep else "params"
    return f"invalid {field}: {head}"


def _unreadable(exc: Exception, data: bytes) -> str:
    """msgspec's reason, made true for a whole line `data`: it says "Input data was truncated"
    for a \\u escape that is the first half of a surrogate pair with no second (the line
    itself is complete) as for JSON cut short."""
    reason = str(exc)
    if reason != "Input data was truncated":
        return reason
    if _HIGH_SURROGATE.search(data):
        return "invalid JSON: a \\u escape of a lone surrogate (\\ud800), or truncated"
    return "invalid JSON: truncated (the line ends before its JSON value does)"


def _utf8_error(data: bytes) -> str | None:
    """Why a request that decoded is still not JSON text (RFC 8259: UTF-8), or None. msgspec
    checks the strings it reads, not those of members it skips (one it does not know), so a
    request with invalid UTF-8 there was executed where any other place gets -32700."""
    if data.isascii():  # the common case, at memchr speed
        return None
    try:
        data.decode()
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8 at byte {exc.start}"
    return None


def _guess_id(line: bytes) -> Any:
    """The id of an invalid request, when one can be read (JSON-RPC allows null otherwise)."""
    try:
        obj = msgspec.json.decode(line)
    except UNREADABLE:
        return id_from_head(line[:HEAD_BYTES])
    if isinstance(obj, dict):
        rid = obj.get("id")
        if isinstance(rid, int | float | str) and not isinstance(rid, bool):
            return rid
    return None


def id_from_head(head: bytes) -> float | str | None:
    """The top-level `"id"` of a request from its first bytes alone (an oversize or unparsable
    line), so its error still reaches the caller waiting for that id; None when not there."""
    # A line may start with a byte order mark (skipped as the whole line's is, see _BOM).
    text = head.removeprefix(_BOM).lstrip()
    if not text.startswith(b"{"):
        return None
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == 0x22:  # a string: skip it whole, escapes included
            j = i + 1
            while j < n and text[j] != 0x22:
                j += 2 if text[j] == 0x5C else 1
            if j >= n:
                return None
            if depth == 1 and text[i : j + 1] == b'"id"':
                m = _ID_VALUE.match(text, j + 1)
                if m:
                    try:
                        rid: float | str = msgspec.json.decode(m.group(1))
                    except UNREADABLE:  # not UTF-8, a lone surrogate, out of range: no id
                        return None
                    return rid
            i = j + 1
            continue
        if c in b"{[":
            depth += 1
        elif c in b"}]":
            depth -= 1
        i += 1
    return None


def _give_back_memory() -> None:
    """Return freed heap pages to the system (glibc's malloc_trim). Without it the pod keeps
    them: ten clients dropped with 16 MiB of replies each left 243 MB resident (96 MB with
    it), and 40 clients gone with 8 MiB partial frames up to 105 MB on a 50 MB pod (57 MB with
    it). Nothing where libc has no malloc_trim."""
    import ctypes  # loaded by the sandbox already

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class Connection(asyncio.Protocol):
    def __init__(self, server: "RpcServer") -> None:
        self.server = server
        self.framer = LineFramer(server.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.subscription: Subscription | None = None
        self.peer_pid = 0
        self._paused = False
        self._eof = False  # the client half-closed: answer what was read, then close
        self._dropped = False
        self._held = 0  # bytes of partial frame counted in server.partial_bytes
        self._held_since = 0.0  # when its partial frame began (monotonic)
        self._held_big = False  # it once held TRIM_AFTER_PARTIAL_BYTES of a partial frame
        # Replies still owed: handlers' tasks, bare futures, Pendings.
        self._tasks: set[asyncio.Future[Any] | Pending] = set()
        # Requests read but not yet handled (MAX_IN_FLIGHT reached); reading waits meanwhile.
        self._backlog: deque[Callable[[], None]] = deque()
        self._draining = False  # a drain of the backlog is scheduled
        self._reading_paused = False
        self._subscribing = False  # its subscription begins once the subscribe reply is out
        # While a batch item is dispatched: the batch's [subscribe cursor] (see _handle_batch).
        self._batch_subscribe: list[int] | None = None
        # A request decided later than it was read (see decide_before_next): later ones wait.
        self._undecided: asyncio.Future[Any] | None = None
        # Big replies are made one at a time, once the client has read the earlier ones (see
        # big_reply_turn); set while its write buffer is below the high-water mark.
        self._big_turn = asyncio.Lock()
        self._read_up = asyncio.Event()
        self._read_up.set()

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        pid, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid not in (os.getuid(), 0):
            log.warning("refused a connection from uid %d (pid %d)", uid, pid)
            self.transport.write(_error(None, errors.INVALID_REQUEST, "permission denied") + b"\n")
            transport.close()
            return
        self.peer_pid = pid
        self.transport.set_write_buffer_limits(high=EVENT_HIGH_WATER)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._backlog.clear()
        self._read_up.set()  # a big reply waiting for its turn goes on, to be cancelled
        self.server.connections.discard(self)
        if not self.server.connections and self.server.all_closed is not None:
            self.server.all_closed.set()
        self.server.half_closed.discard(self)
        self.server.partial_bytes -= self._held
        self._held = 0
        self.framer = LineFramer(self.server.max_frame_bytes)  # its partial frame: freed now
        if self.subscription is not None:
            self.server.bus.unsubscribe(self.subscription)
        for task in self._tasks:
            task.cancel()
        if self._dropped or self._held_big:  # its unread replies or its big frames: freed now
            self.server.give_back_memory_soon()

    def pause_writing(self) -> None:
        # Its replies pile up unread: no more of its requests are handled or read until they
        # drain. A client that pipelines faster than it reads is slowed down, as a socket
        # would; it was disconnected once MAX_UNREAD_BYTES of replies piled up.
        self._paused = True
        self._read_up.clear()
        self._hold()

    def resume_writing(self) -> None:
        self._paused = False
        self._read_up.set()
        if self.subscription is not None:
            self.server.bus.catch_up(self.subscription)
        if self._reading_paused:
            self._drain_soon()

    def data_received(self, data: bytes) -> None:
        self._lines(self.framer.feed(data))
        self._count_partial()

    def eof_received(self) -> bool:
        # The client half-closed (`printf ... | socat`, shutdown(SHUT_WR)): it still reads. Finish
        # the requests already read, a last line without its newline included, then close.
        self._eof = True
        self._lines(self.framer.close())
        self._count_partial()
        self._close_if_done()
        return True  # keep our half open

    def _lines(self, lines: list[bytes | Oversize]) -> None:
        backlog = self._backlog
        for line in lines:
            if backlog or self._paused or self._undecided or len(self._tasks) >= MAX_IN_FLIGHT:
                backlog.append(functools.partial(self._line, line))
            else:
                self._line(line)
        if backlog:
            self._hold()

    def decide_before_next(self, decided: "asyncio.Future[Any]") -> None:
        """The request being handled reaches the machine only once `decided` is done (a
        prompt's hook runs first): this connection's later requests wait until then, so that
        requests pipelined on one connection are decided in the order they were sent."""
        self._undecided = decided
        self._hold()
        decided.add_done_callback(self._decided)

    def _decided(self, decided: "asyncio.Future[Any]") -> None:
        if self._undecided is decided:
            self._undecided = None
            self._drain_soon()

    @contextlib.asynccontextmanager
    async def big_reply_turn(self) -> AsyncIterator[None]:
        """Make a reply that may be megabytes (a `history` page) inside this: one at a time per
        connection, each once the client has read its earlier replies down to the low-water
        mark. Made all at once, the pages of a few pipelined requests passed MAX_UNREAD_BYTES
        together and a client that read all along was disconnected, its replies lost."""
        async with self._big_turn:
            await self._read_up.wait()
            yield
        # The reply is written before the next turn begins: the caller returns it in this
        # same step, and the lock wakes the next one only in a later loop pass.

    def _hold(self) -> None:
        """Stop reading this client until its backlog is handled and its replies are read
        (see _drain)."""
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _answered(self) -> None:
        """A reply owed was given: requests waiting for room are handled in a coming pass."""
        if self._backlog:
            self._drain_soon()

    def _drain_soon(self) -> None:
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._draining = False
        backlog = self._backlog
        while (
            backlog
            and not self._paused
            and not self._undecided
            and len(self._tasks) < MAX_IN_FLIGHT
        ):
            backlog.popleft()()
        if backlog or self._paused or self.transport is None or self.transport.is_closing():
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        self._close_if_done()

    def _line(self, line: bytes | Oversize) -> None:
        if self._dropped:
            return
        try:
            if isinstance(line, Oversize):
                self._send(
                    _error(
                        id_from_head(line.head),
                        errors.INVALID_REQUEST,
                        f"frame of {line.size} bytes exceeds max_frame_bytes "
                        f"({self.server.max_frame_bytes}); discarded",
                    )
                )
            else:
                self._handle_line(line)
        except Exception as exc:  # a bug for one line must not cost the client its connection
            log.exception("request line failed")
            self._send(_error(None, errors.INTERNAL_ERROR, f"internal error: {exc}"))

    def _count_partial(self) -> None:
        held = self.framer.held
        if not held and not self._held:  # the common case: whole lines, none held before
            return
        if held and not self._held:
            self._held_since = time.monotonic()
        self.server.partial_bytes += held - self._held
        self._held = held
        if held >= TRIM_AFTER_PARTIAL_BYTES:
            self._held_big = True
        if held and self.server.partial_bytes > self.server.max_partial_bytes:
            self.server.drop_oldest_partials()

    def _close_if_done(self) -> None:
        if (
            not self._eof
            or self._tasks
            or self._backlog
            or self.transport is None
            or self.transport.is_closing()
        ):
            return
        if (self.subscription is None and not self._subscribing) or self.peer_closed():
            self.transport.close()  # after the buffered replies are written
        else:  # it still reads its events: let go of it once it closes (nothing else tells)
            self.server.watch_half_closed(self)

    def peer_closed(self) -> bool:
        """The client closed its socket, not only its writing half: only then does a Unix
        stream socket poll POLLHUP (a shutdown(SHUT_WR) reads as EOF alone)."""
        assert self.transport is not None
        poller = select.poll()
        poller.register(self.transport.get_extra_info("socket").fileno(), 0)
        return any(events & select.POLLHUP for _, events in poller.poll(0))

    def _drop(self, reason: str) -> None:
        """Disconnect a client past a memory bound, with an alert; others are unaffected."""
        if self._dropped or self.transport is None:
            return
        self._dropped = True
        self._backlog.clear()
        message = f"disconnected client (pid {self.peer_pid}): {reason}"
        log.warning("%s", message)
        self.transport.abort()  # frees its buffers now
        self.framer = LineFramer(self.server.max_frame_bytes)
        self._count_partial()
        self.server.bus.publish(
            "alert", {"level": "warning", "source": "server", "message": message}
        )

    # --- requests --------------------------------------------------------------------------

    def _send(self, frame: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        unread = self.transport.get_write_buffer_size()
        if unread > self.server.max_unread_bytes:
            self._drop(f"{unread} bytes of replies unread (limit {self.server.max_unread_bytes})")
            return
        self.server.before_send()
        self.transport.write(frame + b"\n")

    def _handle_line(self, line: bytes) -> None:
        if line.startswith(_BOM):
            line = line[len(_BOM) :]
            if not line.strip():
                return  # a blank first line: skipped like any other
        try:
            msg = _envelope_decoder.decode(line)
        except msgspec.ValidationError as exc:
            bad = _utf8_error(line)  # (no JSON: malformed first, whatever shape it has)
            if bad is not None:
                self._send(_error(None, errors.PARSE_ERROR, f"parse error: {bad}"))
                return
            self._send(_error(_guess_id(line), errors.INVALID_REQUEST, f"invalid request: {exc}"))
            return
        except UNREADABLE as exc:  # not JSON at all: decoding it again would fail the same way
            head_id = id_from_head(line[:HEAD_BYTES])
            reason = _unreadable(exc, line)
            self._send(_error(head_id, errors.PARSE_ERROR, f"parse error: {reason}"))
            return
        if isinstance(msg, Request):
            bad = _utf8_error(line)
            if bad is not None:  # not JSON, so no notification either: answered (id null)
                rid = None if msg.is_notification else msg.id
                self._send(_error(rid, errors.PARSE_ERROR, f"parse error: {bad}"))
                return
            self._dispatch(msg, self._send)
        else:
            self._handle_batch(msg)

    def _handle_batch(self, items: list[msgspec.Raw]) -> None:
        if not items:
            self._send(_error(None, errors.INVALID_REQUEST, "invalid request: empty batch"))
            return
        if len(items) > MAX_BATCH_ITEMS:
            message = (
                f"invalid request: a batch of {len(items)} items exceeds {MAX_BATCH_ITEMS}; "
                "nothing in it was executed"
            )
            self._send(_error(None, errors.INVALID_REQUEST, message))
            return
        replies: list[bytes | None] = [None] * len(items)
        pending = len(items)
        subscribe: list[int] = []  # a subscribe in it streams once the batch's reply is out
        held = 0  # bytes of read-only replies held for it (see put)

        def collect(index: int, req: Request) -> Callable[[bytes], None]:
            def put(frame: bytes) -> None:
                nonlocal held
                if req.method in _READ_ONLY:
                    # A batch's replies go out together, held until the last: 40 history
                    # pages of 8 MiB took the pod to 1 GB, 150,000 `status` in one 8 MiB line
                    # to 340 MB, and a longer batch could exhaust memory. Past the bound, such
                    # a reply is left out (asking again changes nothing); acks are never.
                    if held and held + len(frame) > self.server.max_unread_bytes:
                        frame = _error(
                            req.id,
                            errors.INTERNAL_ERROR,
                            f"reply of {len(frame)} bytes left out: the batch's replies pass "
                            f"{self.server.max_unread_bytes} bytes; send it on its own",
                        )
                    held += len(frame)
                replies[index] = frame
                done()

            return put

        def done() -> None:
            nonlocal pending
            pending -= 1
            if pending == 0:
                frames = [r for r in replies if r is not None]
                if frames:
                    self._send(b"[" + b",".join(frames) + b"]")
                if subscribe:
                    asyncio.get_running_loop().call_soon(self.start_events, subscribe[-1])

        def handle(i: int, raw: msgspec.Raw) -> None:
            try:
                req = _request_decoder.decode(raw)
            except (msgspec.ValidationError, *UNREADABLE) as exc:
                message = f"invalid request: {exc}"
                replies[i] = _error(_guess_id(bytes(raw)), errors.INVALID_REQUEST, message)
                done()
                return
            bad = _utf8_error(bytes(raw))
            if bad is not None:
                rid = None if req.is_notification else req.id
                replies[i] = _error(rid, errors.PARSE_ERROR, f"parse error: {bad}")
                done()
                return
            self._batch_subscribe = subscribe
            try:
                if req.is_notification:  # unanswered, unless its params are not JSON
                    self._dispatch(req, functools.partial(replies.__setitem__, i))
                    done()
                else:
                    self._dispatch(req, collect(i, req))
            finally:
                self._batch_subscribe = None

        for i, raw in enumerate(items):
            if len(self._tasks) >= MAX_IN_FLIGHT:  # the rest waits as lines do, before them
                rest = [functools.partial(handle, j, r) for j, r in enumerate(items[i:], i)]
                self._backlog.extendleft(reversed(rest))
                self._hold()
                return
            handle(i, raw)

    def _dispatch(self, req: Request, reply: Callable[[bytes], None]) -> None:
        notification = req.is_notification
        rid = None if notification else req.id
        answer = _unanswered if notification else reply  # a notification is never answered
        method = req.method
        handler = self.server.handlers.get(method)
        if handler is None:
            answer(_error(rid, errors.METHOD_NOT_FOUND, f"method not found: {method}"))
            return
        params: Any = _NO_PARAMS
        decoder = _params_decoders.get(method)
        given = req.params
        if given is not msgspec.UNSET and _NO_ARGS.fullmatch(given):
            given = msgspec.UNSET
        if decoder is not None and not (given is msgspec.UNSET and decoder.type is NoParams):
            raw = b"{}" if given is msgspec.UNSET else given
            try:
                params = decoder.decode(raw)
            except msgspec.ValidationError as exc:
                if bytes(raw).lstrip()[:1] not in (b"{", b"["):  # JSON-RPC: structured or absent
                    # Not a valid request, so no notification either: answered (id null) even
                    # without an id, as a wrong `jsonrpc` or `method` is. Dropped silently, a
                    # `notify` sent with `"params": "text"` was lost without a word.
                    message = "invalid request: params must be an object or an array"
                    reply(_error(rid, errors.INVALID_REQUEST, message))
                    return
                answer(_error(rid, errors.INVALID_PARAMS, _params_message(exc)))
                return
            except UNREADABLE as exc:  # params are only skipped, not parsed, by the envelope
                # A line that is not JSON is no notification either: JSON-RPC answers its parse
                # error (id null), as for any other malformed line. Invalid UTF-8 in a
                # notification's params was dropped without a word, and never executed.
                reason = _unreadable(exc, bytes(raw))
                reply(_error(rid, errors.PARSE_ERROR, f"parse error in params: {reason}"))
                return
        try:
            result = handler(params, self)
        except RpcError as exc:
            answer(_error(rid, exc.code, exc.message, exc.data))
            return
        except Exception as exc:
            log.exception("handler %s failed", method)
            answer(_error(rid, errors.INTERNAL_ERROR, f"internal error: {exc}"))
            return
        if isinstance(result, Pending):
            # A reply the pod settles later (e.g. from the group commit, right after its fsync):
            # answered from its callback at once, no future, task or loop pass per request.
            if result.done():
                result.then(functools.partial(self._answer_outcome, rid, answer, method))
            else:
                self._tasks.add(result)
                result.then(functools.partial(self._pending_done, rid, answer, method, result))
        elif isinstance(result, asyncio.Future):
            # A bare future (e.g. a durable ack): answered from its done callback, no Task to
            # create and step through per request.
            self._tasks.add(result)
            result.add_done_callback(functools.partial(self._future_done, rid, answer, method))
        elif isinstance(result, msgspec.Struct):  # a result at once (status): no abc check
            answer(_reply(rid, result))
        elif inspect.isawaitable(result):
            task = asyncio.ensure_future(self._finish(result, rid, answer, method))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
        else:
            answer(_reply(rid, result))

    async def _finish(
        self,
        pending: Awaitable[Result],
        rid: Any,
        answer: Callable[[bytes], None],
        method: str,
    ) -> None:
        try:
            result = await pending
        except asyncio.CancelledError:
            if self.server.closing:  # the pod stops: an answer, not a connection closed on it
                answer(_error(rid, errors.SHUTTING_DOWN, "the pod is shutting down"))
            raise
        except RpcError as exc:
            answer(_error(rid, exc.code, exc.message, exc.data))
        except Exception as exc:
            log.exception("handler %s failed", method)
            answer(_error(rid, errors.INTERNAL_ERROR, f"internal error: {exc}"))
        else:
            answer(_reply(rid, result))

    def _future_done(
        self, rid: Any, answer: Callable[[bytes], None], method: str, fut: "asyncio.Future[Any]"
    ) -> None:
        self._tasks.discard(fut)
        self._answered()
        if not fut.cancelled():  # cancelled: the connection went (as a cancelled task answers)
            exc = fut.exception()
            if isinstance(exc, RpcError):
                answer(_error(rid, exc.code, exc.message, exc.data))
            elif isinstance(exc, Exception):
                log.error("handler %s failed", method, exc_info=exc)
                answer(_error(rid, errors.INTERNAL_ERROR, f"internal error: {exc}"))
            elif exc is None:
                answer(_reply(rid, fut.result()))
        self._close_if_done()

    def _pending_done(
        self, rid: Any, answer: Callable[[bytes], None], method: str, pending: Pending, outcome: Any
    ) -> None:
        self._tasks.discard(pending)
        if self._backlog:
            self._answered()
        if isinstance(outcome, Exception):
            self._answer_outcome(rid, answer, method, outcome)
        else:  # the common case inline: this runs once per durable ack
            answer(_reply(rid, outcome))
        if self._eof:
            self._close_if_done()

    def _answer_outcome(
        self, rid: Any, answer: Callable[[bytes], None], method: str, outcome: Any
    ) -> None:
        if isinstance(outcome, RpcError):
            answer(_error(rid, outcome.code, outcome.message, outcome.data))
        elif isinstance(outcome, Exception):
            log.error("handler %s failed", method, exc_info=outcome)
            answer(_error(rid, errors.INTERNAL_ERROR, f"internal error: {outcome}"))
        else:
            answer(_reply(rid, outcome))

    def _task_done(self, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        self._answered()
        self._close_if_done()

    # --- events ----------------------------------------------------------------------------

    def subscribe_after_reply(self, cursor: int) -> None:
        """Stream events after `cursor` once the subscribe reply now being sent is written (a
        client that half-closes meanwhile still gets them)."""
        self._subscribing = True
        if self._batch_subscribe is not None:  # its reply goes out with the whole batch's
            self._batch_subscribe.append(cursor)
            return
        asyncio.get_running_loop().call_soon(self.start_events, cursor)

    def start_events(self, cursor: int) -> None:
        """Begin streaming events after `cursor` (called once the subscribe reply is written)."""
        self._subscribing = False
        if self.transport is None or self.transport.is_closing():
            return  # closed meanwhile: a subscription now would never be removed
        if self.subscription is not None:
            self.server.bus.unsubscribe(self.subscription)
        # What is staged is written (or, the log failing, forgotten) before any is replayed.
        self.server.before_send()
        self.subscription = Subscription(self._write_event, self._congested, cursor)
        self.server.bus.subscribe(self.subscription)
        self._close_if_done()  # a client that closed before its subscription began

    def _write_event(self, frame: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.server.before_send()
            self.transport.write(frame)

    def _congested(self) -> bool:
        return self._paused or self.transport is None or self.transport.is_closing()


class RpcServer:
    def __init__(
        self,
        handlers: dict[str, Handler],
        bus: EventBus,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_unread_bytes: int = MAX_UNREAD_BYTES,
        max_partial_bytes: int | None = None,
        before_send: Callable[[], None] = lambda: None,
    ) -> None:
        missing = sorted(METHODS.keys() - handlers.keys())
        unknown = sorted(handlers.keys() - METHODS.keys())
        if missing or unknown:
            raise ValueError(
                "handlers do not match protocol.methods.METHODS: "
                f"methods without a handler {missing}, handlers without a method {unknown}"
            )
        self.handlers = handlers
        self.bus = bus
        # Runs before any reply or event is written: the pod writes its staged log entries
        # there, so nothing a client hears of is missing from the session file.
        self.before_send = before_send
        self.max_frame_bytes = max_frame_bytes
        self.max_unread_bytes = max_unread_bytes
        # At least two maximal frames in flight at once, whatever the limit.
        self.max_partial_bytes = max_partial_bytes or max(MAX_PARTIAL_BYTES, 2 * max_frame_bytes)
        self.partial_bytes = 0
        self.closing = False  # the pod stops: what is still owed is answered -32004
        self.all_closed: asyncio.Event | None = None  # set by the last connection_lost, closing
        self._owed: list[asyncio.Future[Any]] = []  # tasks and futures close() settled (drain)
        self._trim_scheduled = False
        self.connections: set[Connection] = set()
        # Subscribers that half-closed. A client that then closes its socket is never read
        # again, and an idle pod writes it nothing that would fail: looked at every
        # HALF_CLOSED_CHECK seconds, or each would hold an fd until the next event.
        self.half_closed: set[Connection] = set()
        self._half_closed_check: asyncio.TimerHandle | None = None
        self._server: asyncio.AbstractServer | None = None
        self._path: Path | None = None
        self._ino = 0  # the inode of the socket we bound at _path

    def drop_oldest_partials(self) -> None:
        """Past the bound on partial frames, disconnect the clients whose unfinished frames
        are the oldest until it holds again: a frame in progress arrives within moments, so
        the old ones are clients holding memory on purpose (a newcomer's valid request is not
        what gets refused, as it was when the client that crossed the bound went)."""
        holders = sorted((c for c in self.connections if c._held), key=lambda c: c._held_since)
        for conn in holders:
            if self.partial_bytes <= self.max_partial_bytes:
                return
            conn._drop(
                f"partial frames of all clients exceed {self.max_partial_bytes} bytes "
                f"(this one's oldest, {conn._held} bytes held for "
                f"{time.monotonic() - conn._held_since:.1f} s)"
            )

    def watch_half_closed(self, conn: Connection) -> None:
        self.half_closed.add(conn)
        self._check_half_closed_later()

    def _check_half_closed_later(self) -> None:
        if self._half_closed_check is None and self.half_closed:
            loop = asyncio.get_running_loop()
            self._half_closed_check = loop.call_later(HALF_CLOSED_CHECK, self._let_go_of_closed)

    def _let_go_of_closed(self) -> None:
        self._half_closed_check = None
        for conn in list(self.half_closed):
            if conn.transport is None or conn.transport.is_closing():
                self.half_closed.discard(conn)
            elif conn.peer_closed():
                self.half_closed.discard(conn)
                conn.transport.close()
        self._check_half_closed_later()

    def give_back_memory_soon(self) -> None:
        """One trim for all the clients that go in the same loop pass (a heap walk each)."""
        if not self._trim_scheduled:
            self._trim_scheduled = True
            asyncio.get_running_loop().call_soon(self._give_back_memory)

    def _give_back_memory(self) -> None:
        self._trim_scheduled = False
        _give_back_memory()

    async def listen(self, path: Path) -> None:
        """Bind `path` (0600). The caller must own the name: any file there is replaced."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path.unlink(missing_ok=True)
            old_umask = os.umask(0o177)
            try:
                sock.bind(str(path))
            finally:
                os.umask(old_umask)
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        loop = asyncio.get_running_loop()
        # The backlog again: the loop listens once more, with its own default of 100, and a
        # burst of more clients than that (a CI fan-out) got EAGAIN while the pod was busy.
        self._server = await loop.create_unix_server(
            lambda: Connection(self), sock=sock, backlog=socket.SOMAXCONN
        )
        self._path, self._ino = path, os.stat(path).st_ino

    def close(self) -> None:
        """Stop listening and give the socket's path up (a new pod of this name may bind it
        once our claim goes); settle every request read and still owed (a history page at
        work, a prompt waiting on its hook) with -32004, as JSON-RPC wants an answer for each.
        `drain` then writes those answers and closes the connections."""
        if self._half_closed_check is not None:
            self._half_closed_check.cancel()
        if self._server is not None:
            self._server.close()
        if self._path is not None:
            # Python 3.11 leaves the file behind. Only ours: once our registry entry went, a
            # new pod of this name may have bound the path, and must keep its socket.
            with contextlib.suppress(OSError):
                if os.stat(self._path).st_ino == self._ino:
                    self._path.unlink()
            self._path = None
        self.closing = True
        gone = RpcError(errors.SHUTTING_DOWN, "the pod is shutting down")
        for reply in [reply for conn in self.connections for reply in conn._tasks]:
            if isinstance(reply, Pending):
                reply.settle(gone)
                continue
            self._owed.append(reply)
            if isinstance(reply, asyncio.Task):
                reply.cancel()  # _finish answers, once the task has unwound (a hook killed)
            elif not reply.done():
                reply.set_exception(gone)  # _future_done answers

    async def drain(self) -> None:
        """After `close`: let the answers owed be given and written, within CLOSE_FLUSH each
        (a client that does not read is not waited for longer), and close every connection."""
        if self._owed:
            await asyncio.wait(self._owed, timeout=CLOSE_FLUSH)
            await asyncio.sleep(0)  # done callbacks (the futures' answers) run a pass later
        self.all_closed = asyncio.Event()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()  # once what is buffered is written
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.all_closed.wait(), CLOSE_FLUSH)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()  # a client that does not read its replies
