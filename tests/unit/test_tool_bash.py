"""The bash tool: exit codes, merged output, caps, and no orphans on timeout or cancellation."""

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from poddaemon.scope import Scope
from poddaemon.tools import ToolContext, ToolOutcome, ToolOutputLimits, execute
from tests.unit.cancelling import cancelled_while_connecting, left_running, running


@pytest.fixture
async def ctx(tmp_path: Path) -> AsyncIterator[ToolContext]:
    scope = Scope.from_config([(str(tmp_path), "write", True)])
    context = ToolContext(scope=scope, pwd=str(tmp_path))
    yield context
    await context.aclose()


async def bash(ctx: ToolContext, command: str, **args: Any) -> ToolOutcome:
    return await execute("bash", msgspec.json.encode({"command": command, **args}).decode(), ctx)


def live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are still running (zombies awaiting a reaper don't count)."""
    return [pid for pid, _, fields in running() if int(fields[2]) == pgid]


async def wait_until_gone(pgid: int, deadline: float = 5.0) -> list[int]:
    end = time.monotonic() + deadline
    while (alive := live_members(pgid)) and time.monotonic() < end:
        await asyncio.sleep(0.01)
    return alive


async def wait_for_file(path: Path, deadline: float = 10.0) -> str:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if path.exists() and (text := path.read_text()).endswith("\n"):
            return text
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never written")


async def test_success_merges_stdout_and_stderr(ctx: ToolContext) -> None:
    out = await bash(ctx, "echo out; echo err >&2; echo again")
    assert not out.is_error
    assert out.output == "out\nerr\nagain"
    assert out.summary.endswith("→ exit 0")


async def test_nonzero_exit_is_an_error_with_the_code(ctx: ToolContext) -> None:
    out = await bash(ctx, "echo failing; exit 2")
    assert out.is_error
    assert out.output == "failing\nexit code 2"
    assert out.summary == "$ echo failing; exit 2 → exit 2"


async def test_runs_in_pwd_with_stdin_closed(ctx: ToolContext, tmp_path: Path) -> None:
    out = await bash(ctx, "pwd; cat; echo done")
    assert out.output == f"{tmp_path}\ndone"
    out = await bash(ctx, "true")
    assert out.output == "(no output)" and not out.is_error


async def test_output_is_capped_with_true_size(tmp_path: Path) -> None:
    scope = Scope.from_config([(str(tmp_path), "write", True)])
    ctx = ToolContext(
        scope=scope, pwd=str(tmp_path), limits=ToolOutputLimits(per_tool={"bash": 1000})
    )
    out = await bash(ctx, "head -c 100000 /dev/zero | tr '\\0' a")
    await ctx.aclose()
    assert out.output == "a" * 1000 + "\n[output truncated: 100000 bytes, showing the first 1000]"


async def test_timeout_validation(ctx: ToolContext) -> None:
    for bad in (0, 601):
        out = await bash(ctx, "true", timeout=bad)
        assert out.is_error and "timeout must be between 1 and 600" in out.output


async def test_a_command_too_long_for_the_kernel_says_so(ctx: ToolContext) -> None:
    # It failed as "could not start the command: OSError: [Errno 7] Argument list too long:
    # '/bin/bash'", naming neither the limit nor a way round it.
    limit = 32 * os.sysconf("SC_PAGESIZE") - 1  # MAX_ARG_STRLEN, less its NUL
    xs = limit - len("echo ") - len(" | wc -c")
    longest = "echo " + "x" * xs + " | wc -c"
    out = await bash(ctx, longest)
    assert (out.is_error, out.output) == (False, str(xs + 1))  # the kernel takes it
    out = await bash(ctx, longest + " ")
    assert out.is_error
    assert out.output == (
        f"the command is {limit + 1} bytes; at most {limit} can be run as one "
        "(write a script with write_file and run that)"
    )


async def test_timeout_kills_the_whole_group(ctx: ToolContext) -> None:
    started = time.monotonic()
    out = await bash(ctx, "echo $$; echo begun; sleep 1000 & sleep 1000", timeout=1)
    assert time.monotonic() - started < 10
    assert out.is_error, out.output
    pgid_text, rest = out.output.split("\n", 1)
    assert rest == "begun\ntimed out after 1s", out.output
    assert await wait_until_gone(int(pgid_text)) == []


async def test_background_jobs_do_not_outlive_the_shell(ctx: ToolContext) -> None:
    out = await bash(ctx, "echo $$; sleep 1000 & echo bye")
    assert not out.is_error
    pgid_text, rest = out.output.split("\n", 1)
    assert rest == "bye"
    assert await wait_until_gone(int(pgid_text)) == []


async def test_cancellation_kills_the_group_and_propagates(
    ctx: ToolContext, tmp_path: Path
) -> None:
    marker = tmp_path / "pgid"
    task = asyncio.create_task(bash(ctx, f"sleep 1000 & echo $$ > {marker}; sleep 1000"))
    pgid = int(await wait_for_file(marker))
    assert len(live_members(pgid)) >= 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_until_gone(pgid) == []


@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8, 13, 21])
async def test_cancellation_at_any_point_leaves_no_process(ctx: ToolContext, yields: int) -> None:
    token = f"{987 + yields}.{os.getpid()}{yields}"  # a unique `sleep` argument
    task = asyncio.create_task(bash(ctx, f"sleep {token} & sleep {token}"))
    for _ in range(yields):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await left_running(token) == []


async def test_cancelled_while_its_output_is_being_connected_it_is_killed(
    ctx: ToolContext,
) -> None:
    # The loop pass between the runner's `started` and reading the command's output: a turn
    # cancelled there left the command running until the pod itself ended.
    token = f"{977}.{os.getpid()}"
    with cancelled_while_connecting(asyncio.get_running_loop()):
        task = asyncio.create_task(bash(ctx, f"sleep {token} & sleep {token}"))
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await left_running(token) == []
