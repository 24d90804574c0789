"""The spawner's view of its children (poddaemon/spawn.py `Children`) against a real pods.json:
what a change of the registry costs the pod's event loop; and the tools a child's
configuration gets from `spawn_pod`'s `tools`."""

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from poddaemon import forkclient, spawn
from poddaemon.config.manifest import Manifest
from poddaemon.entries import SystemItem
from poddaemon.mcp.tool import McpTool
from poddaemon.registry import Registry, make_entry
from poddaemon.scope import Scope
from poddaemon.session import KEPT_REPORT_IDS
from poddaemon.spawn import Children, _Live, narrow_tools
from poddaemon.tools.base import ToolError, ToolOutcome
from poddaemon.toolset import Toolset
from tests.unit.cancelling import cancelled_while_connecting


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


# --- spawn_pod `tools`: the child's tools, builtin and MCP (SPEC §9) -------------------------


def spawner(**worker: Any) -> Manifest:
    """A spawner with two MCP servers: `gh` (no allow-list) and `db` (allow-list `query`,
    `schema.get`), and an output cap on one tool of each."""
    return msgspec.convert(
        {
            "pod": {"name": "boss", "pwd": "/tmp"},
            "provider": {"kind": "openai", "model": "m"},
            "worker": {
                "tools": ["read_file", "grep", "bash", "spawn_pod"],
                "tool_output": {"per_tool": {"gh__search": 100, "db__query": 200, "bash": 300}},
                **worker,
            },
            "scope": {"allow": [{"target": "/tmp", "permission": "write"}]},
            "mcp": {
                "servers": [
                    {"name": "gh", "command": ["gh-mcp"]},
                    {"name": "db", "command": ["db-mcp"], "tools": ["query", "schema.get"]},
                ]
            },
            "hooks": {"PreToolUse": [{"matcher": "bash", "command": "./guard.sh"}]},
        },
        Manifest,
    )


# What the spawner's model is offered of its servers (`db`'s allow-list applied by the pod).
OFFERED = {
    "gh__search": "search",
    "gh__create_issue": "create_issue",
    "db__query": "query",
    "db__schema_get": "schema.get",  # the offered name made safe; the server's own has a dot
}


def servers(m: Manifest) -> dict[str, list[str] | None]:
    return {s.name: s.tools for s in m.mcp.servers}


def test_named_mcp_tools_narrow_their_server_and_the_others_are_dropped() -> None:
    child = narrow_tools(spawner(), ["read_file", "gh__search"], OFFERED)
    assert child.worker.tools == ["read_file"]
    assert servers(child) == {"gh": ["search"]}  # db: none of its tools named, not started
    # An output cap for a dropped server's tool would name a server the child lacks.
    assert child.worker.tool_output.per_tool == {"gh__search": 100, "bash": 300}
    assert child.hooks == spawner().hooks  # a child cannot drop its spawner's hooks


def test_an_mcp_tool_is_allowed_by_the_servers_own_name() -> None:
    child = narrow_tools(spawner(), ["db__schema_get", "db__query", "db__query"], OFFERED)
    assert servers(child) == {"db": ["schema.get", "query"]}
    assert child.worker.tools == []


def test_server_star_keeps_the_whole_server_as_the_spawner_has_it() -> None:
    child = narrow_tools(spawner(), ["gh__*", "db__*", "db__query"], OFFERED)
    assert servers(child) == {"gh": None, "db": ["query", "schema.get"]}


@pytest.mark.parametrize(
    "asked, unknown",
    [
        (["gh__search", "gh__delete_repo"], "gh__delete_repo"),  # not a tool the server offers
        (["db__drop"], "db__drop"),  # not in the spawner's allow-list for db
        (["web__fetch", "web__*"], "web__fetch, web__*"),  # no such server
        (["write_file", "grep"], "write_file"),  # builtin the spawner does not have
    ],
)
def test_a_tool_the_spawner_may_not_use_is_refused_by_name(asked: list[str], unknown: str) -> None:
    with pytest.raises(ToolError) as exc:
        narrow_tools(spawner(), asked, OFFERED)
    assert str(exc.value) == f"tools: {unknown} not available to this pod"


def test_builtin_tools_only_leave_the_child_no_mcp_server() -> None:
    child = narrow_tools(spawner(), ["read_file", "grep"], OFFERED)
    assert child.worker.tools == ["read_file", "grep"]
    assert servers(child) == {}
    assert child.worker.tool_output.per_tool == {"bash": 300}


def test_tools_must_be_a_list_of_names() -> None:
    with pytest.raises(ToolError, match="list of tool names"):
        narrow_tools(spawner(), ["read_file", 3], OFFERED)


def test_without_tools_the_child_gets_every_tool_of_its_spawner(
    registry: Registry, tmp_path: Path
) -> None:
    """`spawn_pod` without `tools`: the child's configuration keeps every builtin tool and
    every MCP server whole."""
    m = spawner()
    pod: Any = SimpleNamespace(
        m=m,
        scope=Scope.from_dicts([{"target": "/tmp", "permission": "write"}]),
        s=SimpleNamespace(registry=registry, tools=SimpleNamespace(tools={})),
    )
    args = {"scope": [{"target": str(tmp_path), "permission": "read"}]}
    child = Children(pod)._child_manifest("kid", args, None)
    assert child.worker == m.worker
    assert child.mcp == m.mcp
    assert child.hooks == m.hooks


def test_the_child_gets_the_mcp_tools_named_as_the_spawners_model_sees_them(
    registry: Registry, tmp_path: Path
) -> None:
    """`_child_manifest` checks MCP names against the tools the spawner's model is offered."""

    async def call(remote: str, args: dict[str, Any]) -> ToolOutcome:
        raise AssertionError("not called")

    offered = [McpTool(name, remote, "", {}, call) for name, remote in OFFERED.items()]
    pod: Any = SimpleNamespace(
        m=spawner(),
        scope=Scope.from_dicts([{"target": "/tmp", "permission": "write"}]),
        s=SimpleNamespace(registry=registry, tools=Toolset({t.name: t for t in offered})),
    )
    args = {
        "scope": [{"target": str(tmp_path), "permission": "read"}],
        "tools": ["grep", "db__schema_get"],
    }
    child = Children(pod)._child_manifest("kid", args, None)
    assert child.worker.tools == ["grep"]
    assert servers(child) == {"db": ["schema.get"]}


# --- a long-lived spawner keeps a bounded past (README: "A pod keeps a bounded past") --------


def _run_finished(pod: str, run_id: str) -> SystemItem:
    return SystemItem(
        id=f"n-{run_id}",
        text="done",
        source=f"pod:{pod}",
        pod=pod,
        event_kind="run.finished",
        event_id=f"e-{run_id}",
        run_id=run_id,
        outcome="finished",
    )


def test_the_reports_a_spawner_remembers_for_runs_it_has_not_expected_yet_are_bounded() -> None:
    """`run.finished` of a child's run may arrive before the run's ack (then `_expect` must
    not wait for it); what is kept for that race is taken by `_expect` and is at most the
    newest KEPT_REPORT_IDS, however many runs the spawner's children ever finished."""
    children = Children(SimpleNamespace())
    for i in range(KEPT_REPORT_IDS + 500):  # a child's runs, reported after their ack
        children._expect("kid", f"r{i}")
        children.observe(_run_finished("kid", f"r{i}"))
    for i in range(KEPT_REPORT_IDS + 500):  # runs reported that this life never expects
        children.observe(_run_finished("kid", f"orphan{i}"))
    assert len(children._reported) <= KEPT_REPORT_IDS
    assert not children.outstanding.get("kid")
    children.observe(_run_finished("kid", "early"))  # the report before the ack
    children._expect("kid", "early")
    assert not children.outstanding.get("kid")  # nothing to wait for
    assert "early" not in children._reported  # and nothing kept once taken


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        # "false" is truthy: the child was given the whole tree instead of one level.
        ({"recursive": "false"}, "scope[0].recursive must be true or false"),
        ({"recursive": 0}, "scope[0].recursive must be true or false"),
        ({"permision": "write"}, "scope[0]: unknown field permision (expected target, "),
        ({"target": "/tmp/a\0b"}, "scope[0].target: invalid path '/tmp/a\\x00b': it contains"),
    ],
)
def test_a_scope_rule_the_child_would_not_get_as_asked_is_refused(
    registry: Registry, tmp_path: Path, rule: dict[str, Any], error: str
) -> None:
    pod: Any = SimpleNamespace(
        m=spawner(),
        scope=Scope.from_dicts([{"target": "/tmp", "permission": "write"}]),
        s=SimpleNamespace(registry=registry, tools=SimpleNamespace(tools={})),
    )
    args = {"scope": [{"target": str(tmp_path), "permission": "read", **rule}]}
    with pytest.raises(ToolError) as refused:
        Children(pod)._child_manifest("kid", args, None)
    assert str(refused.value).startswith(error), refused.value
    for given, recursive in ((False, False), (True, True), (None, True)):
        args = {"scope": [{"target": str(tmp_path), "permission": "read", "recursive": given}]}
        (child_rule,) = Children(pod)._child_manifest("kid", args, None).scope.allow
        assert child_rule.recursive is recursive


def test_a_pwd_with_a_nul_byte_is_a_tool_error(registry: Registry, tmp_path: Path) -> None:
    pod: Any = SimpleNamespace(
        m=spawner(),
        scope=Scope.from_dicts([{"target": "/tmp", "permission": "write"}]),
        s=SimpleNamespace(registry=registry, tools=SimpleNamespace(tools={})),
    )
    args = {"scope": [{"target": str(tmp_path), "permission": "read"}], "pwd": "/tmp/\0"}
    with pytest.raises(ToolError, match=r"pwd: invalid path .* it contains a NUL byte"):
        Children(pod)._child_manifest("kid", args, None)


def test_list_pods_asks_its_children_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`list_pods` asked each child for its state one after another: every child that did not
    answer (stopped, wedged) held the run STATUS_TIMEOUT more. Here each probe waits until
    all are under way: asked in turn, the first would wait for good."""
    import asyncio

    names = [f"kid{i}" for i in range(3)]
    records = {n: SimpleNamespace(scope=[], spent=0) for n in names}
    pod: Any = SimpleNamespace(state=SimpleNamespace(children=records))
    children = Children(pod)

    async def go() -> list[dict[str, Any]]:
        asked: list[str] = []
        everyone = asyncio.Event()

        async def probe(name: str, timeout: float = 2.0) -> tuple[str, int]:
            asked.append(name)
            if len(asked) == len(names):
                everyone.set()
            await everyone.wait()
            return "idle", 0

        monkeypatch.setattr(children, "_probe", probe)
        async with asyncio.timeout(30):  # (in turn, it never ends)
            return await children.list_children()

    listed = asyncio.run(go())
    assert [c["name"] for c in listed] == names
    assert all(c["state"] == "idle" for c in listed)


def test_send_to_a_child_that_does_not_answer_is_a_tool_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that takes the connection but never answers (stopped with SIGSTOP, wedged):
    send_to_pod waited for its answer for good, and the spawner's run with it."""
    import asyncio
    import socket as sockets

    from poddaemon import spawn
    from poddaemon.config.manifest import HooksSection

    monkeypatch.setattr(spawn, "CALL_TIMEOUT", 0.2, raising=False)
    path = str(tmp_path / "sock")
    deaf = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    deaf.bind(path)
    deaf.listen(1)  # connections wait in the backlog, never read
    pod: Any = SimpleNamespace(
        m=SimpleNamespace(hooks=HooksSection()),
        state=SimpleNamespace(children={"kid": object()}),
    )
    children = Children(pod)
    children.live["kid"] = _Live("kid", 0, path)

    async def go() -> str:
        with pytest.raises(ToolError) as refused:
            async with asyncio.timeout(30):  # (without a limit of its own, it never ends)
                await children.send("kid", "hello", "queue")
        return str(refused.value)

    try:
        said = asyncio.run(go())
    finally:
        deaf.close()
    assert "did not answer within 0.2 s" in said, said


async def test_a_spawn_cancelled_as_its_forked_child_is_connected_stops_the_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled in the loop pass that connects a forked child's stderr (after the fork
    server's thread returned), the child ran on for nobody, about to claim its scope."""
    child = subprocess.Popen(["sleep", "100"], start_new_session=True)  # the forked pod
    closed: list[bool] = []
    forked = SimpleNamespace(pid=child.pid, close=lambda: closed.append(True))
    monkeypatch.setattr(forkclient, "fork_pod", lambda cmd, stdio, alone_ok: forked)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.delenv("PODDAEMON_FORKSERVER", raising=False)
    try:
        with (
            cancelled_while_connecting(asyncio.get_running_loop()),
            pytest.raises(asyncio.CancelledError),
        ):
            await asyncio.create_task(spawn._fork(["python", "-m", "poddaemon", "run", "m"]))
        assert child.wait(5) == -signal.SIGKILL
        assert closed == [True]
    finally:
        child.kill()
        child.wait()


async def test_a_fork_server_out_of_reach_through_an_os_error_leaves_the_child_to_exec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fork_pod raising an OSError (out of descriptors, say) failed the spawn, where the child
    should be exec'd, and left the pipe's read end open for the pod's lifetime."""

    def out_of_descriptors(cmd: list[str], stdio: tuple[int, ...], alone_ok: bool) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(forkclient, "fork_pod", out_of_descriptors)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.delenv("PODDAEMON_FORKSERVER", raising=False)
    before = set(os.listdir("/proc/self/fd"))
    assert await spawn._fork(["python", "-m", "poddaemon", "run", "m"]) is None
    assert set(os.listdir("/proc/self/fd")) <= before
