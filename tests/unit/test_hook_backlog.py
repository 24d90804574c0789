"""Hooks that decide nothing (Notification, SubagentStop) run a few at a time; the rest wait
their turn, a bounded number of them. Unbounded, a flood of notifications to a pod whose
Notification hook takes a second queued a task per notification: gigabytes within minutes."""

import asyncio
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from poddaemon.handlers import MAX_BACKGROUND_HOOKS, MAX_WAITING_HOOKS, handlers
from poddaemon.llm.types import ModelRequest, StreamEvent
from protocol.types import NotifyParams
from tests.unit.test_restore import ModelStandIn, runnable_pod


class Thinking(ModelStandIn):
    """A model call that never ends (the notifications wake the pod)."""

    async def stream(self, req: ModelRequest) -> AsyncIterator[StreamEvent]:
        await asyncio.get_running_loop().create_future()
        yield  # an async generator


class SlowHooks:
    """Notification hooks that run until `done` is set."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.ran = 0

    def wants(self, event: str) -> bool:
        return event == "Notification"

    async def run(self, event: str, fields: dict[str, Any]) -> list[Any]:
        await self.done.wait()
        self.ran += 1
        return []


def hook_tasks(pod: Any) -> int:
    return sum(t.get_coro().__name__ == "_background_hook" for t in pod._background)


async def test_hooks_falling_behind_are_skipped_with_one_alert_until_they_catch_up() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        pod = runnable_pod(tmp, Thinking())
        pod.hooks = hooks = SlowHooks()
        # (A model that keeps up takes them from the queue while their hooks fall behind.)
        pod.machine.cfg = msgspec.structs.replace(pod.machine.cfg, max_pending=10**6)
        alerts: list[tuple[str, str]] = []
        pod.alert = lambda level, message, source="": alerts.append((source, message))
        notify = handlers(pod)["notify"]
        bound = MAX_BACKGROUND_HOOKS + MAX_WAITING_HOOKS

        async def burst(n: int) -> None:
            await asyncio.gather(*(notify(NotifyParams(message=f"n{i}"), None) for i in range(n)))

        await burst(bound + 5)  # every one acknowledged, five of their hooks skipped
        assert hook_tasks(pod) == bound
        assert alerts == [
            (
                "hooks",
                f"Notification hooks fall behind ({MAX_WAITING_HOOKS} waiting): further ones "
                "are skipped until they catch up",
            )
        ]

        hooks.done.set()  # they catch up: every one waiting runs, and new ones run again
        await asyncio.gather(*list(pod._background))
        assert hooks.ran == bound and hook_tasks(pod) == 0
        await burst(3)
        await asyncio.gather(*list(pod._background))
        assert hooks.ran == bound + 3 and len(alerts) == 1
        if pod._inflight is not None:  # the model call the notifications woke
            pod._inflight.cancel()
            await asyncio.wait([pod._inflight])
        await pod.plog.close()
