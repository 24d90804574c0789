"""podctl as automation uses it (cron, CI, scripts branching on exit codes): QA round 23.

Real pods over real sockets with the fake model; each test names the item it checks."""

from poddaemon.registry import Registry
from tests.conftest import Env, wait_until
from tests.integration.test_spawn import (
    quiet_children,
    run_and_wait,
    spawn_call,
    start_parent,
    tree,
)

__all__ = ["tree"]  # the fixture, used by name


def children_of(env: Env, parent: str) -> list[str]:
    return sorted(e.name for e in Registry(env.home / "run").live() if e.parent == parent)


# --- item 4: `podctl restart` of a stopped child keeps its spawner within max_children -----------


def test_restart_of_a_stopped_child_refuses_to_pass_its_spawners_max_children(tree: Env) -> None:
    """A spawner with `max_children = 1` spawned k1, which was stopped, then k2. `podctl
    restart k1` started k1 again and its spawner took it back: two live children, past the
    limit spawn_pod itself enforces. The restart is refused instead (exit 1, naming the limit),
    before anything is stopped or started; once k2 is stopped it succeeds."""
    env = tree
    for kid in ("k1", "k2"):
        (env.work / kid).mkdir()
    quiet_children(env, "k1", "k2")
    env.model.script(
        {"tool_calls": [spawn_call("k1", "work", [str(env.work / "k1")])]}, {"text": "one"}
    )
    parent = start_parent(env, extra="[spawn]\nmax_children = 1\n")
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    stopped = env.podctl("stop", "k1")
    assert stopped.returncode == 0, stopped.stderr
    wait_until(lambda: parent.call("status")["children"] == [], 10, "the spawner to see k1 go")
    env.model.script(
        {"tool_calls": [spawn_call("k2", "work", [str(env.work / "k2")])]}, {"text": "two"}
    )
    assert run_and_wait(parent, "again")["outcome"] == "finished"
    assert children_of(env, "parent") == ["k2"]

    out = env.podctl("restart", "k1")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "max_children" in out.stderr and "k2" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert children_of(env, "parent") == ["k2"]

    assert env.podctl("stop", "k2").returncode == 0
    out = env.podctl("restart", "k1")
    assert out.returncode == 0, out.stderr
    assert children_of(env, "parent") == ["k1"]
