"""Builtin tools: small objects (name, JSON schema, run) over a scope-checked filesystem view.

`execute(name, arguments, ctx)` is the one entry point the pod uses; it never raises (except
CancelledError). `tool_specs(names)` gives the specs a model request advertises."""

import importlib
from collections.abc import Iterable, Mapping

from poddaemon.llm.types import ToolSpec
from poddaemon.scope import Access, ScopeDenied
from poddaemon.tools.base import (
    FileStamp,
    ScopeLike,
    Tool,
    ToolContext,
    ToolError,
    ToolOutcome,
    ToolOutputLimits,
    args_preview,
    cap_output,
    decode_arguments,
    execute,
)

# Where each builtin tool lives. The modules load when a pod first builds its tools (right
# after READY, see Pod.warm_up), not with this package: ~2.5 ms of every pod's start-up.
_WHERE: dict[str, tuple[str, str]] = {
    "read_file": ("files", "ReadFile"),
    "write_file": ("files", "WriteFile"),
    "edit_file": ("files", "EditFile"),
    "list_dir": ("files", "ListDir"),
    "glob": ("search", "Glob"),
    "grep": ("search", "Grep"),
    "bash": ("bash", "Bash"),
    "spawn_pod": ("pods", "SpawnPod"),
    "send_to_pod": ("pods", "SendToPod"),
    "wait_pods": ("pods", "WaitPods"),
    "list_pods": ("pods", "ListPods"),
    "stop_pod": ("pods", "StopPod"),
}
BUILTIN_NAMES: tuple[str, ...] = tuple(_WHERE)
_made: dict[str, Tool] = {}


def builtin(name: str) -> Tool:
    """The builtin tool `name` (one instance per process); KeyError for an unknown name."""
    tool = _made.get(name)
    if tool is None:
        module, cls = _WHERE[name]
        tool = _made[name] = getattr(importlib.import_module(f"poddaemon.tools.{module}"), cls)()
    return tool


def __getattr__(name: str) -> object:
    """`BUILTIN`: every builtin tool by name, made on first use (see _WHERE)."""
    if name == "BUILTIN":
        return {n: builtin(n) for n in _WHERE}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DEFAULT_TOOLS: tuple[str, ...] = (
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "glob",
    "grep",
)


def tool_specs(names: Iterable[str], tools: Mapping[str, Tool] | None = None) -> list[ToolSpec]:
    """Specs for `names`, in that order, of `tools` (default: the builtin tools). An unknown
    name is a ValueError naming it."""
    names = list(names)
    if tools is None:
        tools = {n: builtin(n) for n in names if n in _WHERE}
    specs = []
    for name in names:
        tool = tools.get(name)
        if tool is None:
            raise ValueError(f"unknown tool: {name}")
        specs.append(
            ToolSpec(name=tool.name, description=tool.description, parameters=tool.parameters)
        )
    return specs


__all__ = [
    "BUILTIN",
    "BUILTIN_NAMES",
    "DEFAULT_TOOLS",
    "Access",
    "FileStamp",
    "ScopeDenied",
    "ScopeLike",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolOutcome",
    "ToolOutputLimits",
    "args_preview",
    "builtin",
    "cap_output",
    "decode_arguments",
    "execute",
    "tool_specs",
]
