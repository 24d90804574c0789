"""The pod's decisions as one pure machine, in the manner of h11.

Commands go in (a `run`, a notification, a model or tool result, a timer tick, …); effects come
out (commit an entry, reply once durable, publish, call the model, run a tool, set a timer). The
machine does no I/O and never awaits; the clock and fresh ids are the caller's functions. It
owns the folded `SessionState`, the active run (a `Turn`), the queue, pause/cancel/steer,
notification bursts, budget and shutdown, so every rule of the pod lives here and can be driven
by a test with no sockets, files or model.

Entries are applied to the state as they are emitted (they get their `seq` and `ts` here), so
the next decision already sees them; the executor writes them in the same order. Replies marked
`durable` must not reach the client before the log is fsync'd past every entry emitted before
them.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import msgspec

from poddaemon import compaction
from poddaemon.entries import (
    RESTART_NOTE_ID,
    ChildEnded,
    ChildStarted,
    Entry,
    HookRunEntry,
    InputsDelivered,
    LlmUsage,
    OutboxAcked,
    OutboxItem,
    PauseRequested,
    PendingInputSnap,
    PendingRunSnap,
    RunEnd,
    RunStart,
    SessionStart,
    SystemItem,
    ToolOutput,
    ToolOutputSnap,
    UserInput,
    from_log,
)
from poddaemon.history import AssistantMessage, Item, ToolCall, ToolResult, Usage
from poddaemon.llm.types import ModelResponse, ProviderError
from poddaemon.session import (
    CONTEXT_SOURCE,
    SessionState,
    fold,
    input_digest,
)
from poddaemon.tools.base import args_preview
from poddaemon.turn import CallModel as _CallStep
from poddaemon.turn import CheckStop, Finished, Outcome, Turn, interrupted_results
from protocol import errors
from protocol.errors import RpcError
from protocol.types import (
    AcceptedResult,
    CancelResult,
    CompactResult,
    NotifyResult,
    OkResult,
    PauseResult,
    ResumeResult,
    RunResult,
    RunWaitResult,
    UsageTotals,
)

# A burst of notifications to an idle pod is handled in one turn: the turn starts once no new
# notification has arrived for NOTIFY_QUIET seconds (but never later than NOTIFY_MAX_DELAY).
NOTIFY_QUIET = 0.05
NOTIFY_MAX_DELAY = 1.0
MAX_EARLY_HOOK_RUNS = 100  # hook runs held for the first session (prompts refused before it)
RESTART_NOTE = (
    "The pod restarted while your previous run was in progress; it was interrupted. "
    "Check the state of your work and continue where you left off."
)


def _counted_tokens(u: Usage, provider_kind: str) -> int:
    """What a call counts against the budget: its whole request and its output. Anthropic's
    `input` leaves out the cached tokens: counted as input + output, a pod whose calls hit the
    cache spent 300,000 tokens and counted 6 of them against its cap."""
    return compaction.context_tokens(u, provider_kind) + u.output


# Runs in a row a crash or a stop cut off that the pod takes up by itself. Past it the note
# waits for the next input: a run that crashes the pod every time (a command that takes all the
# memory, say) would otherwise spend tokens in a loop under `Restart=on-failure`, and what a
# model call cut off by a crash spent is never counted against the budget.
MAX_TAKEN_UP_IN_ROW = 3
# The note past MAX_TAKEN_UP_IN_ROW, read with the next input: told only to "continue where you
# left off", the model went back to the work that had stopped the pod each time.
HELD_RESTART_NOTE = (
    "The pod restarted while your previous run was in progress; it was interrupted. "
    "{in_row} runs in a row were cut off by a crash or a stop, so the pod did not take the "
    "work up again by itself: what that work did may be what stops the pod (a command that "
    "takes all the memory, say). Check the state of your work before doing any of it again."
)


def _restart_note(run_id: str, in_row: int) -> SystemItem:
    """Tells the model its run `run_id` was cut off (a restart, the `in_row`th cut off in a
    row): the next run takes it up, started by this note unless too many were cut off."""
    held = in_row > MAX_TAKEN_UP_IN_ROW
    return SystemItem(
        id=f"{RESTART_NOTE_ID}{run_id}",
        text=HELD_RESTART_NOTE.format(in_row=in_row) if held else RESTART_NOTE,
        source="poddaemon",
        context=held,
    )


# What the model reads at its next request after a `cancel` cut its run short, as Claude Code and
# Codex mark an interrupted turn: without it the model takes a cut reply for a finished one.
CANCEL_NOTE = (
    "The run before this one was cancelled before it finished: its last reply may be cut "
    "short, and what it had not done yet was not done."
)

# The same after a run that ended in an error with a reply kept (cut off mid-stream, say: the
# provider dropped the connection), which the model took for a finished answer (found by QA).
ERROR_NOTE = (
    "The run before this one ended with an error before it finished ({error}): its last reply "
    "may be cut short, and what it had not done yet was not done."
)
ERROR_NOTE_WIDTH = 300  # characters of the error the note quotes

# What the model reads in a pod started from a copy of a session whose work is another's.
COPY_NOTE = (
    "This conversation continues from a copy of another session. What was still under way "
    "there ({ended} run(s) in progress, {dropped} queued input(s)) was not taken up here."
)

STOP_HOOK_SOURCE = "hook:Stop"  # the source of the reason a blocking Stop hook gave

# The reports a child made as it stopped (`final_report`; `errored` in older logs): stale
# once it starts again.
FINAL_REPORTS = ("shutdown", "errored")

PodState = Literal["idle", "running", "paused", "stopping"]


# --- effects ------------------------------------------------------------------------------------


class OpenSession(msgspec.Struct, frozen=True):
    """Create a new session log whose first entry is `start` (a fresh session or a fork)."""

    start: SessionStart


# Commit and Reply come once or more per request: Structs build in C (~55 ns), a NamedTuple
# in its generated Python __new__ (160 ns; 385 ns with keywords).
class Commit(msgspec.Struct, frozen=True):
    """Append `entry` to the log (not yet fsync'd); publish the events it stands for."""

    entry: Entry


class Reply(msgspec.Struct, frozen=True):
    token: int
    result: Any = None
    error: RpcError | None = None
    durable: bool = False  # send only once everything committed before it is fsync'd


class Publish(msgspec.Struct, frozen=True):
    """An event that is not an entry (state changes, tool starts, queue positions)."""

    type: str
    data: dict[str, Any]
    run_id: str | None = None


class CallModel(msgspec.Struct, frozen=True):
    run_id: str
    system: str
    items: list[Item]


class RunTool(msgspec.Struct, frozen=True):
    run_id: str
    call: ToolCall


class RunStopHooks(msgspec.Struct, frozen=True):
    """The run's final answer is in: run the Stop hooks and feed back `stop_checked`."""

    run_id: str
    stop_hook_active: bool  # the run goes on already because a Stop hook blocked its end
    last_round: bool = False  # max_turns is spent: a block ends the run `limit_reached`


class Interrupt(msgspec.Struct, frozen=True):
    """Cancel the model call or tool in flight; its result comes back as cancelled."""


class SetTimer(msgspec.Struct, frozen=True):
    at: float  # call `tick()` at this clock time


class Sync(msgspec.Struct, frozen=True):
    """Make everything committed so far durable (no one waits for it)."""


class Stopped(msgspec.Struct, frozen=True):
    """Nothing is left to do: persist and exit."""


class Summarize(msgspec.Struct, frozen=True):
    """Compaction: ask the compaction model to summarize `items`; feed the text back with
    `compaction_returned` (or `compaction_failed`)."""

    run_id: str | None
    reason: str  # "auto" (the threshold) | "manual" (`compact`), as Claude Code's PreCompact
    system: str
    items: list[Item]


class SwitchSession(msgspec.Struct, frozen=True):
    """Compaction: write the session `start` opens completely (durable) before anything else
    is appended, then continue in it; the old log stays as it is."""

    start: SessionStart


Effect = (
    OpenSession
    | Summarize
    | SwitchSession
    | Commit
    | Reply
    | Publish
    | CallModel
    | RunTool
    | RunStopHooks
    | Interrupt
    | SetTimer
    | Sync
    | Stopped
)


class MachineConfig(msgspec.Struct, frozen=True):
    name: str
    model: str
    max_turns: int
    max_pending: int = 1000
    max_queued_runs: int = 1000
    max_input_bytes: int = 262144  # of notifications per model request (at least one)
    budget_cap: int | None = None
    config: dict[str, Any] = msgspec.field(
        default_factory=dict
    )  # the resolved manifest, for the log
    compact_threshold: int | None = None  # None: never compact automatically
    compact_retained_turns: int = 2
    provider_kind: str = ""
    compaction_model: str = ""
    compaction_kind: str = ""  # its provider's kind ("": the pod's own)
    reports: bool = False  # started by a spawner: commit reports for it (spawn trees, §9)
    stop_hooks: bool = False  # Stop hooks may block a run's end: ask them first (RunStopHooks)


class _Compaction(msgspec.Struct):
    """A compaction in flight."""

    reason: str
    run_id: str | None
    token: int | None  # of a manual `compact`, answered when it ends
    before_tokens: int
    estimate_before: int
    cancelled: bool = False  # a manual one a `cancel` interrupted


class Machine:
    def __init__(
        self,
        cfg: MachineConfig,
        clock: Callable[[], float],
        new_id: Callable[[], str],
        system_prompt: str = "",
        first_session_id: Callable[[], str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.new_id = new_id
        # The id of a session started by an input (not a fork's or a compaction's): the pod's
        # log may have made its file ahead (PodLog.reserve).
        self.first_session_id = first_session_id or new_id
        self.system_prompt = system_prompt
        # What this start rendered; a restored session keeps its own until `take_rendered_prompt`.
        self.rendered_prompt = system_prompt
        self.state = SessionState()
        self.turn: Turn | None = None
        self.stopping = False
        self.stop_reason = "requested"  # the `shutdown` event's reason (see `shutdown`)
        self.stopped = False
        self.held = False  # start-up not done: no run starts (see `hold`)
        self.in_flight: Literal["model", "tool", "compact", "stop"] | None = None
        # The model call in flight only waits to retry (nothing streamed): a pause may end it.
        self._model_retrying = False
        self._resume_requested = False
        self._pause_withdrawn_call: str | None = None  # a run whose call a pause interrupted
        self._waiters: dict[str, list[int]] = {}  # run_id -> tokens of `run {wait}`
        # run_id -> tokens of `cancel`s of that active run: answered once its end is committed,
        # so a crash after `{cancelled: true}` cannot restore it as interrupted and resume it.
        self._cancels: dict[str, list[int]] = {}
        self._burst_start: float | None = None
        self._last_notify = 0.0
        self._timer_at: float | None = None
        self._notes_overflow = False  # the last request could not show every notification
        self._out: list[Effect] = []
        # The state subscribers were last told of (`state.changed`), and whether the end of a
        # run or a manual compaction may have changed it: told at the end of the command, once
        # the next run had its chance to start, so queued work is `running` throughout.
        self._announced: PodState = "idle"
        self._announce_due = False
        # Compaction (see the section below).
        self._compacting: _Compaction | None = None
        self._last_input: int | None = None  # context size of the last call; None: estimate
        self._compact_failures = 0  # in a row
        self._auto_compact_off = False  # the breaker tripped
        self._usage_estimated = False  # a call reported no usage: said once (an alert)
        self._no_compact_run: str | None = None  # the thrash guard holds for this run
        self._cancelled_run: str | None = None  # a run `cancel` asked to end: not picked up
        self._early_hook_runs: list[HookRunEntry] = []  # before the first session (hook_ran)
        # The report committed when the pod stops: "shutdown", or None (its spawner is gone and
        # it stops with it: it reports to nobody). A pod whose log failed reports nothing more:
        # its spawner reports it `errored` when it sees it die.
        self.final_report: str | None = "shutdown"

    # --- queries --------------------------------------------------------------------------------

    @property
    def pod_state(self) -> PodState:
        if self.stopping:
            return "stopping"
        if self.state.active_run is not None or self._compacting is not None:
            return "running"  # (a manual compaction works without a run)
        if self.state.paused_run is not None:
            return "paused"
        return "idle"

    def tree_spent(self) -> int:
        """Tokens this pod and its descendants spent, as far as their reports tell."""
        s = self.state
        return s.spent + s.ended_spent + sum(c.earlier + c.spent for c in s.children.values())

    def budget_charged(self) -> int:
        """What counts against the cap: own spending, children's grants while they live (so
        the tree cannot overspend), their actual spending once they are gone."""
        s = self.state
        return s.spent + s.ended_spent + sum(c.charged() for c in s.children.values())

    def budget_remaining(self) -> int | None:
        cap = self.cfg.budget_cap
        return None if cap is None else max(0, cap - self.budget_charged())

    def budget_exhausted(self) -> bool:
        cap = self.cfg.budget_cap
        return cap is not None and self.budget_charged() >= cap

    def budget_message(self) -> str:
        return (
            f"budget exhausted: {self.budget_charged()} tokens used or granted to children of "
            f"budget.max_total_tokens = {self.cfg.budget_cap}"
        )

    # --- commands from clients ------------------------------------------------------------------

    def run(
        self,
        token: int,
        text: str,
        mode: str = "queue",
        client_key: str | None = None,
        wait: bool = False,
        context: str = "",
    ) -> list[Effect]:
        """`context`: what UserPromptSubmit hooks added, committed only with the input (not for
        a replayed key, a conflict or a refusal): in its user_input entry, shown when its run
        starts; for a steer, as a context item for the active run's next request."""
        return self._handle(lambda: self._run(token, text, mode, client_key, wait, context))

    def notify(
        self, token: int, message: str, source: str = "", client_key: str | None = None
    ) -> list[Effect]:
        return self._handle(self._notify, token, message, source, client_key)

    def child_report(
        self,
        token: int,
        pod: str,
        kind: str,
        event_id: str,
        run_id: str | None = None,
        text: str | None = None,
        outcome: str | None = None,
        tree_spent: int | None = None,
    ) -> list[Effect]:
        def go() -> None:
            if self._refuse_if_stopping(token):
                return
            if event_id in self.state.report_ids:  # redelivered: accepted once
                self._reply(token, AcceptedResult(), durable=True)
                return
            if self._queue_full(token):
                return
            self._accept_report(pod, kind, event_id, run_id, text, outcome, tree_spent)
            self._reply(token, AcceptedResult(), durable=True)

        return self._handle(go)

    def child_left_reports(self, pod: str, reports: Sequence[OutboxItem]) -> list[Effect]:
        """Reports a gone child committed but never delivered, read from its log: accepted
        like delivered ones (once each), so its end is known from them (see child_ended)."""

        def go() -> None:
            for o in reports:
                if o.event_id not in self.state.report_ids:
                    tree_spent = o.usage.get("tree_spent")
                    self._accept_report(
                        pod, o.event_kind, o.event_id, o.run_id, o.text, o.outcome, tree_spent
                    )

        return self._handle(go)

    def _accept_report(
        self,
        pod: str,
        kind: str,
        event_id: str,
        run_id: str | None,
        text: str | None,
        outcome: str | None,
        tree_spent: int | None,
    ) -> None:
        head = f"{kind} {outcome}" if outcome else kind
        shown = _within(text, self.cfg.max_input_bytes) if text else text
        body = f"[{head}] {shown}" if shown else f"[{head}]"
        self._note_arrived()
        self._commit(
            SystemItem(
                id=self.new_id(),
                text=body,
                source=f"pod:{pod}",
                pod=pod,
                event_kind=kind,
                event_id=event_id,
                run_id=run_id,
                detail=text,
                outcome=outcome,
                tree_spent=tree_spent,
            )
        )

    # --- spawn trees: the outbox (child side) and the children (spawner side) -------------------

    def outbox_acked(self, ids: list[str]) -> list[Effect]:
        """The spawner acknowledged these reports: they are not redelivered."""

        def go() -> None:
            known = [i for i in ids if i in self.state.outbox]
            if known:
                self._commit(OutboxAcked(ids=known))
                self._emit(Sync())

        return self._handle(go)

    def child_started(
        self,
        name: str,
        socket: str,
        grant: int | None,
        scope: list[dict[str, Any]],
        resumed: bool = False,
    ) -> list[Effect]:
        def go() -> None:
            self._commit(
                ChildStarted(name=name, socket=socket, grant=grant, scope=scope, resumed=resumed)
            )
            self._emit(Sync())

        return self._handle(go)

    def child_ended(
        self, name: str, reason: str, told: bool = False, mid_run: bool = False
    ) -> list[Effect]:
        """A child's process is gone. Without a final report its grant stays charged (it may
        have spent it); one that died without reporting is reported `errored` here, unless
        `told`: the model knows already (its spawn_pod failed, or stop_pod stopped it).
        `mid_run`: a run we gave it had not reported: that run, its last, ended in `error`
        (wait_pods showed the run before it, `finished`, as its last)."""

        def go() -> None:
            child = self.state.children.get(name)
            if child is None or not child.live:
                return
            final = child.last_kind in FINAL_REPORTS
            spent = child.spent if final or child.grant is None else max(child.grant, child.spent)
            if not final and not self.stopping and not told:
                event_id = f"died-{name}-{self.new_id()}"
                self._note_arrived()
                self._commit(
                    SystemItem(
                        id=self.new_id(),
                        text=f"[errored] {reason}",
                        source=f"pod:{name}",
                        pod=name,
                        event_kind="errored",
                        event_id=event_id,
                        detail=reason,
                        outcome="error" if mid_run else None,
                    )
                )
            why = f"it stopped ({child.last_kind} reported)" if final else reason
            self._commit(ChildEnded(name=name, spent=spent, reason=why))
            self._emit(Sync())

        return self._handle(go)

    def _report(self, kind: str, tree_spent: int | None = None, **fields: Any) -> None:
        """Commit a report for the spawner to this pod's outbox (delivered by the executor)."""
        usage = dict(fields.pop("usage", {}))
        usage["tree_spent"] = self.tree_spent() if tree_spent is None else tree_spent
        self._commit(OutboxItem(event_id=self.new_id(), event_kind=kind, usage=usage, **fields))

    def pause(self, token: int) -> list[Effect]:
        def go() -> None:
            turn = self.turn
            if turn is None or turn.done:
                # A run paused already stays so: a second `pause` said "nothing to pause" of
                # a pod that is paused, as of one that had finished (the answer a pause still
                # on its way to the safe point gets is true).
                paused = self.state.paused_run is not None and self.state.active_run is None
                self._reply(token, PauseResult(paused=paused))
            else:  # even a final answer in flight ends the run `paused` (see _start_run)
                turn.request_pause()
                self._resume_requested = False  # a resume before this pause is taken back
                if self.state.pause_requested != turn.run_id:  # kept, so a crash keeps it
                    self._commit(PauseRequested(run_id=turn.run_id))
                self._reply(token, PauseResult(paused=True), durable=True)
                self._pause_retrying_call()

        return self._handle(go)

    def resume(self, token: int) -> list[Effect]:
        def go() -> None:
            if self._refuse_if_stopping(token):
                return
            run_id = self.state.paused_run
            turn = self.turn
            if run_id is None and turn is not None and not turn.done and turn.pause_requested:
                # A pause asked for and not reached yet: the run still pauses at its safe
                # point (it may have been interrupted there already) and goes on at once. Told
                # "not paused", a client that paused and resumed left the pod paused for good.
                if self._pause_withdrawn_call == turn.run_id:
                    self._resume_requested = True  # its call is withdrawn: it ends paused
                else:  # nothing done for the pause yet: the run goes on, never reported paused
                    turn.withdraw_pause()
                if self.state.pause_requested == turn.run_id:  # a crash now must not pause it
                    self._commit(PauseRequested(run_id=turn.run_id, taken_back=True))
                self._reply(token, ResumeResult(run_id=turn.run_id), durable=True)
                return
            if run_id is None or self.state.active_run is not None:
                self._error(token, errors.NOT_PAUSED, "the pod is not paused")
                return
            self._resume_requested = True
            self._reply(token, ResumeResult(run_id=run_id))

        return self._handle(go)

    def cancel(self, token: int, run_id: str | None = None) -> list[Effect]:
        def go() -> None:
            active, paused = self.state.active_run, self.state.paused_run
            if active is None and paused is not None and run_id in (None, paused):
                self._finish_run(paused, Finished("cancelled", ""))  # its final report
                # Sent once its end is fsync'd: a power cut after `{cancelled: true}` must not
                # bring the run back paused (or queued, below), to be resumed or started.
                self._reply(token, CancelResult(cancelled=True), durable=True)
                return
            compacting = self._compacting
            if run_id is None and self.turn is None and compacting is not None:
                # A manual compaction (no run): what keeps the pod "running" is what stops.
                compacting.cancelled = True
                self._emit(Interrupt())
                self._reply(token, CancelResult(cancelled=True))
                return
            if run_id is not None and run_id != active:
                queued = run_id in self.state.pending_runs
                if queued:
                    self._finish_run(run_id, Finished("cancelled", ""), started=False)
                self._reply(token, CancelResult(cancelled=queued), durable=queued)
                return
            if self.turn is None or self.turn.done:
                self._reply(token, CancelResult(cancelled=False))
                return
            self.turn.request_cancel()
            self._cancelled_run = self.turn.run_id
            self._cancels.setdefault(self.turn.run_id, []).append(token)
            if self.in_flight is not None:
                self._emit(Interrupt())

        return self._handle(go)

    def shutdown(self, token: int | None = None, reason: str = "requested") -> list[Effect]:
        """Stop: `reason` is "requested" (a client, a signal), "failed" (the pod cannot go on)
        or "parent exited" (a child that stops with its spawner); the first one counts."""

        def go() -> None:
            if token is not None:
                self._reply(token, OkResult())
            if self.stopping:
                return
            self.stopping = True
            self.stop_reason = reason
            self._announce()
            if self._compacting is not None and self.turn is None:
                self._emit(Interrupt())  # a manual compaction: the old session stays
            if self.turn is not None and not self.turn.done:
                self.turn.request_cancel()
                if self.in_flight is not None:
                    self._emit(Interrupt())

        return self._handle(go)

    def tick(self) -> list[Effect]:
        self._timer_at = None
        return self._handle(lambda: None)

    def add_context(self, text: str, source: str, replaces: bool = False) -> list[Effect]:
        """Context a hook added (SessionStart, UserPromptSubmit): committed like a notification,
        so the model reads it at its next request, but it wakes no run by itself. `replaces`:
        what `source` added before and no request has read yet is dropped (SystemItem)."""
        item = SystemItem(
            id=self.new_id(), text=text, source=source, context=True, replaces=replaces
        )
        return self._handle(lambda: self._commit(item))

    def hook_ran(
        self,
        event: str,
        command: str,
        exit: int | None,
        duration: float,
        decision: str,
        reason: str,
    ) -> list[Effect]:
        entry = HookRunEntry(
            event=event,
            command=command,
            exit=exit,
            duration=round(duration, 6),
            decision=decision,
            reason=reason,
        )

        # Recorded in the session the pod already has; a hook before any input opens none: it
        # is held, and recorded first when the first input opens the session.
        def go() -> None:
            if self.state.session_id:
                self._commit(entry)
            elif len(self._early_hook_runs) < MAX_EARLY_HOOK_RUNS:
                self._early_hook_runs.append(entry)

        return self._handle(go)

    # --- results from the executor --------------------------------------------------------------

    def model_returned(self, response: ModelResponse) -> list[Effect]:
        def go() -> None:
            turn = self._expect("model")
            size = compaction.context_tokens(response.usage, self.cfg.provider_kind)
            self._last_input = size or None  # a server that reports no usage: estimate
            counted = self._counted(response)
            u = counted.usage
            self._commit(
                LlmUsage(
                    run_id=turn.run_id,
                    model=self.cfg.model,
                    input=u.input,
                    output=u.output,
                    cache_read=u.cache_read,
                    cache_write=u.cache_write,
                    counted=_counted_tokens(u, self.cfg.provider_kind),
                )
            )
            more = self.state.pending_steers > 0 or self._notes_overflow
            self._commit_all(turn.model_returned(counted, more_input=more))
            self._advance()

        return self._handle(go)

    def _counted(self, response: ModelResponse) -> ModelResponse:
        """The response with the usage the budget counts: a server that reports none would
        spend a capped pod's budget for nothing, so its call is counted by the estimate
        compaction uses (bytes / 4), and an alert says so once."""
        usage = self._billed(response.usage, response.message)
        return (
            response if usage is response.usage else msgspec.structs.replace(response, usage=usage)
        )

    def _billed(self, u: Usage, answer: AssistantMessage) -> Usage:
        """`u`, or for a capped pod whose provider reported none, the bytes / 4 estimate."""
        if self.cfg.budget_cap is None or u.total or u.cache_read or u.cache_write:
            return u
        if not self._usage_estimated:
            self._usage_estimated = True
            message = (
                "the provider reports no token usage: the budget counts an estimate "
                "(the request's and the answer's bytes / 4)"
            )
            self._publish("alert", {"level": "warning", "source": "provider", "message": message})
        return compaction.estimated_usage(self.system_prompt, self.state.history, answer)

    def attempt_cut(self) -> list[Effect]:
        """An attempt of the call in flight broke after the provider began its answer, before
        anything was shown (a tool call's arguments), and is retried: charged as a cut call.
        A summary call's attempts too: a provider that kept cutting them was retried free."""

        def go() -> None:
            if self.turn is not None and self.in_flight == "model":
                self._charge_cut_call(self.turn.run_id, True, "")
            elif self._compacting is not None and self.in_flight == "compact":
                model = self.cfg.compaction_model or self.cfg.model
                self._charge_cut_call(self._compacting.run_id, True, "", model)

        return self._handle(go)

    def _charge_cut_call(
        self, run_id: str | None, answered: bool, partial: str, model: str = ""
    ) -> None:
        """A call cut short once the provider answered (a broken or stalled stream, a cancel
        mid-answer) cost its request and what it produced, yet no usage came (it comes last):
        a capped pod counts it by the bytes / 4 estimate, or a provider that keeps cutting its
        streams (or a client that keeps cancelling) would spend without limit."""
        if self.cfg.budget_cap is None or not (answered or partial):
            return
        u = compaction.estimated_usage(
            self.system_prompt, self.state.history, AssistantMessage(text=partial)
        )
        self._commit(
            LlmUsage(
                run_id=run_id,
                model=model or self.cfg.model,
                input=u.input,
                output=u.output,
                cache_read=0,
                cache_write=0,
            )
        )

    def model_retrying(self, retrying: bool) -> list[Effect]:
        """The model call in flight failed before any output and waits to try again (True), or
        its output started streaming after all (False). While it only waits, a pause need not
        wait for it (retries can take minutes): it is a safe point, the call is withdrawn."""

        def go() -> None:
            if self.in_flight == "model":
                self._model_retrying = retrying
                self._pause_retrying_call()

        return self._handle(go)

    def _pause_retrying_call(self) -> None:
        turn = self.turn
        if (
            self._model_retrying
            and self.in_flight == "model"
            and turn is not None
            and turn.pause_requested
        ):
            self._model_retrying = False
            self._pause_withdrawn_call = turn.run_id
            self._emit(Interrupt())  # model_failed(None) follows: the run ends `paused`

    def model_failed(self, error: ProviderError | None, partial: str = "") -> list[Effect]:
        """The call failed, or (None) was interrupted before it completed; `partial` is the
        text it had streamed (kept: see Turn.model_failed)."""

        def go() -> None:
            turn = self._expect("model")
            answered = error is not None and (
                error.answered or error.kind in ("interrupted", "stalled")
            )
            self._charge_cut_call(turn.run_id, answered, partial)
            failure = error
            if failure is not None and failure.kind == "context_overflow" and self._compaction_on():
                message = f"{compaction.CONTEXT_FULL}{failure.message}"
                failure = ProviderError(failure.kind, message, failure.status)
                self._refused_as_too_long()
            self._commit_all(turn.model_failed(failure, partial))
            self._advance()

        return self._handle(go)

    def model_refused(self, reason: str, outcome: Outcome = "limit_reached") -> list[Effect]:
        """An interceptor refused the call before it was made (the budget is spent, a hook
        stopped the run)."""

        def go() -> None:
            turn = self._expect("model")
            self._commit_all(turn.model_refused(reason, outcome))
            self._advance()

        return self._handle(go)

    def tool_finished(
        self, call_id: str, output: str, is_error: bool, summary: str = ""
    ) -> list[Effect]:
        """The tool of the call in flight returned, its PostToolUse hooks are about to run:
        what it did is written now, so a crash during the hooks keeps it (`tool_returned`
        follows with the result the hooks leave)."""

        def go() -> None:
            turn = self.turn
            if turn is None or self.in_flight != "tool":
                raise RuntimeError("a tool output with no tool in flight")
            call = next((c for c in self.state.open_calls if c.id == call_id), None)
            if call is None:
                raise RuntimeError(f"a tool output for {call_id}, not an open call")
            item = ToolResult(call_id=call_id, name=call.name, output=output, is_error=is_error)
            self._commit(ToolOutput(run_id=turn.run_id, item=item, summary=summary))

        return self._handle(go)

    def tool_returned(
        self, call_id: str, output: str, is_error: bool, summary: str = ""
    ) -> list[Effect]:
        def go() -> None:
            turn = self._expect("tool")
            self._commit_all(turn.tool_returned(call_id, output, is_error, summary))
            self._advance()

        return self._handle(go)

    def stop_checked(self, block: str | None) -> list[Effect]:
        """The Stop hooks' verdict on the final answer: `block` is the reason the first that
        blocked gave (the run goes on, the model reads it), None lets the run end (also when
        the hooks were interrupted by a cancel or a shutdown)."""

        def go() -> None:
            turn = self._expect("stop")
            more = self.state.pending_steers > 0
            if turn.stop_checked(block, more_input=more):
                assert block is not None
                text = f"Stop hook: {block.strip() or 'no reason given'}"
                self._commit(
                    SystemItem(id=self.new_id(), text=text, source=STOP_HOOK_SOURCE, context=True)
                )
            self._advance()

        return self._handle(go)

    def internal_error(self, message: str) -> list[Effect]:
        """A bug in the executor: end the run properly, every call closed."""

        def go() -> None:
            turn = self.turn
            self.in_flight = None
            if turn is None:
                return
            self._commit_all(interrupted_results(self.state.open_calls, turn.run_id))
            self._finish_run(turn.run_id, Finished("error", "", f"internal error: {message}"))

        return self._handle(go)

    # --- sessions -------------------------------------------------------------------------------

    def restore(self, entries: Iterable[dict[str, Any]], copy: bool = False) -> list[Effect]:
        """Continue a session from its log (its entries, read once as they come): close what a
        crash left open, then go on. `copy`: the session is not this pod's to go on with (the
        caller forks it: another pod's, or one another session continues already), so only
        its conversation is taken (see `_only_the_conversation`)."""

        def go() -> None:
            calls = _LastCall(entries)
            self.state = fold(calls)
            self.system_prompt = self.state.system_prompt
            if copy:
                self._only_the_conversation()
                self._announced = self.pod_state
                self._emit(Sync())
                return
            # A compaction the last call made due, which a crash cut short, is made again.
            self._last_input = calls.context_size(self.cfg.provider_kind)
            if calls.refused_as_too_long and self._compaction_on():
                self._refused_as_too_long()  # (the run's end says so: the mark outlives us)
            stale = [i for i, o in self.state.outbox.items() if o.event_kind in FINAL_REPORTS]
            if stale:  # "this pod stopped", from an earlier life: not true now it runs again
                self._commit(OutboxAcked(ids=stale))
            run_id = self.state.active_run
            if run_id is not None:
                # Paused by a client before the crash, short of its safe point, it stays paused
                # (its open calls closed as interrupted) and nothing takes it up until `resume`.
                paused = run_id == self.state.pause_requested
                s = self.state
                self._commit_all(interrupted_results(s.open_calls, run_id, s.tool_outputs))
                self._commit(
                    RunEnd(
                        run_id=run_id,
                        outcome="paused" if paused else "error",
                        text=_run_text(s),  # its reply, as a run's end says (a keyed retry's)
                        error=None if paused else "interrupted: the pod stopped during this run",
                        interrupted=True,
                        usage=self.state.run_usage,
                    )
                )
                if not paused:
                    if self.cfg.reports and run_id in self.state.spawner_runs:
                        error = "interrupted: the pod stopped during this run"
                        self._report("run.finished", run_id=run_id, text=error, outcome="error")
                    self._note_arrived()
                    self._note_cut_off(run_id)
            self._announced = self.pod_state  # (paused, say) what later changes are told against
            self._emit(Sync())

        return self._handle(go)

    def hold(self) -> None:
        """Start no run until `release`: a restored pod's work waits for its start-up (the
        SessionStart hooks' context, its MCP tools), as a new pod's input waits for READY."""
        self.held = True

    def release(self) -> list[Effect]:
        """Start-up is done: the work held since `hold` starts."""

        def go() -> None:
            self.held = False

        return self._handle(go)

    def _only_the_conversation(self) -> None:
        """A copy of a session keeps its conversation, not its work: that was acknowledged to
        the other pod's clients (or taken up by the session that continues it) and is done
        there. Its run in progress or paused ends here (its open calls closed), its queued
        runs are not started, its undelivered inputs not delivered, its children and reports
        stay the other pod's; a note tells the model, waking nothing. Taken up, as a
        restart's are, the copy re-ran another pod's task under a false "the pod restarted"
        note, and told its model that pod's live children had ended (found by QA)."""
        s = self.state
        why = "not taken up: this session continues a copy of it"
        dropped = len(s.pending_runs) + len(s.pending_inputs)
        ended = [r for r in (s.active_run, s.paused_run) if r is not None]
        for run_id in dict.fromkeys(ended):
            if run_id == s.active_run:
                self._commit_all(interrupted_results(s.open_calls, run_id, s.tool_outputs))
            self._commit(
                RunEnd(run_id=run_id, outcome="error", text="", error=why, usage=s.run_usage)
            )
        for run_id in list(s.pending_runs):
            self._commit(RunEnd(run_id=run_id, outcome="error", text="", error=why))
        # Undelivered inputs: never shown, so nothing in the history refers to them.
        for pid in list(s.pending_inputs):
            s.take_pending(pid)
        s.children.clear()
        s.outbox.clear()
        s.spawner_runs.clear()
        s.owed_runs.clear()
        s.interrupted_in_row = 0
        if ended or dropped:
            text = COPY_NOTE.format(ended=len(ended), dropped=dropped)
            self._commit(SystemItem(id=self.new_id(), text=text, source="poddaemon", context=True))

    def take_rendered_prompt(self) -> bool:
        """After `restore`: continue with the prompt this start rendered (the instruction was
        edited, or what it renders changed). True when it differs from the session's: the
        caller forks, so that each session's first entry holds the prompt its calls carry."""
        changed = self.system_prompt != self.rendered_prompt
        self.system_prompt = self.rendered_prompt
        return changed

    def fork(self) -> SessionStart:
        """Another writer moved our log's head: continue, from the state as it is now, in a new
        session linked to the old one. The caller creates the log from the returned entry."""
        old = self.state
        snap = old.snapshot()
        start = SessionStart(
            session_id=self.new_id(),
            pod=self.cfg.name,
            system_prompt=self.system_prompt,
            config=self.cfg.config,
            history=list(old.history),
            forked_from=old.session_id,
            pending_runs=[msgspec.convert(r, PendingRunSnap) for r in snap["pending_runs"]],
            pending_inputs=[msgspec.convert(p, PendingInputSnap) for p in snap["pending_inputs"]],
            run_key_digests=snap["run_key_digests"],
            notify_key_digests=snap["notify_key_digests"],
            usage=old.usage,
            spent=old.spent,
            usage_calls=old.usage_calls,
            usage_call_count=old.call_count,
            active_run=old.active_run,
            rounds=old.rounds,
            run_from=old.run_from,
            paused_run=old.paused_run,
            pause_requested=old.pause_requested,
            open_calls=list(old.open_calls),
            tool_outputs=[
                ToolOutputSnap(run_id=o.run_id, item=o.item, summary=o.summary)
                for o in old.tool_outputs.values()
            ],
            run_outcomes=snap["run_outcomes"],
            run_positions=snap["run_positions"],
            tree=old.tree_snapshot(),
            interrupted_in_row=old.interrupted_in_row,
            take_up_from=old.take_up_from,
            seq=1,
            ts=self.clock(),
        )
        run_usage = old.run_usage
        self.state = fold([start])
        self.state.run_usage = run_usage
        return start

    # --- compaction ---------------------------------------------------------------------------
    # Decided here, between model rounds (never with a tool call open); `compaction.py` holds the
    # pure selection rules, the executor makes the summary call and writes the new session.

    def compact(self, token: int) -> list[Effect]:
        """The `compact` method: idle only (else -32008)."""

        def go() -> None:
            if self._refuse_if_stopping(token):
                return
            if self.pod_state != "idle" or self._compacting is not None or self.turn is not None:
                self._error(token, errors.BUSY, "compact needs an idle pod")
                return
            if not self.state.history:
                self._reply(token, CompactResult(session_id=self.state.session_id or None))
                return
            if self.budget_exhausted():
                self._error(token, errors.BUDGET_EXHAUSTED, self.budget_message())
                return
            self._begin_compaction("manual", None, token)

        return self._handle(go)

    def compaction_returned(
        self, summary: str, usage: Usage, children: list[str] | None = None
    ) -> list[Effect]:
        """The summary came back: continue in a new session (the executor writes it)."""

        def go() -> None:
            c = self._end_compaction()
            self._charge_summary(c, usage, AssistantMessage(text=summary))
            run_from = self.state.run_from if c.run_id is not None else None
            history, new_run_from = compaction.build_history(
                self.state.history,
                run_from,
                summary,
                self.cfg.compact_retained_turns,
                children or [],
            )
            after = compaction.estimate_tokens(self.system_prompt, history)
            gained = compaction.shrink(c.estimate_before, after)
            if not summary.strip():
                # No summary is a failed call, as an HTTP error is (the breaker counts it and
                # the next round tries again), not a useless one: the thrash guard would leave
                # the rest of the run to grow uncompacted after one empty answer.
                self._compaction_failed(c, "the summary was empty")
                self._after_compaction(c)
                return
            # A manual compaction is applied as asked; an automatic one only if it helps.
            if gained <= 0 and c.reason != "manual":
                if c.run_id is not None:
                    self._no_compact_run = c.run_id
                self._compaction_failed(c, "the summary did not make the context smaller")
                self._after_compaction(c)
                return
            if gained < compaction.SHRINK_MIN and c.run_id is not None:
                self._no_compact_run = c.run_id  # the thrash guard: not again in this run
            start = self._compacted_start(history, new_run_from)
            self._emit(SwitchSession(start))
            self._last_input = None
            self._compact_failures = 0
            if c.reason == "manual":
                self._auto_compact_off = False
            after_tokens = round(c.before_tokens * (1.0 - gained))
            data = {
                "session_id": start.session_id,
                "before_tokens": c.before_tokens,
                "after_tokens": after_tokens,
            }
            self._publish("compaction.finished", data, c.run_id)
            if c.token is not None:
                self._reply(c.token, CompactResult(session_id=start.session_id), durable=True)
            self._after_compaction(c)

        return self._handle(go)

    def compaction_failed(
        self,
        error: str | None,
        usage: Usage | None = None,
        answer: AssistantMessage | None = None,
    ) -> list[Effect]:
        """The summary call failed, or (None) was interrupted: the old session stays. `answer`:
        what the provider answered, though it is no summary (a tool call, a refusal, a stream
        cut mid-answer), with its `usage` if it came: the provider bills it all the same."""

        def go() -> None:
            c = self._end_compaction()
            if answer is not None and (usage is not None or self.cfg.budget_cap is not None):
                self._charge_summary(c, usage or Usage(), answer)
            if error is None and c.cancelled:  # asked for: no failure the breaker counts
                self._publish("compaction.failed", {"error": "cancelled"}, c.run_id)
                if c.token is not None:
                    self._error(c.token, errors.INTERNAL_ERROR, "compaction failed: cancelled")
            elif error is None:
                self._publish("compaction.failed", {"error": "interrupted"}, c.run_id)
                if c.token is not None:
                    self._error(c.token, errors.SHUTTING_DOWN, "compaction interrupted")
            else:
                self._compaction_failed(c, error)
            self._after_compaction(c)

        return self._handle(go)

    @property
    def compacting(self) -> bool:
        return self._compacting is not None

    @property
    def auto_compaction_off(self) -> bool:
        return self._auto_compact_off

    def _compaction_on(self) -> bool:
        return self.cfg.compact_threshold is not None

    def _refused_as_too_long(self) -> None:
        """The provider refused the context as too long: the next run compacts first. The
        refused request reported no size; the last call's, under the threshold (one round's
        tool results took it past the window), kept every later run from compacting first:
        each failed "context full" for good."""
        threshold = self.cfg.compact_threshold or 0
        self._last_input = max(self._context_size(), threshold)

    def _context_size(self) -> int:
        if self._last_input is not None:
            return self._last_input
        return compaction.estimate_tokens(self.system_prompt, self.state.history)

    def _compaction_due(self, run_id: str) -> bool:
        threshold = self.cfg.compact_threshold
        if threshold is None or self._auto_compact_off or run_id == self._no_compact_run:
            return False
        if self.budget_exhausted():
            return False  # the request is refused anyway
        if self._context_size() < threshold:
            return False
        # Rounds too few to summarize any (all within compact_retained_turns): not yet.
        return compaction.summarizable(
            self.state.history, self.state.run_from, self.cfg.compact_retained_turns
        )

    def _begin_compaction(self, reason: str, run_id: str | None, token: int | None) -> None:
        before = self._context_size()
        estimate = compaction.estimate_tokens(self.system_prompt, self.state.history)
        self._compacting = _Compaction(reason, run_id, token, before, estimate)
        self.in_flight = "compact"
        if run_id is None:  # a manual one: the idle pod is at work until it ends
            self._announce()
        self._publish("compaction.started", {"reason": reason, "input_tokens": before}, run_id)
        items = compaction.summary_request_items(list(self.state.history))
        self._emit(Summarize(run_id, reason, self.system_prompt, items))

    def _end_compaction(self) -> _Compaction:
        c = self._compacting
        if c is None or self.in_flight != "compact":
            raise RuntimeError("a compaction result with no compaction in flight")
        self._compacting = None
        self.in_flight = None
        if c.run_id is None:
            self._announce_due = True  # idle, unless a run queued meanwhile starts at once
        return c

    def _charge_summary(self, c: _Compaction, usage: Usage, answer: AssistantMessage) -> None:
        """A summary call's cost, counted as a model call's is: one that came to nothing (no
        summary, a stream cut short, no usage reported) cost its whole context all the same,
        and a capped pod kept compacting for free past `max_total_tokens`."""
        u = self._billed(usage, answer)
        self._commit(
            LlmUsage(
                run_id=c.run_id,
                model=self.cfg.compaction_model or self.cfg.model,
                input=u.input,
                output=u.output,
                cache_read=u.cache_read,
                cache_write=u.cache_write,
                counted=_counted_tokens(u, self.cfg.compaction_kind or self.cfg.provider_kind),
            )
        )

    def _compaction_failed(self, c: _Compaction, error: str) -> None:
        self._compact_failures += 1
        self._publish("compaction.failed", {"error": error}, c.run_id)
        if c.token is not None:
            self._error(c.token, errors.INTERNAL_ERROR, f"compaction failed: {error}")
        if self._compact_failures >= compaction.BREAKER_FAILURES and not self._auto_compact_off:
            self._auto_compact_off = True
            message = (
                f"compaction failed {self._compact_failures} times in a row; automatic "
                "compaction is off until a manual `podctl compact` succeeds"
            )
            self._publish("alert", {"level": "warning", "source": "compaction", "message": message})

    def _after_compaction(self, c: _Compaction) -> None:
        """Go on with the run the compaction interrupted (a manual one had none)."""
        turn = self.turn
        if c.run_id is None or turn is None or turn.run_id != c.run_id:
            return
        if turn.cancel_requested or self.stopping:
            self._commit_all(turn.model_failed(None))
            self._advance()
            return
        if turn.pause_requested:  # the safe point is now, before the next model call
            turn.call_withdrawn()
            self._advance()
            return
        self._call_model(turn)

    def _compacted_start(self, history: list[Item], run_from: int | None) -> SessionStart:
        """The new session's first entry; the machine continues in it from now on."""
        old_id = self.state.session_id
        run_usage, run_calls = self.state.run_usage, self.state.run_calls
        self.system_prompt = self.rendered_prompt  # rendered for it (`now`: not the start's)
        continued = self.fork()
        start = msgspec.structs.replace(
            continued,
            history=history,
            forked_from=None,
            compacted_from=old_id,
            run_from=run_from,
            run_usage=msgspec.structs.replace(run_usage),
            run_calls=run_calls,
        )
        self.state = fold([start])
        return start

    # --- the rules ------------------------------------------------------------------------------

    def _run(
        self, token: int, text: str, mode: str, key: str | None, wait: bool, context: str = ""
    ) -> None:
        if self._refuse_if_stopping(token):
            return
        s = self.state
        original = self._replayed(token, s.run_keys, key, text)
        if original == "":
            return  # a conflicting key: answered
        if original is not None:
            assert key is not None
            if wait:
                self._wait_for(token, original)
            elif s.run_keys[key][2]:  # a steer: into the run it joined, as then
                self._reply(token, RunResult(run_id=original, state="steered"), durable=True)
            else:  # as the first time (SPEC §5), whatever became of the run since
                self._reply(token, self._first_answer(original), durable=True)
            return
        if self.budget_exhausted():
            self._error(token, errors.BUDGET_EXHAUSTED, self.budget_message())
            return
        active = s.active_run
        if mode == "steer" and active is not None:
            if context:  # for the active run's next request, with the steered input
                item = SystemItem(
                    id=self.new_id(), text=context, source=CONTEXT_SOURCE, context=True
                )
                self._commit(item)
            steer_id = self.new_id()
            self._commit(
                UserInput(text=text, mode="steer", run_id=active, id=steer_id, client_key=key)
            )
            if wait:  # answered when the run it joined ends, as any `wait`
                self._waiters.setdefault(active, []).append(token)
            else:
                self._reply(token, RunResult(run_id=active, state="steered"), durable=True)
            return
        busy = (
            active is not None
            or s.paused_run is not None
            or s.pending_runs
            or self._compacting is not None
        )
        queued = len(s.pending_runs)
        if busy and queued >= self.cfg.max_queued_runs:
            message = (
                f"queue full: {queued} runs queued "
                f"(worker.max_queued_runs = {self.cfg.max_queued_runs})"
            )
            self._error(token, errors.QUEUE_FULL, message)
            return
        run_id = self.new_id()
        position = queued + 1 if busy else 0
        # The hook's context goes with the input: a queued run's must not reach the active run.
        self._commit(
            UserInput(
                text=text,
                mode="queue",
                run_id=run_id,
                client_key=key,
                context=context,
                position=position if key is not None else None,
            )
        )
        if position:
            self._publish("run.queued", {"position": position}, run_id)
        if wait:
            self._waiters.setdefault(run_id, []).append(token)
        elif position:
            self._reply(
                token, RunResult(run_id=run_id, state="queued", position=position), durable=True
            )
        else:
            self._reply(token, RunResult(run_id=run_id, state="started"), durable=True)

    def _first_answer(self, run_id: str) -> RunResult:
        """What a keyed `run` that queued `run_id` was answered. A run keyed before its
        position was kept: where it stands now (waiting: its place; else started)."""
        s = self.state
        position = s.run_positions.get(run_id)
        if position is None and run_id in s.pending_runs:
            position = list(s.pending_runs).index(run_id) + 1
        if position:
            return RunResult(run_id=run_id, state="queued", position=position)
        return RunResult(run_id=run_id, state="started")

    def _notify(self, token: int, message: str, source: str, key: str | None) -> None:
        if self._refuse_if_stopping(token):
            return
        if key is not None:
            original = self._replayed(token, self.state.notify_keys, key, message)
            if original == "":
                return  # a conflicting key: answered
            if original is not None:
                woke = self.state.notify_keys[key][2]
                result = NotifyResult(notification_id=original, wakes=woke)
                self._reply(token, result, durable=True)
                return
        if self._queue_full(token):
            return
        nid = self.new_id()
        self._note_arrived()
        # A manual compaction holds no run: once it ends (whatever its end) the pod runs a turn
        # for this, unless a run queued meanwhile starts first and takes it.
        manual = self._compacting is not None and self.state.active_run is None
        waiting = manual and not self.state.pending_runs
        wakes = (self.pod_state == "idle" or waiting) and not self.budget_exhausted()
        self._commit(SystemItem(id=nid, text=message, source=source, client_key=key, wakes=wakes))
        self._reply(token, NotifyResult(notification_id=nid, wakes=wakes), durable=True)

    def _queue_full(self, token: int) -> bool:
        pending = self.state.pending_notifications
        if pending < self.cfg.max_pending:
            return False
        message = (
            f"queue full: {pending} notifications pending "
            f"(notify.max_pending = {self.cfg.max_pending})"
        )
        self._error(token, errors.QUEUE_FULL, message)
        return True

    def _replayed(
        self, token: int, keys: Mapping[str, tuple[Any, ...]], key: str | None, text: str
    ) -> str | None:
        """The id an earlier request with this key got (an idempotent retry), or None. Same key
        with a different text is -32006 (replied here; then '' is returned). `keys` maps a key
        to (input_digest, id, ...)."""
        if key is None or key not in keys:
            return None
        original, input_id = keys[key][:2]
        if original != input_digest(text):
            self._error(
                token,
                errors.CONFLICTING_CLIENT_KEY,
                f"client_key {key!r} was used for a different input",
            )
            return ""
        return str(input_id)

    def _wait_for(self, token: int, run_id: str) -> None:
        done = self.state.run_outcomes.get(run_id)
        if done is None:
            self._waiters.setdefault(run_id, []).append(token)
            return
        usage = msgspec.convert(
            {**(done.get("usage") or {}), "calls": done.get("calls", 0)}, UsageTotals
        )
        result = RunWaitResult(
            run_id=run_id,
            outcome=done["outcome"],
            text=done["text"],
            usage=usage,
            error=done["error"],
        )
        self._reply(token, result, durable=True)

    # --- scheduling -----------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Start the next piece of work while the pod is free; stop if it is stopping."""
        while self.turn is None and not self.stopped and self._start_next():
            pass

    def _start_next(self) -> bool:
        """Start one run if one is due (True); a run may end at once (a resumed final answer)."""
        if self._compacting is not None:
            return False  # a manual compaction: the next run starts in the new session
        if self.stopping:
            self._stop()
            return False
        if self.held:
            return False
        s = self.state
        if self._resume_requested and s.paused_run is not None:
            self._resume_requested = False
            self._start_run(s.paused_run, "resume")
            return True
        self._resume_requested = False
        if s.paused_run is not None:
            return False  # paused: runs and notifications wait for `resume` (or a `cancel`)
        if s.pending_steers and not self.budget_exhausted():
            # Steered into a run that ended before its next model request (a provider error,
            # a cancel, max_turns, a crash): acknowledged input is answered, in a run of its
            # own, before any queued run. Taken up by the next queued run instead, it read as
            # that run's steer ("also check the tests" added to "deploy").
            self._start_run(self.new_id(), "steer")
            return True
        if s.pending_runs:
            self._start_run(next(iter(s.pending_runs)), "input")
            return True
        if s.pending_notifications <= s.pending_context or self.budget_exhausted():
            return False  # nothing that wakes the pod (a hook's context waits for input)
        now = self.clock()
        start = self._burst_start if self._burst_start is not None else now
        settle_at = min(self._last_notify + NOTIFY_QUIET, start + NOTIFY_MAX_DELAY)
        if now < settle_at:
            if self._timer_at is None or self._timer_at > settle_at or self._timer_at < now:
                self._timer_at = settle_at
                self._emit(SetTimer(settle_at))
            return False
        self._start_run(self.new_id(), "notifications")
        return True

    def _start_run(self, run_id: str, trigger: str) -> None:
        self._burst_start = None
        run = self.state.pending_runs.get(run_id) if trigger == "input" else None
        if run is not None:
            # What waited before this input came (a SessionStart hook's context, the note that
            # the run before was cut short) is read before it, as in Claude Code. Delivered at
            # the first request, it followed the input and its prompt's own context.
            self._deliver_pending(until=run.ts)
        self._commit(RunStart(run_id=run_id, trigger=trigger, continues=self._taken_up()))
        turn = Turn(run_id, self.cfg.max_turns, self.state.rounds, stop_hooks=self.cfg.stop_hooks)
        self.turn = turn
        self._announce()
        last = self.state.history[-1] if self.state.history else None
        if trigger == "resume" and not self.state.pending_steers and _final_answer(last):
            # Paused while its final answer streamed (or its Stop hooks ran): the answer
            # stands, the run ends (once the Stop hooks let it).
            assert isinstance(last, AssistantMessage)
            turn.resumed_answered(last.text)
        self._advance()

    def _advance(self) -> None:
        """Drive the active turn to its next effect: a model call, a tool, or its end."""
        turn = self.turn
        assert turn is not None
        self.in_flight = None
        if self.stopping:
            turn.request_cancel()
        while turn.in_tools:
            step = turn.next_tool()
            if step is not None:
                call = step.call
                data = {"call_id": call.id, "name": call.name, "args": args_preview(call.arguments)}
                self._publish("tool.started", data, turn.run_id)
                self.in_flight = "tool"
                self._emit(RunTool(turn.run_id, call))
                return
        next_step = turn.next_step()
        if isinstance(next_step, Finished):
            self._finish_run(turn.run_id, next_step)
            return
        if isinstance(next_step, CheckStop):
            self.in_flight = "stop"
            active, last = next_step.stop_hook_active, next_step.last_round
            self._emit(RunStopHooks(turn.run_id, active, last))
            return
        assert isinstance(next_step, _CallStep)
        if self._compaction_due(turn.run_id):
            self._begin_compaction("auto", turn.run_id, None)
            return
        self._call_model(turn)

    def _call_model(self, turn: Turn) -> None:
        self._deliver_pending()
        self.in_flight = "model"
        self._model_retrying = False
        self._emit(CallModel(turn.run_id, self.system_prompt, list(self.state.history)))

    def _deliver_pending(self, until: float | None = None) -> None:
        ids, _ = self.state.deliverable(self.cfg.max_input_bytes, until)
        if not ids:
            self._notes_overflow = False
            return
        shown = sum(1 for i in ids if self.state.pending_inputs[i].kind == "notification")
        left = self.state.pending_notifications - shown
        self._notes_overflow = left > 0  # held back by the count or the bytes a request takes
        self._commit(InputsDelivered(ids=ids, more=left))

    def _finish_run(self, run_id: str, end: Finished, started: bool = True) -> None:
        # Cut short by the stop, not by a `cancel` that came first: picked up at the next start.
        cancelled = run_id == self._cancelled_run
        if started and self._pause_withdrawn_call == run_id:
            self._pause_withdrawn_call = None
        interrupted = self.stopping and end.outcome == "cancelled" and started and not cancelled
        outcome, error = end.outcome, end.error
        if interrupted:
            outcome, error = "error", "interrupted: the pod shut down"
        run_usage = msgspec.structs.replace(self.state.run_usage) if started else Usage()
        self._commit(
            RunEnd(
                run_id=run_id,
                outcome=outcome,
                text=end.text,
                error=error,
                interrupted=interrupted,
                usage=run_usage,
            )
        )
        calls = self.state.run_calls if started else 0
        usage = UsageTotals(**msgspec.structs.asdict(run_usage), calls=calls)
        if started:
            self.turn = None
            self.in_flight = None
            self._notes_overflow = False
            self._announce_due = True  # idle or paused, unless the next run starts at once
        result = RunWaitResult(
            run_id=run_id, outcome=outcome, text=end.text, usage=usage, error=error
        )
        for token in self._waiters.pop(run_id, []):
            self._reply(token, result, durable=True)
        for token in self._cancels.pop(run_id, []):
            self._reply(token, CancelResult(cancelled=outcome == "cancelled"), durable=True)
        if self.cfg.reports and run_id in self.state.spawner_runs and outcome != "paused":
            run_usage_dict = {**msgspec.structs.asdict(run_usage), "calls": calls}
            self._report(
                "run.finished",
                run_id=run_id,
                text=end.text if error is None else f"{end.text}\n{error}".strip(),
                outcome=outcome,
                usage=run_usage_dict,
            )
        if interrupted:  # as after a crash (see restore): the next start picks the work up
            self._note_cut_off(run_id)
        elif started and outcome == "cancelled":  # told at the next request; wakes nothing
            note = SystemItem(id=self.new_id(), text=CANCEL_NOTE, source="poddaemon", context=True)
            self._commit(note)
        elif started and outcome == "error" and end.text:  # (no reply kept: nothing to mistake)
            said = (error or "")[:ERROR_NOTE_WIDTH]
            text = ERROR_NOTE.format(error=said)
            self._commit(SystemItem(id=self.new_id(), text=text, source="poddaemon", context=True))
        self._emit(Sync())

    def _stop(self) -> None:
        self.stopped = True
        if self.cfg.reports and self.final_report is not None and self.state.session_id:
            # Our last word on what our tree spent, said before our children stop (or while
            # detached ones go on): a live child's grant counts whole, as in our own budget.
            # Counted at its last report, a child mid-run had spent more, unheard of: our
            # spawner charged us less than the tree spent and granted the rest out again.
            self._report(self.final_report, tree_spent=self.budget_charged())
        for tokens in self._waiters.values():
            for token in tokens:
                self._error(token, errors.SHUTTING_DOWN, "the pod shut down")
        self._waiters.clear()
        for tokens in self._cancels.values():
            for token in tokens:
                self._reply(token, CancelResult(cancelled=True))
        self._cancels.clear()
        self._publish("shutdown", {"reason": self.stop_reason})
        self._emit(Sync())
        self._emit(Stopped())

    # --- plumbing -------------------------------------------------------------------------------

    def _handle(self, go: Callable[..., None], *args: Any) -> list[Effect]:
        self._out = []
        go(*args)
        if self.turn is None:  # (else _schedule has nothing to start: a call saved)
            self._schedule()
        if self._announce_due:
            self._announce_due = False
            self._announce()
        out, self._out = self._out, []
        return out

    def _announce(self) -> None:
        """`state.changed`, when the pod's state is not the one subscribers were last told."""
        state = self.pod_state
        if state != self._announced:
            self._announced = state
            self._publish("state.changed", {"state": state})

    def _emit(self, effect: Effect) -> None:
        self._out.append(effect)

    def _commit(self, entry: Entry) -> None:
        if not self.state.session_id:
            self._open_session()
        entry.seq = self.state.last_seq + 1
        entry.ts = self.clock()
        self.state.apply(entry)
        self._out.append(Commit(entry))  # (as _emit does: this runs on every request)

    def _commit_all(self, entries: Sequence[Entry]) -> None:
        for entry in entries:
            self._commit(entry)

    def _open_session(self) -> None:
        start = SessionStart(
            session_id=self.first_session_id(),
            pod=self.cfg.name,
            system_prompt=self.system_prompt,
            config=self.cfg.config,
            seq=1,
            ts=self.clock(),
        )
        self.state.apply(start)
        self._emit(OpenSession(start))
        held, self._early_hook_runs = self._early_hook_runs, []
        self._commit_all(held)

    def _publish(self, type: str, data: dict[str, Any], run_id: str | None = None) -> None:
        self._emit(Publish(type, data, run_id))

    def _reply(self, token: int, result: Any, durable: bool = False) -> None:
        self._out.append(Reply(token, result=result, durable=durable))  # (see _commit)

    def _error(self, token: int, code: int, message: str) -> None:
        self._emit(Reply(token, error=RpcError(code, message)))

    def _refuse_if_stopping(self, token: int) -> bool:
        if self.stopping:
            self._error(token, errors.SHUTTING_DOWN, "the pod is shutting down")
        return self.stopping

    def _note_cut_off(self, run_id: str) -> None:
        """The restart note for `run_id`, just ended as cut off (its `RunEnd` is committed)."""
        in_row = self.state.interrupted_in_row
        note = _restart_note(run_id, in_row)
        self._commit(note)
        if note.context:
            message = (
                f"{in_row} runs in a row were cut off by a crash or a stop; the pod does not "
                "take the work up again by itself: it waits for the next input"
            )
            self._publish("alert", {"level": "warning", "source": "poddaemon", "message": message})

    def _taken_up(self) -> str | None:
        """The spawner's run, cut off by a restart, whose note the run starting now carries
        to the model: that run takes it up, and its end is the report the spawner waits for
        (it heard only that the task was interrupted)."""
        owed = self.state.owed_runs
        if not owed:
            return None
        for pid in self.state.pending_inputs:
            if pid.startswith(RESTART_NOTE_ID) and pid[len(RESTART_NOTE_ID) :] in owed:
                return pid[len(RESTART_NOTE_ID) :]
        return None

    def _note_arrived(self) -> None:
        now = self.clock()
        self._last_notify = now
        if self._burst_start is None:
            self._burst_start = now

    def _expect(self, what: Literal["model", "tool", "stop"]) -> Turn:
        if self.turn is None or self.in_flight != what:
            raise RuntimeError(f"a {what} result with no {what} in flight")
        self.in_flight = None
        self._model_retrying = False
        return self.turn


class _LastCall:
    """The entries passed through, noting the session's last `llm_usage` on the way, and
    whether a run ended refused as too long since."""

    def __init__(self, entries: Iterable[dict[str, Any]]) -> None:
        self._entries = entries
        self._last: dict[str, Any] | None = None
        self.refused_as_too_long = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for e in self._entries:
            kind = e.get("kind")
            if kind == "llm_usage":
                self._last = e
                self.refused_as_too_long = False  # a call answered since: its size says
            elif kind == "run_end" and e.get("outcome") == "error":
                error = e.get("error")
                if isinstance(error, str) and error.startswith(compaction.CONTEXT_FULL):
                    self.refused_as_too_long = True
            yield e

    def context_size(self, provider_kind: str) -> int | None:
        """The request size the last model call reported (None: none reported one)."""
        last = from_log(self._last) if self._last is not None else None
        if isinstance(last, LlmUsage):
            return compaction.context_tokens(last.usage(), provider_kind) or None
        return None


def _within(text: str, limit: int) -> str:
    """A child's report as the model reads it: at most `limit` bytes of its text. A report
    cannot be refused as a notify over max_input_bytes is (its child would send it again for
    ever), but once read it stays in the context: one larger than the window failed every
    later run. The whole text stays in the entry's `detail`, for wait_pods and history."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    kept = raw[:limit].decode("utf-8", "ignore")  # (a character cut in two is dropped)
    return f"{kept}\n[... {len(raw) - limit:,} more bytes cut (worker.max_input_bytes)]"


def _run_text(s: SessionState) -> str:
    """The active run's text as its turn kept it: its last message that had text."""
    for item in reversed(s.history[s.run_from :]):
        if isinstance(item, AssistantMessage) and item.text:
            return item.text
    return ""


def _final_answer(item: Item | None) -> bool:
    return isinstance(item, AssistantMessage) and not item.tool_calls
