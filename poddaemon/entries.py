"""Session log entries as types: a msgspec tagged union keyed on `kind`. Pure: no I/O.

The log format (seq, ts, prev, hash around a body) is `store/log.py`'s; this module owns the
bodies. Fields unknown to this version are ignored when reading, so a newer writer's extras do
not break an older reader, and every field added since the first version has a default, so the
sessions of earlier versions decode unchanged (see tests/fixtures/v1_session.jsonl).

`events_of(entry)` is the one place where committed entries become subscriber events.
"""

from typing import Any, Literal

import msgspec

from poddaemon.history import AssistantMessage, Item, ToolCall, ToolResult, Usage


class Entry(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=True):
    # Assigned by the log when written; carried here so the fold can read them back.
    seq: int = 0
    ts: float = 0.0

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)


class PendingRunSnap(msgspec.Struct, kw_only=True, omit_defaults=True):
    run_id: str
    text: str
    client_key: str | None = None
    context: str = ""
    ts: float = 0.0


class PendingInputSnap(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    kind: Literal["steer", "notification"]
    text: str
    source: str = ""
    ts: float = 0.0
    context: bool = False


class ToolOutputSnap(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An open call's `tool_output` (its tool returned, its PostToolUse hooks not through)."""

    run_id: str
    item: ToolResult
    summary: str = ""


class SessionStart(Entry, tag="session_start"):
    session_id: str = ""
    pod: str = ""
    system_prompt: str = ""
    config: dict[str, Any] = {}
    history: list[Item] = []
    forked_from: str | None = None
    compacted_from: str | None = None
    # The rest continues a forked session from the state it was forked in.
    pending_runs: list[PendingRunSnap] = []
    pending_inputs: list[PendingInputSnap] = []
    client_keys: dict[str, list[str]] = {}  # before keys were per method: one namespace
    run_keys: dict[str, list[str]] = {}  # before 0.4: [input, run id] or [..., "steer"]
    notify_keys: dict[str, list[str | bool]] = {}  # before 0.4: [text, id, wakes]
    run_key_digests: dict[str, tuple[str, str, bool]] = {}  # [input digest, run id, steered]
    run_positions: dict[str, int] = {}  # keyed run id -> the position it was answered
    notify_key_digests: dict[str, tuple[str, str, bool]] = {}  # [text digest, id, wakes]
    usage: Usage | None = None
    usage_calls: list[dict[str, Any]] = []  # the newest (session.KEPT_USAGE_CALLS)
    usage_call_count: int | None = None  # all of them (before 0.4: len(usage_calls))
    spent: int | None = None  # counted against the budget so far (None: usage's input + output)
    active_run: str | None = None
    rounds: int = 0
    paused_run: str | None = None
    pause_requested: str | None = None  # the active run a `pause` was acknowledged for
    open_calls: list[ToolCall] = []
    # Of the open calls, those whose tool had returned: a crash after the fork restores what
    # they did, not "interrupted" (see ToolOutput).
    tool_outputs: list[ToolOutputSnap] = []
    run_outcomes: dict[str, dict[str, Any]] = {}
    run_from: int | None = None  # index in `history` where the active run's items begin
    run_usage: Usage | None = None  # the active (or paused) run's usage and calls so far
    run_calls: int = 0
    # Spawn trees: {outbox, children, spawner_runs, owed_runs, report_ids, ended_spent}
    # (SessionState.tree_snapshot).
    tree: dict[str, Any] = {}
    # Runs in a row a crash or a stop cut off (SessionState.interrupted_in_row): a fork (an
    # instruction rendering `now` forks at every start) must not start the count again.
    interrupted_in_row: int = 0
    # Where a run a restart cut off began, its note waiting (SessionState.take_up_from): kept by
    # a fork, whose history is the same.
    take_up_from: int | None = None


class UserInput(Entry, tag="user_input"):
    """A `run` input: queued (starts a run of its own) or steered into the active run."""

    text: str
    mode: Literal["queue", "steer"]
    run_id: str | None = None
    id: str | None = None  # steer inputs: the pending input's id
    client_key: str | None = None
    context: str = ""  # queued: what UserPromptSubmit hooks added, shown when its run starts
    # queued, keyed: the answer's position (0: `started`), for a retry of the key (None in
    # logs from before it was kept: such a retry is told where the run stands now)
    position: int | None = None


class SystemItem(Entry, tag="system_item"):
    """A notification (or child report) waiting for the model's next request."""

    id: str
    text: str
    source: str
    client_key: str | None = None
    wakes: bool = False  # a `notify` that woke the idle pod: a retry of it answers the same
    # Child reports (`pod_event`): what the spawner's subscribers see as `child.event`.
    pod: str | None = None
    event_kind: str | None = None
    event_id: str | None = None
    run_id: str | None = None
    detail: str | None = None  # the report's own text (`text` is what the model reads)
    context: bool = False  # a hook's context: read at the next request, wakes no one
    outcome: str | None = None  # a child's run.finished: the run's outcome
    tree_spent: int | None = None  # tokens the child's tree had spent when it reported
    # Drops what its source said before that no request has read yet (a SessionStart hook's
    # output at an earlier start: a pod restarted while idle stacked one per start).
    replaces: bool = False


# --- spawn trees: the child's outbox and the spawner's children (see poddaemon/spawn.py) ------

# A `run` whose client_key starts with this was sent by the spawner: its end is reported.
SPAWNER_KEY = "spawner:"
# The id of the note that tells the model its run was cut off by a restart: this, the run's id.
RESTART_NOTE_ID = "restart-"


class OutboxItem(Entry, tag="outbox"):
    """A report to the spawner, committed before it is delivered (redelivered until acked)."""

    event_id: str
    event_kind: str  # "run.finished" | "errored" | "shutdown"
    run_id: str | None = None
    text: str | None = None
    outcome: str | None = None
    usage: dict[str, int] = {}


class OutboxAcked(Entry, tag="outbox_acked"):
    """Reports not to deliver again: the spawner acknowledged them, or (at a restore) they
    said this pod stopped, which its new life makes untrue."""

    ids: list[str]


class ChildStarted(Entry, tag="child_started"):
    """The spawner started (or re-adopted) a child; `grant` is reserved from its budget.
    `resumed`: the same child again (restarted, re-adopted), its reports counting its spending
    from its first start; otherwise a new child, which may reuse an ended child's name."""

    name: str
    socket: str
    grant: int | None = None
    scope: list[dict[str, Any]] = []
    resumed: bool = False


class ChildEnded(Entry, tag="child_ended"):
    """A child's process is gone; `spent` is what its tree is charged with for good."""

    name: str
    spent: int = 0
    reason: str = ""


class RunStart(Entry, tag="run_start"):
    run_id: str
    trigger: str  # "input" | "notifications" | "resume" | "steer" (left over by its run)
    # The spawner's run a restart cut off, which this one takes up: its end is reported.
    continues: str | None = None


class InputsDelivered(Entry, tag="inputs_delivered"):
    ids: list[str]
    more: int


class Assistant(Entry, tag="assistant"):
    run_id: str
    item: AssistantMessage


class ToolResultEntry(Entry, tag="tool_result"):
    run_id: str
    item: ToolResult
    summary: str = ""


class ToolOutput(Entry, tag="tool_output"):
    """A tool's own result, written as it returns, before its PostToolUse hooks run: a crash
    while they run restores this (what the tool did), not "interrupted". Its `tool_result`
    (with what the hooks added) follows when they end."""

    run_id: str
    item: ToolResult
    summary: str = ""


class TurnEnd(Entry, tag="turn_end"):
    run_id: str
    round: int


class LlmUsage(Entry, tag="llm_usage"):
    run_id: str | None
    model: str
    input: int
    output: int
    cache_read: int
    cache_write: int
    # What the call counts against the budget: every token of its request, cached or not,
    # and its output. None (older logs): input + output.
    counted: int | None = None

    def usage(self) -> Usage:
        return Usage(
            input=self.input,
            output=self.output,
            cache_read=self.cache_read,
            cache_write=self.cache_write,
        )


class RunEnd(Entry, tag="run_end"):
    run_id: str
    outcome: str
    text: str
    error: str | None = None
    interrupted: bool = False
    usage: Usage | None = None  # this run's own usage (absent in sessions of before 0.2)


class PauseRequested(Entry, tag="pause_requested"):
    """A `pause` acknowledged for the active run, before it reached its safe point: a restore
    ends that run `paused` (and starts nothing), not interrupted and taken up again. With
    `taken_back`, a `resume` acknowledged before that point: the run goes on after all."""

    run_id: str
    taken_back: bool = False


class HookRunEntry(Entry, tag="hook_run"):
    """A command hook ran (SPEC §10): what policy decided, for a restore or an audit."""

    event: str
    command: str
    exit: int | None  # None: killed at its timeout, or it could not start
    duration: float
    decision: str  # ok | block | allow | warning | stop
    reason: str = ""


AnyEntry = (
    SessionStart
    | UserInput
    | SystemItem
    | RunStart
    | InputsDelivered
    | Assistant
    | ToolResultEntry
    | ToolOutput
    | TurnEnd
    | LlmUsage
    | RunEnd
    | OutboxItem
    | OutboxAcked
    | ChildStarted
    | ChildEnded
    | PauseRequested
    | HookRunEntry
)

BY_KIND: dict[str, type[Entry]] = {
    t.__struct_config__.tag: t  # type: ignore[misc]
    for t in (
        SessionStart,
        UserInput,
        SystemItem,
        RunStart,
        InputsDelivered,
        Assistant,
        ToolResultEntry,
        ToolOutput,
        TurnEnd,
        LlmUsage,
        RunEnd,
        OutboxItem,
        OutboxAcked,
        ChildStarted,
        ChildEnded,
        PauseRequested,
        HookRunEntry,
    )
}


def from_log(obj: dict[str, Any]) -> Entry | None:
    """A log entry (as the store reads it) as its type; None for a kind this version does not
    know (skipped by the fold, as before). Converting to the concrete type is much cheaper than
    to the union, whose type info msgspec would rebuild on every call."""
    target = BY_KIND.get(obj.get("kind", ""))
    if target is None:
        return None
    return msgspec.convert(obj, target)


def body_of(entry: Entry) -> dict[str, Any]:
    """What the log writes for `entry` besides its own seq/ts/kind/prev/hash."""
    body: dict[str, Any] = msgspec.to_builtins(entry)
    for key in ("kind", "seq", "ts"):
        body.pop(key, None)
    _spelled_out(entry, body)
    return body


def record_of(entry: Entry) -> dict[str, Any]:
    """What the log writes for `entry` with its kind and ts (PodLog.write; seq is the log's)."""
    record: dict[str, Any] = msgspec.to_builtins(entry)
    record["ts"] = entry.ts  # kept even when 0.0 (a default, omitted above)
    if type(entry) is RunEnd:
        _spelled_out(entry, record)
    return record


def _spelled_out(entry: Entry, body: dict[str, Any]) -> None:
    """SPEC §8 names these fields of their kinds: they are written even when empty, null or
    false (omit_defaults left them out: a fresh session's first entry had no history and no
    links, and a run_end no `interrupted`, for a reader of the format to find)."""
    if type(entry) is SessionStart:
        body.setdefault("history", [])
        body.setdefault("forked_from", None)
        body.setdefault("compacted_from", None)
    elif type(entry) is RunEnd:
        body.setdefault("interrupted", False)


# --- events: the projection of committed entries --------------------------------------------

EventSpec = tuple[str, dict[str, Any], str | None]


def events_of(entry: Entry) -> list[EventSpec]:
    """The subscriber events a committed entry stands for (type, data, run_id)."""
    data: dict[str, Any]
    match entry:
        case SystemItem():
            data = {"notification_id": entry.id, "source": entry.source, "message": entry.text}
            events: list[EventSpec] = [("notification.committed", data, None)]
            if entry.pod is not None:  # a child's report is also a child event
                report = {"pod": entry.pod, "kind": entry.event_kind, "text": entry.detail}
                if entry.outcome is not None:
                    report["outcome"] = entry.outcome
                events.append(("child.event", report, entry.run_id))
            return events
        case RunStart():
            return [("run.started", {"trigger": entry.trigger}, entry.run_id)]
        case ToolResultEntry(item=item):
            summary = entry.summary or item.output.split("\n", 1)[0][:200]
            data = {
                "call_id": item.call_id,
                "name": item.name,
                "is_error": item.is_error,
                "summary": summary,
            }
            return [("tool.finished", data, entry.run_id)]
        case LlmUsage():
            data = {
                "input": entry.input,
                "output": entry.output,
                "cache_read": entry.cache_read,
                "cache_write": entry.cache_write,
            }
            return [("llm.usage", data, entry.run_id)]
        case RunEnd():
            data = {"outcome": entry.outcome, "text": entry.text}
            if entry.error is not None:
                data["error"] = entry.error
            data["usage"] = msgspec.to_builtins(entry.usage or Usage())
            return [("run.finished", data, entry.run_id)]
    return []
