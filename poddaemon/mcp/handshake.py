"""The start of a stdio MCP session without the SDK: `initialize`, `notifications/initialized`,
`tools/list` (all pages), as plain JSON-RPC lines.

Why: the SDK's import (~0.6 s of CPU, more on a busy host) would otherwise sit on the pod's path
to READY; the handshake is three small messages. The SDK's `ClientSession.adopt()` then takes
over the initialized session (no wire traffic) for the calls, once the SDK is imported.
A server that refuses the handshake-era `initialize` (a modern-only one) makes this return
None: the SDK's own negotiation takes over the same pipes.
"""

from typing import Any

import msgspec

import poddaemon
from poddaemon.mcp.stdio import StdioProcess, reply_id
from protocol.unreadable import UNREADABLE

# The newest revision reachable with `initialize` (mcp_types.version.LATEST_HANDSHAKE_VERSION).
PROTOCOL_VERSION = "2025-11-25"
# Those the SDK's session can adopt (mcp_types.version.HANDSHAKE_PROTOCOL_VERSIONS; a unit test
# checks they agree): the SDK is not imported yet when the handshake runs.
HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MAX_PAGES = 100


class HandshakeError(Exception):
    """The server answered something that is not MCP, or went away."""


class Handshake(msgspec.Struct):
    initialize: dict[str, Any]  # the InitializeResult, as sent
    tools: list[dict[str, Any]]  # every tools/list entry, as sent


async def handshake(process: StdioProcess) -> Handshake | None:
    """Initialize the server and list its tools; None if it refuses `initialize`."""
    rpc = _Lines(process)
    init = await rpc.request(
        "initialize",
        {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "poddaemon", "version": poddaemon.__version__},
        },
    )
    if "error" in init:
        return None
    result = init.get("result")
    if not isinstance(result, dict):
        raise HandshakeError(f"initialize: not a result: {init!r:.200}")
    if problem := _unadoptable(result):
        # Found by QA: accepted here, such a server was listed and offered, then every call
        # failed (status still "ready"), or it "died" twice at the SDK's first look at it.
        raise HandshakeError(f"initialize: {problem}")
    await rpc.notify("notifications/initialized")
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        reply = await rpc.request("tools/list", {"cursor": cursor} if cursor else {})
        if "error" in reply:
            raise HandshakeError(f"tools/list: {reply['error'].get('message', reply['error'])}")
        page = reply.get("result")
        listed = page.get("tools") if isinstance(page, dict) else None
        if not isinstance(listed, list):  # read as no tools, it failed nowhere anyone would see
            raise HandshakeError(f"tools/list: no list of tools in {reply!r:.200}")
        assert isinstance(page, dict)
        named = [t for t in listed if isinstance(t, dict) and t.get("name")]
        if repeated(seen, [str(t["name"]) for t in named]):
            break
        tools.extend(named)
        cursor = page.get("nextCursor")
        if not cursor:
            break
    return Handshake(initialize=result, tools=tools)


def repeated(seen: set[str], names: list[str]) -> bool:
    """Is a tools/list page one listed before (every name of it is in `seen`, which it then
    joins)? Found by QA: a server that ignores the cursor but always sends one, as some do,
    was listed MAX_PAGES times, and each tool of it was an alert 99 times ("listed twice")."""
    if names and seen.issuperset(names):
        return True
    seen.update(names)
    return False


def _unadoptable(result: dict[str, Any]) -> str | None:
    """Why the SDK's session could not take over a session with this InitializeResult, or
    None: the fields it requires, and a protocol revision it speaks."""
    version = result.get("protocolVersion")
    if version not in HANDSHAKE_VERSIONS:
        return (
            f"the server answers with protocol version {version!r:.40}; the pod speaks "
            f"{', '.join(HANDSHAKE_VERSIONS)}"
        )
    info = result.get("serverInfo")
    if not (
        isinstance(info, dict)
        and isinstance(info.get("name"), str)
        and isinstance(info.get("version"), str)
    ):
        return f"serverInfo is not an object with a name and a version: {info!r:.100}"
    if not isinstance(result.get("capabilities"), dict):
        return f"capabilities is not an object: {result.get('capabilities')!r:.100}"
    return None


class _Lines:
    """Newline-delimited JSON-RPC on the server's pipes, one request at a time."""

    def __init__(self, process: StdioProcess) -> None:
        self._process = process
        proc = process.proc
        assert proc.stdin is not None and proc.stdout is not None
        self._stdin = proc.stdin
        self._stdout = proc.stdout
        self._next_id = 0

    async def _send(self, message: dict[str, Any]) -> None:
        self._stdin.write(msgspec.json.encode({"jsonrpc": "2.0", **message}) + b"\n")
        await self._stdin.drain()

    async def notify(self, method: str) -> None:
        await self._send({"method": method})

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        # Negative ids: never the ones the SDK's session numbers from 0 or 1 afterwards.
        self._next_id -= 1
        rid = self._next_id
        try:
            await self._send({"id": rid, "method": method, "params": params})
        except (ConnectionError, OSError) as exc:
            raise HandshakeError(f"cannot write to the server: {exc}") from None
        while True:
            line = await self._stdout.readline()
            if not line:
                raise HandshakeError(f"the server closed its output during {method}")
            try:
                msg = msgspec.json.decode(line)
            except UNREADABLE as exc:
                # Our reply, too deep to decode (a tool's schema nested past the decoder's
                # limit)? Say so now: waiting would cost start_timeout and say "did not start".
                if reply_id(line) == str(rid).encode():
                    raise HandshakeError(
                        f"{method}: the server's reply cannot be read ({exc})"
                    ) from None
                if len(self._process.stray) < 100:  # (said if the start fails)
                    self._process.stray.append(line[:200])
                continue  # a stray line on stdout; the SDK's transport skips them too
            # A batch (an array of messages) is its messages, in order: found by QA, a server
            # answering in batches was skipped here, and its start waited out start_timeout.
            reply: dict[str, Any] | None = None
            for item in msg if isinstance(msg, list) else [msg]:
                if not isinstance(item, dict):
                    continue
                if item.get("id") == rid and "method" not in item:
                    if "result" not in item and "error" not in item:
                        # Found by QA: skipped, it cost start_timeout and "did not start".
                        raise HandshakeError(
                            f"{method}: the server's reply has neither a result nor an error"
                        )
                    if item.get("jsonrpc") != "2.0":
                        # Found by QA: taken here, the server was listed and offered, and the
                        # SDK then refused each reply of it: every call failed, status "ready".
                        raise HandshakeError(
                            f'{method}: the server\'s reply is not JSON-RPC 2.0 (its "jsonrpc" '
                            f"is {item.get('jsonrpc')!r:.20}, not '2.0')"
                        )
                    reply = item  # the rest of its batch is still answered
                elif "method" in item and "id" in item:  # a server's request (ping, roots…)
                    answer: dict[str, Any] = (
                        {"result": {}}
                        if item["method"] == "ping"
                        else {"error": {"code": -32601, "message": "not supported during start-up"}}
                    )
                    await self._send({"id": item["id"], **answer})
                # notifications (logging, progress) are dropped
            if reply is not None:
                return reply
