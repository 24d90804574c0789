"""`kill -USR1 <pod>`: where every task waits, and what every other thread runs."""

import asyncio
from collections.abc import AsyncIterator

from poddaemon.daemon import await_chain


def test_await_chain_names_every_await_down_to_the_innermost() -> None:
    """What `kill -USR1` prints for each task: not just the task's own coroutine (all that
    `Task.print_stack` shows) but each coroutine and async generator it awaits."""

    async def innermost(gate: asyncio.Event) -> None:
        await gate.wait()

    async def stream(gate: asyncio.Event) -> AsyncIterator[int]:
        await innermost(gate)
        yield 1

    async def outer(gate: asyncio.Event) -> None:
        async for _ in stream(gate):
            pass

    async def main() -> list[str]:
        gate = asyncio.Event()
        task = asyncio.ensure_future(outer(gate))
        await asyncio.sleep(0)
        chain = await_chain(task.get_coro())
        gate.set()
        await task
        return chain

    chain = asyncio.run(main())
    names = [where.rsplit(" in ", 1)[1] for where in chain]
    assert names[:4] == ["outer", "stream", "innermost", "wait"], chain
    assert chain[0].startswith(__file__)
