"""One run of the agent as a sans-IO state machine (in the manner of h11).

The pod asks `next_step()` what to do, does it (calls the model, runs a tool), and feeds the
result back; the machine answers with the records to commit. It never does I/O, never awaits,
and guarantees the invariants every provider needs:

- every tool call gets exactly one result (synthetic when cancelled, paused, cut off or denied);
- every run ends in exactly one `Finished`.

A run with Stop hooks does not end `finished` by itself: its final answer asks `CheckStop`
first, and a hook that blocks gives it another model round (as Claude Code's Stop hooks).

Pause and cancel are requests: they take effect at the next safe point (before a model call or
before a tool), except that the pod also interrupts whatever is in flight on cancel.
"""

from collections.abc import Mapping
from enum import Enum
from typing import Literal

import msgspec

from poddaemon.entries import Assistant, Entry, ToolOutput, ToolResultEntry, TurnEnd
from poddaemon.history import AssistantMessage, ToolCall, ToolResult, Usage
from poddaemon.llm.types import ModelResponse, ProviderError

Outcome = Literal["finished", "paused", "limit_reached", "cancelled", "error"]

NOT_RUN_PAUSED = "not run: the run was paused before this tool started"
NOT_RUN_CANCELLED = "not run: the run was cancelled"
NOT_RUN_CUT_OFF = "not run: the response hit the output limit before this call was complete"
NOT_RUN_STOPPED = "not run: the model's response was stopped ({reason})"
CANCELLED_WHILE_RUNNING = (
    "interrupted: the run was cancelled (or the pod shut down) while this call ran; a command "
    "and every process it started were killed. It did not finish: check its effects before "
    "running it again."
)
# A call whose tool had returned when a cancel or shutdown cut its PostToolUse hooks short.
HOOKS_CUT_SHORT = (
    "[PostToolUse hook] not run to the end: the run was cancelled (or the pod shut down) "
    "after this call had finished"
)
# What a restored session adds to the output of a call whose tool had returned when a crash
# cut its PostToolUse hooks short.
HOOKS_CUT_SHORT_BY_CRASH = (
    "[PostToolUse hook] not run to the end: the pod stopped after this call had finished"
)
# What a restored session says of a call a crash cut off, by what the call was doing.
INTERRUPTED = (
    "interrupted: the pod stopped while this call ran. It did not finish: check its effects "
    "before running it again."
)
INTERRUPTED_COMMAND = (
    "interrupted: the pod stopped while this call ran; a command and every process it started "
    "were killed with the pod. It did not finish: check its effects before running it again."
)
# A child outlives its spawner's crash when on_parent_exit = "detach", and is adopted again:
# "killed" would have the model spawn it a second time.
INTERRUPTED_SPAWN = (
    "interrupted: the pod stopped while this call ran. The pod it was starting may be running "
    "now (list_pods says): check before spawning it again."
)


def interrupted_output(tool: str) -> str:
    if tool == "bash":
        return INTERRUPTED_COMMAND
    return INTERRUPTED_SPAWN if tool == "spawn_pod" else INTERRUPTED


class CallModel(msgspec.Struct, frozen=True):
    round: int


class RunTool(msgspec.Struct, frozen=True):
    call: ToolCall


class CheckStop(msgspec.Struct, frozen=True):
    """Run the Stop hooks on the final answer and feed their verdict to `stop_checked`."""

    stop_hook_active: bool  # the run already goes on because a Stop hook blocked its end
    last_round: bool = False  # max_turns is spent: a block ends the run `limit_reached`


class Finished(msgspec.Struct, frozen=True):
    outcome: Outcome
    text: str
    error: str | None = None


Step = CallModel | RunTool | CheckStop | Finished


class _State(Enum):
    NEED_MODEL = "need_model"
    AWAIT_MODEL = "await_model"
    NEED_TOOLS = "need_tools"
    AWAIT_TOOL = "await_tool"
    NEED_STOP_CHECK = "need_stop_check"
    AWAIT_STOP_CHECK = "await_stop_check"
    DONE = "done"


class Turn(msgspec.Struct):
    run_id: str
    max_turns: int
    rounds: int = 0  # model rounds already spent in this run (a resumed run keeps counting)
    usage: Usage = msgspec.field(default_factory=Usage)
    stop_hooks: bool = False  # a final answer asks `CheckStop` before the run ends
    _state: _State = _State.NEED_MODEL
    _pending: list[ToolCall] = msgspec.field(default_factory=list)
    _text: str = ""
    _finished: Finished | None = None
    _pause: bool = False
    _cancel: bool = False
    _stop_hook_active: bool = False

    # --- what to do next -----------------------------------------------------------------------

    def next_step(self) -> Step:
        if self._finished is not None:
            return self._finished
        if self._state is _State.NEED_MODEL:
            if self._cancel:
                return self._finish("cancelled", None)
            if self._pause:
                return self._finish("paused", None)
            if self.rounds >= self.max_turns:
                return self._limit_reached()
            self._state = _State.AWAIT_MODEL
            return CallModel(self.rounds + 1)
        if self._state is _State.NEED_STOP_CHECK:
            if self._cancel:
                return self._finish("cancelled", None)
            if self._pause:
                return self._finish("paused", None)
            self._state = _State.AWAIT_STOP_CHECK
            return CheckStop(self._stop_hook_active, self.rounds >= self.max_turns)
        if self._state is _State.NEED_TOOLS:
            raise RuntimeError("tool results must be fed back before asking for a step")
        if self._state in (_State.AWAIT_TOOL, _State.AWAIT_MODEL, _State.AWAIT_STOP_CHECK):
            raise RuntimeError(f"waiting for a result ({self._state.value})")
        raise AssertionError(self._state)

    def next_tool(self) -> RunTool | None:
        """The next tool to run, or None when the batch is done (then ask `next_step`)."""
        if self._state is not _State.NEED_TOOLS:
            raise RuntimeError(f"no tool batch in progress ({self._state.value})")
        if not self._pending:
            self._state = _State.NEED_MODEL
            return None
        self._state = _State.AWAIT_TOOL
        return RunTool(self._pending[0])

    @property
    def in_tools(self) -> bool:
        return self._state is _State.NEED_TOOLS

    @property
    def done(self) -> bool:
        return self._finished is not None

    # --- requests from outside ------------------------------------------------------------------

    def request_pause(self) -> None:
        self._pause = True

    def withdraw_pause(self) -> None:
        """A `resume` before the safe point was reached: the run goes on as if never paused."""
        self._pause = False

    def request_cancel(self) -> None:
        self._cancel = True

    # --- results fed back -----------------------------------------------------------------------

    def model_returned(self, response: ModelResponse, more_input: bool = False) -> list[Entry]:
        """Records for a complete model response. `more_input`: steer input is waiting, so a
        final answer does not end the run; the model gets another round to read it."""
        self._expect(_State.AWAIT_MODEL)
        self.rounds += 1
        self.usage.add(response.usage)
        message = response.message
        records: list[Entry] = [Assistant(run_id=self.run_id, item=message)]
        if message.text:
            self._text = message.text
        calls = list(message.tool_calls)
        stop = response.stop
        if stop == "max_tokens":
            records += self._close_calls(calls, NOT_RUN_CUT_OFF)
            records.append(self._turn_end())
            cut = "incomplete: the response hit the output limit (worker.max_tokens)"
            self._finish("error", cut)  # (naming the manifest setting a user raises)
        elif stop in ("content_filter", "context_overflow"):
            reason = response.detail or stop.replace("_", " ")
            records += self._close_calls(calls, NOT_RUN_STOPPED.format(reason=reason))
            records.append(self._turn_end())
            self._finish("error", f"{stop}: {reason}")
        elif calls:
            self._pending = calls
            self._state = _State.NEED_TOOLS
            if self._cancel or self._pause:
                records += self._stop_batch()
        else:
            records.append(self._turn_end())
            if more_input and not (self._cancel or self._pause):
                self._state = _State.NEED_MODEL
            elif self._cancel:
                self._finish("cancelled", None)
            elif self._pause:  # a pause asked for during the answer holds: resuming ends it
                self._finish("paused", None)
            else:
                self._answered()
        return records

    def resumed_answered(self, text: str) -> None:
        """The run resumes after its final answer (it was paused as the answer streamed or as
        the Stop hooks ran): it ends, once the Stop hooks let it."""
        self._expect(_State.NEED_MODEL)
        self._text = text
        self._answered()

    def stop_checked(self, block: str | None, more_input: bool = False) -> bool:
        """The Stop hooks' verdict: `block` is the reason one blocked the end of the run, None
        lets it end (or the check was interrupted: by a cancel or a shutdown, which end the run
        anyway). `more_input`: steer input came meanwhile, read in another round. True when
        the run goes on because of the block (the caller gives the model the reason). A pause
        asked for meanwhile ends the run `paused` whatever the verdict: resuming asks again."""
        self._expect(_State.AWAIT_STOP_CHECK)
        if self._cancel:
            self._finish("cancelled", None)
        elif self._pause:
            self._finish("paused", None)
        elif block is None and (not more_input or self.rounds >= self.max_turns):
            self._finish("finished", None)  # (the steer gets a run of its own)
        elif self.rounds >= self.max_turns:
            self._limit_reached()
        else:
            self._state = _State.NEED_MODEL
            if block is not None:
                self._stop_hook_active = True
                return True
        return False

    def model_failed(self, error: ProviderError | None, partial: str = "") -> list[Entry]:
        """The model call failed, or (error None) was interrupted before it completed: by a
        cancel, or by a pause while the call only waited to retry (nothing was streamed, so
        resuming simply makes the call again). `partial`: the text it had streamed. It stays in
        the history as the model's message and is the run's text: what the client saw, and
        what the model said before it was cut off (it reads it at the next request); not when
        the run pauses (a pause asked for, the call broken or stalled): resuming calls again."""
        self._expect(_State.AWAIT_MODEL)
        # A pause waiting for this answer is honoured when the call fails in a way that calling
        # again can mend (resuming does): it was acknowledged, and ending `error` lost it.
        resumable = error is None or error.kind in ("transient", "stalled", "interrupted")
        paused = resumable and self._pause and not self._cancel
        records: list[Entry] = []
        if partial.strip() and not paused:  # (a resumed run would take it for its answer)
            self.rounds += 1
            self._text = partial
            message = AssistantMessage(text=partial)
            records = [Assistant(run_id=self.run_id, item=message), self._turn_end()]
        if paused:
            self._finish("paused", None)
        elif error is None or self._cancel:
            self._finish("cancelled", None)
        else:
            self._finish("error", error.message)
        return records

    def call_withdrawn(self) -> None:
        """The model call asked for was never made (a compaction ran first and a pause came in
        meanwhile): ask `next_step` again, which honours the pause."""
        self._expect(_State.AWAIT_MODEL)
        self._state = _State.NEED_MODEL

    def model_refused(self, reason: str, outcome: Outcome = "limit_reached") -> list[Entry]:
        """An interceptor refused the call before it was made (the budget is spent, a hook
        stopped the run)."""
        self._expect(_State.AWAIT_MODEL)
        self._finish(outcome, reason)
        return []

    @property
    def pause_requested(self) -> bool:
        return self._pause

    @property
    def cancel_requested(self) -> bool:
        return self._cancel

    def tool_returned(
        self, call_id: str, output: str, is_error: bool, summary: str = ""
    ) -> list[Entry]:
        self._expect(_State.AWAIT_TOOL)
        call = self._pending[0]
        if call.id != call_id:
            raise RuntimeError(f"result for {call_id}, expected {call.id}")
        self._pending.pop(0)
        self._state = _State.NEED_TOOLS
        records: list[Entry] = [self._result(call, output, is_error, summary)]
        if self._cancel or self._pause:
            records += self._stop_batch()
        elif not self._pending:
            records.append(self._turn_end())
        return records

    # --- helpers --------------------------------------------------------------------------------

    def _stop_batch(self) -> list[Entry]:
        """Close the rest of the batch with synthetic results; the run ends at this safe point."""
        reason = NOT_RUN_CANCELLED if self._cancel else NOT_RUN_PAUSED
        records: list[Entry] = self._close_calls(self._pending, reason)
        self._pending = []
        records.append(self._turn_end())
        self._finish("cancelled" if self._cancel else "paused", None)
        return records

    def _close_calls(self, calls: list[ToolCall], reason: str) -> list[Entry]:
        return [self._result(call, reason, True) for call in calls]

    def _result(
        self, call: ToolCall, output: str, is_error: bool, summary: str = ""
    ) -> ToolResultEntry:
        item = ToolResult(call_id=call.id, name=call.name, output=output, is_error=is_error)
        return ToolResultEntry(run_id=self.run_id, item=item, summary=summary)

    def _turn_end(self) -> TurnEnd:
        return TurnEnd(run_id=self.run_id, round=self.rounds)

    def _answered(self) -> None:
        if self.stop_hooks:
            self._state = _State.NEED_STOP_CHECK
        else:
            self._finish("finished", None)

    def _limit_reached(self) -> Finished:
        return self._finish("limit_reached", f"reached max_turns ({self.max_turns})")

    def _finish(self, outcome: Outcome, error: str | None) -> Finished:
        self._state = _State.DONE
        self._finished = Finished(outcome, self._text, error)
        return self._finished

    def _expect(self, state: _State) -> None:
        if self._state is not state:
            raise RuntimeError(f"unexpected result in state {self._state.value}")


def interrupted_results(
    calls: list[ToolCall], run_id: str, finished: Mapping[str, ToolOutput] | None = None
) -> list[Entry]:
    """Results for tool calls a crash left without one (used when a session is restored).
    A call in `finished` had returned, its PostToolUse hooks cut short: its output stands."""
    results: list[Entry] = []
    for c in calls:
        done = finished.get(c.id) if finished else None
        if done is not None:
            item = msgspec.structs.replace(
                done.item, output=f"{done.item.output}\n{HOOKS_CUT_SHORT_BY_CRASH}"
            )
            results.append(ToolResultEntry(run_id=run_id, item=item, summary=done.summary))
            continue
        item = ToolResult(
            call_id=c.id, name=c.name, output=interrupted_output(c.name), is_error=True
        )
        results.append(ToolResultEntry(run_id=run_id, item=item, summary="interrupted"))
    return results
