"""The pod's tools, built once from the manifest at start-up: what the model is offered and what
runs when it calls. Builtin tools come from `worker.tools`; other sources (MCP servers) add
entries with `add` before the first request."""

from collections.abc import Iterable, Mapping

from poddaemon.llm.types import ToolSpec
from poddaemon.tools import BUILTIN, Tool


class Toolset:
    def __init__(self, tools: Mapping[str, Tool]) -> None:
        self.tools: dict[str, Tool] = dict(tools)
        self._specs: list[ToolSpec] | None = None

    @classmethod
    def from_names(cls, names: Iterable[str], available: Mapping[str, Tool] = BUILTIN) -> "Toolset":
        """The named builtin tools; an unknown name is a ValueError naming it."""
        missing = [n for n in names if n not in available]
        if missing:
            raise ValueError(f"not available in this version: {', '.join(missing)}")
        return cls({n: available[n] for n in names})

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
