"""A model call's request leaves (on the model thread) while the pod fsyncs the input it
answers: the two overlap. Nothing the model answers is published, committed or replied before
that input is durable, and an fsync that fails drops the answer. Real pod, real log, the real
`ThreadedModel`; only `os.fsync` of the session file is held until the request has started."""

import asyncio
import errno
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from poddaemon.history import AssistantMessage, Usage
from poddaemon.llm.threaded import ThreadedModel
from poddaemon.llm.types import ModelRequest, ModelResponse, StreamEvent, TextDelta
from poddaemon.store.log import verify
from protocol.errors import RpcError
from tests.unit.test_restore import ModelStandIn, runnable_pod


class Answering(ModelStandIn):
    """The SDK's place: says when its request has started, then answers "hi"."""

    def __init__(self) -> None:
        self.started = threading.Event()

    async def stream(self, req: ModelRequest) -> AsyncIterator[StreamEvent]:
        self.started.set()
        yield TextDelta("hi")
        yield ModelResponse(message=AssistantMessage(text="hi"), stop="end", usage=Usage())


@pytest.fixture
def pod() -> Iterator[Any]:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        pod = runnable_pod(tmp, ThreadedModel(Answering()))
        yield pod


def hold_fsync(monkeypatch: pytest.MonkeyPatch, pod: Any, fail: bool) -> list[bool]:
    """The session file's fsync waits (up to 10 s) for the model's request to start; returns
    whether each such fsync found it started. `fail`: the fsync then fails (EIO)."""
    model: Answering = pod.s.model.inner
    seen: list[bool] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        log = pod.plog.log
        if log is not None and fd == log.fileno() and not seen:
            seen.append(model.started.wait(10))
            if fail:
                raise OSError(errno.EIO, "injected")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def watch(pod: Any) -> list[tuple[str, bool]]:
    """Each event the pod publishes, with whether every input was durable by then."""
    published: list[tuple[str, bool]] = []
    publish = pod.bus.publish

    def recording(type: str, data: dict[str, Any], run_id: str | None = None) -> Any:
        published.append((type, pod.plog.inputs_durable()))
        return publish(type, data, run_id)

    pod.bus.publish = recording
    return published


async def test_the_request_overlaps_the_inputs_fsync_and_its_answer_waits_for_it(
    pod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = hold_fsync(monkeypatch, pod, fail=False)
    published = watch(pod)
    reply = await pod.request(lambda t: pod.machine.run(t, "hello", wait=True))
    assert seen == [True]  # the request had started while the input's fsync ran
    assert (reply.outcome, reply.text) == ("finished", "hi")
    assert [durable for kind, durable in published if kind == "text.delta"] == [True]
    await pod.s.model.aclose()
    await pod.plog.close()


async def test_an_answer_to_an_input_whose_fsync_failed_is_never_used(
    pod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = hold_fsync(monkeypatch, pod, fail=True)
    published = watch(pod)
    with pytest.raises(RpcError, match="could not persist"):
        await pod.request(lambda t: pod.machine.run(t, "hello", wait=True))
    assert seen == [True]
    assert not [kind for kind, _ in published if kind == "text.delta"]
    entries = verify(Path(pod.plog.path).read_bytes()).entries
    assert not [e for e in entries if e.get("kind") == "assistant"]
    await asyncio.wait_for(pod._stopped.wait(), 10)  # a pod whose log failed stops
    await pod.s.model.aclose()
    await pod.plog.close()


class Hanging:
    """A stream that starts, then waits forever; says when it is closed."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.closed = threading.Event()

    async def stream(self, req: ModelRequest) -> AsyncIterator[StreamEvent]:
        self.started.set()
        try:
            await asyncio.get_running_loop().create_future()
            yield TextDelta("never")
        finally:
            self.closed.set()


async def test_a_stream_closed_before_it_was_read_releases_its_request() -> None:
    """A model call cancelled while the input is fsync'd: its request is under way, unread."""
    inner = Hanging()
    model = ThreadedModel(inner)  # type: ignore[arg-type]
    events = model.stream(ModelRequest(system="", items=[], tools=[], max_tokens=10))
    assert await asyncio.to_thread(inner.started.wait, 10)
    await events.aclose()
    assert await asyncio.to_thread(inner.closed.wait, 10)
    with pytest.raises(StopAsyncIteration):  # and it stays ended
        await events.__anext__()
    await model.aclose()
