"""Interceptors: policy around each model request and each tool call.

The executor runs the chain in order before every model request (`before_request` may replace
the request or refuse it), before every tool call (`before_tool` may deny it with a reason the
model sees), after every tool call (`after_tool` may replace the outcome) and when a run ends.
Budget is the first user; compaction and hooks plug in here the same way.
"""

from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from poddaemon.history import ToolCall
from poddaemon.llm.types import ModelRequest
from poddaemon.tools.base import ToolOutcome


class Refuse(msgspec.Struct, frozen=True):
    """Do not make this model call; the run ends `outcome` with `reason`."""

    reason: str
    outcome: Literal["limit_reached", "cancelled"] = "limit_reached"


class Deny(msgspec.Struct, frozen=True):
    """Do not run this tool; the model gets `reason` as the call's error result."""

    reason: str


class Interceptor:
    """Base class: every hook passes through unchanged. Override what you need."""

    async def before_request(self, run_id: str, request: ModelRequest) -> ModelRequest | Refuse:
        return request

    async def before_tool(self, run_id: str, call: ToolCall) -> Deny | None:
        return None

    async def after_tool(self, run_id: str, call: ToolCall, outcome: ToolOutcome) -> ToolOutcome:
        return outcome

    async def on_run_end(self, run_id: str, outcome: str) -> None:
        return None

    async def before_compact(self, reason: str) -> None:
        """The `PreCompact` point: a compaction is about to start; `reason` is "auto" (the
        threshold) or "manual" (`compact`), as Claude Code's trigger."""
        return None


class Chain:
    def __init__(self, interceptors: Sequence[Interceptor] = ()) -> None:
        self.interceptors = list(interceptors)

    async def before_request(self, run_id: str, request: ModelRequest) -> ModelRequest | Refuse:
        for i in self.interceptors:
            verdict = await i.before_request(run_id, request)
            if isinstance(verdict, Refuse):
                return verdict
            request = verdict
        return request

    async def before_tool(self, run_id: str, call: ToolCall) -> Deny | None:
        for i in self.interceptors:
            verdict = await i.before_tool(run_id, call)
            if verdict is not None:
                return verdict
        return None

    async def after_tool(self, run_id: str, call: ToolCall, outcome: ToolOutcome) -> ToolOutcome:
        for i in self.interceptors:
            outcome = await i.after_tool(run_id, call, outcome)
        return outcome

    async def on_run_end(self, run_id: str, outcome: str) -> None:
        for i in self.interceptors:
            await i.on_run_end(run_id, outcome)

    async def before_compact(self, reason: str) -> None:
        for i in self.interceptors:
            await i.before_compact(reason)


class Budget(Interceptor):
    """`[budget] max_total_tokens`: no model call once the pod has spent its cap."""

    def __init__(self, exhausted: Callable[[], str | None]) -> None:
        self.exhausted = exhausted  # the reason the budget is spent, or None

    async def before_request(self, run_id: str, request: ModelRequest) -> ModelRequest | Refuse:
        reason = self.exhausted()
        return Refuse(reason) if reason else request
