"""15. Compaction: request size over a 200-round run with and without it, its own token cost,
and the restore time of a compacted chain of 10 sessions vs one session of the same length.

The pod is simulated in-process with the real parts: the real `Machine` decides (trigger,
selection, session switch), a small executor writes real session logs with `SessionLog`, and
each model request is rendered by the real OpenAI Chat adapter, so the bytes measured are the
bytes the pod would send (HTTP framing aside). The model answers like the fake model: every
round a `read_file` call whose result is TOOL_BYTES long, input tokens = request bytes / 4.
Restores run in fresh processes (`bench.restore_child`), as a pod started with `--resume` does.
"""

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import Row, Section, value_le
from bench.store_bench import child
from poddaemon.compaction import SUMMARY_PROMPT
from poddaemon.entries import body_of
from poddaemon.history import AssistantMessage, ToolCall, Usage
from poddaemon.llm.openai_chat import render_request
from poddaemon.llm.types import ModelRequest, ModelResponse
from poddaemon.machine import (
    CallModel,
    Commit,
    Effect,
    Machine,
    MachineConfig,
    OpenSession,
    RunTool,
    Summarize,
    SwitchSession,
)
from poddaemon.store.file import SessionLog, list_sessions, newest_session_for
from poddaemon.store.log import new_session_id
from poddaemon.toolset import Toolset

ROUNDS = 200
TOOL_BYTES = 2048
THRESHOLD = 24_000  # tokens
RESTORE_ROUNDS = 600  # a longer run for the restore part: more than 10 sessions
RETAINED = 2
SUMMARY_BYTES = 3000  # a realistic structured summary
SYSTEM = "You are a careful engineer working through a long task. " * 10
TOOLS = Toolset.from_names(["read_file", "write_file", "edit_file", "list_dir", "glob", "grep"])
OUTPUT = ("def handler(request):\n    return respond(request.body)  # line\n" * 64)[:TOOL_BYTES]


class Sim:
    """The machine, with an executor that writes real logs and answers like the fake model."""

    def __init__(self, sessions: Path, threshold: int | None, rounds: int = ROUNDS) -> None:
        self.max_rounds = rounds
        cfg = MachineConfig(
            name="bench",
            model="fake-model",
            max_turns=rounds + 10,
            compact_threshold=threshold,
            compact_retained_turns=RETAINED,
            provider_kind="openai",
        )
        self.m = Machine(cfg, clock=time.time, new_id=new_session_id, system_prompt=SYSTEM)
        self.sessions = sessions
        self.log: SessionLog | None = None
        self.next: Effect | None = None
        self.request_bytes: list[int] = []  # the run's own model requests
        self.summary_tokens: list[tuple[int, int]] = []  # (input, output) per compaction
        self.rounds = 0

    def feed(self, effects: list[Effect]) -> None:
        for e in effects:
            match e:
                case OpenSession(start):
                    self.log = SessionLog.create(self.sessions, start.session_id, body_of(start))
                case Commit(entry):
                    assert self.log is not None
                    self.log.append(entry.kind, body_of(entry), ts=entry.ts)
                case SwitchSession(start):
                    assert self.log is not None
                    old = self.log
                    self.log = SessionLog.create_complete(
                        self.sessions, start.session_id, body_of(start), ts=start.ts
                    )
                    old.close()
                case CallModel() | RunTool() | Summarize():
                    self.next = e

    def size(self, system: str, items: list[Any]) -> int:
        req = ModelRequest(system=system, items=items, tools=TOOLS.specs, max_tokens=4096)
        return len(json.dumps(render_request(req, "fake-model")).encode())

    def go(self) -> None:
        self.feed(self.m.run(1, "Refactor every handler of the service, one file per round."))
        while self.next is not None:
            e, self.next = self.next, None
            if isinstance(e, CallModel):
                n = self.size(e.system, e.items)
                self.request_bytes.append(n)
                self.rounds += 1
                calls: tuple[ToolCall, ...] = ()
                if self.rounds < self.max_rounds:
                    args = f'{{"path": "src/handler_{self.rounds}.py"}}'
                    calls = (ToolCall(id=f"call_{self.rounds}", name="read_file", arguments=args),)
                response = ModelResponse(
                    message=AssistantMessage(text=f"Round {self.rounds}.", tool_calls=calls),
                    stop="tool_use" if calls else "end_turn",
                    usage=Usage(input=n // 4, output=20),
                )
                self.feed(self.m.model_returned(response))
            elif isinstance(e, RunTool):
                self.feed(self.m.tool_returned(e.call.id, OUTPUT, False))
            elif isinstance(e, Summarize):
                assert e.items[-1].text == SUMMARY_PROMPT  # type: ignore[union-attr]
                n_in = self.size(e.system, e.items) // 4
                summary = ("- src/handler_N.py: refactored, tests pass\n" * 80)[:SUMMARY_BYTES]
                n_out = len(summary) // 4
                self.summary_tokens.append((n_in, n_out))
                self.feed(self.m.compaction_returned(summary, Usage(input=n_in, output=n_out)))
        assert self.log is not None
        self.log.close()


def run(sec: Section) -> None:
    with tempfile.TemporaryDirectory(prefix="pdbc", dir="/tmp") as tmp:
        plain_dir, chain_dir = Path(tmp) / "plain", Path(tmp) / "chain"
        plain = Sim(plain_dir, None)
        plain.go()
        compacted = Sim(chain_dir, THRESHOLD)
        compacted.go()
        a, b = plain.request_bytes, compacted.request_bytes
        assert len(a) == len(b) == ROUNDS
        for r in (1, 50, 100, 150, 200):
            label = f"request {r} of {ROUNDS}, bytes"
            sec.add(Row(label, b[r - 1], "B", a[r - 1], "no compaction"))
        sec.add(Row("largest request", max(b), "B", max(a), "no compaction"))
        sec.add(
            Row(
                f"all {ROUNDS} requests together",
                sum(b) / 1e6,
                "MB",
                sum(a) / 1e6,
                "no compaction",
                value_le(0.5 * sum(a) / 1e6, "MB"),
            )
        )
        n = len(compacted.summary_tokens)
        cost_in = sum(i for i, _ in compacted.summary_tokens)
        cost_out = sum(o for _, o in compacted.summary_tokens)
        run_tokens = sum(x // 4 + 20 for x in b)
        sec.add(
            Row(
                f"compactions' own tokens ({n} summaries)",
                cost_in + cost_out,
                "tok",
                sum(x // 4 + 20 for x in a),
                "the uncompacted run's tokens",
            )
        )
        sec.add(Row("  summary input", cost_in, "tok"))
        sec.add(Row("  summary output", cost_out, "tok"))
        sec.add(
            Row(
                "run + compactions, tokens",
                run_tokens + cost_in + cost_out,
                "tok",
                sum(x // 4 + 20 for x in a),
                "no compaction",
            )
        )
        table = " ".join(f"{r}:{b[r - 1] // 1000}k/{a[r - 1] // 1000}k" for r in range(10, 201, 10))
        sec.note(f"bytes per request, compacted/plain, every 10th round: {table}")

        # Restore: a chain of 10 sessions vs one session of the same total length.
        chain_dir = Path(tmp) / "chain10"
        Sim(chain_dir, THRESHOLD, rounds=RESTORE_ROUNDS).go()
        chain = _chain_of(chain_dir, 10)
        total_entries = sum(_entries(chain_dir, s) for s in chain)
        one_dir = Path(tmp) / "one"
        one = _one_session(one_dir, total_entries)
        chain_times = [_resume(chain_dir) for _ in range(5)]
        one_times = [child("restore", one_dir, one)["seconds"] for _ in range(5)]
        sec.add(
            Row(
                f"--resume of a chain of {len(chain)} sessions (newest only)",
                statistics.median(chain_times) * 1e3,
                "ms",
                statistics.median(one_times) * 1e3,
                f"one session of {total_entries} entries",
                value_le(statistics.median(one_times) * 1e3, "ms"),
            )
        )
        verify_all = [child("restore", chain_dir, s)["seconds"] for s in chain]
        sec.add(Row("  verify+fold every session of the chain", sum(verify_all) * 1e3, "ms"))
    sec.note(
        f"{ROUNDS} rounds, {TOOL_BYTES} B tool results, compact_threshold = {THRESHOLD}, "
        f"compact_retained_turns = {RETAINED}, {SUMMARY_BYTES} B summaries; tokens = bytes/4 "
        f"as the fake model counts; restore = newest_session_for + SessionLog.open + fold in a "
        "fresh process (median of 5)"
    )


def _entries(sessions: Path, sid: str) -> int:
    return sum(1 for _ in open(sessions / f"{sid}.jsonl", "rb"))


def _chain_of(sessions: Path, want: int) -> list[str]:
    """Keep the newest `want` sessions of the chain (oldest first); drop the rest from disk."""
    infos = {i.id: i for i in list_sessions(sessions)}
    newest = newest_session_for(sessions, "bench")
    assert newest is not None
    ids = [newest]
    while (link := infos[ids[-1]].compacted_from) and len(ids) < want:
        ids.append(link)
    for sid in set(infos) - set(ids):
        (sessions / f"{sid}.jsonl").unlink()
    return ids[::-1]


def _resume(sessions: Path) -> float:
    """What `--resume` does: find the newest session of the pod, then restore it."""
    t = time.perf_counter()
    newest = newest_session_for(sessions, "bench")
    found = time.perf_counter() - t
    assert newest is not None
    return found + float(child("restore", sessions, newest)["seconds"])


def _one_session(sessions: Path, entries: int) -> str:
    """One uncompacted session of `entries` entries, from the same simulated run shape."""
    sim = Sim(sessions, None, rounds=10**6)
    sim.feed(sim.m.run(1, "Refactor every handler of the service, one file per round."))
    assert sim.log is not None
    while sim.log.seq < entries and sim.next is not None:
        e, sim.next = sim.next, None
        if isinstance(e, CallModel):
            sim.rounds += 1
            args = f'{{"path": "src/handler_{sim.rounds}.py"}}'
            call = ToolCall(id=f"call_{sim.rounds}", name="read_file", arguments=args)
            response = ModelResponse(
                message=AssistantMessage(text=f"Round {sim.rounds}.", tool_calls=(call,)),
                stop="tool_use",
                usage=Usage(input=1000, output=20),
            )
            sim.feed(sim.m.model_returned(response))
        elif isinstance(e, RunTool):
            sim.feed(sim.m.tool_returned(e.call.id, OUTPUT, False))
    sid = sim.log.session_id
    sim.log.close()
    return sid
