"""What every builtin tool shares: the context it runs in, its outcome, argument checking,
output capping and `execute`, the one entry point that turns any failure into a tool error."""

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import msgspec

from poddaemon.scope import Access, ScopeDenied


class ScopeLike(Protocol):
    """The part of `poddaemon.scope.Scope` the tools use."""

    def check(self, path: str, want: Access, cwd: str) -> str: ...

    def access(self, path: str) -> Access: ...


class FileStamp(NamedTuple):
    """What a file looked like when the model last read (or wrote) it."""

    mtime_ns: int
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileStamp":
        return cls(st.st_mtime_ns, st.st_size)


@dataclass
class ToolOutputLimits:
    default_max_bytes: int = 16384
    per_tool: dict[str, int] = field(default_factory=dict)

    def max_bytes(self, tool: str) -> int:
        return self.per_tool.get(tool, self.default_max_bytes)


@dataclass
class ToolContext:
    scope: ScopeLike
    pwd: str
    limits: ToolOutputLimits = field(default_factory=ToolOutputLimits)
    # resolved absolute path -> stamp at the model's last read or write of it
    reads: dict[str, FileStamp] = field(default_factory=dict)

    def check(self, path: str, want: Access) -> str:
        """The resolved absolute path, or ScopeDenied. Call before touching the filesystem."""
        return self.scope.check(path, want, self.pwd)

    def display(self, resolved: str) -> str:
        """A path as the model should see it: relative to pwd when inside it."""
        rel = os.path.relpath(resolved, self.pwd)
        if rel == os.curdir:
            return "."
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            return resolved
        return rel


class ToolOutcome(msgspec.Struct, kw_only=True):
    output: str
    is_error: bool = False
    summary: str = ""


class ToolError(Exception):
    """A failure the model should see as the tool's result (its text is the whole message)."""


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome: ...


def schema(
    required: dict[str, tuple[str, str]], optional: dict[str, tuple[str, str]] | None = None
) -> dict[str, Any]:
    """A terse JSON schema for an object: name -> (JSON type, short description)."""
    props = {
        name: {"type": typ, "description": desc}
        for name, (typ, desc) in (required | (optional or {})).items()
    }
    return {"type": "object", "properties": props, "required": list(required)}


def cap_output(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8 (never inside a character), plus a marker."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    head = data[:max_bytes].decode("utf-8", "ignore")
    return f"{head}\n[output truncated: {len(data)} bytes, showing the first {max_bytes}]"


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_args(params: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Args checked against a flat object schema; absent or null optional fields are dropped.
    Raises ToolError naming the offending field."""
    props: dict[str, Any] = params.get("properties", {})
    required: list[str] = params.get("required", [])
    out: dict[str, Any] = {}
    for name in required:
        if args.get(name) is None:
            raise ToolError(f"missing required argument: {name}")
    for name, value in args.items():
        prop = props.get(name)
        if prop is None:
            raise ToolError(f"unknown argument: {name} (expected: {', '.join(props)})")
        if value is None:
            continue
        typ = prop.get("type", "string")
        if typ == "integer" and isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, _JSON_TYPES[typ]) and (
            typ == "boolean" or not isinstance(value, bool)
        )
        if not ok:
            raise ToolError(f"argument {name} must be a {typ}, got {_json_type(value)}")
        out[name] = value
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    for name, types in _JSON_TYPES.items():
        if name != "number" and isinstance(value, types):
            return name
    return "number" if isinstance(value, float) else type(value).__name__


def _os_error_text(e: OSError) -> str:
    text = e.strerror or str(e)
    if e.filename is not None:
        text += f": {os.fsdecode(e.filename)}"
    if e.filename2 is not None:
        text += f" -> {os.fsdecode(e.filename2)}"
    return text


def _error(text: str) -> ToolOutcome:
    first = text.splitlines()[0] if text else "error"
    if len(first) > 100:
        first = first[:99] + "…"
    return ToolOutcome(output=text, is_error=True, summary=first)


async def execute(
    name: str,
    arguments: str,
    ctx: ToolContext,
    tools: Mapping[str, Tool] | None = None,
) -> ToolOutcome:
    """Run one tool call. Never raises except CancelledError: every failure becomes an
    `is_error` outcome the model sees. `tools` defaults to the builtin tools."""
    if tools is None:
        from poddaemon.tools import BUILTIN

        tools = BUILTIN
    tool = tools.get(name)
    if tool is None:
        return _error(f"unknown tool: {name} (available: {', '.join(sorted(tools))})")
    try:
        raw = msgspec.json.decode(arguments) if arguments.strip() else {}
    except msgspec.DecodeError as e:
        return _error(f"arguments are not valid JSON: {e}")
    if not isinstance(raw, dict):
        return _error(f"arguments must be a JSON object, got {_json_type(raw)}")
    try:
        # MCP tools' schemas go beyond check_args' flat types; their servers validate.
        own = getattr(tool, "validates_own_args", False)
        args = raw if own else check_args(tool.parameters, raw)
        outcome = await tool.run(ctx, args)
    except ScopeDenied as e:
        outcome = _error(str(e))
    except ToolError as e:
        outcome = _error(str(e))
    except OSError as e:
        outcome = _error(_os_error_text(e))
    except Exception as e:
        outcome = _error(f"internal error in {name}: {type(e).__name__}: {e}")
    if not getattr(tool, "caps_own_output", False):
        outcome.output = cap_output(outcome.output, ctx.limits.max_bytes(name))
    return outcome
