"""The pod machine alone, no I/O: scripted command sequences, asserting the exact effects."""

import pytest

from poddaemon.history import AssistantMessage, SystemNote, Usage, UserMessage
from poddaemon.llm.types import ModelResponse, ProviderError
from poddaemon.machine import (
    CANCEL_NOTE,
    ERROR_NOTE,
    MAX_TAKEN_UP_IN_ROW,
    NOTIFY_MAX_DELAY,
    NOTIFY_QUIET,
    RESTART_NOTE,
    CallModel,
    Commit,
    Interrupt,
    MachineConfig,
    OpenSession,
    Publish,
    Reply,
    RunStopHooks,
    RunTool,
    SetTimer,
    Stopped,
)
from poddaemon.session import MAX_NOTIFICATIONS_PER_REQUEST
from poddaemon.turn import (
    CANCELLED_WHILE_RUNNING,
    HOOKS_CUT_SHORT_BY_CRASH,
    NOT_RUN_CANCELLED,
    NOT_RUN_PAUSED,
    interrupted_output,
)
from protocol import errors
from tests.unit.machine_driver import Driver


def kinds_of(effects: list[object]) -> list[str]:
    out = []
    for e in effects:
        if isinstance(e, Commit):
            out.append(e.entry.kind)
        elif isinstance(e, Publish):
            out.append(f"event:{e.type}")
        else:
            out.append(type(e).__name__)
    return out


def test_a_run_on_an_idle_pod_opens_the_session_commits_acks_durably_and_calls_the_model() -> None:
    d = Driver()
    token = d.call("run", "hello")
    assert kinds_of(d.effects) == [
        "OpenSession",
        "user_input",
        "Reply",
        "run_start",
        "event:state.changed",
        "CallModel",
    ]
    (reply,) = [e for e in d.effects if isinstance(e, Reply)]
    assert reply.durable and reply.result.state == "started"
    assert token not in d.answers  # not before the fsync
    assert d.answer(token).result.run_id == reply.result.run_id
    call = d.inflight
    assert isinstance(call, CallModel) and call.items[-1].text == "hello"  # type: ignore[union-attr]
    d.model("hi there")
    assert d.kinds()[-4:] == ["llm_usage", "assistant", "turn_end", "run_end"]
    finished = [data for t, data, _ in d.events if t == "run.finished"]
    assert finished == [
        {
            "outcome": "finished",
            "text": "hi there",
            "usage": {"input": 10, "output": 1, "cache_read": 0, "cache_write": 0},
        }
    ]
    assert d.machine.pod_state == "idle"


def test_run_started_and_shutdown_events_carry_data() -> None:
    d = Driver()
    d.call("run", "x")
    d.model()
    d.call("shutdown")
    started = [data for t, data, _ in d.events if t == "run.started"]
    stopped = [data for t, data, _ in d.events if t == "shutdown"]
    assert started == [{"trigger": "input"}] and stopped == [{"reason": "requested"}]
    assert d.stopped


def test_runs_queue_fifo_with_positions_and_start_in_order() -> None:
    d = Driver()
    d.call("run", "first")
    second = d.call("run", "second")
    third = d.call("run", "third")
    assert d.answer(second).result.position == 1
    assert d.answer(third).result.position == 2
    queued = [data for t, data, _ in d.events if t == "run.queued"]
    assert queued == [{"position": 1}, {"position": 2}]
    d.model("one")
    assert isinstance(d.inflight, CallModel) and d.inflight.items[-1].text == "second"
    d.model("two")
    assert isinstance(d.inflight, CallModel) and d.inflight.items[-1].text == "third"


def test_state_changed_tells_each_change_once_and_no_idle_between_queued_runs() -> None:
    """A subscriber waiting for `idle` to know the queue is done must not be fooled by the
    moment between one run's end and the next one's start."""
    d = Driver()

    def states() -> list[str]:
        return [data["state"] for t, data, _ in d.events if t == "state.changed"]

    d.call("run", "first")
    d.call("run", "second")
    assert states() == ["running"]
    d.model("one")  # the first ends, the second starts: running throughout
    assert states() == ["running"]
    assert d.event_types().count("run.started") == 2
    d.model("two")
    assert states() == ["running", "idle"]
    d.call("run", "third")
    d.call("pause")
    d.model("three")  # ends `paused`
    assert states() == ["running", "idle", "running", "paused"]
    d.call("cancel")  # the paused run ends: idle
    assert states() == ["running", "idle", "running", "paused", "idle"]
    d.call("shutdown")
    assert states()[-1] == "stopping"


def test_a_keyed_retry_of_a_queued_run_answers_as_the_first_time() -> None:
    """SPEC §5: the original result, queued with its position then, even once runs ahead of
    it have ended or it has started itself (it answered where the run stood at the retry)."""
    d = Driver()
    d.call("run", "first")
    d.call("run", "second")
    third = d.answer(d.call("run", "third", client_key="k")).result
    again = d.answer(d.call("run", "third", client_key="k")).result
    assert (third.state, third.position) == ("queued", 2)
    assert (again.run_id, again.state, again.position) == (third.run_id, "queued", 2)
    d.model("one")  # the first run ends: one run ahead of it now
    moved = d.answer(d.call("run", "third", client_key="k")).result
    assert (moved.run_id, moved.state, moved.position) == (third.run_id, "queued", 2)
    d.model("two")  # it has started
    started = d.answer(d.call("run", "third", client_key="k")).result
    assert (started.run_id, started.state, started.position) == (third.run_id, "queued", 2)
    idle = Driver()
    solo = idle.answer(idle.call("run", "solo", client_key="s")).result
    idle.model("done")
    assert solo.state == "started"
    assert idle.answer(idle.call("run", "solo", client_key="s")).result == solo


def test_steer_reaches_the_next_request_and_a_final_answer_gets_another_round() -> None:
    d = Driver()
    d.call("run", "task")
    steer = d.call("run", "also this", mode="steer")
    assert d.answer(steer).result.state == "steered"
    d.model("first take")  # final, but steer input waits: another round
    call = d.inflight
    assert isinstance(call, CallModel)
    assert [getattr(i, "text", "") for i in call.items][-2:] == ["first take", "also this"]
    d.model("revised")
    assert d.machine.pod_state == "idle"


def test_a_notification_burst_wakes_an_idle_pod_once_after_quiet() -> None:
    d = Driver()
    for k in range(3):
        t = d.call("notify", f"event {k}", "ci")
        assert d.answer(t).result.wakes
        d.now += NOTIFY_QUIET / 10
    assert d.inflight is None and d.timer is not None  # waiting for the burst to settle
    d.tick(NOTIFY_QUIET)
    call = d.inflight
    assert isinstance(call, CallModel)
    (note,) = call.items
    assert "3 notifications arrived:" in note.text and "event 2" in note.text
    assert "while you worked" not in note.text
    d.model()
    assert d.inflight is None and d.machine.pod_state == "idle"


def test_a_burst_never_waits_past_the_max_delay() -> None:
    d = Driver()
    d.call("notify", "first", "ci")
    start = d.now
    while d.inflight is None:
        d.now += NOTIFY_QUIET / 2
        d.call("notify", "more", "ci")
        assert d.now - start <= NOTIFY_MAX_DELAY + NOTIFY_QUIET
        if d.timer is not None and d.now >= d.timer:
            d.tick(0)
    assert isinstance(d.inflight, CallModel)


def test_more_notifications_than_one_request_shows_are_handled_in_one_run() -> None:
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=10, max_pending=1000))
    n = MAX_NOTIFICATIONS_PER_REQUEST * 2 + 50
    for k in range(n):
        d.call("notify", f"n{k}", "ci")
    d.tick()
    rounds = 0
    while isinstance(d.inflight, CallModel):
        d.model("seen")
        rounds += 1
    assert rounds == 3
    assert d.kinds().count("run_start") == 1
    assert d.machine.state.pending_notifications == 0


def test_pause_stops_at_the_tool_safe_point_and_resume_continues_the_same_run() -> None:
    d = Driver()
    d.call("run", "work")
    d.model(calls=2)
    assert isinstance(d.inflight, RunTool)
    pause = d.call("pause")
    assert d.answer(pause).result.paused
    d.tool()
    results = [e["item"]["output"] for e in d.entries if e["kind"] == "tool_result"]
    assert results == ["tool output", NOT_RUN_PAUSED]
    assert d.machine.pod_state == "paused" and d.inflight is None
    run_id = d.machine.state.paused_run
    notify = d.call("notify", "while paused", "ci")
    assert not d.answer(notify).result.wakes and d.inflight is None
    resume = d.call("resume")
    assert d.answer(resume).result.run_id == run_id
    assert isinstance(d.inflight, CallModel) and d.inflight.run_id == run_id
    d.model("done")
    outcomes = [data["outcome"] for t, data, _ in d.events if t == "run.finished"]
    assert outcomes == ["paused", "finished"]


def test_pause_of_a_paused_pod_says_it_is_paused_and_changes_nothing() -> None:
    d = Driver()
    d.call("run", "work")
    assert d.answer(d.call("pause")).result.paused
    assert d.answer(d.call("pause")).result.paused  # on its way to the safe point
    d.model(calls=1)
    assert d.machine.pod_state == "paused" and d.inflight is None
    run_id, written = d.machine.state.paused_run, len(d.lines)
    assert d.answer(d.call("pause")).result.paused  # reached: still paused, not "nothing"
    assert len(d.lines) == written and d.machine.pod_state == "paused" and d.inflight is None
    assert d.answer(d.call("resume")).result.run_id == run_id
    d.model("done")
    assert not d.answer(d.call("pause")).result.paused  # finished: nothing to pause


def test_a_paused_pod_holds_its_queue_until_resume() -> None:
    """`pause` with a run queued behind the active one: the pod stays paused (the queued run
    used to start at once and cancel the paused one as "superseded"); on resume the paused run
    goes on, and the queued one starts when it ends."""
    d = Driver()
    first = d.answer(d.call("run", "first")).result.run_id
    second = d.answer(d.call("run", "second")).result
    assert (second.state, second.position) == ("queued", 1)
    d.call("pause")
    d.model(calls=1)
    assert d.machine.pod_state == "paused" and d.inflight is None
    assert d.machine.state.paused_run == first and second.run_id in d.machine.state.pending_runs
    assert d.answer(d.call("resume")).result.run_id == first
    assert isinstance(d.inflight, CallModel) and d.inflight.run_id == first
    d.model("first done")
    assert isinstance(d.inflight, CallModel) and d.inflight.run_id == second.run_id
    d.model("second done")
    finished = [(run_id, data["outcome"]) for t, data, run_id in d.events if t == "run.finished"]
    assert finished == [
        (first, "paused"),
        (first, "finished"),
        (second.run_id, "finished"),
    ]


def test_a_run_sent_to_a_paused_pod_is_queued_behind_the_paused_run() -> None:
    d = Driver()
    first = d.answer(d.call("run", "first")).result.run_id
    d.call("pause")
    d.model(calls=1)
    later = d.answer(d.call("run", "later")).result
    assert (later.state, later.position) == ("queued", 1)
    assert d.machine.pod_state == "paused" and d.inflight is None
    d.call("cancel")  # the paused run ends: the queue goes on
    assert isinstance(d.inflight, CallModel) and d.inflight.run_id == later.run_id
    finished = [(run_id, data["outcome"]) for t, data, run_id in d.events if t == "run.finished"]
    assert finished == [(first, "paused"), (first, "cancelled")]


def test_pause_during_the_final_answer_holds_and_resume_finishes_without_a_call() -> None:
    d = Driver()
    d.call("run", "work")
    assert d.answer(d.call("pause")).result.paused
    d.model("the answer")
    assert d.machine.pod_state == "paused"
    d.call("resume")
    assert d.inflight is None
    finished = [data for t, data, _ in d.events if t == "run.finished"]
    assert [f["outcome"] for f in finished] == ["paused", "finished"]
    assert finished[-1]["text"] == "the answer"


def test_resume_before_the_pause_is_reached_takes_the_pause_back() -> None:
    """`pause` then `resume` while the model still streams (the safe point not reached): the
    resume is not refused as "not paused" leaving the pod to pause for good a moment later;
    the run goes on as if never paused: no `paused` end, which `run {wait}` and `podctl send`
    would report as the run's outcome. A later pause holds again."""
    d = Driver()
    run_id = d.answer(d.call("run", "work")).result.run_id
    assert d.answer(d.call("pause")).result.paused
    resume = d.answer(d.call("resume"))
    assert resume.error is None and resume.result.run_id == run_id
    d.model(calls=1)  # the safe point passes: its tool runs
    assert d.machine.pod_state == "running"
    assert isinstance(d.inflight, RunTool)
    d.tool()
    assert isinstance(d.inflight, CallModel) and d.inflight.run_id == run_id
    d.model("done")
    assert d.machine.pod_state == "idle"
    finished = [data["outcome"] for t, data, _ in d.events if t == "run.finished"]
    assert finished == ["finished"]
    # pause, resume, pause: the last word holds
    d.call("run", "again")
    d.call("pause")
    d.call("resume")
    d.call("pause")
    d.model("the answer")
    assert d.machine.pod_state == "paused"


def test_pause_while_the_model_call_waits_to_retry_withdraws_it() -> None:
    d = Driver()
    d.call("run", "work")
    d.feed(d.machine.model_retrying(True))
    assert not any(isinstance(e, Interrupt) for e in d.effects)  # no pause asked for yet
    assert d.answer(d.call("pause")).result.paused
    assert any(isinstance(e, Interrupt) for e in d.effects)
    d.model_fails(None)
    assert d.machine.pod_state == "paused"
    run_id = d.machine.state.paused_run
    d.call("resume")
    assert isinstance(d.inflight, CallModel) and d.inflight.run_id == run_id
    d.model("done")
    outcomes = [data["outcome"] for t, data, _ in d.events if t == "run.finished"]
    assert outcomes == ["paused", "finished"]


def test_a_pause_before_the_retry_ends_the_call_when_it_comes() -> None:
    d = Driver()
    d.call("run", "work")
    assert d.answer(d.call("pause")).result.paused
    assert not any(isinstance(e, Interrupt) for e in d.effects)  # the attempt may still answer
    d.feed(d.machine.model_retrying(True))
    assert any(isinstance(e, Interrupt) for e in d.effects)


def test_a_pause_waits_for_output_that_streams_after_a_retry() -> None:
    d = Driver()
    d.call("run", "work")
    d.feed(d.machine.model_retrying(True))
    d.feed(d.machine.model_retrying(False))
    d.call("pause")
    assert not any(isinstance(e, Interrupt) for e in d.effects)
    d.model(calls=1)  # the answer stands; the pause then holds its tool call unrun
    assert d.machine.pod_state == "paused"
    d.feed(d.machine.model_retrying(True))  # late: no model call in flight, ignored
    assert not any(isinstance(e, Interrupt) for e in d.effects)


@pytest.mark.parametrize("how", ["error", "cancel", "max_turns"])
def test_a_steer_its_run_never_read_gets_a_run_of_its_own(how: str) -> None:
    d = Driver()
    d.call("run", "work")
    if how == "max_turns":
        for _ in range(d.cfg.max_turns - 1):
            d.model(calls=1)
            d.tool()
        d.model(calls=1)  # the last round: its tool runs, then the run ends limit_reached
    steer = d.call("run", "and this", "steer")
    assert d.answer(steer).result.state == "steered"
    if how == "error":
        d.model_fails(ProviderError("fatal", "HTTP 400: no"))
    elif how == "cancel":
        d.call("cancel")
        d.model_fails(None)
    else:
        d.tool()
    starts = [e for e in d.entries if e["kind"] == "run_start"]
    assert [e["trigger"] for e in starts] == ["input", "steer"]
    assert isinstance(d.inflight, CallModel)
    items = d.inflight.items
    if how == "cancel":  # after the steer, the note saying its run was cancelled
        assert isinstance(items[-1], SystemNote) and CANCEL_NOTE in items[-1].text
        items = items[:-1]
    assert items[-1] == UserMessage(text="and this")
    d.model("done")
    assert d.machine.pod_state == "idle" and d.machine.state.pending_steers == 0


def test_a_steer_its_run_never_read_goes_before_a_queued_run() -> None:
    # The queued run started first and took the steer up at its first request: "and this",
    # meant for the work, read as part of "deploy" (found after a kill -9 of a running pod).
    d = Driver()
    d.call("run", "work")
    d.call("run", "and this", "steer")
    queued = d.call("run", "deploy")
    assert d.answer(queued).result.state == "queued"
    d.model_fails(ProviderError("fatal", "HTTP 400: no"))

    def triggers() -> list[str]:
        return [e["trigger"] for e in d.entries if e["kind"] == "run_start"]

    assert triggers() == ["input", "steer"]
    assert isinstance(d.inflight, CallModel)
    assert d.inflight.items[-1] == UserMessage(text="and this")
    d.model("done")
    assert triggers() == ["input", "steer", "input"]
    assert isinstance(d.inflight, CallModel)
    assert d.inflight.items[-1] == UserMessage(text="deploy")
    assert d.inflight.items.count(UserMessage(text="and this")) == 1


def test_a_cancelled_run_is_told_to_the_model_at_its_next_request() -> None:
    d = Driver()
    d.call("run", "write the report")
    d.call("cancel")
    d.model_fails(None, partial="The report: first")  # what had streamed is kept
    assert d.kinds()[-2:] == ["run_end", "system_item"]
    note = d.entries[-1]
    assert (note["text"], note["source"], note["context"]) == (CANCEL_NOTE, "poddaemon", True)
    assert d.machine.pod_state == "idle" and d.inflight is None  # the note wakes nothing
    d.now += 1
    d.call("run", "now the summary")
    assert isinstance(d.inflight, CallModel)
    *_, cut, told, asked = d.inflight.items  # (told first: it came before the input)
    assert cut == AssistantMessage(text="The report: first")
    assert asked == UserMessage(text="now the summary")
    assert isinstance(told, SystemNote) and CANCEL_NOTE in told.text
    d.model("done")
    assert d.kinds().count("system_item") == 1


def test_a_run_that_ended_in_an_error_with_a_reply_kept_is_told_at_the_next_request() -> None:
    """Found by QA: a stream the provider cut mid-answer kept the text as the model's reply,
    and the next request gave no sign it was cut: the model took it for a finished answer,
    where a cancel at the same point is told (CANCEL_NOTE)."""
    d = Driver()
    d.call("run", "write the report")
    d.model_fails(ProviderError("interrupted", "stream interrupted: peer closed"), "The rep")
    note = d.entries[-1]
    text = ERROR_NOTE.format(error="stream interrupted: peer closed")
    assert (note["kind"], note["text"], note["context"]) == ("system_item", text, True)
    assert d.machine.pod_state == "idle" and d.inflight is None  # the note wakes nothing
    d.now += 1
    d.call("run", "go on")
    assert isinstance(d.inflight, CallModel)
    *_, cut, told, asked = d.inflight.items
    assert cut == AssistantMessage(text="The rep") and asked == UserMessage(text="go on")
    assert isinstance(told, SystemNote) and text in told.text
    # An error with no reply kept (a key refused, say: every run fails alike) leaves no note
    # to pile up for the run that works at last.
    d.model_fails(ProviderError("fatal", "HTTP 401: bad key"))
    assert d.kinds()[-1] == "run_end"


@pytest.mark.parametrize("how", ["queued", "shutdown"])
def test_a_run_not_cut_by_a_cancel_gets_no_cancel_note(how: str) -> None:
    d = Driver()
    first = d.call("run", "first")
    if how == "queued":
        second = d.call("run", "second")
        d.call("cancel", d.answer(second).result.run_id)
        d.model("done")
    else:
        d.call("shutdown")
        d.model_fails(None)
    assert d.answer(first).error is None
    assert all(e.get("text") != CANCEL_NOTE for e in d.entries)


def test_resume_when_not_paused_is_an_error() -> None:
    d = Driver()
    assert d.answer(d.call("resume")).error.code == errors.NOT_PAUSED  # type: ignore[union-attr]


def test_cancel_during_the_model_call_interrupts_it() -> None:
    d = Driver()
    d.call("run", "work")
    t = d.call("cancel")
    assert any(isinstance(e, Interrupt) for e in d.effects)
    assert t not in d.answers  # answered once the run's end is committed, not before
    d.model_fails(None)
    (finished,) = [data for t_, data, _ in d.events if t_ == "run.finished"]
    assert finished["outcome"] == "cancelled"
    assert d.answer(t).result.cancelled


def test_cancel_during_a_tool_closes_the_rest_of_the_batch() -> None:
    d = Driver()
    d.call("run", "work")
    d.model(calls=3)
    d.call("cancel")
    d.tool(CANCELLED_WHILE_RUNNING, is_error=True)
    outputs = [e["item"]["output"] for e in d.entries if e["kind"] == "tool_result"]
    assert outputs == [CANCELLED_WHILE_RUNNING, NOT_RUN_CANCELLED, NOT_RUN_CANCELLED]
    assert d.kinds()[-3:] == ["turn_end", "run_end", "system_item"]  # the cancel's note


def test_cancel_of_a_queued_run_ends_it_without_starting_it() -> None:
    d = Driver()
    d.call("run", "first")
    queued = d.answer(d.call("run", "second")).result.run_id
    assert d.answer(d.call("cancel", queued)).result.cancelled
    d.model()
    assert d.inflight is None and d.kinds().count("run_start") == 1


def test_max_turns_ends_the_run_limit_reached() -> None:
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=2))
    t = d.call("run", "loop", wait=True)
    d.model(calls=1)
    d.tool()
    d.model(calls=1)
    d.tool()
    result = d.answer(t).result
    assert result.outcome == "limit_reached" and "max_turns (2)" in result.error
    assert result.usage.calls == 2 and result.usage.input == 20


def test_budget_refusal_ends_the_run_and_new_runs_get_32007() -> None:
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=5, budget_cap=15))
    t = d.call("run", "spend", wait=True)
    d.model(calls=1, usage=20)
    d.tool()
    assert d.machine.budget_exhausted()
    d.inflight = None
    d.feed(d.machine.model_refused(d.machine.budget_message()))
    assert d.answer(t).result.outcome == "limit_reached"
    refused = d.answer(d.call("run", "more"))
    assert refused.error is not None and refused.error.code == errors.BUDGET_EXHAUSTED
    assert not d.answer(d.call("notify", "x", "ci")).result.wakes


def test_client_keys_are_per_method_and_replay_the_original() -> None:
    d = Driver()
    run = d.answer(d.call("run", "same", client_key="k")).result
    note = d.answer(d.call("notify", "same", "ci", client_key="k")).result
    assert note.notification_id != run.run_id  # a different method: a new notification
    again = d.answer(d.call("run", "same", client_key="k")).result
    assert again.run_id == run.run_id
    conflict = d.answer(d.call("run", "other", client_key="k")).error
    assert conflict is not None and conflict.code == errors.CONFLICTING_CLIENT_KEY
    assert sum(1 for e in d.entries if e["kind"] == "user_input") == 1


def test_a_notify_retry_gets_the_original_result_wakes_included_even_after_a_restore() -> None:
    # SPEC §5: same client_key + same input => the original result. A retry used to say
    # wakes=false because it woke no one itself.
    d = Driver()
    first = d.answer(d.call("notify", "build failed", "ci", client_key="k")).result
    assert first.wakes
    (item,) = [e for e in d.entries if e["kind"] == "system_item"]
    assert item["wakes"] is True  # in the log, so a restarted pod answers the same
    again = d.answer(d.call("notify", "build failed", "ci", client_key="k")).result
    assert (again.notification_id, again.wakes) == (first.notification_id, True)
    d.call("run", "busy")
    asleep = d.answer(d.call("notify", "later", "ci", client_key="k2")).result
    assert not asleep.wakes  # the pod is running: this one wakes no one

    d.sync()
    restored = Driver()
    restored.lines, restored.entries, restored.prev = list(d.lines), list(d.entries), d.prev
    restored.feed(restored.machine.restore(d.entries))
    for key, text, want in (("k", "build failed", first), ("k2", "later", asleep)):
        retry = restored.answer(restored.call("notify", text, "ci", client_key=key)).result
        assert (retry.notification_id, retry.wakes) == (want.notification_id, want.wakes)


def test_notify_past_max_pending_is_queue_full() -> None:
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=2, max_pending=2))
    d.call("run", "busy")
    for k in range(2):
        d.call("notify", f"n{k}", "ci")
    full = d.answer(d.call("notify", "n2", "ci")).error
    assert full is not None and full.code == errors.QUEUE_FULL


def test_run_past_max_queued_runs_is_queue_full_and_commits_nothing() -> None:
    """Queued runs were unbounded: each holds its input in memory until it starts."""
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=2, max_queued_runs=2))
    d.call("run", "busy")
    queued = [d.answer(d.call("run", f"r{k}", client_key=f"k{k}")).result for k in range(2)]
    assert [r.position for r in queued] == [1, 2]
    inputs, events = len(d.inputs()), len(d.events)
    full = d.answer(d.call("run", "one too many")).error
    assert full is not None and full.code == errors.QUEUE_FULL
    assert full.message == "queue full: 2 runs queued (worker.max_queued_runs = 2)"
    assert (len(d.inputs()), len(d.events)) == (inputs, events)
    # A retried key is answered as the first time, full or not; a steer joins the active run.
    again = d.answer(d.call("run", "r1", client_key="k1")).result
    assert (again.run_id, again.position) == (queued[1].run_id, 2)
    assert d.answer(d.call("run", "steer", mode="steer")).result.state == "steered"
    d.model("reading the steer")  # (it came during this call: one more round for it)
    d.model("done")  # the active run ends, the first queued one starts: room for one more
    assert d.answer(d.call("run", "now fits")).result.position == 2


def test_child_reports_are_accepted_once_per_event_id() -> None:
    d = Driver()
    for _ in range(2):
        t = d.call("child_report", "kid", "run.finished", "ev-1", "r1", "done")
        assert d.answer(t).result.accepted
    assert sum(1 for e in d.entries if e["kind"] == "system_item") == 1
    assert [t for t, _, _ in d.events].count("child.event") == 1


def test_shutdown_mid_run_interrupts_and_ends_the_run_as_interrupted() -> None:
    d = Driver()
    waiter = d.call("run", "work", wait=True)
    d.call("shutdown")
    assert any(isinstance(e, Interrupt) for e in d.effects)
    refused = d.answer(d.call("run", "late")).error
    assert refused is not None and refused.code == errors.SHUTTING_DOWN
    d.model_fails(None)
    result = d.answer(waiter).result
    assert result.outcome == "error" and "shut down" in result.error
    assert [e for e in d.entries if e["kind"] == "run_end"][-1]["interrupted"] is True
    assert any(isinstance(e, Stopped) for e in d.effects)


def test_the_shutdown_event_says_why_the_pod_stops_and_the_first_reason_counts() -> None:
    for reason in ("requested", "failed", "parent exited"):
        d = Driver()
        d.feed(d.machine.shutdown(reason=reason))
        d.feed(d.machine.shutdown())  # a client asking too, once it is stopping already
        assert [data for type_, data, _ in d.events if type_ == "shutdown"] == [{"reason": reason}]


def test_a_run_a_shutdown_interrupted_is_picked_up_at_the_next_start() -> None:
    """A graceful stop or restart (systemctl restart, podctl restart) must not abandon the work
    the run was acknowledged for: the same note as after a crash waits in the log."""
    d = Driver()
    d.call("run", "work")
    d.model(calls=1)
    d.call("shutdown")
    d.tool()  # the cancelled call comes back
    kinds = [e["kind"] for e in d.entries]
    assert kinds[-2:] == ["run_end", "system_item"] and d.entries[-2]["interrupted"] is True
    assert not any(isinstance(e, CallModel) for e in d.effects)  # no turn while stopping
    again = Driver()
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(d.entries))
    again.tick(NOTIFY_MAX_DELAY)
    assert isinstance(again.inflight, CallModel)
    assert "restarted" in again.inflight.items[-1].text  # type: ignore[union-attr]


def test_a_run_cancelled_before_a_shutdown_ends_it_is_not_picked_up_again() -> None:
    """`podctl cancel` then `podctl stop` before the cancelled call came back: the user ended
    that work; the next start must not wake the model to continue it."""
    d = Driver()
    t = d.call("run", "work", wait=True)
    d.model(calls=1)
    d.call("cancel")
    d.call("shutdown")
    d.tool()  # the cancelled call comes back
    (end,) = [e for e in d.entries if e["kind"] == "run_end"]
    assert end["outcome"] == "cancelled" and not end.get("interrupted")
    assert d.answer(t).result.outcome == "cancelled"
    notes = [e["text"] for e in d.entries if e["kind"] == "system_item"]
    assert notes == [CANCEL_NOTE]  # not the restart note, which would wake it


def test_a_provider_error_ends_the_run_with_its_message() -> None:
    d = Driver()
    t = d.call("run", "x", wait=True)
    d.model_fails(ProviderError("fatal", "401 bad key"))
    assert d.answer(t).result.error == "401 bad key"


def test_restore_closes_open_calls_ends_the_run_and_notes_the_restart() -> None:
    d = Driver()
    d.call("run", "work")
    d.model(calls=2)
    d.tool()
    queued = d.call("run", "next")
    d.sync()
    crashed = d.entries
    again = Driver()
    again.lines, again.entries, again.prev = list(d.lines), list(crashed), d.prev
    effects = again.feed(again.machine.restore(crashed))
    tail = [e.entry.kind for e in effects if isinstance(e, Commit)]
    assert tail == ["tool_result", "run_end", "system_item", "run_start", "inputs_delivered"]
    assert isinstance(again.inflight, CallModel)
    assert [getattr(i, "text", "") for i in again.inflight.items][-2:-1] == ["next"]
    assert "restarted" in again.inflight.items[-1].text  # type: ignore[union-attr]
    assert d.answers[queued].result.state == "queued"


def test_a_run_a_crash_cut_short_keeps_its_answer_for_a_keyed_retry() -> None:
    """Found by QA: killed while the Stop hooks judged its final answer, the run was restored
    with `text: ""`, and a `run` retry of its key returned that, the answer in the log
    unread (podctl, which reads the history, printed it). What it had said stays its reply."""
    cfg = MachineConfig(name="p", model="m", max_turns=4, stop_hooks=True)
    d = Driver(cfg=cfg)
    d.call("run", "keyed", client_key="KK")
    d.model(text="THE FINAL ANSWER")
    assert isinstance(d.inflight, RunStopHooks)
    d.sync()
    again = Driver(cfg=cfg)
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(d.entries))
    (end,) = [e for e in again.entries if e["kind"] == "run_end"]
    assert (end["outcome"], end["text"]) == ("error", "THE FINAL ANSWER")
    retry = again.answer(again.call("run", "keyed", client_key="KK", wait=True)).result
    assert (retry.outcome, retry.text) == ("error", "THE FINAL ANSWER")
    assert "interrupted" in (retry.error or "")


def test_context_waiting_for_an_input_is_read_before_it_and_is_its_run_s() -> None:
    """A hook's context committed before an input is delivered ahead of it (as Claude Code
    orders SessionStart's), and belongs to that run: compaction keeps it with the input."""
    d = Driver()
    d.feed(d.machine.add_context("SS", "hook:SessionStart"))
    d.now += 1
    d.call("run", "the prompt", context="UPS")
    assert isinstance(d.inflight, CallModel)
    texts = [getattr(i, "text", "") for i in d.inflight.items]
    assert "SS" in texts[0] and texts[1] == "the prompt" and "UPS" in texts[2], texts
    assert d.machine.state.run_from == 0
    assert d.kinds()[-2:] == ["inputs_delivered", "run_start"]


def test_a_copy_of_a_session_takes_its_conversation_and_starts_nothing() -> None:
    """Restored as a copy (another pod's session, or one a later session continues): the run
    in progress ends with its open calls closed, the queued run and the notification are not
    taken up, no restart note claims the pod restarted, and the note that says so wakes
    nothing; the next run's first request carries the conversation and that note."""
    d = Driver()
    d.call("run", "their work")
    d.model(calls=2)
    d.tool()
    d.call("run", "their queued work")
    d.call("notify", "their news")
    d.sync()
    again = Driver()
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    effects = again.feed(again.machine.restore(d.entries, copy=True))
    assert not [e for e in effects if isinstance(e, CallModel)]
    again.tick(NOTIFY_MAX_DELAY)
    assert again.inflight is None and again.machine.pod_state == "idle"
    s = again.machine.state
    assert (s.active_run, s.pending_runs, s.paused_run) == (None, {}, None)
    (note,) = s.pending_inputs.values()
    assert note.context and "was not taken up here" in note.text
    ends = [e for e in again.entries if e["kind"] == "run_end"]
    assert [e["error"] for e in ends] == ["not taken up: this session continues a copy of it"] * 2
    again.call("run", "my own work")
    assert isinstance(again.inflight, CallModel)
    texts = [getattr(i, "text", "") for i in again.inflight.items]
    assert "their work" in texts and "my own work" in texts
    assert not [t for t in texts if "their queued work" in t or "their news" in t]
    assert not [t for t in texts if "restarted" in t]


def _crash_and_restore(d: Driver) -> Driver:
    again = Driver()
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(d.entries))
    again.tick(NOTIFY_MAX_DELAY)
    return again


def test_a_pod_that_crashes_in_every_run_stops_taking_the_work_up_by_itself() -> None:
    """Under `Restart=on-failure` a run that crashes the pod each time would be taken up after
    every start, its cut-off model calls spent and never counted: after MAX_TAKEN_UP_IN_ROW
    the note waits for the next input, and says so in an alert."""
    d = Driver()
    d.call("run", "work")
    for _ in range(MAX_TAKEN_UP_IN_ROW):
        d = _crash_and_restore(d)  # the model call in flight dies with the pod
        assert isinstance(d.inflight, CallModel)
        assert "restarted" in d.inflight.items[-1].text  # type: ignore[union-attr]
        assert not [e for t, e, _ in d.events if t == "alert"]
    d = _crash_and_restore(d)
    assert d.inflight is None and d.machine.pod_state == "idle"
    (alert,) = [e for t, e, _ in d.events if t == "alert"]
    assert alert["message"].startswith(f"{MAX_TAKEN_UP_IN_ROW + 1} runs in a row were cut off")
    d.call("run", "look again")  # the user's next input carries the note to the model
    assert isinstance(d.inflight, CallModel)
    texts = [getattr(i, "text", "") for i in d.inflight.items]
    assert texts[-1] == "look again" and RESTART_NOTE not in texts[-2]  # (the note came first)
    # Why the work waited, not "continue where you left off": that work may stop the pod.
    assert f"{MAX_TAKEN_UP_IN_ROW + 1} runs in a row were cut off" in texts[-2]
    assert "before doing any of it again" in texts[-2]
    d.model()  # a run that ends as runs do: the count starts again
    d.call("run", "more")
    d = _crash_and_restore(d)
    assert isinstance(d.inflight, CallModel)


def test_new_input_after_a_held_note_starts_the_count_of_runs_cut_off_again() -> None:
    """Found by QA: past MAX_TAKEN_UP_IN_ROW the note waits for the next input; the user sent
    new work, stopped the pod once on purpose, and that run was not taken up ("5 runs in a
    row were cut off"): the count went on from the loop before the new input."""
    d = Driver()
    d.call("run", "work")
    for _ in range(MAX_TAKEN_UP_IN_ROW + 1):
        d = _crash_and_restore(d)
    assert d.inflight is None  # held
    d.call("run", "new work")
    assert d.machine.state.interrupted_in_row == 0
    d = _crash_and_restore(d)  # one stop (or crash) of the new work: taken up
    assert isinstance(d.inflight, CallModel)
    assert RESTART_NOTE in d.inflight.items[-1].text  # type: ignore[union-attr]


def test_a_crash_in_post_tool_use_hooks_keeps_what_the_tool_did() -> None:
    """A call whose tool returned (its output written) when a crash cut its PostToolUse hooks
    short is restored with that output, not as interrupted; the next call of the batch, never
    run, is."""
    d = Driver()
    d.call("run", "append a line")
    d.model(calls=2)
    assert isinstance(d.inflight, RunTool)
    d.feed(d.machine.tool_finished(d.inflight.call.id, "appended-once", False, "1 line"))
    again = _crash_and_restore(d)
    results = [e for e in again.entries if e["kind"] == "tool_result"]
    assert [r["item"]["output"] for r in results] == [
        f"appended-once\n{HOOKS_CUT_SHORT_BY_CRASH}",
        interrupted_output("read_file"),
    ]
    assert [r["item"]["is_error"] for r in results] == [False, True]
    assert results[0]["summary"] == "1 line"


def test_a_later_notification_moves_the_burst_deadline_at_the_next_tick() -> None:
    d = Driver()
    d.call("notify", "a", "ci")
    (first,) = [e for e in d.effects if isinstance(e, SetTimer)]
    d.now += NOTIFY_QUIET / 2
    d.call("notify", "b", "ci")
    assert not [e for e in d.effects if isinstance(e, SetTimer)]  # the timer stands
    assert not any(isinstance(e, OpenSession) for e in d.effects)
    d.tick(first.at - d.now)
    (second,) = [e for e in d.effects if isinstance(e, SetTimer)]
    assert second.at == first.at + NOTIFY_QUIET / 2 and d.inflight is None
    d.tick(second.at - d.now)
    assert isinstance(d.inflight, CallModel)


def test_hook_runs_before_the_first_session_are_recorded_when_it_opens() -> None:
    # A SessionStart hook at start-up, a UserPromptSubmit hook that refused the first prompt:
    # there is no session yet; they are its first entries once an input opens it.
    d = Driver()
    d.feed(d.machine.hook_ran("SessionStart", "echo hi", 0, 0.01, "ok", ""))
    d.feed(d.machine.hook_ran("UserPromptSubmit", "./guard.sh", 2, 0.02, "block", "no"))
    assert d.entries == []
    d.call("run", "accepted")
    kinds = [e["kind"] for e in d.entries]
    assert kinds[:4] == ["session_start", "hook_run", "hook_run", "user_input"], kinds
    assert [e["event"] for e in d.entries[1:3]] == ["SessionStart", "UserPromptSubmit"]
    d.feed(d.machine.hook_ran("Stop", "true", 0, 0.01, "ok", ""))
    assert d.entries[-1]["kind"] == "hook_run" and d.entries[-1]["event"] == "Stop"


def test_a_queued_prompts_hook_context_waits_for_its_own_run() -> None:
    # UserPromptSubmit context belongs to its prompt: a queued prompt's must not reach the
    # run that is active meanwhile, and must survive a restore (it is in the input's entry).
    d = Driver()
    d.call("run", "first")
    d.call("run", "second", context="CTX-FOR-SECOND")
    d.model(calls=1)
    d.tool()
    assert isinstance(d.inflight, CallModel)
    assert "CTX-FOR-SECOND" not in str(d.inflight.items)  # the first run's next request
    d.sync()
    again = Driver()
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(d.entries))  # a crash here: the first run is cut short
    d.model("first done")
    for driver in (d, again):
        assert isinstance(driver.inflight, CallModel)
        items = list(driver.inflight.items)
        at = items.index(UserMessage(text="second"))
        note = items[at + 1]
        assert isinstance(note, SystemNote) and "CTX-FOR-SECOND" in note.text
        assert "from hook:UserPromptSubmit" in note.text
        assert sum("CTX-FOR-SECOND" in str(i) for i in items) == 1


@pytest.mark.parametrize("capped", [True, False])
def test_a_provider_reporting_no_usage_cannot_spend_a_budget_for_nothing(capped: bool) -> None:
    """A server that sends no usage counted 0 tokens: a [budget] was never reached. With a cap,
    the call is counted by the bytes/4 estimate, and an alert says so once."""
    cfg = MachineConfig(name="p", model="m", max_turns=4, budget_cap=10_000 if capped else None)
    d = Driver(cfg=cfg)
    for text in ("first", "second"):
        d.call("run", text * 100)
        assert isinstance(d.inflight, CallModel)
        d.inflight = None
        silent = ModelResponse(
            message=AssistantMessage(text="an answer " * 20), stop="end_turn", usage=Usage()
        )
        d.feed(d.machine.model_returned(silent))
    used = [e for e in d.entries if e["kind"] == "llm_usage"]
    alerts = [data for t, data, _ in d.events if t == "alert"]
    if capped:
        assert all(e["input"] > 100 and e["output"] > 40 for e in used), used
        assert d.machine.state.usage.total == sum(e["input"] + e["output"] for e in used)
        assert len(alerts) == 1 and "no token usage" in alerts[0]["message"]
    else:  # nothing to enforce: the numbers stay what the provider said
        assert all(e["input"] == e["output"] == 0 for e in used) and alerts == []


@pytest.mark.parametrize("what", ["paused", "queued"])
def test_cancel_of_a_paused_or_queued_run_answers_once_its_end_is_in_the_log(what: str) -> None:
    """`cancel` of the active run answers once the run's end is written (durable reply); the
    same must hold for a paused run and a queued one, or a crash right after `{cancelled:
    true}` brings the run back (paused, to be resumed; queued, to be started)."""
    d = Driver()
    d.call("run", "work")
    if what == "paused":
        d.model(calls=1)
        d.answer(d.call("pause"))
        d.tool()
        assert d.machine.pod_state == "paused"
        token = d.call("cancel")
    else:
        queued = d.answer(d.call("run", "later")).result.run_id
        token = d.call("cancel", queued)
    (reply,) = [e for e in d.effects if isinstance(e, Reply) and e.token == token]
    assert reply.result.cancelled
    assert reply.durable, "answered before the run's end is written"


def test_resume_after_a_pause_withdrew_a_retrying_call_pauses_and_goes_on() -> None:
    """The pause interrupted a call waiting to retry (the call is gone): a resume before the
    run's end is written still ends it `paused` and takes it up at once."""
    d = Driver()
    run_id = d.answer(d.call("run", "work")).result.run_id
    d.feed(d.machine.model_retrying(True))
    assert d.answer(d.call("pause")).result.paused
    assert any(isinstance(e, Interrupt) for e in d.effects)
    assert d.answer(d.call("resume")).result.run_id == run_id
    d.model_fails(None)
    assert isinstance(d.inflight, CallModel) and d.inflight.run_id == run_id
    d.model("done")
    finished = [data["outcome"] for t, data, _ in d.events if t == "run.finished"]
    assert finished == ["paused", "finished"]
