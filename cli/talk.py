"""Talking to a pod: send, notify, attach, history, pause, resume, cancel."""

import itertools
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from cli.app import JsonOpt, PodArg, app
from cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_LIMIT,
    EXIT_USAGE,
    UNANSWERED_INPUT,
    call,
    check_stdout,
    connect,
    connection_lost,
    fail,
    print_json,
    read_message,
)

if TYPE_CHECKING:
    from protocol.client import PodClient
    from protocol.types import Event

FOLLOW_CHECK = 1.0  # seconds a follower waits for an event before it checks its stdout
HISTORY_TAIL = 50  # entries `podctl history` shows without --all/--since/--limit
HISTORY_PAGE = 10_000  # entries asked for per `history` call (the pod caps a page there)
USAGE_KEYS = ("input", "output", "cache_read", "cache_write")

ClientKeyOption = Annotated[
    str | None,
    typer.Option(
        "--client-key",
        metavar="KEY",
        help="Idempotency key: sent again with the same key and text, it is taken once and "
        "answered as the first time (a cron job that may run twice).",
    ),
]


def follow(client: "PodClient") -> Iterator["Event"]:
    """`client.events()`, ended (BrokenPipeError) when our stdout's reader goes, even while the
    pod is quiet: `podctl attach x | head -3` returns once `head` has its lines."""
    while True:
        event = client.next_event(FOLLOW_CHECK)
        if event is None:
            check_stdout()
        else:
            yield event


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
    take the message when it runs again.
    """
    import msgspec

    from cli.render import one_line, printable, retry_line
    from protocol.errors import ConnectionClosed

    text = read_message(message)
    mode: Literal["queue", "steer"] = "steer" if steer else "queue"
    with connect(pod, unanswered=UNANSWERED_INPUT) as client:
        if no_wait:
            result = _submit(client, text, mode, client_key)
            if as_json:
                print_json(msgspec.to_builtins(result))
            else:
                sys.stdout.write(f"{result.run_id} {result.state}\n")
            return
        client.subscribe()
        result = _submit(client, text, mode, client_key)
        run_id = result.run_id  # steered: the run it joined, followed to its end
        # A retry of a keyed run that has ended since gets its first reply: its end is only
        # in the log now (what ends after subscribing comes as an event).
        ended = run_end_in_log(client, run_id) if client_key is not None else None
        if result.state == "queued" and sys.stderr.isatty():
            position = f" (position {result.position})" if result.position is not None else ""
            sys.stderr.write(f"podctl: run {run_id} queued{position}\n")
        if result.state == "queued" and client.status().state == "paused":
            # Nothing starts until then: a silent wait would look like a hang.
            sys.stderr.write(
                f"podctl: pod '{pod}' is paused: the run waits for `podctl resume {pod}`"
                " (or a cancel of the paused run)\n"
            )
            sys.stderr.flush()
        wrote, ends_nl = False, True
        # To a terminal, the answer's control characters are shown as \xNN (newlines and tabs
        # kept): a file the model read could make it echo an escape sequence that writes the
        # clipboard (OSC 52) or retitles the terminal. To a pipe or file, verbatim.
        shown = printable if sys.stdout.isatty() else str
        between_messages = False  # the model's text so far has ended (a tool call came)
        finished: dict[str, Any] | None = ended
        trouble = ""  # the last error alert: why the pod stopped, should it close on us
        try:
            if ended is not None and ended["text"] and not as_json:  # its reply, as it streamed
                _out(shown(ended["text"]))
                wrote, ends_nl = True, ended["text"].endswith("\n")
            for event in follow(client) if ended is None else ():
                if event.type == "gap":
                    sys.stderr.write("podctl: some events were missed; output may be incomplete\n")
                    finished = run_end_in_log(client, run_id)  # its run.finished may be one
                    if finished is not None:
                        break
                if event.type == "alert" and event.data.get("level") == "error":
                    trouble = one_line(str(event.data.get("message", "")), 1000)
                if event.run_id != run_id:
                    continue
                if event.type == "text.delta" and not as_json:
                    delta = str(event.data.get("text", ""))
                    if delta:
                        if not ends_nl and between_messages:  # a new round's text
                            delta = "\n" + delta
                        _out(shown(delta))
                        wrote, ends_nl, between_messages = True, delta.endswith("\n"), False
                elif event.type == "run.finished":
                    finished = dict(event.data)
                    break
                elif event.type == "llm.retry":  # a silent wait would look like a hung pod
                    between_messages = True
                    if wrote and not ends_nl:
                        _out("\n")
                        ends_nl = True
                    sys.stderr.write(f"podctl: model call failed; {retry_line(event.data)}\n")
                elif event.type != "reasoning.delta":  # a tool call, the model call's usage…
                    between_messages = True
        except KeyboardInterrupt:
            if wrote and not ends_nl:
                sys.stdout.write("\n")
            fail(f"stopped waiting; run {run_id} goes on (podctl cancel {pod})", EXIT_INTERRUPTED)
        except _OutputLost as lost:
            # Not the pod's fault: "cannot talk to pod" would invite a retry, a second run.
            goes_on = f" and goes on (podctl cancel {pod})" if ended is None else ""
            fail(f"cannot write the output: {lost}; run {run_id} was taken{goes_on}")
        except ConnectionClosed:
            if wrote and not ends_nl:
                sys.stdout.write("\n")
            why = f": {trouble}" if trouble else ""  # the pod's own last word, if it said one
            connection_lost(pod, f"before run {run_id} finished{why}")
    assert finished is not None
    if wrote and not ends_nl:
        sys.stdout.write("\n")
    if as_json:
        print_json({"run_id": run_id, **finished})
    outcome = finished.get("outcome")
    if outcome == "finished":
        return
    error = finished.get("error")  # for limit_reached, which limit: max_turns, the budget
    # The pod's error quotes what failed (a provider's error body, say): no escape sequences.
    said = f": {one_line(str(error), 1000)}" if error else ""
    if outcome == "limit_reached":
        if not as_json:
            sys.stderr.write(f"podctl: run {run_id} reached its limit{said}\n")
        raise typer.Exit(EXIT_LIMIT)
    if not as_json:
        sys.stderr.write(f"podctl: run {run_id} {outcome}{said}\n")
    raise typer.Exit(EXIT_ERROR)


class _OutputLost(Exception):
    """podctl's stdout failed (a full disk, /dev/full): an OSError would read as the pod's."""


def _out(text: str) -> None:
    """Write and flush a piece of `send`'s answer (BrokenPipeError: the reader went, as ever)."""
    from protocol.errors import os_error_line

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _OutputLost(os_error_line(exc)) from None


def _submit(
    client: "PodClient",
    text: str,
    mode: Literal["queue", "steer"] = "queue",
    client_key: str | None = None,
) -> Any:
    """`run`; a pod out of budget refuses it (-32007): exit 2, as a run that reaches its limit."""
    from protocol.errors import BudgetExhausted

    try:
        return client.run(text, mode=mode, client_key=client_key)
    except BudgetExhausted as exc:
        fail(f"{exc.message} ({exc.code})", EXIT_LIMIT)


def run_end_in_log(client: "PodClient", run_id: str) -> dict[str, Any] | None:
    """The `run.finished` data of run `run_id` as its session log holds it, or None while it has
    not ended: for a follower told `gap`, whose missed events may have held it. The pod's session
    first, then the ones it continues (a compaction may have come after the run ended)."""
    entry = last_run_end(client, run_id)
    if entry is None:
        return None
    if entry.get("outcome") == "paused":  # not final: resumed since, it goes on
        status = client.status()
        if status.run_id == run_id and status.state != "paused":
            return None
    data = {"outcome": entry.get("outcome"), "text": entry.get("text", "")}
    if entry.get("error") is not None:
        data["error"] = entry["error"]
    data["usage"] = entry.get("usage") or dict.fromkeys(USAGE_KEYS, 0)
    return data


def last_run_end(client: "PodClient", run_id: str) -> dict[str, Any] | None:
    """The newest `run_end` entry of run `run_id`: a run paused (not a final outcome) and
    resumed has another after it, maybe in a later session (a compaction in between)."""
    found: dict[str, Any] | None = None
    for entry in log_entries(client):
        if entry.get("kind") == "session_start" and found is not None:
            return found  # an earlier session: what it holds came before
        if entry.get("kind") == "run_end" and entry.get("run_id") == run_id:
            found = entry
    return found


def log_entries(client: "PodClient") -> Iterator[dict[str, Any]]:
    """Every entry of the pod's session log, then of the sessions it continues (compacted or
    forked from), newest session first, each oldest entry first."""
    session: str | None = None
    searched: set[str] = set()
    while True:
        links: list[str] = []
        for page in history_pages(client, 0, session, links):
            yield from page
        session = next((s for s in links if s not in searched), None)
        if session is None:
            return
        searched.add(session)


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
                    out.write(json_text(msgspec.json.encode(event).decode()) + "\n")
                else:
                    out.write(renderer.render(msgspec.structs.asdict(event)))
                out.flush()
        except KeyboardInterrupt:  # 130, as send's and wait's: exit 0 says the pod shut down
            out.write(renderer.finish())
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except ConnectionClosed:
            out.write(renderer.finish())
            out.flush()
            if seen_shutdown:
                return
            raise


def history_pages(
    client: "PodClient",
    since: int,
    session_id: str | None = None,
    links: list[str] | None = None,
    size: int = HISTORY_PAGE,
) -> Iterable[list[dict[str, Any]]]:
    """Every entry after seq `since`, page by page (of at most `size`), oldest first. `links`
    receives the session the pages continue (compacted or forked from), if any."""
    while True:
        # session_id only when asked for: a pod of an earlier version does not know it.
        extra = {"session_id": session_id} if session_id else {}
        page = client.history(since=since, limit=size, **extra)
        # Every later page from the session this one came from: a compaction in between moves
        # the pod to a new session, whose entries would go on from another log's seq.
        session_id = session_id or getattr(page, "session_id", None)
        previous = getattr(page, "previous", None)
        if links is not None and previous and previous not in links:
            links.append(previous)
        if not page.entries:
            return
        yield page.entries
        if page.next <= since:
            return  # a pod that does not advance would loop forever
        since = page.next


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
    with connect(pod) as client:
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
    """Pause the active run at its next safe point."""
    _say("pausing" if call(pod, "pause")["paused"] else "nothing to pause")


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
        known = end is not None or any(e.get("run_id") == run_id for e in log_entries(client))
    if not known:
        fail(f"pod '{pod}' has no run {run_id}")
    said = f": {end.get('outcome')}" if end is not None else ""
    return f"nothing to cancel: run {run_id} already ended{said}"


@app.command()
def compact(pod: PodArg, as_json: JsonOpt = False) -> None:
    """Compact the pod's context now (idle pods only): summarize the history and continue in a
    new session linked by `compacted_from`. Prints the new session's id. Waits for the summary
    however long the model takes."""
    session_id = call(pod, "compact", timeout=None)["session_id"]  # a model call: no limit
    if as_json:
        print_json({"session_id": session_id})
        return
    # A pod with no history yet has nothing to summarize: the pod answers its session as is
    # (none: null; "" from earlier versions).
    _say(f"compacted: session {session_id}" if session_id else "nothing to compact yet")
