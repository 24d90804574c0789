"""podctl: the user's command line for pods (SPEC §6).

Start-up time matters (`podctl status` runs in scripts and prompts), so this module imports only
typer and the standard library at the top. `protocol` (msgspec, sockets), `poddaemon.store`,
`poddaemon.testing` and `cli.render` are imported inside the commands that use them; nothing here
ever imports openai, anthropic or asyncio.

Exit codes: 0 ok · 1 error (an RPC error prints `podctl: <message> (<code>)`) · 2 usage error ·
3 the pod is not running (`podctl: pod 'x' is not running`). `send` also exits 2 on
limit_reached, as SPEC §6 says.
"""

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    from protocol.client import PodClient

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3
EXIT_LIMIT = 2
LS_TIMEOUT = 2.0
STOP_TIMEOUT = 10.0

app = typer.Typer(
    name="podctl",
    help="Control poddaemon pods: LLM agents running as supervised processes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help and usage errors: rich's formatting would import ~60 ms of modules.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
sessions_app = typer.Typer(
    help="Browse and check session logs.", rich_markup_mode=None, pretty_exceptions_enable=False
)
dev_app = typer.Typer(
    help="Developer tools.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
app.add_typer(sessions_app, name="sessions")
app.add_typer(dev_app, name="dev")

PodArg = Annotated[str, typer.Argument(metavar="POD", help="Pod name, or the path of its socket.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


# --- helpers ------------------------------------------------------------------------------------


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.write(f"podctl: {message}\n")
    raise typer.Exit(code)


def print_json(value: Any) -> None:
    import json

    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def read_message(message: str) -> str:
    """MESSAGE as given, or stdin for `-` (without its trailing newlines)."""
    text = sys.stdin.read().rstrip("\n") if message == "-" else message
    if not text.strip():
        fail("empty message", EXIT_USAGE)
    return text


@contextlib.contextmanager
def rpc_errors(target: str) -> Iterator[None]:
    """Map the client's exceptions to podctl's one-line messages and exit codes."""
    from protocol.errors import ConnectionClosed, PodNotRunning, RpcError

    try:
        yield
    except PodNotRunning:
        fail(f"pod '{target}' is not running", EXIT_NOT_RUNNING)
    except RpcError as exc:
        fail(f"{exc.message} ({exc.code})")
    except ConnectionClosed:
        fail(f"pod '{target}' closed the connection")
    except BrokenPipeError:
        raise  # our stdout went away (e.g. `| head`): main() handles it
    except TimeoutError:
        fail(f"pod '{target}' did not answer in time")
    except OSError as exc:
        fail(f"cannot talk to pod '{target}': {exc}")


@contextlib.contextmanager
def connect(target: str, timeout: float | None = None) -> Iterator["PodClient"]:
    """A PodClient for `target`, with podctl's error handling around everything in the block."""
    from protocol.client import PodClient

    with rpc_errors(target), PodClient.connect(target, timeout=timeout) as client:
        yield client


def raw_status(client: "PodClient") -> dict[str, Any]:
    import msgspec

    result: dict[str, Any] = msgspec.json.decode(client.call_raw("status"))
    return result


def live_statuses() -> list[dict[str, Any]]:
    """The status of every pod with a socket under the runtime dir that answers in time."""
    import msgspec

    from protocol import paths
    from protocol.client import PodClient
    from protocol.errors import ConnectionClosed, PodNotRunning, RpcError

    pods = paths.runtime_dir() / "pods"
    try:
        names = sorted(entry.name for entry in pods.iterdir() if (entry / "sock").exists())
    except (FileNotFoundError, NotADirectoryError):
        return []
    statuses = []
    for name in names:
        try:
            with PodClient.connect(name, timeout=LS_TIMEOUT) as client:
                statuses.append(raw_status(client))
        except (PodNotRunning, RpcError, ConnectionClosed, OSError, msgspec.DecodeError):
            continue  # gone, stuck or not a pod: ls shows what answers
    return statuses


# --- pods ---------------------------------------------------------------------------------------


@app.command()
def spawn(
    manifest: Annotated[str, typer.Argument(metavar="MANIFEST", help="The pod's manifest (TOML).")],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", metavar="K=V", help="Override one manifest value (repeatable)."),
    ] = None,
    session: Annotated[
        str | None, typer.Option("--session", metavar="ID", help="Restore this session.")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Restore the pod's newest session.")
    ] = False,
    foreground: Annotated[
        bool, typer.Option("--foreground", help="Run attached to this terminal instead.")
    ] = False,
) -> None:
    """Start a pod detached; print its name and socket.

    Waits until the pod is ready; on failure prints the pod's own error and exits 1.
    """
    import os

    from cli.spawn import SpawnFailed, daemon_command, spawn_detached

    if session and resume:
        fail("--session and --resume exclude each other", EXIT_USAGE)
    cmd = daemon_command(manifest, set_ or [], session, resume)
    if foreground:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(cmd[0], cmd)
    try:
        name, socket, early = spawn_detached(cmd)
    except SpawnFailed as exc:
        sys.stdout.flush()
        if exc.output.strip():
            sys.stderr.buffer.write(
                exc.output if exc.output.endswith(b"\n") else exc.output + b"\n"
            )
            sys.stderr.flush()
            if "ready within" in exc.message:
                fail(exc.message)
            raise typer.Exit(EXIT_ERROR) from None
        fail(exc.message)
    if early:
        sys.stderr.buffer.write(early)  # warnings the pod printed while starting
        sys.stderr.flush()
    sys.stdout.write(f"{name}\t{socket}\n")


@app.command("ls")
def ls(as_json: JsonOpt = False) -> None:
    """Table of live pods.

    Columns: name, pid, state, model, write scope, parent, queue (runs/notifications), tokens.
    """
    statuses = live_statuses()
    if as_json:
        print_json(statuses)
        return
    if not statuses:
        sys.stderr.write("podctl: no pods running\n")
        return
    from cli.render import pod_table

    sys.stdout.write(pod_table(statuses))


@app.command()
def status(
    pod: Annotated[
        str | None,
        typer.Argument(metavar="[POD]", help="Pod name or socket path; without it, like `ls`."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """One pod's status (or, without POD, the table of live pods)."""
    if pod is None:
        ls(as_json)
        return
    with connect(pod) as client:
        st = raw_status(client)
    if as_json:
        print_json(st)
        return
    from cli.render import status_text

    sys.stdout.write(status_text(st))


def _socket_gone(target: str, pid: int | None, deadline: float) -> bool:
    """Poll until the pod's socket disappears (or its process is gone); False at the deadline."""
    import os
    import time

    from protocol.core import resolve_socket

    sock = resolve_socket(target)
    while True:
        if not sock.exists():
            return True
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True  # dead, only a stale socket file left
            except PermissionError:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _stop(target: str, tree: bool, top: bool) -> None:
    import time

    from protocol.client import PodClient
    from protocol.errors import SHUTTING_DOWN, ConnectionClosed, PodNotRunning, RpcError

    try:
        with rpc_errors(target), PodClient.connect(target, timeout=STOP_TIMEOUT) as client:
            name, pid, children = target, None, []
            try:
                st = client.status()
                name, pid, children = st.name, st.pid, st.children
            except RpcError:
                if tree:
                    raise
            if tree:
                for child in children:
                    _stop(child, tree=True, top=False)
            try:
                client.shutdown()
            except ConnectionClosed:
                pass  # it went before it could answer: fine
            except RpcError as exc:
                if exc.code != SHUTTING_DOWN:
                    raise
    except PodNotRunning:
        if top:
            fail(f"pod '{target}' is not running", EXIT_NOT_RUNNING)
        return  # a child that already went
    except typer.Exit:
        if top:
            raise
        return
    if not _socket_gone(target, pid, time.monotonic() + STOP_TIMEOUT):
        fail(f"pod '{name}' did not stop within {STOP_TIMEOUT:g} s")
    sys.stdout.write(f"stopped {name}\n")
    sys.stdout.flush()


@app.command()
def stop(
    pod: PodArg,
    tree: Annotated[bool, typer.Option("--tree", help="Stop its descendants first.")] = False,
) -> None:
    """Shut a pod down and wait until it is gone."""
    _stop(pod, tree, top=True)


@app.command()
def rpc(
    pod: PodArg,
    method: Annotated[str, typer.Argument(metavar="METHOD", help="JSON-RPC method, e.g. status.")],
    params: Annotated[
        str | None, typer.Argument(metavar="[JSON]", help="Params: a JSON object.")
    ] = None,
) -> None:
    """Raw JSON-RPC call; prints the JSON result."""
    import json

    parsed: dict[str, Any] | None = None
    if params is not None:
        try:
            value = json.loads(params)
        except ValueError as exc:
            fail(f"invalid JSON params: {exc}", EXIT_USAGE)
        if not isinstance(value, dict):
            fail("JSON params must be an object", EXIT_USAGE)
        parsed = value
    import msgspec

    with connect(pod) as client:
        result = msgspec.json.decode(client.call_raw(method, parsed))
    print_json(result)


# --- conversation -------------------------------------------------------------------------------


@app.command()
def send(
    pod: PodArg,
    message: Annotated[
        str, typer.Argument(metavar="MESSAGE", help="The input; `-` reads it from stdin.")
    ],
    no_wait: Annotated[
        bool, typer.Option("--no-wait", help="Only submit: print `run_id state`.")
    ] = False,
    steer: Annotated[
        bool, typer.Option("--steer", help="Deliver into the active run instead of queueing.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the final run.finished data as JSON.")
    ] = False,
) -> None:
    """Start a run and stream its reply.

    Exit 0 finished, 1 error/cancelled/paused, 2 limit reached.
    """
    import msgspec

    text = read_message(message)
    with connect(pod) as client:
        if steer or no_wait:
            result = client.run(text, mode="steer" if steer else "queue")
            if as_json:
                print_json(msgspec.to_builtins(result))
            else:
                sys.stdout.write(f"{result.run_id} {result.state}\n")
            return
        client.subscribe()
        result = client.run(text)
        run_id = result.run_id
        if result.state == "queued" and sys.stderr.isatty():
            position = f" (position {result.position})" if result.position is not None else ""
            sys.stderr.write(f"podctl: run {run_id} queued{position}\n")
        wrote, ends_nl = False, True
        finished: dict[str, Any] | None = None
        try:
            for event in client.events():
                if event.type == "gap":
                    sys.stderr.write("podctl: some events were missed; output may be incomplete\n")
                if event.run_id != run_id:
                    continue
                if event.type == "text.delta" and not as_json:
                    delta = str(event.data.get("text", ""))
                    if delta:
                        sys.stdout.write(delta)
                        sys.stdout.flush()
                        wrote, ends_nl = True, delta.endswith("\n")
                elif event.type == "run.finished":
                    finished = dict(event.data)
                    break
        except KeyboardInterrupt:
            if wrote and not ends_nl:
                sys.stdout.write("\n")
            fail(f"stopped waiting; run {run_id} goes on (podctl cancel {pod})", 130)
    assert finished is not None
    if wrote and not ends_nl:
        sys.stdout.write("\n")
    if as_json:
        print_json({"run_id": run_id, **finished})
    outcome = finished.get("outcome")
    if outcome == "finished":
        return
    if outcome == "limit_reached":
        if not as_json:
            sys.stderr.write(f"podctl: run {run_id} reached its limit\n")
        raise typer.Exit(EXIT_LIMIT)
    if not as_json:
        error = finished.get("error")
        sys.stderr.write(f"podctl: run {run_id} {outcome}" + (f": {error}" if error else "") + "\n")
    raise typer.Exit(EXIT_ERROR)


@app.command()
def notify(
    pod: PodArg,
    message: Annotated[
        str, typer.Argument(metavar="MESSAGE", help="The message; `-` reads it from stdin.")
    ],
    source: Annotated[
        str | None, typer.Option("--source", metavar="S", help="Who it is from.")
    ] = None,
) -> None:
    """Send the pod a notification.

    It reaches the model at its next request; an idle pod wakes for it.
    """
    text = read_message(message)
    with connect(pod) as client:
        result = client.notify(text, source=source)
    sys.stdout.write(result.notification_id + (" (woke the pod)" if result.wakes else "") + "\n")


@app.command()
def attach(
    pod: PodArg,
    since: Annotated[
        int | None, typer.Option("--since", metavar="N", help="Replay events after seq N.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per event.")] = False,
) -> None:
    """Follow the pod's event stream (Ctrl-C to stop)."""
    import msgspec

    from cli.render import EventRenderer
    from protocol.errors import ConnectionClosed

    renderer = EventRenderer()
    out = sys.stdout
    seen_shutdown = False
    with connect(pod) as client:
        client.subscribe(since)
        try:
            for event in client.events():
                seen_shutdown = seen_shutdown or event.type == "shutdown"
                if as_json:
                    out.write(msgspec.json.encode(event).decode() + "\n")
                else:
                    out.write(renderer.render(msgspec.structs.asdict(event)))
                out.flush()
        except KeyboardInterrupt:
            out.write(renderer.finish())
            return
        except ConnectionClosed:
            out.write(renderer.finish())
            out.flush()
            if seen_shutdown:
                return
            raise


@app.command()
def history(
    pod: PodArg,
    since: Annotated[int, typer.Option("--since", metavar="N", help="Entries after seq N.")] = 0,
    limit: Annotated[
        int | None, typer.Option("--limit", metavar="N", help="At most N entries.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The pod's session history (`seq kind summary` lines)."""
    with connect(pod) as client:
        result = client.history(since=since, limit=limit)
    if as_json:
        print_json({"entries": result.entries, "next": result.next})
        return
    from cli.render import entry_line

    sys.stdout.writelines(entry_line(entry) + "\n" for entry in result.entries)


@app.command()
def pause(pod: PodArg) -> None:
    """Pause the active run at its next safe point."""
    with connect(pod) as client:
        result = client.pause()
    sys.stdout.write("pausing\n" if result.paused else "nothing to pause\n")


@app.command()
def resume(pod: PodArg) -> None:
    """Continue a paused run."""
    with connect(pod) as client:
        result = client.resume()
    sys.stdout.write(f"resumed run {result.run_id}\n")


@app.command()
def cancel(
    pod: PodArg,
    run_id: Annotated[
        str | None, typer.Option("--run-id", metavar="ID", help="Only this run.")
    ] = None,
) -> None:
    """Cancel the active run (or the given one)."""
    with connect(pod) as client:
        result = client.cancel(run_id)
    sys.stdout.write("cancelled\n" if result.cancelled else "nothing to cancel\n")


# --- sessions -----------------------------------------------------------------------------------


def _sessions_dir() -> Any:
    from protocol import paths

    return paths.sessions_dir()


@sessions_app.callback(invoke_without_command=True)
def sessions(ctx: typer.Context) -> None:
    """Browse and check session logs (without a subcommand: list)."""
    if ctx.invoked_subcommand is None:
        sessions_list(False)


@sessions_app.command("list")
def sessions_list(as_json: JsonOpt = False) -> None:
    """Every session log, newest first."""
    import msgspec

    from cli.render import format_time
    from poddaemon.store.file import list_sessions

    infos = list_sessions(_sessions_dir())
    if as_json:
        print_json(msgspec.to_builtins(infos))
        return
    if not infos:
        sys.stderr.write("podctl: no sessions\n")
        return
    rows = [("ID", "POD", "STARTED", "BYTES", "FROM")]
    for info in infos:
        link = ""
        if info.compacted_from:
            link = f"compacted {info.compacted_from}"
        elif info.forked_from:
            link = f"forked {info.forked_from}"
        rows.append((info.id, info.pod or "?", format_time(info.started), str(info.size), link))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        sys.stdout.write("\n")


def _read_session(session_id: str) -> Any:
    from poddaemon.store.file import read_session
    from poddaemon.store.log import LogCorrupt

    try:
        return read_session(_sessions_dir(), session_id)
    except LogCorrupt as exc:
        fail(str(exc))
    except FileNotFoundError as exc:
        fail(exc.strerror or str(exc))
    except (ValueError, OSError) as exc:
        fail(str(exc))


@sessions_app.command("show")
def sessions_show(
    session_id: Annotated[str, typer.Argument(metavar="ID", help="Session id.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per entry.")] = False,
) -> None:
    """The entries of one session log (`seq kind summary`)."""
    import json

    from cli.render import entry_line

    result = _read_session(session_id)
    for entry in result.entries:
        if as_json:
            sys.stdout.write(json.dumps(entry, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write(entry_line(entry) + "\n")
    if result.torn:
        sys.stderr.write(f"podctl: torn last line after byte {result.end_offset} (not shown)\n")


@sessions_app.command("verify")
def sessions_verify(
    session_id: Annotated[str, typer.Argument(metavar="ID", help="Session id.")],
) -> None:
    """Check a session log's hash chain.

    Prints `ok: N entries, head H`, or the first bad line and exits 1.
    """
    result = _read_session(session_id)
    sys.stdout.write(f"ok: {len(result.entries)} entries, head {result.head[:12]}\n")
    if result.torn:
        sys.stderr.write(
            f"podctl: warning: torn last line after byte {result.end_offset}; "
            "restoring the session cuts it off\n"
        )


@app.command("mcp-serve")
def mcp_serve() -> None:
    """Serve this user's pods to an MCP client over stdio (list_pods, send_to_pod, notify_pod,
    pod_status, pod_history): `claude mcp add pods -- podctl mcp-serve`."""
    from cli.mcp_serve import main as serve

    raise typer.Exit(serve())


# --- dev ----------------------------------------------------------------------------------------


@dev_app.callback()
def dev() -> None:
    """Developer tools."""


@dev_app.command("fake-model")
def dev_fake_model(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port; 0 picks a free one.")] = 0,
    script: Annotated[
        str | None, typer.Option("--script", metavar="FILE", help="Scripted replies (JSON).")
    ] = None,
) -> None:
    """Run the fake model server (OpenAI and Anthropic wire formats) for offline testing."""
    from poddaemon.testing.fake_model import main as fake_model_main

    argv = ["--host", host, "--port", str(port)]
    if script:
        argv += ["--script", script]
    raise typer.Exit(fake_model_main(argv))


def main() -> None:
    try:
        app(prog_name="podctl")
    except BrokenPipeError:
        # Reader went away (`podctl history x | head`): quietly stop, like other Unix tools.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
