"""`podctl sessions`: browse and check session logs on disk (no pod needed)."""

import sys
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from cli.app import JsonOpt, app, sub_app
from cli.common import EXIT_USAGE, fail, print_json

sessions_app = sub_app("Browse and check session logs.")
app.add_typer(sessions_app, name="sessions")


def _sessions_dir() -> Any:
    from protocol import paths

    paths.check_private_dirs()  # a log another user could plant is no evidence of anything
    return paths.sessions_dir()


@sessions_app.callback(invoke_without_command=True)
def sessions(ctx: typer.Context) -> None:
    """Browse and check session logs (without a subcommand: list)."""
    if ctx.invoked_subcommand is None:
        sessions_list(None, False)


def _only_a_name(value: str | None) -> str | None:
    """A pod name, as spawn allows them: `Alpha` or `alpha.toml` (a typo) listed "no sessions"
    with exit 0, as if the pod had never run. A usage error instead (2), as for every command
    naming a pod; a socket path names no pod here either (sessions are on disk by name)."""
    from protocol.paths import pod_name_problem

    if value is not None and (problem := pod_name_problem(value)):
        raise typer.BadParameter(problem)
    return value


@sessions_app.command("list")
def sessions_list(
    pod: Annotated[
        str | None,
        typer.Argument(metavar="[POD]", help="Only this pod's sessions.", callback=_only_a_name),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Every session log (or POD's), newest first."""
    import msgspec

    from cli.render import format_time
    from poddaemon.store.file import list_sessions

    infos = list_sessions(_sessions_dir())
    if pod is not None:  # ten pods that compact make a long list
        infos = [info for info in infos if info.pod == pod]
    if as_json:
        print_json(msgspec.to_builtins(infos))
        return
    if not infos:
        sys.stderr.write(f"podctl: no sessions{'' if pod is None else f' of pod {pod}'}\n")
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


def _scan(session_id: str) -> Any:
    from poddaemon.store.file import SessionScan

    try:
        # An empty file is a session with no entries: one a pod made ahead of its first input
        # and was stopped (killed) before any came. Nothing in it was ever acknowledged.
        return SessionScan(_sessions_dir(), session_id, allow_empty=True)
    except ValueError as exc:  # not a session id: a usage error, unlike a damaged log (1)
        fail(str(exc), EXIT_USAGE)


EMPTY_NOTE = (
    "an empty file: a pod makes its first session's file ahead of its first input, and none "
    "came (the pod was stopped first, or waits still); nothing in it was acknowledged"
)


def _entries(scan: Any) -> Iterator[dict[str, Any]]:
    """The entries of a `_scan`, one at a time; a damaged or unreadable log ends podctl with
    one line (after the entries before the damage)."""
    from poddaemon.store.log import LogCorrupt
    from protocol.errors import os_error_line

    try:
        yield from scan
    except LogCorrupt as exc:
        fail(str(exc))
    except FileNotFoundError as exc:
        fail(exc.strerror or str(exc))
    except OSError as exc:
        fail(os_error_line(exc))


@sessions_app.command("show")
def sessions_show(
    session_id: Annotated[str, typer.Argument(metavar="ID", help="Session id.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per entry.")] = False,
    chain: Annotated[
        bool,
        typer.Option(
            "--chain",
            help="Follow `compacted_from`/`forked_from` back: every session of the chain, "
            "oldest first, each under a `== session ID` line.",
        ),
    ] = False,
) -> None:
    """The entries of one session log (`seq kind summary`)."""
    import json

    from cli.render import entry_line, json_text

    ids = [session_id]
    if chain:
        ids, gone = _chain(session_id)
        if gone is not None:
            sys.stderr.write(f"podctl: {ids[0]} continues session {gone}, which is not on disk\n")
    for sid in ids:
        scan = _scan(sid)
        for entry in _entries(scan):
            if chain and not as_json and entry["seq"] == 1:
                link = entry.get("compacted_from") or entry.get("forked_from")
                how = "compacted" if entry.get("compacted_from") else "forked"
                sys.stdout.write(
                    f"== session {sid}" + (f" ({how} from {link})" if link else "") + "\n"
                )
            if as_json:
                sys.stdout.write(json_text(json.dumps(entry, ensure_ascii=False)) + "\n")
            else:
                sys.stdout.write(entry_line(entry) + "\n")
        if scan.torn:
            sys.stderr.write(
                f"podctl: {sid}: torn last line after byte {scan.end_offset} (not shown)\n"
            )
        if scan.empty:
            sys.stderr.write(f"podctl: {sid}: no entries ({EMPTY_NOTE})\n")


def _chain(session_id: str) -> tuple[list[str], str | None]:
    """The session and those it continues (compacted or forked from), oldest first, and the
    link the oldest of them names that is not on disk (None if none). A removed old session
    (nothing removes them but the user) ends the chain there: naming it would fail the whole
    command before the sessions that are still there were shown."""
    from poddaemon.store.file import list_sessions

    links = {i.id: i.compacted_from or i.forked_from for i in list_sessions(_sessions_dir())}
    ids = [session_id]
    while (link := links.get(ids[-1])) and link not in ids:
        if link not in links:
            return ids[::-1], link
        ids.append(link)
    return ids[::-1], None


@sessions_app.command("verify")
def sessions_verify(
    session_id: Annotated[str, typer.Argument(metavar="ID", help="Session id.")],
) -> None:
    """Check a session log's hash chain.

    Prints `ok: N entries, head H`, or the first bad line and exits 1. An empty file (a
    session a pod made ahead of its first input, stopped before any came) is `ok: 0 entries`.
    """
    scan = _scan(session_id)
    for _ in _entries(scan):
        pass
    if scan.empty:
        sys.stdout.write(f"ok: 0 entries ({EMPTY_NOTE})\n")
        return
    sys.stdout.write(f"ok: {scan.count} entries, head {scan.head[:12]}\n")
    if scan.torn:
        sys.stderr.write(
            f"podctl: warning: torn last line after byte {scan.end_offset}; "
            "restoring the session cuts it off\n"
        )
