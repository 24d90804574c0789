"""The durable-ack floor: `python -m bench.fsync_server SOCK FILE [SIZE]` appends every request
line to FILE and answers it only after an fsync that covers it. With SIZE, each line is written
padded with spaces to SIZE bytes (still the same JSON): the bytes a log entry takes.

asyncio + uvloop, a bare `Protocol`: each complete line is written (one `os.write`) as it
arrives; one callback per loop iteration then fsyncs once, inline, and sends every waiting
reply (group commit with no thread hand-off, no JSON, no ids). What a durable `notify` cannot
beat on this stack. Prints `READY` on stdout once listening.
"""

import asyncio
import os
import sys
from typing import cast

import uvloop


class Durable:
    def __init__(self, path: str, size: int = 0) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.waiting: list[tuple[asyncio.Transport, bytes]] = []
        self.scheduled = False
        self.size = size

    def add(self, transport: asyncio.Transport, lines: bytes) -> None:
        if self.size:
            lines = b"".join(line.ljust(self.size - 1) + b"\n" for line in lines.splitlines())
        os.write(self.fd, lines)
        self.waiting.append((transport, lines))
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.commit)

    def commit(self) -> None:
        self.scheduled = False
        os.fsync(self.fd)  # inline: the whole batch of this loop iteration at once
        waiting, self.waiting = self.waiting, []
        for transport, lines in waiting:
            transport.write(lines)  # the "reply": the lines back, now durable


class Conn(asyncio.Protocol):
    def __init__(self, log: Durable) -> None:
        self.log = log
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        end = buf.rfind(b"\n") + 1
        if end:
            self.log.add(self.transport, buf[:end])
        self.buf = buf[end:]


async def serve(path: str, file: str, size: int = 0) -> None:
    log = Durable(file, size)
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: Conn(log), path)
    print("READY", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0))
