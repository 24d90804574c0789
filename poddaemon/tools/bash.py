"""The opt-in bash tool. Commands are started by the pod's command runner (a subreaper helper
process, `poddaemon/runner.py`), each in its own session; on timeout, cancellation, or when the
shell exits (leftover background jobs), the runner kills the command's group, its whole process
tree and every orphan it left (`setsid` ones too); when the pod dies, even by `kill -9`, the
runner kills everything. Commands get the pod's environment minus credential-like variables.
It is not confined by the scope check; that is why it is opt-in."""

import asyncio
import codecs
import contextlib
import os
from typing import Any

from poddaemon.pipes import read_pipe
from poddaemon.tools.base import ToolContext, ToolError, ToolOutcome, schema
from poddaemon.tools.runner_client import CommandRunner, RunnerError

DEFAULT_TIMEOUT = 120
MAX_TIMEOUT = 600
# After the group is killed, how long to wait for the output pipe to close (a process that
# left the group with setsid may still hold it).
DRAIN_GRACE = 5.0
# The kernel's limit on one argument (MAX_ARG_STRLEN, 32 pages, with its NUL): a longer command
# failed as "Argument list too long: '/bin/bash'", which does not say what to do.
MAX_COMMAND_BYTES = 32 * os.sysconf("SC_PAGESIZE") - 1


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


async def _run(
    runner: CommandRunner, command: str, cwd: str, timeout: int, capture: _Capture
) -> tuple[int | None, bool]:
    """Run `command` through the runner: (returncode, timed out). Whatever happens here, the
    command and everything it started are killed before this returns or raises."""
    r, w = os.pipe()
    try:
        cmd = await runner.spawn(["/bin/bash", "-c", command], cwd, w)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)  # the command holds the only write end now: EOF once it is all gone
    stream = asyncio.StreamReader(limit=2**16)
    transport: asyncio.BaseTransport | None = None
    reader: asyncio.Task[None] | None = None
    timed_out = False
    try:
        # Inside: connecting takes a loop pass, and a cancellation there let the command run
        # on until the pod ended.
        transport = await read_pipe(r, stream)
        reader = asyncio.create_task(capture.drain(stream))
        try:
            async with asyncio.timeout(timeout):
                # Not the pipe's EOF: a background job holding stdout would delay that.
                await asyncio.shield(cmd.exited)
        except TimeoutError:
            timed_out = True
        await runner.kill(cmd)  # on timeout everything; otherwise leftover background jobs
        done, _ = await asyncio.wait({reader}, timeout=DRAIN_GRACE)
        if not done:  # cannot happen unless something escaped the runner: stop reading
            reader.cancel()
    except BaseException:  # cancellation: kill, then let it propagate
        with contextlib.suppress(BaseException):
            await runner.kill(cmd)
        if reader is not None:
            reader.cancel()
        raise
    finally:
        if transport is not None:
            transport.close()
    with contextlib.suppress(BaseException):
        await reader
    if cmd.exited.done() and cmd.exited.exception() is None:
        return cmd.exited.result(), timed_out
    raise ToolError("the command runner exited while the command ran; it was killed")


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
        size = len(command.encode("utf-8", "surrogatepass"))
        if size > MAX_COMMAND_BYTES:
            raise ToolError(
                f"the command is {size} bytes; at most {MAX_COMMAND_BYTES} can be run as one "
                "(write a script with write_file and run that)"
            )
        capture = _Capture(ctx.limits.max_bytes(self.name))
        try:
            runner = await ctx.command_runner()
        except (RunnerError, OSError) as e:
            raise ToolError(f"cannot run commands: {e}") from None
        try:
            rc, timed_out = await _run(runner, command, ctx.pwd, timeout, capture)
        except RunnerError as e:
            raise ToolError(str(e)) from None
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
