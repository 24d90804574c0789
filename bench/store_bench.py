"""7. Session store: append cost at 1k and 100k entries, restore of a 100k-entry session."""

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.harness import PY, ROOT, Row, Section, base_env, fsync_us, median, ratio_le, value_le
from poddaemon.history import AssistantMessage, ToolCall, ToolResult, item_to_builtins
from poddaemon.store.file import SessionLog
from poddaemon.store.log import new_session_id

SMALL = 1_000
LARGE = 100_000
TIMED_CYCLES = 200  # 1,800 timed appends per log
BATCHES = 20
PER_CYCLE = 10  # entries per cycle() below
TOOL_OUTPUT = ("def handler(request):\n    return respond(request.body)\n" * 20)[:1024]


def cycle(n: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """One run as the pod logs it (entries.py's typed entries): input, start, a tool round, a
    text round, usage, the end."""
    rid = f"0192f0c1-7d3a-7c4e-9a1b-{n:012x}"
    call = ToolCall(id=f"call_{n}_0", name="read_file", arguments='{"path": "src/handler.py"}')
    yield (
        "user_input",
        {"run_id": rid, "text": f"Review src/handler.py, change {n}.", "mode": "queue"},
    )
    yield "run_start", {"run_id": rid, "trigger": "input"}
    yield (
        "assistant",
        {"run_id": rid, "item": item_to_builtins(AssistantMessage(tool_calls=(call,)))},
    )
    result = ToolResult(call_id=call.id, name=call.name, output=TOOL_OUTPUT)
    yield "tool_result", {"run_id": rid, "item": item_to_builtins(result)}
    usage = {"input": 1800 + n % 500, "output": 40, "cache_read": 1024, "cache_write": 0}
    yield "llm_usage", {"run_id": rid, "model": "gpt-4o-mini", **usage}
    text = "The handler echoes the body back unchanged; it should validate it first. " * 3
    yield "turn_end", {"run_id": rid, "round": 1}
    yield "assistant", {"run_id": rid, "item": item_to_builtins(AssistantMessage(text=text))}
    yield "llm_usage", {"run_id": rid, "model": "gpt-4o-mini", **usage}
    yield "turn_end", {"run_id": rid, "round": 2}
    yield "run_end", {"run_id": rid, "outcome": "finished", "text": text}


def entries() -> Iterator[tuple[str, dict[str, Any]]]:
    n = 0
    while True:
        yield from cycle(n)
        n += 1


def timed_appends(
    logs: list[SessionLog], source: Iterator[tuple[str, dict[str, Any]]]
) -> list[float]:
    """µs per entry for each log: the median over BATCHES batches of whole cycles, the logs
    taking turns batch by batch so that noise (other processes, writeback) hits them alike.
    Bodies are built beforehand, not timed; the files are fsync'd first, so no earlier
    writeback is still queued."""
    for log in logs:
        os.fsync(log.fileno())
    per_batch: list[list[float]] = [[] for _ in logs]
    for _ in range(BATCHES):
        for log, out in zip(logs, per_batch, strict=True):
            batch = [next(source) for _ in range(PER_CYCLE * TIMED_CYCLES // BATCHES)]
            append = log.append
            t = time.perf_counter()
            for kind, body in batch:
                append(kind, body)
            out.append((time.perf_counter() - t) / len(batch) * 1e6)
    return [median(x) for x in per_batch]


def fill(log: SessionLog, source: Iterator[tuple[str, dict[str, Any]]], upto: int) -> None:
    while log.seq < upto:
        kind, body = next(source)
        log.append(kind, body)


def child(mode: str, sessions: Path, sid: str) -> dict[str, Any]:
    out = subprocess.run(
        [PY, "-m", "bench.restore_child", mode, str(sessions), sid],
        cwd=ROOT,
        env=base_env(sessions),
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"restore_child {mode} failed: {out.stderr.strip()[-1500:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def run(sec: Section) -> None:
    with tempfile.TemporaryDirectory(prefix="pdbs", dir="/tmp") as tmp:
        sessions = Path(tmp) / "sessions"
        sid = new_session_id()
        start = {
            "session_id": sid,
            "pod": "bench",
            "system_prompt": "You are a reviewer. " * 100,
            "config": {"pod": {"name": "bench"}, "provider": {"kind": "openai"}},
            "history": [],
        }
        fs = median(fsync_us(200, tmp))  # before the big writes: no writeback queued yet
        source = entries()
        path = sessions / f"{sid}.jsonl"
        small_id = new_session_id()
        with (
            SessionLog.create(sessions, sid, start) as log,
            SessionLog.create(sessions, small_id, {**start, "session_id": small_id}) as small,
        ):
            fill(small, source, SMALL)
            t = time.perf_counter()
            fill(log, source, LARGE)
            fill_s = time.perf_counter() - t
            size = path.stat().st_size
            at_small, at_large = timed_appends([small, log], source)
        os.truncate(path, size)  # whole lines: exactly LARGE entries, a valid chain
        size_mb = size / 1e6
        restore = child("restore", sessions, sid)
        floor = child("decode", sessions, sid)
    sec.add(Row(f"append at {SMALL:,} entries", at_small, "µs/entry", fs, "one fsync"))
    sec.add(
        Row(
            f"append at {LARGE:,} entries",
            at_large,
            "µs/entry",
            at_small,
            f"append at {SMALL:,}",
            ratio_le(1.25),
        )
    )
    sec.add(
        Row(
            f"restore {LARGE:,} entries: open+verify+fold",
            restore["seconds"],
            "s",
            floor["seconds"],
            "read + msgspec decode",
            value_le(2, "s"),
        )
    )
    sec.add(
        Row(
            "restore peak RSS (VmHWM)",
            restore["maxrss_mb"],
            "MB",
            floor["maxrss_mb"],
            "read + decode, same file",
        )
    )
    sec.add(Row("fsync of a small file, median", fs, "µs"))
    sec.note(
        f"entries cycle user_input/run_start/assistant(tool call)/tool_result(1 KB)/"
        f"llm_usage/assistant(text)/llm_usage/turn_end/run_end; file {size_mb:.1f} MB; "
        f"append = SessionLog.append (no fsync), {PER_CYCLE * TIMED_CYCLES} timed appends per "
        f"log (median of {BATCHES} batches, the two logs taking turns, after an "
        f"fsync); filling to {LARGE:,} took {fill_s:.1f} s; restore in a fresh process"
    )
