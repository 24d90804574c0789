"""The pod's state as a pure fold over its session log.

The pod commits an entry, then applies it here; restoring a session applies the same entries in
the same order. So the live state and the restored state are one code path and cannot drift.

Inputs are committed when acknowledged but enter the model's context later: a queued `run` at its
`run_start`, steer input and notifications at an `inputs_delivered`. Until then they are pending,
which is exactly what must be processed after a crash.
"""

import gc
import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import msgspec

from poddaemon.entries import (
    RESTART_NOTE_ID,
    SPAWNER_KEY,
    Assistant,
    ChildEnded,
    ChildStarted,
    Entry,
    InputsDelivered,
    LlmUsage,
    OutboxAcked,
    OutboxItem,
    PauseRequested,
    RunEnd,
    RunStart,
    SessionStart,
    SystemItem,
    ToolOutput,
    ToolResultEntry,
    TurnEnd,
    UserInput,
    from_log,
)
from poddaemon.history import Item, SystemNote, ToolCall, Usage, UserMessage, item_to_builtins
from poddaemon.scope import Rule, Scope

# How many notifications one model request shows in full; the rest follow in later rounds.
MAX_NOTIFICATIONS_PER_REQUEST = 100
CONTEXT_SOURCE = "hook:UserPromptSubmit"  # where a prompt's hook context is shown as from
# What a long-lived pod keeps of its past, in memory and in each new session's first entry (a
# compaction or fork copies it there): the newest client keys per method (the idempotency
# window; the oldest is forgotten first) and the newest model calls `usage` lists (its totals
# count them all). Unbounded, a pod compacting every few hundred turns rewrote its whole past
# into every new session: disk grew with the square of its age.
KEPT_CLIENT_KEYS = 1000
KEPT_USAGE_CALLS = 500
# The newest ids of child reports a spawner accepted: a child redelivers a report until it is
# acknowledged, which takes moments (or until the spawner is back, when no others arrive), so
# an id is never needed again this many reports later.
KEPT_REPORT_IDS = 10_000
# Children that ended, as their spawner keeps them (`list_pods`, `wait_pods` name them): the
# newest KEPT_ENDED_CHILDREN; what an older one spent is still counted (`ended_spent`).
KEPT_ENDED_CHILDREN = 1000


def input_size(*texts: str) -> int:
    """The bytes an input takes as worker.max_input_bytes counts them: UTF-8 (a lone surrogate,
    which JSON may carry, as the 3 bytes it would take)."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def input_digest(text: str) -> str:
    """What a client key remembers of its input: enough to tell a retry (the same input) from
    a conflict (-32006), without keeping the text."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class PendingRun(msgspec.Struct, frozen=True):
    run_id: str
    text: str
    client_key: str | None = None
    context: str = ""  # a UserPromptSubmit hook's, for this run only
    ts: float = 0.0  # when it was queued


class PendingInput(msgspec.Struct, frozen=True, gc=False):
    """Steer input or a notification, acknowledged but not yet seen by the model.

    One is kept per queued notification: a Struct without GC tracking (its fields are strings
    and numbers, it can hold no cycle), so a long queue adds nothing for the cyclic GC to scan
    and each notify is not a tracked allocation that triggers its collections."""

    id: str
    kind: Literal["steer", "notification"]
    text: str
    source: str = ""
    ts: float = 0.0
    context: bool = False  # a hook's context: delivered with the next request, wakes no run


class ChildRecord(msgspec.Struct):
    """A child this pod spawned, as its log knows it (poddaemon/spawn.py acts on it)."""

    name: str
    socket: str
    grant: int | None = None
    scope: list[dict[str, Any]] = msgspec.field(default_factory=list)
    spent: int = 0  # its tree's spending as last reported (final once it ended)
    # As it said itself: `spent` of a child that ended without a final report is its whole
    # grant, and one restarted then reports again what it really spent (None: not known).
    reported: int | None = None
    earlier: int = 0  # spent by ended children that had this name before it
    live: bool = True
    last_kind: str = ""  # the kind of its last report
    outcome: str | None = None  # of its last reported run
    text: str | None = None

    def come_back(self, socket: str, scope: list[dict[str, Any]]) -> None:
        """It runs again (re-adopted after a restart of either side): live, charged its grant
        again, at what it last said it spent rather than the grant charged when it died."""
        self.socket, self.scope, self.live, self.last_kind = socket, list(scope), True, ""
        if self.reported is not None:
            self.spent = self.reported

    def write_areas(self) -> tuple[Rule, ...]:
        """The areas it was given write access to: delegated to it while it lives."""
        return Scope.from_dicts(self.scope).writable_rules()

    def charged(self) -> int:
        """What the spawner's budget counts for it: the grant is reserved while it lives."""
        if self.live and self.grant is not None:
            return self.earlier + max(self.grant, self.spent)
        return self.earlier + self.spent


class SessionState(msgspec.Struct):
    session_id: str = ""
    history: list[Item] = msgspec.field(default_factory=list)
    pending_runs: dict[str, PendingRun] = msgspec.field(default_factory=dict)
    pending_inputs: dict[str, PendingInput] = msgspec.field(default_factory=dict)
    system_prompt: str = ""
    # client_key -> (input_digest, run id, steered), one namespace per method: a run key never
    # matches a notify. A steer's run id is the run it joined. The newest KEPT_CLIENT_KEYS.
    run_keys: dict[str, tuple[str, str, bool]] = msgspec.field(default_factory=dict)
    notify_keys: dict[str, tuple[str, str, bool]] = msgspec.field(default_factory=dict)
    keyed_runs: dict[str, int] = msgspec.field(default_factory=dict)  # run id -> keys naming it
    usage_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)  # the newest
    call_count: int = 0  # model calls ever made (usage_calls keeps the newest)
    usage: Usage = msgspec.field(default_factory=Usage)
    spent: int = 0  # what the calls count against the budget (LlmUsage.counted)
    run_usage: Usage = msgspec.field(default_factory=Usage)  # of the active (or paused) run
    run_calls: int = 0  # model calls of the active (or paused) run
    # Child reports accepted (dedup): the newest KEPT_REPORT_IDS, oldest first (a dict as an
    # ordered set).
    report_ids: dict[str, None] = msgspec.field(default_factory=dict)
    active_run: str | None = None
    rounds: int = 0  # model rounds of the active (or paused) run
    run_from: int = 0  # index in `history` of the active (or paused) run's first item
    paused_run: str | None = None
    pause_requested: str | None = None  # the active run a `pause` was acknowledged for
    open_calls: list[ToolCall] = msgspec.field(default_factory=list)
    # Open calls whose tool returned, their PostToolUse hooks not yet through: call id -> it.
    tool_outputs: dict[str, ToolOutput] = msgspec.field(default_factory=dict)
    run_outcomes: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)  # keyed runs
    # keyed run id -> the position its `run` was answered (0: started), for a retry of its key
    run_positions: dict[str, int] = msgspec.field(default_factory=dict)
    last_seq: int = 0
    head: str = ""
    # Spawn trees: runs the spawner asked for (reported when they end), reports not yet
    # acknowledged by the spawner, and this pod's own children.
    spawner_runs: set[str] = msgspec.field(default_factory=set)
    # Spawner's runs a restart cut off (reported as interrupted): the run that takes one up
    # after the restart is reported in its place.
    owed_runs: set[str] = msgspec.field(default_factory=set)
    outbox: dict[str, OutboxItem] = msgspec.field(default_factory=dict)
    children: dict[str, ChildRecord] = msgspec.field(default_factory=dict)
    ended_spent: int = 0  # by the ended children no longer kept (KEPT_ENDED_CHILDREN)
    # Kept as counters: `notify` checks max_pending on every request, so this must be O(1).
    pending_notifications: int = 0
    pending_steers: int = 0
    pending_context: int = 0  # of the pending notifications, hook context (wakes no run)
    # Runs in a row a crash or a stop cut off (a run that ends otherwise, or one started for
    # new input, resets it): the pod takes cut-off work up by itself only so many times (see
    # machine.MAX_TAKEN_UP_IN_ROW).
    interrupted_in_row: int = 0
    # Where the run a restart cut off began, while the note that has the next run take it up
    # waits: that run's items are the next run's own, and compaction keeps the cut-off run's
    # input verbatim (SPEC §3). It went into the summary: a crash during the compaction at a
    # run's start left the run taking it up with "continue where you left off" and no task.
    take_up_from: int | None = None
    # History items delivered while no run was active: the next run's own, ahead of its input.
    idle_delivered: int = 0

    def add_pending(self, p: PendingInput) -> None:
        if p.id in self.pending_inputs:
            return
        self.pending_inputs[p.id] = p
        if p.kind == "notification":
            self.pending_notifications += 1
            self.pending_context += p.context
        else:
            self.pending_steers += 1

    def take_pending(self, pid: str) -> PendingInput | None:
        p = self.pending_inputs.pop(pid, None)
        if p is not None:
            if p.kind == "notification":
                self.pending_notifications -= 1
                self.pending_context -= p.context
            else:
                self.pending_steers -= 1
        return p

    def add_run_key(self, key: str, value: tuple[str, str, bool]) -> None:
        """Remember a run key (the oldest beyond KEPT_CLIENT_KEYS is forgotten, with the
        outcome its run kept for a retry that waits)."""
        self.run_keys[key] = value
        self.keyed_runs[value[1]] = self.keyed_runs.get(value[1], 0) + 1
        while len(self.run_keys) > KEPT_CLIENT_KEYS:
            _, run_id, _ = self.run_keys.pop(next(iter(self.run_keys)))
            left = self.keyed_runs.pop(run_id, 1) - 1
            if left:
                self.keyed_runs[run_id] = left
            else:
                self.run_outcomes.pop(run_id, None)
                self.run_positions.pop(run_id, None)

    def forget_ended_children(self) -> None:
        """Keep the newest KEPT_ENDED_CHILDREN ended children (the first spawned go first);
        what the others spent still counts."""
        ended = [name for name, c in self.children.items() if not c.live]
        for name in ended[: max(0, len(ended) - KEPT_ENDED_CHILDREN)]:
            gone = self.children.pop(name)
            self.ended_spent += gone.earlier + gone.spent

    def add_report_id(self, event_id: str) -> None:
        self.report_ids[event_id] = None
        if len(self.report_ids) > KEPT_REPORT_IDS:
            del self.report_ids[next(iter(self.report_ids))]

    def add_notify_key(self, key: str, value: tuple[str, str, bool]) -> None:
        self.notify_keys[key] = value
        if len(self.notify_keys) > KEPT_CLIENT_KEYS:
            del self.notify_keys[next(iter(self.notify_keys))]

    def snapshot(self) -> dict[str, Any]:
        """Everything `session_start` needs to continue from this state (a fork)."""
        return {
            "history": [item_to_builtins(i) for i in self.history],
            "pending_runs": [msgspec.structs.asdict(r) for r in self.pending_runs.values()],
            "pending_inputs": [msgspec.structs.asdict(p) for p in self.pending_inputs.values()],
            "run_key_digests": {k: list(v) for k, v in self.run_keys.items()},
            "notify_key_digests": {k: list(v) for k, v in self.notify_keys.items()},
            "usage": msgspec.to_builtins(self.usage),
            "usage_calls": self.usage_calls,
            "usage_call_count": self.call_count,
            "active_run": self.active_run,
            "rounds": self.rounds,
            "paused_run": self.paused_run,
            "open_calls": [msgspec.to_builtins(c) for c in self.open_calls],
            "run_outcomes": self.run_outcomes,  # what a keyed retry with wait=True may ask
            "run_positions": self.run_positions,  # what a keyed retry without it is answered
        }

    def tree_snapshot(self) -> dict[str, Any]:
        """The spawn-tree state a new session (fork, compaction) must carry on: undelivered
        reports, children, runs still to report, report ids already accepted."""
        return {
            "outbox": [msgspec.to_builtins(o) for o in self.outbox.values()],
            "children": [msgspec.structs.asdict(c) for c in self.children.values()],
            "spawner_runs": sorted(self.spawner_runs),
            "owed_runs": sorted(self.owed_runs),
            "report_ids": list(self.report_ids),
            "ended_spent": self.ended_spent,
        }

    def apply(self, entry: Mapping[str, Any] | Entry) -> None:
        """Fold one entry: a typed one, or a log entry as the store reads it."""
        if not isinstance(entry, Entry):  # a Mapping (a cheaper test than the ABC's)
            self.head = entry.get("hash", self.head)
            typed = from_log(entry if isinstance(entry, dict) else dict(entry))
            if typed is None:  # a kind this version does not know
                self.last_seq = entry["seq"]
                return
            entry = typed
        _apply(self, entry)
        self.last_seq = entry.seq

    def deliverable(
        self, max_bytes: int | None = None, until: float | None = None
    ) -> tuple[list[str], list[Item]]:
        """Ids and rendered items of what the next model request should carry (pure): the
        oldest steers and notifications, at most MAX_NOTIFICATIONS_PER_REQUEST notifications
        and `max_bytes` of their texts (and sources) in all, always the first; the rest wait,
        in order (each kind's: none jumps ahead of one of its kind held back). `until`: only
        those committed before then (their `ts`)."""
        ids: list[str] = []
        notes: list[PendingInput] = []
        items: list[Item] = []
        taken = 0  # bytes of the texts and sources taken
        held: set[str] = set()  # the kinds one of which was held back
        for p in self.pending_inputs.values():
            if until is not None and p.ts >= until:
                break  # (in the order they came; at the same instant: after)
            if p.kind in held or (
                p.kind != "steer" and len(notes) >= MAX_NOTIFICATIONS_PER_REQUEST
            ):
                continue
            if max_bytes is not None:
                # Steers too: each is under the bound, but a burst of them in one request
                # overflowed the context as one huge input did. A source is read as well.
                size = input_size(p.text, p.source)
                if ids and taken + size > max_bytes:
                    held.add(p.kind)
                    continue
                taken += size
            ids.append(p.id)
            if p.kind == "steer":
                items.append(UserMessage(text=p.text))
            else:
                notes.append(p)
        if notes:
            left = self.pending_notifications - len(notes)
            items.append(SystemNote(text=render_notifications(notes, left)))
        return ids, items


def render_notifications(notes: list[PendingInput], more: int) -> str:
    """One clearly marked block for a batch of notifications, each with its source and time."""
    head = "notification" if len(notes) == 1 else f"{len(notes)} notifications"
    lines = [f"<notifications> {head} arrived:"]
    for n in notes:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(n.ts))
        lines.append(f"- [{stamp}] from {n.source}: {n.text}")
    if more:
        lines.append(f"({more} more are queued and follow in the next request)")
    lines.append("</notifications>")
    return "\n".join(lines)


# --- the fold: one case per entry kind -----------------------------------------------------


def _apply(s: SessionState, e: Entry) -> None:
    match e:  # (the kinds are disjoint: the one a notify commits comes first)
        case SystemItem():
            if e.replaces:
                stale = [p.id for p in s.pending_inputs.values() if p.source == e.source]
                for pid in stale:
                    s.take_pending(pid)
            s.add_pending(PendingInput(e.id, "notification", e.text, e.source, e.ts, e.context))
            if e.id.startswith(RESTART_NOTE_ID) and not e.context:  # (held: a new task's)
                s.take_up_from = s.run_from  # the cut-off run's, just ended
            if e.client_key:
                s.add_notify_key(e.client_key, (input_digest(e.text), e.id, e.wakes))
            if e.event_id is not None:
                s.add_report_id(e.event_id)
            child = s.children.get(e.pod) if e.pod is not None else None
            if child is not None:
                _child_report(child, e)
        case SessionStart():
            _session_start(s, e)
        case UserInput(mode="steer"):
            s.add_pending(PendingInput(e.id or "", "steer", e.text, "user", e.ts))
            if e.client_key:
                s.add_run_key(e.client_key, (input_digest(e.text), e.run_id or "", True))
        case UserInput():
            run_id = e.run_id or ""
            if e.client_key and e.client_key.startswith(SPAWNER_KEY):
                s.spawner_runs.add(run_id)
            s.pending_runs[run_id] = PendingRun(run_id, e.text, e.client_key, e.context, e.ts)
            if e.client_key:
                s.add_run_key(e.client_key, (input_digest(e.text), run_id, False))
                if e.position is not None:
                    s.run_positions[run_id] = e.position
        case RunStart(run_id=run_id):
            if run_id != s.paused_run:  # a resumed run keeps its round count and usage
                s.rounds = 0
                s.run_usage = Usage()
                s.run_calls = 0
                start = len(s.history) - s.idle_delivered
                s.run_from = start if s.take_up_from is None else s.take_up_from
            s.take_up_from = None
            s.idle_delivered = 0
            if e.trigger == "input":  # new work was asked for: a loop, if any, starts again
                s.interrupted_in_row = 0
            s.paused_run = None
            s.active_run = run_id
            if e.continues is not None:
                s.owed_runs.discard(e.continues)
                s.spawner_runs.add(run_id)
            run = s.pending_runs.pop(run_id, None)
            if run is not None:
                s.history.append(UserMessage(text=run.text))
                if run.context:
                    hook = PendingInput("", "notification", run.context, CONTEXT_SOURCE, run.ts)
                    s.history.append(SystemNote(text=render_notifications([hook], 0)))
        case InputsDelivered():
            before = len(s.history)
            delivered = [p for p in map(s.take_pending, e.ids) if p is not None]
            for p in delivered:
                if p.kind == "steer":
                    s.history.append(UserMessage(text=p.text))
            notes = [p for p in delivered if p.kind == "notification"]
            if notes:
                s.history.append(SystemNote(text=render_notifications(notes, e.more)))
            if s.active_run is None:  # (the next run's start: see Machine._start_run)
                s.idle_delivered += len(s.history) - before
        case Assistant(item=item):
            s.history.append(item)
            s.open_calls = list(item.tool_calls)
            s.rounds += 1
        case ToolResultEntry(item=item):
            s.history.append(item)
            s.open_calls = [c for c in s.open_calls if c.id != item.call_id]
            s.tool_outputs.pop(item.call_id, None)
        case ToolOutput(item=item):
            s.tool_outputs[item.call_id] = e
        case TurnEnd():
            pass  # a marker for readers of the log (one per round): it changes no state
        case LlmUsage():
            u = e.usage()
            s.usage.add(u)
            s.spent += u.total if e.counted is None else e.counted
            if e.run_id is not None and e.run_id in (s.active_run, s.paused_run):
                s.run_usage.add(u)
                s.run_calls += 1
            s.call_count += 1
            if len(s.usage_calls) >= KEPT_USAGE_CALLS:
                del s.usage_calls[0]
            s.usage_calls.append(
                {
                    "seq": e.seq,
                    "ts": e.ts,
                    "model": e.model,
                    "run_id": e.run_id,
                    "input": u.input,
                    "output": u.output,
                    "cache_read": u.cache_read,
                    "cache_write": u.cache_write,
                }
            )
        case PauseRequested(run_id=run_id, taken_back=taken_back):
            if run_id == s.active_run:
                s.pause_requested = None if taken_back else run_id
        case RunEnd(run_id=run_id):
            if s.pause_requested == run_id:
                s.pause_requested = None
            if e.interrupted and run_id in s.spawner_runs:
                s.owed_runs.add(run_id)
            s.pending_runs.pop(run_id, None)  # a queued run cancelled before it started
            calls = s.run_calls if s.active_run == run_id else 0
            if s.active_run == run_id:
                s.active_run = None
                s.open_calls = []
                s.tool_outputs.clear()
                if e.outcome != "paused":
                    s.interrupted_in_row = s.interrupted_in_row + 1 if e.interrupted else 0
            # A queued run cancelled before it started touches neither the active nor the
            # paused run.
            if e.outcome == "paused":
                s.paused_run = run_id
            elif s.paused_run == run_id:
                s.paused_run = None
            if run_id in s.keyed_runs:  # (waiters of a run are answered as it ends)
                s.run_outcomes[run_id] = {
                    "outcome": e.outcome,
                    "text": e.text,
                    "error": e.error,
                    "usage": msgspec.to_builtins(e.usage) if e.usage is not None else None,
                    "calls": calls,
                }

        case OutboxItem():
            s.outbox[e.event_id] = e
            if e.run_id is not None:
                s.spawner_runs.discard(e.run_id)
        case OutboxAcked():
            for event_id in e.ids:
                s.outbox.pop(event_id, None)
        case ChildStarted():
            old = s.children.get(e.name)
            if old is not None and e.resumed:
                old.come_back(e.socket, e.scope)
            else:
                # A name reused after its child ended: that child's spending stays counted.
                spent = old.spent if old is not None and old.live else 0
                earlier = 0 if old is None else old.earlier + (0 if old.live else old.spent)
                s.children[e.name] = ChildRecord(
                    e.name, e.socket, e.grant, list(e.scope), spent, earlier=earlier
                )
        case ChildEnded():
            child = s.children.get(e.name)
            if child is not None:
                child.live = False
                child.spent = e.spent
                s.forget_ended_children()


def _child_report(child: ChildRecord, e: SystemItem) -> None:
    child.last_kind = e.event_kind or ""
    if e.tree_spent is not None:
        child.spent = max(child.spent, e.tree_spent)
        child.reported = max(child.reported or 0, e.tree_spent)
    # An `errored` with an outcome: the child died in a run we gave it (Machine.child_ended).
    if e.event_kind == "run.finished" or (e.event_kind == "errored" and e.outcome is not None):
        child.outcome = e.outcome
        child.text = e.detail


def _session_start(s: SessionState, e: SessionStart) -> None:
    s.session_id = e.session_id or s.session_id
    s.system_prompt = e.system_prompt
    s.history = list(e.history)
    for r in e.pending_runs:
        s.pending_runs[r.run_id] = PendingRun(r.run_id, r.text, r.client_key, r.context, r.ts)
    for p in e.pending_inputs:
        s.add_pending(PendingInput(p.id, p.kind, p.text, p.source, p.ts, p.context))
    # Before 0.2 keys shared one namespace; such a fork's keys count for both methods. Before
    # 0.4 a key kept its input's text, not its digest.
    s.run_keys, s.notify_keys, s.keyed_runs = {}, {}, {}
    s.run_outcomes = dict(e.run_outcomes)
    for k, (text, input_id) in ((k, v[:2]) for k, v in e.client_keys.items()):
        s.add_run_key(k, (input_digest(text), input_id, False))
        s.add_notify_key(k, (input_digest(text), input_id, False))
    for k, run in e.run_keys.items():
        s.add_run_key(k, (input_digest(run[0]), run[1], run[2:] == ["steer"]))
    for k, note in e.notify_keys.items():
        wakes = len(note) > 2 and note[2] is True
        s.add_notify_key(k, (input_digest(str(note[0])), str(note[1]), wakes))
    for k, (digest, rid, steered) in e.run_key_digests.items():
        s.add_run_key(k, (digest, rid, steered))
    for k, (digest, nid, wakes) in e.notify_key_digests.items():
        s.add_notify_key(k, (digest, nid, wakes))
    s.run_outcomes = {rid: o for rid, o in s.run_outcomes.items() if rid in s.keyed_runs}
    s.run_positions = {rid: p for rid, p in e.run_positions.items() if rid in s.keyed_runs}
    if e.usage is not None:
        s.usage = Usage(**msgspec.structs.asdict(e.usage))
    s.spent = e.spent if e.spent is not None else s.usage.total
    s.usage_calls = list(e.usage_calls[-KEPT_USAGE_CALLS:])
    s.call_count = len(e.usage_calls) if e.usage_call_count is None else e.usage_call_count
    s.active_run = e.active_run
    s.paused_run = e.paused_run
    s.pause_requested = e.pause_requested
    s.rounds = e.rounds
    s.run_from = e.run_from or 0
    s.take_up_from = e.take_up_from  # a fork's (a compaction's history is another: None)
    if e.run_usage is not None:
        s.run_usage = Usage(**msgspec.structs.asdict(e.run_usage))
        s.run_calls = e.run_calls
    s.open_calls = list(e.open_calls)
    s.tool_outputs = {
        o.item.call_id: ToolOutput(run_id=o.run_id, item=o.item, summary=o.summary)
        for o in e.tool_outputs
    }
    s.interrupted_in_row = e.interrupted_in_row
    tree = e.tree
    if tree:
        for o in tree.get("outbox", []):
            item = msgspec.convert(o, OutboxItem)
            s.outbox[item.event_id] = item
        for c in tree.get("children", []):
            s.children[c["name"]] = ChildRecord(**c)
        s.spawner_runs = set(tree.get("spawner_runs", []))
        s.owed_runs = set(tree.get("owed_runs", []))
        s.report_ids = {}
        for event_id in tree.get("report_ids", []):
            s.add_report_id(event_id)
        s.ended_spent = int(tree.get("ended_spent", 0))


def fold(entries: Iterable[Mapping[str, Any] | Entry]) -> SessionState:
    state = SessionState()
    # The fold allocates many small long-lived objects; the cyclic GC would rescan them all
    # again and again (a 100k-entry restore took ~40% longer with it on).
    enabled = gc.isenabled()
    gc.disable()
    try:
        for entry in entries:
            state.apply(entry)
    finally:
        if enabled:
            gc.enable()
    return state
