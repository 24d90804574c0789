"""The spawn-tree rules of the machine (issue 10), driven through the in-memory executor:
which runs a child reports, that reports survive a crash until acknowledged, how the spawner
charges its children against its budget, and `errored` for a child that died silently."""

from poddaemon.entries import SPAWNER_KEY, OutboxItem, SessionStart
from poddaemon.machine import MachineConfig
from poddaemon.session import KEPT_ENDED_CHILDREN, fold
from protocol import errors
from tests.unit.machine_driver import Driver


def child_driver(cap: int | None = None) -> Driver:
    cfg = MachineConfig(name="kid", model="m", max_turns=4, budget_cap=cap, reports=True)
    return Driver(cfg=cfg)


def outbox(d: Driver) -> list[dict]:
    return [e for e in d.entries if e["kind"] == "outbox"]


def test_only_runs_the_spawner_asked_for_are_reported() -> None:
    d = child_driver()
    d.call("run", "from the spawner", client_key=f"{SPAWNER_KEY}task")
    d.model("did it")
    d.call("run", "from someone else")
    d.model("other")
    d.call("notify", "ping")
    d.tick()
    d.model("noted")
    (report,) = outbox(d)
    assert report["event_kind"] == "run.finished" and report["text"] == "did it"
    assert report["outcome"] == "finished" and report["usage"]["input"] == 10
    assert report["usage"]["tree_spent"] == 11


def test_a_paused_run_reports_only_when_it_really_ends() -> None:
    d = child_driver()
    d.call("run", "task", client_key=f"{SPAWNER_KEY}task")
    d.call("pause")
    d.model("half", calls=1)  # pauses at the tool safe point: the run ends `paused`
    assert d.machine.pod_state == "paused"
    assert outbox(d) == []
    d.call("resume")
    d.model("whole")
    assert [r["outcome"] for r in outbox(d)] == ["finished"]


def test_unacknowledged_reports_survive_a_restore_and_acks_remove_them() -> None:
    d = child_driver()
    d.call("run", "a", client_key=f"{SPAWNER_KEY}1")
    d.model("one")
    d.call("run", "b", client_key=f"{SPAWNER_KEY}2")
    d.model("two")
    first, second = (r["event_id"] for r in outbox(d))
    d.feed(d.machine.outbox_acked([first]))
    d.sync()
    restored = fold(d.entries)
    assert list(restored.outbox) == [second]  # what a restored child redelivers
    assert restored.spawner_runs == set()


def test_shutdown_reports_unless_the_spawner_is_gone() -> None:
    d = child_driver()
    d.call("run", "x")
    d.model("y")
    d.call("shutdown")
    assert [r["event_kind"] for r in outbox(d)] == ["shutdown"]
    quiet = child_driver()
    quiet.call("run", "x")
    quiet.model("y")
    quiet.machine.final_report = None
    quiet.call("shutdown")
    assert outbox(quiet) == []


def test_a_restored_child_drops_its_undelivered_stop_report_and_keeps_its_results() -> None:
    d = child_driver()
    d.call("run", "task", client_key=f"{SPAWNER_KEY}task")
    d.model("done")
    d.call("shutdown")  # the spawner is down: neither report is acknowledged
    result, stop = outbox(d)
    assert stop["event_kind"] == "shutdown"
    again = child_driver()
    again.lines, again.entries, again.prev = list(d.lines), list(d.entries), d.prev
    again.feed(again.machine.restore(d.entries))
    last = again.entries[-1]
    assert (last["kind"], last["ids"]) == ("outbox_acked", [stop["event_id"]])
    assert list(fold(again.entries).outbox) == [result["event_id"]]  # still delivered


def test_grants_are_reserved_while_children_live_then_reconciled() -> None:
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=4, budget_cap=1000))
    d.call("run", "x")
    d.model("y", usage=99)  # 100 spent
    d.feed(d.machine.child_started("k", "/s", 600, []))
    assert d.machine.budget_charged() == 700 and d.machine.budget_remaining() == 300
    t = d.call("child_report", "k", "run.finished", "e1", "r", "done", "finished", 250)
    assert d.answer(t).result.accepted
    assert d.machine.tree_spent() == 350  # known spending; the grant is still reserved
    d.call("child_report", "k", "shutdown", "e2", None, None, None, 260)
    d.feed(d.machine.child_ended("k", "child pod 'k' died without a final report"))
    assert d.machine.budget_charged() == 360  # its final report: only what it spent
    ended = [e for e in d.entries if e["kind"] == "child_ended"]
    assert ended[-1]["reason"] == "it stopped (shutdown reported)"  # the executor's guess aside
    # A child that dies without a final report keeps its whole grant charged.
    d.feed(d.machine.child_started("j", "/s2", 600, []))
    d.feed(d.machine.child_ended("j", "child pod 'j' died"))
    assert d.machine.budget_charged() == 960
    assert any(e["kind"] == "system_item" and e.get("event_kind") == "errored" for e in d.entries)
    d.feed(d.machine.child_started("i", "/s3", 100, []))
    assert d.machine.budget_exhausted()
    refused = d.answer(d.call("run", "more")).error
    assert refused is not None and refused.code == errors.BUDGET_EXHAUSTED
    restored = fold(d.entries)
    assert {n: (c.live, c.charged()) for n, c in restored.children.items()} == {
        "k": (False, 260),
        "j": (False, 600),
        "i": (True, 100),
    }


def test_a_child_that_died_in_a_run_we_gave_it_shows_that_run_errored_not_the_one_before() -> None:
    """wait_pods gives each child's last run's outcome and text (SPEC §9): a child killed in
    its second run showed its first, `finished`, with that run's answer, as its last."""
    d = Driver()
    for kid in ("busy", "idle"):
        d.feed(d.machine.child_started(kid, f"/{kid}", None, []))
        d.call("child_report", kid, "run.finished", f"e-{kid}", "r1", "first answer", "finished")
    d.feed(d.machine.child_ended("busy", "child pod 'busy' died", mid_run=True))
    d.feed(d.machine.child_ended("idle", "child pod 'idle' died"))  # between runs
    for children in (d.machine.state.children, fold(d.entries).children):  # live and restored
        busy, idle = children["busy"], children["idle"]
        assert (busy.outcome, busy.text) == ("error", "child pod 'busy' died")
        assert (idle.outcome, idle.text) == ("finished", "first answer")
    errored = [e for e in d.entries if e.get("event_kind") == "errored"]
    assert [e["pod"] for e in errored] == ["busy", "idle"]  # both told to the model, as before


def test_a_reused_child_name_keeps_the_ended_childs_spending_charged() -> None:
    """spawn_pod may reuse the name of an ended child: its spending stays counted (it was
    dropped with the old record, so a tree could spend its cap again and again)."""
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=4, budget_cap=1000))
    d.feed(d.machine.child_started("w", "/s", 400, []))
    d.call("child_report", "w", "shutdown", "e1", None, None, None, 400)
    d.feed(d.machine.child_ended("w", "gone"))
    d.feed(d.machine.child_started("w", "/s", 400, []))
    assert d.machine.budget_charged() == 800 and d.machine.tree_spent() == 400
    d.call("child_report", "w", "shutdown", "e2", None, None, None, 300)
    d.feed(d.machine.child_ended("w", "gone"))
    assert d.machine.budget_charged() == 700 == d.machine.tree_spent()
    # The same child restarted and re-adopted: its grant is reserved again, and its reports
    # count its spending from its first start.
    d.feed(d.machine.child_started("w", "/s", None, [], resumed=True))
    assert d.machine.budget_charged() == 800
    d.call("child_report", "w", "shutdown", "e3", None, None, None, 350)
    d.feed(d.machine.child_ended("w", "gone"))
    assert d.machine.budget_charged() == 750
    assert fold(d.entries).children["w"].charged() == 750


def test_a_spawner_keeps_its_newest_ended_children_and_counts_what_all_of_them_spent() -> None:
    """Each child that ended stayed in the spawner's state, and in every new session's first
    entry, for good. The oldest beyond KEPT_ENDED_CHILDREN are dropped; their spending stays
    in the budget and in tree_spent, across a fork too."""
    cfg = MachineConfig(name="p", model="m", max_turns=4, budget_cap=10**9, max_pending=10**6)
    d = Driver(cfg=cfg)
    n = KEPT_ENDED_CHILDREN + 3
    for i in range(n):
        d.feed(d.machine.child_started(f"c{i}", f"/s{i}", 50, []))
        d.call("child_report", f"c{i}", "shutdown", f"e{i}", None, None, None, 10)
        d.feed(d.machine.child_ended(f"c{i}", "gone"))
    d.feed(d.machine.child_started("live", "/s", 500, []))
    state = d.machine.state
    assert list(state.children) == [f"c{i}" for i in range(3, n)] + ["live"]
    assert d.machine.tree_spent() == 10 * n
    assert d.machine.budget_charged() == 10 * n + 500  # the live child's grant is reserved
    again = fold([d.machine.fork()])
    assert again.children.keys() == state.children.keys()
    assert again.ended_spent == 30 == fold(d.entries).ended_spent


def test_a_fork_carries_the_tree_state_on() -> None:
    d = child_driver()
    d.call("run", "a", client_key=f"{SPAWNER_KEY}1")
    d.model("one")
    d.feed(d.machine.child_started("g", "/s", 5, [{"target": "/w", "permission": "write"}]))
    d.call("child_report", "g", "run.finished", "ev-9", "r", "t", "finished", 3)
    before = fold(d.entries)
    start = d.machine.fork()
    after = fold([start])
    assert list(after.outbox) == list(before.outbox)
    assert after.children == before.children
    assert "ev-9" in after.report_ids


def restored_mid_task() -> Driver:
    """A child restored from the log of a crash in the middle of its spawner's task."""
    d = child_driver()
    d.call("run", "long task", client_key=f"{SPAWNER_KEY}task")
    d.sync()
    again = Driver(cfg=d.cfg, n=d.n + 1000)
    again.entries, again.lines, again.prev = list(d.entries), list(d.lines), d.prev
    again.durable = len(again.lines)
    again.feed(again.machine.restore(d.entries))
    return again


def test_a_run_the_spawner_asked_for_that_a_crash_interrupted_is_reported() -> None:
    (report,) = outbox(restored_mid_task())
    assert report["event_kind"] == "run.finished" and report["outcome"] == "error"
    assert "interrupted" in report["text"]


def test_the_run_that_takes_up_an_interrupted_spawner_run_is_reported_too() -> None:
    """Restored after a crash mid-task: the task's run is reported interrupted, and the run
    its restart note wakes takes the work up; that one's end is reported as well (it went
    unreported, so the spawner heard only of the failure). A fork between carries it on."""
    again = restored_mid_task()
    (cut,) = outbox(again)
    snap = again.machine.state.tree_snapshot()  # what a fork or a compaction carries on
    carried = SessionStart(session_id="s2", pod="kid", system_prompt="", seq=1, ts=1.0, tree=snap)
    assert fold([carried]).owed_runs == {cut["run_id"]}
    again.tick()  # the restart note wakes the pod
    start = [e for e in again.entries if e["kind"] == "run_start"][-1]
    assert start["continues"] == cut["run_id"]
    again.model("the task, done after all")
    first, done = outbox(again)
    assert first == cut
    assert (done["run_id"], done["outcome"]) == (start["run_id"], "finished")
    assert done["text"] == "the task, done after all"
    state = fold(again.entries)
    assert state.owed_runs == set() and state.spawner_runs == set()


def test_reports_left_in_a_gone_childs_log_are_accepted_once_and_end_it() -> None:
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=4, budget_cap=1000))
    d.feed(d.machine.child_started("k", "/s", 600, []))
    d.call("child_report", "k", "run.finished", "e1", "r", "done", "finished", 250)
    left = [
        OutboxItem(event_id="e1", event_kind="run.finished", run_id="r", text="done"),
        OutboxItem(event_id="e2", event_kind="shutdown", usage={"tree_spent": 300}),
    ]
    d.feed(d.machine.child_left_reports("k", left))
    d.feed(d.machine.child_ended("k", "gone"))
    kinds = [e.get("event_kind") for e in d.entries if e["kind"] == "system_item"]
    assert kinds == ["run.finished", "shutdown"]  # e1 once; no `errored`: it ended reporting
    assert d.machine.budget_charged() == 300  # what it spent, not its whole grant
