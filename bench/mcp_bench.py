"""20. MCP: pod start-up to READY with one stdio MCP server vs none, and the cost of one MCP tool
call vs a builtin one.

`python bench/mcp_bench.py serve` is the MCP server measured (the `mcp` SDK's MCPServer with one
`echo` tool); run as a file because a pod passes a server no PYTHONPATH. Only the standard
library is imported at the top for the same reason.
"""

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
STARTS = 5  # per kind, interleaved
CALLS = 40  # tool calls per run (one per model round)


def serve() -> None:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("bench", log_level="WARNING")

    @server.tool()
    def echo(text: str) -> str:
        """Return the text."""
        return text

    server.run("stdio")


def _server_own_start(py: str, env: dict[str, str]) -> float:
    """ms from spawning the server to its tool list (initialize, initialized, tools/list over
    raw pipes): what the server itself costs, with no client library on our side."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        [py, str(HERE), "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None

    def send(msg: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **msg}).encode() + b"\n")
        proc.stdin.flush()

    init = {"protocolVersion": "2025-06-18", "capabilities": {}}
    send({"id": 1, "method": "initialize",
          "params": {**init, "clientInfo": {"name": "bench", "version": "0"}}})  # fmt: skip
    proc.stdout.readline()
    send({"method": "notifications/initialized"})
    send({"id": 2, "method": "tools/list"})
    assert b'"echo"' in proc.stdout.readline()
    ms = (time.perf_counter() - t) * 1e3
    proc.stdin.close()
    proc.wait(10)
    return ms


# A hand-written server without the SDK (starts in tens of ms, like a native binary would).
TINY = HERE.parent.parent / "tests" / "integration" / "mcp_legacy_server.py"


def _server_toml(py: str, script: Path = HERE) -> str:
    args = [py, str(script)] + (["serve"] if script == HERE else [])
    return f'\n[[mcp.servers]]\nname = "b"\ncommand = {json.dumps(args)}\n'


def _ready_ms(home: Any, name: str, extra: str) -> float:
    from bench.harness import Rpc

    manifest = home.manifest(name, extra=extra)
    t = time.perf_counter()
    pod = home.start_pod(name, manifest=manifest)
    ms = (time.perf_counter() - t) * 1e3
    with Rpc(pod.socket) as c:
        c.call("shutdown")
    pod.proc.wait(30)
    home.pods.remove(pod)
    return ms


def _tool_ms(
    pod: Any, fake: Any, tool: str, args: dict[str, Any], per_round: bool = False
) -> list[float]:
    """tool.started -> tool.finished (ms) for CALLS calls of `tool`: all in one model round
    (back to back, as the SDK baseline calls them), or one per round (the server idles
    through each model call first)."""
    from protocol import PodClient

    fake.reset()
    call = {"name": tool, "arguments": args}
    if per_round:
        fake.script(*[{"tool_calls": [call]}] * CALLS, {"text": "done"})
    else:
        fake.script({"tool_calls": [call] * CALLS}, {"text": "done"})
    started: dict[str, float] = {}
    out: list[float] = []
    with PodClient.connect(pod.socket, timeout=120) as c:
        c.subscribe()
        c.run("go")
        for event in c.events():
            if event.type == "tool.started":
                started[event.data["call_id"]] = event.ts
            elif event.type == "tool.finished":
                assert not event.data["is_error"], event.data
                out.append((event.ts - started[event.data["call_id"]]) * 1e3)
            elif event.type == "run.finished":
                break
    return out


def _sdk_call_ms(py: str, env: dict[str, str]) -> list[float]:
    """The same `echo` call with the plain SDK Client in one process, against the same server."""
    code = f"""
import asyncio, json, sys, time
from mcp import Client, StdioServerParameters
async def main():
    params = StdioServerParameters(command={py!r}, args=[{str(HERE)!r}, "serve"])
    async with Client(params) as c:
        await c.list_tools()
        out = []
        for _ in range({CALLS}):
            t = time.perf_counter()
            await c.call_tool("echo", {{"text": "hi"}})
            out.append((time.perf_counter() - t) * 1e3)
        print(json.dumps(out))
asyncio.run(main())
"""
    out = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, check=True)
    result: list[float] = json.loads(out.stdout)
    return result


def run(sec: Any) -> None:
    from bench.harness import PY, Home, Row, median, pct, ratio_le

    with Home() as home:
        fake = home.fake
        assert fake is not None
        _server_own_start(PY, home.env)  # warm the page cache
        own: list[float] = []
        plain: list[float] = []
        with_mcp: list[float] = []
        with_tiny: list[float] = []
        for i in range(STARTS):
            own.append(_server_own_start(PY, home.env))
            plain.append(_ready_ms(home, f"plain{i}", ""))
            with_mcp.append(_ready_ms(home, f"mcp{i}", _server_toml(PY)))
            with_tiny.append(_ready_ms(home, f"tiny{i}", _server_toml(PY, TINY)))
        sec.add(Row("start to READY, no MCP server, median", median(plain), "ms"))
        sec.add(
            Row(
                "start to READY, one stdio MCP server, median",
                median(with_mcp),
                "ms",
                median(plain),
                "no MCP server",
            )
        )
        sec.add(
            Row(
                "READY delayed by the MCP server, median",
                median(with_mcp) - median(plain),
                "ms",
                median(own),
                "the server's own start (spawn to tool list, raw pipes)",
                ratio_le(1.25),
            )
        )

        sec.add(
            Row(
                "READY delayed by a tiny server without the SDK, median",
                median(with_tiny) - median(plain),
                "ms",
                median(plain),
                "no MCP server (the delay: a tiny server's start + the handshake)",
            )
        )

        pod = home.start_pod("caller", extra=_server_toml(PY))
        builtin = _tool_ms(pod, fake, "list_dir", {"path": "."})
        mcp = _tool_ms(pod, fake, "b__echo", {"text": "hi"})
        mcp_spaced = _tool_ms(pod, fake, "b__echo", {"text": "hi"}, per_round=True)
        builtin_spaced = _tool_ms(pod, fake, "list_dir", {"path": "."}, per_round=True)
        sdk = _sdk_call_ms(PY, home.env)
        sec.add(
            Row(
                "MCP tool call in a pod, back to back, p50 (tool.started→finished)",
                pct(mcp, 50),
                "ms",
                pct(sdk, 50),
                "same call, plain SDK Client in one process",
                ratio_le(1.5),
            )
        )
        sec.add(
            Row(
                "builtin tool call in a pod (list_dir), back to back, p50",
                pct(builtin, 50),
                "ms",
            )
        )
        sec.add(
            Row(
                "MCP call overhead over a builtin one, back to back, p50",
                pct(mcp, 50) - pct(builtin, 50),
                "ms",
            )
        )
        sec.add(
            Row(
                "MCP tool call, one per model round, p50",
                pct(mcp_spaced, 50),
                "ms",
                pct(builtin_spaced, 50),
                "builtin list_dir, one per model round",
            )
        )
        sec.note(
            "back to back, the pod adds nothing measurable to the SDK's own call; one call per "
            "round also pays for waking the idle server process (scheduler latency on a busy host)"
        )
        sec.note(
            f"p99: MCP {pct(mcp, 99):.2f} ms, builtin {pct(builtin, 99):.2f} ms, "
            f"plain SDK {pct(sdk, 99):.2f} ms; {CALLS} calls each; "
            f"server's own start {', '.join(f'{x:.0f}' for x in own)} ms"
        )


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
