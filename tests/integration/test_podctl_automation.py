"""podctl as automation uses it (cron, CI, scripts branching on exit codes): QA round 23.

Real pods over real sockets with the fake model; each test names the item it checks."""

import json
import signal
import socket

from poddaemon.registry import Registry
from tests.conftest import Env, drained, wait_until
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


# --- item 1: `podctl cancel --run-id` of a run the pod never had is an error ---------------------


def test_cancel_of_an_unknown_run_id_exits_1_and_of_an_ended_run_says_how_it_ended(
    env: Env,
) -> None:
    """`podctl cancel POD --run-id <typo>` said "nothing to cancel" and exited 0: a script
    that cancels a run by id went on as if it were done. A run id the pod does not know is an
    error (exit 1, one line naming it); a run that already ended is nothing to cancel (exit 0),
    and the answer says how it ended."""
    env.model.script({"text": "done"})
    pod = env.start("c")
    ended = pod.call("run", input="hi", wait=True)
    assert ended["outcome"] == "finished"

    bogus = env.podctl("cancel", "c", "--run-id", "no-such-run")
    assert bogus.returncode == 1, (bogus.stdout, bogus.stderr)
    assert bogus.stdout == ""
    assert bogus.stderr == "podctl: pod 'c' has no run no-such-run\n"

    old = env.podctl("cancel", "c", "--run-id", ended["run_id"])
    assert old.returncode == 0, old.stderr
    assert old.stdout == f"nothing to cancel: run {ended['run_id']} already ended: finished\n"

    idle = env.podctl("cancel", "c")
    assert (idle.returncode, idle.stdout) == (0, "nothing to cancel\n")


# --- item 3: `podctl history --since S --limit N` pages as the RPC does ---------------------------


def test_history_since_and_limit_is_the_rpcs_page_and_next_goes_on(env: Env) -> None:
    """`podctl history POD --since S --limit N` showed the newest N entries after S, while the
    `history` RPC (SPEC §5: `since`, `limit` -> `entries`, `next`) gives the first N after S:
    a script paging with `--since $next` skipped every entry between S and the newest N. Now
    it is the RPC's page; following `next` visits every entry once, and the end is `next`
    unchanged with no entries."""
    env.model.script({"text": "one"}, {"text": "two"})
    pod = env.start("h")
    for text in ("one", "two"):
        assert pod.call("run", input=text, wait=True)["outcome"] == "finished"
    every = [e["seq"] for e in pod.call("history", limit=10000)["entries"]]
    assert len(every) > 6

    rpc = pod.call("history", since=2, limit=3)
    out = env.podctl("history", "h", "--since", "2", "--limit", "3", "--json")
    assert out.returncode == 0, out.stderr
    page = json.loads(out.stdout)
    assert [e["seq"] for e in page["entries"]] == [e["seq"] for e in rpc["entries"]] == [3, 4, 5]
    assert page["next"] == rpc["next"] == 5
    assert page["later"] == len(every) - 5 and page["earlier"] == 0

    text = env.podctl("history", "h", "--since", "2", "--limit", "3")
    assert [int(line.split()[0]) for line in text.stdout.splitlines()] == [3, 4, 5]
    assert text.stderr == (
        f"podctl: {len(every) - 5} later entries not shown (--since 5 shows the next page)\n"
    )

    seen: list[int] = []
    cursor = 0
    while True:
        args = ("history", "h", "--since", str(cursor), "--limit", "4", "--json")
        step = json.loads(env.podctl(*args).stdout)
        if not step["entries"]:
            assert step["next"] == cursor
            break
        seen += [e["seq"] for e in step["entries"]]
        cursor = step["next"]
    assert seen == every


# --- item 2: a keyed `send --no-wait` retried gets its original answer ----------------------------


def test_keyed_send_no_wait_retried_after_a_restart_answers_as_the_first_time(env: Env) -> None:
    """SPEC §5: same client_key + same input => the original result. `podctl send --no-wait
    --client-key K` was answered `queued` (position 1) behind a busy run; retried after the pod
    was kill -9ed and restored, by when its run had started and ended, it was answered
    `started`: a script branching on the answer took another path on its retry. The retry now
    gets the first answer, state and position, whatever became of the run since."""
    env.model.script({"text": "first", "gate": "g"}, {"text": "second"})
    pod = env.start("k")
    assert pod.call("run", input="busy")["state"] == "started"
    args = ("send", "k", "later", "--no-wait", "--client-key", "K", "--json")
    first = env.podctl(*args)
    assert first.returncode == 0, first.stderr
    answer = json.loads(first.stdout)
    assert answer["state"] == "queued" and answer["position"] == 1
    env.model.open_gate("g")
    drained(pod)
    pod.kill9()
    again = env.restart(pod, "--resume")
    drained(again)

    retried = env.podctl(*args)
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout) == answer
    text = env.podctl(*args[:-1])
    assert text.stdout == f"{answer['run_id']} queued\n"


# --- item 5: Ctrl-C ends every follower with 130, as it ends send, wait and rpc ---------------


def test_ctrl_c_ends_attach_and_logs_follow_with_130(env: Env) -> None:
    """`podctl attach` and `podctl logs -f` exited 0 on Ctrl-C, while send, wait and rpc exit
    130 (128 + SIGINT): a script running `podctl attach POD >events &` could not tell its
    own interrupt from the pod's clean shutdown, which attach documents as its exit 0."""
    env.model.script({"text": "hello"})
    pod = env.start("f")
    assert pod.call("run", input="hi", wait=True)["outcome"] == "finished"
    log = env.home / "run" / "pods" / "gone" / "stderr.log"
    log.parent.mkdir(mode=0o700)
    log.write_text("2026-11-29 08:00:00.000 poddaemon[1] INFO ready\n")
    for args in (("attach", "f", "--since", "0"), ("attach", "f", "--since", "0", "--json"),
                 ("logs", "gone", "-f")):
        proc = env.podctl_popen(*args)
        assert proc.stdout is not None
        assert proc.stdout.readline()  # following now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 130, (args, out, err)
        assert "Traceback" not in err, err


# --- item 5: a keyed `send` retried after its run was paused and resumed ------------------------


def test_keyed_send_retried_after_a_pause_and_resume_prints_how_the_run_ended(env: Env) -> None:
    """A keyed `podctl send` retried after its run ended prints that run's reply from the log.
    It took the run's first `run_end`: for a run paused, resumed and then finished, that is
    the `paused` one (not final, SPEC §5), so the retry said 'run … paused' and exited 1 for a
    run that had finished. The last one counts."""
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}], "gate": "g"},
        {"text": "done at last"},
    )
    pod = env.start("pr", tools=["list_dir"])
    args = ("send", "pr", "work", "--client-key", "K")
    assert env.podctl(*args, "--no-wait").returncode == 0
    wait_until(lambda: pod.call("status")["state"] == "running", 10, "the run to start")
    assert pod.call("pause")["paused"]
    env.model.open_gate("g")
    wait_until(lambda: pod.call("status")["state"] == "paused", 10, "the run to pause")
    pod.call("resume")
    drained(pod)
    ends = [e["outcome"] for e in pod.call("history")["entries"] if e["kind"] == "run_end"]
    assert ends == ["paused", "finished"]

    retried = env.podctl(*args)
    assert (retried.returncode, retried.stdout, retried.stderr) == (0, "done at last\n", "")
    as_json = env.podctl(*args, "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["outcome"] == "finished"


# --- a bounded run queue ---------------------------------------------------------------------


def test_runs_past_worker_max_queued_runs_are_refused_with_32002_then_fit_again(env: Env) -> None:
    """Queued runs were unbounded (SPEC bounds only notifications): a script sending
    `podctl send --no-wait` in a loop behind a busy run grew the pod's memory by each input
    until it started. Past `[worker] max_queued_runs` a `run` is refused as a notification is
    past `max_pending`: -32002, nothing committed, and `podctl send` says so and exits 1."""
    env.model.script({"text": "first", "gate": "g"})
    pod = env.start("bounded", "--set", "worker.max_queued_runs=2")
    assert pod.call("run", input="busy")["state"] == "started"
    for position in (1, 2):
        queued = env.podctl("send", "bounded", f"later {position}", "--no-wait", "--json")
        assert queued.returncode == 0, queued.stderr
        assert json.loads(queued.stdout)["position"] == position
    full = env.podctl("send", "bounded", "one too many", "--no-wait")
    assert full.returncode == 1, (full.stdout, full.stderr)
    assert "queue full: 2 runs queued (worker.max_queued_runs = 2)" in full.stderr, full.stderr
    with socket.socket(socket.AF_UNIX) as raw:  # on the wire, as a script's own client sees it
        raw.connect(pod.socket)
        raw.sendall(b'{"jsonrpc":"2.0","id":7,"method":"run","params":{"input":"more"}}\n')
        reply = json.loads(raw.makefile("rb").readline())
    assert (reply["id"], reply["error"]["code"]) == (7, -32002), reply
    assert pod.call("status")["queue"]["runs"] == 2
    inputs = [e["text"] for e in pod.call("history")["entries"] if e["kind"] == "user_input"]
    assert inputs == ["busy", "later 1", "later 2"]

    env.model.open_gate("g")
    drained(pod)
    assert pod.call("run", input="fits again")["state"] == "started"
