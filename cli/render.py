"""Human-readable rendering for podctl: events, status, the pod table, history entries.

Pure functions over plain JSON data (dicts as the pod sends them), no I/O, so they are unit-tested
directly. Only the standard library is imported: podctl imports this inside its commands.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from typing import IO, Any, TypeVar

SUMMARY_WIDTH = 120
REASON_WIDTH = 400  # why a model call failed: its advice comes last ("does base_url point at …")
ARGS_WIDTH = 200
SCOPE_WIDTH = 40

# Log entry keys that every entry has; the rest is the entry's body.
ENTRY_KEYS = frozenset({"seq", "ts", "kind", "prev", "hash"})


# C0 and C1 control characters (ESC, BEL, CSI, ...) shown as \xNN: what a summary quotes
# (a file a tool read, a command's output, the model's text) must not reach the terminal as
# escape sequences that retitle it, clear it or write the clipboard (OSC 52).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}


_CONTROLS_BUT_LINES = {c: v for c, v in _CONTROLS.items() if c not in (0x09, 0x0A)}
# JSON escapes C0 characters but may carry DEL and the C1 ones (CSI is U+009B) as they are:
# \u00NN instead.
_C1_IN_JSON = {c: f"\\u{c:04x}" for c in (0x7F, *range(0x80, 0xA0))}


def printable(text: str) -> str:
    """Control characters shown as ``\\xNN``, newlines and tabs kept: for what a message quotes."""
    return text.translate(_CONTROLS_BUT_LINES)


def json_text(encoded: str) -> str:
    """JSON text (ensure_ascii off) with DEL and C1 control characters as ``\\u00NN`` escapes:
    the same JSON, and no escape sequence for a terminal it is printed to."""
    return encoded.translate(_C1_IN_JSON)


def one_line(text: str, width: int = SUMMARY_WIDTH) -> str:
    """Collapse whitespace (newlines included), show control characters as ``\\xNN`` and cut
    to `width` characters with an ellipsis."""
    flat = " ".join(text.split()).translate(_CONTROLS)
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def retry_line(data: Mapping[str, Any]) -> str:
    """An `llm.retry` event's data: `retry #2 in 1.5s: <why the call failed>`."""
    parts = ["retry"]
    if "attempt" in data:
        parts.append(f"#{data['attempt']}")
    delay = data.get("delay")
    # Not a number: what no pod sends, but a socket that is no pod's may (POD can be a path);
    # float("soon") ended `podctl attach` in a ValueError traceback.
    if isinstance(delay, int | float):
        parts.append(f"in {delay:.1f}s")
    line = " ".join(parts)
    if data.get("error"):
        line += f": {one_line(str(data['error']), REASON_WIDTH)}"
    return line


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


def _args_text(args: Any) -> str:
    """Tool arguments arrive as an object or as the model's raw JSON text; show both compactly."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return one_line(args, ARGS_WIDTH)
    return one_line(compact_json(args), ARGS_WIDTH)


def usage_text(data: Mapping[str, Any]) -> str:
    text = f"in={data.get('input', 0)} out={data.get('output', 0)}"
    for key in ("cache_read", "cache_write"):
        if data.get(key):
            text += f" {key}={data[key]}"
    return text


class EventRenderer:
    """Turns a pod's event stream into terminal text.

    Text (and reasoning) deltas are written inline as they stream; every other event is one line
    of its own, so the renderer remembers whether the output currently ends mid-line.
    """

    def __init__(self) -> None:
        self._stream: tuple[Any, str] | None = None  # (run_id, "text"|"reasoning") being streamed
        self._midline = False  # the output so far does not end with a newline

    def render(self, event: Mapping[str, Any]) -> str:
        """The text to write for one event (possibly empty, possibly without a newline)."""
        etype = str(event.get("type", ""))
        run_id = event.get("run_id")
        data: Mapping[str, Any] = event.get("data") or {}
        if etype in ("text.delta", "reasoning.delta"):
            kind = "text" if etype == "text.delta" else "reasoning"
            text = printable(str(data.get("text", "")))  # a model can be led to write escapes
            if not text:
                return ""
            out = ""
            if self._stream != (run_id, kind):
                out += self._break()
                if kind == "reasoning":
                    out += "(thinking) "
            self._stream = (run_id, kind)
            out += text
            self._midline = not out.endswith("\n")
            return out
        line = event_line(etype, run_id, data, event)
        if line is None:
            return ""
        return self._break() + line + "\n"

    def finish(self) -> str:
        """Text that ends a pending inline stream (a newline), for when output stops."""
        return self._break()

    def _break(self) -> str:
        self._stream = None
        if not self._midline:
            return ""
        self._midline = False
        return "\n"


def event_line(
    etype: str, run_id: Any, data: Mapping[str, Any], event: Mapping[str, Any]
) -> str | None:
    """One line (no newline) for a non-delta event; None to show nothing."""
    line = _event_line(etype, run_id, data, event)
    # Every field, not only the free text: a tool's name, a child's name, an alert's source and
    # level are chosen by the model (or another pod) as much as its text is.
    return None if line is None else line.translate(_CONTROLS)


def _event_line(
    etype: str, run_id: Any, data: Mapping[str, Any], event: Mapping[str, Any]
) -> str | None:
    run = f"[run {run_id}]" if run_id else "[run ?]"
    if etype == "run.queued":
        position = data.get("position")
        return f"{run} queued" + (f" (position {position})" if position is not None else "")
    if etype == "run.started":
        return f"{run} started"
    if etype == "run.finished":
        line = f"{run} finished: {data.get('outcome', '?')}"
        if data.get("error"):
            line += f" ({one_line(str(data['error']))})"
        return line
    if etype == "tool.started":
        return f"⚙ {data.get('name', '?')} {_args_text(data.get('args', {}))}"
    if etype == "tool.finished":
        mark = "✗" if data.get("is_error") else "✓"
        summary = one_line(str(data.get("summary") or ""))
        return f"{mark} {data.get('name', '?')}" + (f": {summary}" if summary else "")
    if etype == "llm.usage":
        return f"usage {usage_text(data)}"
    if etype == "llm.retry":
        return retry_line(data)
    if etype == "notification.committed":
        sender = one_line(str(data.get("source") or "?"))
        return f"✉ notification from {sender}: {one_line(str(data.get('message', '')))}"
    if etype == "state.changed":
        return f"state: {data.get('state', '?')}"
    if etype == "alert":
        level = data.get("level", "info")
        source = data.get("source")
        prefix = f"! {level}" + (f" [{source}]" if source else "")
        return f"{prefix}: {one_line(str(data.get('message', '')))}"
    if etype == "child.event":
        pod = data.get("pod", "?")
        kind = data.get("kind", "event")
        line = f"child {pod}: {kind}"
        if data.get("run_id"):
            line += f" [run {data['run_id']}]"
        if data.get("text"):
            line += f": {one_line(str(data['text']))}"
        return line
    if etype == "compaction.started":
        why = data.get("reason")
        tokens = data.get("input_tokens")
        return (
            "compaction started"
            + (f" ({why})" if why else "")
            + (f" at {tokens} input tokens" if tokens is not None else "")
        )
    if etype == "compaction.finished":
        sid = data.get("session_id")
        before, after = data.get("before_tokens"), data.get("after_tokens")
        line = "compaction finished" + (f": new session {sid}" if sid else "")
        if before is not None and after is not None:
            line += f" ({before} -> ~{after} tokens)"
        return line
    if etype == "compaction.failed":
        err = data.get("error") or data.get("message")
        return "compaction failed" + (f": {one_line(str(err))}" if err else "")
    if etype == "shutdown":
        reason = data.get("reason")
        return "pod shutting down" + (f" ({reason})" if reason and reason != "requested" else "")
    if etype == "gap":
        return f"… events missed since {data.get('since', event.get('seq', '?'))}"
    return f"{etype or 'event'} {one_line(compact_json(dict(data)))}".rstrip()


# --- terminal styling ---------------------------------------------------------------------------


def color_enabled(stream: IO[str]) -> bool:
    """Escape codes only for a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def bold(text: str, stream: IO[str]) -> str:
    return f"\033[1m{text}\033[0m" if color_enabled(stream) else text


# --- status and the pod table -------------------------------------------------------------------


def shorten_path(path: str, home: str | None = None) -> str:
    home = home if home is not None else os.path.expanduser("~")
    if home and home != "/" and (path == home or path.startswith(home.rstrip("/") + "/")):
        return "~" + path[len(home.rstrip("/")) :]
    return path


def write_targets(scope: Iterable[Mapping[str, Any]]) -> list[str]:
    return [
        str(rule.get("target", "?"))
        for rule in scope
        if rule.get("permission") == "write" and not rule.get("deny")
    ]


def scope_cell(scope: Iterable[Mapping[str, Any]], home: str | None = None) -> str:
    """The write targets (what the registry keeps apart); a pod that may only read shows its
    read targets, marked `ro:` ("-" read as no scope at all)."""
    rules = list(scope)
    targets = [shorten_path(t, home) for t in write_targets(rules)]
    if not targets:
        reads = (r for r in rules if r.get("permission") == "read" and not r.get("deny"))
        targets = [f"ro:{shorten_path(str(r.get('target', '?')), home)}" for r in reads]
    text = ",".join(targets) if targets else "-"
    return text if len(text) <= SCOPE_WIDTH else "…" + text[-(SCOPE_WIDTH - 1) :]


def tokens(status: Mapping[str, Any]) -> int:
    """The tokens the pod's calls cost, as its budget counts them (`budget.spent`): the
    providers count cached input apart (Anthropic) or within input (OpenAI), so input +
    output alone made one call 110 tokens on one pod and 1,610 on another (found by QA)."""
    budget = status.get("budget") or {}
    if isinstance(budget.get("spent"), int):
        return int(budget["spent"])
    usage = status.get("usage") or {}  # a pod of an older version
    return int(usage.get("input", 0)) + int(usage.get("output", 0))


def queue_cell(status: Mapping[str, Any]) -> str:
    queue = status.get("queue") or {}
    return f"{queue.get('runs', 0)}/{queue.get('notifications', 0)}"


TABLE_HEADER = ("NAME", "PID", "STATE", "MODEL", "SCOPE", "PARENT", "QUEUE", "TOKENS", "SANDBOX")
TREE_INDENT = "  "

if TYPE_CHECKING:
    _Status = TypeVar("_Status", bound=Mapping[str, Any])


def tree_order(statuses: Sequence[_Status]) -> list[tuple[int, _Status]]:
    """`(depth, status)` with every pod right after its parent, children by name. A pod whose
    parent is not listed (gone, or a cycle) is a root."""
    by_name = {str(st.get("name")): st for st in statuses}
    children: dict[str, list[_Status]] = {}
    roots: list[_Status] = []
    for st in sorted(statuses, key=lambda s: str(s.get("name"))):
        parent = st.get("parent")
        if parent is not None and str(parent) in by_name and parent != st.get("name"):
            children.setdefault(str(parent), []).append(st)
        else:
            roots.append(st)
    out: list[tuple[int, _Status]] = []
    seen: set[str] = set()

    def visit(st: _Status, depth: int) -> None:
        name = str(st.get("name"))
        if name in seen:
            return
        seen.add(name)
        out.append((depth, st))
        for child in children.get(name, []):
            visit(child, depth + 1)

    for st in roots:
        visit(st, 0)
    # Pods caught in a parent cycle were reached from no root: list them at the top level.
    for st in statuses:
        visit(st, 0)
    return out


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def pod_table(statuses: Sequence[Mapping[str, Any]], home: str | None = None) -> str:
    """The `podctl ls` table, header included, columns padded to their widest cell; children
    indented under their parent. An unresponsive pod shows what the registry knows of it."""
    rows: list[tuple[str, ...]] = [TABLE_HEADER]
    listed = {st.get("name") for st in statuses}  # live pods: a parent not among them is gone
    for depth, st in tree_order(statuses):
        parent = st.get("parent")
        # What only a status answer says (not one still starting its MCP servers and hooks):
        # its SANDBOX read "none" there, for a pod that would be confined.
        unresponsive = st.get("state") == "unresponsive" or "queue" not in st
        cells = (
            TREE_INDENT * depth + str(st.get("name", "?")),
            _cell(st.get("pid")),
            str(st.get("state", "?")),
            _cell(st.get("model")),
            scope_cell(st.get("scope") or [], home),
            _cell(parent) if parent is None or parent in listed else f"{parent} (gone)",
            "-" if unresponsive else queue_cell(st),
            "-" if unresponsive else str(tokens(st)),
            "-" if unresponsive else str(st.get("sandbox") or "none"),
        )
        # A pwd or scope target (a child's, named by the model), a model name: data, shown with
        # control characters as \xNN like everything else podctl prints of a pod.
        rows.append(tuple(cell.translate(_CONTROLS) for cell in cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADER))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines) + "\n"


def format_time(ts: float | None) -> str:
    """Local time to the second; "?" for a time no calendar holds (a log's ts is only data)."""
    if ts is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "?"


def status_text(st: Mapping[str, Any]) -> str:
    """`podctl status POD`: one `key: value` line per field (scope rules one per line)."""
    fields: list[tuple[str, str]] = [
        ("name", str(st.get("name", "?"))),
        ("pid", str(st.get("pid", "?"))),
        ("state", str(st.get("state", "?"))),
    ]
    if st.get("run_id"):
        fields.append(("run", str(st["run_id"])))
    fields += [
        ("session", str(st.get("session_id") or "-")),
        ("provider", str(st.get("provider", "?"))),
        ("model", str(st.get("model", "?"))),
        ("pwd", str(st.get("pwd", "?"))),
    ]
    rules = list(st.get("scope") or [])
    if not rules:
        fields.append(("scope", "-"))
    for i, rule in enumerate(rules):
        verb = "deny" if rule.get("deny") else "allow"
        text = f"{verb} {rule.get('permission', '?')} {rule.get('target', '?')}"
        if rule.get("recursive") is False:
            text += " (non-recursive)"
        fields.append(("scope" if i == 0 else "", text))
    queue = st.get("queue") or {}
    fields.append(
        ("queue", f"{queue.get('runs', 0)} runs, {queue.get('notifications', 0)} notifications")
    )
    usage = st.get("usage") or {}
    fields.append(("usage", f"{usage_text(usage)} calls={usage.get('calls', 0)}"))
    fields.append(("parent", str(st.get("parent") or "-")))
    budget = st.get("budget") or {}
    if budget:
        limit = budget.get("limit")
        fields.append(
            (
                "budget",
                f"limit={limit if limit is not None else '-'} spent={budget.get('spent', 0)} "
                f"tree_spent={budget.get('tree_spent', 0)}"
                + (f" left={budget['left']}" if budget.get("left") is not None else ""),
            )
        )
    children = st.get("children") or []
    names = [str(c.get("name")) if isinstance(c, dict) else str(c) for c in children]
    fields.append(("children", ", ".join(names) if names else "-"))
    fields.append(("sandbox", str(st.get("sandbox") or "none")))
    for note in st.get("sandbox_notes") or []:
        fields.append(("", f"note: {note}"))
    for i, server in enumerate(st.get("mcp") or []):
        text = f"{server.get('name')} {server.get('state')} ({server.get('tools', 0)} tools)"
        if server.get("restarts"):
            text += f", restarted {server['restarts']}x"
        if server.get("error"):
            text += f": {one_line(str(server['error']), 1000)}"
        fields.append(("mcp" if i == 0 else "", text))
    started = st.get("started_at")
    fields.append(("started", format_time(float(started)) if started is not None else "-"))
    fields.append(("version", str(st.get("version", "?"))))
    width = max(len(key) for key, _ in fields) + 1
    # One line per value, control characters as \xNN: a child's pwd and scope targets are
    # named by the model, and a newline or an escape sequence there is no status to print raw.
    return "".join(
        (f"{key}:" if key else "").ljust(width) + f" {value.translate(_CONTROLS)}\n"
        for key, value in fields
    )


# --- session log entries (history, sessions show) ----------------------------------------------


def entry_summary(entry: Mapping[str, Any]) -> str:
    """A one-line summary of a session log entry's body, by kind."""
    kind = entry.get("kind")
    item: Mapping[str, Any] = entry.get("item") or {}
    if kind == "session_start":
        parts = [f"pod={entry.get('pod', '?')}"]
        for link in ("forked_from", "compacted_from"):
            if entry.get(link):
                parts.append(f"{link}={entry[link]}")
        return " ".join(parts)
    if kind == "user_input":
        mode = entry.get("mode")
        tag = f"[run {entry.get('run_id', '?')}]" + (
            f" ({mode})" if mode and mode != "queue" else ""
        )
        return one_line(f"{tag} {entry.get('text', '')}")
    if kind in ("run_start", "turn_end"):
        return f"[run {entry.get('run_id', '?')}]"
    if kind == "run_end":
        line = f"[run {entry.get('run_id', '?')}] {entry.get('outcome', '?')}"
        if entry.get("error"):
            line += f": {entry['error']}"
        if entry.get("interrupted"):
            line += " (interrupted)"
        return one_line(line)
    if kind == "system_item":
        return one_line(f"{entry.get('source', '?')}: {entry.get('text', '')}")
    if kind == "inputs_delivered":
        return one_line(", ".join(map(str, entry.get("ids") or [])))
    if kind == "assistant":
        parts = []
        if item.get("text"):
            parts.append(str(item["text"]))
        for call in item.get("tool_calls") or []:
            parts.append(f"⚙ {call.get('name', '?')} {_args_text(call.get('arguments', ''))}")
        return one_line(" ".join(parts)) if parts else "(empty)"
    if kind in ("tool_result", "tool_output"):
        mark = "✗" if item.get("is_error") else "✓"
        return one_line(f"{mark} {item.get('name', '?')}: {item.get('output', '')}")
    if kind == "llm_usage":
        model = entry.get("model")
        return usage_text(entry) + (f" model={model}" if model else "")
    body = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
    return one_line(compact_json(body)) if body else ""


def entry_line(entry: Mapping[str, Any]) -> str:
    """`seq kind summary`, control characters as \\xNN in every field: a log's pod name, model
    name or kind is as much data as the text it quotes."""
    try:
        summary = entry_summary(entry)
    except (AttributeError, TypeError):
        # A sound entry of a shape this version does not know (a later version's log, one
        # made by hand: its hashes verify all the same): its body as it is, not a traceback
        # that ends `sessions show` or `history` at it.
        body = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
        summary = one_line(compact_json(body))
    line = f"{entry.get('seq', '?')} {entry.get('kind', '?')} {summary}".rstrip()
    return line.translate(_CONTROLS)
