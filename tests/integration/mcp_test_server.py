"""A real MCP server for the tests, written with the `mcp` SDK (MCPServer).

`python mcp_test_server.py [--http PORT] [--ignore-eof] [--child] [--escapee] [--hang-at-start]`:
stdio by
default. With `MCP_TEST_PIDDIR` set it writes `server.<pid>` (and `child.<pid>` with `--child`)
files there, so tests can check that every process of the server dies with the pod.
"""

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("testsrv")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def fail(message: str) -> str:
    """Always fails with `message`."""
    raise ToolError(message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
async def hang(seconds: float) -> str:
    """Block the whole server (its event loop too: no ping is answered), then answer."""
    time.sleep(seconds)
    return f"hung {seconds}"


@server.tool()
def env(name: str) -> str:
    """The value of an environment variable of the server, or <unset>."""
    return os.environ.get(name, "<unset>")


@server.tool()
def big(n: int) -> str:
    """n bytes of output."""
    return "x" * n


@server.tool()
def pid() -> str:
    """The server's pid."""
    return str(os.getpid())


@server.tool()
def crash() -> str:
    """The server dies at once."""
    os._exit(3)


def record_pid(piddir: str, role: str, pid: int) -> None:
    with open(os.path.join(piddir, f"{role}.{pid}"), "w") as f:
        f.write(str(pid))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    parser.add_argument("--ignore-eof", action="store_true")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--hang-at-start", action="store_true")
    parser.add_argument("--escapee", action="store_true")
    args = parser.parse_args()
    piddir = os.environ.get("MCP_TEST_PIDDIR")
    if args.child:
        # A grandchild that ignores SIGTERM and never reads stdin: only a group kill ends it.
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "while True: time.sleep(60)",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        if piddir:
            record_pid(piddir, "child", child.pid)
    if args.escapee:
        # Detached as some servers detach a browser: its own session, SIGTERM ignored.
        escapee = subprocess.Popen(
            [sys.executable, "-c", "import signal, time\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "while True: time.sleep(60)"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        if piddir:
            record_pid(piddir, "escapee", escapee.pid)
    if piddir:
        record_pid(piddir, "server", os.getpid())
    if args.hang_at_start:
        time.sleep(3600)
    if args.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
        return
    server.run("stdio")
    if args.ignore_eof:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(60)


if __name__ == "__main__":
    main()
