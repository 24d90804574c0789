"""`podctl mcp-serve`: a stdio MCP server whose tools reach this user's pods (SPEC §6).

`claude mcp add pods -- podctl mcp-serve` gives any MCP client durable, scoped, supervised
workers: it can list the pods, hand one work (and wait for the answer or not), notify it, and
read its status and history. Every call goes through `protocol.AsyncPodClient`, so the pod's own
rules hold (acknowledged means durable, `client_key` idempotence, scope, budget).

The `mcp` SDK is imported here only, when the command runs; `podctl`'s start-up never pays for it.
"""

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream
    from mcp.server.mcpserver import MCPServer
    from mcp.shared.message import SessionMessage

    from cli.common import UnitRestart
    from protocol.aio import AsyncPodClient

F = TypeVar("F", bound=Callable[..., Any])

STATUS_TIMEOUT = 2.0  # a pod that does not answer `status` in time is listed as unresponsive
CALL_TIMEOUT = 30.0  # default: a pod that does not answer another call in time is reported stuck
# The entries one pod_history reply holds, in bytes of JSON: an MCP client hands a tool result
# to its model whole (Claude Code refuses one over 25,000 tokens by default).
HISTORY_BYTES = 64 * 1024

INSTRUCTIONS = """\
Pods are long-lived LLM agents run by poddaemon, each confined to its own files (scope) and
budget. Use list_pods to see them, send_to_pod to give one a task (wait=true returns its final
answer; wait=false returns at once with a run_id), notify_pod to tell a pod something without
starting a task (it sees it at its next step, or wakes up for it), pod_status and pod_history to
follow one."""


def build_server(timeout: float = CALL_TIMEOUT) -> "MCPServer":
    """`timeout`: seconds a pod has to answer any call but a waited run (a stopped or stuck
    pod must not hang the MCP client's tool call)."""
    from mcp.server.mcpserver import MCPServer

    from poddaemon import __version__

    # The version is what a client shows next to the name (serverInfo); the SDK's default is "".
    server = MCPServer(
        "poddaemon", instructions=INSTRUCTIONS, version=__version__, log_level="WARNING"
    )

    @server.tool()
    @_dedented
    async def list_pods() -> list[dict[str, Any]]:
        """The live pods of this user: name, state, model, parent, queue and token usage."""
        return await _list_pods()

    @server.tool()
    @_dedented
    async def send_to_pod(
        pod: str,
        message: str,
        wait: bool = True,
        mode: Literal["queue", "steer"] = "queue",
        client_key: str | None = None,
    ) -> dict[str, Any]:
        """Give a pod a task. With wait=true (default) return when the run ends: its outcome
        (finished, limit_reached, cancelled, error, paused) and final text. With wait=false
        return at once: run_id and whether it started or was queued. mode="steer" delivers the
        message into the pod's active run instead of queueing it. A client_key makes a retry
        idempotent (same key and message: the original result). Cancelling this call stops
        the wait, not the run: the pod has the message and works on."""
        if wait:
            # The run may take hours: its wait is not bounded, but a pod that is stopped or
            # stuck must not hang the call before it has the message (found by QA): it is
            # asked for its status first, within `timeout`, on the same connection.
            async with _client(pod, None, sends=True, answers_within=timeout) as c:
                await _not_paused(c, pod)
                return _plain(await c.run_wait(message, mode=mode, client_key=client_key))
        async with _client(pod, timeout, sends=True) as c:
            return _plain(await c.run(message, mode=mode, client_key=client_key))

    @server.tool()
    @_dedented
    async def notify_pod(
        pod: str, message: str, source: str = "mcp", client_key: str | None = None
    ) -> dict[str, Any]:
        """Tell a pod something without starting a task: the message is committed to its
        history and reaches its model at the next request; an idle pod wakes up for it."""
        async with _client(pod, timeout, sends=True) as c:
            return _plain(await c.notify(message, source=source, client_key=client_key))

    @server.tool()
    @_dedented
    async def pod_status(pod: str) -> dict[str, Any]:
        """One pod's status: state, active run, queue, scope, usage, budget, children."""
        async with _client(pod, timeout) as c:
            return _plain(await c.status())

    @server.tool()
    @_dedented
    async def pod_history(
        pod: str, since: int = 0, limit: int = 50, session_id: str | None = None
    ) -> dict[str, Any]:
        """A pod's session log entries after sequence number `since` (at most `limit`, and
        about 64 KiB of them: `cut` says when there are more); `next` is the `since` for the
        following page. A compaction continues the log in a new session: `previous` names
        the one before, which `session_id` reads (pass the `session_id` of the first page to
        keep paging one session)."""
        extra = {"session_id": session_id} if session_id else {}
        async with _client(pod, timeout) as c:
            page = await c.history(since=since, limit=max(1, min(limit, 1000)), **extra)
        return _within(_plain(page), HISTORY_BYTES)

    return server


@contextlib.asynccontextmanager
async def _client(
    pod: str, timeout: float | None, sends: bool = False, answers_within: float | None = None
) -> AsyncIterator["AsyncPodClient"]:
    """A connection to `pod`, for a block that must end within `timeout` seconds (None: no
    limit); every failure becomes a tool error the MCP client's model reads. `sends`: the block
    gives the pod a message, which a stuck pod may still take when it resumes. `answers_within`:
    before the block, the pod must answer `status` within that many seconds (the block itself
    is not bounded). A block that `sends` to a pod still starting waits until it listens,
    within that time, as `podctl send` and `notify` do; the others say it is starting."""
    import asyncio

    from mcp.server.mcpserver.exceptions import ToolError

    from cli.common import STARTING, UnitRestart, starting
    from protocol import paths
    from protocol.errors import ConnectionClosed, PodNotRunning, RpcError

    # A name, never a path: the client's model must not point us at any socket of this user's.
    if not paths.POD_NAME_RE.match(pod):
        raise ToolError(f"{pod!r} is not a pod name (list_pods names the pods)")
    within = timeout if timeout is not None else answers_within or CALL_TIMEOUT
    restart = UnitRestart(pod, within) if sends else None  # None too once the pod listens

    def is_starting() -> ToolError:
        """As `podctl`'s "not running" of a pod `ls` lists as starting (cli.common)."""
        if restart is None:
            return ToolError(f"pod {pod!r} is starting: {STARTING} (podctl wait {pod})")
        return ToolError(
            f"pod {pod!r} is still starting after {within:g} s: {STARTING} (podctl wait {pod}); "
            "nothing was sent"
        )

    try:
        async with asyncio.timeout(timeout):
            try:
                paths.check_private_dirs()  # as podctl: nobody else may swap what we talk to
                client = await _listening(pod, restart)
                restart = None
            except PodNotRunning as exc:
                raise (is_starting() if starting(pod) else ToolError(str(exc))) from None
            except OSError as exc:
                raise ToolError(f"cannot reach pod {pod!r}: {exc.strerror or exc}") from None
            try:
                if answers_within is not None:
                    try:
                        async with asyncio.timeout(answers_within):
                            await client.status()
                    except TimeoutError:
                        raise ToolError(
                            f"pod {pod!r} did not answer within {answers_within:g} s: it is "
                            f"stopped or stuck (podctl logs {pod}); nothing was sent"
                        ) from None
                yield client
            finally:
                await client.close()
    except TimeoutError:
        if timeout is None:  # not ours: an OSError of that kind from the socket
            raise
        if restart is not None and restart.said and starting(pod):  # it never listened
            raise is_starting() from None
        late = "; the message may still reach it when it resumes" if sends else ""
        raise ToolError(
            f"pod {pod!r} did not answer within {timeout:g} s: it is stopped or stuck "
            f"(podctl logs {pod}){late}"
        ) from None
    except RpcError as exc:
        raise ToolError(f"pod {pod!r}: {exc.message} ({exc.code})") from None
    except ConnectionClosed as exc:
        raise ToolError(f"{exc} before answering: it stopped, or crashed") from None


async def _listening(pod: str, restart: "UnitRestart | None") -> "AsyncPodClient":
    """A connection to `pod`; with `restart`, once it listens: one still starting (its
    SessionStart hooks or MCP servers at work), or whose unit systemd restarts, is waited for
    as podctl waits for it, within `restart`'s time. A send said "not running" at once, where
    list_pods said "starting" and `podctl notify` waited and got through (found by QA)."""
    import asyncio

    from protocol.aio import AsyncPodClient
    from protocol.errors import PodNotRunning

    while True:
        try:
            return await AsyncPodClient.connect(pod)
        except PodNotRunning:
            # (in a thread: it polls, and asks systemctl about the pod's units)
            if restart is None or not await asyncio.to_thread(restart.waited):
                raise


def _dedented(fn: "F") -> "F":
    """`fn` with its docstring dedented, which the SDK takes as the tool's description as it is
    (Python 3.11 keeps a docstring's indentation: the client's model read it, found by QA)."""
    import inspect

    fn.__doc__ = inspect.cleandoc(fn.__doc__ or "")
    return fn


async def _not_paused(client: "AsyncPodClient", pod: str) -> None:
    """A tool error for a paused pod, before a waited run is sent: it would wait until someone
    resumes the pod, and the MCP client's model with it, not knowing why (found by QA)."""
    from mcp.server.mcpserver.exceptions import ToolError

    if (await client.status()).state == "paused":
        raise ToolError(
            f"pod {pod!r} is paused: a run sent now waits until `podctl resume {pod}`; nothing "
            "was sent (send it with wait=false to queue it)"
        )


async def _list_pods() -> list[dict[str, Any]]:
    import asyncio

    from mcp.server.mcpserver.exceptions import ToolError

    from poddaemon.registry import Registry, RegistryError
    from protocol import paths

    try:
        paths.check_private_dirs()  # as podctl: nobody else may swap what we talk to
        # The registry's live pods, as `podctl ls`: a killed pod leaves its socket file.
        names = sorted(entry.name for entry in Registry(paths.runtime_dir()).live())
    except (OSError, RegistryError) as exc:
        raise ToolError(str(exc)) from None
    return list(await asyncio.gather(*(_summary(name) for name in names)))


async def _summary(name: str) -> dict[str, Any]:
    import asyncio

    from protocol.aio import AsyncPodClient

    try:
        client = await AsyncPodClient.connect(name)
    except Exception:  # registered, and its socket does not listen yet (or no more)
        return {"name": name, "state": "starting"}
    try:
        status = await asyncio.wait_for(client.status(), STATUS_TIMEOUT)
    except Exception:
        return {"name": name, "state": "unresponsive"}
    finally:
        await client.close()
    return {
        "name": status.name,
        "state": status.state,
        "model": status.model,
        "parent": status.parent,
        "pwd": status.pwd,
        "queue": _plain(status.queue),
        "tokens": status.budget.spent,  # as the budget counts them (see cli.render.tokens)
        "session_id": status.session_id,
    }


def _within(page: dict[str, Any], budget: int) -> dict[str, Any]:
    """A history `page` cut to the entries that fit in `budget` bytes of JSON (one at least,
    so paging goes on), `next` set after the last one kept and `cut` saying so. A page was
    as big as the pod sends (16 MiB: 1000 notifications of 200 KB made an 18 MB reply)."""
    import msgspec

    entries = page["entries"]
    used = 0
    for kept, entry in enumerate(entries):
        used += len(msgspec.json.encode(entry)) + 1
        if used > budget and kept:
            page["entries"] = entries[:kept]
            page["next"] = entries[kept - 1]["seq"]
            page["cut"] = (
                f"the entries after seq {page['next']} did not fit in one reply "
                f"({budget // 1024} KiB): call again with since={page['next']}"
            )
            break
    return page


def _plain(value: Any) -> dict[str, Any]:
    import msgspec

    out: dict[str, Any] = msgspec.to_builtins(value)
    return out


def refusal(line: str) -> tuple[bool, Any]:
    """Whether the SDK's stdio transport can take `line`; if not, the JSON-RPC error it
    deserves (None: a notification or a response, which get no answer). The transport drops
    what it cannot read without a word: a client whose request had a bad field (`"params":
    []`, `"jsonrpc": "1.0"`) or was no JSON waited for its answer for ever."""
    import json

    from mcp import types

    try:
        types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        return True, None
    except ValueError:  # pydantic's ValidationError: its text lists every union member's
        pass
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        error = types.ErrorData(code=types.PARSE_ERROR, message="Parse error")
        return False, types.JSONRPCError(jsonrpc="2.0", id=None, error=error)
    id_ = None
    if isinstance(msg, dict):
        if "id" not in msg or ("method" not in msg and ("result" in msg or "error" in msg)):
            return False, None  # a notification, or a response to us: never answered
        id_ = msg["id"]
    if isinstance(id_, bool) or not isinstance(id_, int | str):
        id_ = None
    why = 'not a JSON-RPC 2.0 message ("jsonrpc": "2.0", a "method", "params" an object)'
    error = types.ErrorData(code=types.INVALID_REQUEST, message=f"Invalid Request: {why}")
    return False, types.JSONRPCError(jsonrpc="2.0", id=id_, error=error)


class _Answered:
    """The lines of stdin the SDK's transport can take; the others are answered here, through
    the transport's own writer (so replies never interleave on stdout)."""

    def __init__(self, lines: Any) -> None:
        import anyio

        self._lines = lines
        self._out: MemoryObjectSendStream[SessionMessage] | None = None
        self._ready = anyio.Event()

    def answer_with(self, out: "MemoryObjectSendStream[SessionMessage]") -> None:
        self._out = out
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[str]:
        from mcp.shared.message import SessionMessage

        async for line in self._lines:
            if not line.strip():
                continue  # a blank line: nothing was asked
            ok, error = refusal(line)
            if ok:
                yield line
            elif error is not None:
                await self._ready.wait()
                assert self._out is not None
                await self._out.send(SessionMessage(error))


async def serve_stdio(server: "MCPServer") -> None:
    """`server` on stdio, as the SDK's `run("stdio")`, with every line that is no message it
    can take answered (`refusal`) instead of dropped."""
    import io
    import sys

    import anyio
    from mcp.server.stdio import stdio_server

    text = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    lines = _Answered(anyio.wrap_file(text))
    async with stdio_server(stdin=lines) as (read_stream, write_stream):  # type: ignore[arg-type]
        lines.answer_with(write_stream)
        lowlevel = server._lowlevel_server
        await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


def main(timeout: float = CALL_TIMEOUT) -> int:
    import anyio

    anyio.run(serve_stdio, build_server(timeout))
    return 0
