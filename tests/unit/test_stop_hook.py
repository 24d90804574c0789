"""A blocking Stop hook (SPEC §10, as Claude Code's): the pure machine asks for the Stop hooks'
verdict before a run ends `finished`; a block commits the reason and the run goes on."""

from typing import Any

from poddaemon.history import SystemNote
from poddaemon.machine import CallModel, Interrupt, MachineConfig, RunStopHooks, Stopped
from tests.unit.machine_driver import Driver


def hooked(max_turns: int = 4) -> Driver:
    return Driver(cfg=MachineConfig(name="p", model="m", max_turns=max_turns, stop_hooks=True))


def checks(d: Driver) -> list[RunStopHooks]:
    return [e for e in d.effects if isinstance(e, RunStopHooks)]


def finished(d: Driver) -> list[dict[str, Any]]:
    return [data for type_, data, _ in d.events if type_ == "run.finished"]


def test_a_block_commits_the_reason_and_the_run_gets_another_model_round() -> None:
    d = hooked()
    t = d.call("run", "fix the tests", wait=True)
    d.model("done, I think")
    (check,) = checks(d)
    assert check.stop_hook_active is False
    assert "run_end" not in d.kinds() and d.machine.pod_state == "running"
    d.stop_hooks("2 tests still fail")
    assert d.kinds()[-2:] == ["system_item", "inputs_delivered"]
    item = d.entries[-2]
    assert item["source"] == "hook:Stop"
    assert item["text"] == "Stop hook: 2 tests still fail"
    assert ("notification.committed", item["id"]) in [
        (type_, data.get("notification_id")) for type_, data, _ in d.events
    ]
    assert isinstance(d.inflight, CallModel)
    note = d.inflight.items[-1]
    assert isinstance(note, SystemNote) and "Stop hook: 2 tests still fail" in note.text
    d.model("now they pass")
    (again,) = checks(d)
    assert again.run_id == check.run_id and again.stop_hook_active is True
    d.stop_hooks(None)
    result = d.answer(t).result
    assert result.outcome == "finished" and result.text == "now they pass"
    assert result.usage.calls == 2
    assert [f["outcome"] for f in finished(d)] == ["finished"]
    assert d.kinds().count("run_end") == 1 and d.machine.pod_state == "idle"
    assert d.machine.state.pending_notifications == 0  # the reason was read, nothing wakes


def test_a_block_without_a_reason_says_so() -> None:
    d = hooked()
    d.call("run", "x")
    d.model()
    d.stop_hooks("")
    texts = [e["text"] for e in d.entries if e["kind"] == "system_item"]
    assert texts == ["Stop hook: no reason given"]


def test_without_stop_hooks_a_final_answer_ends_the_run_with_no_check() -> None:
    d = Driver()
    d.call("run", "x")
    d.model("the answer")
    assert not checks(d) and d.inflight is None
    assert d.kinds()[-1] == "run_end" and finished(d)[0]["text"] == "the answer"


def test_max_turns_bounds_repeated_blocks() -> None:
    d = hooked(max_turns=2)
    t = d.call("run", "loop", wait=True)
    d.model("one")
    d.stop_hooks("not yet")
    d.model("two")
    (check,) = checks(d)
    assert check.stop_hook_active
    d.stop_hooks("still not")
    assert d.inflight is None
    result = d.answer(t).result
    assert result.outcome == "limit_reached" and "max_turns (2)" in result.error
    assert result.text == "two"
    # The second reason is not committed: no run would read it, and nothing is left to wake.
    assert [e["text"] for e in d.entries if e["kind"] == "system_item"] == ["Stop hook: not yet"]
    assert d.machine.state.pending_notifications == 0


def test_cancel_during_the_check_interrupts_it_and_ends_the_run_cancelled() -> None:
    d = hooked()
    t = d.call("run", "x", wait=True)
    d.model("answer")
    c = d.call("cancel")
    assert any(isinstance(e, Interrupt) for e in d.effects)
    d.stop_hooks("a verdict that came back anyway")
    assert d.answer(c).result.cancelled  # once the run's end is committed
    result = d.answer(t).result
    assert result.outcome == "cancelled" and result.text == "answer"
    sources = [e["source"] for e in d.entries if e["kind"] == "system_item"]
    assert sources == ["poddaemon"]  # the cancel's note; the late verdict is not committed
    assert d.inflight is None and d.machine.pod_state == "idle"


def test_shutdown_during_the_check_ends_the_run_as_a_stop_mid_run_does() -> None:
    d = hooked()
    t = d.call("run", "x", wait=True)
    d.model("answer")
    d.call("shutdown")
    assert any(isinstance(e, Interrupt) for e in d.effects)
    d.stop_hooks(None)
    result = d.answer(t).result
    assert result.outcome == "error" and "shut down" in result.error
    assert d.kinds()[-2:] == ["run_end", "system_item"]  # picked up at the next start
    assert any(isinstance(e, Stopped) for e in d.effects)


def test_a_pause_during_the_check_ends_the_run_paused_and_resume_checks_again() -> None:
    d = hooked()
    t = d.call("run", "x", wait=True)
    d.model("answer")
    assert d.answer(d.call("pause")).result.paused
    assert not any(isinstance(e, Interrupt) for e in d.effects)  # like a tool: it finishes
    d.stop_hooks("not done")
    assert [f["outcome"] for f in finished(d)] == ["paused"]
    assert not [e for e in d.entries if e["kind"] == "system_item"]
    d.call("resume")
    (check,) = checks(d)  # the world may have changed while paused: asked again
    assert check.stop_hook_active is False
    d.stop_hooks(None)
    assert d.answer(t).result.outcome == "paused"  # a `wait` is answered at the pause
    assert [(f["outcome"], f["text"]) for f in finished(d)][1:] == [("finished", "answer")]
    assert not any(isinstance(e, CallModel) for e in d.effects)


def test_a_steer_during_the_check_is_read_in_the_same_run() -> None:
    d = hooked()
    t = d.call("run", "x", wait=True)
    d.model("answer")
    d.call("run", "also this", mode="steer")
    d.stop_hooks(None)
    assert isinstance(d.inflight, CallModel) and d.inflight.items[-1].text == "also this"  # type: ignore[union-attr]
    d.model("both done")
    d.stop_hooks(None)
    assert d.answer(t).result.text == "both done" and d.kinds().count("run_start") == 1


def test_a_steer_during_the_last_rounds_check_does_not_cut_a_finished_run_short() -> None:
    d = hooked(max_turns=1)
    t = d.call("run", "x", wait=True)
    d.model("answer")
    d.call("run", "also this", mode="steer")
    d.stop_hooks(None)
    assert d.answer(t).result.outcome == "finished"
    assert isinstance(d.inflight, CallModel) and d.kinds().count("run_start") == 2
    assert d.inflight.items[-1].text == "also this"  # type: ignore[union-attr]


def test_a_crash_during_the_check_ends_the_run_once_and_the_next_start_picks_it_up() -> None:
    d = hooked()
    d.call("run", "x")
    d.model("answer")
    queued = d.call("run", "next")
    d.sync()
    again = hooked()
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(d.entries))
    ends = [e for e in again.entries if e["kind"] == "run_end"]
    assert len(ends) == 1 and ends[0]["interrupted"] is True
    assert d.answers[queued].result.state == "queued"
    assert isinstance(again.inflight, CallModel)  # the queued run starts
    assert "next" in str(again.inflight.items) and "restarted" in str(again.inflight.items)
