"""Restore after a crash, as a property: a pod-like session (driven through the real turn
machine, encoded in the real log format) cut at any byte verifies to exactly its complete
lines, folds without raising, and once restored (open calls closed, the interrupted run ended)
has a valid history that has lost nothing acknowledged.

The first property is pure (bytes in memory, `verify` + `fold`, the restore's closing entries
built as `Pod.restore` builds them); the second runs the real `Pod.restore` on a file."""

import asyncio
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from poddaemon.events import EventBus
from poddaemon.history import (
    AssistantMessage,
    Item,
    SystemNote,
    ToolCall,
    ToolResult,
    Usage,
    UserMessage,
)
from poddaemon.llm.types import ModelResponse, ProviderError, StopReason
from poddaemon.session import SessionState, fold
from poddaemon.store.log import GENESIS, encode_entry, verify
from poddaemon.turn import INTERRUPTED, CallModel, Finished, Turn, interrupted_results

T0 = 1_700_000_000.0


@dataclass
class Sim:
    """Writes entries in the order pod.py writes them, deciding from the folded state as the pod
    does. Every acknowledged input has a unique text, so it can be found again."""

    lines: list[bytes] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    prev: str = GENESIS
    state: SessionState = field(default_factory=SessionState)
    turn: Turn | None = None
    resume: bool = False
    n: int = 0
    acked: list[dict[str, Any]] = field(default_factory=list)  # user_input / system_item

    def commit(self, kind: str, body: dict[str, Any]) -> None:
        line, entry = encode_entry(
            len(self.entries) + 1, T0 + len(self.entries), kind, self.prev, body
        )
        self.prev = entry["hash"]
        self.lines.append(line)
        self.entries.append(entry)
        self.state.apply(entry)

    def new_id(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def step(self, data: st.DataObject) -> None:
        s = self.state
        action = data.draw(
            st.sampled_from(
                [
                    *("queue", "notify", "steer", "pause", "cancel", "resume", "drop"),
                    *("work",) * 6,
                ]
            )
        )
        if action == "queue":
            run_id = self.new_id("r")
            body = {"run_id": run_id, "text": f"input of {run_id}", "mode": "queue"}
            if data.draw(st.booleans()):
                body["client_key"] = f"key-{run_id}"
            self.commit("user_input", body)
        elif action == "notify":
            nid = self.new_id("n")
            self.commit("system_item", {"id": nid, "source": "ci", "text": f"note {nid}"})
        elif action == "steer" and s.active_run is not None:
            sid = self.new_id("s")
            body = {"id": sid, "run_id": s.active_run, "text": f"steer {sid}", "mode": "steer"}
            self.commit("user_input", body)
        elif action == "pause" and self.turn is not None:
            self.turn.request_pause()
        elif action == "cancel" and self.turn is not None:
            self.turn.request_cancel()
        elif action == "resume" and s.paused_run is not None and s.active_run is None:
            self.resume = True
        elif action == "drop" and s.pending_runs:
            run_id = data.draw(st.sampled_from(sorted(s.pending_runs)))
            self.commit("run_end", {"run_id": run_id, "outcome": "cancelled", "text": ""})
        elif action == "work":
            self.work(data)
        if self.entries[-1]["kind"] in ("user_input", "system_item"):
            self.acked.append(self.entries[-1])

    def work(self, data: st.DataObject) -> None:
        """One unit of the pod's driver: start a run, one model round, one tool, or the end."""
        turn = self.turn
        if turn is None:
            self.start(data)
        elif turn.in_tools:
            tool = turn.next_tool()
            if tool is not None:
                for rec in turn.tool_returned(tool.call.id, "tool output", False):
                    self.commit(rec.kind, rec.body)
        elif isinstance(step := turn.next_step(), Finished):
            body: dict[str, Any] = {"run_id": turn.run_id, "outcome": step.outcome}
            body["text"] = step.text
            if step.error:
                body["error"] = step.error
            self.commit("run_end", body)
            self.turn = None
        else:
            assert isinstance(step, CallModel)
            self.model_round(turn, data)

    def start(self, data: st.DataObject) -> None:
        s = self.state
        if self.resume and s.paused_run is not None:
            run_id, trigger = s.paused_run, "input"
        elif s.pending_runs:
            run_id, trigger = next(iter(s.pending_runs)), "input"
        elif s.pending_notifications and s.paused_run is None:
            run_id, trigger = self.new_id("w"), "notifications"
        else:
            return
        self.resume = False
        self.commit("run_start", {"run_id": run_id, "trigger": trigger})
        max_turns = data.draw(st.integers(1, 4))
        self.turn = Turn(run_id, max_turns, rounds=self.state.rounds)

    def model_round(self, turn: Turn, data: st.DataObject) -> None:
        ids, _ = self.state.deliverable()
        if ids:
            notes = sum(1 for i in ids if self.state.pending_inputs[i].kind == "notification")
            more = self.state.pending_notifications - notes
            self.commit("inputs_delivered", {"ids": ids, "more": more})
        outcome = data.draw(st.integers(0, 9))
        if outcome == 0:
            records = turn.model_failed(None)
        elif outcome == 1:
            records = turn.model_failed(ProviderError("fatal", "boom"))
        else:
            calls = tuple(
                ToolCall(id=self.new_id("c"), name="read_file", arguments='{"path": "x"}')
                for _ in range(data.draw(st.integers(0, 3)))
            )
            stops: list[StopReason] = ["tool_use", "max_tokens"] if calls else ["end_turn"]
            usage = Usage(input=data.draw(st.integers(0, 50)), output=3)
            self.commit(
                "llm_usage",
                {"run_id": turn.run_id, "model": "m", "input": usage.input, "output": 3},
            )
            response = ModelResponse(
                message=AssistantMessage(text="answer", tool_calls=list(calls)),
                stop=data.draw(st.sampled_from(stops)),
                usage=usage,
            )
            records = turn.model_returned(response, more_input=self.state.pending_steers > 0)
        for rec in records:
            self.commit(rec.kind, rec.body)


RESTART_TEXT = "The pod restarted while your previous run was in progress"


def restore_records(state: SessionState) -> list[tuple[str, dict[str, Any]]]:
    """The entries `Pod.restore` appends to a session a crash left with an active run."""
    run_id = state.active_run
    if run_id is None:
        return []
    out = [(rec.kind, rec.body) for rec in interrupted_results(state.open_calls, run_id)]
    out.append(
        (
            "run_end",
            {
                "run_id": run_id,
                "outcome": "error",
                "text": "",
                "error": "interrupted: the pod stopped during this run",
                "interrupted": True,
            },
        )
    )
    out.append(
        ("system_item", {"id": f"restart-{run_id}", "source": "poddaemon", "text": RESTART_TEXT})
    )
    return out


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


def check_nothing_acknowledged_lost(state: SessionState, acked: list[dict[str, Any]]) -> None:
    """Each acknowledged input is either still pending (the restored pod will process it) or
    already part of the history the model sees."""
    users = [i.text for i in state.history if isinstance(i, UserMessage)]
    notes = "\n".join(i.text for i in state.history if isinstance(i, SystemNote))
    for e in acked:
        if e["kind"] == "user_input" and e["mode"] == "queue":
            run_id = e["run_id"]
            cancelled = state.run_outcomes.get(run_id, {}).get("outcome") == "cancelled"
            assert run_id in state.pending_runs or e["text"] in users or cancelled, e
        elif e["kind"] == "user_input":
            assert e["id"] in state.pending_inputs or e["text"] in users, e
        else:
            assert e["id"] in state.pending_inputs or e["text"] in notes, e


def generate(data: st.DataObject) -> Sim:
    sim = Sim()
    start = {"session_id": "S", "pod": "p", "system_prompt": "", "config": {}, "history": []}
    sim.commit("session_start", start)
    for _ in range(data.draw(st.integers(0, 60), label="steps")):
        sim.step(data)
    return sim


def draw_cut(data: st.DataObject, sim: Sim, first: int = 1) -> int:
    """A byte offset: every line equally likely (not weighted by its length), and half the time
    exactly at its end (a crash between two appends) rather than inside it (a torn write)."""
    k = data.draw(st.integers(first, len(sim.lines)), label="line")
    start = sum(map(len, sim.lines[: k - 1]))
    if data.draw(st.booleans(), label="whole line"):
        return start + len(sim.lines[k - 1])
    return start + data.draw(st.integers(0, len(sim.lines[k - 1]) - 1), label="offset")


def complete_prefix(sim: Sim, cut: int) -> int:
    """How many whole lines (newline included) the first `cut` bytes hold."""
    end = 0
    for k, line in enumerate(sim.lines):
        end += len(line)
        if end > cut:
            return k
    return len(sim.lines)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_session_cut_anywhere_restores_to_its_complete_lines(data: st.DataObject) -> None:
    sim = generate(data)
    blob = b"".join(sim.lines)
    cut = draw_cut(data, sim)
    k = complete_prefix(sim, cut)
    event(f"cut inside a line: {cut != sum(map(len, sim.lines[:k]))}")

    result = verify(blob[:cut])
    assert result.entries == sim.entries[:k]
    assert result.torn == (cut != sum(map(len, sim.lines[:k])))
    assert result.end_offset == sum(map(len, sim.lines[:k]))
    if k == 0:
        return  # the session never started: nothing was acknowledged in it

    state = fold(result.entries)  # never raises, whatever the cut
    if state.active_run is not None:
        event("restore closes an interrupted run")
        if state.open_calls:
            event("restore closes open tool calls")

    # Restore appends its closing entries after the complete prefix; the chain continues.
    head, seq = result.head, len(result.entries)
    tail = b""
    open_calls = {c.id for c in state.open_calls}
    for kind, body in restore_records(state):
        seq += 1
        line, entry = encode_entry(seq, T0 + 10_000 + seq, kind, head, body)
        head = entry["hash"]
        tail += line
        state.apply(entry)
    again = verify(blob[: result.end_offset] + tail)
    assert not again.torn and len(again.entries) == seq
    assert fold(again.entries) == state

    assert state.active_run is None and state.open_calls == []
    check_pairing(state.history)
    synthetic = {i.call_id for i in state.history if isinstance(i, ToolResult)} & open_calls
    assert synthetic == open_calls
    acked = [e for e in sim.acked if e["seq"] <= k]
    check_nothing_acknowledged_lost(state, acked)


# --- the real Pod.restore on a file --------------------------------------------------------------


def make_pod(sessions_dir: str) -> Any:
    from poddaemon.config.manifest import (
        Manifest,
        PodSection,
        ProviderConfig,
        ScopeRule,
        ScopeSection,
    )
    from poddaemon.pod import Pod, Services

    manifest = Manifest(
        pod=PodSection(name="p", pwd=sessions_dir),
        provider=ProviderConfig(kind="openai", model="m"),
        scope=ScopeSection(allow=[ScopeRule(target=sessions_dir, permission="read")]),
    )
    services = Services(
        manifest=manifest,
        scope=None,  # type: ignore[arg-type]
        registry=None,  # type: ignore[arg-type]
        entry=None,  # type: ignore[arg-type]
        bus=EventBus(),
        sessions_dir=sessions_dir,
        instruction=None,  # type: ignore[arg-type]
        tools={},
        model=None,  # type: ignore[arg-type]
    )
    return Pod(services)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_pod_restore_of_a_cut_file(data: st.DataObject) -> None:
    sim = generate(data)
    blob = b"".join(sim.lines)
    cut = draw_cut(data, sim, first=2) if len(sim.lines) > 1 else len(blob)
    k = complete_prefix(sim, cut)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        path = Path(tmp) / "S.jsonl"
        path.write_bytes(blob[:cut])
        pod = make_pod(tmp)
        warnings = asyncio.run(pod.restore("S"))
        torn = cut != sum(map(len, sim.lines[:k]))
        assert bool(warnings) == torn
        if torn:
            assert f"line {k + 1}" in warnings[0]
        state: SessionState = pod.state
        pod._log.close()
        on_disk = verify(path.read_bytes())
    assert not on_disk.torn
    assert on_disk.entries[:k] == sim.entries[:k]
    assert fold(on_disk.entries) == state
    assert state.active_run is None and state.open_calls == []
    check_pairing(state.history)
    for e in on_disk.entries[k:]:
        if e["kind"] == "tool_result":
            assert e["item"]["output"] == INTERRUPTED
        if e["kind"] == "run_end":
            assert e["interrupted"] is True
    check_nothing_acknowledged_lost(state, [e for e in sim.acked if e["seq"] <= k])
