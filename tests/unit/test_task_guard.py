"""A bug in a model call's or tool's own error handling still ends the run (it stayed
"running" for good, the pod deaf to everything but `cancel`). Real pod, real log."""

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from poddaemon.llm.types import ModelRequest, ProviderError, StreamEvent
from tests.unit.test_restore import ModelStandIn, runnable_pod


class Failing(ModelStandIn):
    """A provider that fails every call."""

    async def stream(self, req: ModelRequest) -> AsyncIterator[StreamEvent]:
        raise ProviderError("fatal", "the provider failed")
        yield  # an async generator


@pytest.fixture
def pod() -> Iterator[Any]:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        pod = runnable_pod(tmp, Failing())
        yield pod


async def test_a_bug_while_a_provider_error_is_handled_still_ends_the_run(
    pod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_alert(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("broken alert")

    monkeypatch.setattr(pod, "alert", broken_alert)
    ask = pod.request(lambda t: pod.machine.run(t, "hello", wait=True))
    reply = await asyncio.wait_for(ask, 10)
    assert reply.outcome == "error"
    assert "RuntimeError: broken alert" in (reply.error or "")
    assert pod.machine.pod_state == "idle" and pod._inflight is None
    # and the pod goes on: the next run is taken (and fails the same way, answered)
    ask = pod.request(lambda t: pod.machine.run(t, "again", wait=True))
    again = await asyncio.wait_for(ask, 10)
    assert again.outcome == "error"
    await pod.plog.close()
