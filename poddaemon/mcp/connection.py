"""One MCP server for the life of a pod: start and tool list (bounded by `start_timeout`, listed
once), calls (bounded by `timeout`), one restart after a death, stop.

A stdio server is initialized and listed without the SDK (`handshake.py`), then an SDK
`ClientSession` adopts that session; an HTTP server (or a stdio one that refuses our
`initialize`) gets the SDK's `Client` and its own negotiation. Either is entered and exited by
one task, the holder (anyio's cancel scopes must nest within a task); calls come from the pod's
tool tasks and share it while it is up.
"""

import asyncio
import collections
import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from poddaemon.config.manifest import McpServerConfig, loads_from_cwd
from poddaemon.mcp.handshake import Handshake, HandshakeError, handshake, repeated
from poddaemon.mcp.stdio import DROPPED, PROTOCOL_BROKEN, StdioProcess, transport
from poddaemon.mcp.tool import (
    McpTool,
    error,
    input_schema,
    offered_name,
    outcome,
    schema_problem,
)
from poddaemon.tools.base import ToolOutcome

if TYPE_CHECKING:
    from poddaemon.scope import Scope

log = logging.getLogger("poddaemon.mcp")

Alert = Callable[[str, str, str], None]  # (level, source, message), as the pod's alerts
MAX_PAGES = 100  # tools/list pages followed; a paginator that never ends cannot hang start-up
CALL_MARGIN = 5.0  # seconds past `timeout` after which a call is abandoned even if the SDK hangs
PING_TIMEOUT = 2.0  # after a call timed out: a server that cannot answer a ping in this is hung
SAID_ONE_BY_ONE = 10  # tools that cannot be offered, one alert each; the rest in one more
GIVE_UP = 5.0  # seconds past `start_timeout` a server that did not start gets to be stopped

FileId = tuple[int, int, int]  # (device, inode, ctime): a rewrite or a rename over it changes it


def program_files(command: list[str], cwd: str) -> dict[str, FileId]:
    """The files a stdio server's command names (its program, its script: any word that is an
    existing file, relative to `cwd` as the server sees it), each with its identity now."""
    out: dict[str, FileId] = {}
    for word in command:
        path = os.path.join(cwd, word)
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            continue
        if os.path.isfile(path):
            out[path] = (st.st_dev, st.st_ino, st.st_ctime_ns)
    return out


def rewritable_files(
    server: McpServerConfig, pwd: str, scope: "Scope", commands: bool
) -> list[str]:
    """The files `server`'s command names that a pod of `scope` may rewrite (`commands`: it
    runs bash): the server runs them outside the sandbox at the pod's next start."""
    from poddaemon.sandbox.policy import may_replace

    files = program_files(server.command or [], server.cwd or pwd)
    found = [path for path in files if may_replace(path, scope, commands)]
    if (cwd := code_dir(server, pwd, scope)) is not None:
        found.append(f"{cwd} (its working directory, which its command loads code from)")
    return found


def code_dir(server: McpServerConfig, pwd: str, scope: "Scope") -> str | None:
    """`server`'s working directory when its command loads code from there (`python3 -m`,
    `sh -c`, `npx`: `loads_from_cwd`) and the pod may write there: found by QA, the model
    put a `json.py` beside a `python3 -m` server living outside the scope, crashed it, and its
    restart ran that file unconfined. What it loads cannot be checked as a script can."""
    from poddaemon.scope import Access

    if server.command is None or not loads_from_cwd(server.command):
        return None
    cwd = server.cwd or pwd
    return cwd if scope.access(os.path.realpath(cwd)) >= Access.WRITE else None


class StartFailed(Exception):
    """A server could not be started, connected or listed; the message says why."""


class McpServerStatus(msgspec.Struct, kw_only=True):
    name: str
    transport: str  # "stdio" | "http"
    # starting | ready | restarting | failed (never started) | dead (died, no restart left)
    # | stopped
    state: str
    tools: int
    restarts: int = 0
    error: str | None = None


class McpConnection:
    def __init__(
        self,
        cfg: McpServerConfig,
        env: dict[str, str] | None,
        cwd: str,
        sdk: Callable[[], "asyncio.Future[None]"],
        alert: Alert,
        code_dir: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.state = "starting"
        self.error: str | None = None
        self.tools: dict[str, McpTool] = {}
        self.restarts = 0
        self._env = env
        self._cwd = cwd
        self._sdk = sdk
        self._alert = alert
        self._client: Any = None
        self._process: StdioProcess | None = None
        self._refusal: str | None = None  # how an HTTP server refused the last POST, if it did
        self._holder: asyncio.Task[None] | None = None
        self._restart: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._files: dict[str, FileId] = {}  # program_files at the first start
        self._code_dir = code_dir  # a directory in the write scope it loads code from
        self._lost = asyncio.Event()  # the connection is unusable (a call or its start said so)
        self._usable = asyncio.Event()  # the current connection has its SDK session
        self._settled = asyncio.Event()  # not (re)starting

    @property
    def transport(self) -> str:
        return "stdio" if self.cfg.command is not None else "http"

    def status(self) -> McpServerStatus:
        return McpServerStatus(
            name=self.name,
            transport=self.transport,
            state=self.state,
            tools=len(self.tools),
            restarts=self.restarts,
            error=self.error,
        )

    # --- start --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and list the tools once; raises StartFailed."""
        if self.cfg.command is not None:
            self._files = program_files(self.cfg.command, self._cwd)
        try:
            listed = await self._launch()
        except StartFailed as exc:
            self.state, self.error = "failed", str(exc)
            raise
        finally:
            self._settled.set()
        self.tools = self._make_tools(listed)
        self.state = "ready"

    async def _launch(self) -> list[Any]:
        """Start one connection (a new holder): its tool list, or StartFailed by start_timeout."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[list[Any]] = loop.create_future()
        self._lost = asyncio.Event()
        self._usable = asyncio.Event()
        before = self._process  # an earlier connection's, until this one's has started
        self._holder = holder = asyncio.create_task(self._hold(started), name=f"mcp:{self.name}")
        try:
            async with asyncio.timeout(self.cfg.start_timeout):
                return await asyncio.shield(started)
        except TimeoutError:
            # Killed at once: the grace a closing server gets to see EOF and exit (2 s) came on
            # top of start_timeout, before READY (found by QA).
            self._lost.set()
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(GIVE_UP):
                    await holder
            why = f"did not start within {self.cfg.start_timeout:g} s"
            if self._process is not None and self._process is not before:
                why += self._process.stray_lines()
            raise StartFailed(self._with_stderr(why)) from None
        except asyncio.CancelledError:
            holder.cancel()
            raise

    async def _hold(self, started: "asyncio.Future[list[Any]]") -> None:
        reason = await self._connect_and_wait(started)
        if reason is not None and not self._closing.is_set():
            self._died(reason)

    async def _connect_and_wait(self, started: "asyncio.Future[list[Any]]") -> str | None:
        """Run one connection until close (returns None) or death (returns why)."""
        process: StdioProcess | None = None
        try:
            if self.cfg.command is not None:
                assert self._env is not None
                try:
                    process = await StdioProcess.spawn(
                        self.name, self.cfg.command, self._env, self._cwd
                    )
                except OSError as exc:
                    raise StartFailed(f"cannot start the guard: {exc}") from None
                self._process = process
            shook: Handshake | None = None
            if process is not None:
                try:
                    # Without the SDK: the tools are known (and READY may come) before its import.
                    shook = await handshake(process)
                except HandshakeError as exc:
                    raise StartFailed(str(exc)) from None
                if shook is not None:
                    started.set_result(shook.tools)
            try:
                await asyncio.shield(self._sdk())  # shared: one holder's cancel must not cancel it
            except ImportError as exc:
                raise StartFailed(f"the mcp package cannot be imported: {exc}") from None
            from mcp import Client, ClientSession
            from mcp_types import Implementation, InitializeResult

            import poddaemon

            info = Implementation(name="poddaemon", version=poddaemon.__version__)
            if process is not None and shook is not None:
                async with (
                    transport(process) as (read, write),
                    ClientSession(read, write, client_info=info) as session,
                ):
                    # The session the handshake opened, taken over without wire traffic.
                    session.adopt(InitializeResult.model_validate(shook.initialize, by_name=False))
                    self._client = session
                    self._usable.set()
                    await self._until_unusable(process)
            else:
                if process is not None:
                    conn: Any = transport(process)
                else:
                    from poddaemon.mcp.http import http_transport

                    assert self.cfg.url is not None
                    self._refusal = None
                    conn = http_transport(self.cfg.url, refused=self._refused, name=self.name)
                # cache=None: the pod lists tools once and keeps them.
                client = Client(conn, client_info=info, cache=None)
                async with client:
                    listed = await _list_tools(client)
                    self._client = client
                    self._usable.set()
                    started.set_result(listed)
                    await self._until_unusable(process)
            if self._closing.is_set():
                return None
            return self._with_stderr("the connection was lost")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # ExceptionGroup too: the SDK's transports raise them
            why = str(exc) if isinstance(exc, StartFailed) else _describe(exc)
            reason = self._with_stderr(why)
            if not started.done():
                started.set_exception(StartFailed(reason))
                return None
            return None if self._closing.is_set() else reason
        finally:
            self._client = None
            if process is not None:
                # A dead connection is not waited for; a closing one gets its grace.
                grace = 0.0 if self._lost.is_set() or process.gone.is_set() else None
                await (process.stop() if grace is None else process.stop(grace))

    async def _until_unusable(self, process: StdioProcess | None) -> None:
        waits = [self._closing.wait(), self._lost.wait()]
        if process is not None:
            waits.append(process.gone.wait())
        tasks = [asyncio.ensure_future(w) for w in waits]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()

    def _make_tools(self, listed: list[Any]) -> dict[str, McpTool]:
        wanted = self.cfg.tools
        entries = [_tool_fields(t) for t in listed]
        names = {remote for remote, _, _ in entries}
        if wanted is not None and (missing := [w for w in wanted if w not in names]):
            self._alert(
                "warning",
                "mcp",
                f"MCP server '{self.name}' has no tool {', '.join(missing)} "
                f"(it offers: {', '.join(sorted(names)) or 'none'})",
            )
        # A tool listed more than once is one alert, at its second listing, saying how often:
        # found by QA, one listed N times was N-1 alerts (and the repeats of one left out for
        # its schema were each an alert about that schema).
        listings = collections.Counter(remote for remote, _, _ in entries)
        seen: set[str] = set()
        out: dict[str, McpTool] = {}
        refused: list[tuple[str, str | None]] = []
        for remote, description, schema in entries:
            if wanted is not None and remote not in wanted:
                continue
            name = offered_name(self.name, remote)
            if remote in seen:
                if not listings[remote]:
                    continue  # said at its second listing
                count = listings.pop(remote)
                why: str | None = (
                    f"the server lists it {'twice' if count == 2 else f'{count} times'}"
                )
            elif name is None:
                why = "its name is empty, or too long for the providers (64 characters)"
            elif name in out:
                first = out[name].remote
                why = f"made safe, its name is that of {first!r}, listed before it"
            else:
                why = schema_problem(schema)
            seen.add(remote)
            if why is not None or name is None:
                refused.append((remote, why))
                continue
            out[name] = McpTool(
                name=name,
                remote=remote,
                description=description,
                parameters=input_schema(schema),
                call=self.call,
            )
        self._say_refused(refused)
        return out

    def _say_refused(self, refused: list[tuple[str, str | None]]) -> None:
        """An alert per tool that cannot be offered, up to SAID_ONE_BY_ONE; then one for the
        rest (found by QA: a server listing 3,000 over-long names was 3,000 log lines, and as
        many on `podctl spawn`'s terminal)."""
        for remote, why in refused[:SAID_ONE_BY_ONE]:
            self._alert(
                "warning",
                "mcp",
                f"MCP server '{self.name}': tool {remote!r} cannot be offered to the model ({why})",
            )
        rest = [remote for remote, _ in refused[SAID_ONE_BY_ONE:]]
        if rest:
            named = ", ".join(repr(r[:40]) for r in rest[:3])
            self._alert(
                "warning",
                "mcp",
                f"MCP server '{self.name}': {len(rest)} more of its tools cannot be offered to "
                f"the model either ({named}, …)",
            )

    # --- death and restart --------------------------------------------------------------------

    def _died(self, reason: str) -> None:
        self._client = None
        if self._restart is None:  # `restarts` counts restarts made, not refused or failed
            try:
                self._unchanged()  # before "restarting it": a refused restart read as one made
            except StartFailed as exc:
                self.state, self.error = "dead", str(exc)
                self._settled.set()
                self._alert(
                    "error",
                    "mcp",
                    f"MCP server '{self.name}' died ({reason}) and could not be restarted "
                    f"({exc}); its tools fail from now on",
                )
                return
            self.state, self.error = "restarting", reason
            self._settled.clear()
            self._alert(
                "warning",
                "mcp",
                f"MCP server '{self.name}' died ({reason}); restarting it (once per pod life)",
            )
            self._restart = asyncio.create_task(self._relaunch(), name=f"mcp-restart:{self.name}")
            return
        self.state, self.error = "dead", reason
        self._settled.set()
        self._alert(
            "error",
            "mcp",
            f"MCP server '{self.name}' died again ({reason}); its tools fail from now on",
        )

    async def _relaunch(self) -> None:
        try:
            self._unchanged()
            await self._launch()
        except StartFailed as exc:
            self.state, self.error = "dead", str(exc)
            self._alert(
                "error",
                "mcp",
                f"MCP server '{self.name}' could not be restarted ({exc}); "
                "its tools fail from now on",
            )
        else:
            self.state, self.error = "ready", None
            self.restarts += 1
            log.info("MCP server '%s' restarted", self.name)
        finally:
            self._settled.set()

    def _unchanged(self) -> None:
        """StartFailed when a file the server's command names is another than at its start,
        or it loads code from a directory the pod may write (`code_dir`). The server runs
        outside the sandbox: a script of it lying where the pod may write, rewritten by the
        model's (sandboxed) commands, ran with this user's full rights once the model had the
        server die (a crash, a hang)."""
        if self.cfg.command is None:
            return
        if self._code_dir is not None:
            raise StartFailed(
                f"its command loads code from its working directory {self._code_dir}, which "
                "lies in the pod's write scope (the pod's commands may have put code there, "
                "and the server runs outside the sandbox): not restarted; restart the pod to "
                "start it again"
            )
        now = program_files(self.cfg.command, self._cwd)
        for path, was in self._files.items():
            if now.get(path) != was:
                raise StartFailed(
                    f"{path} changed since the pod started the server (the pod's commands may "
                    "have rewritten it, and the server runs outside the sandbox): not "
                    "restarted; restart the pod to run the new one"
                )

    # --- calls --------------------------------------------------------------------------------

    async def call(self, remote: str, args: dict[str, Any]) -> ToolOutcome:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.start_timeout + CALL_MARGIN):
                await self._until_settled()
        client = self._client
        if self.state != "ready" or client is None:
            why = self.error or self.state
            return error(f"MCP server '{self.name}' is not available: {why}")
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        timeout = self.cfg.timeout
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout + CALL_MARGIN):
                result = await _call_tool(client, remote, args, timeout)
        except TimeoutError:
            return await self._timed_out(remote, client)
        except MCPError as exc:
            if exc.data == PROTOCOL_BROKEN:  # the pod's stand-in for a reply that breaks it
                broke = f"MCP server '{self.name}' broke the protocol on {remote}"
                return error(f"{broke}: {exc.message}")
            # The SDK raises these two codes itself, for a silent server and a gone one; but a
            # server may send them too (-32000 is the usual "server error"): then it answers a
            # ping, and answered well before the timeout (the SDK's own comes at about the
            # timeout, a little early over HTTP). Its words are the model's, not a restart.
            if exc.code == REQUEST_TIMEOUT and time.monotonic() - started >= timeout / 2:
                return await self._timed_out(remote, client)
            if exc.code == CONNECTION_CLOSED and not await self._answers(client):
                return self._call_lost(remote, exc.message, client)
            if exc.data == DROPPED:  # over HTTP, by a server that still answers: it stays
                return error(
                    f"MCP server '{self.name}' gave no answer to {remote}: {exc.message}; the "
                    "call may or may not have taken effect"
                )
            refused = f"MCP server '{self.name}' refused {remote}: {exc.message} ({exc.code})"
            # Over HTTP, with the status: "Server returned an error response" is all the SDK says.
            return error(self._with_stderr(refused) if self.transport == "http" else refused)
        except Exception as exc:  # a transport failure, or a result that breaks the protocol
            if self.transport == "http" and _is_connection_error(exc):
                return self._call_lost(remote, _describe(exc), client)
            return error(f"MCP server '{self.name}' failed on {remote}: {_describe(exc)}")
        return outcome(result)

    async def _until_settled(self) -> None:
        """Until no start or restart is under way: a restart has its outcome, and a server
        listed before READY has its SDK session, or its holder ended without one. Found by
        QA: a call waiting for that session alone waited out start_timeout + 5 s when the
        server died before it (its restart made a new one; nothing set the old)."""
        while True:
            if not self._settled.is_set():  # a restart is under way: wait for its outcome
                await self._settled.wait()
                continue
            holder = self._holder
            if self.state != "ready" or self._usable.is_set() or holder is None or holder.done():
                return
            # Listed before READY; the SDK session follows once the SDK is imported.
            usable = asyncio.ensure_future(self._usable.wait())
            try:
                await asyncio.wait([usable, holder], return_when=asyncio.FIRST_COMPLETED)
            finally:
                usable.cancel()

    async def _timed_out(self, remote: str, client: Any) -> ToolOutcome:
        """A slow tool, or a hung server? A server that cannot answer a ping either is taken
        for lost (restarted once, as if it died): otherwise every later call would wait out
        its timeout too while its status still said ready. An error reply to the ping is an
        answer: a server without `ping` (-32601, as hand-written ones say) is alive."""
        late = f"{remote} timed out after {self.cfg.timeout:g} s"
        asked = time.monotonic()
        # A server that talked while the ping waited (a single-threaded one logging progress
        # as it works) is busy, not hung: the ping waits behind its work.
        if not await self._answers(client) and not self._heard_since(asked):
            return self._call_lost(remote, f"{late}, and a ping got no answer", client)
        # Said as for a lost connection: a model told only "timed out" may call again a tool
        # that did its work (found by QA).
        return error(
            f"{late} (MCP server '{self.name}', [[mcp.servers]] timeout); the call may or may "
            "not have taken effect"
        )

    def _heard_since(self, when: float) -> bool:
        process = self._process
        return process is not None and process.heard >= when

    @staticmethod
    async def _answers(client: Any) -> bool:
        """Does the server answer a ping? An error reply is an answer (a server without `ping`,
        -32601, is alive), unless it is the SDK saying none came or the connection is gone."""
        from mcp import MCPDeprecationWarning, MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        # The SDK's `Client` marks ping deprecated (the 2026-07-28 revision drops it; servers of
        # the others answer it): its warning went raw into the pod's stderr.log. Said when the
        # coroutine is made, so the filter need not outlive an await.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MCPDeprecationWarning)
                ping = client.send_ping()
            async with asyncio.timeout(PING_TIMEOUT):
                await ping
        except MCPError as exc:
            return exc.code not in (REQUEST_TIMEOUT, CONNECTION_CLOSED)
        except Exception:
            return False
        return True

    def _call_lost(self, remote: str, why: str, client: Any) -> ToolOutcome:
        # Only the connection this call used: a restart may already have replaced it.
        if client is self._client and not self._closing.is_set():
            # Later calls wait for the holder's verdict (restarted or dead), not this client.
            self._client = None
            self._settled.clear()
            self._lost.set()
        return error(
            f"MCP server '{self.name}' lost the connection during {remote} ({why}); the call may "
            "or may not have taken effect"
        )

    # --- stop ---------------------------------------------------------------------------------

    async def aclose(self) -> None:
        self._closing.set()
        for task in (self._restart, self._holder):
            if task is None or task.done():
                continue
            try:
                async with asyncio.timeout(10.0):
                    await asyncio.shield(task)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                    async with asyncio.timeout(2.0):
                        await task
            except Exception:
                log.exception("MCP server '%s' failed while stopping", self.name)
        if self._process is not None:  # whatever a holder could not clean up: kill the group
            self._process.kill()
        self.state = "stopped"

    def _refused(self, status: str | None) -> None:
        self._refusal = status

    def _with_stderr(self, reason: str) -> str:
        """`reason`, with what the server said besides: its stderr's last lines, or the HTTP
        status it refused the last message with (the SDK's own error names none)."""
        if self.transport == "http":
            return f"{reason}; the server answered {self._refusal}" if self._refusal else reason
        process = self._process
        tail = process.stderr_tail() if process is not None else ""
        return f"{reason}; stderr: {tail}" if tail else reason


async def _call_tool(client: Any, remote: str, args: dict[str, Any], timeout: float) -> Any:
    """`tools/call` on either kind of client. The session the handshake opened is sent the
    request as is: its `call_tool` would first list the tools again (for their output schemas)
    and parse the whole list strictly, so one tool with a bad schema (never offered, see
    `schema_problem`) would fail the calls of every other tool of the server."""
    from mcp import ClientSession

    if not isinstance(client, ClientSession):
        return await client.call_tool(remote, args, read_timeout_seconds=timeout)
    from mcp_types import CallToolRequest, CallToolRequestParams, CallToolResult

    request = CallToolRequest(params=CallToolRequestParams(name=remote, arguments=args))
    return await client.send_request(request, CallToolResult, request_read_timeout_seconds=timeout)


async def _list_tools(client: Any) -> list[Any]:
    tools: list[Any] = []
    seen: set[str] = set()
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        if repeated(seen, [str(tool.name) for tool in page.tools]):
            break  # a server that ignores the cursor: the same page again
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _tool_fields(tool: Any) -> tuple[str, str, Any]:
    """(name, description, input schema) of a listed tool: a raw dict from the handshake, or
    the SDK's Tool."""
    if isinstance(tool, dict):
        description = tool.get("description") or tool.get("title") or ""
        return str(tool["name"]), str(description), tool.get("inputSchema")
    description = tool.description or getattr(tool, "title", None) or ""
    return str(tool.name), str(description), tool.input_schema


def _describe(exc: BaseException) -> str:
    """The innermost useful message of an exception (groups are unwrapped)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    message = getattr(exc, "message", None) or str(exc)
    return f"{type(exc).__name__}: {message}" if not hasattr(exc, "code") else str(message)


def _is_connection_error(exc: BaseException) -> bool:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return isinstance(exc, ConnectionError | OSError) or type(exc).__name__ in (
        "ConnectError",
        "RemoteProtocolError",
        "ReadError",
        "WriteError",
    )
