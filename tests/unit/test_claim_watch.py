"""The claim watcher (poddaemon.daemon.watch_claim) against a real pods.json."""

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from poddaemon import daemon
from poddaemon.daemon import Claim, watch_claim
from poddaemon.registry import PodEntry, Registry, make_entry
from poddaemon.scope import Scope


@pytest.fixture
def runtime() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="claim-"))
    yield path / "run"
    shutil.rmtree(path, ignore_errors=True)


def test_an_entry_put_back_by_another_writer_while_we_take_it_back_is_still_ours(
    runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pods.json replaced by an older copy while another pod's transaction was under way: that
    transaction, which had read the file before, wrote our entry back just as we registered
    again. Our registration was refused ("a pod named 'px' is already running", our own pid),
    and the watcher took the refusal for a lost claim: the pod stopped with status 1 though
    pods.json named it, as it should."""
    monkeypatch.setattr(daemon, "CLAIM_CHECK_INTERVAL", 0.01)
    registry = Registry(runtime)
    scope = Scope.from_config([("/w/px", "write", True)], cwd="/")
    ours = registry.register(make_entry("px", str(runtime / "pods/px/sock"), scope))
    claim = Claim(registry, ours, runtime / "pods" / "px")
    snapshot = registry.path.read_bytes()
    registry.path.write_bytes(b'{"version": 1, "pods": {}}')  # the older copy: no entry of ours
    register = registry.register

    def put_back_first(entry: PodEntry, *args: Any, **kwargs: Any) -> PodEntry:
        registry.path.write_bytes(snapshot)  # the other writer's late write: ours again
        return register(entry, *args, **kwargs)

    monkeypatch.setattr(registry, "register", put_back_first)
    lost: list[str] = []
    changed: list[bool] = []

    async def watch() -> None:
        task = asyncio.create_task(
            watch_claim(
                claim, lambda why, *_: lost.append(why), lambda: changed.append(True), lambda: None
            )
        )
        try:
            async with asyncio.timeout(10):
                while not (lost or changed):  # the watcher's next pass decides
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()

    asyncio.run(watch())
    assert lost == [] and changed
    assert msgspec.json.decode(registry.path.read_bytes())["pods"]["px"]["pid"] == ours.pid
