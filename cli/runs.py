"""A run followed to its end, without typer: `podctl send` (its typer command and cli/plain.py
both run `send` here), and what `attach` and `history` share with it: the event follower, and
the pod's session log read page by page."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator

from cli.common import (
    ANSWER_TIMEOUT,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_LIMIT,
    UNANSWERED_INPUT,
    check_client_key,
    check_stdout,
    connect,
    connection_lost,
    fail,
    one_call,
    print_json,
    read_message,
    rpc_errors,
    say_taken,
)

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from typing import Any, Literal

    from protocol.client import PodClient
    from protocol.types import Event

FOLLOW_CHECK = 1.0  # seconds a follower waits for an event before it checks its stdout
HISTORY_PAGE = 10_000  # entries asked for per `history` call (the pod caps a page there)
BACK_PAGE = 256  # the newest entries read first, when a log is read from its end backward
USAGE_KEYS = ("input", "output", "cache_read", "cache_write")
# Said when a pod does not answer `send`'s subscribe, asked before the input: not sent.
NOT_SENT = "; the message was not sent"


def send(
    pod: str,
    message: str,
    no_wait: bool = False,
    steer: bool = False,
    as_json: bool = False,
    client_key: str | None = None,
) -> None:
    """`podctl send` (its exit statuses are in its --help, cli/talk.py)."""
    from cli.render import one_line, printable, retry_line
    from protocol.errors import ConnectionClosed

    check_client_key(client_key)
    text = read_message(message)
    mode: Literal["queue", "steer"] = "steer" if steer else "queue"
    if no_wait:
        submitted = _submit_once(pod, text, mode, client_key)
        # Written once the pod is let go, naming the run: a stdout that fails (a full disk)
        # must not read as the pod's failure, which invites a second run.
        run = submitted["run_id"]
        if as_json:
            say_taken(lambda: print_json(submitted), f"run {run}")
        else:
            say_taken(lambda: sys.stdout.write(f"{run} {submitted['state']}\n"), f"run {run}")
        return
    with connect(pod, unanswered=UNANSWERED_INPUT) as client:
        # Before the input: a pod that does not answer this has not been sent it either.
        with rpc_errors(pod, ANSWER_TIMEOUT, NOT_SENT):
            client.subscribe()
        result = _submit(client, text, mode, client_key)
        run_id = result.run_id  # steered: the run it joined, followed to its end
        wrote, ends_nl = False, True
        # To a terminal, the answer's control characters are shown as \xNN (newlines and tabs
        # kept): a file the model read could make it echo an escape sequence that writes the
        # clipboard (OSC 52) or retitles the terminal. To a pipe or file, verbatim.
        shown = printable if sys.stdout.isatty() else str
        between_messages = False  # the model's text so far has ended (a tool call came)
        ended: dict[str, Any] | None = None
        finished: dict[str, Any] | None = None
        trouble = ""  # the last error alert: why the pod stopped, should it close on us
        try:  # (from here on the run is taken: Ctrl-C says which, and that it goes on)
            # A retry of a keyed run that has ended since gets its first reply: its end is
            # only in the log now (what ends after subscribing comes as an event).
            rounds: list[str] = []  # its rounds' text, should it have ended
            ended = run_end_in_log(client, run_id, rounds) if client_key is not None else None
            finished = ended
            # (A retry is answered as the first time, "queued" too, whatever the run did since.)
            queued = result.state == "queued" and ended is None
            if queued and sys.stderr.isatty():
                position = f" (position {result.position})" if result.position is not None else ""
                sys.stderr.write(f"podctl: run {run_id} queued{position}\n")
            if queued and client.status().state == "paused":
                # Nothing starts until then: a silent wait would look like a hang.
                sys.stderr.write(
                    f"podctl: pod '{pod}' is paused: the run waits for `podctl resume {pod}`"
                    " (or a cancel of the paused run)\n"
                )
                sys.stderr.flush()
            reply = rounds_text(rounds) or (ended or {}).get("text", "")
            if ended is not None and reply and not as_json:  # its reply, as it streamed
                write_out(shown(reply))
                wrote, ends_nl = True, reply.endswith("\n")
            # A keyed retry of a run under way joins it midway: the text it said before this
            # subscribe went by, so its reply is printed whole, from the log, once it ends
            # (streamed, "five six…" read as the reply). A run seen from its start streams.
            began = joined = False
            for event in follow(client) if ended is None else ():
                if event.run_id == run_id and client_key is not None and not steer:
                    if event.type == "run.started" and event.data.get("trigger") != "resume":
                        began = True
                    elif not began and not joined and event.type != "run.queued":
                        joined = True
                        if sys.stderr.isatty() and not as_json:
                            sys.stderr.write(
                                f"podctl: run {run_id} is under way: its reply"
                                " follows when it ends\n"
                            )
                            sys.stderr.flush()
                if event.type == "gap":
                    sys.stderr.write("podctl: some events were missed; output may be incomplete\n")
                    finished = run_end_in_log(client, run_id)  # its run.finished may be one
                    if finished is not None:
                        break
                if event.type == "alert" and event.data.get("level") == "error":
                    trouble = one_line(str(event.data.get("message", "")), 1000)
                if event.run_id != run_id:
                    continue
                if event.type == "text.delta" and not as_json and not joined:
                    delta = str(event.data.get("text", ""))
                    if delta:
                        if not ends_nl and between_messages:  # a new round's text
                            delta = "\n" + delta
                        write_out(shown(delta))
                        wrote, ends_nl, between_messages = True, delta.endswith("\n"), False
                elif event.type == "run.finished":
                    finished = dict(event.data)
                    if joined and not as_json:  # as a retry of a run that had ended
                        run_end_in_log(client, run_id, rounds)
                        reply = rounds_text(rounds) or str(finished.get("text") or "")
                        if reply:
                            write_out(shown(reply))
                            wrote, ends_nl = True, reply.endswith("\n")
                    break
                elif event.type == "llm.retry":  # a silent wait would look like a hung pod
                    between_messages = True
                    if wrote and not ends_nl:
                        write_out("\n")
                        ends_nl = True
                    sys.stderr.write(f"podctl: model call failed; {retry_line(event.data)}\n")
                elif event.type != "reasoning.delta":  # a tool call, the model call's usage…
                    between_messages = True
        except KeyboardInterrupt:
            if wrote and not ends_nl:
                sys.stdout.write("\n")
            fail(f"stopped waiting; run {run_id} goes on (podctl cancel {pod})", EXIT_INTERRUPTED)
        except OutputLost as lost:
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
        say_taken(lambda: print_json({"run_id": run_id, **finished}), f"run {run_id}")
    outcome = finished.get("outcome")
    if outcome == "finished":
        return
    error = finished.get("error")  # for limit_reached, which limit: max_turns, the budget
    # The pod's error quotes what failed (a provider's error body, say): no escape sequences.
    said = f": {one_line(str(error), 1000)}" if error else ""
    if outcome == "limit_reached":
        if not as_json:
            sys.stderr.write(f"podctl: run {run_id} reached its limit{said}\n")
        raise SystemExit(EXIT_LIMIT)
    if not as_json:
        sys.stderr.write(f"podctl: run {run_id} {outcome}{said}\n")
    raise SystemExit(EXIT_ERROR)


class OutputLost(Exception):
    """podctl's stdout failed (a full disk, /dev/full): an OSError would read as the pod's."""


def write_out(text: str) -> None:
    """Write and flush a piece of `send`'s answer or `attach`'s events (BrokenPipeError: the
    reader went, as ever; any other OSError is our stdout's, not the pod's: OutputLost)."""
    from protocol.errors import os_error_line

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputLost(os_error_line(exc)) from None


def _submit_once(
    pod: str, text: str, mode: Literal["queue", "steer"], client_key: str | None
) -> dict[str, Any]:
    """`run` as one call (protocol.oneshot: no PodClient, no msgspec, ~20 ms of podctl's
    start-up), for --no-wait; an exhausted budget exits 2, as in `_submit`."""
    from protocol import paths
    from protocol.errors import BudgetExhausted

    params = {"input": text, "mode": mode}
    if client_key is not None:
        params["client_key"] = client_key
    with rpc_errors(pod, ANSWER_TIMEOUT, UNANSWERED_INPUT):
        paths.check_private_dirs()  # another user must not be able to swap what we talk to
        try:
            result: dict[str, Any] = one_call(pod, "run", params, ANSWER_TIMEOUT)
        except BudgetExhausted as exc:
            fail(f"{exc.message} ({exc.code})", EXIT_LIMIT)
    return result


def _submit(
    client: PodClient,
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


def rounds_text(texts: list[str]) -> str:
    """A run's answer as `send` streams it: each round's text, on a line of its own."""
    said = ""
    for text in texts:
        if text:
            said += ("\n" if said and not said.endswith("\n") else "") + text
    return said


def run_end_in_log(
    client: PodClient, run_id: str, texts: list[str] | None = None
) -> dict[str, Any] | None:
    """The `run.finished` data of run `run_id` as its session log holds it, or None while it has
    not ended: for a follower told `gap`, whose missed events may have held it. The pod's session
    first, then the ones it continues (a compaction may have come after the run ended). `texts`
    receives the text of each of its rounds (`run.finished` has the last one's only)."""
    entry = last_run_end(client, run_id, texts)
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


def last_run_end(
    client: PodClient, run_id: str, texts: list[str] | None = None
) -> dict[str, Any] | None:
    """The newest `run_end` entry of run `run_id`: a run paused (not a final outcome) and
    resumed has another after it, maybe in a later session (a compaction in between).
    `texts` receives the text of each of the run's rounds, oldest first, when it ended.
    Read from the newest entry back to where the run began (its queued input or its start),
    not from the log's first: a keyed `send`'s run is most often among the newest few."""
    found: dict[str, Any] | None = None
    said: list[str] = []  # its rounds' text, newest first
    for entry in entries_newest_first(client):
        if entry.get("run_id") != run_id:
            continue
        kind = entry.get("kind")
        if kind == "run_end" and found is None:
            found = entry
            if texts is None:
                break
        elif kind == "assistant":
            said.append(str((entry.get("item") or {}).get("text") or ""))
        elif _began(kind, entry):
            break  # nothing of the run comes before
    if texts is not None and found is not None:
        texts.extend(reversed(said))
    return found


def _began(kind: object, entry: dict[str, Any]) -> bool:
    """`entry` is the first of its run: the input it was queued for (a run not started yet has
    nothing else), or its start (one made for notifications has no input)."""
    if kind == "user_input":
        return entry.get("mode") == "queue"  # (a steered input joins a run begun earlier)
    return kind == "run_start" and entry.get("trigger") != "resume"


def entries_newest_first(client: PodClient) -> Iterator[dict[str, Any]]:
    """Every entry of the pod's session log, newest first, then of the sessions it continues
    (compacted or forked from), each newest first: a reader that stops early reads only the
    end of a long log (0.36 s to page through 41,000 entries)."""
    session: str | None = None
    searched: set[str] = set()
    while True:
        links: list[str] = []
        yield from _session_newest_first(client, session, links)
        session = next((s for s in links if s not in searched), None)
        if session is None:
            return
        searched.add(session)


def _session_newest_first(
    client: PodClient, session_id: str | None, links: list[str]
) -> Iterator[dict[str, Any]]:
    """One session's entries, newest first, read in pages from its end backward: the newest
    BACK_PAGE first, each page further back four times larger (up to HISTORY_PAGE).
    `links` receives the session it continues, if any."""
    extra = {"session_id": session_id} if session_id else {}
    head = client.history(since=0, limit=1, **extra)
    session_id = session_id or getattr(head, "session_id", None)  # the same log throughout
    previous = getattr(head, "previous", None)
    if previous and previous not in links:
        links.append(previous)
    last = getattr(head, "last_seq", None)
    if last is None:  # a pod of an earlier version does not say where its log ends
        entries = [e for page in history_pages(client, 0, session_id, links) for e in page]
        yield from reversed(entries)
        return
    size = BACK_PAGE
    while last > 0:
        since = max(0, last - size)
        pages = history_pages(client, since, session_id, size=last - since)
        window = list(itertools.islice(itertools.chain.from_iterable(pages), last - since))
        yield from reversed(window)
        last, size = since, min(size * 4, HISTORY_PAGE)


def follow(client: PodClient) -> Iterator[Event]:
    """`client.events()`, ended (BrokenPipeError) when our stdout's reader goes, even while the
    pod is quiet: `podctl attach x | head -3` returns once `head` has its lines."""
    while True:
        event = client.next_event(FOLLOW_CHECK)
        if event is None:
            check_stdout()
        else:
            yield event


def history_pages(
    client: PodClient,
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
