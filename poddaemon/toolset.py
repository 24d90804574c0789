"""The pod's tools, built once from the manifest: what the model is offered and what runs when
it calls. Builtin tools come from `worker.tools`; other sources (MCP servers) add entries with
`add` before the first request. The builtin tools' modules load when the tools are first used
(the pod's warm-up right after READY, or its first request), not at start-up."""

from collections.abc import Iterable, Mapping

from poddaemon.llm.types import ToolSpec
from poddaemon.tools import BUILTIN_NAMES, Tool, builtin


class Toolset:
    def __init__(self, tools: Mapping[str, Tool], builtin_names: Iterable[str] = ()) -> None:
        # Made on first use (once each: a name listed twice is one tool, as in a dict).
        self._builtin = [n for n in dict.fromkeys(builtin_names) if n not in tools]
        self._tools: dict[str, Tool] = dict(tools)
        self._specs: list[ToolSpec] | None = None

    @classmethod
    def from_names(cls, names: Iterable[str]) -> "Toolset":
        """The named builtin tools; an unknown name is a ValueError naming it."""
        names = list(names)
        missing = [n for n in names if n not in BUILTIN_NAMES]
        if missing:
            raise ValueError(f"not available in this version: {', '.join(missing)}")
        return cls({}, names)

    @property
    def tools(self) -> dict[str, Tool]:
        """Every tool by name, builtin ones first, in the manifest's order."""
        if self._builtin:
            self._tools = {**{n: builtin(n) for n in self._builtin}, **self._tools}
            self._builtin = []
        return self._tools

    def __len__(self) -> int:
        return len(self._builtin) + len(self._tools)

    def add(self, tool: Tool) -> None:
        self.tools[tool.name] = tool
        self._specs = None

    @property
    def specs(self) -> list[ToolSpec]:
        """What every model request advertises (built once: it goes into every request)."""
        if self._specs is None:
            self._specs = [
                ToolSpec(name=t.name, description=t.description, parameters=t.parameters)
                for t in self.tools.values()
            ]
        return self._specs
