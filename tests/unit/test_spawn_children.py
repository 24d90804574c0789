"""The spawner's view of its children (poddaemon/spawn.py `Children`) against a real pods.json:
what a change of the registry costs the pod's event loop."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from poddaemon.registry import Registry, make_entry
from poddaemon.scope import Scope
from poddaemon.spawn import Children, _Live


@pytest.fixture
def registry() -> Iterator[Registry]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="kids-"))
    yield Registry(path / "run")
    shutil.rmtree(path, ignore_errors=True)


def test_a_registry_change_reads_pods_json_once_however_many_children_live(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before every tool call of a spawner whose pods.json changed (any pod of the user
    starting, stopping or naming a session changes it) the registry is read on the loop; the
    children it already watches need no second read each."""
    names = [f"kid{i}" for i in range(4)]
    for name in names:  # live children (this process stands in for them) of pod "boss"
        scope = Scope.from_dicts([{"target": f"/tmp/kids/{name}", "permission": "write"}])
        registry.register(make_entry(name, f"/run/{name}/sock", scope, parent="boss"))
    pod: Any = SimpleNamespace(
        name="boss",
        state=SimpleNamespace(children=dict.fromkeys(names)),
        s=SimpleNamespace(registry=registry),
    )
    children = Children(pod)
    for name in names:
        children.live[name] = _Live(name, 0, f"/run/{name}/sock")
    reads = 0
    read = registry._read

    def counted() -> Any:
        nonlocal reads
        reads += 1
        return read()

    monkeypatch.setattr(registry, "_read", counted)
    children.registry_changed()
    assert reads == 1
