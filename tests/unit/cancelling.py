"""Helpers for tests of what a cancellation leaves behind: a cancellation made to land in the
loop pass that connecting a pipe takes, and the processes a command left running."""

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def cancelled_while_connecting(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Within: `loop.connect_read_pipe` cancels the task that calls it, then connects, so the
    cancellation lands in the loop pass connecting takes."""
    connect = loop.connect_read_pipe

    async def cancelled_meanwhile(*args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        return await connect(*args, **kwargs)

    loop.connect_read_pipe = cancelled_meanwhile  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.connect_read_pipe  # (the class's own again)


def running() -> Iterator[tuple[int, bytes, list[str]]]:
    """Each running (non-zombie) process: its pid, command line and /proc stat fields after
    the command name (state first, then ppid, pgrp, ...)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (gone meanwhile)
        if fields[0] not in ("Z", "X"):
            yield int(entry), cmdline, fields


def live_with(token: str) -> list[int]:
    """Running processes whose command line holds `token`."""
    return [pid for pid, cmdline, _ in running() if token.encode() in cmdline]


async def left_running(token: str, deadline: float = 5.0) -> list[int]:
    """The processes of `live_with(token)` still running after up to `deadline` seconds."""
    end = time.monotonic() + deadline
    while (alive := live_with(token)) and time.monotonic() < end:
        await asyncio.sleep(0.01)
    return alive
