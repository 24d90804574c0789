"""Reading a pipe on the event loop, its descriptor owned whatever happens."""

import asyncio
import contextlib
import os


async def read_pipe(fd: int, reader: asyncio.StreamReader) -> asyncio.ReadTransport:
    """Feed `reader` from `fd`, the read end of a pipe, which the transport returned owns.

    Connecting takes a loop pass. Cancelled there, the file object around `fd` is closed here,
    at once: uvloop has closed the descriptor under it and leaves the object to close that
    number again when collected (whatever reused it by then); asyncio closes it a pass later.
    A caller closing `fd` itself closed it twice."""
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
    except BaseException:
        with contextlib.suppress(OSError):  # EBADF: closed under it already (uvloop)
            pipe.close()
        raise
    return transport
