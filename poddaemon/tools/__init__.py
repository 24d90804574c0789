"""Builtin tools: small objects (name, JSON schema, run) over a scope-checked filesystem view.

`execute(name, arguments, ctx)` is the one entry point the pod uses; it never raises (except
CancelledError). `tool_specs(names)` gives the specs a model request advertises."""

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
from poddaemon.tools.bash import Bash
from poddaemon.tools.files import EditFile, ListDir, ReadFile, WriteFile
from poddaemon.tools.pods import ListPods, SendToPod, SpawnPod, StopPod, WaitPods
from poddaemon.tools.search import Glob, Grep

BUILTIN: dict[str, Tool] = {
    t.name: t
    for t in (
        ReadFile(),
        WriteFile(),
        EditFile(),
        ListDir(),
        Glob(),
        Grep(),
        Bash(),
        SpawnPod(),
        SendToPod(),
        WaitPods(),
        ListPods(),
        StopPod(),
    )
}
DEFAULT_TOOLS: tuple[str, ...] = (
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "glob",
    "grep",
)


def tool_specs(names: Iterable[str], tools: Mapping[str, Tool] = BUILTIN) -> list[ToolSpec]:
    """Specs for `names`, in that order. An unknown name is a ValueError naming it."""
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
    "cap_output",
    "decode_arguments",
    "execute",
    "tool_specs",
]
