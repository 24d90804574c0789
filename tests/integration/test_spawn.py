"""Spawn trees (issue 10, SPEC §9): real parent and child pods, the fake model scripting the
parent's tool calls. Children get their own model names (`spawn_pod {model}`), so the fake model
scripts each pod apart (`script_model`); an unscripted child answers `ok: <its input>`."""

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock
import pytest

from poddaemon.registry import Registry, make_entry
from poddaemon.scope import Scope
from protocol import PodClient
from protocol.errors import RpcError
from tests.conftest import Env, PodProcess, collect_run, drained, ppid, wait_until

POD_TOOLS = [
    "read_file",
    "write_file",
    "list_dir",
    "spawn_pod",
    "send_to_pod",
    "wait_pods",
    "list_pods",
    "stop_pod",
]


@pytest.fixture
def tree(env: Env) -> Iterator[Env]:
    """`env`, and at the end every pod of this home killed (children are their own groups)."""
    try:
        yield env
    finally:
        # Shown by pytest only when the test failed: what the children said.
        for log in sorted((env.home / "run" / "pods").glob("*/stderr.log")):
            print(f"--- {log} ---\n{log.read_text(errors='replace')}")
        for entry in Registry(env.home / "run").live():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(entry.pid, signal.SIGKILL)
        for entry in _stray(env):
            with contextlib.suppress(ProcessLookupError):
                os.kill(entry, signal.SIGKILL)


def _stray(env: Env) -> list[int]:
    """Pids of `poddaemon run` processes of this home still alive (registered or not)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            # A pod forked by the fork server has its title in one string (setproctitle) and
            # an empty environ; its children's command lines name the home (their callback).
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
            continue
        home = str(env.home).encode()
        if b"-m poddaemon run " in cmd and (
            home + b"/" in cmd or b"PODDAEMON_HOME=" + home + b"\0" in environ
        ):
            found.append(int(pid))
    return found


def spawn_call(name: str, task: str, write: list[str], **extra: Any) -> dict[str, Any]:
    scope = [{"target": t, "permission": "write"} for t in write]
    return {
        "name": "spawn_pod",
        "arguments": {"name": name, "task": task, "scope": scope, "model": f"m-{name}", **extra},
    }


def tool(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def start_parent(env: Env, name: str = "parent", extra: str = "", **kw: Any) -> PodProcess:
    kw.setdefault("tools", POD_TOOLS)
    return env.start(name, extra=extra, **kw)


def tool_results(pod: PodProcess) -> list[dict[str, Any]]:
    entries = pod.call("history", limit=10000)["entries"]
    return [e["item"] for e in entries if e["kind"] == "tool_result"]


def reports(pod: PodProcess) -> list[dict[str, Any]]:
    entries = pod.call("history", limit=10000)["entries"]
    return [e for e in entries if e["kind"] == "system_item" and e.get("pod")]


def model_saw(env: Env, model: str) -> list[str]:
    """The request bodies (JSON text) the fake model got for `model`."""
    return [json.dumps(r["body"]) for r in env.model.requests if r["body"].get("model") == model]


def quiet_children(env: Env, *names: str) -> None:
    for n in names:
        env.model.script_model(f"m-{n}")  # their own (empty) queue: the echo answer


def _run_into_tool(c: PodClient, text: str, name: str) -> Any:
    """Start a run of `text` on `c` (subscribed); return it once its call of tool `name` has
    started."""
    c.subscribe()
    run = c.run(text)
    for event in c.events():
        if event.type == "tool.started" and event.data["name"] == name:
            return run
    raise AssertionError(f"the run ended without calling {name}")


def run_and_wait(pod: PodProcess, text: str, timeout: float = 60) -> dict[str, Any]:
    with pod.client(timeout=timeout) as c:
        import msgspec

        return dict(msgspec.json.decode(c.call_raw("run", {"input": text, "wait": True})))


# --- scope: disjoint delegated write areas ---------------------------------------------------


def test_children_get_disjoint_delegated_scopes(tree: Env) -> None:
    env = tree
    work = env.work
    dirs = {n: work / n for n in ("a", "b", "c")}
    for d in dirs.values():
        d.mkdir()
    # Each child tries to write into the next one's area (and, c, into the parent's own file).
    targets = {"a": dirs["b"] / "x", "b": dirs["c"] / "x", "c": work / "x"}
    for n, target in targets.items():
        env.model.script_model(
            f"m-{n}",
            {"tool_calls": [tool("write_file", path=str(target), content="no")]},
            {"text": f"{n} done"},
        )
    env.model.script(
        {
            "tool_calls": [spawn_call(n, f"task {n}", [str(d)]) for n, d in dirs.items()]
            + [tool("write_file", path=str(dirs["a"] / "p.txt"), content="parent")]
        },
        {"tool_calls": [tool("wait_pods", pods=["a"], timeout_s=30)]},
        {
            "tool_calls": [
                tool("stop_pod", pod="a"),
                tool("write_file", path=str(dirs["a"] / "p.txt"), content="parent"),
            ]
        },
        {"text": "parent done"},
    )
    parent = start_parent(env)
    result = run_and_wait(parent, "go")
    assert result["outcome"] == "finished", result
    results = tool_results(parent)
    spawned = [json.loads(r["output"]) for r in results if r["name"] == "spawn_pod"]
    assert [s["name"] for s in spawned] == ["a", "b", "c"], results
    writes = [r for r in results if r["name"] == "write_file"]
    assert writes[0]["is_error"] and "outside scope" in writes[0]["output"], writes
    assert not writes[1]["is_error"], writes  # child a stopped: the area is the parent's again
    assert (dirs["a"] / "p.txt").read_text() == "parent"
    # Child a's write outside its delegated area was refused; nothing landed.
    for n, target in targets.items():
        assert not target.exists()
        wait_until(
            lambda n=n: any("outside scope" in b for b in model_saw(env, f"m-{n}")),  # type: ignore[misc]
            20,
            f"child {n}'s refusal",
        )
    # The registry knows the tree; b and c still live, with parent = "parent".
    live = {e.name: e for e in Registry(env.home / "run").live()}
    assert {live["b"].parent, live["c"].parent} == {"parent"} and "a" not in live
    st = parent.call("status")
    assert sorted(c["name"] for c in st["children"]) == ["b", "c"]
    # Children log to <runtime>/pods/<name>/stderr.log, their config kept for podctl restart.
    assert "ready on" in (env.home / "run" / "pods" / "b" / "stderr.log").read_text()
    assert (env.home / "data" / "pods" / "b.toml").exists()
    assert (env.home / "data" / "pods" / "b.callback").read_text().strip() == parent.socket
    assert all(c["pid"] > 0 and c["socket"] for c in st["children"])


def test_a_non_recursive_child_leaves_the_parent_what_lies_deeper(tree: Env) -> None:
    # SPEC §3: `recursive = false` is the target and its direct children only; the spawner
    # loses write there (§9), not in the whole tree below. It lost all of it once.
    env = tree
    area = env.work / "d"
    (area / "e").mkdir(parents=True)
    env.model.script_model("m-flat", {"text": "flat ready"})
    spawn = spawn_call("flat", "wait", [])
    spawn["arguments"]["scope"] = [{"target": str(area), "permission": "write", "recursive": False}]
    env.model.script(
        {
            "tool_calls": [
                spawn,
                tool("write_file", path=str(area / "e" / "deep.txt"), content="parent"),
                tool("write_file", path=str(area / "top.txt"), content="parent"),
            ]
        },
        {"text": "parent done"},
    )
    parent = start_parent(env)
    result = run_and_wait(parent, "go")
    assert result["outcome"] == "finished", result
    writes = [r for r in tool_results(parent) if r["name"] == "write_file"]
    assert not writes[0]["is_error"], writes  # two levels down: still the parent's
    assert (area / "e" / "deep.txt").read_text() == "parent"
    assert writes[1]["is_error"] and "outside scope" in writes[1]["output"], writes
    assert not (area / "top.txt").exists()


# --- reports ---------------------------------------------------------------------------------


def _finished_reports(pod: PodProcess, child: str) -> list[dict[str, Any]]:
    return [r for r in reports(pod) if r["pod"] == child and r["event_kind"] == "run.finished"]


def test_each_report_reaches_the_parent_model_once(tree: Env) -> None:
    env = tree
    quiet_children(env, "k1", "k2")
    env.model.script(
        {
            "tool_calls": [
                spawn_call("k1", "alpha", [str(env.work / "k1")]),
                spawn_call("k2", "beta", [str(env.work / "k2")]),
            ]
        },
        {"text": "spawned"},
    )
    for d in ("k1", "k2"):
        (env.work / d).mkdir()
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: len(reports(parent)) >= 2, 30, "two child reports")
    for child, task in (("k1", "alpha"), ("k2", "beta")):
        got = _finished_reports(parent, child)
        assert len(got) == 1, got
        assert got[0]["outcome"] == "finished" and got[0]["detail"] == f"ok: {task}"
    # The parent's model saw each report exactly once (in the request after they arrived).
    wait_until(
        lambda: any("ok: alpha" in b and "ok: beta" in b for b in model_saw(env, "fake-model")),
        20,
        "the parent's model to see the reports",
    )
    # The first request carrying them has each once; later requests carry the same history item
    # (and the parent's own echo of it), never a second delivery.
    for text in ("ok: alpha", "ok: beta"):
        first = next(b for b in model_saw(env, "fake-model") if text in b)
        assert first.count(text) == 1
    entries = parent.call("history", limit=10000)["entries"]
    delivered = [i for e in entries if e["kind"] == "inputs_delivered" for i in e["ids"]]
    for r in reports(parent):
        assert delivered.count(r["id"]) == 1


def _detached_parent_of(env: Env, child: str, *replies: dict[str, Any]) -> PodProcess:
    """A parent (on_parent_exit = detach) that spawned `child` on work/<child>, the child's
    model scripted with `replies` (none: it echoes its task at once)."""
    (env.work / child).mkdir()
    env.model.script_model(f"m-{child}", *replies)
    env.model.script(
        {"tool_calls": [spawn_call(child, "work", [str(env.work / child)])]}, {"text": "spawned"}
    )
    parent = start_parent(env, extra='[spawn]\non_parent_exit = "detach"\n')
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    return parent


def test_reports_wait_while_the_parent_is_down(tree: Env) -> None:
    """kill -9 of a parent whose children detach: their reports wait and arrive on restore."""
    env = tree
    parent = _detached_parent_of(env, "d1", {"text": "d1 done", "gate": "child"})
    parent.kill9()
    env.model.open_gate("child")  # the child finishes while its parent is down
    child = Registry(env.home / "run").get("d1")
    assert child is not None
    time.sleep(0.3)  # let it try (and fail) to deliver
    again = env.restart(parent, "--resume")
    wait_until(lambda: _finished_reports(again, "d1"), 20, "the waiting report")
    time.sleep(0.5)
    got = _finished_reports(again, "d1")
    assert len(got) == 1 and got[0]["detail"] == "d1 done"
    st = again.call("status")
    assert [c["name"] for c in st["children"]] == ["d1"]  # re-adopted


def test_a_child_that_stopped_while_its_spawner_was_down_still_reports(tree: Env) -> None:
    """A report is never lost: a detached child that finished its work and was stopped while
    its spawner was down left its reports in its log; the restored spawner takes them from
    there (the child's result, not an `errored` of its own)."""
    env = tree
    parent = _detached_parent_of(env, "d1", {"text": "d1 done", "gate": "child"})
    assert parent.stop() == 0
    env.model.open_gate("child")  # the child finishes while its spawner is down
    assert env.podctl("wait", "d1", "--timeout", "20").returncode == 0
    assert env.podctl("stop", "d1").returncode == 0
    again = env.restart(parent, "--resume")
    wait_until(lambda: _finished_reports(again, "d1"), 20, "the report left in the log")
    drained(again)
    got = [(r["event_kind"], r.get("detail")) for r in reports(again) if r["pod"] == "d1"]
    assert got == [("run.finished", "d1 done"), ("shutdown", None)]
    assert again.call("status")["children"] == []


def test_wait_pods_after_a_restore_waits_for_a_child_still_at_work(tree: Env) -> None:
    """The runs a spawner gave its children die with its memory at kill -9: after the restore,
    wait_pods waits for a taken-back child while it is running, not returning at once."""
    env = tree
    parent = _detached_parent_of(env, "d1", {"text": "d1 done", "gate": "child"})
    parent.kill9()
    again = env.restart(parent, "--resume")
    env.model.script(
        {"tool_calls": [tool("wait_pods", pods=["d1"], timeout_s=30)]}, {"text": "waited"}
    )
    with again.client(timeout=60) as c:
        run = _run_into_tool(c, "wait for d1", "wait_pods")
        env.model.open_gate("child")  # only now: wait_pods must still be waiting
        assert collect_run(c, run.run_id)[-1].data["outcome"] == "finished"
    (waited,) = [r for r in tool_results(again) if r["name"] == "wait_pods"]
    d1 = json.loads(waited["output"])["d1"]
    assert (d1["outcome"], d1["text"], d1["waiting"]) == ("finished", "d1 done", False), d1


def test_wait_pods_after_a_restore_waits_for_a_report_the_child_still_holds(tree: Env) -> None:
    """A child that finished while its spawner was down holds its report until it can deliver
    it (retrying with backoff): wait_pods on the restored spawner waits for that report, rather
    than answering at once that the idle child has no outcome."""
    env = tree
    parent = _detached_parent_of(env, "d1", {"text": "d1 done", "gate": "child"})
    parent.kill9()
    env.model.open_gate("child")  # the child finishes while its parent is down
    assert env.podctl("wait", "d1", "--timeout", "20").returncode == 0
    again = env.restart(parent, "--resume")
    env.model.script(
        {"tool_calls": [tool("wait_pods", pods=["d1"], timeout_s=30)]}, {"text": "waited"}
    )
    assert run_and_wait(again, "wait for d1")["outcome"] == "finished"
    (waited,) = [r for r in tool_results(again) if r["name"] == "wait_pods"]
    d1 = json.loads(waited["output"])["d1"]
    assert (d1["outcome"], d1["text"], d1["waiting"]) == ("finished", "d1 done", False), d1


def test_a_pod_started_afresh_under_a_gone_spawners_name_takes_no_child_beyond_its_scope(
    tree: Env,
) -> None:
    """A detached child outlives its spawner's crash. Another pod started under the
    spawner's name, afresh and with another scope, took that child back as its own: its
    model could steer (send_to_pod) a pod writing where it cannot even read, and stopping
    it stopped the child. A pod whose scope does not lie in ours is not our child."""
    env = tree
    parent = _detached_parent_of(env, "d1", {"text": "d1 done", "gate": "child"})
    parent.kill9()
    (env.work / "other").mkdir()
    env.model.script(
        {"tool_calls": [tool("send_to_pod", pod="d1", message="write outside your scope")]},
        {"text": "done"},
    )
    namesake = start_parent(env, write=[str(env.work / "other")])
    assert namesake.call("status")["children"] == []
    env.model.open_gate("child")  # d1 reports to the socket of that name: heard, not taken
    wait_until(lambda: _finished_reports(namesake, "d1"), 20, "d1's report")
    assert run_and_wait(namesake, "steer d1")["outcome"] == "finished"
    (sent,) = [r for r in tool_results(namesake) if r["name"] == "send_to_pod"]
    assert sent["is_error"] and "no child pod named 'd1'" in sent["output"], sent
    assert namesake.call("status")["children"] == []
    assert namesake.stop() == 0
    assert Registry(env.home / "run").get("d1") is not None  # not stopped as its child


def test_child_killed_mid_report_is_redelivered_once(tree: Env) -> None:
    """A child kill -9ed with a report in its outbox redelivers it after its restore; the
    parent accepts its event_id once."""
    env = tree
    parent = _detached_parent_of(env, "r1")
    wait_until(lambda: _finished_reports(parent, "r1"), 20, "the first report")
    entry = Registry(env.home / "run").get("r1")
    assert entry is not None
    sessions = env.home / "data" / "sessions"
    log_path = next(p for p in sessions.iterdir() if '"pod":"r1"' in p.read_text()[:4000])
    # The parent logs the report before it answers: the child's ack comes a moment later.
    wait_until(lambda: _outbox_done(log_path), 10, "the child to log the ack")
    # Simulate a report committed but never acknowledged: the child dies before the ack is
    # logged. Its log still lists it (no outbox_acked) after we cut the ack off.
    os.kill(entry.pid, signal.SIGKILL)
    wait_until(lambda: Registry(env.home / "run").get("r1") is None, 10, "r1 gone")
    lines = log_path.read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"kind":"outbox_acked"' in line]
    log_path.write_text("".join(lines[: cut[0]]))  # as if it died between delivery and ack
    out = env.podctl("restart", "r1")
    assert out.returncode == 0, out.stderr
    wait_until(lambda: _outbox_done(log_path), 20, "the redelivery to be acknowledged")
    assert len(_finished_reports(parent, "r1")) == 1
    # and the parent did see the death meanwhile (reported by itself as errored)
    assert any(r["event_kind"] == "errored" for r in reports(parent) if r["pod"] == "r1")
    # The restarted child is its child again: watched, listed, its area delegated.
    wait_until(
        lambda: [c["name"] for c in parent.call("status")["children"]] == ["r1"],
        10,
        "the parent to take the restarted child back",
    )
    writable = [r for r in parent.call("status")["scope"] if r.get("deny")]
    assert any(r["target"] == str(env.work / "r1") for r in writable)


def test_child_restarted_while_its_spawner_is_down_is_taken_back(tree: Env) -> None:
    """`podctl restart CHILD` while its (detached-from) spawner is down: the child keeps the
    spawner as parent, so the restored spawner starts (no scope clash with its own child) and
    re-adopts it, its area delegated."""
    env = tree
    parent = _detached_parent_of(env, "d1")
    wait_until(lambda: _finished_reports(parent, "d1"), 20, "the report")
    parent.kill9()
    out = env.podctl("restart", "d1")
    assert out.returncode == 0, out.stderr
    entry = Registry(env.home / "run").get("d1")
    assert entry is not None and entry.parent == "parent"
    again = env.restart(parent, "--resume")  # failed: scope conflict with its own child
    st = again.call("status")
    assert [c["name"] for c in st["children"]] == ["d1"]
    assert any(r["target"] == str(env.work / "d1") for r in st["scope"] if r.get("deny"))


def test_child_restarted_while_its_spawner_is_down_drops_its_stale_shutdown_report(
    tree: Env,
) -> None:
    """`podctl restart CHILD` while its spawner is down: the stop commits a `shutdown` report
    the spawner cannot take. The child runs again, so that report is no longer true: the
    restarted child drops it rather than deliver it to the restored spawner, which would then
    take the running child for shut down and stay silent when it later dies."""
    env = tree
    parent = _detached_parent_of(env, "d1")
    wait_until(lambda: _finished_reports(parent, "d1"), 20, "the report")
    parent.kill9()
    out = env.podctl("restart", "d1")
    assert out.returncode == 0, out.stderr
    again = env.restart(parent, "--resume")
    log_path = _session_log_of(env, "d1")
    wait_until(lambda: not _undelivered(log_path), 20, "the child's outbox to drain")
    assert [r["event_kind"] for r in reports(again) if r["pod"] == "d1"] == ["run.finished"]
    entry = Registry(env.home / "run").get("d1")
    assert entry is not None
    os.kill(entry.pid, signal.SIGKILL)
    wait_until(lambda: [r for r in reports(again) if r["event_kind"] == "errored"], 10, "errored")


def _session_log_of(env: Env, pod: str) -> Path:
    sessions = env.home / "data" / "sessions"
    return next(p for p in sessions.iterdir() if f'"pod":"{pod}"' in p.read_text()[:4000])


def _undelivered(log_path: Path) -> set[str]:
    """The ids of the reports in a child's log its spawner has not acknowledged."""
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line]
    sent = {e["event_id"] for e in entries if e["kind"] == "outbox"}
    return sent - {i for e in entries if e["kind"] == "outbox_acked" for i in e["ids"]}


def _parent_of_an_idle_kid(env: Env) -> tuple[PodProcess, Path]:
    """A parent whose child `kid`, on work/kid, has done its task and reported it; and that
    area."""
    kid = env.work / "kid"
    kid.mkdir()
    env.model.script_model("m-kid")
    env.model.script({"tool_calls": [spawn_call("kid", "work", [str(kid)])]}, {"text": "spawned"})
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: _finished_reports(parent, "kid"), 20, "the report")
    return parent, kid


def test_child_restarted_while_its_spawner_lives_is_taken_back_at_once(tree: Env) -> None:
    """`podctl restart CHILD` of an idle child with nothing to report: its spawner takes it back
    (it loses write on the child's area again, it watches it) without waiting for a report."""
    env = tree
    parent, kid = _parent_of_an_idle_kid(env)
    out = env.podctl("restart", "kid")
    assert out.returncode == 0, out.stderr
    wait_until(
        lambda: [c["name"] for c in parent.call("status")["children"]] == ["kid"],
        10,
        "the spawner to take the restarted child back",
    )
    env.model.script(
        {"tool_calls": [tool("write_file", path=str(kid / "p.txt"), content="parent")]},
        {"text": "tried"},
    )
    assert run_and_wait(parent, "write")["outcome"] == "finished"
    write = [r for r in tool_results(parent) if r["name"] == "write_file"]
    assert write[0]["is_error"] and "outside scope" in write[0]["output"], write
    assert not (kid / "p.txt").exists()
    entry = Registry(env.home / "run").get("kid")
    assert entry is not None
    os.kill(entry.pid, signal.SIGKILL)  # its death is reported, not hidden by its old shutdown
    wait_until(lambda: [r for r in reports(parent) if r["event_kind"] == "errored"], 10, "errored")


def test_a_child_restarted_from_a_shell_is_waited_for_while_it_starts(tree: Env) -> None:
    """`podctl restart CHILD` while its spawner lives: the spawner takes it back as it
    registers, before it listens (its SessionStart hooks first). send_to_pod then said "cannot
    reach the child pod: ... no socket" and its status said `unresponsive`, where `podctl send`
    waits for a pod that is starting."""
    env = tree
    kid = env.work / "kid"
    kid.mkdir()
    # In its area: the hook runs in its sandbox.
    hold, gate, started = kid / "hold", kid / "gate", kid / "starting"
    hook = env.home / "hold.sh"
    hook.write_text(
        "#!/bin/sh\n"
        f'case "$PWD" in */kid) if [ -e {hold} ]; then touch {started}; '
        f"while [ ! -e {gate} ]; do sleep 0.02; done; fi;; esac\n"
        "echo '{}'\n"
    )
    hook.chmod(0o755)
    env.model.script_model("m-kid")
    env.model.script({"tool_calls": [spawn_call("kid", "work", [str(kid)])]}, {"text": "spawned"})
    parent = start_parent(env, extra=f'[[hooks.SessionStart]]\ncommand = "{hook}"\n')
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: _finished_reports(parent, "kid"), 20, "the report")
    hold.touch()
    restart = env.podctl_popen("restart", "kid")
    try:
        wait_until(started.exists, 20, "the restarted child's SessionStart hook")
        wait_until(
            lambda: [c["name"] for c in parent.call("status")["children"]] == ["kid"],
            10,
            "the spawner to take the restarted child back",
        )
        assert [c["state"] for c in parent.call("status")["children"]] == ["starting"]
        env.model.script(
            {"tool_calls": [tool("send_to_pod", pod="kid", message="AGAIN")]}, {"text": "sent"}
        )
        with parent.client(timeout=60) as c:
            run = _run_into_tool(c, "use the child", "send_to_pod")
            gate.touch()  # the send is under way: now the child may listen
            assert collect_run(c, run.run_id)[-1].data["outcome"] == "finished"
    finally:
        gate.touch()
        assert restart.wait(30) == 0, restart.stderr.read() if restart.stderr else ""
    sent = [r for r in tool_results(parent) if r["name"] == "send_to_pod"]
    assert not sent[0]["is_error"], sent
    wait_until(lambda: any("AGAIN" in b for b in model_saw(env, "m-kid")), 20, "the message")


def _parent_of_a_busy_kid(env: Env, kid: str) -> PodProcess:
    """A parent (on_parent_exit = stop) whose child `kid`, on work/<kid>, works on its task:
    its model call waits on a gate that never opens."""
    (env.work / kid).mkdir()
    env.model.script_model(f"m-{kid}", {"text": "never", "gate": "never"})
    env.model.script(
        {"tool_calls": [spawn_call(kid, "the task", [str(env.work / kid)])]},
        {"text": "spawned"},
    )
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    return parent


def test_a_child_restarted_mid_task_reports_the_run_that_takes_it_up(tree: Env) -> None:
    """kill -9 of a child at work, then `podctl restart CHILD`: its spawner hears the task was
    cut off (errored, run.finished error), and then how the run that took the task up after
    the restart ended. That run went unreported: the work was done, the spawner's model was
    told only that it failed, and would hand it out again."""
    env = tree
    parent = _parent_of_a_busy_kid(env, "k5")
    env.model.wait_for_requests(3)  # the child's model call, held at its gate
    entry = Registry(env.home / "run").get("k5")
    assert entry is not None
    os.kill(entry.pid, signal.SIGKILL)
    wait_until(lambda: [r for r in reports(parent) if r["event_kind"] == "errored"], 10, "errored")
    env.model.script_model("m-k5", {"text": "K5 DONE AFTER THE RESTART"})
    out = env.podctl("restart", "k5")
    assert out.returncode == 0, out.stderr
    wait_until(
        lambda: [r for r in _finished_reports(parent, "k5") if r["outcome"] == "finished"],
        20,
        "the report of the run that took the task up",
    )
    finished = _finished_reports(parent, "k5")
    assert [(r["outcome"], r["detail"]) for r in finished][-1] == (
        "finished",
        "K5 DONE AFTER THE RESTART",
    )
    assert finished[0]["outcome"] == "error" and "interrupted" in finished[0]["detail"]


def test_tool_call_right_after_a_child_restart_does_not_write_in_its_area(tree: Env) -> None:
    """The spawner's model asks for a write into a child's area the moment `podctl restart
    CHILD` has returned (the child registered, its area delegated again): the tool call looks
    at pods.json first and is refused, rather than writing until the next registry poll."""
    env = tree
    parent, kid = _parent_of_an_idle_kid(env)
    env.model.script(
        {
            "tool_calls": [tool("write_file", path=str(kid / "p.txt"), content="parent")],
            "gate": "write",
        },
        {"text": "tried"},
    )
    with parent.client(timeout=60) as c:
        c.subscribe()
        run = c.run("write")
        out = env.podctl("restart", "kid")
        assert out.returncode == 0, out.stderr
        env.model.open_gate("write")  # the write comes within milliseconds, not after a poll
        assert collect_run(c, run.run_id)[-1].data["outcome"] == "finished"
    write = [r for r in tool_results(parent) if r["name"] == "write_file"]
    assert write[0]["is_error"] and "outside scope" in write[0]["output"], write
    assert not (kid / "p.txt").exists()


def _outbox_done(path: Path) -> bool:
    return '"kind":"outbox_acked"' in path.read_text()


def _parent_of_one_child(env: Env, kid: str, busy: bool = False) -> PodProcess:
    """A parent that spawned `kid`: a child whose turn never ends (`busy`), or one that
    answers at once."""
    (env.work / kid).mkdir()
    if busy:
        env.model.script_model(f"m-{kid}", {"text": "never", "gate": "never"})
    else:
        quiet_children(env, kid)
    env.model.script(
        {"tool_calls": [spawn_call(kid, "hi", [str(env.work / kid)])]}, {"text": "spawned"}
    )
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    return parent


def test_child_killed_without_restore_is_reported_errored(tree: Env) -> None:
    env = tree
    parent = _parent_of_one_child(env, "e1", busy=True)
    _kill_and_see_it_reported_errored(env, parent, "e1")
    wait_until(
        lambda: any("[errored]" in b for b in model_saw(env, "fake-model")),
        10,
        "the parent's model to see it",
    )
    assert parent.call("status")["children"] == []


def test_wait_pods_on_a_child_killed_in_its_second_run_gives_that_run_errored(tree: Env) -> None:
    """wait_pods answers each child's last run's outcome and text (SPEC §9). A child kill -9ed
    in the run send_to_pod gave it was answered with its first run, `finished`, and that run's
    answer, as if that were its last word."""
    env = tree
    (env.work / "kid").mkdir()
    env.model.script_model("m-kid", {"text": "first answer"}, {"text": "x", "gate": "never"})
    env.model.script(
        {"tool_calls": [spawn_call("kid", "a task", [str(env.work / "kid")])]},
        {"tool_calls": [tool("send_to_pod", pod="kid", message="second")]},
        {"tool_calls": [tool("wait_pods", pods=["kid"], timeout_s=60)]},
        {"text": "parent done"},
    )
    parent = start_parent(env)
    with parent.client(timeout=90) as c:
        run = _run_into_tool(c, "go", "wait_pods")
        wait_until(lambda: len(model_saw(env, "m-kid")) >= 2, 20, "the kid's second run")
        entry = Registry(env.home / "run").get("kid")
        assert entry is not None
        os.kill(entry.pid, signal.SIGKILL)
        assert collect_run(c, run.run_id)[-1].data["outcome"] == "finished"
    (waited,) = [r for r in tool_results(parent) if r["name"] == "wait_pods"]
    kid = json.loads(waited["output"])["kid"]
    assert (kid["state"], kid["outcome"], kid["waiting"]) == ("stopped", "error", False), kid
    assert "died without a final report" in kid["text"], kid


def test_a_live_childs_report_comes_from_its_own_process_only(tree: Env) -> None:
    """Any process of this user reaches the spawner's socket (a child's sandboxed bash too):
    one forging a live child's `shutdown` made the spawner take that child for stopped, and
    when it then died its `errored` report was never made (and its grant was released)."""
    env = tree
    parent = _parent_of_one_child(env, "v1", busy=True)
    with PodClient.connect(parent.socket, timeout=10) as c, pytest.raises(RpcError) as err:
        c.pod_event("v1", "shutdown", event_id="forged", usage={"tree_spent": 0})
    assert err.value.code == -32602 and "v1" in str(err.value), err.value
    assert not [r for r in reports(parent) if r.get("event_id") == "forged"]
    _kill_and_see_it_reported_errored(env, parent, "v1")


def _kill_and_see_it_gone(env: Env, parent: PodProcess, kid: str) -> None:
    """kill -9 the child `kid`; return once its spawner lists no live child."""
    entry = Registry(env.home / "run").get(kid)
    assert entry is not None
    os.kill(entry.pid, signal.SIGKILL)
    wait_until(lambda: parent.call("status")["children"] == [], 20, f"the end of {kid}, killed")


def _kill_and_see_it_reported_errored(env: Env, parent: PodProcess, kid: str) -> None:
    entry = Registry(env.home / "run").get(kid)
    assert entry is not None
    os.kill(entry.pid, signal.SIGKILL)
    wait_until(
        lambda: [r for r in reports(parent) if r["event_kind"] == "errored"],
        10,
        f"the errored report of {kid}, killed",
    )


def test_a_report_for_an_ended_child_comes_only_from_that_child_restarted(tree: Env) -> None:
    """A report naming a child that ended counts its `tree_spent` into the spawner's budget:
    one forged by any process of this user exhausted that budget for good."""
    env = tree
    (env.work / "v2").mkdir()
    quiet_children(env, "v2")
    env.model.script(
        {"tool_calls": [spawn_call("v2", "hi", [str(env.work / "v2")], budget_tokens=1000)]},
        {"text": "spawned"},
    )
    parent = start_parent(env, extra="[budget]\nmax_total_tokens = 100000\n")
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: _finished_reports(parent, "v2"), 20, "the child's report")
    _kill_and_see_it_gone(env, parent, "v2")
    drained(parent)
    before = parent.call("status")["budget"]
    with PodClient.connect(parent.socket, timeout=10) as c, pytest.raises(RpcError) as err:
        c.pod_event("v2", "errored", event_id="forged", usage={"tree_spent": 10**12})
    assert err.value.code == -32602 and "v2" in str(err.value), err.value
    after = parent.call("status")["budget"]
    assert after["tree_spent"] == before["tree_spent"] and after["left"] > 0, (before, after)


# --- parent exit ------------------------------------------------------------------------------


def _tree_of_two(env: Env, policy: str) -> PodProcess:
    """A parent, two children, and (under s1) a grandchild: four processes."""
    for d in ("s1", "s2", "s1/g1"):
        (env.work / d).mkdir()
    quiet_children(env, "s2", "g1")
    env.model.script_model(
        "m-s1",
        {"tool_calls": [spawn_call("g1", "grandchild", [str(env.work / "s1" / "g1")])]},
        {"text": "s1 spawned g1"},
    )
    env.model.script(
        {"tool_calls": [spawn_call(n, "hi", [str(env.work / n)]) for n in ("s1", "s2")]},
        {"text": "spawned"},
    )
    parent = start_parent(env, extra=f'[spawn]\non_parent_exit = "{policy}"\n')
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: len(_stray(env)) == 4, 20, "the grandchild")
    wait_until(lambda: Registry(env.home / "run").get("g1"), 20, "the grandchild's entry")
    return parent


def test_kill9_parent_stops_the_tree(tree: Env) -> None:
    parent = _tree_of_two(tree, "stop")
    parent.kill9()
    wait_until(lambda: not _stray(tree), 5, "every pod of the tree to exit")
    assert Registry(tree.home / "run").live() == []


def kill_spawner_mid_child_start(env: Env, extra: str = "", **call: Any) -> PodProcess:
    """A parent whose child s1 is still starting (a SessionStart hook holds the child's
    start-up, its pwd work/s1, until a gate file appears; the parent's does not), kill -9ed
    then; the child is let go on. The dead parent's process object is returned."""
    (env.work / "s1").mkdir()
    quiet_children(env, "s1")
    gate = env.home / "gate"
    hook = env.home / "hold.sh"
    hook.write_text(
        "#!/bin/sh\n"
        'case "$PWD" in */s1) touch starting; '
        f"while [ ! -e {gate} ]; do sleep 0.02; done;; esac\n"
        "echo '{}'\n"
    )
    hook.chmod(0o755)
    env.model.script({"tool_calls": [spawn_call("s1", "work", [str(env.work / "s1")], **call)]})
    parent = start_parent(env, extra=f'[[hooks.SessionStart]]\ncommand = "{hook}"\n{extra}')
    with parent.client() as c:
        c.run("go")
    wait_until(lambda: (env.work / "s1" / "starting").exists(), 20, "the child's start-up")
    parent.kill9()
    gate.touch()
    return parent


def test_kill9_parent_while_its_child_starts_up_stops_the_child(tree: Env) -> None:
    """on_parent_exit = "stop": a spawner kill -9ed while its child was still starting (its
    spawn_pod waiting for the child's READY). The child, finding its spawner dead by the time
    it followed it, took it for one gone before a `podctl restart` and waited for it to come
    back: it ran on for good, holding its area, with nobody to report to."""
    env = tree
    kill_spawner_mid_child_start(env)  # the child gets READY with its spawner gone
    wait_until(lambda: not _stray(env), 20, "the child to stop with its spawner")
    assert Registry(env.home / "run").live() == []


def test_a_spawner_killed_mid_spawn_leaves_no_childs_manifest_once_restored(tree: Env) -> None:
    """The manifest a spawner hands its child (`<data>/pods/.spawn-<name>-<pid>.toml`, the
    child's whole configuration) is removed when spawn_pod returns; a spawner kill -9ed while
    its child started left it for good. Any pod starting up removes such leftovers."""
    env = tree
    parent = kill_spawner_mid_child_start(env)
    wait_until(lambda: not _stray(env), 20, "the child to stop with its spawner")
    env.restart(parent, "--resume")
    assert not list((env.home / "data" / "pods").glob(".spawn-*"))


def test_a_child_taken_back_after_a_kill9_mid_spawn_keeps_its_grant_charged(tree: Env) -> None:
    """A spawner kill -9ed while its detached child (budget_tokens = 80,000 of its 100,000)
    was starting: the child came up holding its grant, and the restored spawner took it back
    with none (its log never got to say `child_started`). It charged the child nothing and
    granted the same 80,000 again: a tree capped at 100,000 could spend 160,000."""
    env = tree
    extra = '[spawn]\non_parent_exit = "detach"\n[budget]\nmax_total_tokens = 100000\n'
    parent = kill_spawner_mid_child_start(env, extra=extra, budget_tokens=80000)
    registry = Registry(env.home / "run")
    wait_until(lambda: registry.get("s1"), 20, "the child's entry")
    (env.work / "s2").mkdir()
    quiet_children(env, "s2")
    again_call = spawn_call("s2", "work", [str(env.work / "s2")], budget_tokens=80000)
    env.model.script({"text": "restored"}, {"tool_calls": [again_call]}, {"text": "done"})
    again = env.restart(parent, "--resume")
    drained(again)
    budget = again.call("status")["budget"]
    assert budget["left"] <= 100000 - 80000, budget
    assert run_and_wait(again, "spawn another")["outcome"] == "finished"
    refused = tool_results(again)[-1]
    assert refused["is_error"] and "cannot grant budget_tokens = 80000" in refused["output"]


def test_stop_pod_of_a_child_that_never_got_its_task_reports_no_error(tree: Env) -> None:
    """A detached child that was starting when its spawner was kill -9ed never got its task;
    the restored spawner takes it back and its model stops it (stop_pod: {stopped: true}).
    With no input it has no log to report `shutdown` from: the spawner then told its model
    the child "died without a final report", `errored`, against what stop_pod said."""
    env = tree
    parent = kill_spawner_mid_child_start(env, extra='[spawn]\non_parent_exit = "detach"\n')
    registry = Registry(env.home / "run")
    wait_until(lambda: registry.get("s1"), 20, "the child's entry")
    env.model.script(
        {"text": "restored"}, {"tool_calls": [tool("stop_pod", pod="s1")]}, {"text": "stopped"}
    )
    again = env.restart(parent, "--resume")
    drained(again)
    assert run_and_wait(again, "stop it")["outcome"] == "finished"
    assert json.loads(tool_results(again)[-1]["output"]) == {"stopped": True}
    entries = lambda: again.call("history", limit=10000)["entries"]  # noqa: E731
    wait_until(lambda: any(e["kind"] == "child_ended" for e in entries()), 20, "the child's end")
    drained(again)
    assert reports(again) == []


def test_a_child_stopped_by_its_spawners_kill9_reports_its_shutdown_on_restore(tree: Env) -> None:
    """A child that stops because its spawner was killed (on_parent_exit = "stop") leaves its
    `shutdown` report, with what it spent, in its log for the restored spawner. It used to
    leave none: the restored spawner told its model the child "errored" and charged it its
    whole grant, for good (a budget used up by crashes, not by work)."""
    env = tree
    call = {"input": 200, "output": 100}
    (env.work / "kid").mkdir()
    env.model.script_model("m-kid", {"text": "kid done", "usage": call})
    env.model.script(
        {"tool_calls": [spawn_call("kid", "a task", [str(env.work / "kid")])], "usage": call},
        {"text": "spawned", "usage": call},
    )
    parent = start_parent(env, extra="[budget]\nmax_total_tokens = 100000\n")
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: _finished_reports(parent, "kid"), 20, "the kid's report")
    parent.kill9()
    registry = Registry(env.home / "run")
    wait_until(lambda: registry.get("kid") is None, 10, "the kid to stop with its spawner")
    again = env.restart(parent, "--resume")
    wait_until(
        lambda: [r for r in reports(again) if r["event_kind"] != "run.finished"],
        20,
        "the kid's end",
    )
    kinds = [r["event_kind"] for r in reports(again) if r["pod"] == "kid"]
    assert kinds == ["run.finished", "shutdown"], kinds
    budget = again.call("status")["budget"]
    assert budget["tree_spent"] == budget["spent"] + 300, budget


def test_a_child_restarted_while_its_spawner_was_down_stops_with_it_later(tree: Env) -> None:
    """on_parent_exit = "stop" still holds for a child restarted (podctl restart) while its
    spawner was down: once the restored spawner has taken it back, a kill -9 of the spawner
    stops it too."""
    env = tree
    parent = _parent_of_one_child(env, "c1")
    wait_until(lambda: _finished_reports(parent, "c1"), 20, "the report")
    parent.kill9()
    registry = Registry(env.home / "run")
    wait_until(lambda: registry.get("c1") is None, 10, "c1 to stop with its spawner")
    out = env.podctl("restart", "c1")
    assert out.returncode == 0, out.stderr
    again = env.restart(parent, "--resume")
    wait_until(
        lambda: [c["name"] for c in again.call("status")["children"]] == ["c1"],
        10,
        "the spawner to take c1 back",
    )
    again.kill9()
    wait_until(lambda: registry.get("c1") is None, 10, "c1 to stop with its spawner again")


def test_kill9_parent_detach_children_keep_running(tree: Env) -> None:
    parent = _tree_of_two(tree, "detach")
    parent.kill9()
    time.sleep(1.5)
    live = {e.name: e for e in Registry(tree.home / "run").live()}
    assert set(live) == {"s1", "s2", "g1"}
    child = PodProcess.__new__(PodProcess)
    child.socket = live["s1"].socket
    done = run_and_wait(child, "still there?")
    assert done["outcome"] == "finished" and done["text"] == "ok: still there?"


def test_stop_tree_three_levels_deepest_first(tree: Env) -> None:
    env = tree
    (env.work / "mid").mkdir()
    (env.work / "mid" / "leaf").mkdir()
    # The middle pod spawns a leaf as its task's first tool call.
    env.model.script_model(
        "m-mid",
        {
            "tool_calls": [
                {
                    "name": "spawn_pod",
                    "arguments": {
                        "name": "leaf",
                        "task": "leaf task",
                        "model": "m-leaf",
                        "scope": [
                            {"target": str(env.work / "mid" / "leaf"), "permission": "write"}
                        ],
                    },
                }
            ]
        },
        {"text": "mid done"},
    )
    env.model.script_model("m-leaf")
    env.model.script(
        {"tool_calls": [spawn_call("mid", "spawn a leaf", [str(env.work / "mid")])]},
        {"text": "spawned"},
    )
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: Registry(env.home / "run").get("leaf") is not None, 30, "the leaf")
    ls = env.podctl("ls")
    assert ls.returncode == 0
    rows = [line for line in ls.stdout.splitlines()[1:] if line.strip()]
    names = [r.split()[0] if not r.startswith(" ") else r.strip().split()[0] for r in rows]
    assert [n.strip("└─├│ ") for n in names][:3] == ["parent", "mid", "leaf"], ls.stdout
    out = env.podctl("stop", "--tree", "parent")
    assert out.returncode == 0, out.stderr
    stopped = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("stopped")]
    assert stopped == ["leaf", "mid", "parent"], out.stdout
    assert Registry(env.home / "run").live() == []
    assert not _stray(env)


def test_stop_tree_of_a_crashed_root_stops_its_detached_descendants(tree: Env) -> None:
    """A detached tree whose root crashed: `podctl stop --tree ROOT` said the root was not
    running (exit 3) and stopped nothing, though `podctl ls` shows its children under it and
    they run on, holding their areas. Its descendants are stopped, deepest first; the root's
    own answer stays "not running"."""
    env = tree
    parent = _tree_of_two(env, "detach")
    parent.kill9()
    stopped = env.podctl("stop", "--tree", "parent")
    assert stopped.returncode == 3, stopped.stderr
    assert "not running" in stopped.stderr
    lines = stopped.stdout.splitlines()
    assert sorted(lines) == ["stopped g1", "stopped s1", "stopped s2"], lines
    assert lines.index("stopped g1") < lines.index("stopped s1")  # deepest first
    assert not _stray(env)
    assert Registry(env.home / "run").live() == []


def test_stop_tree_stops_a_descendant_that_cannot_answer_and_names_one_that_stays(
    tree: Env,
) -> None:
    """A child that cannot answer (SIGSTOP) while its parent stops, children detached, is
    stopped by its registered pid (SIGTERM, then SIGCONT). A descendant whose process does not
    stop even so is named, and `stop --tree` exits 1 (it exited 0)."""
    env = tree
    parent = _detached_parent_of(env, "stuck")
    child = Registry(env.home / "run").get("stuck")
    assert child is not None
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & wait"])
    try:
        entry = make_entry(
            "stubborn", "/nowhere/sock", Scope(allow=(), deny=()), parent="stuck", pid=stubborn.pid
        )
        Registry(env.home / "run").register(entry)
        os.kill(child.pid, signal.SIGSTOP)
        try:
            out = env.podctl("stop", "--tree", "parent")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGCONT)
        assert out.returncode == 1, (out.stdout, out.stderr)
        assert out.stdout.splitlines() == ["stopped stuck", "stopped parent"]
        assert f"sent SIGTERM to pid {child.pid}" in out.stderr
        assert "1 descendant(s) still running: 'stubborn'" in out.stderr
        assert [e.name for e in Registry(env.home / "run").live()] == ["stubborn"]
        assert parent.proc.wait(10) == 0
    finally:
        stubborn.kill()
        stubborn.wait()


def test_stop_tree_stops_every_branch_deepest_first(tree: Env) -> None:
    """SPEC §9: "deepest first" across branches. `root` has a leaf `a` and a branch `b` with
    its own child `b1`: `stop --tree` stopped each child's subtree in turn (a, b1, b), so `a`
    stopped while `b1`, deeper, still ran. The whole tree is walked first now."""
    env = tree
    tree_of = {"root": None, "a": "root", "b": "root", "b1": "b"}
    procs = {n: subprocess.Popen(["sleep", "60"], start_new_session=True) for n in tree_of}
    try:
        registry = Registry(env.home / "run")
        none = Scope(allow=(), deny=())
        for name, parent in tree_of.items():
            entry = make_entry(name, "/nowhere/sock", none, parent=parent, pid=procs[name].pid)
            registry.register(entry)
        out = env.podctl("stop", "--tree", "root")
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert out.stdout.splitlines() == ["stopped b1", "stopped a", "stopped b", "stopped root"]
        assert registry.live() == []
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_stop_tree_of_pods_whose_parents_form_a_cycle_stops_both(tree: Env) -> None:
    """Two registered processes naming each other parent (a registry not written by a real
    spawn, or names reused after their pods went): `stop --tree` recursed from one to the
    other until RecursionError, a traceback and nothing stopped."""
    env = tree
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    try:
        registry = Registry(env.home / "run")
        for (name, parent), proc in zip((("ca", "cb"), ("cb", "ca")), procs, strict=True):
            none = Scope(allow=(), deny=())
            registry.register(make_entry(name, "/nowhere/sock", none, parent=parent, pid=proc.pid))
        out = env.podctl("stop", "--tree", "ca")
        assert "Traceback" not in out.stderr, out.stderr
        assert out.returncode == 0, (out.stdout, out.stderr)
        assert out.stdout.splitlines() == ["stopped cb", "stopped ca"]
        assert registry.live() == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_stopped_leaf_does_not_make_ls_call_its_answering_ancestors_unresponsive(
    tree: Env,
) -> None:
    """A spawner's `status` asks its children for theirs; it waited as long for a stopped one
    as `podctl ls` waits for the spawner, so the healthy spawner was listed `unresponsive`."""
    env = tree
    _parent_mid_leaf(env, {"text": "spawned"})
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: Registry(env.home / "run").get("leaf") is not None, 30, "the leaf")
    leaf = Registry(env.home / "run").get("leaf")
    assert leaf is not None
    # Serving: stopped after its claim but before it listens, it is `starting` (CI caught it).
    wait_until(lambda: env.podctl("status", "leaf").returncode == 0, 30, "the leaf to answer")
    os.kill(leaf.pid, signal.SIGSTOP)
    try:
        listed = env.podctl("ls", "--json")
    finally:
        os.kill(leaf.pid, signal.SIGCONT)
    assert listed.returncode == 0, listed.stderr
    states = {st["name"]: st["state"] for st in json.loads(listed.stdout)}
    assert states["leaf"] == "unresponsive", states
    assert "unresponsive" not in (states["parent"], states["mid"]), states  # mid may still run


def _parent_mid_leaf(env: Env, *then: dict[str, Any]) -> None:
    """Script a tree of three: the parent spawns mid (work/mid), which spawns leaf
    (work/mid/leaf); then the parent's model answers `then`."""
    (env.work / "mid" / "leaf").mkdir(parents=True)
    env.model.script_model(
        "m-mid",
        {"tool_calls": [spawn_call("leaf", "leaf task", [str(env.work / "mid" / "leaf")])]},
        {"text": "mid done"},
    )
    env.model.script_model("m-leaf")
    env.model.script(
        {"tool_calls": [spawn_call("mid", "spawn a leaf", [str(env.work / "mid")])]}, *then
    )


def test_stop_pod_stops_the_childs_subtree_under_detach(tree: Env) -> None:
    """`stop_pod` stops the child's own subtree too (SPEC §9), even where on_parent_exit =
    "detach" lets a stopping pod's children run on."""
    env = tree
    _parent_mid_leaf(
        env,
        {"tool_calls": [tool("wait_pods", pods=["mid"], timeout_s=30)]},
        {"tool_calls": [tool("stop_pod", pod="mid")]},
        {"text": "stopped"},
    )
    parent = start_parent(env, extra='[spawn]\non_parent_exit = "detach"\n')
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    stopped = [r for r in tool_results(parent) if r["name"] == "stop_pod"]
    assert stopped and not stopped[0]["is_error"], stopped
    assert {e.name for e in Registry(env.home / "run").live()} == {"parent"}
    assert len(_stray(env)) == 1


@pytest.mark.parametrize("first", ["parent", "leaf"])
def test_a_tree_whose_registry_went_registers_again_in_any_order(tree: Env, first: str) -> None:
    """pods.json removed while the middle pod of a tree cannot act (SIGSTOP): the root and the
    grandchild register again without it, in either order. The root keeps its live child's
    area delegated, so the grandchild's claim inside it is no stranger's (it stopped the
    whole tree: 'scope conflict' with its own grandchild)."""
    env = tree
    _parent_mid_leaf(env, {"text": "spawned"})
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    registry = Registry(env.home / "run")
    everyone = {"parent", "mid", "leaf"}
    wait_until(lambda: {e.name for e in registry.live()} == everyone, 30, "the tree")
    wait_until(lambda: all(e.session for e in registry.live()), 30, "every session named")
    pids = {e.name: e.pid for e in registry.live()}
    other = "leaf" if first == "parent" else "parent"
    # A pod stopped while it holds the registry's lock keeps everyone out of it for as long as
    # it is stopped (CI twice stopped the leaf inside a transaction, after waiting for it to
    # be done). Stopped while we hold the lock, neither can be: filelock polls for it, and a
    # stopped process does not take it until it is continued.
    with filelock.FileLock(registry.lock_path, timeout=20):
        os.kill(pids["mid"], signal.SIGSTOP)
        os.kill(pids[other], signal.SIGSTOP)  # `first` registers again first
        wait_until(lambda: _stopped(pids["mid"]) and _stopped(pids[other]), 10, "both stopped")
    try:
        (env.home / "run" / "pods.json").unlink()
        wait_until(lambda: registry.get(first) is not None, 20, f"{first} back")
        os.kill(pids[other], signal.SIGCONT)
        wait_until(lambda: registry.get(other) is not None, 20, f"{other} back")
    finally:
        for name in ("mid", other):
            os.kill(pids[name], signal.SIGCONT)
    wait_until(lambda: {e.name for e in registry.live()} == everyone, 20, "the whole tree back")
    assert {e.name: e.pid for e in registry.live()} == pids
    # Alive and well: it goes idle (a report of mid's, late for the stops, may wake a turn).
    drained(parent)
    assert str(env.work / "mid") in (registry.get("parent") or registry.live()[0]).delegated


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


# --- budget ----------------------------------------------------------------------------------


def test_tree_spent_counts_a_live_childs_runs_the_parent_did_not_ask_for(tree: Env) -> None:
    """Reports tell the parent of the runs it sent; a run someone else sends its child spends
    too, and status (and list_pods) said the tree spent less than it had."""
    env = tree
    call = {"input": 200, "output": 100}
    (env.work / "kid").mkdir()
    env.model.script_model(
        "m-kid", {"text": "task done", "usage": call}, {"text": "extra", "usage": call}
    )
    env.model.script(
        {"tool_calls": [spawn_call("kid", "a task", [str(env.work / "kid")])], "usage": call},
        {"text": "spawned", "usage": call},
    )
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: len(reports(parent)) == 1, 30, "the kid's report")
    kid = Registry(env.home / "run").get("kid")
    assert kid is not None
    with PodClient.connect(kid.socket, timeout=30) as c:
        assert c.run_wait("a run the parent never sent").outcome == "finished"
        kid_spent = c.status().budget.tree_spent
    st = parent.call("status")
    assert kid_spent == 600
    assert st["budget"]["tree_spent"] == st["budget"]["spent"] + kid_spent


def test_a_child_that_stops_before_its_busy_child_is_charged_what_that_one_may_spend(
    tree: Env,
) -> None:
    """`podctl stop` of a middle pod: it reports its shutdown (with its tree's spending) and
    only then stops its own child, which is mid-run and has spent part of its grant without a
    report yet. The shutdown report counted that grandchild at its last report (nothing), so
    the root charged the middle pod far less than its tree spent, took the rest of the grant
    back and could hand it out again: the tree went past its cap by a whole grant."""
    env = tree
    call = {"input": 200, "output": 100}
    (env.work / "mid" / "gc").mkdir(parents=True)
    env.model.script_model(
        "m-mid",
        {
            "tool_calls": [
                spawn_call("gc", "spend", [str(env.work / "mid" / "gc")], budget_tokens=900)
            ],
            "usage": call,
        },
        {"text": "mid done", "usage": call},
    )
    # Two calls spent, the third never answered: the run (and its report) never ends.
    env.model.script_model(
        "m-gc",
        *[{"tool_calls": [tool("list_dir", path=".")], "usage": call}] * 2,
        {"text": "never", "gate": "never"},
    )
    env.model.script(
        {
            "tool_calls": [spawn_call("mid", "go", [str(env.work / "mid")], budget_tokens=2000)],
        },
        {"text": "spawned"},
    )
    parent = start_parent(env, extra="[budget]\nmax_total_tokens = 10000\n")
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: len(model_saw(env, "m-gc")) == 3, 30, "gc's third call")
    assert env.podctl("stop", "mid").returncode == 0
    wait_until(lambda: not parent.call("status")["children"], 30, "mid's end")
    wait_until(lambda: Registry(env.home / "run").get("gc") is None, 30, "gc's end")
    spent_below = 300 * (len(model_saw(env, "m-mid")) + 2)  # gc's third call was never answered
    st = parent.call("status")["budget"]
    assert st["tree_spent"] - st["spent"] >= spent_below, (st, spent_below)


def test_a_child_restarted_after_a_crash_counts_what_it_spent_not_its_whole_grant(
    tree: Env,
) -> None:
    """A child killed -9 is charged its whole grant (it may have spent it). Restarted
    (`podctl restart`), it is back and says what its tree really spent; the spawner kept
    the whole grant as its spending for good: status said the tree spent thousands of tokens
    more than it had, and the grant was never given back when the child ended."""
    env = tree
    call = {"input": 200, "output": 100}
    cap, grant = 100_000, 5000
    (env.work / "kid").mkdir()
    env.model.script_model("m-kid", {"text": "task done", "usage": call})
    env.model.script(
        {
            "tool_calls": [
                spawn_call("kid", "a task", [str(env.work / "kid")], budget_tokens=grant)
            ],
            "usage": call,
        },
        {"text": "spawned", "usage": call},
    )
    parent = start_parent(env, extra=f"[budget]\nmax_total_tokens = {cap}\n")
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: _finished_reports(parent, "kid"), 30, "the kid's report")
    _kill_and_see_it_gone(env, parent, "kid")
    assert env.podctl("restart", "kid").returncode == 0
    wait_until(lambda: parent.call("status")["children"], 20, "the kid taken back")
    drained(parent)
    st = parent.call("status")["budget"]
    assert st["tree_spent"] == st["spent"] + 300, st  # the kid's one call
    assert st["left"] == cap - st["spent"] - grant, st  # its grant still reserved
    assert parent.stop() == 0  # the kid stops first, reporting what it spent
    again = env.restart(parent, "--resume")
    st = again.call("status")["budget"]
    assert st["tree_spent"] - st["spent"] == 300, st
    assert st["left"] == cap - st["tree_spent"], st


def test_a_child_restarted_after_its_grant_was_spent_elsewhere_is_stopped(tree: Env) -> None:
    """`podctl restart` of a child that ended: its grant had gone back to the spawner, which
    spent it since; the child came back with its whole grant, charged again, and the tree
    spent 1,600 tokens under a cap of 1,000 (found by QA). The spawner stops such a child."""
    env = tree
    call = {"input": 80, "output": 20}  # 100 tokens each
    cap, grant = 1000, 600
    (env.work / "kid").mkdir()
    env.model.script_model("m-kid", {"text": "kid done", "usage": {"input": 40, "output": 10}})
    env.model.script(  # one run: spawn, wait, stop it (its grant comes back), spend it
        {
            "tool_calls": [
                spawn_call("kid", "a task", [str(env.work / "kid")], budget_tokens=grant)
            ],
            "usage": call,
        },
        {"tool_calls": [tool("wait_pods", pods=["kid"], timeout_s=30)], "usage": call},
        {"tool_calls": [tool("stop_pod", pod="kid")], "usage": call},
        {"text": "thinking hard", "usage": {"input": 300, "output": 100}},
    )
    parent = start_parent(env, extra=f"[budget]\nmax_total_tokens = {cap}\n")
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    drained(parent)
    before = parent.call("status")["budget"]
    assert before["left"] < grant, before  # the kid's grant was given back, and spent
    assert env.podctl("restart", "kid").returncode == 0
    wait_until(lambda: Registry(env.home / "run").get("kid") is None, 20, "the kid stopped")
    drained(parent)
    assert parent.call("status")["children"] == []
    after = parent.call("status")["budget"]
    # The kid counts what it spent, not its grant again (the reports that come woke the
    # parent: its own spending may grow meanwhile, by the one call a run may overspend).
    assert after["tree_spent"] - after["spent"] == before["tree_spent"] - before["spent"] == 50
    assert "child pod 'kid' was started again, but the 600 tokens granted to it" in parent.text()


def test_tree_budget_stays_under_the_cap(tree: Env) -> None:
    env = tree
    cap = 3000
    call = {"input": 200, "output": 100}
    for n in ("b1", "b2"):
        (env.work / n).mkdir()
        # Children keep calling the model (a tool call each round) until their grant is spent.
        env.model.script_model(
            f"m-{n}", *[{"tool_calls": [tool("list_dir", path=".")], "usage": call}] * 40
        )
    env.model.script(
        {
            "tool_calls": [
                spawn_call("b1", "spend", [str(env.work / "b1")], budget_tokens=1000),
                spawn_call("b2", "spend", [str(env.work / "b2")], budget_tokens=1000),
            ],
            "usage": call,
        },
        *[{"tool_calls": [tool("list_dir", path=".")], "usage": call}] * 40,
    )
    parent = start_parent(env, extra=f"[budget]\nmax_total_tokens = {cap}\n")
    result = run_and_wait(parent, "go")
    assert result["outcome"] == "limit_reached", result
    wait_until(
        lambda: len([r for r in reports(parent) if r["event_kind"] == "run.finished"]) == 2,
        30,
        "both children's reports",
    )
    outcomes = {
        r["pod"]: r["outcome"] for r in reports(parent) if r["event_kind"] == "run.finished"
    }
    assert outcomes == {"b1": "limit_reached", "b2": "limit_reached"}
    total = sum(300 for r in env.model.requests)  # every call cost 300 tokens
    per_call = 300
    assert total <= cap + 3 * per_call, (total, cap)
    st = parent.call("status")
    assert st["budget"]["limit"] == cap
    assert st["budget"]["tree_spent"] >= st["budget"]["spent"] + 1000
    # A new run is refused: -32007.
    with PodClient.connect(parent.socket, timeout=10) as c, pytest.raises(RpcError) as err:
        c.run("more")
    assert err.value.code == -32007


# --- failures leave nothing behind -------------------------------------------------------------


def test_spawn_failures_leave_nothing_behind(tree: Env) -> None:
    env = tree
    (env.work / "ok").mkdir()
    (env.work / "sib").mkdir()
    quiet_children(env, "ok", "sib", "x1", "x2", "x3", "x4", "parent")
    outside = Path("/tmp")
    env.model.script(
        {
            "tool_calls": [
                spawn_call("ok", "fine", [str(env.work / "ok")]),
                spawn_call("parent", "name taken", [str(env.work / "sib")]),
                spawn_call("x1", "outside", [str(outside)]),
                spawn_call("x2", "overlaps a sibling", [str(env.work / "ok" / "inner")]),
                spawn_call("x4", "contains a sibling's area", [str(env.work)]),
                spawn_call(
                    "x3",
                    "dies at start",
                    [str(env.work / "sib")],
                    instruction="{{ undefined_function() }}",
                ),
                spawn_call("x5", " \n", [str(env.work / "sib")]),
                spawn_call("x6", "writes where we only read", [str(env.home / "ro")]),
            ]
        },
        {"text": "done"},
    )
    (env.home / "ro").mkdir()
    parent = start_parent(env, write=[str(env.work)], read=[str(env.home / "ro")])
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    results = [r for r in tool_results(parent) if r["name"] == "spawn_pod"]
    assert not results[0]["is_error"], results[0]
    errs = [r["output"] for r in results[1:]]
    assert all(r["is_error"] for r in results[1:]), results
    assert "already running" in errs[0], errs[0]
    assert "not inside this pod's scope" in errs[1], errs[1]
    assert "delegated to another child" in errs[2], errs[2]
    assert "scope conflict: pod 'ok'" in errs[3], errs[3]  # the child's own message
    assert "child pod failed to start" in errs[4] and "undefined" in errs[4], errs[4]
    assert ".spawn-" not in errs[4]  # no name of the child's manifest: gone when it is read
    assert "the task is empty" in errs[5], errs[5]
    assert "(outside: it has read)" in errs[6], errs[6]  # nothing was delegated there
    live = {e.name for e in Registry(env.home / "run").live()}
    assert live == {"parent", "ok"}
    assert len(_stray(env)) == 2
    pods_dir = env.home / "run" / "pods"
    for n in ("x1", "x2", "x3", "x4", "x5"):
        assert not (pods_dir / n / "sock").exists()
    assert not list((env.home / "data" / "pods").glob(".spawn-*"))


def test_a_child_stopped_because_its_task_was_refused_is_not_reported_errored(
    tree: Env,
) -> None:
    """The child's UserPromptSubmit hook (its spawner's) refuses its task: spawn_pod fails with
    the hook's reason and the spawner stops the child. Stopped before its first input, the
    child has no log to report `shutdown` from: its spawner reported it `errored`, "died
    without a final report", a second, false account that woke its model once more."""
    env = tree
    (env.work / "s1").mkdir()
    quiet_children(env, "s1")
    hook = env.home / "prompt.sh"
    hook.write_text("#!/bin/sh\nif grep -q forbidden; then echo 'no such tasks' >&2; exit 2; fi\n")
    hook.chmod(0o755)
    env.model.script(
        {"tool_calls": [spawn_call("s1", "forbidden work", [str(env.work / "s1")])]},
        {"text": "done"},
    )
    parent = start_parent(env, extra=f'[[hooks.UserPromptSubmit]]\ncommand = "{hook}"\n')
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    (result,) = [r for r in tool_results(parent) if r["name"] == "spawn_pod"]
    assert result["is_error"] and "no such tasks" in result["output"], result
    entries = lambda: parent.call("history", limit=10000)["entries"]  # noqa: E731
    wait_until(lambda: any(e["kind"] == "child_ended" for e in entries()), 20, "the child's end")
    drained(parent)
    assert reports(parent) == []
    assert Registry(env.home / "run").get("s1") is None


def test_a_child_killed_before_it_takes_its_task_is_not_said_to_refuse_it(tree: Env) -> None:
    """The child dies (kill -9) while its UserPromptSubmit hook decides its task: spawn_pod
    fails, saying it did not take its task, where it said it "refused" it (a refusal is the
    child's own answer, as a hook's exit 2)."""
    env = tree
    (env.work / "s1").mkdir()
    hook = env.home / "prompt.sh"
    hook.write_text('#!/bin/sh\ncase "$PWD" in */s1) touch deciding; sleep 30;; esac\n')
    hook.chmod(0o755)
    env.model.script(
        {"tool_calls": [spawn_call("s1", "work", [str(env.work / "s1")])]}, {"text": "done"}
    )
    parent = start_parent(env, extra=f'[[hooks.UserPromptSubmit]]\ncommand = "{hook}"\n')
    with parent.client() as c:
        c.run("go")
    wait_until(lambda: (env.work / "s1" / "deciding").exists(), 20, "the child's hook")
    entry = Registry(env.home / "run").get("s1")
    assert entry is not None
    os.kill(entry.pid, signal.SIGKILL)
    drained(parent)
    (result,) = [r for r in tool_results(parent) if r["name"] == "spawn_pod"]
    assert result["is_error"], result
    assert "child pod 's1' did not take its task" in result["output"], result


def test_a_spawn_cancelled_while_the_fork_server_starts_leaves_no_child(tree: Env) -> None:
    """The run is cancelled while the first spawn starts the fork server (the fork runs in a
    thread, which goes on): the child it forks for nobody is stopped, not left running with
    its share of the scope. A second spawn, forked after it by the same server, shows the
    server got that far."""
    env = tree
    (env.work / "c1").mkdir()
    (env.work / "c2").mkdir()
    quiet_children(env, "c1", "c2")
    env.model.script({"tool_calls": [spawn_call("c1", "never told", [str(env.work / "c1")])]})
    parent = start_parent(env, write=[str(env.work)])
    assert not list((env.home / "run").glob("forkserver.*.sock"))
    run_id = parent.call("run", input="go")["run_id"]

    def spawning() -> bool:
        entries = parent.call("history", limit=100)["entries"]
        return any(e["kind"] == "assistant" and "spawn_pod" in json.dumps(e) for e in entries)

    wait_until(spawning, what="the spawn_pod call")
    parent.call("cancel", run_id=run_id)
    env.model.script(
        {"tool_calls": [spawn_call("c2", "work", [str(env.work / "c2")])]}, {"text": "done"}
    )
    assert run_and_wait(parent, "again")["outcome"] == "finished"
    registry = Registry(env.home / "run")
    wait_until(lambda: registry.get("c1") is None, what="c1 gone from the registry")
    assert {e.name for e in registry.live()} == {"parent", "c2"}
    assert len(_stray(env)) == 2


def test_a_child_gets_no_deeper_scope_than_its_spawner(tree: Env) -> None:
    """SPEC §9: a child's scope lies inside its spawner's. A spawner whose rule is not
    recursive (its pwd and what lies directly in it) cannot hand out a recursive rule on one
    of those children: the child could reach what lies deeper, which the spawner cannot."""
    env = tree
    deep = env.work / "a" / "deep"
    deep.mkdir(parents=True)
    (deep / "secret.txt").write_text("not for the tree\n")
    a = str(env.work / "a")
    quiet_children(env, "r1", "r2", "r3")
    env.model.script(
        {
            "tool_calls": [
                tool("read_file", path=str(deep / "secret.txt")),
                spawn_call("r1", "write below", [a]),
                {
                    "name": "spawn_pod",
                    "arguments": {
                        "name": "r2",
                        "task": "read below",
                        "scope": [{"target": a, "permission": "read"}],
                        "model": "m-r2",
                    },
                },
                {
                    "name": "spawn_pod",
                    "arguments": {
                        "name": "r3",
                        "task": "one level",
                        "scope": [{"target": a, "permission": "read", "recursive": False}],
                        "model": "m-r3",
                    },
                },
            ]
        },
        {"text": "done"},
    )
    manifest = env.manifest("parent", tools=POD_TOOLS)
    text = manifest.read_text().replace(
        'permission = "write"', 'permission = "write"\nrecursive = false'
    )
    manifest.write_text(text)
    parent = PodProcess(env.popen(str(manifest)), "parent")
    env.pods.append(parent)
    parent.wait_ready()
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    own, *children = tool_results(parent)
    assert own["is_error"] and "outside scope" in own["output"]  # the spawner cannot read it
    assert len(children) == 3
    for refused in children:
        assert refused["is_error"] and "not inside this pod's scope" in refused["output"], refused
    assert {e.name for e in Registry(env.home / "run").live()} == {"parent"}


def test_max_children_counts_live_children_and_max_depth_is_enforced(tree: Env) -> None:
    env = tree
    for d in ("l1", "l2"):
        (env.work / d).mkdir()
    # l1's own spawn attempt: its max_depth is its spawner's (1) minus one.
    env.model.script_model(
        "m-l1",
        {"tool_calls": [spawn_call("deep", "x", [str(env.work / "l1" / "deep")])]},
        {"text": "l1 done"},
    )
    env.model.script_model("m-l2")
    env.model.script(
        {
            "tool_calls": [
                spawn_call("l1", "try to spawn", [str(env.work / "l1")]),
                spawn_call("l2", "one too many", [str(env.work / "l2")]),
            ]
        },
        {
            "tool_calls": [
                tool("wait_pods", timeout_s=30),
                tool("stop_pod", pod="l1"),
                spawn_call("l2", "now there is room", [str(env.work / "l2")]),
            ]
        },
        {"tool_calls": [tool("list_pods")]},
        {"text": "done"},
    )
    parent = start_parent(env, extra="[spawn]\nmax_children = 1\nmax_depth = 1\n")
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    results = tool_results(parent)
    spawns = [r for r in results if r["name"] == "spawn_pod"]
    assert not spawns[0]["is_error"]
    assert spawns[1]["is_error"] and "max_children = 1" in spawns[1]["output"]
    assert not spawns[2]["is_error"], spawns[2]  # l1 stopped: it no longer counts
    waited = json.loads(next(r for r in results if r["name"] == "wait_pods")["output"])
    assert waited["l1"]["outcome"] == "finished" and waited["l1"]["text"] == "l1 done"
    listed = json.loads(next(r for r in results if r["name"] == "list_pods")["output"])
    states = {c["name"]: c["state"] for c in listed}
    assert states["l1"] == "stopped" and states["l2"] in ("running", "idle"), states
    assert any("max_depth" in b for b in model_saw(env, "m-l1"))
    assert Registry(env.home / "run").get("deep") is None


# --- the spawner's commands lose the delegated area too (when the sandbox confines them) -------


def test_delegation_reaches_the_spawners_commands() -> None:
    import asyncio
    import tempfile

    from poddaemon.sandbox import available, build_policy
    from poddaemon.scope import Scope
    from poddaemon.tools import ToolContext, execute

    if not available():
        pytest.skip("no Landlock here")
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        base = Path(os.path.realpath(d))
        (base / "work" / "kid").mkdir(parents=True)
        (base / "tmp").mkdir()
        granted = Scope.from_config([("work", "write", True)], cwd=str(base))
        live = {"scope": granted}

        class Live:
            def check(self, path: str, want: Any, cwd: str) -> str:
                return live["scope"].check(path, want, cwd)

            def access(self, path: str) -> Any:
                return live["scope"].access(path)

        def policy() -> bytes:
            p = build_policy(live["scope"], pwd=str(base / "work"), tmpdir=str(base / "tmp"))
            return p.encode()

        ctx = ToolContext(scope=Live(), pwd=str(base / "work"), policy_for_scope=policy)
        ctx.sandbox_policy = policy()
        cmd = json.dumps({"command": "echo x > kid/f && echo wrote"})

        async def go() -> list[str]:
            out = [(await execute("bash", cmd, ctx)).output]
            live["scope"] = granted.with_delegated([str(base / "work" / "kid")])
            ctx.scope_changed()  # what Children._refresh_scope does
            out.append((await execute("bash", cmd, ctx)).output)
            live["scope"] = granted  # the child's entry went: the area comes back
            ctx.scope_changed()
            out.append((await execute("bash", cmd, ctx)).output)
            await ctx.aclose()
            return out

        before, during, after = asyncio.run(go())
    assert "wrote" in before
    assert "wrote" not in during and "denied" in during.lower(), during
    assert "wrote" in after


def test_stopping_the_parent_stops_its_children_first(tree: Env) -> None:
    parent = _tree_of_two(tree, "stop")
    assert parent.stop() == 0  # a requested shutdown: exit 0
    wait_until(lambda: not _stray(tree), 10, "every pod of the tree to exit")
    assert Registry(tree.home / "run").live() == []


def test_podctl_stop_of_a_spawner_with_a_wedged_child_succeeds(tree: Env) -> None:
    """A child that cannot answer `shutdown` (SIGSTOPped, wedged) was waited for 20 s more
    before its spawner sent it SIGTERM: `podctl stop` of the spawner gave up after its 10 s
    and exited 1 ("did not stop"), though the spawner went later (`stop && spawn` failed)."""
    env = tree
    parent = _parent_of_one_child(env, "w1")
    child = Registry(env.home / "run").get("w1")
    assert child is not None
    os.kill(child.pid, signal.SIGSTOP)
    done = env.podctl("stop", "parent")
    assert done.returncode == 0, done.stderr
    assert parent.proc.wait(10) == 0
    wait_until(lambda: not _stray(env), 10, "the wedged child to be gone")
    assert Registry(env.home / "run").live() == []


def test_a_stopped_spawner_keeps_the_reports_its_children_made_as_they_stopped(tree: Env) -> None:
    """`podctl stop` of a spawner (on_parent_exit = "stop"): its child, stopped mid-task,
    reports its run's end and its shutdown as it goes. The spawner used to note only the
    child's end and drop those reports (delivery is refused while stopping, and once the end
    is noted the child's log is never read again): its model never learned the task was cut
    off. They are in its log now, and reach its model when it is restored."""
    env = tree
    parent = _parent_of_a_busy_kid(env, "k7")
    assert parent.stop() == 0
    wait_until(lambda: not _stray(env), 10, "every pod of the tree to exit")
    again = env.restart(parent, "--resume")
    kinds = [(r["event_kind"], r.get("outcome")) for r in reports(again) if r["pod"] == "k7"]
    assert ("run.finished", "error") in kinds and ("shutdown", None) in kinds, kinds
    wait_until(  # (the spawner's own log holds no "interrupted": it stopped cleanly)
        lambda: any("interrupted" in b for b in model_saw(env, "fake-model")[2:]),
        20,
        "the restored spawner's model to hear of it",
    )


def _kid_under_landlock(env: Env) -> Path:
    """work/kid, for a child `kid` whose model (m-kid) answers at once; skips without Landlock
    (these tests are about what the kernel enforces)."""
    from poddaemon.sandbox import available

    if not available():
        pytest.skip("no Landlock here")
    kid = env.work / "kid"
    kid.mkdir()
    env.model.script_model("m-kid")
    return kid


def test_a_real_spawners_bash_loses_the_delegated_area(tree: Env) -> None:
    """With the sandbox confining commands: the spawner's `bash` cannot write into a live
    child's area, and can again once the child stopped."""
    env = tree
    kid = _kid_under_landlock(env)
    write = tool("bash", command="echo x > kid/f && echo wrote")
    env.model.script(
        {"tool_calls": [spawn_call("kid", "hi", [str(kid)]), write]},
        {"tool_calls": [tool("stop_pod", pod="kid"), write]},
        {"text": "done"},
    )
    parent = start_parent(env, tools=[*POD_TOOLS, "bash"])
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    outputs = [r["output"] for r in tool_results(parent) if r["name"] == "bash"]
    # Read-only in the runner's view (its mount namespace), or denied by Landlock without one.
    refused = "read-only file system" in outputs[0].lower() or "denied" in outputs[0].lower()
    assert "wrote" not in outputs[0] and refused, outputs
    assert "wrote" in outputs[1], outputs


def test_the_spawners_status_says_what_its_commands_can_still_do_in_a_delegated_area(
    tree: Env,
) -> None:
    """Landlock cannot subtract from an allowed tree: the spawner's commands can still create,
    remove and rename entries in its child's area (file contents are protected). The same
    rule written as a manifest deny is noted in `status`; a delegated one was not (the notes
    were the start's)."""
    env = tree
    kid = _kid_under_landlock(env)
    env.model.script({"tool_calls": [spawn_call("kid", "hi", [str(kid)])]}, {"text": "done"})
    parent = start_parent(env, tools=[*POD_TOOLS, "bash"])
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    note = f"{kid}: denied, but entries inside it can still be created, removed or renamed"
    assert any(n.startswith(note) for n in parent.call("status")["sandbox_notes"])
    with parent.client() as c:
        env.model.script({"tool_calls": [tool("stop_pod", pod="kid")]}, {"text": "stopped"})
        assert c.run_wait("stop it").outcome == "finished"

    def given_back() -> bool:
        return not any(str(kid) in n for n in parent.call("status")["sandbox_notes"])

    wait_until(given_back, 10, "the note to go with the delegation")


def test_a_childs_bash_is_confined_to_its_delegated_area(tree: Env) -> None:
    """The escape suite's core through a child pod's own `bash`: its commands run in a domain
    built from the child's scope (inside the spawner's), so the rest of the spawner's tree, the
    session logs and the registry are out of reach; its own area works."""
    from poddaemon.sandbox import available

    if not available():
        pytest.skip("no Landlock here")
    env = tree
    kid = env.work / "kid"
    kid.mkdir()
    (env.work / "parents.txt").write_text("the spawner's own file\n")
    attacks = [
        f"echo x > {env.work}/escaped.txt",
        f"cat {env.work}/parents.txt",
        f"cat {env.home}/data/sessions/*.jsonl",
        f"echo '{{}}' > {env.home}/run/pods.json",
    ]
    calls = [tool("bash", command=f"{c}; echo STATUS=$?") for c in attacks]
    calls.append(tool("bash", command=f"echo mine > {kid}/ok.txt && cat {kid}/ok.txt"))
    env.model.script_model("m-kid", {"tool_calls": calls}, {"text": "kid done"})
    env.model.script(
        {"tool_calls": [spawn_call("kid", "try", [str(kid)], tools=["bash"])]},
        {"tool_calls": [tool("wait_pods", pods=["kid"], timeout_s=30)]},
        {"text": "done"},
    )
    # A child gets no tool its spawner lacks.
    parent = start_parent(env, tools=[*POD_TOOLS, "bash"])
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    wait_until(lambda: (kid / "ok.txt").exists(), 20, "the child's own write")
    seen = wait_until(
        lambda: [b for b in model_saw(env, "m-kid") if "kid done" not in b and "STATUS=" in b],
        20,
        "the child's bash results",
    )
    body = seen[-1]
    assert body.count("STATUS=0") == 0, body
    assert "the spawner's own file" not in body and not (env.work / "escaped.txt").exists()
    assert json.loads((env.home / "run" / "pods.json").read_text()) != {}
    assert (kid / "ok.txt").read_text() == "mine\n"


def test_children_are_forked_by_the_fork_server_and_share_it(tree: Env) -> None:
    """A tree's pods come from one fork server (started by the spawner): the SDK and the pod's
    modules are one copy for all of them. The grandchild's spawner is a forked pod itself."""
    _tree_of_two(tree, "stop")
    (lock,) = (tree.home / "run").glob("forkserver.*.lock")
    server = int(lock.read_text())
    registry = Registry(tree.home / "run")
    for name in ("s1", "s2", "g1"):
        entry = registry.get(name)
        assert entry is not None and ppid(entry.pid) == server, name


def test_a_unit_pods_children_are_execd_into_its_cgroup(tree: Env) -> None:
    """Under systemd (INVOCATION_ID set) children stay the spawner's own processes: they are in
    its unit's cgroup, and stopping the unit stops them."""
    tree.env["INVOCATION_ID"] = "0123456789abcdef0123456789abcdef"
    parent = _tree_of_two(tree, "stop")
    registry = Registry(tree.home / "run")
    for name in ("s1", "s2"):
        entry = registry.get(name)
        assert entry is not None and ppid(entry.pid) == parent.proc.pid, name
    assert not list((tree.home / "run").glob("forkserver.*"))


# Run itself, or by an interpreter (then it need not be executable): with `bash ./guard.sh`
# the child, in its own pwd, failed to find it (exit 127, a warning) and let the write through.
@pytest.mark.parametrize("command", ["./guard.sh", "bash ./guard.sh"])
def test_a_child_runs_its_spawners_guard_hook(tree: Env, command: str) -> None:
    """SPEC §10: a child cannot drop a hook its spawner has. The spawner's guard is named
    relative to its pwd and lies outside the child's scope: the child runs it all the same."""
    env = tree
    (env.work / "kid").mkdir()
    guard = env.work / "guard.sh"
    guard.write_text('#!/bin/sh\ncat >/dev/null\necho "the guard says no" >&2\nexit 2\n')
    guard.chmod(0o755 if command == "./guard.sh" else 0o644)
    hook = f'[[hooks.PreToolUse]]\ncommand = "{command}"\nmatcher = "write_file"\n'
    env.model.script_model(
        "m-kid",
        {"tool_calls": [tool("write_file", path="x.txt", content="no")]},
        {"text": "kid done"},
    )
    env.model.script(
        {"tool_calls": [spawn_call("kid", "write x.txt", [str(env.work / "kid")])]},
        {"tool_calls": [tool("wait_pods", pods=["kid"], timeout_s=30)]},
        {"text": "parent done"},
    )
    parent = start_parent(env, extra=hook)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    assert not (env.work / "kid" / "x.txt").exists()
    kid = json.dumps(model_saw(env, "m-kid"))
    assert "the guard says no" in kid


def test_a_child_is_offered_only_the_mcp_tools_its_spawner_names(tree: Env) -> None:
    """SPEC §9: `tools` names the child's tools, MCP tools among them (`<server>__<tool>`):
    its copy of the server offers only those; nothing else of the spawner's server reaches it."""
    from tests.integration.test_mcp import advertised_tools, server_toml

    env = tree
    (env.work / "kid").mkdir()
    env.model.script_model(
        "m-kid", {"tool_calls": [tool("t__add", a=2, b=40)]}, {"text": "kid done"}
    )
    env.model.script(
        {
            "tool_calls": [
                spawn_call("kid", "add", [str(env.work / "kid")], tools=["read_file", "t__add"])
            ]
        },
        {"tool_calls": [tool("wait_pods", pods=["kid"], timeout_s=30)]},
        {"text": "parent done"},
    )
    parent = start_parent(env, extra=server_toml())
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    assert not any(r["is_error"] for r in tool_results(parent)), tool_results(parent)
    wait_until(lambda: _finished_reports(parent, "kid"), 30, "the child's report")
    # The spawner itself is offered every tool of the server.
    assert {"t__add", "t__env", "t__pid"} <= set(advertised_tools(env.model.requests[0]["body"]))
    first, then = [r["body"] for r in env.model.requests if r["body"].get("model") == "m-kid"]
    assert set(advertised_tools(first)) == {"read_file", "t__add"}
    # Its call went to its own copy of the server (started with the allow-list) and worked.
    (result,) = [m for m in then["messages"] if m["role"] == "tool"]
    assert result["content"] == "42", result


def test_a_child_runs_its_spawners_mcp_server_not_one_planted_in_its_area(tree: Env) -> None:
    """The spawner's server is `python3 server.py`, relative to its pwd, which its commands
    may only read. A child's pwd is the area it is handed, which they may write: they planted
    a server.py there, and the child ran it, outside any sandbox, as the user."""
    import sys

    from tests.integration.test_mcp import SERVER

    env = tree
    outside = env.home / "outside"
    outside.mkdir()
    pwned = outside / "pwned"
    (env.work / "server.py").write_text(Path(SERVER).read_text())
    area = env.work / "area"
    area.mkdir()
    plant = f"""echo 'open("{pwned}", "w").write("escaped")' > {area}/server.py"""
    quiet_children(env, "kid")
    env.model.script(
        {"tool_calls": [tool("bash", command=plant)]},
        {"tool_calls": [spawn_call("kid", "hi", [str(area)])]},
        {"text": "parent done"},
    )
    server = f'[[mcp.servers]]\nname = "t"\ncommand = {json.dumps([sys.executable, "server.py"])}\n'
    parent = start_parent(env, tools=[*POD_TOOLS, "bash"], write=[str(area)],
                          read=[str(env.work)], pwd=str(env.work), extra=server)  # fmt: skip
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    planted, spawned = tool_results(parent)
    assert not planted["is_error"] and (area / "server.py").exists()
    assert not spawned["is_error"], spawned
    status = env.podctl("status", "kid", "--json")
    assert json.loads(status.stdout)["mcp"][0]["state"] == "ready", status.stdout
    assert not pwned.exists()


def test_a_spawners_commands_cannot_change_metadata_in_the_area_it_delegated(tree: Env) -> None:
    """The spawner loses write access to a delegated area while the child lives (SPEC §9):
    file contents by Landlock, and modes, times and entries by the runner's read-only view
    (Landlock cannot subtract them from the spawner's writable tree)."""
    env = tree
    kid = env.work / "kid"
    kid.mkdir()
    mine = kid / "k.txt"
    mine.write_text("k")
    os.chmod(mine, 0o600)
    mark = "@@RC="
    attacks = [
        f"chmod 0644 {mine}",
        f"touch -d 2001-02-03 {mine}",
        f"mkdir {kid}/made",
        f"mv {mine} {kid}/moved",
    ]
    own = [f"chmod 0640 {env.work}/p.txt", f"mkdir {env.work}/d"]
    (env.work / "p.txt").write_text("p")
    env.model.script_model("m-kid")
    env.model.script(
        {"tool_calls": [spawn_call("kid", "wait here", [str(kid)])]},
        {"tool_calls": [tool("bash", command=f"{c}; echo {mark}$?") for c in [*attacks, *own]]},
        {"tool_calls": [tool("stop_pod", pod="kid")]},
        {"tool_calls": [tool("bash", command=f"chmod 0640 {mine}; echo {mark}$?")]},
        {"text": "parent done"},
    )
    parent = start_parent(env, tools=[*POD_TOOLS, "bash"])
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    outputs = [r["output"] for r in tool_results(parent) if r["name"] == "bash"]
    for command, output in zip(attacks, outputs, strict=False):
        assert not output.rstrip().endswith(f"{mark}0"), f"{command!r} worked: {output}"
    assert "Read-only file system" in outputs[0], outputs[0]
    assert not (kid / "made").exists() and mine.exists()
    for command, output in zip(own, outputs[len(attacks) : -1], strict=True):
        assert output.rstrip().endswith(f"{mark}0"), f"{command!r} failed: {output}"
    # The child gone, the area is the spawner's again, modes included (the runner rebuilt).
    assert outputs[-1].rstrip().endswith(f"{mark}0"), outputs[-1]
    assert os.stat(mine).st_mode & 0o777 == 0o640


def test_a_final_text_longer_than_a_frame_is_reported_cut(tree: Env) -> None:
    """Found by QA: a child's final text over the spawner's frame limit (8 MiB) made its report
    a request the client refused to send, on every retry: never delivered, and every later
    report (its shutdown) queued behind it. The report's text is cut; the child keeps it all."""
    env = tree
    (env.work / "k").mkdir()
    # In 64 KiB deltas, not 20-character ones: 470,000 deltas took the child a minute here.
    env.model.chunk_size = 1 << 16
    env.model.script_model("m-k", {"text": "y" * (9 << 20)})
    env.model.script(
        {"tool_calls": [spawn_call("k", "say a lot", [str(env.work / "k")])]},
        {"tool_calls": [tool("wait_pods", pods=["k"], timeout_s=60)]},
        {"text": "done"},
    )
    parent = start_parent(env)
    assert run_and_wait(parent, "go", timeout=120)["outcome"] == "finished"
    waited = tool_results(parent)[-1]["output"]  # (cut to the tool's output cap)
    assert '"outcome":"finished"' in waited and '"text":"yyyy' in waited, waited[:200]
    (report,) = _finished_reports(parent, "k")
    text = report["detail"]
    assert text.startswith("y" * 1000) and len(text) < 2 << 20
    assert "[report text cut: 9437184 bytes" in text and "in pod k's history" in text


def test_a_child_cannot_take_a_stopped_pods_name_and_its_kept_configuration(tree: Env) -> None:
    """Found by QA: spawn_pod named after a stopped pod of the user replaced that pod's kept
    configuration (`<data>/pods/<name>.toml`) with the child's: `podctl restart` of the
    user's pod then started the child, on the child's scope. A child of ours may reuse its
    own name (its `.callback` names us)."""
    env = tree
    (env.work / "k").mkdir()
    other = env.start("reviewer", write=[str(env.work / "k")])
    other.stop()
    kept = env.home / "data" / "pods" / "reviewer.toml"
    before = kept.read_text()
    quiet_children(env, "k")
    env.model.script(
        {"tool_calls": [spawn_call("reviewer", "take its name", [str(env.work / "k")])]},
        {"tool_calls": [spawn_call("k", "mine", [str(env.work / "k")])]},
        {"tool_calls": [tool("stop_pod", pod="k")]},
        {"tool_calls": [spawn_call("k", "mine again", [str(env.work / "k")])]},
        {"text": "done"},
    )
    parent = start_parent(env)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    taken, mine, _, again = [
        r for r in tool_results(parent) if r["name"] in ("spawn_pod", "stop_pod")
    ]
    assert taken["is_error"] and "is the name of another pod" in taken["output"], taken
    assert kept.read_text() == before
    assert not mine["is_error"] and not again["is_error"], (mine, again)


def test_a_task_over_the_childs_input_limit_is_refused_before_a_child_starts(tree: Env) -> None:
    """The child refused it at once (-32602, over worker.max_input_bytes), but only after it
    was started, had claimed its scope and reached READY, to be stopped again."""
    env = tree
    (env.work / "s1").mkdir()
    task = "x" * 3000
    env.model.script(
        {"tool_calls": [spawn_call("s1", task, [str(env.work / "s1")])]}, {"text": "done"}
    )
    parent = env.start("parent", "--set", "worker.max_input_bytes=2000", tools=POD_TOOLS)
    assert run_and_wait(parent, "go")["outcome"] == "finished"
    (result,) = [r for r in tool_results(parent) if r["name"] == "spawn_pod"]
    assert result["is_error"], result
    assert (
        "the task is 3,000 bytes, over the child's worker.max_input_bytes (2,000)"
        in (result["output"])
    )
    kinds = {e["kind"] for e in parent.call("history", limit=10000)["entries"]}
    assert "child_started" not in kinds
    assert not (env.home / "log" / "s1.log").exists()  # never started: no log


def test_a_child_that_never_became_ready_leaves_its_name_free(tree: Env) -> None:
    """Found by QA: a child that failed at start-up (here its instruction's template) had
    written its kept configuration and callback already: the name stayed "another pod's"
    to every other spawner, though no pod of that name ever ran."""
    env = tree
    for d in ("p1/kid", "p2/kid"):
        (env.work / d).mkdir(parents=True)
    quiet_children(env, "kid")
    env.model.script(
        {
            "tool_calls": [
                spawn_call("kid", "t", [str(env.work / "p1" / "kid")], instruction="{{ nope() }}")
            ]
        },
        {"text": "first done"},
        {"tool_calls": [spawn_call("kid", "t", [str(env.work / "p2" / "kid")])]},
        {"text": "second done"},
    )
    first = start_parent(env, "first", write=[str(env.work / "p1")])
    assert run_and_wait(first, "go")["outcome"] == "finished"
    (failed,) = tool_results(first)
    assert failed["is_error"] and "child pod failed to start" in failed["output"], failed
    kept = env.home / "data" / "pods"
    assert not (kept / "kid.toml").exists() and not (kept / "kid.callback").exists()
    second = start_parent(env, "second", write=[str(env.work / "p2")])
    assert run_and_wait(second, "go")["outcome"] == "finished"
    (spawned,) = tool_results(second)
    assert not spawned["is_error"], spawned
