"""A stdio MCP server as a process of the pod: spawned through the guard, its stderr read by the
pod (logged, its tail kept for error messages), its stdout/stdin bridged to the MCP SDK.

The process is spawned *before* the SDK is imported (the import takes ~0.6 s; the pod runs it in
a thread meanwhile), which is why this module does not use `mcp.client.stdio.stdio_client`: the
SDK's `Client` accepts any transport, and `transport()` below is one for a process that already
runs. The guard makes stopping simple: closing our end of its stderr pipe kills its whole group.
"""

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from poddaemon.pipes import read_pipe
from protocol.unreadable import UNREADABLE

log = logging.getLogger("poddaemon.mcp")

GUARD = str(Path(__file__).with_name("guard.py"))
MAX_LINE = 64 * 1024 * 1024  # one JSON-RPC message from the server
STDERR_TAIL = 20  # lines kept for error messages
# A server's stderr goes to the pod's log at up to LOG_BURST bytes at once, then LOG_RATE bytes a
# second: one that floods it must not fill the disk the pod's session log is on.
LOG_BURST = 256 * 1024
LOG_RATE = 4096
LOG_LINE = 4096  # characters of one line logged
# While a flood is cut, how many lines were dropped is logged at most this often (a report per
# line let through, two lines each time, logged more than the flood's own lines).
DROPS_REPORT_EVERY = 10.0
STOP_GRACE = 2.0  # seconds a server gets to exit after EOF on stdin (the SDK's own grace)


class StdioProcess:
    """One guarded server process and the pod's end of its pipes."""

    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        stderr: asyncio.StreamReader,
        stderr_transport: asyncio.ReadTransport,
    ) -> None:
        self.name = name
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._allowance = float(LOG_BURST)  # bytes that may be logged now
        self._refilled = time.monotonic()
        self._dropped = 0  # lines not logged since the last report
        self._flooding = False  # lines are being dropped: said once, when it began
        self._reported = 0.0  # when dropped lines were last reported (monotonic)
        # Set when stderr reaches EOF: the guard has exited, so has the server's whole group.
        self.gone = asyncio.Event()
        self.heard = 0.0  # when the server last sent a line on stdout (monotonic)
        self.stray: list[bytes] = []  # lines on stdout during start-up that were not JSON
        self._stderr_transport = stderr_transport
        self._reader = asyncio.ensure_future(self._read_stderr(stderr))

    @classmethod
    async def spawn(
        cls, name: str, command: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> "StdioProcess":
        """Start `command` under the guard. Raises OSError if even the guard cannot start."""
        # The pod is the only reader of this pipe (os.pipe is close-on-exec): the guard sees it
        # close when the pod ends, however it ends.
        read_fd, write_fd = os.pipe()
        stderr = asyncio.StreamReader()
        try:
            stderr_transport = await read_pipe(read_fd, stderr)  # (it closes read_fd on failure)
        except BaseException:
            os.close(write_fd)
            raise
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                GUARD,
                "--",
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=write_fd,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,  # the guard leads a group it can kill whole
                limit=MAX_LINE,
            )
        except BaseException:
            stderr_transport.close()
            raise
        finally:
            os.close(write_fd)
        return cls(name, proc, stderr, stderr_transport)

    async def _read_stderr(self, reader: asyncio.StreamReader) -> None:
        try:
            pending = b""
            while chunk := await reader.read(65536):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._line(line)
                if len(pending) > 4096:  # a line without end: show it anyway
                    self._line(pending)
                    pending = b""
            if pending:
                self._line(pending)
            self._report_drops()  # the server is gone: the last count of its flood
        finally:
            self.gone.set()

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip()[:LOG_LINE]
        if not text:
            return
        self.tail.append(text)
        now = time.monotonic()
        self._allowance = min(LOG_BURST, self._allowance + (now - self._refilled) * LOG_RATE)
        self._refilled = now
        if self._allowance < len(text):
            if not self._flooding:
                self._flooding = True
                self._reported = now
                log.warning(
                    "mcp[%s] writes to stderr faster than it is logged: lines dropped", self.name
                )
            self._dropped += 1
            return
        if self._dropped and now - self._reported >= DROPS_REPORT_EVERY:
            self._report_drops()
        self._allowance -= len(text)
        log.info("mcp[%s] %s", self.name, text)

    def _report_drops(self) -> None:
        if self._dropped:
            log.warning("mcp[%s] %d lines of stderr were not logged", self.name, self._dropped)
        self._dropped = 0
        self._flooding = False
        self._reported = time.monotonic()

    def stray_lines(self) -> str:
        """What a server that did not start printed on stdout that was not JSON (it answered
        `initialize` with it, or its replies are not newline-delimited): "" if nothing."""
        if not self.stray:
            return ""
        first = self.stray[0].decode("utf-8", "replace").strip()
        first = first if len(first) <= 80 else first[:80] + "…"
        return f"; its stdout held {len(self.stray)} line(s) not JSON (the first: {first!r})"

    def stderr_tail(self, lines: int = 3, limit: int = 400) -> str:
        text = " | ".join(list(self.tail)[-lines:])
        return text if len(text) <= limit else "…" + text[-limit:]

    async def stop(self, grace: float = STOP_GRACE) -> None:
        """EOF on stdin, `grace` seconds to exit, then the guard kills the group.

        Often awaited in a task being cancelled (a holder's cleanup): there, on Python 3.11,
        an `asyncio.timeout` that expires raises CancelledError, not TimeoutError, and the
        kill after it never ran (a server that ignored EOF outlived its failed start until the
        pod stopped). So the waits are bounded by `asyncio.wait`, and the kill comes whatever
        happens to them."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await _within(self.gone.wait(), grace)
        finally:
            self.kill()
            try:
                await _within(self.proc.wait(), grace)
            finally:
                self._reader.cancel()
        await asyncio.wait({self._reader})  # (its cancellation is not raised here; ours is)

    def kill(self) -> None:
        """Kill the server's whole group now (the guard does it when its stderr reader goes),
        and what the server detached into sessions of its own (re-parented to the guard)."""
        from poddaemon.runner import descendants, kill_all

        self._stderr_transport.close()
        if self.proc.returncode is None:  # not reaped: its pid is still its group's id
            kill_all(descendants(self.proc.pid))
        elif self.gone.is_set():
            return  # the guard killed the group as it exited, as it always does
        # Else the guard itself was killed (kill -9, the OOM killer) and the server lives on
        # with our stderr pipe (found by QA: one ignoring EOF outlived the pod). It is still in
        # the guard's group and session, so their id, the guard's pid, is not free for reuse.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


async def _within(waiting: Coroutine[Any, Any, Any], seconds: float) -> None:
    """Await `waiting` for at most `seconds` without cancelling the caller (see `stop`)."""
    task = asyncio.ensure_future(waiting)
    try:
        await asyncio.wait({task}, timeout=seconds)
    finally:
        task.cancel()


_ID = re.compile(rb'"id"\s*:\s*(-?\d{1,18}|"(?:[^"\\]|\\.){0,200}")')


async def _skip_long_line(stdout: asyncio.StreamReader, name: str) -> bytes:
    """Read past a line over MAX_LINE (a tool's 70 MB result, say) and return, in its place, the
    JSON-RPC error that answers the request it answered (its id is near the start, where
    servers put it): the call fails with the reason and the server stays connected (the
    connection was dropped as lost, and the server restarted, or left dead the second time)."""
    head = b""
    size = 0
    while True:
        try:
            size += len(await stdout.readuntil(b"\n"))
            break
        except asyncio.LimitOverrunError as exc:
            chunk = await stdout.readexactly(exc.consumed)  # it is there: no wait
            size += len(chunk)
            head = head or chunk[:4096]
        except asyncio.IncompleteReadError as exc:  # EOF within it
            size += len(exc.partial)
            break
    why = f"a message of {size:,} bytes, over the {MAX_LINE // (1 << 20)} MiB limit"
    log.warning("mcp[%s] sent %s; skipped", name, why)
    return _error_reply(head, f"the server's reply was {why}; it was discarded") or b"\n"


def _error_reply(line: bytes, message: str) -> bytes | None:
    """A JSON-RPC error answering the reply that `line` begins, or None when it names no id
    (its call times out) or is a request of the server's (no reply of ours)."""
    rid = reply_id(line)
    if rid is None:
        return None
    error = {"code": -32603, "message": message}
    return b'{"jsonrpc":"2.0","id":%b,"error":%b}\n' % (rid, json.dumps(error).encode())


# `error.data` of the errors the pod answers a call with in place of the server's reply: one that
# breaks the protocol, and (over HTTP) one the connection closed before; the server did not
# refuse the call, and connection.py says which it was.
PROTOCOL_BROKEN = "poddaemon: the server broke the protocol"
DROPPED = "poddaemon: the connection closed without an answer"


def stand_in(rid: int | str, code: int, message: str, data: str) -> bytes:
    """A JSON-RPC error answering request `rid`, made by the pod in the server's place."""
    error = {"code": code, "message": message, "data": data}
    return msgspec.json.encode({"jsonrpc": "2.0", "id": rid, "error": error})


def broken_reply(message: Any) -> bytes | None:
    """An error answering the call a decoded `message` answers when the reply breaks the
    protocol: neither `result` nor `error` (it has the call's id and no method), or a `result`
    that is not an object; None for any other message. Found by QA: such a reply failed its
    call with the SDK's four validation errors (one per shape a message may have), as if the
    server had refused it."""
    if not isinstance(message, dict) or "method" in message or "error" in message:
        return None
    rid = message.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int | str):
        return None
    if "result" not in message:
        why = "its reply has neither a result nor an error"
    elif isinstance(message["result"], dict):
        return None
    else:
        why = f"its result is {_json_kind(message['result'])}, not an object"
    return stand_in(rid, -32603, why, PROTOCOL_BROKEN)


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


def batch_items(line: bytes) -> list[bytes] | None:
    """The messages of a JSON-RPC batch (an array of them, legal in JSON-RPC 2.0 and in MCP
    2025-03-26), each encoded on its own: the SDK reads one message at a time, and found a
    whole batch unreadable (found by QA: the calls it answered failed). None when the line is
    no batch, or one that cannot be decoded: it is then read as one message, and fails as such."""
    if not line.lstrip().startswith(b"["):
        return None
    try:
        items = msgspec.json.decode(line)
    except UNREADABLE:
        return None
    if not isinstance(items, list):
        return None
    encode = msgspec.json.Encoder().encode
    return [broken_reply(item) or encode(item) for item in items]


def reply_id(line: bytes) -> bytes | None:
    """The id (as written) of the reply a line that cannot be decoded begins, from its first
    4 KiB, where servers put it; None if none is there, or the line is a request."""
    head = line[:4096]
    found = _ID.search(head)
    return None if found is None or b'"method"' in head else found[1]


def _unreadable(line: bytes, exc: ValueError) -> Any:
    """What the session gets for a line the SDK cannot read: an error answering it if it is a
    reply (its call fails now, with the reason) or the exception, which the SDK drops. Found by
    QA: a result nested deeper than the SDK's JSON parser goes (~200 levels: an AST, a tree)
    was dropped, and its call waited out its timeout and said it had timed out. Not logged:
    the call's error says it, and a server could send such lines by the thousand."""
    import mcp_types
    from mcp.shared.message import SessionMessage

    with contextlib.suppress(*UNREADABLE):
        if (broken := broken_reply(msgspec.json.decode(line))) is not None:
            return SessionMessage(
                mcp_types.jsonrpc_message_adapter.validate_json(broken, by_name=False)
            )
    detail = " ".join(str(exc).split())[:300]
    reply = _error_reply(line, f"the server's reply cannot be read ({detail})")
    if reply is None:
        return exc
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(reply, by_name=False))
    except ValueError:  # its id is no valid JSON either ("\q"): nothing to answer
        return exc


@contextlib.asynccontextmanager
async def transport(process: StdioProcess) -> AsyncIterator[tuple[Any, Any]]:
    """The MCP SDK's Transport shape (read stream, write stream) over a running process.

    Newline-delimited JSON-RPC, as the SDK's own stdio transport; stopping the process is the
    caller's business (`StdioProcess.stop`).
    """
    import anyio
    import mcp_types
    from mcp.shared.message import SessionMessage

    proc = process.proc
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)

    async def server_to_session() -> None:
        async with read_send:
            while True:
                try:
                    line = await stdout.readuntil(b"\n")
                except asyncio.IncompleteReadError as exc:  # EOF, maybe after a last line
                    line = exc.partial
                except asyncio.LimitOverrunError:  # over MAX_LINE: skipped, its caller told
                    line = await _skip_long_line(stdout, process.name)
                except OSError as exc:  # a broken pipe
                    log.warning("mcp[%s] cannot read the server's output: %s", process.name, exc)
                    return
                if not line:
                    return  # EOF: the session sees the connection close
                process.heard = time.monotonic()  # alive, even if too busy to answer a ping
                if not line.lstrip().startswith((b"{", b"[")):
                    # Not a JSON object or batch, so no message (a banner, a debug print): the
                    # SDK would drop it, but only after a failed parse and a task of its own
                    # each (found by QA: a server printing 100,000 such lines in a call kept
                    # the pod busy for ~18 s).
                    continue
                for item in batch_items(line) or [line]:
                    message: SessionMessage | Exception
                    try:
                        parsed = mcp_types.jsonrpc_message_adapter.validate_json(
                            item, by_name=False
                        )
                        message = SessionMessage(parsed)
                    except ValueError as exc:  # pydantic's ValidationError is one
                        message = _unreadable(item, exc)
                    try:
                        await read_send.send(message)
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        return

    async def session_to_server() -> None:
        try:
            async with write_recv:
                async for session_message in write_recv:
                    json = session_message.message.model_dump_json(
                        by_alias=True, exclude_unset=True
                    )
                    stdin.write(json.encode() + b"\n")
                    await stdin.drain()
        except (ConnectionError, OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await read_send.aclose()  # the server is gone: no request may wait forever

    async with anyio.create_task_group() as tg:
        tg.start_soon(server_to_session)
        tg.start_soon(session_to_server)
        try:
            yield read_recv, write_send
        finally:
            tg.cancel_scope.cancel()
            for stream in (read_recv, write_send, read_send, write_recv):
                await stream.aclose()
