"""poddaemon.pipes.read_pipe: a pipe read on the event loop, under asyncio and uvloop; cancelled
while connecting, its descriptor is closed, and only once."""

import asyncio
import gc
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from poddaemon.pipes import read_pipe

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}


@pytest.mark.parametrize("loop", LOOPS)
def test_it_reads_the_pipe_to_its_end(loop: str) -> None:
    async def main() -> None:
        r, w = os.pipe()
        reader = asyncio.StreamReader()
        transport = await read_pipe(r, reader)
        os.write(w, b"hello\n")
        os.close(w)
        assert await reader.read() == b"hello\n"
        transport.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_cancelled_while_connecting_it_closes_the_descriptor_once(loop: str) -> None:
    async def main() -> None:
        r, w = os.pipe()
        task = asyncio.ensure_future(read_pipe(r, asyncio.StreamReader()))
        await asyncio.sleep(0)  # it waits for the connection now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        os.close(w)
        with pytest.raises(OSError):
            os.fstat(r)  # closed
        reused, other = os.pipe()  # the lowest free numbers: those just closed
        try:
            assert reused == r
            del task  # (whatever still held the file object around the old descriptor lets go)
            gc.collect()
            os.fstat(reused)  # still open: nothing closed that number a second time
        finally:
            os.close(reused)
            os.close(other)

    LOOPS[loop](main())
