"""Talking to a pod: send, notify, attach, history, pause, resume, cancel."""

import itertools
import sys
from collections.abc import Iterable
from typing import Annotated, Any

import typer

from cli.app import JsonOpt, PodArg, app
from cli.common import (
    ANSWER_TIMEOUT,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    call,
    connect,
    fail,
    one_call,
    print_json,
    say_compacted,
)
from cli.runs import (
    HISTORY_PAGE,
    OutputLost,
    entries_newest_first,
    follow,
    history_pages,
    last_run_end,
    write_out,
)

HISTORY_TAIL = 50  # entries `podctl history` shows without --all/--since/--limit

ClientKeyOption = Annotated[
    str | None,
    typer.Option(
        "--client-key",
        metavar="KEY",
        help="Idempotency key: sent again with the same key and text, it is taken once and "
        "answered as the first time (a cron job that may run twice).",
    ),
]


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
        bool,
        typer.Option(
            "--steer",
            help="Deliver into the active run instead of queueing, and stream the rest of "
            "that run (an idle pod starts a run for it).",
        ),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the final run.finished data as JSON (with --no-wait: the run's "
            "run_id, state and position).",
        ),
    ] = False,
    client_key: ClientKeyOption = None,
) -> None:
    """Start a run and stream its reply.

    Exit status: 0 finished; 1 error, cancelled or paused; 2 limit reached (max_turns or the
    budget; otherwise 2 means a usage error, e.g. an empty message); 3 the pod is not running,
    or went away before the run finished (a restart reports that run interrupted).

    Ctrl-C stops only the waiting (exit 130): the run was acknowledged and goes on;
    `podctl cancel POD` ends it, `podctl attach POD` follows it again. A pod that does not
    acknowledge the message within 30 s (stopped, wedged) is an error (exit 1); it may still
    take the message when it runs again, unless podctl says it was not sent.
    """
    from cli import runs

    runs.send(pod, message, no_wait, steer, as_json, client_key)


@app.command()
def notify(
    pod: PodArg,
    message: Annotated[
        str, typer.Argument(metavar="MESSAGE", help="The message; `-` reads it from stdin.")
    ],
    source: Annotated[
        str | None, typer.Option("--source", metavar="S", help="Who it is from.")
    ] = None,
    client_key: ClientKeyOption = None,
) -> None:
    """Send the pod a notification.

    It reaches the model at its next request; an idle pod wakes for it. A pod that does not
    acknowledge it within 30 s (stopped, wedged) is an error (exit 1); it may still take the
    notification when it runs again.
    """
    from cli import plain  # (what runs it without typer, cli/main.py's usual way in)

    plain.notify(pod, message, source, client_key)


def _sessions_on_disk(pod: str) -> str:
    """For a pod that ran here once (its configuration is kept) and is not running: where its
    history is still to be read."""
    from protocol import paths

    if "/" in pod or not paths.kept_config(pod).exists():
        return ""
    return f"; its sessions are on disk: podctl sessions list {pod}, podctl sessions show ID"


@app.command()
def attach(
    pod: PodArg,
    since: Annotated[
        int | None, typer.Option("--since", metavar="N", min=0, help="Replay events after seq N.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per event.")] = False,
) -> None:
    """Follow the pod's event stream (Ctrl-C to stop: exit 130).

    It ends with the pod: exit 0 after its `shutdown` event (a stop or restart), 3 when it went
    away without one (killed, crashed).
    """
    import msgspec

    from cli.render import EventRenderer, json_text
    from protocol.errors import ConnectionClosed

    renderer = EventRenderer()
    out = sys.stdout
    seen_shutdown = False
    with connect(pod) as client:
        client.subscribe(since)
        try:
            for event in follow(client):
                seen_shutdown = seen_shutdown or event.type == "shutdown"
                if as_json:
                    write_out(json_text(msgspec.json.encode(event).decode()) + "\n")
                else:
                    write_out(renderer.render(msgspec.structs.asdict(event)))
        except OutputLost as lost:
            # Our stdout failed (a full disk): inside connect(), an OSError read as the pod's
            # ("cannot talk to pod 'x': [Errno 28] …"), which sends one looking at the pod.
            fail(f"cannot write the output: {lost}")
        except KeyboardInterrupt:  # 130, as send's and wait's: exit 0 says the pod shut down
            out.write(renderer.finish())
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except ConnectionClosed:
            out.write(renderer.finish())
            out.flush()
            if seen_shutdown:
                return
            raise


def newest(pages: Iterable[list[dict[str, Any]]], keep: int | None) -> tuple[list[Any], int]:
    """The newest `keep` entries (all with None) and how many earlier ones were left out."""
    from collections import deque

    # A --limit past what a deque can hold (its maxlen is a C ssize_t: 10**20 raised
    # OverflowError) is past any session's length too: every entry.
    kept: deque[dict[str, Any]] = deque(maxlen=keep if keep is None or keep < sys.maxsize else None)
    total = 0
    for page in pages:
        total += len(page)
        kept.extend(page)
    return list(kept), total - len(kept)


@app.command()
def history(
    pod: PodArg,
    all_: Annotated[bool, typer.Option("--all", help="Every entry of the session.")] = False,
    since: Annotated[
        int | None, typer.Option("--since", metavar="SEQ", min=0, help="Every entry after seq SEQ.")
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            metavar="N",
            min=1,
            help=f"The newest N (default {HISTORY_TAIL}); with --since, the first N after SEQ.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    session: Annotated[
        str | None,
        typer.Option(
            "--session",
            metavar="ID",
            help="An earlier session of the pod (after a compaction: the one it continues).",
        ),
    ] = None,
) -> None:
    """The newest session log entries (`seq kind summary`).

    By default the newest 50; `--limit N` the newest N, `--all` every entry, `--since SEQ`
    every entry after SEQ. `--since SEQ --limit N` is one page, as the `history` RPC pages:
    the first N entries after SEQ; `--since NEXT` (the last seq shown; `next` in --json) gives
    the next page, and the same seq again once nothing is left. When entries are left out,
    says how many on stderr (in `--json`: `earlier`, and `later` for a page). After a
    compaction the pod's session continues an earlier one: stderr names it (in `--json`:
    `previous`), and `--session ID` pages it.
    """
    if all_ and limit is not None:
        fail("--all and --limit exclude each other", EXIT_USAGE)
    page = since is not None and limit is not None  # forward from SEQ, as the RPC pages
    keep = None if all_ or since is not None else (limit or HISTORY_TAIL)
    start = since or 0
    links: list[str] = []
    later = 0
    with connect(pod, stopped=_sessions_on_disk(pod)) as client:
        skipped = 0
        extra = {"session_id": session} if session else {}
        first = client.history(since=start, limit=1, **extra)
        last = getattr(first, "last_seq", None)
        session = session or getattr(first, "session_id", None)  # the same log throughout
        if page:
            assert limit is not None
            size = min(limit, HISTORY_PAGE)
            entries = list(
                itertools.islice(
                    itertools.chain.from_iterable(
                        history_pages(client, start, session, links, size)
                    ),
                    limit,
                )
            )
            earlier = 0
            if entries and last is not None:
                later = max(0, last - entries[-1]["seq"])
        else:
            # ask only for the newest `keep`, when the pod says where they are
            if keep is not None and last is not None and last - keep > start:
                skipped, start = last - keep - start, last - keep
            entries, earlier = newest(history_pages(client, start, session, links), keep)
            earlier += skipped
    previous = links[0] if links else None
    nxt = entries[-1]["seq"] if entries else start
    if as_json:
        out = {"entries": entries, "next": nxt, "earlier": earlier, "previous": previous}
        if page:
            out["later"] = later
        print_json(out)
        return
    from cli.render import entry_line

    if earlier:
        sys.stderr.write(f"podctl: {earlier} earlier entries not shown (--all shows every entry)\n")
    if later:
        sys.stderr.write(
            f"podctl: {later} later entries not shown (--since {nxt} shows the next page)\n"
        )
    if previous and not earlier and start == 0:
        sys.stderr.write(
            f"podctl: this session continues session {previous} "
            f"(podctl history {pod} --session {previous})\n"
        )
    sys.stderr.flush()
    sys.stdout.writelines(entry_line(entry) + "\n" for entry in entries)


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")


@app.command()
def pause(pod: PodArg) -> None:
    """Pause the active run at its next safe point: says "pausing" until it is there, "paused"
    once it is (or was already), "nothing to pause" for an idle pod."""
    if not call(pod, "pause")["paused"]:
        _say("nothing to pause")
        return
    # The reply's one bool is true for a pod paused already too: it said "pausing" then.
    _say("paused" if _state(pod) == "paused" else "pausing")


def _state(pod: str) -> str | None:
    """The pod's state, or None if it cannot be told (nothing fails for it)."""
    try:
        status = one_call(pod, "status", None, ANSWER_TIMEOUT)
    except Exception:
        return None
    return status.get("state") if isinstance(status, dict) else None


@app.command()
def resume(pod: PodArg) -> None:
    """Continue a paused run."""
    _say(f"resumed run {call(pod, 'resume')['run_id']}")


@app.command()
def cancel(
    pod: PodArg,
    run_id: Annotated[
        str | None, typer.Option("--run-id", metavar="ID", help="Only this run.")
    ] = None,
) -> None:
    """Cancel the active run (or the given one); with no run, a `podctl compact` at work.

    Exit status: 0 cancelled, or nothing to cancel (idle; or the given run had already
    ended: its outcome is said); 1 a --run-id the pod does not know (in its sessions' logs);
    3 the pod is not running.
    """
    result = call(pod, "cancel", None if run_id is None else {"run_id": run_id})
    if result["cancelled"]:
        _say("cancelled")
    elif run_id is None:
        _say("nothing to cancel")
    else:
        _say(_not_cancelled(pod, run_id))


def _not_cancelled(pod: str, run_id: str) -> str:
    """Why run `run_id` was not cancelled: it ended (how), or failed as one the pod never had.
    A typo or another pod's run id must not read as done: a script would go on as if it were."""
    with connect(pod) as client:
        end = last_run_end(client, run_id)
        known = end is not None or any(
            e.get("run_id") == run_id for e in entries_newest_first(client)
        )
    if not known:
        fail(f"pod '{pod}' has no run {run_id}")
    said = f": {end.get('outcome')}" if end is not None else ""
    return f"nothing to cancel: run {run_id} already ended{said}"


@app.command()
def compact(pod: PodArg, as_json: JsonOpt = False) -> None:
    """Compact the pod's context now (idle pods only): summarize the history and continue in a
    new session linked by `compacted_from`. Prints "compacted: session ID" (--json: {"session_id":
    ID}, for scripts). Waits for the summary however long the model takes."""
    session_id = call(pod, "compact", timeout=None)["session_id"]  # a model call: no limit
    if as_json:
        say_compacted(pod, lambda: print_json({"session_id": session_id}), session_id)
        return
    # A pod with no history yet has nothing to summarize: the pod answers its session as is
    # (none: null; "" from earlier versions).
    said = f"compacted: session {session_id}" if session_id else "nothing to compact yet"
    say_compacted(pod, lambda: _say(said), session_id)
