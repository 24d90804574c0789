"""The raw baseline server: `python -m bench.echo_server SOCK` echoes every line back.

asyncio + uvloop, a bare `Protocol` (no streams, no JSON): the floor any JSON-RPC server on the
same stack can reach. Prints `READY` on stdout once listening.
"""

import asyncio
import sys
from typing import cast

import uvloop


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        end = buf.rfind(b"\n") + 1
        if end:
            self.transport.write(buf[:end])  # every complete line, back as it came
        self.buf = buf[end:]


async def serve(path: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(Echo, path)
    print("READY", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1]))
