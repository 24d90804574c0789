"""The sans-IO turn machine driven by scripted model responses through every path.

Every test checks the two promises of `Turn`: every tool call in an emitted `assistant` record
gets exactly one `tool_result` record (in order, before the next model round), and the run ends
in exactly one `Finished`, which `next_step()` keeps returning.
"""

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from poddaemon.entries import Assistant, Entry, TurnEnd
from poddaemon.history import AssistantMessage, ToolCall, ToolResult, Usage
from poddaemon.llm.types import ModelResponse, ProviderError, StopReason
from poddaemon.turn import (
    CANCELLED_WHILE_RUNNING,
    INTERRUPTED,
    INTERRUPTED_COMMAND,
    INTERRUPTED_SPAWN,
    NOT_RUN_CANCELLED,
    NOT_RUN_CUT_OFF,
    NOT_RUN_PAUSED,
    CallModel,
    Finished,
    Outcome,
    RunTool,
    Turn,
    interrupted_results,
)

# --- scripting helpers ------------------------------------------------------------------------


def call(cid: str, name: str = "read_file", args: str = '{"path":"a"}') -> ToolCall:
    return ToolCall(id=cid, name=name, arguments=args)


def resp(
    text: str = "",
    calls: tuple[ToolCall, ...] = (),
    stop: StopReason | None = None,
    usage: Usage | None = None,
    detail: str = "",
) -> ModelResponse:
    if stop is None:
        stop = "tool_use" if calls else "end_turn"
    return ModelResponse(
        message=AssistantMessage(text=text, tool_calls=calls),
        stop=stop,
        usage=usage or Usage(input=10, output=2),
        detail=detail,
    )


def tool_output(c: ToolCall) -> str:
    return tool_output_for(c.id)


def tool_output_for(call_id: str) -> str:
    return f"output of {call_id}"


def check_pairing(records: list[Entry]) -> None:
    """Every call of an assistant record has exactly one result, in call order, before the next
    assistant record; no result without a call; one turn_end per assistant record, after its
    results."""
    open_calls: list[str] = []
    seen_results: Counter[str] = Counter()
    assistants = 0
    turn_ends = 0
    for rec in records:
        assert rec.run_id
        if rec.kind == "assistant":
            assert not open_calls, f"new round with unanswered calls {open_calls}"
            assert assistants == turn_ends, "new round before the previous turn_end"
            item = rec.item
            assert isinstance(item, AssistantMessage)
            open_calls = [c.id for c in item.tool_calls]
            assistants += 1
        elif rec.kind == "tool_result":
            item = rec.item
            assert isinstance(item, ToolResult)
            assert open_calls and open_calls[0] == item.call_id, (open_calls, item.call_id)
            open_calls.pop(0)
            seen_results[item.call_id] += 1
        elif rec.kind == "turn_end":
            assert not open_calls, "turn_end with unanswered calls"
            turn_ends += 1
            assert turn_ends == assistants
        else:
            raise AssertionError(f"unexpected record kind {rec.kind}")
    assert not open_calls, f"calls never answered: {open_calls}"
    assert all(n == 1 for n in seen_results.values())
    assert turn_ends == assistants


def check_terminal(turn: Turn, fin: Finished) -> None:
    assert turn.done
    for _ in range(3):
        assert turn.next_step() is fin
    # Nothing can be fed to a finished turn.
    with pytest.raises(RuntimeError):
        turn.model_returned(resp("late"))
    with pytest.raises(RuntimeError):
        turn.model_failed(None)
    with pytest.raises(RuntimeError):
        turn.tool_returned("x", "y", False)
    with pytest.raises(RuntimeError):
        turn.next_tool()
    # Late requests do not change the outcome.
    turn.request_pause()
    turn.request_cancel()
    assert turn.next_step() is fin


def results_of(records: list[Entry]) -> list[ToolResult]:
    return [r.item for r in records if r.kind == "tool_result"]


@dataclass
class Run:
    """A scripted pod: calls the model and runs tools the way pod.py does."""

    turn: Turn
    records: list[Entry] = field(default_factory=list)
    steps: list[CallModel | RunTool] = field(default_factory=list)

    def model(self, response: ModelResponse, more_input: bool = False) -> None:
        step = self.turn.next_step()
        assert isinstance(step, CallModel)
        self.steps.append(step)
        self.records += self.turn.model_returned(response, more_input=more_input)

    def tools(self, stop_after: int | None = None, action: str = "") -> list[ToolCall]:
        """Run the batch; after `stop_after` tools, request `action` (pause/cancel)."""
        ran = []
        while self.turn.in_tools and (tool := self.turn.next_tool()) is not None:
            self.steps.append(tool)
            ran.append(tool.call)
            if stop_after is not None and len(ran) == stop_after:
                getattr(self.turn, f"request_{action}")()
            self.records += self.turn.tool_returned(tool.call.id, tool_output(tool.call), False)
        return ran

    def finish(self) -> Finished:
        fin = self.turn.next_step()
        assert isinstance(fin, Finished)
        check_pairing(self.records)
        check_terminal(self.turn, fin)
        return fin


# --- the paths --------------------------------------------------------------------------------


def test_plain_answer_finishes_with_its_text() -> None:
    run = Run(Turn("r1", max_turns=5))
    run.model(resp("hello", usage=Usage(input=7, output=3, cache_read=1)))
    assert [r.kind for r in run.records] == ["assistant", "turn_end"]
    assert run.records[0] == Assistant(run_id="r1", item=AssistantMessage(text="hello"))
    assert run.records[1] == TurnEnd(run_id="r1", round=1)
    assert not run.turn.in_tools
    fin = run.finish()
    assert fin == Finished("finished", "hello", None)
    assert run.turn.rounds == 1
    assert run.turn.usage == Usage(input=7, output=3, cache_read=1)


def test_tool_loop_over_several_rounds() -> None:
    run = Run(Turn("r", max_turns=10))
    run.model(resp("looking", (call("a"),)))
    assert run.turn.in_tools
    assert run.tools() == [call("a")]
    run.model(resp("", (call("b", "grep"),)))
    assert run.tools() == [call("b", "grep")]
    run.model(resp("done: 42"))
    fin = run.finish()
    assert fin == Finished("finished", "done: 42")
    assert [s.round for s in run.steps if isinstance(s, CallModel)] == [1, 2, 3]
    assert [(r.call_id, r.output, r.is_error) for r in results_of(run.records)] == [
        ("a", "output of a", False),
        ("b", "output of b", False),
    ]
    assert [r.round for r in run.records if r.kind == "turn_end"] == [1, 2, 3]
    assert run.turn.usage == Usage(input=30, output=6)


def test_text_of_an_earlier_round_is_kept_when_the_last_has_none() -> None:
    run = Run(Turn("r", max_turns=10))
    run.model(resp("partial answer", (call("a"),)))
    run.tools()
    run.model(resp(""))
    assert run.finish().text == "partial answer"


def test_parallel_calls_each_get_exactly_one_result_in_order() -> None:
    run = Run(Turn("r", max_turns=5))
    calls = (call("c1"), call("c2", "glob"), call("c3", "grep"))
    run.model(resp("", calls))
    assert run.tools() == list(calls)
    kinds = [r.kind for r in run.records]
    assert kinds == ["assistant", "tool_result", "tool_result", "tool_result", "turn_end"]
    assert [r.call_id for r in results_of(run.records)] == ["c1", "c2", "c3"]
    assert [r.name for r in results_of(run.records)] == ["read_file", "glob", "grep"]
    run.model(resp("ok"))
    assert run.finish().outcome == "finished"


def test_next_tool_then_none_then_the_model_again() -> None:
    turn = Turn("r", max_turns=5)
    assert turn.next_step() == CallModel(1)
    turn.model_returned(resp("", (call("a"),)))
    with pytest.raises(RuntimeError):
        turn.next_step()  # results must come first
    assert turn.next_tool() == RunTool(call("a"))
    with pytest.raises(RuntimeError):
        turn.next_step()  # waiting for the tool
    with pytest.raises(RuntimeError, match="expected a"):
        turn.tool_returned("zzz", "x", False)
    assert [r.kind for r in turn.tool_returned("a", "x", False)] == ["tool_result", "turn_end"]
    assert turn.next_tool() is None
    assert turn.next_step() == CallModel(2)


def test_tool_result_for_the_wrong_call_does_not_lose_the_call() -> None:
    turn = Turn("r", max_turns=5)
    turn.next_step()
    turn.model_returned(resp("", (call("a"), call("b"))))
    assert turn.next_tool() == RunTool(call("a"))
    with pytest.raises(RuntimeError):
        turn.tool_returned("b", "x", False)
    # The mistaken result must not have consumed call "a": it can still be answered.
    recs = turn.tool_returned("a", "x", False)
    assert [r.item.call_id for r in recs] == ["a"]
    assert turn.next_tool() == RunTool(call("b"))


def test_max_turns_ends_limit_reached() -> None:
    run = Run(Turn("r", max_turns=2))
    run.model(resp("one", (call("a"),)))
    run.tools()
    run.model(resp("two", (call("b"),)))
    run.tools()
    fin = run.finish()
    assert fin.outcome == "limit_reached"
    assert fin.text == "two"
    assert fin.error == "reached max_turns (2)"
    assert sum(isinstance(s, CallModel) for s in run.steps) == 2


def test_resumed_turn_keeps_counting_rounds() -> None:
    run = Run(Turn("r", max_turns=3, rounds=2))
    run.model(resp("", (call("a"),)))
    assert run.steps[0] == CallModel(3)
    run.tools()
    assert run.finish().outcome == "limit_reached"


def test_max_turns_zero_never_calls_the_model() -> None:
    run = Run(Turn("r", max_turns=0))
    fin = run.finish()
    assert fin == Finished("limit_reached", "", "reached max_turns (0)")
    assert run.records == []


def test_pause_mid_tools_closes_the_rest_and_ends_paused() -> None:
    run = Run(Turn("r", max_turns=5))
    calls = (call("c1"), call("c2"), call("c3"))
    run.model(resp("", calls))
    ran = run.tools(stop_after=1, action="pause")
    assert ran == [calls[0]]
    res = results_of(run.records)
    assert [(r.call_id, r.output, r.is_error) for r in res] == [
        ("c1", "output of c1", False),
        ("c2", NOT_RUN_PAUSED, True),
        ("c3", NOT_RUN_PAUSED, True),
    ]
    assert run.records[-1].kind == "turn_end"
    fin = run.finish()
    assert fin == Finished("paused", "", None)
    assert run.turn.rounds == 1


def test_pause_during_the_model_call_runs_no_tool() -> None:
    run = Run(Turn("r", max_turns=5))
    assert isinstance(run.turn.next_step(), CallModel)
    run.turn.request_pause()
    run.records += run.turn.model_returned(resp("", (call("a"), call("b"))))
    assert not run.turn.in_tools
    assert [r.output for r in results_of(run.records)] == [NOT_RUN_PAUSED, NOT_RUN_PAUSED]
    assert run.finish().outcome == "paused"


def test_pause_between_rounds_stops_before_the_next_model_call() -> None:
    run = Run(Turn("r", max_turns=5))
    run.model(resp("", (call("a"),)))
    run.tools(stop_after=1, action="pause")
    # The batch was complete, so nothing synthetic; the run stops before calling the model.
    assert [r.output for r in results_of(run.records)] == ["output of a"]
    assert run.finish().outcome == "paused"


def test_cancel_mid_stream_is_cancelled() -> None:
    run = Run(Turn("r", max_turns=5))
    assert isinstance(run.turn.next_step(), CallModel)
    run.turn.request_cancel()
    assert run.turn.model_failed(None) == []
    fin = run.finish()
    assert fin == Finished("cancelled", "", None)
    assert run.records == []


def test_cancel_mid_stream_keeps_the_text_streamed_so_far() -> None:
    run = Run(Turn("r", max_turns=5))
    assert isinstance(run.turn.next_step(), CallModel)
    run.turn.request_cancel()
    run.records += run.turn.model_failed(None, "Here is the first ha")
    assert run.finish() == Finished("cancelled", "Here is the first ha", None)
    assistant, end = run.records
    assert isinstance(assistant, Assistant) and isinstance(end, TurnEnd)
    assert assistant.item == AssistantMessage(text="Here is the first ha")
    assert run.turn.rounds == 1 == end.round


def test_a_stream_broken_after_output_keeps_its_text_and_ends_error() -> None:
    turn = Turn("r", max_turns=5)
    turn.next_step()
    records = turn.model_failed(ProviderError("interrupted", "stream cut"), "half an ans")
    assert [type(r) for r in records] == [Assistant, TurnEnd]
    assert turn.next_step() == Finished("error", "half an ans", "stream cut")


@pytest.mark.parametrize(
    ("pause", "partial", "outcome"),
    [
        (True, "some text", "paused"),  # a resume would take kept text for the run's answer
        (False, "\n  ", "cancelled"),  # whitespace alone is nothing said
    ],
)
def test_no_streamed_text_is_kept_for_a_pause_or_when_blank(
    pause: bool, partial: str, outcome: Outcome
) -> None:
    turn = Turn("r", max_turns=5)
    turn.next_step()
    if pause:
        turn.request_pause()
    else:
        turn.request_cancel()
    assert turn.model_failed(None, partial) == []
    assert turn.next_step() == Finished(outcome, "", None)


def test_interrupted_stream_without_a_request_is_cancelled() -> None:
    turn = Turn("r", max_turns=5)
    turn.next_step()
    turn.model_failed(None)
    assert turn.next_step() == Finished("cancelled", "", None)


def test_cancel_mid_tools_closes_the_rest_as_cancelled() -> None:
    run = Run(Turn("r", max_turns=5))
    run.model(resp("", (call("c1"), call("c2"), call("c3"))))
    run.tools(stop_after=2, action="cancel")
    assert [r.output for r in results_of(run.records)] == [
        "output of c1",
        "output of c2",
        NOT_RUN_CANCELLED,
    ]
    assert run.finish().outcome == "cancelled"


def test_cancel_wins_over_pause() -> None:
    run = Run(Turn("r", max_turns=5))
    assert isinstance(run.turn.next_step(), CallModel)
    run.turn.request_pause()
    run.turn.request_cancel()
    run.records += run.turn.model_returned(resp("", (call("a"),)))
    assert [r.output for r in results_of(run.records)] == [NOT_RUN_CANCELLED]
    assert run.finish().outcome == "cancelled"


def test_cancel_with_a_complete_final_answer_is_cancelled_with_its_text() -> None:
    run = Run(Turn("r", max_turns=5))
    assert isinstance(run.turn.next_step(), CallModel)
    run.turn.request_cancel()
    run.records += run.turn.model_returned(resp("the answer"), more_input=True)
    assert run.finish() == Finished("cancelled", "the answer", None)


def test_provider_error_ends_error_with_the_message() -> None:
    run = Run(Turn("r", max_turns=5))
    run.model(resp("", (call("a"),)))
    run.tools()
    assert isinstance(run.turn.next_step(), CallModel)
    assert run.turn.model_failed(ProviderError("fatal", "401 bad key", status=401)) == []
    fin = run.finish()
    assert fin == Finished("error", "", "401 bad key")


def test_provider_error_after_cancel_is_cancelled() -> None:
    turn = Turn("r", max_turns=5)
    turn.next_step()
    turn.request_cancel()
    turn.model_failed(ProviderError("interrupted", "stream cut"))
    assert turn.next_step().outcome == "cancelled"  # type: ignore[union-attr]


def test_output_limit_with_tool_calls_closes_them_without_running() -> None:
    run = Run(Turn("r", max_turns=5))
    run.model(resp("writing", (call("a"), call("b")), stop="max_tokens"))
    assert not run.turn.in_tools
    assert [(r.call_id, r.output, r.is_error) for r in results_of(run.records)] == [
        ("a", NOT_RUN_CUT_OFF, True),
        ("b", NOT_RUN_CUT_OFF, True),
    ]
    fin = run.finish()
    assert fin.outcome == "error"
    assert fin.text == "writing"
    assert fin.error is not None and "incomplete" in fin.error and "max_tokens" in fin.error
    assert not any(isinstance(s, RunTool) for s in run.steps)


def test_output_limit_without_calls_is_an_incomplete_error() -> None:
    run = Run(Turn("r", max_turns=5))
    run.model(resp("half an ans", stop="max_tokens"))
    fin = run.finish()
    assert fin.outcome == "error" and "incomplete" in (fin.error or "")


@pytest.mark.parametrize(
    ("stop", "detail", "expect"),
    [
        ("content_filter", "violence", "content_filter: violence"),
        ("content_filter", "", "content_filter: content filter"),
        ("context_overflow", "", "context_overflow: context overflow"),
    ],
)
def test_stopped_response_is_an_error_with_the_reason(
    stop: StopReason, detail: str, expect: str
) -> None:
    run = Run(Turn("r", max_turns=5))
    run.model(resp("", (call("a"),), stop=stop, detail=detail))
    [res] = results_of(run.records)
    assert res.is_error and "stopped" in res.output
    assert (detail or stop.replace("_", " ")) in res.output
    fin = run.finish()
    assert fin.outcome == "error"
    assert fin.error == expect


def test_steer_on_a_final_answer_gives_another_round() -> None:
    run = Run(Turn("r", max_turns=5))
    run.model(resp("first take"), more_input=True)
    assert not run.turn.done
    run.model(resp("revised"), more_input=False)
    fin = run.finish()
    assert fin == Finished("finished", "revised")
    assert [s.round for s in run.steps] == [1, 2]  # type: ignore[union-attr]


def test_a_pause_during_the_final_answer_holds_and_steer_waits() -> None:
    # The pause was acknowledged `paused: true`, so the run ends paused (the answer is kept;
    # resuming finishes the run) and the steer input waits for the resume.
    run = Run(Turn("r", max_turns=5))
    assert isinstance(run.turn.next_step(), CallModel)
    run.turn.request_pause()
    run.records += run.turn.model_returned(resp("answer"), more_input=True)
    assert run.finish().outcome == "paused"


def test_steer_still_respects_max_turns() -> None:
    run = Run(Turn("r", max_turns=1))
    run.model(resp("first"), more_input=True)
    assert run.finish().outcome == "limit_reached"


def test_tool_error_results_are_passed_through() -> None:
    turn = Turn("r", max_turns=5)
    turn.next_step()
    turn.model_returned(resp("", (call("a"),)))
    turn.next_tool()
    [res, end] = turn.tool_returned("a", "outside scope: /etc", True)
    assert res.item == ToolResult(
        call_id="a", name="read_file", output="outside scope: /etc", is_error=True
    )
    assert end.kind == "turn_end"


def test_interrupted_results_close_each_call_saying_what_it_was_doing() -> None:
    recs = interrupted_results([call("x"), call("y", "bash"), call("z", "spawn_pod")], "r9")
    assert [r.kind for r in recs] == ["tool_result"] * 3
    assert [r.run_id for r in recs] == ["r9"] * 3
    assert [r.item for r in recs] == [
        ToolResult(call_id="x", name="read_file", output=INTERRUPTED, is_error=True),
        ToolResult(call_id="y", name="bash", output=INTERRUPTED_COMMAND, is_error=True),
        ToolResult(call_id="z", name="spawn_pod", output=INTERRUPTED_SPAWN, is_error=True),
    ]


# --- the property -----------------------------------------------------------------------------

TOOL_STOPS: list[StopReason] = ["tool_use"] * 6 + [
    "end_turn",
    "other",
    "max_tokens",
    "content_filter",
    "context_overflow",
]
FINAL_STOPS: list[StopReason] = ["end_turn"] * 4 + [
    "other",
    "max_tokens",
    "content_filter",
    "context_overflow",
]


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[ModelResponse | ProviderError | None, bool]]:
    script: list[tuple[ModelResponse | ProviderError | None, bool]] = []
    for i in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["resp"] * 8 + ["error", "interrupted"]))
        if kind == "error":
            script.append((ProviderError("fatal", f"boom {i}"), False))
            continue
        if kind == "interrupted":
            script.append((None, False))
            continue
        n = draw(st.integers(0, 3))
        calls = tuple(call(f"c{i}_{j}", f"tool{j}") for j in range(n))
        stop = draw(st.sampled_from(TOOL_STOPS if calls else FINAL_STOPS))
        text = draw(st.sampled_from(["", f"text {i}"]))
        usage = Usage(input=draw(st.integers(0, 50)), output=draw(st.integers(0, 50)))
        script.append((resp(text, calls, stop, usage), draw(st.booleans())))
    return script


@settings(max_examples=400, deadline=None)
@given(
    script=scripts(),
    max_turns=st.sampled_from([0, 1, 2, 3, 5, 10, 10, 10]),
    start_rounds=st.integers(0, 2),
    inject=st.dictionaries(
        st.integers(1, 24),
        st.sampled_from(["pause", "pause", "cancel", "cancel_interrupt"]),
        max_size=2,
    ),
)
def test_random_scripts_keep_the_invariants(
    script: list[tuple[ModelResponse | ProviderError | None, bool]],
    max_turns: int,
    start_rounds: int,
    inject: dict[int, str],
) -> None:
    turn = Turn("run", max_turns=max_turns, rounds=start_rounds)
    records: list[Entry] = []
    steps: list[CallModel | RunTool | Finished] = []
    remaining = list(script)
    point = 0
    requested_at: int | None = None  # len(steps) when the first pause/cancel was requested
    cancel_requested = False
    pause_requested = False
    interrupt = False
    returned: list[ModelResponse] = []
    texts: list[str] = []  # each round's text, an interrupted one's streamed text too
    rounds_with_text = 0  # interrupted rounds whose streamed text was kept
    ran: list[ToolCall] = []
    last_failure: ProviderError | None = None

    def tick() -> None:
        """A point where the outside world may request a pause or a cancel."""
        nonlocal point, requested_at, cancel_requested, pause_requested, interrupt
        point += 1
        action = inject.get(point)
        if action is None or turn.done:
            return
        if requested_at is None:
            requested_at = len(steps)
        if action == "pause":
            pause_requested = True
            turn.request_pause()
        else:
            cancel_requested = True
            interrupt = interrupt or action == "cancel_interrupt"
            turn.request_cancel()

    while True:
        tick()
        step = turn.next_step()
        steps.append(step)
        if isinstance(step, Finished):
            break
        assert isinstance(step, CallModel)
        tick()  # while the model streams
        reply, more = remaining.pop(0) if remaining else (resp("fallback"), False)
        if interrupt or reply is None:
            streamed = "cut o" if reply is None else ""  # a scripted interruption streamed text
            kept = "" if pause_requested and not cancel_requested else streamed  # (not on a pause)
            texts.append(kept)
            rounds_with_text += bool(kept)
            records += turn.model_failed(None, kept)
        elif isinstance(reply, ProviderError):
            last_failure = reply
            records += turn.model_failed(reply)
        else:
            returned.append(reply)
            texts.append(reply.message.text)
            records += turn.model_returned(reply, more_input=more)
        while turn.in_tools:
            tick()
            tool = turn.next_tool()
            if tool is None:
                break
            steps.append(tool)
            ran.append(tool.call)
            tick()  # while the tool runs
            if interrupt:
                out, err = CANCELLED_WHILE_RUNNING, True
            else:
                out, err = tool_output(tool.call), False
            records += turn.tool_returned(tool.call.id, out, err)

    fin = steps[-1]
    assert isinstance(fin, Finished)
    event(f"outcome={fin.outcome}")
    event(f"tools run={min(len(ran), 3)}")
    check_pairing(records)
    check_terminal(turn, fin)
    assert sum(isinstance(s, Finished) for s in steps) == 1

    # Model rounds are numbered on from where the run stood, and never exceed max_turns.
    rounds = [s.round for s in steps if isinstance(s, CallModel)]
    assert rounds == list(range(start_rounds + 1, start_rounds + 1 + len(rounds)))
    assert all(r <= max_turns for r in rounds)
    assert turn.rounds == start_rounds + len(returned) + rounds_with_text

    # Only tools the model asked for ran, each once, and their real output was recorded.
    asked = [c for r in returned for c in r.message.tool_calls]
    assert len(set(c.id for c in ran)) == len(ran)
    assert all(c in asked for c in ran)
    ran_ids = {c.id for c in ran}
    for res in results_of(records):
        if res.call_id in ran_ids:
            assert res.output in (tool_output_for(res.call_id), CANCELLED_WHILE_RUNNING)
        else:
            assert res.is_error and res.output.startswith("not run:")

    # Usage adds up; the text is the last non-empty text.
    total = Usage()
    for r in returned:
        total.add(r.usage)
    assert turn.usage == total
    said = [t for t in texts if t]
    assert fin.text == (said[-1] if said else "")

    # Outcomes are explained by what happened.
    if fin.outcome == "cancelled":
        assert cancel_requested or any(r is None for r, _ in script)
    if fin.outcome == "paused":
        assert pause_requested and not cancel_requested
    if fin.outcome == "error":
        assert fin.error
    else:
        assert fin.error is None or fin.outcome == "limit_reached"
    if last_failure is not None and not cancel_requested and fin.outcome == "error":
        assert fin.error == last_failure.message or fin.error.startswith(
            ("incomplete", "content_filter", "context_overflow")
        )

    # A pause or cancel takes effect at the next safe point: no model call after it, and at most
    # the one tool that was already being handed out.
    if requested_at is not None:
        after = steps[requested_at:]
        assert not any(isinstance(s, CallModel) for s in after)
        assert sum(isinstance(s, RunTool) for s in after) <= 1
