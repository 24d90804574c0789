"""Every MCP server of a pod: started together before READY, their tools merged, closed at exit.

The pod uses three things: `await start_mcp(manifest, alert)` before READY (raises
McpStartupError for a start-up error), `manager.tools` merged into its tool registry, and
`await manager.aclose()` at shutdown; `manager.status()` feeds `status`.
"""

import asyncio
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from poddaemon import collector
from poddaemon.config.manifest import Manifest
from poddaemon.tools.base import Tool

log = logging.getLogger("poddaemon.mcp")

if TYPE_CHECKING:  # imported by start_mcp: a pod without servers never loads them (~3 ms)
    from poddaemon.mcp.connection import Alert, McpConnection, McpServerStatus


class McpStartupError(Exception):
    """The pod must not start: a `${VAR}` that is not set, or a required server that failed.
    `lasting`: starting again as it is changes nothing (the unset variable), as for a
    provider key that is not set; a required server may come up next time."""

    def __init__(self, message: str, *, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


class McpManager:
    def __init__(self, connections: "list[McpConnection]") -> None:
        self._connections = connections
        self.tools: dict[str, Tool] = {}
        for conn in connections:
            self.tools.update(conn.tools)

    def status(self) -> "list[McpServerStatus]":
        return [c.status() for c in self._connections]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._connections))


# The SDK's own log records reach the pod's log SDK_LOG_BURST at once, then one every
# SDK_LOG_EVERY seconds: it logs a warning with its traceback (~17 lines) for each notification
# it cannot validate, and a server sending those by the thousand must not flood the log (found
# by QA: 3,000 of them were 51,000 lines, 4 MB, and ~10 s of the pod's CPU).
SDK_LOG_BURST = 20
SDK_LOGGERS = ("mcp", "client")  # its client session logs as "client", not under "mcp"
SDK_LOG_EVERY = 1.0


class _SdkLog(logging.Handler):
    """The SDK's records, rate-limited, into the pod's log (through `poddaemon.mcp`'s handlers:
    a filter on the `mcp` logger would not see its children's records)."""

    def __init__(self) -> None:
        super().__init__()
        self._allowance = float(SDK_LOG_BURST)
        self._refilled = time.monotonic()
        self._dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        self._allowance = min(
            SDK_LOG_BURST, self._allowance + (now - self._refilled) / SDK_LOG_EVERY
        )
        self._refilled = now
        if self._allowance < 1:
            if not self._dropped:
                log.warning("the MCP SDK logs faster than it is logged: records dropped")
            self._dropped += 1
            return
        self._allowance -= 1
        if self._dropped:
            log.warning("%d records of the MCP SDK were not logged (too many)", self._dropped)
            self._dropped = 0
        log.handle(record)


def _import_sdk() -> None:
    with collector.paused():  # its modules live as long as the pod (see poddaemon/collector.py)
        importlib.import_module("mcp")
    # The SDK logs every request at INFO; the pod's log keeps its warnings, so many a second.
    handler = _SdkLog()
    for name in SDK_LOGGERS:
        sdk = logging.getLogger(name)
        sdk.setLevel(logging.WARNING)
        if not any(isinstance(h, _SdkLog) for h in sdk.handlers):
            sdk.addHandler(handler)
            sdk.propagate = False


def preload_sdk(manifest: Manifest) -> None:
    """Start importing the SDK in a background thread now, if an HTTP server needs it to start.

    The import (~0.6 s of CPU, more on a busy host) is on the path to READY for `url` servers;
    the daemon calls this as soon as the manifest is loaded, so it overlaps the rest of
    start-up. stdio servers are listed without the SDK, which is imported after their handshake
    (off the path to READY, and not competing with their own start for the CPU).
    """
    if any(s.url for s in manifest.mcp.servers) and "mcp" not in sys.modules:
        threading.Thread(target=_import_sdk, name="mcp-import", daemon=True).start()


async def start_mcp(
    manifest: Manifest, alert: "Alert", environ: Mapping[str, str] | None = None
) -> McpManager:
    """Start every `[[mcp.servers]]` concurrently, each bounded by its `start_timeout`.

    A server that fails is an alert and its tools are absent, unless it is `required`: then
    everything started is stopped and McpStartupError names it. With no servers the SDK is never
    imported.
    """
    servers = manifest.mcp.servers
    if not servers:
        return McpManager([])
    from poddaemon.mcp.connection import McpConnection, StartFailed, code_dir
    from poddaemon.mcp.env import EnvError, server_env
    from poddaemon.scope import Scope

    environ = os.environ if environ is None else environ
    envs: dict[str, dict[str, str]] = {}
    for i, cfg in enumerate(servers):
        if cfg.command is None:
            continue
        try:
            envs[cfg.name] = server_env(cfg.env, environ)
        except EnvError as exc:
            raise McpStartupError(
                f"{manifest.source}: mcp.servers[{i}].{exc}", lasting=True
            ) from None
    # ~0.6 s of imports, in a thread, once, when the first server needs it.
    loaded: list[asyncio.Future[None]] = []

    def sdk() -> "asyncio.Future[None]":
        if not loaded:
            loaded.append(asyncio.ensure_future(asyncio.to_thread(_import_sdk)))
        return loaded[0]

    # The manifest's write scope, children's areas included: their commands may write there.
    pwd = manifest.pod.pwd
    scope = Scope.from_config(manifest.scope.allow, manifest.scope.deny, cwd=pwd)
    connections = [
        McpConnection(
            cfg, envs.get(cfg.name), cfg.cwd or pwd, sdk, alert, code_dir(cfg, pwd, scope)
        )
        for cfg in servers
    ]
    results = await asyncio.gather(*(c.start() for c in connections), return_exceptions=True)
    manager = McpManager(connections)
    for i, (conn, result) in enumerate(zip(connections, results, strict=True)):
        if isinstance(result, asyncio.CancelledError):
            await manager.aclose()
            raise result
        if not isinstance(result, BaseException):
            continue
        why = str(result) if isinstance(result, StartFailed) else repr(result)
        if conn.cfg.required:
            await manager.aclose()
            raise McpStartupError(
                f"{manifest.source}: mcp.servers[{i}]: required MCP server '{conn.name}' "
                f"failed to start: {why}"
            )
        alert(
            "warning",
            "mcp",
            f"MCP server '{conn.name}' failed to start: {why}; its tools are absent",
        )
    return manager
