"""Sessions written before the pod machine (0.1) restore unchanged: the checked-in log has runs,
tools, steer, notifications, a pause, a kill -9 mid-tool and the restore that closed its call."""

import json
from pathlib import Path

import msgspec

from poddaemon.history import item_to_builtins
from poddaemon.machine import MachineConfig
from poddaemon.session import fold, input_digest
from poddaemon.store.log import verify
from tests.unit.machine_driver import Driver

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
# The one intended change since 0.1: a notification block no longer says "while you worked"
# (a notification can wake an idle pod), and the overflow line no longer says "will".
RENAMED = (("arrived while you worked:", "arrived:"), ("and will follow", "and follow"))


def test_a_v1_session_folds_to_the_same_state() -> None:
    entries = verify((FIXTURES / "v1_session.jsonl").read_bytes()).entries
    expected = json.loads((FIXTURES / "v1_session.expected.json").read_text())
    state = fold(entries)
    history = json.dumps(expected["history"])
    for old, new in RENAMED:
        history = history.replace(old, new)
    as_json = json.loads(msgspec.json.encode([item_to_builtins(i) for i in state.history]))
    assert as_json == json.loads(history)
    assert state.session_id == expected["session_id"]
    assert state.pending_runs == {} and expected["pending_runs"] == []
    assert state.pending_notifications == expected["pending_notifications"] == 0
    assert (state.active_run, state.paused_run) == (expected["active_run"], expected["paused_run"])
    assert state.usage_calls == expected["usage_calls"]
    assert state.usage.input == expected["usage"]["input"]
    assert state.usage.output == expected["usage"]["output"]
    # Keys were one namespace in 0.1: a run key and a notify key both still replay. A key
    # keeps its input's digest now, and an outcome is kept only for a keyed run.
    legacy = expected["client_keys"]
    assert {k: list(v) for k, v in state.run_keys.items()} == {
        k: [input_digest(text), rid, False]
        for k, (text, rid) in legacy.items()
        if k.startswith("k-run")
    }
    assert {k: list(v) for k, v in state.notify_keys.items()} == {
        k: [input_digest(text), nid, False]  # `wakes` was not logged: a retry says false
        for k, (text, nid) in legacy.items()
        if k.startswith("k-note")
    }
    keyed = {rid for _, rid, _ in state.run_keys.values()}
    assert keyed and state.run_outcomes.keys() == keyed & expected["run_outcomes"].keys()
    for run_id, got in state.run_outcomes.items():
        outcome = expected["run_outcomes"][run_id]
        assert (got["outcome"], got["text"], got["error"]) == (
            outcome["outcome"],
            outcome["text"],
            outcome["error"],
        )


def test_a_v1_session_restores_and_takes_new_work() -> None:
    entries = verify((FIXTURES / "v1_session.jsonl").read_bytes()).entries
    d = Driver(cfg=MachineConfig(name="fixture", model="fake-model", max_turns=5))
    blob = (FIXTURES / "v1_session.jsonl").read_bytes()
    d.lines = [line + b"\n" for line in blob.split(b"\n")[:-1]]
    d.entries, d.prev = list(entries), entries[-1]["hash"]
    d.feed(d.machine.restore(entries))
    assert d.machine.pod_state == "idle"  # nothing was left open
    replay = d.answer(d.call("run", "read the notes", client_key="k-run-1")).result
    assert replay.run_id == d.machine.state.run_keys["k-run-1"][1]
    d.call("run", "new work")
    d.model("done")
    assert d.machine.pod_state == "idle"
    assert fold(verify(b"".join(d.lines)).entries).run_outcomes == d.machine.state.run_outcomes
