"""The opt-in bash tool. It runs in its own process group, killed as a group on timeout,
cancellation, or when the shell exits (leftover background jobs): no orphans.
It is not confined by the scope check; that is why it is opt-in."""

import asyncio
import codecs
import contextlib
import os
import signal
from typing import Any

from poddaemon.tools.base import ToolContext, ToolError, ToolOutcome, schema

DEFAULT_TIMEOUT = 120
MAX_TIMEOUT = 600
# After the group is killed, how long to wait for the output pipe to close (a process that
# left the group with setsid may still hold it).
DRAIN_GRACE = 5.0


class _Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.total += len(chunk)
            room = self.limit - len(self.data)
            if room > 0:
                self.data += chunk[:room]

    def text(self) -> str:
        truncated = self.total > len(self.data)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(bytes(self.data), final=not truncated).rstrip("\n")
        if truncated:
            text += f"\n[output truncated: {self.total} bytes, showing the first {self.limit}]"
        return text


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Tells when the shell itself exits. `Process.wait()` only returns once every pipe is
    closed, which a background job holding stdout would delay until the timeout."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2**16, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class Bash:
    name = "bash"
    description = "Run a bash command in the working directory; stdout and stderr merged."
    parameters = schema(
        {"command": ("string", "shell command")},
        {"timeout": ("integer", f"seconds (default {DEFAULT_TIMEOUT}, max {MAX_TIMEOUT})")},
    )
    # execute() leaves the output alone: the capture below applies ctx.limits itself and
    # reports the true size of what the command printed.
    caps_own_output = True

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        command: str = args["command"]
        timeout: int = args.get("timeout", DEFAULT_TIMEOUT)
        if not 1 <= timeout <= MAX_TIMEOUT:
            raise ToolError(f"timeout must be between 1 and {MAX_TIMEOUT} seconds")
        capture = _Capture(ctx.limits.max_bytes(self.name))
        loop = asyncio.get_running_loop()
        spawn = asyncio.ensure_future(
            loop.subprocess_exec(
                lambda: _Protocol(loop),
                "/bin/bash",
                "-c",
                command,
                cwd=ctx.pwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        )
        try:
            # Shielded: cancelled while starting, the shell may already be running (and forking).
            transport, protocol = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                started, _ = await spawn
                _kill_group(started.get_pid())
                started.close()
            raise
        proc = asyncio.subprocess.Process(transport, protocol, loop)
        pgid = proc.pid  # a new session: the shell leads its own process group
        assert proc.stdout is not None
        reader = asyncio.create_task(capture.drain(proc.stdout))
        timed_out = False
        try:
            try:
                async with asyncio.timeout(timeout):
                    await protocol.exited
            except TimeoutError:
                timed_out = True
            _kill_group(pgid)  # on timeout everything; otherwise leftover background jobs
            done, _ = await asyncio.wait({reader}, timeout=DRAIN_GRACE)
            if not done:  # something left the group and still holds the pipe
                reader.cancel()
                transport.close()
            await proc.wait()
        except BaseException:  # cancellation: kill, reap, then let it propagate
            _kill_group(pgid)
            reader.cancel()
            transport.close()
            with contextlib.suppress(BaseException):
                await proc.wait()
            with contextlib.suppress(BaseException):
                await reader
            raise
        rc = proc.returncode
        lines = [capture.text()] if capture.total else []
        if timed_out:
            lines.append(f"timed out after {timeout}s")
            status = f"timed out after {timeout}s"
        elif rc is not None and rc < 0:
            lines.append(f"killed by signal {-rc}")
            status = f"signal {-rc}"
        elif rc:
            lines.append(f"exit code {rc}")
            status = f"exit {rc}"
        else:
            status = "exit 0"
        first = command.strip().splitlines()[0] if command.strip() else ""
        if len(first) > 60:
            first = first[:59] + "…"
        return ToolOutcome(
            output="\n".join(lines) or "(no output)",
            is_error=timed_out or rc != 0,
            summary=f"$ {first} → {status}",
        )
