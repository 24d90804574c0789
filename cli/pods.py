"""Pod lifecycle commands: spawn, ls, status, stop, rpc."""

import contextlib
import sys
from typing import Annotated, Any

import typer

from cli.app import JsonOpt, PodArg, app, pod_name, seconds
from cli.common import (
    EXIT_USAGE,
    STARTING,
    call,
    fail,
    not_running,
    print_json,
    read_message,
    rpc_errors,
)

LS_TIMEOUT = 2.0  # a pod slower than this to answer `status` is listed as unresponsive
STOP_TIMEOUT = 10.0
POLL = 0.02


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
        bool, typer.Option("--resume", help="Restore the session the pod wrote last.")
    ] = False,
    foreground: Annotated[
        bool, typer.Option("--foreground", help="Run attached to this terminal instead.")
    ] = False,
) -> None:
    """Start a pod detached; print its name and socket.

    Waits until the pod is ready; on failure prints the pod's own error and exits 1.
    """
    from cli import plain  # (what runs it without typer, cli/main.py's usual way in)

    plain.spawn(manifest, set_, session, resume, foreground)


# --- ls -----------------------------------------------------------------------------------------


def _registry_entries() -> dict[str, Any]:
    """Live registry entries by name (read-only, lock-free); {} when the registry is unusable."""
    from poddaemon.registry import Registry, RegistryError
    from protocol import paths

    try:
        return {e.name: e for e in Registry(paths.runtime_dir()).live()}
    except RegistryError as exc:
        sys.stderr.write(f"podctl: warning: {exc}\n")
        return {}


def _socket_names() -> set[str]:
    from protocol import paths

    try:
        return {e.name for e in (paths.runtime_dir() / "pods").iterdir() if (e / "sock").exists()}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _query(name: str, registered: bool) -> dict[str, Any] | str | None:
    """A pod's status, or why it is unresponsive (a string), or None when it is not a pod at all
    (a stale socket nobody listens on, and no live registry entry)."""
    from protocol import oneshot
    from protocol.errors import ConnectionClosed, PodNotRunning, RpcError

    try:
        status: dict[str, Any] = oneshot.call(name, "status", timeout=LS_TIMEOUT)
        return status
    except PodNotRunning:  # registered, no socket yet: starting (SessionStart hooks, MCP)
        return STARTING if registered else None
    except TimeoutError:
        return f"no answer within {LS_TIMEOUT:g} s"
    except RpcError as exc:
        return f"status failed: {exc.message} ({exc.code})"
    except (ConnectionClosed, OSError) as exc:
        return f"status failed: {exc}"
    except Exception as exc:  # whatever one pod does wrong, ls lists the others
        return f"status failed: {exc!r}"


def live_statuses() -> list[dict[str, Any]]:
    """Every live pod: its status, or a row with `state: unresponsive` when it errs or does not
    answer within LS_TIMEOUT. Pods come from the registry and from the sockets under the runtime
    dir; all are asked at once, so a stuck pod costs LS_TIMEOUT once, not per pod."""
    from concurrent.futures import ThreadPoolExecutor

    entries = _registry_entries()
    names = sorted(entries.keys() | _socket_names())
    if not names:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        answers = list(pool.map(lambda n: _query(n, n in entries), names))
    statuses = []
    for name, answer in zip(names, answers, strict=True):
        if isinstance(answer, dict):
            statuses.append(answer)
        elif isinstance(answer, str):
            entry = entries.get(name)
            statuses.append(
                {
                    "name": name,
                    "pid": entry.pid if entry is not None else None,
                    "state": "starting" if answer is STARTING else "unresponsive",
                    "parent": entry.parent if entry is not None else None,
                    "scope": entry.scope if entry is not None else [],
                    "error": answer,
                }
            )
    from cli.render import tree_order

    return [st for _, st in tree_order(statuses)]


@app.command("ls")
def ls(as_json: JsonOpt = False) -> None:
    """Table of live pods, children indented under their parent.

    Columns: name, pid, state, model, write scope, parent, queue (runs/notifications), tokens,
    sandbox (landlock-abi-N or none).
    A pod that errs or does not answer within 2 s is listed with state `unresponsive`; one
    whose socket does not listen yet (SessionStart hooks, MCP servers) with state `starting`.
    """
    from protocol import paths

    paths.check_private_dirs()  # the registry and sockets of an unsafe home cannot be trusted
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
        typer.Argument(
            metavar="[POD]",
            help="Pod name or socket path; without it, like `ls`.",
            callback=pod_name,
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """One pod's status (or, without POD, the table of live pods).

    A pod that does not answer within 10 s (stopped, wedged) is an error (exit 1).
    """
    if pod is None:
        ls(as_json)
        return
    from cli import plain  # (what runs it without typer, cli/main.py's usual way in)

    plain.status(pod, as_json)


# --- stop ---------------------------------------------------------------------------------------


def _released(name: str, pid: int | None, sock: str, deadline: float) -> bool:
    """Poll until the pod is gone and its registry claim (name and scope) is free; False at the
    deadline. Gone: its process ended (so its last log line, "shut down", is written), or,
    its pid unknown, its socket was removed."""
    import os
    import time

    from poddaemon.registry import Registry, RegistryError, process_start_time
    from protocol import paths

    started = process_start_time(pid) if pid is not None else None  # (a pid reused is not it)
    registry = Registry(paths.runtime_dir())
    while True:
        if pid is None:
            gone = not os.path.exists(sock)
        else:
            gone = started is None or process_start_time(pid) != started
        if gone:
            try:
                entry = registry.get(name)  # None once released, or when its process is dead
            except RegistryError:
                entry = None  # unreadable registry: the socket is all there is to go by
            if entry is None or (pid is not None and entry.pid != pid):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)


def _children_of(name: str) -> list[str] | None:
    """The children a pod says it has: [] when it is not there to ask (the registry still
    tells), None when it did not answer in time."""
    from protocol.client import PodClient
    from protocol.errors import ConnectionClosed, PodNotRunning, RpcError

    try:
        with PodClient.connect(name, timeout=STOP_TIMEOUT) as client:
            return [c.name for c in client.status().children]
    except TimeoutError:
        return None
    except (PodNotRunning, ConnectionClosed, RpcError, OSError):
        return []


def _descendants(
    name: str, children: list[str], seen: set[str]
) -> tuple[list[tuple[int, str]], set[str]]:
    """The pods below `name` with their depth, walked breadth first, and those of them that
    did not answer. A pod's children are those it names and those the registry names (a child
    the pod lost track of is still its descendant). Adds them to `seen`, so parents that name
    each other end the walk."""
    by_parent: dict[str, set[str]] = {}
    for entry in _registry_entries().values():
        if entry.parent:
            by_parent.setdefault(entry.parent, set()).add(entry.name)
    found: list[tuple[int, str]] = []
    unanswered: set[str] = set()
    level, depth = [(name, set(children))], 0
    while level:
        depth += 1
        below: list[tuple[str, set[str]]] = []
        for parent, named in level:
            for child in sorted(named | by_parent.get(parent, set())):
                if child in seen:
                    continue
                seen.add(child)
                found.append((depth, child))
                its = _children_of(child)
                if its is None:
                    unanswered.add(child)
                below.append((child, set(its or ())))
        level = below
    return found, unanswered


def _stop_descendants(name: str, children: list[str], seen: set[str] | None = None) -> list[str]:
    """`stop --tree`: the pod's descendants, deepest first (SPEC §9): the whole tree is walked
    before any pod is asked to stop, so no pod stops while a deeper one of another branch
    runs. Each is stopped with `tree` still set, which also stops a child it spawned after the
    walk (the walked ones are in `seen`, and gone); one that did not answer the walk is not
    asked again, to wait as long again. Returns those that did not stop (each said why)."""
    seen = set() if seen is None else seen
    seen.add(name)
    found, unanswered = _descendants(name, children, seen)
    left: list[str] = []
    for _, child in sorted(found, key=lambda found: -found[0]):  # stable: by name within a depth
        left += _stop(child, tree=True, top=False, unanswered=child in unanswered, seen=seen)
    return left


def _stop(
    target: str, tree: bool, top: bool, unanswered: bool = False, seen: set[str] | None = None
) -> list[str]:
    """Stop `target` (and, with `tree`, its descendants first); the descendants that did not
    stop. A top-level pod that does not stop is an error at once. A pod that cannot be asked
    (`unanswered`: it did not answer already) is sent SIGTERM, if a live process holds it."""
    import time

    from protocol.client import PodClient
    from protocol.errors import SHUTTING_DOWN, ConnectionClosed, PodNotRunning, RpcError
    from protocol.sockets import resolve_socket

    name, pid = target, None
    left: list[str] = []
    try:
        with rpc_errors(target, STOP_TIMEOUT):
            try:
                if unanswered:  # not asked again, to wait as long again
                    raise TimeoutError
                with PodClient.connect(target, timeout=STOP_TIMEOUT) as client:
                    children: list[str] = []
                    try:
                        st = client.status()
                        name, pid = st.name, st.pid
                        children = [c.name for c in st.children]
                    except RpcError:
                        if tree:
                            raise
                    if tree:
                        left = _stop_descendants(name, children, seen)
                    try:
                        client.shutdown()
                    except ConnectionClosed:
                        pass  # it went before it could answer: fine
                    except RpcError as exc:
                        if exc.code != SHUTTING_DOWN:
                            raise
            except (PodNotRunning, ConnectionClosed, TimeoutError) as exc:
                entry = live_entry(target)
                if entry is None and tree and not left:
                    # Gone, but not its descendants (detached, or they outlived its crash):
                    # the registry still names them its tree, and they would run on.
                    left = _stop_descendants(name, [], seen)
                if entry is None and not top and not isinstance(exc, TimeoutError):
                    return left  # it went already (another stop, a restart): not left running
                if entry is None:
                    raise
                name, pid = entry.name, entry.pid
                if tree and not left:
                    left = _stop_descendants(name, [], seen)
                _terminate(entry, "did not answer in time" if isinstance(exc, TimeoutError) else "")
    except PodNotRunning as exc:
        if top:
            not_running(exc)
        return left  # a child that already went
    except SystemExit:  # fail() for this pod
        if top:
            raise
        return [*left, name]
    # `podctl stop p; podctl spawn p.toml` must work: return only once name and scope are free.
    if not _released(name, pid, resolve_socket(target), time.monotonic() + STOP_TIMEOUT):
        if top:
            fail(f"pod '{name}' did not stop within {STOP_TIMEOUT:g} s")
        sys.stderr.write(f"podctl: pod '{name}' did not stop within {STOP_TIMEOUT:g} s\n")
        return [*left, name]
    try:
        sys.stdout.write(f"stopped {name}\n")
        sys.stdout.flush()
    except OSError:  # a full disk, `| true`'s reader gone
        if top:
            raise  # `podctl stop`'s own output: said as ever
        # Raised here, it ended `restart` between its stop and its start (the pod left
        # stopped) or a --tree stop midway; what they print last says it failed.
    return left


def live_entry(target: str) -> Any:
    """The live registry entry of the pod `target` names (a name, or a socket path or a
    symlink to one); None if no live process holds it. What is known of a pod that cannot be
    asked on its socket."""
    import os

    entries = _registry_entries()
    if target in entries or "/" not in target:  # a name: no path (from a removed cwd, none)
        return entries.get(target)
    path = os.path.realpath(target)  # (a symlink to the socket names it too)
    return next((e for e in entries.values() if os.path.realpath(e.socket) == path), None)


def _terminate(entry: Any, why: str) -> None:
    """SIGTERM, which a pod takes as `shutdown` (SPEC §7), for a pod that cannot be asked on
    its socket (wedged, out of file descriptors, stopped); then SIGCONT, so a stopped one wakes
    to take it, as systemd does. The entry is a live one: its pid is that pod's, not reused."""
    import os
    import signal

    with contextlib.suppress(ProcessLookupError):  # it went meanwhile
        os.kill(entry.pid, signal.SIGTERM)
        os.kill(entry.pid, signal.SIGCONT)
    said = why or "could not be asked on its socket"
    sys.stderr.write(f"podctl: pod '{entry.name}' {said}; sent SIGTERM to pid {entry.pid}\n")


def _still_running(left: list[str]) -> None:
    """`stop --tree` is done only when the whole tree is: exit 1 naming what is left."""
    if left:
        names = ", ".join(f"'{n}'" for n in left)
        fail(f"{len(left)} descendant(s) still running: {names}")


@app.command()
def stop(
    pod: PodArg,
    tree: Annotated[bool, typer.Option("--tree", help="Stop its descendants first.")] = False,
) -> None:
    """Shut a pod down; wait until it has exited and its name is free.

    Returns once the pod is gone and its name and scope are free in the registry, so a
    `podctl spawn` of the same manifest right after it succeeds. A unit-managed pod: its unit
    is stopped (or systemd would start it again).
    """
    from cli.service import stop_unit_pod
    from protocol import paths

    # A pod that cannot be asked is sent SIGTERM at the pid its registry entry names: in a
    # runtime dir others can write, that could be any process of ours.
    paths.check_private_dirs()
    # A unit pod's descendants first, as for any pod: systemd would SIGKILL what its stop
    # leaves in the unit's cgroup, and detached children are not the pod's to stop.
    left: list[str] = []
    stop_children = (lambda n, c: left.extend(_stop_descendants(n, c))) if tree else None
    try:
        if stop_unit_pod(pod, STOP_TIMEOUT, stop_children):
            _still_running(left)
            return
    except TimeoutError:
        _still_running(_stop(pod, tree, top=True, unanswered=True))
        return
    _still_running(_stop(pod, tree, top=True))


# --- rpc ----------------------------------------------------------------------------------------


def _not_json(name: str) -> Any:
    # Python's json reads NaN and Infinity; sent on, the pod answered -32700 "JSON is malformed"
    # for what the user typed.
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999: valid JSON, sent on as Infinity
        raise ValueError(f"{text} is out of range")
    return value


@app.command()
def rpc(
    pod: PodArg,
    method: Annotated[str, typer.Argument(metavar="METHOD", help="JSON-RPC method, e.g. status.")],
    params: Annotated[
        str | None,
        typer.Argument(metavar="[JSON]", help="Params: a JSON object; `-` reads it from stdin."),
    ] = None,
) -> None:
    """Raw JSON-RPC call; prints the JSON result.

    Waits as long as the pod takes to answer (`run` with `"wait": true` lasts the whole run).
    """
    import json

    parsed: dict[str, Any] | None = None
    if params == "-":
        # As `send -`: one argument holds at most 128 KiB (the kernel's MAX_ARG_STRLEN), less
        # than the 256 KiB of input a pod takes by default, and `-` was "invalid JSON" itself.
        params = read_message(params, "JSON params")
    if params is not None:
        try:
            value = json.loads(params, parse_constant=_not_json, parse_float=_finite)
        except ValueError as exc:
            fail(f"invalid JSON params: {exc}", EXIT_USAGE)
        except RecursionError:  # (a traceback, else)
            fail("invalid JSON params: nested too deeply", EXIT_USAGE)
        if not isinstance(value, dict):
            fail("JSON params must be an object", EXIT_USAGE)
        parsed = value
    print_json(call(pod, method, parsed, timeout=None))  # `run` with `wait` lasts its run


# --- mcp-serve ----------------------------------------------------------------------------------


@app.command("mcp-serve")
def mcp_serve(
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="S",
            min=0.1,
            callback=seconds,
            help="Seconds a pod has to answer a tool call, except send_to_pod with wait=true "
            "(which lasts as long as the run).",
        ),
    ] = 30.0,
) -> None:
    """Serve this user's pods to an MCP client over stdio (list_pods, send_to_pod, notify_pod,
    pod_status, pod_history): `claude mcp add pods -- podctl mcp-serve`."""
    from cli.mcp_serve import main as serve

    raise typer.Exit(serve(timeout))
