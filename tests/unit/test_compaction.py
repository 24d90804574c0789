"""Compaction's rules, driven through the real machine (no I/O) and the pure selection."""

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from poddaemon import compaction
from poddaemon.history import AssistantMessage, Item, SystemNote, ToolCall, ToolResult, UserMessage
from poddaemon.llm.types import ProviderError
from poddaemon.machine import (
    MAX_TAKEN_UP_IN_ROW,
    NOTIFY_MAX_DELAY,
    RESTART_NOTE,
    CallModel,
    MachineConfig,
    Summarize,
    SwitchSession,
)
from poddaemon.session import fold
from protocol import errors
from tests.unit.machine_driver import Driver
from tests.unit.test_restore import check_fold_matches, check_pairing, check_runs_end_once
from tests.unit.test_restore import crash as restore_crash
from tests.unit.test_restore import step as restore_step
from tests.unit.test_restore import work as restore_work


def driver(threshold: int | None = 100, retained: int = 1, max_turns: int = 40) -> Driver:
    cfg = MachineConfig(
        name="p",
        model="m",
        max_turns=max_turns,
        max_pending=50,
        compact_threshold=threshold,
        compact_retained_turns=retained,
        provider_kind="openai",
    )
    return Driver(cfg=cfg)


def events(d: Driver, type_: str) -> list[dict[str, Any]]:
    return [data for t, data, _ in d.events if t == type_]


def tool_round(d: Driver, usage: int) -> None:
    d.model("working", calls=1, usage=usage)
    d.tool("output of the tool " * 20)


def test_a_round_over_the_threshold_compacts_mid_run_and_the_run_goes_on_in_the_new_session() -> (
    None
):
    d = driver(threshold=100)
    token = d.call("run", "the task, verbatim")
    run_id = d.answer(token).result.run_id
    tool_round(d, usage=50)  # under the threshold: the next call is a model call
    assert isinstance(d.inflight, CallModel)
    tool_round(d, usage=150)  # over it: a summary first
    assert isinstance(d.inflight, Summarize)
    assert d.inflight.items[-1].text == compaction.SUMMARY_PROMPT  # type: ignore[union-attr]
    assert events(d, "compaction.started") == [{"reason": "auto", "input_tokens": 150}]
    old_id = d.machine.state.session_id
    d.summarize("SUMMARY OF WORK")
    assert len(d.old_sessions) == 1 and d.old_sessions[0][-1]["kind"] == "llm_usage"
    start = d.entries[0]
    assert start["kind"] == "session_start" and start["compacted_from"] == old_id
    (finished,) = events(d, "compaction.finished")
    assert finished["session_id"] == start["session_id"] and finished["before_tokens"] == 150
    assert 0 < finished["after_tokens"] < 150
    call = d.inflight
    assert isinstance(call, CallModel) and call.run_id == run_id
    first, second, third = call.items[:3]
    assert isinstance(first, UserMessage) and "SUMMARY OF WORK" in first.text
    assert second == UserMessage(text="the task, verbatim")
    assert isinstance(third, AssistantMessage) and third.tool_calls  # the last round, whole
    assert isinstance(call.items[3], ToolResult)
    assert call.items[3].call_id == third.tool_calls[0].id
    d.model("done")
    assert [e["kind"] for e in d.entries].count("run_end") == 1
    assert [data["outcome"] for data in events(d, "run.finished")] == ["finished"]
    # The summary's own usage is in the totals and in the run's usage.
    assert d.machine.state.usage.input == 50 + 150 + 5 + 10
    # The new session folds to the state the machine continued with.
    again = fold(d.entries)
    assert again.history == d.machine.state.history
    assert again.usage == d.machine.state.usage


def test_a_compaction_a_crash_cut_short_is_made_again_after_the_restore() -> None:
    """The last call reported a context over the threshold, then the pod died while the summary
    was being made: the restored pod summarizes before its next model call, as the pod that
    died would have (it used to send the whole context again)."""
    d = driver(threshold=100)
    d.call("run", "the task")
    tool_round(d, usage=50)  # a round a summary can replace
    tool_round(d, usage=150)
    assert isinstance(d.inflight, Summarize)
    again = Driver(cfg=d.cfg, now=d.now + 100, n=d.n + 1000)  # kill -9 mid-summary
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(iter(d.entries)))  # read once, as the log hands them over
    again.call("run", "go on")
    assert isinstance(again.inflight, Summarize)
    assert events(again, "compaction.started") == [{"reason": "auto", "input_tokens": 150}]


def test_the_run_that_takes_up_one_cut_off_during_its_compaction_keeps_its_input() -> None:
    """Found by QA: killed while the summary at a round was made, the pod restarted, and the
    run its restart note started compacted first, from the note on: the cut-off run's input
    went into the summary, and the model read "continue where you left off" with no task.
    The run that takes the work up owns the cut-off run's items: its input stays verbatim,
    also in a fork (an instruction rendering `now` forks at every start)."""
    d = driver(threshold=100)
    d.call("run", "the task, verbatim")
    tool_round(d, usage=50)
    tool_round(d, usage=150)
    assert isinstance(d.inflight, Summarize)
    again = Driver(cfg=d.cfg, now=d.now + 100, n=d.n + 1000)  # kill -9 mid-summary
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(iter(d.entries)))
    cut_off_from = again.machine.state.run_from
    assert again.machine.state.take_up_from == cut_off_from
    forked = Driver(cfg=d.cfg, now=d.now + 100, n=d.n + 1000)
    forked.lines, forked.entries, forked.prev = list(d.lines), list(d.entries), d.prev
    forked.feed(forked.machine.restore(iter(d.entries)))
    assert fold([forked.machine.fork()]).take_up_from == cut_off_from
    again.tick(NOTIFY_MAX_DELAY)  # the note starts the run that takes the work up
    assert again.machine.state.run_from == cut_off_from
    assert again.machine.state.take_up_from is None
    assert isinstance(again.inflight, Summarize)
    again.summarize("SUMMARY OF WORK")
    call = again.inflight
    assert isinstance(call, CallModel)
    assert call.items[1] == UserMessage(text="the task, verbatim")
    assert RESTART_NOTE in call.items[-1].text  # type: ignore[union-attr]


def test_a_held_restart_note_leaves_the_next_runs_items_its_own() -> None:
    """Past MAX_TAKEN_UP_IN_ROW the note waits for a new task: the run that input starts does
    not take the cut-off run's items for its own."""
    d = driver(threshold=None)
    d.call("run", "work")
    for _ in range(MAX_TAKEN_UP_IN_ROW + 1):
        again = Driver(cfg=d.cfg, now=d.now + 100, n=d.n + 1000)
        again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
        again.feed(again.machine.restore(d.entries))
        again.tick(NOTIFY_MAX_DELAY)
        d = again
    assert d.inflight is None and d.machine.state.take_up_from is None
    d.call("run", "a new task")
    assert d.machine.state.run_from == len(d.machine.state.history) - 2  # its input, the note


def test_notifications_acked_before_a_compaction_reach_the_first_request_after_it() -> None:
    d = driver(threshold=100)
    d.call("run", "task")
    tool_round(d, usage=50)  # a round a summary can replace
    d.model("working", calls=1, usage=500)
    note = d.call("notify", "the build failed", source="ci")
    assert d.answer(note).result.notification_id
    d.tool()
    assert isinstance(d.inflight, Summarize)
    late = d.call("notify", "arrived during the summary", source="ci")
    d.summarize("short")
    assert d.answer(late).error is None
    call = d.inflight
    assert isinstance(call, CallModel)
    notes = [i for i in call.items if isinstance(i, SystemNote)]
    assert notes and "the build failed" in notes[-1].text
    assert "arrived during the summary" in notes[-1].text


def test_no_summary_is_asked_while_every_round_is_one_compaction_keeps() -> None:
    """Over the threshold with no more rounds than compact_retained_turns keeps, a summary
    could only add to the context: it was asked for anyway (a call over the whole context,
    paid for nothing), and thrown away. The first round it can replace is summarized."""
    d = driver(threshold=100, retained=2)
    d.call("run", "task")
    tool_round(d, usage=500)
    assert isinstance(d.inflight, CallModel) and not events(d, "compaction.started")
    tool_round(d, usage=500)
    assert isinstance(d.inflight, CallModel)  # two rounds: both kept
    tool_round(d, usage=500)
    assert isinstance(d.inflight, Summarize)  # the first of three can go


def test_summarizable_is_false_only_when_compaction_would_keep_everything() -> None:
    task, answer = UserMessage(text="task"), AssistantMessage(text="a")
    assert not compaction.summarizable([], None, 2)
    assert not compaction.summarizable([task, answer], 0, 2)
    assert compaction.summarizable([task, answer], 0, 0)  # no round kept
    assert compaction.summarizable([task, answer, UserMessage(text="t2")], 2, 2)  # before the run
    assert compaction.summarizable([answer, answer, answer], None, 2)


def test_no_compaction_without_config_or_below_the_threshold() -> None:
    d = driver(threshold=None)
    d.call("run", "task")
    for _ in range(3):
        tool_round(d, usage=10**6)
        assert isinstance(d.inflight, CallModel)


def test_a_useless_summary_is_not_applied_and_not_repeated_in_that_run() -> None:
    d = driver(threshold=100)
    d.call("run", "task")
    tool_round(d, usage=50)  # a round a summary can replace
    tool_round(d, usage=500)
    sid = d.machine.state.session_id
    d.summarize("x" * 100_000)  # larger than the history it replaces
    assert events(d, "compaction.failed") == [
        {"error": "the summary did not make the context smaller"}
    ]
    assert d.machine.state.session_id == sid and not d.old_sessions
    for _ in range(3):  # the thrash guard: over the threshold, but no second try in this run
        assert isinstance(d.inflight, CallModel)
        tool_round(d, usage=500)
    d.model("end")
    d.call("run", "next task")
    tool_round(d, usage=500)
    assert isinstance(d.inflight, Summarize)  # a new run may compact again


def test_an_empty_summary_is_a_failure_the_next_round_retries_not_a_useless_one() -> None:
    """An empty answer (a glitch of the compaction model) was reported as "the summary did not
    make the context smaller" and set the thrash guard: no compaction for the rest of the run,
    whose context then grew unchecked until the provider refused it."""
    d = driver(threshold=100)
    d.call("run", "task")
    tool_round(d, usage=50)  # a round a summary can replace
    tool_round(d, usage=500)
    sid = d.machine.state.session_id
    d.summarize("  \n")
    assert events(d, "compaction.failed") == [{"error": "the summary was empty"}]
    assert d.machine.state.session_id == sid and not d.old_sessions
    tool_round(d, usage=500)
    assert isinstance(d.inflight, Summarize)  # tried again: one empty answer is no thrash
    d.summarize("a real summary")
    assert d.machine.state.session_id != sid
    (finished,) = events(d, "compaction.finished")
    assert finished["after_tokens"] < finished["before_tokens"]


def test_an_empty_summary_fails_a_manual_compact_saying_so() -> None:
    d = driver(threshold=None)
    d.call("run", "task")
    d.model("end")
    token = d.call("compact")
    d.summarize("")
    error = d.answer(token).error
    assert error is not None and error.code == errors.INTERNAL_ERROR
    assert error.message == "compaction failed: the summary was empty"


def test_a_compaction_shrinking_less_than_5_percent_is_kept_but_not_repeated_in_that_run() -> None:
    d = driver(threshold=100, retained=0)
    d.call("run", "task")
    tool_round(d, usage=500)
    st_ = d.machine.state
    before = compaction.estimate_tokens("", st_.history)

    def after(n: int) -> int:
        new, _ = compaction.build_history(st_.history, st_.run_from, "y" * n, 0, [])
        return compaction.estimate_tokens("", new)

    n = 0  # a summary about as big as what it replaces: a shrink of about 3 %
    while after(n) < before * 0.97:
        n += 4
    d.summarize("y" * n)
    (finished,) = events(d, "compaction.finished")
    assert finished["after_tokens"] > 0.9 * finished["before_tokens"]
    for _ in range(3):
        tool_round(d, usage=500)
        assert isinstance(d.inflight, CallModel)


def test_the_run_ends_context_full_only_when_the_provider_then_rejects_the_request() -> None:
    d = driver(threshold=100)
    d.call("run", "task")
    tool_round(d, usage=50)  # a round a summary can replace
    tool_round(d, usage=500)
    d.summarize("z" * 100_000)
    tool_round(d, usage=500)
    d.model_fails(ProviderError("context_overflow", "prompt is too long", 400))
    (done,) = events(d, "run.finished")
    assert done["outcome"] == "error" and done["error"].startswith("context full: ")


def test_three_failures_in_a_row_trip_the_breaker_until_a_manual_compact_succeeds() -> None:
    d = driver(threshold=100)
    d.call("run", "task")
    tool_round(d, usage=50)  # a round a summary can replace
    for _ in range(3):
        tool_round(d, usage=500)
        d.summarize_fails("the compaction model is down")
        assert isinstance(d.inflight, CallModel)  # the run goes on uncompacted
    (alert,) = events(d, "alert")
    assert alert["source"] == "compaction" and "off" in alert["message"]
    assert d.machine.auto_compaction_off
    for _ in range(2):
        tool_round(d, usage=500)
        assert isinstance(d.inflight, CallModel)
    d.model("end")
    busy_free = d.call("compact")
    assert isinstance(d.inflight, Summarize) and d.inflight.reason == "manual"
    d.summarize("manual summary")
    assert d.answer(busy_free).result.session_id == d.machine.state.session_id
    assert not d.machine.auto_compaction_off
    d.call("run", "again")
    tool_round(d, usage=500)
    assert isinstance(d.inflight, Summarize)  # automatic compaction is back


def test_compact_is_refused_busy_while_a_run_is_active_and_answers_the_new_session_when_idle() -> (
    None
):
    d = driver(threshold=None)
    d.call("run", "task")
    busy = d.call("compact")
    assert d.answer(busy).error is not None and d.answer(busy).error.code == errors.BUSY
    d.model("done")
    token = d.call("compact")
    again = d.call("compact")  # while the first is in flight
    assert d.answer(again).error is not None and d.answer(again).error.code == errors.BUSY
    # Busy meanwhile, as a client sees it: running, a run is queued, a notification wakes no one.
    assert d.machine.pod_state == "running"
    assert [e["state"] for e in events(d, "state.changed")][-1] == "running"
    queued = d.call("run", "waits for the compaction")
    assert d.answer(queued).result.state == "queued" and d.answer(queued).result.position == 1
    assert d.answer(d.call("notify", "meanwhile", "ci")).result.wakes is False
    assert isinstance(d.inflight, Summarize)
    d.summarize("idle summary")
    new_id = d.answer(token).result.session_id
    assert new_id == d.entries[0]["session_id"] != d.old_sessions[0][0]["session_id"]
    call = d.inflight
    assert isinstance(call, CallModel)  # the queued run started in the new session
    # running through the compaction and into the queued run, never a moment idle between
    assert [e["state"] for e in events(d, "state.changed")] == ["running", "idle", "running"]
    assert "idle summary" in call.items[0].text  # type: ignore[union-attr]
    assert call.items[-2] == UserMessage(text="waits for the compaction")
    assert "meanwhile" in call.items[-1].text  # type: ignore[union-attr]


def test_a_notification_during_a_manual_compaction_says_it_wakes_the_pod() -> None:
    """It answered `wakes: false` (the pod said "running"), yet no run was active and the pod
    ran a turn for it as soon as the compaction ended, whatever its end."""
    for end in ("summary", "failed", "cancelled"):
        d = driver(threshold=None)
        d.call("run", "task")
        d.model("end")
        d.call("compact")
        assert d.answer(d.call("notify", "meanwhile", "ci")).result.wakes is True
        if end == "cancelled":
            d.call("cancel")
            d.summarize_fails(None)
        elif end == "failed":
            d.summarize_fails("down")
        else:
            d.summarize("idle summary")
        for _ in range(5):  # the burst settles, then the run for it starts
            if isinstance(d.inflight, CallModel):
                break
            d.tick(5.0)
        call = d.inflight
        assert isinstance(call, CallModel), end
        assert "meanwhile" in call.items[-1].text  # type: ignore[union-attr]


def test_cancel_during_a_compaction_ends_the_run_cancelled_in_the_old_session() -> None:
    d = driver(threshold=100)
    d.call("run", "task")
    tool_round(d, usage=50)  # a round a summary can replace
    tool_round(d, usage=500)
    sid = d.machine.state.session_id
    d.call("cancel")
    assert d.interrupted
    d.summarize_fails(None)
    assert d.machine.state.session_id == sid
    (done,) = events(d, "run.finished")
    assert done["outcome"] == "cancelled"
    assert events(d, "compaction.failed") == [{"error": "interrupted"}]


def test_cancel_stops_a_manual_compaction_and_the_queued_run_starts_in_the_old_session() -> None:
    """A `podctl compact` whose summary call hangs kept the pod "running" with nothing
    `cancel` would act on ("nothing to cancel"): only a stop ended it."""
    d = driver(threshold=None)
    d.call("run", "task")
    d.model("done")
    sid = d.machine.state.session_id
    compact = d.call("compact")
    queued = d.call("run", "after it")
    cancel = d.call("cancel")
    assert d.answer(cancel).result.cancelled and d.interrupted
    d.summarize_fails(None)
    error = d.answer(compact).error
    assert error is not None and error.code == errors.INTERNAL_ERROR
    assert error.message == "compaction failed: cancelled"
    assert events(d, "compaction.failed") == [{"error": "cancelled"}]
    assert d.machine.state.session_id == sid and not d.old_sessions
    assert d.answer(queued).result.state == "queued"
    assert isinstance(d.inflight, CallModel)  # the queued run goes on, in the old session


def test_shutdown_during_a_compaction_keeps_the_old_session() -> None:
    d = driver(threshold=100)
    d.call("run", "task")
    tool_round(d, usage=50)  # a round a summary can replace
    tool_round(d, usage=500)
    d.call("shutdown")
    assert d.interrupted and not d.stopped
    d.summarize_fails(None)
    assert d.stopped and not d.old_sessions


def test_repeated_compactions_keep_the_run_input_first_and_never_rerun_a_tool() -> None:
    d = driver(threshold=300, retained=2)
    d.call("run", "THE INPUT")
    tools_run = 0
    compactions = 0
    for _ in range(30):
        size = compaction.estimate_tokens("", d.machine.state.history)  # as a provider counts
        d.model("step", calls=1, usage=size)
        tools_run += 1
        d.tool(f"result {tools_run} " + "." * 200)
        if isinstance(d.inflight, Summarize):
            compactions += 1
            d.summarize(f"summary {compactions}")
            call = d.inflight
            assert isinstance(call, CallModel)
            assert f"summary {compactions}" in call.items[0].text  # type: ignore[union-attr]
            assert call.items[1] == UserMessage(text="THE INPUT")
    d.model("final")
    assert compactions >= 2
    results = [e for s in [*d.old_sessions, d.entries] for e in s if e["kind"] == "tool_result"]
    assert len(results) == tools_run == 30  # each call ran exactly once
    assert len(events(d, "run.finished")) == 1


# --- the pure selection -------------------------------------------------------------------------


def _call(i: int) -> ToolCall:
    return ToolCall(id=f"c{i}", name="t", arguments="{}")


@st.composite
def histories(draw: Any) -> tuple[list[Item], int]:
    items: list[Item] = [UserMessage(text="previous run")]
    items.append(AssistantMessage(text="previous answer"))
    run_from = len(items)
    items.append(UserMessage(text="input"))
    n = 0
    for _ in range(draw(st.integers(0, 8))):
        calls = tuple(_call(n + k) for k in range(draw(st.integers(0, 3))))
        n += len(calls)
        items.append(AssistantMessage(text="r", tool_calls=calls))
        for k, c in enumerate(calls):
            items.append(ToolResult(call_id=c.id, name="t", output="o"))
            if k == 0 and draw(st.booleans()):
                items.append(SystemNote(text="a note inside a batch"))
        if draw(st.booleans()):
            items.append(UserMessage(text="steer"))
    return items, run_from


@given(histories(), st.integers(0, 4))
def test_the_kept_rounds_never_split_a_call_from_its_result(
    case: tuple[list[Item], int], turns: int
) -> None:
    history, run_from = case
    new, new_from = compaction.build_history(history, run_from, "S", turns, ["kid"])
    assert new_from == 1 and "S" in new[0].text  # type: ignore[union-attr]
    assert new[1] == UserMessage(text="input")
    calls = {c.id for i in new if isinstance(i, AssistantMessage) for c in i.tool_calls}
    results = {i.call_id for i in new if isinstance(i, ToolResult)}
    assert calls == results
    assert sum(isinstance(i, AssistantMessage) for i in new) <= turns
    assert UserMessage(text="previous run") not in new  # earlier runs live in the summary
    kids = [i for i in new if isinstance(i, SystemNote) and "kid" in i.text]
    assert len(kids) == 1
    # Every input of the run survives verbatim, once.
    inputs = [i for i in history[run_from:] if isinstance(i, UserMessage)]
    assert [i for i in new[1:] if isinstance(i, UserMessage)] == inputs


def test_notifications_the_model_answered_are_summarized_not_kept_verbatim() -> None:
    """Every notification of the run was kept verbatim, through every compaction of it: a run
    fed reports outgrew any threshold, and asked for a summary every round."""
    call = ToolCall(id="c1", name="t", arguments="{}")
    later = ToolCall(id="c2", name="t", arguments="{}")
    history: list[Item] = [
        UserMessage(text="previous run"),
        AssistantMessage(text="previous answer"),
        UserMessage(text="input"),
        SystemNote(text="woke with this"),  # delivered with the input: what the run starts from
        AssistantMessage(text="r", tool_calls=(call,)),
        ToolResult(call_id="c1", name="t", output="o"),
        SystemNote(text="report 1"),  # answered by the next round
        UserMessage(text="steer"),
        AssistantMessage(text="r", tool_calls=(later,)),
        ToolResult(call_id="c2", name="t", output="o"),
        SystemNote(text="report 2"),  # in the kept round: not answered yet
    ]
    new, _ = compaction.build_history(history, 2, "S", 1, [])
    assert new[1:] == [
        UserMessage(text="input"),
        SystemNote(text="woke with this"),
        UserMessage(text="steer"),
        *history[8:],
    ]
    again, _ = compaction.build_history([*new, AssistantMessage(text="r")], 1, "S2", 1, [])
    assert again[1:] == [
        UserMessage(text="input"),
        SystemNote(text="woke with this"),
        UserMessage(text="steer"),  # report 2 was answered by then
        AssistantMessage(text="r"),
    ]


def test_switch_session_effect_carries_the_whole_state_to_continue_from() -> None:
    d = driver(threshold=100, retained=0)
    d.call("run", "queued first")
    d.call("run", "queued second")
    tool_round(d, usage=500)
    d.summarize("s")
    (switch,) = [e for e in d.effects if isinstance(e, SwitchSession)]
    assert [r.text for r in switch.start.pending_runs] == ["queued second"]
    assert switch.start.active_run == d.machine.state.active_run
    assert switch.start.run_from == 1


# --- properties: compaction inside random command sequences, with crashes -----------------------


def _seen(d: Driver, seen: set[str]) -> None:
    """Texts the model has been shown (requests and summary requests): what it has read."""
    for e in d.effects:
        if isinstance(e, CallModel | Summarize):
            for item in e.items:
                if isinstance(item, UserMessage | SystemNote):
                    seen.add(item.text)


def _compaction_work(d: Driver, data: Any) -> None:
    if isinstance(d.inflight, Summarize):
        if d.interrupted:
            d.summarize_fails(None)
            return
        kind = data.draw(st.integers(0, 5))
        if kind == 0:
            d.summarize_fails("provider down")
        elif kind == 1:
            d.summarize("useless " * 5000)
        else:
            d.summarize("a short summary")
    else:
        restore_work(d, data)


def _crash(d: Driver, data: Any) -> Driver:
    again = restore_crash(d, data)
    again.old_sessions = d.old_sessions  # complete files: a switch is durable before it happens
    return again


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_compaction_keeps_the_machine_invariants_across_crashes(data: Any) -> None:
    d = driver(threshold=data.draw(st.sampled_from([20, 60, 200])), retained=1, max_turns=6)
    seen: set[str] = set()
    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        roll = data.draw(st.integers(0, 14))
        if roll == 0:
            d = _crash(d, data)
        elif roll == 1:
            d.call("compact")
        elif isinstance(d.inflight, Summarize) and roll < 8:
            _compaction_work(d, data)
        else:
            restore_step(d, data) if not isinstance(d.inflight, Summarize) else None
        _seen(d, seen)
        check_fold_matches(d)
    for _ in range(300):  # settle
        if d.inflight is None and d.timer is None:
            if d.machine.state.paused_run is not None and d.machine.state.active_run is None:
                d.call("resume")
                _seen(d, seen)
                continue
            break
        if isinstance(d.inflight, Summarize):
            d.summarize("settling summary")
        elif isinstance(d.inflight, CallModel):
            d.model_fails(None) if d.interrupted else d.model("final")
        elif d.inflight is not None:
            d.tool()
        else:
            d.tick(5.0)
        _seen(d, seen)
    d.sync()
    check_fold_matches(d)
    if not d.entries:
        return
    state = d.machine.state
    assert state.active_run is None and state.open_calls == [] and not d.machine.compacting
    check_pairing(state.history)
    every = [e for s in [*d.old_sessions, d.entries] for e in s]
    check_runs_end_once(every)
    # (a compacted session keeps only the outcomes keyed retries may ask for: read the logs)
    cancelled_runs = {
        e["run_id"] for e in every if e["kind"] == "run_end" and e["outcome"] == "cancelled"
    }
    for e in d.acked:  # nothing acknowledged is lost: the model read it, or it still waits
        queued_run = e["kind"] == "user_input" and e.get("mode", "queue") == "queue"
        cancelled = queued_run and e["run_id"] in cancelled_runs
        shown = any(e["text"] in t for t in seen)
        pending = e.get("id") in state.pending_inputs
        assert shown or cancelled or pending, e


def test_the_precompact_point_runs_every_interceptor_in_order() -> None:
    import asyncio

    from poddaemon.interceptors import Chain, Interceptor

    seen: list[str] = []

    class Hook(Interceptor):
        def __init__(self, name: str) -> None:
            self.name = name

        async def before_compact(self, reason: str) -> None:
            seen.append(f"{self.name}:{reason}")

    asyncio.run(Chain([Hook("a"), Interceptor(), Hook("b")]).before_compact("manual"))
    assert seen == ["a:manual", "b:manual"]


def test_a_pause_asked_for_during_a_compaction_holds_before_the_next_model_call() -> None:
    """The end of a compaction is a safe point: no model call is made for a run paused meanwhile
    (it would be paid for, and its tool calls closed as 'not run')."""
    d = driver(threshold=300)
    token = d.call("run", "the task")
    run_id = d.answer(token).result.run_id
    tool_round(d, usage=50)
    tool_round(d, usage=400)
    assert isinstance(d.inflight, Summarize)
    assert d.answer(d.call("pause")).result.paused
    d.summarize("SUMMARY")
    assert d.inflight is None
    assert d.entries[0]["compacted_from"]  # the compaction itself stands
    assert [data["outcome"] for data in events(d, "run.finished")] == ["paused"]
    assert d.machine.state.paused_run == run_id
    assert d.answer(d.call("resume")).result.run_id == run_id
    call = d.inflight
    assert isinstance(call, CallModel) and call.run_id == run_id
    assert "SUMMARY" in call.items[0].text  # type: ignore[union-attr]
    d.model("done")
    assert [data["outcome"] for data in events(d, "run.finished")] == ["paused", "finished"]


def test_a_summary_request_too_long_loses_whole_oldest_rounds_until_one_is_left() -> None:
    """What a too-long summary request is sent again with: a quarter of its history or more
    gone each time, in whole rounds (a call never without its result, the input before a
    round goes with it), one note in front however often it is trimmed; nothing once only
    the last round is left."""
    history: list[Item] = [UserMessage(text="the task")]
    for i in range(8):
        call = ToolCall(id=f"c{i}", name="read_file", arguments="{}")
        history += [
            AssistantMessage(text=f"round {i}", tool_calls=(call,)),
            ToolResult(call_id=f"c{i}", name="read_file", output="x" * 400),
        ]
        if i == 4:
            history.append(SystemNote(text="a report came"))
    items = compaction.summary_request_items(history)
    sizes = [compaction.estimate_tokens("", history)]
    while (trimmed := compaction.trimmed_summary_request(items)) is not None:
        assert trimmed[0] == UserMessage(text=compaction.TRIMMED_NOTE)
        assert trimmed[-1] == items[-1]  # the instruction to summarize
        kept = trimmed[1:-1]
        assert kept == history[len(history) - len(kept) :]  # the newest part, as it was
        assert isinstance(kept[0], AssistantMessage | SystemNote)  # a round's start
        assert UserMessage(text=compaction.TRIMMED_NOTE) not in kept
        sizes.append(compaction.estimate_tokens("", kept))
        items = trimmed
    assert [type(i) for i in items[1:-1]] == [AssistantMessage, ToolResult]  # the last round
    assert all(b <= a * 0.75 for a, b in itertools.pairwise(sizes)), sizes
    assert compaction.trimmed_summary_request(compaction.summary_request_items([])) is None


def test_a_trimmed_summary_request_keeps_an_earlier_compactions_summary() -> None:
    """The oldest item of a compacted session is the summary of everything before it: trimming
    it away lost the whole older conversation to save a few hundred bytes."""
    summary = compaction.summary_item("we fixed the parser; the tests remain")
    history: list[Item] = [summary, UserMessage(text="the task")]
    for i in range(6):
        call = ToolCall(id=f"c{i}", name="read_file", arguments="{}")
        history += [
            AssistantMessage(text=f"round {i}", tool_calls=(call,)),
            ToolResult(call_id=f"c{i}", name="read_file", output="x" * 400),
        ]
    items = compaction.summary_request_items(history)
    note = UserMessage(text=compaction.TRIMMED_NOTE)
    while (trimmed := compaction.trimmed_summary_request(items)) is not None:
        assert trimmed[:2] == [summary, note] and trimmed.count(note) == 1
        assert trimmed[2:-1] == history[len(history) - len(trimmed) + 3 :]
        items = trimmed
    assert [type(i) for i in items[2:-1]] == [AssistantMessage, ToolResult]
