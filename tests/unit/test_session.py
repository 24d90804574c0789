"""The session fold: entries as the pod writes them (encoded through the real log format, so
bodies are plain JSON as a restore reads them) fold into history plus what is still pending."""

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from poddaemon.entries import body_of
from poddaemon.history import (
    AssistantMessage,
    Item,
    SystemNote,
    ToolCall,
    ToolResult,
    Usage,
    UserMessage,
    item_to_builtins,
)
from poddaemon.llm.types import ModelResponse, StopReason
from poddaemon.session import (
    KEPT_CLIENT_KEYS,
    KEPT_REPORT_IDS,
    KEPT_USAGE_CALLS,
    MAX_NOTIFICATIONS_PER_REQUEST,
    PendingInput,
    SessionState,
    fold,
    input_digest,
    render_notifications,
)
from poddaemon.store.log import GENESIS, encode_entry
from poddaemon.turn import CallModel, Finished, Turn, interrupted_results

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


class Log:
    """Builds entries exactly as SessionLog.append returns them (and restore reads them)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.prev = GENESIS
        self.ts = T0

    def add(self, kind: str, **body: Any) -> dict[str, Any]:
        self.ts += 1.0
        _, entry = encode_entry(len(self.entries) + 1, self.ts, kind, self.prev, body)
        self.prev = entry["hash"]
        self.entries.append(entry)
        return entry

    def start(self, history: list[Item] | None = None, **extra: Any) -> dict[str, Any]:
        items = [item_to_builtins(i) for i in history or []]
        return self.add(
            "session_start",
            session_id="S1",
            pod="p",
            system_prompt="be good",
            config={},
            history=items,
            **extra,
        )


def state_of(log: Log) -> SessionState:
    return fold(log.entries)


def call(cid: str, name: str = "read_file") -> ToolCall:
    return ToolCall(id=cid, name=name, arguments="{}")


def assistant(log: Log, run_id: str, text: str = "", calls: tuple[ToolCall, ...] = ()) -> None:
    log.add("assistant", run_id=run_id, item=AssistantMessage(text=text, tool_calls=calls))


def result(log: Log, run_id: str, c: ToolCall, output: str = "ok") -> None:
    log.add("tool_result", run_id=run_id, item=ToolResult(call_id=c.id, name=c.name, output=output))


# --- inputs -----------------------------------------------------------------------------------


def test_session_start_sets_history_and_tracks_seq_and_head() -> None:
    log = Log()
    e = log.start([UserMessage(text="earlier"), AssistantMessage(text="reply")])
    s = state_of(log)
    assert s.session_id == "S1"
    assert s.history == [UserMessage(text="earlier"), AssistantMessage(text="reply")]
    assert s.last_seq == 1 and s.head == e["hash"]
    log.add("turn_end", run_id="x", round=1)  # kinds without a handler still advance seq/head
    s = state_of(log)
    assert s.last_seq == 2 and s.head == log.entries[-1]["hash"]


def test_queued_input_waits_until_its_run_starts() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="first", mode="queue")
    log.add("user_input", run_id="r2", text="second", mode="queue", client_key="k2")
    s = state_of(log)
    assert list(s.pending_runs) == ["r1", "r2"]
    assert s.pending_runs["r2"].client_key == "k2"
    assert s.history == [] and s.active_run is None
    log.add("run_start", run_id="r1", trigger="input")
    s = state_of(log)
    assert s.active_run == "r1"
    assert s.history == [UserMessage(text="first")]
    assert list(s.pending_runs) == ["r2"]


def test_notifications_wait_and_are_delivered_as_one_block_with_source_and_time() -> None:
    log = Log()
    log.start()
    log.add("system_item", id="n1", source="ci", text="build failed")
    log.add("system_item", id="n2", source="pod:child", text="[finished] done")
    s = state_of(log)
    assert s.pending_notifications == 2 and s.pending_steers == 0
    assert s.history == []
    ids, items = s.deliverable()
    assert ids == ["n1", "n2"]
    [note] = items
    assert isinstance(note, SystemNote)
    text = note.text
    assert text.startswith("<notifications> 2 notifications arrived")
    assert "- [2023-11-14T22:13:22Z] from ci: build failed" in text
    assert "- [2023-11-14T22:13:23Z] from pod:child: [finished] done" in text
    assert text.endswith("</notifications>")
    assert "more are queued" not in text

    log.add("run_start", run_id="w1", trigger="notifications")
    log.add("inputs_delivered", ids=ids, more=0)
    s = state_of(log)
    assert s.pending_inputs == {}
    assert s.history == [note]  # exactly what deliverable() promised, as ONE item
    assert s.deliverable() == ([], [])


def test_single_notification_is_named_in_the_singular() -> None:
    note = PendingInput("n", "notification", "hi", "user", T0)
    text = render_notifications([note], 0)
    assert "<notifications> notification arrived" in text
    assert "from user: hi" in text


def test_steer_input_is_delivered_as_a_user_message_before_the_notes() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="go", mode="queue")
    log.add("run_start", run_id="r1", trigger="input")
    log.add("system_item", id="n1", source="ci", text="red")
    log.add("user_input", id="s1", run_id="r1", text="also check y", mode="steer", client_key="ks")
    s = state_of(log)
    assert s.pending_steers == 1 and s.pending_notifications == 1
    assert s.pending_inputs["s1"].source == "user"
    assert s.run_keys["ks"] == (input_digest("also check y"), "r1", True)  # the run it joined
    ids, items = s.deliverable()
    assert ids == ["n1", "s1"]
    assert items[0] == UserMessage(text="also check y")
    assert isinstance(items[1], SystemNote) and "from ci: red" in items[1].text
    log.add("inputs_delivered", ids=ids, more=0)
    s = state_of(log)
    assert s.history == [UserMessage(text="go"), *items]
    assert s.pending_inputs == {}


def test_deliverable_is_bounded_and_the_rest_summarised_by_count() -> None:
    extra = 7
    log = Log()
    log.start()
    n = MAX_NOTIFICATIONS_PER_REQUEST + extra
    for i in range(n):
        log.add("system_item", id=f"n{i}", source="ci", text=f"event {i}")
    log.add("user_input", id="s", run_id="r", text="steer", mode="steer")
    s = state_of(log)
    ids, items = s.deliverable()
    # Steer input is never held back; notifications are capped.
    assert "s" in ids
    assert ids.count("s") == 1 and len(ids) == MAX_NOTIFICATIONS_PER_REQUEST + 1
    assert [i for i in ids if i != "s"] == [f"n{i}" for i in range(MAX_NOTIFICATIONS_PER_REQUEST)]
    note = items[-1]
    assert isinstance(note, SystemNote)
    assert note.text.count("\n- [") == MAX_NOTIFICATIONS_PER_REQUEST
    assert f"({extra} more are queued and follow in the next request)" in note.text
    assert f"from ci: event {MAX_NOTIFICATIONS_PER_REQUEST}\n" not in note.text

    # The pod delivers them with the count left; the fold renders the same block.
    log.add("inputs_delivered", ids=ids, more=s.pending_notifications - len(ids) + 1)
    s = state_of(log)
    assert s.history[-1] == note
    assert s.pending_notifications == extra
    ids2, items2 = s.deliverable()
    assert ids2 == [f"n{i}" for i in range(MAX_NOTIFICATIONS_PER_REQUEST, n)]
    assert "more are queued" not in items2[0].text  # type: ignore[union-attr]


def test_deliverable_is_bounded_by_bytes_in_order_and_always_takes_the_first() -> None:
    log = Log()
    log.start()
    log.add("system_item", id="huge", source="ci", text="h" * 500)  # over the bound, alone
    log.add("system_item", id="a", source="ci", text="é" * 30)  # 60 bytes
    log.add("system_item", id="b", source="ci", text="b" * 50)
    log.add("system_item", id="c", source="ci", text="c")  # would fit, but b is first
    log.add("user_input", id="s", run_id="r", text="steer " * 100, mode="steer")
    s = state_of(log)
    assert s.deliverable(100)[0] == ["huge"]  # a steer is held back too: its turn comes
    assert s.deliverable(1300)[0] == ["huge", "a", "b", "c", "s"]
    log.add("inputs_delivered", ids=["huge", "s"], more=3)
    s = state_of(log)
    ids, items = s.deliverable(100)
    assert ids == ["a"]
    assert "(2 more are queued and follow in the next request)" in items[0].text  # type: ignore[union-attr]
    assert s.deliverable(120)[0] == ["a", "b", "c"]  # 111 bytes
    assert s.deliverable()[0] == ["a", "b", "c"]
    log.add("system_item", id="d", source="s" * 200, text="d")  # its source counts
    assert state_of(log).deliverable(300)[0] == ["a", "b", "c"]


def test_deliverable_holds_back_steers_over_the_bytes_in_their_order() -> None:
    """Each steer is under max_input_bytes, but every one waiting went into one request: a
    burst of them overflowed the context as one huge input did."""
    log = Log()
    log.start()
    for i in range(3):
        log.add("user_input", id=f"s{i}", run_id="r", text=f"{i}" * 60, mode="steer")
    log.add("system_item", id="n", source="ci", text="n" * 10)
    s = state_of(log)
    assert s.deliverable(100)[0] == ["s0", "n"]  # s1 waits (120 bytes); n fits (72)
    assert s.deliverable(130)[0] == ["s0", "s1"]  # s2 would make 180, n 132
    assert s.deliverable(10)[0] == ["s0"]  # the first always
    assert s.deliverable()[0] == ["s0", "s1", "s2", "n"]
    log.add("inputs_delivered", ids=["s0"], more=1)
    assert state_of(log).deliverable(130)[0] == ["s1", "s2"]


def test_inputs_delivered_ignores_unknown_ids() -> None:
    log = Log()
    log.start()
    log.add("system_item", id="n1", source="ci", text="x")
    log.add("inputs_delivered", ids=["gone", "n1"], more=0)
    s = state_of(log)
    assert s.pending_inputs == {} and len(s.history) == 1


# --- model rounds -----------------------------------------------------------------------------


def test_assistant_and_tool_results_pair_and_track_open_calls() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r", text="go", mode="queue")
    log.add("run_start", run_id="r", trigger="input")
    a, b = call("a"), call("b", "grep")
    assistant(log, "r", "", (a, b))
    s = state_of(log)
    assert s.open_calls == [a, b] and s.rounds == 1
    result(log, "r", b, "B")
    assert state_of(log).open_calls == [a]
    result(log, "r", a, "A")
    log.add("turn_end", run_id="r", round=1)
    s = state_of(log)
    assert s.open_calls == []
    assert s.history[1:] == [
        AssistantMessage(tool_calls=(a, b)),
        ToolResult(call_id="b", name="grep", output="B"),
        ToolResult(call_id="a", name="read_file", output="A"),
    ]
    assistant(log, "r", "done")
    log.add("run_end", run_id="r", outcome="finished", text="done")
    s = state_of(log)
    assert s.rounds == 2 and s.active_run is None
    assert s.run_outcomes == {}  # kept only for a keyed run's retry (see the keys' tests)
    s.add_run_key("k", ("digest", "r", False))
    s.apply(log.entries[-1])
    assert s.run_outcomes["r"] == {
        "outcome": "finished",
        "text": "done",
        "error": None,
        "usage": None,
        "calls": 0,
    }


def test_llm_usage_totals_and_calls() -> None:
    log = Log()
    log.start()
    log.add("llm_usage", run_id="r", model="m1", input=10, output=5, cache_read=3, cache_write=1)
    log.add("llm_usage", run_id="r", model="m1", input=7, output=2, cache_read=0, cache_write=4)
    s = state_of(log)
    assert s.usage == Usage(input=17, output=7, cache_read=3, cache_write=5)
    assert s.usage.total == 24
    assert [c["seq"] for c in s.usage_calls] == [2, 3]
    assert s.usage_calls[0] == {
        "seq": 2,
        "ts": log.entries[1]["ts"],
        "model": "m1",
        "run_id": "r",
        "input": 10,
        "output": 5,
        "cache_read": 3,
        "cache_write": 1,
    }


def test_paused_run_resumes_with_its_rounds_kept() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="go", mode="queue")
    log.add("run_start", run_id="r1", trigger="input")
    assistant(log, "r1", "", (call("a"),))
    result(log, "r1", call("a"))
    assistant(log, "r1", "", (call("b"),))
    result(log, "r1", call("b"), "not run: paused")
    log.add("run_end", run_id="r1", outcome="paused", text="")
    s = state_of(log)
    assert s.paused_run == "r1" and s.active_run is None and s.rounds == 2
    log.add("run_start", run_id="r1", trigger="input")
    s = state_of(log)
    assert s.active_run == "r1" and s.paused_run is None
    assert s.rounds == 2  # resumed: a Turn built from it keeps counting
    assert s.history.count(UserMessage(text="go")) == 1  # the input is not re-added
    assistant(log, "r1", "done")
    log.add("run_end", run_id="r1", outcome="finished", text="done")
    s = state_of(log)
    assert s.rounds == 3 and s.paused_run is None


def test_a_different_run_after_a_pause_starts_counting_afresh() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="go", mode="queue")
    log.add("run_start", run_id="r1", trigger="input")
    assistant(log, "r1", "x")
    log.add("run_end", run_id="r1", outcome="paused", text="x")
    log.add("user_input", run_id="r2", text="other", mode="queue")
    log.add("run_start", run_id="r2", trigger="input")
    s = state_of(log)
    assert s.rounds == 0 and s.paused_run is None and s.active_run == "r2"


def test_cancelling_a_queued_run_leaves_the_active_run_alone() -> None:
    """A queued run cancelled (run_end without run_start) while another run is mid-tool must
    not drop that run's open calls: restore closes open calls from them."""
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="go", mode="queue")
    log.add("run_start", run_id="r1", trigger="input")
    log.add("user_input", run_id="r2", text="later", mode="queue")
    assistant(log, "r1", "", (call("a"),))
    log.add("run_end", run_id="r2", outcome="cancelled", text="")
    s = state_of(log)
    assert "r2" not in s.pending_runs
    assert s.active_run == "r1"
    assert s.open_calls == [call("a")]


def test_cancelling_a_queued_run_keeps_a_paused_run_paused() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="go", mode="queue")
    log.add("run_start", run_id="r1", trigger="input")
    assistant(log, "r1", "", (call("a"),))
    result(log, "r1", call("a"))
    log.add("run_end", run_id="r1", outcome="paused", text="")
    log.add("user_input", run_id="r2", text="later", mode="queue")
    log.add("run_end", run_id="r2", outcome="cancelled", text="")
    s = state_of(log)
    assert s.paused_run == "r1" and s.rounds == 1


def test_restore_closes_open_calls_of_the_interrupted_run() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r", text="go", mode="queue")
    log.add("run_start", run_id="r", trigger="input")
    assistant(log, "r", "", (call("a"), call("b")))
    result(log, "r", call("a"))
    s = state_of(log)  # the pod crashed here
    assert s.active_run == "r" and s.open_calls == [call("b")]
    for rec in interrupted_results(s.open_calls, "r"):
        log.add(rec.kind, **body_of(rec))
    log.add("run_end", run_id="r", outcome="error", text="", error="interrupted", interrupted=True)
    s = state_of(log)
    assert s.open_calls == [] and s.active_run is None
    check_history_pairing(s.history)


def test_client_keys_for_runs_steers_and_notifications() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="a", mode="queue", client_key="k1")
    log.add("user_input", id="s1", run_id="r1", text="b", mode="steer", client_key="k2")
    log.add("system_item", id="n1", source="ci", text="c", client_key="k3")
    log.add("system_item", id="n2", source="ci", text="e", client_key="k4", wakes=True)
    log.add("user_input", run_id="r2", text="d", mode="queue")
    s = state_of(log)
    # Keys are per method: a run key (queue or steer) never matches a notify key. A notify key
    # keeps whether it woke the pod: its retry answers the same.
    d = input_digest
    assert s.run_keys == {"k1": (d("a"), "r1", False), "k2": (d("b"), "r1", True)}
    assert s.notify_keys == {"k3": (d("c"), "n1", False), "k4": (d("e"), "n2", True)}


def test_a_fork_keeps_which_run_keys_were_steers() -> None:
    log = Log()
    log.start()
    log.add("user_input", run_id="r1", text="a", mode="queue", client_key="k1")
    log.add("user_input", id="s1", run_id="r1", text="b", mode="steer", client_key="k2")
    snap = state_of(log).snapshot()
    forked = Log()
    forked.start(run_key_digests=snap["run_key_digests"])
    d = input_digest
    assert state_of(forked).run_keys == {"k1": (d("a"), "r1", False), "k2": (d("b"), "r1", True)}
    before_digests = Log()  # a session started before 0.4 kept the inputs' texts
    before_digests.start(run_keys={"k1": ["a", "r1"], "k2": ["b", "r1", "steer"]})
    assert state_of(before_digests).run_keys == state_of(forked).run_keys


def test_session_start_carries_pending_work_and_a_paused_run() -> None:
    log = Log()
    log.start(
        [UserMessage(text="old")],
        pending_runs=[{"run_id": "q", "text": "queued", "client_key": "k"}],
        pending_inputs=[{"id": "n", "kind": "notification", "text": "t", "source": "ci", "ts": T0}],
        paused_run="p",
        rounds=4,
    )
    s = state_of(log)
    assert s.pending_runs["q"].text == "queued"
    assert s.pending_inputs["n"] == PendingInput("n", "notification", "t", "ci", T0)
    assert s.paused_run == "p" and s.rounds == 4


# --- the property -----------------------------------------------------------------------------


def check_history_pairing(history: list[Item]) -> None:
    open_ids: list[str] = []
    for item in history:
        if isinstance(item, AssistantMessage):
            assert not open_ids, f"unanswered calls {open_ids}"
            open_ids = [c.id for c in item.tool_calls]
        elif isinstance(item, ToolResult):
            assert item.call_id in open_ids
            open_ids.remove(item.call_id)
    assert not open_ids


@dataclass
class PodSim:
    """Writes entries the way pod.py does, deciding from the folded state like the pod does."""

    log: Log = field(default_factory=Log)
    state: SessionState = field(default_factory=SessionState)
    turn: Turn | None = None
    n: int = 0

    def commit(self, kind: str, **body: Any) -> None:
        entry = self.log.add(kind, **body)
        self.state.apply(entry)
        self.state.deliverable()  # pure: asking must not change anything

    def new_id(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def step(self, data: st.DataObject) -> None:
        s = self.state
        action = data.draw(
            st.sampled_from(
                ["queue", "notify", "steer", "work", "work", "work", "pause", "cancel", "drop"]
            )
        )
        if action == "queue":
            key = data.draw(st.sampled_from([None, self.new_id("k")]))
            body: dict[str, Any] = {"client_key": key} if key else {}
            self.commit("user_input", run_id=self.new_id("r"), text="do", mode="queue", **body)
        elif action == "notify":
            self.commit("system_item", id=self.new_id("n"), source="ci", text="ping")
        elif action == "steer" and s.active_run is not None:
            self.commit(
                "user_input", id=self.new_id("s"), run_id=s.active_run, text="steer", mode="steer"
            )
        elif action == "pause" and self.turn is not None:
            self.turn.request_pause()
        elif action == "cancel" and self.turn is not None:
            self.turn.request_cancel()
        elif action == "drop" and s.pending_runs:
            run_id = data.draw(st.sampled_from(sorted(s.pending_runs)))
            self.commit("run_end", run_id=run_id, outcome="cancelled", text="")
        elif action == "work":
            if self.turn is None:
                self.start(data)
            else:
                self.round(data)

    def start(self, data: st.DataObject) -> None:
        s = self.state
        if s.paused_run is not None and data.draw(st.booleans()):
            run_id = s.paused_run
        elif s.pending_runs:
            run_id = next(iter(s.pending_runs))
        elif s.pending_notifications:
            run_id = self.new_id("w")
        else:
            return
        self.commit("run_start", run_id=run_id, trigger="input")
        self.turn = Turn(run_id, max_turns=data.draw(st.integers(1, 4)), rounds=self.state.rounds)

    def round(self, data: st.DataObject) -> None:
        turn = self.turn
        assert turn is not None
        step = turn.next_step()
        if isinstance(step, CallModel):
            ids, _ = self.state.deliverable()
            if ids:
                left = self.state.pending_notifications - sum(
                    1 for i in ids if self.state.pending_inputs[i].kind == "notification"
                )
                self.commit("inputs_delivered", ids=ids, more=left)
            if data.draw(st.integers(0, 9)) == 0:  # interrupted, with or without text streamed
                recs = turn.model_failed(None, data.draw(st.sampled_from(["", "cut o"])))
            else:
                n = data.draw(st.integers(0, 3))
                calls = tuple(call(self.new_id("c")) for _ in range(n))
                stops: list[StopReason] = ["tool_use", "max_tokens"] if n else ["end_turn"]
                stop = data.draw(st.sampled_from(stops))
                usage = Usage(input=data.draw(st.integers(0, 9)), output=1)
                self.commit("llm_usage", run_id=turn.run_id, model="m", **usage_body(usage))
                response = ModelResponse(
                    message=AssistantMessage(text="t", tool_calls=calls), stop=stop, usage=usage
                )
                recs = turn.model_returned(response, more_input=self.state.pending_steers > 0)
            for rec in recs:
                self.commit(rec.kind, **body_of(rec))
            while turn.in_tools and (tool := turn.next_tool()) is not None:
                if data.draw(st.integers(0, 5)) == 0:
                    turn.request_pause()
                for rec in turn.tool_returned(tool.call.id, "out", False):
                    self.commit(rec.kind, **body_of(rec))
            if turn.done:
                step = turn.next_step()
        if isinstance(step, Finished):
            body: dict[str, Any] = {"outcome": step.outcome, "text": step.text}
            if step.error:
                body["error"] = step.error
            self.commit("run_end", run_id=turn.run_id, **body)
            self.turn = None


def usage_body(u: Usage) -> dict[str, int]:
    return {
        "input": u.input,
        "output": u.output,
        "cache_read": u.cache_read,
        "cache_write": u.cache_write,
    }


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_folding_generated_sessions(data: st.DataObject) -> None:
    sim = PodSim()
    sim.commit("session_start", session_id="S", pod="p", system_prompt="", config={}, history=[])
    for _ in range(data.draw(st.integers(0, 40))):
        sim.step(data)
    entries = sim.log.entries
    event(f"entries>={len(entries) // 20 * 20}")
    for kind in ("inputs_delivered", "tool_result", "run_end"):
        if any(e["kind"] == kind for e in entries):
            event(f"has {kind}")
    if any(e["kind"] == "run_end" and e["outcome"] == "paused" for e in entries):
        event("has a pause")

    # Restoring (folding the log) gives exactly the live state, built entry by entry.
    assert fold(entries) == sim.state

    # Any prefix folds without raising (a crash can stop the log anywhere), and continuing from
    # a prefix gives the same state as folding it all at once.
    whole = fold(entries)
    for k in range(len(entries) + 1):
        prefix = fold(entries[:k])
        assert prefix.last_seq == (entries[k - 1]["seq"] if k else 0)
        if prefix.active_run is None:
            assert prefix.open_calls == []
        ids, _ = prefix.deliverable()
        assert set(ids) <= set(prefix.pending_inputs)
        for e in entries[k:]:
            prefix.apply(e)
        assert prefix == whole

    # The history the model sees always pairs calls with results once no run is active.
    if whole.active_run is None:
        check_history_pairing(whole.history)
    # Usage totals are the sum of the recorded calls.
    assert whole.usage.input == sum(c["input"] for c in whole.usage_calls)


@pytest.mark.parametrize("offset", [0.0, 0.5])
def test_notification_time_is_rendered_in_utc(offset: float) -> None:
    ts = T0 + offset
    note = PendingInput("n", "notification", "x", "s", ts)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    assert stamp == "2023-11-14T22:13:20Z"
    assert f"[{stamp}]" in render_notifications([note], 0)


def test_a_long_lived_pod_keeps_a_bounded_past_and_each_new_session_starts_small() -> None:
    """The newest KEPT_CLIENT_KEYS keys per method (inputs as digests) and KEPT_USAGE_CALLS
    calls are kept, the totals count everything, and a forked or compacted session's first
    entry carries no more: its size does not grow with the pod's age."""
    extra = 50
    log = Log()
    log.start()
    big = "x" * 10_000
    for i in range(KEPT_CLIENT_KEYS + extra):
        log.add("user_input", run_id=f"r{i}", text=f"{big}{i}", mode="queue", client_key=f"k{i}")
        log.add("run_start", run_id=f"r{i}", trigger="input")
        log.add(
            "llm_usage", run_id=f"r{i}", model="m", input=1, output=1, cache_read=0, cache_write=0
        )
        log.add("run_end", run_id=f"r{i}", outcome="finished", text=f"done {i}")
        log.add("system_item", id=f"n{i}", source="ci", text=f"note {i}", client_key=f"nk{i}")
    s = state_of(log)
    newest = [f"k{i}" for i in range(extra, KEPT_CLIENT_KEYS + extra)]
    assert list(s.run_keys) == newest
    assert list(s.notify_keys) == [f"n{k}" for k in newest]
    assert s.run_keys[f"k{extra}"] == (input_digest(f"{big}{extra}"), f"r{extra}", False)
    assert s.run_outcomes.keys() == {f"r{i}" for i in range(extra, KEPT_CLIENT_KEYS + extra)}
    assert (
        len(s.usage_calls) == KEPT_USAGE_CALLS
        and s.usage_calls[-1]["run_id"] == f"r{KEPT_CLIENT_KEYS + extra - 1}"
    )
    assert s.call_count == s.usage.input == KEPT_CLIENT_KEYS + extra
    forked = Log()
    forked.start(**{k: v for k, v in s.snapshot().items() if k != "history"})
    assert len(forked.entries[0]["run_key_digests"]) == KEPT_CLIENT_KEYS
    assert len(msgspec.json.encode(forked.entries[0])) < 1_000_000  # not 10 MB of inputs
    again = state_of(forked)
    assert (again.run_keys, again.notify_keys) == (s.run_keys, s.notify_keys)
    assert (again.run_outcomes, again.usage_calls) == (s.run_outcomes, s.usage_calls)
    assert again.call_count == s.call_count


def test_a_spawner_keeps_the_newest_report_ids_and_a_new_session_carries_no_more() -> None:
    """A spawner remembers the child reports it accepted (a redelivery is accepted once):
    the newest KEPT_REPORT_IDS of them. Kept all, every compaction of a long-lived spawner
    rewrote its whole past of reports into the new session's first entry."""
    extra = 5
    log = Log()
    log.start()
    for i in range(KEPT_REPORT_IDS + extra):
        log.add("system_item", id=f"n{i}", source="pod:kid", text="[shutdown]", event_id=f"e{i}")
    s = state_of(log)
    assert list(s.report_ids) == [f"e{i}" for i in range(extra, KEPT_REPORT_IDS + extra)]
    forked = Log()
    forked.start(tree=s.tree_snapshot())
    again = state_of(forked)
    assert again.report_ids == s.report_ids
    assert "e0" not in again.report_ids and f"e{extra}" in again.report_ids


def test_a_run_keeps_its_outcome_while_any_key_naming_it_is_kept() -> None:
    """Two keys name one run (a keyed run and a keyed steer into it): forgetting the older key
    keeps the outcome the newer one's retry may wait for."""
    s = SessionState()
    s.add_run_key("queued", ("d1", "r", False))
    s.add_run_key("steered", ("d2", "r", True))
    s.run_outcomes["r"] = {"outcome": "finished"}
    for i in range(KEPT_CLIENT_KEYS - 1):
        s.add_run_key(f"other{i}", ("d", f"o{i}", False))
    assert "queued" not in s.run_keys and s.run_outcomes.keys() == {"r"}
    s.add_run_key("last", ("d", "o-last", False))
    assert "steered" not in s.run_keys and s.run_outcomes == {} and "r" not in s.keyed_runs
