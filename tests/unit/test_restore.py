"""Restore and the machine's invariants, as properties over random command sequences.

Sessions are produced by the real `Machine` (through the in-memory executor of
`machine_driver.py`, in the real log format) with crashes injected: a crash keeps any prefix of
what was written that holds at least what was fsync'd, then a new machine restores from it. Over
every such history:

- a cut file verifies to exactly its complete lines and folds without raising;
- nothing is acknowledged before the entry it acknowledges is synced;
- folding the committed log gives the machine's own state;
- every tool call gets exactly one result; every run ends in exactly one final `run_end`
  (`paused` is the one outcome that is not final);
- no acknowledged input is lost across restarts.

The last test runs the real `Pod.restore` on a file."""

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import event, given, settings
from hypothesis import strategies as st

from poddaemon.history import AssistantMessage, Item, SystemNote, ToolResult, UserMessage
from poddaemon.llm.types import ProviderError
from poddaemon.machine import CallModel, MachineConfig, Reply, RunTool
from poddaemon.session import SessionState, fold
from poddaemon.store.log import verify
from poddaemon.turn import HOOKS_CUT_SHORT_BY_CRASH, interrupted_output
from tests.unit.machine_driver import Driver

ACTIONS = (
    *("run", "notify", "steer", "pause", "cancel", "cancel_queued", "resume", "sync", "tick"),
    *("work",) * 8,
)


def step(d: Driver, data: st.DataObject) -> None:
    action = data.draw(st.sampled_from(ACTIONS))
    s = d.machine.state
    if action == "run":
        text = f"input {d.n}"
        key = f"k{d.n}" if data.draw(st.booleans()) else None
        d.call("run", text, client_key=key, wait=data.draw(st.booleans()))
        check_acks_are_durable(d)
    elif action == "notify":
        d.call("notify", f"note {d.n}", "ci")
        check_acks_are_durable(d)
    elif action == "steer":
        d.call("run", f"steer {d.n}", mode="steer")
        check_acks_are_durable(d)
    elif action == "pause":
        d.call("pause")
    elif action == "cancel":
        d.call("cancel")
    elif action == "cancel_queued" and s.pending_runs:
        d.call("cancel", data.draw(st.sampled_from(sorted(s.pending_runs))))
    elif action == "resume":
        d.call("resume")
    elif action == "sync":
        d.sync()
    elif action == "tick":
        d.tick(data.draw(st.sampled_from([0.01, 0.06, 2.0])))
    elif action == "work":
        work(d, data)


def work(d: Driver, data: st.DataObject) -> None:
    """Finish whatever is in flight: a model call (answer, tools, error, interruption) or a tool."""
    if isinstance(d.inflight, CallModel):
        if d.interrupted:
            d.model_fails(None)
            return
        kind = data.draw(st.integers(0, 9))
        if kind == 0:
            d.model_fails(ProviderError("fatal", "boom"))
        elif kind == 1:
            d.model("cut", calls=data.draw(st.integers(0, 2)), stop="max_tokens")
        else:
            d.model(
                "answer", calls=data.draw(st.integers(0, 3)), usage=data.draw(st.integers(0, 9))
            )
    elif isinstance(d.inflight, RunTool):
        is_error = data.draw(st.booleans())
        if data.draw(st.booleans()):  # PostToolUse hooks to run: the tool's own output first
            d.feed(d.machine.tool_finished(d.inflight.call.id, "tool output", is_error))
            if data.draw(st.booleans()):
                return  # a crash (or more commands) while the hooks run
        d.tool("tool output", is_error=is_error)
    elif d.timer is not None:
        d.tick(d.timer - d.now + 0.001)


def check_acks_are_durable(d: Driver) -> None:
    """A successful run/notify answer is never sent before its entry can be synced."""
    for e in d.effects:
        if isinstance(e, Reply) and e.error is None:
            result = e.result
            if hasattr(result, "notification_id") or getattr(result, "state", "") in (
                "started",
                "queued",
                "steered",
            ):
                assert e.durable, e


def crash(d: Driver, data: st.DataObject) -> Driver:
    """kill -9: keep what was written, or for a machine crash any prefix holding what was
    synced (maybe a torn last line); then a new machine restores from the file."""
    blob = b"".join(d.lines)
    floor = sum(map(len, d.lines[: d.durable]))
    if not blob:
        return Driver(cfg=d.cfg, now=d.now + 100, n=d.n + 1000)
    cut = data.draw(st.integers(max(floor, 1), len(blob)), label="cut")
    result = verify(blob[:cut])
    assert result.end_offset <= cut
    again = Driver(cfg=d.cfg, now=d.now + 100, n=d.n + 1000)
    again.acked = [e for e in d.acked]
    if not result.entries:
        return again
    again.entries = list(result.entries)
    again.lines = _lines(blob[: result.end_offset])
    again.prev = result.head
    again.durable = len(again.lines)
    state_before = fold(result.entries)
    if state_before.active_run is not None:
        event("restore closes an interrupted run")
    again.feed(again.machine.restore(result.entries))
    return again


def _lines(blob: bytes) -> list[bytes]:
    return [line + b"\n" for line in blob.split(b"\n")[:-1]]


def drain(d: Driver, data: st.DataObject) -> None:
    """Answer everything until the pod is idle (or paused), as a well-behaved model would."""
    for _ in range(200):
        if isinstance(d.inflight, CallModel):
            if d.interrupted:
                d.model_fails(None)
            else:
                d.model("final")
        elif isinstance(d.inflight, RunTool):
            d.tool()
        elif d.timer is not None:
            d.tick(5.0)
        elif d.machine.state.paused_run is not None and d.machine.state.active_run is None:
            d.call("resume")
        else:
            return
    raise AssertionError("the machine never settled")


def check_fold_matches(d: Driver) -> None:
    if not d.entries:
        return
    on_disk = fold(verify(b"".join(d.lines)).entries)
    assert msgspec.structs.replace(on_disk, head="") == msgspec.structs.replace(
        d.machine.state, head=""
    )


def check_pairing(history: list[Item]) -> None:
    open_ids: list[str] = []
    for item in history:
        if isinstance(item, AssistantMessage):
            assert not open_ids, f"calls {open_ids} have no result"
            open_ids = [c.id for c in item.tool_calls]
        elif isinstance(item, ToolResult):
            assert item.call_id in open_ids, f"result for unknown call {item.call_id}"
            open_ids.remove(item.call_id)
    assert not open_ids, f"calls {open_ids} have no result"


def check_runs_end_once(entries: list[dict[str, Any]]) -> None:
    ends: dict[str, list[str]] = {}
    for e in entries:
        if e["kind"] == "run_end":
            ends.setdefault(e["run_id"], []).append(e["outcome"])
    for run_id, outcomes in ends.items():
        assert all(o == "paused" for o in outcomes[:-1]), (run_id, outcomes)
    started = {e["run_id"] for e in entries if e["kind"] == "run_start"}
    for run_id in started:
        assert run_id in ends, f"run {run_id} never ended"
        assert ends[run_id][-1] != "paused", f"run {run_id} still paused"


def check_nothing_acknowledged_lost(
    state: SessionState, entries: list[dict[str, Any]], acked: list[dict[str, Any]]
) -> None:
    """Each acknowledged input is in the history the model saw (or was a cancelled run)."""
    users = [i.text for i in state.history if isinstance(i, UserMessage)]
    notes = "\n".join(i.text for i in state.history if isinstance(i, SystemNote))
    ended = {e["run_id"]: e["outcome"] for e in entries if e["kind"] == "run_end"}
    for e in acked:
        if e["kind"] == "user_input" and e.get("mode", "queue") == "queue":
            cancelled = ended.get(e["run_id"]) == "cancelled"
            assert e["text"] in users or cancelled, e
        elif e["kind"] == "user_input":
            # A steer that arrived as its run ended: delivered to a later run, or still pending
            # when no run came after it.
            assert e["text"] in users or e["id"] in state.pending_inputs, e
        else:
            assert e["text"] in notes, e


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_the_machine_keeps_its_invariants_across_crashes(data: st.DataObject) -> None:
    d = Driver()
    crashes = 0
    for _ in range(data.draw(st.integers(1, 70), label="steps")):
        if data.draw(st.integers(0, 14)) == 0:
            d = crash(d, data)
            crashes += 1
        else:
            step(d, data)
        check_fold_matches(d)
    event(f"crashes: {min(crashes, 3)}")
    drain(d, data)
    d.sync()
    check_fold_matches(d)
    if not d.entries:
        return
    state = d.machine.state
    assert state.active_run is None and state.open_calls == []
    check_pairing(state.history)
    check_runs_end_once(d.entries)
    check_nothing_acknowledged_lost(state, d.entries, d.acked)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_session_cut_anywhere_verifies_to_its_complete_lines_and_restores(
    data: st.DataObject,
) -> None:
    d = Driver()
    for _ in range(data.draw(st.integers(1, 50), label="steps")):
        step(d, data)
    if not d.lines:
        return
    blob = b"".join(d.lines)
    k = data.draw(st.integers(1, len(d.lines)), label="line")
    start = sum(map(len, d.lines[: k - 1]))
    torn = data.draw(st.booleans(), label="torn")
    cut = (
        start + data.draw(st.integers(0, len(d.lines[k - 1]) - 1))
        if torn
        else start + len(d.lines[k - 1])
    )
    complete = k - 1 if torn else k
    result = verify(blob[:cut])
    assert result.entries == d.entries[:complete]
    assert result.torn == (cut != sum(map(len, d.lines[:complete])))
    if not complete:
        return
    again = Driver(now=d.now + 100, n=d.n + 1000)
    again.lines, again.entries, again.prev = d.lines[:complete], list(result.entries), result.head
    again.feed(again.machine.restore(result.entries))
    check_fold_matches(again)
    assert again.machine.state.open_calls == [] or again.machine.state.active_run is not None


# --- the real Pod.restore on a file --------------------------------------------------------------


def make_pod(sessions_dir: str) -> Any:
    from poddaemon.config.manifest import (
        Manifest,
        PodSection,
        ProviderConfig,
        ScopeRule,
        ScopeSection,
    )
    from poddaemon.events import EventBus
    from poddaemon.pod import Pod, Services
    from poddaemon.prompt import Instruction
    from poddaemon.scope import Scope
    from poddaemon.toolset import Toolset

    manifest = Manifest(
        pod=PodSection(name="p", pwd=sessions_dir),
        provider=ProviderConfig(kind="openai", model="m"),
        scope=ScopeSection(allow=[ScopeRule(target=sessions_dir, permission="read")]),
    )
    services = Services(
        manifest=manifest,
        scope=Scope.from_config(manifest.scope.allow, manifest.scope.deny, cwd=sessions_dir),
        registry=None,  # type: ignore[arg-type]
        entry=None,  # type: ignore[arg-type]
        bus=EventBus(),
        sessions_dir=sessions_dir,
        instruction=Instruction("", "test"),
        tools=Toolset({}),
        model=None,  # type: ignore[arg-type]
    )
    return Pod(services)


class ModelStandIn:
    """What a model offers besides `stream` (which a subclass gives), doing nothing."""

    async def warm(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def runnable_pod(sessions_dir: str, model: Any) -> Any:
    """`make_pod` with a model, and stand-ins for the registry and its entry: it can run."""
    import os

    pod = make_pod(sessions_dir)
    pod.s.model = model
    pod.s.registry = type("Registry", (), {"update": lambda *a, **k: None})()
    pod.s.entry = type("Entry", (), {"pid": os.getpid()})()
    return pod


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_pod_restore_of_a_cut_file(data: st.DataObject) -> None:
    d = Driver(cfg=MachineConfig(name="p", model="m", max_turns=4))
    for _ in range(data.draw(st.integers(1, 50), label="steps")):
        step(d, data)
    if len(d.lines) < 2:
        return
    blob = b"".join(d.lines)
    cut = data.draw(st.integers(len(d.lines[0]), len(blob)), label="cut")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        path = Path(tmp) / f"{d.machine.state.session_id}.jsonl"
        path.write_bytes(blob[:cut])
        pod = make_pod(tmp)

        async def go() -> list[str]:
            warnings: list[str] = await pod.restore(d.machine.state.session_id)
            return warnings

        expected = verify(blob[:cut])
        warnings = asyncio.run(go())
        assert bool(warnings) == expected.torn
        state: SessionState = pod.machine.state
        assert pod.plog.log is not None
        pod.plog.log.close()
        on_disk = verify(path.read_bytes())
    assert not on_disk.torn
    k = len(expected.entries)
    assert on_disk.entries[:k] == expected.entries
    assert msgspec.structs.replace(fold(on_disk.entries), head="") == msgspec.structs.replace(
        state, head=""
    )
    before = fold(expected.entries)
    for e in on_disk.entries[k:]:
        if e["kind"] == "tool_result":
            # A call whose tool had returned (its PostToolUse hooks cut short) keeps its output.
            done = before.tool_outputs.get(e["item"]["call_id"])
            if done is None:
                assert e["item"]["output"] == interrupted_output(e["item"]["name"])
            else:
                assert e["item"]["output"] == f"{done.item.output}\n{HOOKS_CUT_SHORT_BY_CRASH}"
        if e["kind"] == "run_end" and e["run_id"] == before.active_run:
            assert e["interrupted"] is True
