"""Spawn trees under races (SPEC §4, §9): spawners that go while their children start up."""

import os
import signal
import threading
from pathlib import Path

import pytest

from poddaemon.readyline import EXIT_REFUSED
from poddaemon.registry import Registry
from protocol import PodClient
from tests.conftest import Env, PodProcess, StartFailed, wait_until
from tests.integration.test_spawn import (
    _stray,
    quiet_children,
    run_and_wait,
    spawn_call,
    start_parent,
    tool,
    tool_results,
    tree,
)

__all__ = ["tree"]  # the fixture, imported for the tests here


def _feed_fifo(fifo: Path, text: str = "\n") -> threading.Thread:
    """Write `text` to `fifo` once a reader opens it (in a thread: opening waits for one)."""

    def feed() -> None:
        with open(fifo, "w") as f:
            f.write(text)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


def _parent_of_a_child_held_starting(env: Env) -> tuple[PodProcess, Path]:
    """A spawner whose spawn_pod started child s1, held before it looks for its spawner: the
    child reads a defaults.toml that is a pipe (fed once here for the spawner's own read; feed
    it again to let the child go on). The pod and the pipe."""
    (env.work / "s1").mkdir()
    quiet_children(env, "s1")
    config = env.home / "config"
    config.mkdir(mode=0o700)
    fifo = config / "defaults.toml"
    os.mkfifo(fifo, 0o600)
    fed = _feed_fifo(fifo)  # the spawner's own read of it
    env.model.script({"tool_calls": [spawn_call("s1", "work", [str(env.work / "s1")])]})
    parent = start_parent(env)
    fed.join(10)
    with parent.client() as c:
        c.run("go")
    wait_until(lambda: len(_stray(env)) == 2, 20, "the child process")
    return parent, fifo


def test_a_child_whose_spawner_died_before_the_child_looked_for_it_stops(tree: Env) -> None:
    """on_parent_exit = "stop": a spawner kill -9ed before its child, still starting, looked
    for it in the registry (here: the child reads a defaults.toml that is a pipe, and is let
    go on only after its spawner died). The child took its spawner for one gone before a
    `podctl restart` of the child, waited for it to come back, and ran on for good, holding
    its delegated area, with nobody to report to, nobody to stop it with its spawner."""
    env = tree
    parent, fifo = _parent_of_a_child_held_starting(env)
    assert Registry(env.home / "run").get("s1") is None
    parent.kill9()
    fed = _feed_fifo(fifo)  # the child goes on, its spawner dead
    fed.join(20)
    wait_until(lambda: not _stray(env), 20, "the child to stop with its dead spawner")
    assert Registry(env.home / "run").live() == []


def test_a_spawner_stopped_while_its_child_starts_leaves_no_child(tree: Env) -> None:
    """`podctl stop` of a spawner whose spawn_pod waits for a child still starting (held on
    a defaults.toml that is a pipe): the spawner stops (exit 0), and the child with it."""
    env = tree
    parent, _ = _parent_of_a_child_held_starting(env)
    stop = env.podctl_popen("stop", "parent")
    _, err = stop.communicate(timeout=60)
    assert stop.returncode == 0, err
    assert parent.proc.wait(20) == 0
    wait_until(lambda: not _stray(env), 20, "the child to be gone")
    assert Registry(env.home / "run").live() == []


def test_a_spawner_keeps_out_of_a_live_childs_area_whatever_an_old_registry_says(
    tree: Env,
) -> None:
    """pods.json replaced by an older copy (from before the children were spawned: no
    child entries, no delegation), and a child ending before its sibling registered again:
    the spawner took its scope from that registry (granted minus delegated), got write access
    back to the live sibling's area, and kept it after the sibling was back, so both wrote
    there. The areas of the children it watches stay out of its scope, whatever pods.json says.
    """
    env = tree
    for n in ("a", "b"):
        (env.work / n).mkdir()
    quiet_children(env, "c1", "c2")
    env.model.script(
        {
            "tool_calls": [
                spawn_call("c1", "t", [str(env.work / "a")]),
                spawn_call("c2", "t", [str(env.work / "b")]),
            ]
        },
        {"text": "spawned"},
        {"tool_calls": [tool("write_file", path=str(env.work / "a" / "x"), content="parent")]},
        {"text": "done"},
    )
    parent = start_parent(env)
    path = env.home / "run" / "pods.json"
    old = path.read_bytes()  # the parent alone
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    registry = Registry(env.home / "run")
    c1, c2 = registry.get("c1"), registry.get("c2")
    assert c1 is not None and c2 is not None
    os.kill(c1.pid, signal.SIGSTOP)  # c1 registers again only once the parent saw c2 go
    try:
        copy = env.home / "run" / "old.json"
        copy.write_bytes(old)
        os.replace(copy, path)
        with PodClient.connect(c2.socket) as c:
            c.shutdown()
        wait_until(
            lambda: [c["name"] for c in parent.call("status")["children"]] == ["c1"],
            20,
            "the parent to see c2 go",
        )
    finally:
        os.kill(c1.pid, signal.SIGCONT)
    wait_until(lambda: registry.get("c1") is not None, 20, "c1 registered again")
    assert run_and_wait(parent, "write")["outcome"] == "finished"
    write = tool_results(parent)[-1]
    assert write["is_error"] and "outside scope" in write["output"], write
    assert not (env.work / "a" / "x").exists()


def test_a_child_started_while_the_registry_is_corrupt_says_so_in_one_line(env: Env) -> None:
    """A child (`--adopt --callback`: spawn_pod, `podctl restart CHILD`) started while
    pods.json is corrupt: looking up its spawner there raised past the start-up's error
    handling, a traceback (and exit 1) where any other pod says in one line why."""
    run = env.home / "run"
    run.mkdir(mode=0o700)
    (run / "pods.json").write_text("garbage")
    callback = str(run / "pods" / "parent" / "sock")
    with pytest.raises(StartFailed) as refused:
        env.start("child", "--adopt", "--callback", callback)
    assert refused.value.code == EXIT_REFUSED
    (line,) = refused.value.stderr.splitlines()
    assert line.startswith("poddaemon: cannot start pod 'child': ")
    assert "corrupt pod registry" in line
