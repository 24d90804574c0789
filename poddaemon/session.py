"""The pod's state as a pure fold over its session log.

The pod commits an entry, then applies it here; restoring a session applies the same entries in
the same order. So the live state and the restored state are one code path and cannot drift.

Inputs are committed when acknowledged but enter the model's context later: a queued `run` at its
`run_start`, steer input and notifications at an `inputs_delivered`. Until then they are pending,
which is exactly what must be processed after a crash.
"""

import gc
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from poddaemon.history import (
    AssistantMessage,
    Item,
    SystemNote,
    ToolCall,
    ToolResult,
    Usage,
    UserMessage,
    item_from_builtins,
    item_to_builtins,
)

# How many notifications one model request shows in full; the rest follow in later rounds.
MAX_NOTIFICATIONS_PER_REQUEST = 100


@dataclass(frozen=True)
class PendingRun:
    run_id: str
    text: str
    client_key: str | None = None


@dataclass(frozen=True)
class PendingInput:
    """Steer input or a notification, acknowledged but not yet seen by the model."""

    id: str
    kind: Literal["steer", "notification"]
    text: str
    source: str = ""
    ts: float = 0.0


@dataclass
class SessionState:
    session_id: str = ""
    history: list[Item] = field(default_factory=list)
    pending_runs: dict[str, PendingRun] = field(default_factory=dict)
    pending_inputs: dict[str, PendingInput] = field(default_factory=dict)
    client_keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (input, id)
    usage_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    active_run: str | None = None
    rounds: int = 0  # model rounds of the active (or paused) run
    paused_run: str | None = None
    open_calls: list[ToolCall] = field(default_factory=list)
    run_outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_seq: int = 0
    head: str = ""
    # Kept as counters: `notify` checks max_pending on every request, so this must be O(1).
    pending_notifications: int = 0
    pending_steers: int = 0

    def add_pending(self, p: PendingInput) -> None:
        if p.id in self.pending_inputs:
            return
        self.pending_inputs[p.id] = p
        if p.kind == "notification":
            self.pending_notifications += 1
        else:
            self.pending_steers += 1

    def take_pending(self, pid: str) -> PendingInput | None:
        p = self.pending_inputs.pop(pid, None)
        if p is not None:
            if p.kind == "notification":
                self.pending_notifications -= 1
            else:
                self.pending_steers -= 1
        return p

    def snapshot(self) -> dict[str, Any]:
        """Everything `session_start` needs to continue from this state (a fork)."""
        return {
            "history": [item_to_builtins(i) for i in self.history],
            "pending_runs": [vars(r) for r in self.pending_runs.values()],
            "pending_inputs": [vars(p) for p in self.pending_inputs.values()],
            "client_keys": {k: list(v) for k, v in self.client_keys.items()},
            "usage": msgspec.to_builtins(self.usage),
            "usage_calls": self.usage_calls,
            "active_run": self.active_run,
            "rounds": self.rounds,
            "paused_run": self.paused_run,
            "open_calls": [msgspec.to_builtins(c) for c in self.open_calls],
            # Outcomes a keyed retry with wait=True may still ask for.
            "run_outcomes": {
                rid: self.run_outcomes[rid]
                for _, rid in self.client_keys.values()
                if rid in self.run_outcomes
            },
        }

    def apply(self, entry: Mapping[str, Any]) -> None:
        kind = entry["kind"]
        handler = _APPLY.get(kind)
        if handler is not None:
            handler(self, entry)
        self.last_seq = entry["seq"]
        self.head = entry.get("hash", self.head)

    def deliverable(self) -> tuple[list[str], list[Item]]:
        """Ids and rendered items of what the next model request should carry (pure)."""
        ids: list[str] = []
        notes: list[PendingInput] = []
        items: list[Item] = []
        for p in self.pending_inputs.values():
            if p.kind == "steer":
                ids.append(p.id)
                items.append(UserMessage(text=p.text))
            elif len(notes) < MAX_NOTIFICATIONS_PER_REQUEST:
                ids.append(p.id)
                notes.append(p)
        if notes:
            left = self.pending_notifications - len(notes)
            items.append(SystemNote(text=render_notifications(notes, left)))
        return ids, items


def render_notifications(notes: list[PendingInput], more: int) -> str:
    """One clearly marked block for a batch of notifications, each with its source and time."""
    head = "notification" if len(notes) == 1 else f"{len(notes)} notifications"
    lines = [f"<notifications> {head} arrived while you worked:"]
    for n in notes:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(n.ts))
        lines.append(f"- [{stamp}] from {n.source}: {n.text}")
    if more:
        lines.append(f"({more} more are queued and will follow in the next request)")
    lines.append("</notifications>")
    return "\n".join(lines)


# --- one function per entry kind ---------------------------------------------------------------


def _session_start(s: SessionState, e: Mapping[str, Any]) -> None:
    s.session_id = e.get("session_id", s.session_id)
    s.history = [item_from_builtins(i) for i in e.get("history", [])]
    for r in e.get("pending_runs", []):
        s.pending_runs[r["run_id"]] = PendingRun(r["run_id"], r["text"], r.get("client_key"))
    for p in e.get("pending_inputs", []):
        s.add_pending(
            PendingInput(p["id"], p["kind"], p["text"], p.get("source", ""), p.get("ts", 0.0))
        )
    s.client_keys = {k: (v[0], v[1]) for k, v in e.get("client_keys", {}).items()}
    if e.get("usage"):
        s.usage = Usage(**e["usage"])
    s.usage_calls = list(e.get("usage_calls", []))
    s.active_run = e.get("active_run")
    s.paused_run = e.get("paused_run")
    s.rounds = e.get("rounds", 0)
    s.open_calls = [msgspec.convert(c, ToolCall) for c in e.get("open_calls", [])]
    s.run_outcomes = dict(e.get("run_outcomes", {}))


def _user_input(s: SessionState, e: Mapping[str, Any]) -> None:
    key = e.get("client_key")
    if e.get("mode") == "steer":
        s.add_pending(PendingInput(e["id"], "steer", e["text"], "user", e["ts"]))
        if key:
            s.client_keys[key] = (e["text"], e["id"])
    else:
        s.pending_runs[e["run_id"]] = PendingRun(e["run_id"], e["text"], key)
        if key:
            s.client_keys[key] = (e["text"], e["run_id"])


def _system_item(s: SessionState, e: Mapping[str, Any]) -> None:
    s.add_pending(PendingInput(e["id"], "notification", e["text"], e.get("source", ""), e["ts"]))
    key = e.get("client_key")
    if key:
        s.client_keys[key] = (e["text"], e["id"])


def _run_start(s: SessionState, e: Mapping[str, Any]) -> None:
    run_id = e["run_id"]
    if run_id == s.paused_run:
        s.paused_run = None  # resumed: keeps its round count
    else:
        s.paused_run = None
        s.rounds = 0
    s.active_run = run_id
    run = s.pending_runs.pop(run_id, None)
    if run is not None:
        s.history.append(UserMessage(text=run.text))


def _inputs_delivered(s: SessionState, e: Mapping[str, Any]) -> None:
    ids = e["ids"]
    delivered = [p for p in map(s.take_pending, ids) if p is not None]
    notes = [p for p in delivered if p.kind == "notification"]
    for p in delivered:
        if p.kind == "steer":
            s.history.append(UserMessage(text=p.text))
    if notes:
        s.history.append(SystemNote(text=render_notifications(notes, e.get("more", 0))))


def _assistant(s: SessionState, e: Mapping[str, Any]) -> None:
    item = item_from_builtins(e["item"])
    assert isinstance(item, AssistantMessage)
    s.history.append(item)
    s.open_calls = list(item.tool_calls)
    s.rounds += 1


def _tool_result(s: SessionState, e: Mapping[str, Any]) -> None:
    item = item_from_builtins(e["item"])
    assert isinstance(item, ToolResult)
    s.history.append(item)
    s.open_calls = [c for c in s.open_calls if c.id != item.call_id]


def _llm_usage(s: SessionState, e: Mapping[str, Any]) -> None:
    u = Usage(
        input=e.get("input", 0),
        output=e.get("output", 0),
        cache_read=e.get("cache_read", 0),
        cache_write=e.get("cache_write", 0),
    )
    s.usage.add(u)
    s.usage_calls.append(
        {
            "seq": e["seq"],
            "ts": e["ts"],
            "model": e.get("model", ""),
            "run_id": e.get("run_id"),
            "input": u.input,
            "output": u.output,
            "cache_read": u.cache_read,
            "cache_write": u.cache_write,
        }
    )


def _run_end(s: SessionState, e: Mapping[str, Any]) -> None:
    run_id = e["run_id"]
    s.pending_runs.pop(run_id, None)  # a queued run cancelled before it started
    if s.active_run == run_id:
        s.active_run = None
        s.open_calls = []
    # A queued run cancelled before it started touches neither the active nor the paused run.
    if e["outcome"] == "paused":
        s.paused_run = run_id
    elif s.paused_run == run_id:
        s.paused_run = None
    s.run_outcomes[run_id] = {
        "outcome": e["outcome"],
        "text": e.get("text", ""),
        "error": e.get("error"),
    }


_APPLY = {
    "session_start": _session_start,
    "user_input": _user_input,
    "system_item": _system_item,
    "run_start": _run_start,
    "inputs_delivered": _inputs_delivered,
    "assistant": _assistant,
    "tool_result": _tool_result,
    "llm_usage": _llm_usage,
    "run_end": _run_end,
}


def fold(entries: Iterable[Mapping[str, Any]]) -> SessionState:
    state = SessionState()
    # The fold allocates many small long-lived objects; the cyclic GC would rescan them all
    # again and again (a 100k-entry restore took ~40% longer with it on).
    enabled = gc.isenabled()
    gc.disable()
    try:
        for entry in entries:
            state.apply(entry)
    finally:
        if enabled:
            gc.enable()
    return state
