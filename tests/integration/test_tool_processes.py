"""Issue 9 items 11 and 3 against a real pod: the bash tool's processes (background jobs and
`setsid` escapees too) die with the pod however it ends; absurd tool arguments are a tool error."""

import time
from pathlib import Path

import pytest

from poddaemon.sandbox import landlock
from poddaemon.testing.cleanup import alive
from tests.conftest import PROVIDER_KINDS, Env, wait_until


def command_pids(pids_file: Path, n: int) -> list[int]:
    def ready() -> list[int] | None:
        if not pids_file.exists():
            return None
        lines = pids_file.read_text().splitlines()
        return [int(x) for x in lines[:n]] if len(lines) >= n else None

    pids: list[int] = wait_until(ready, timeout=20, what=f"{n} pids in {pids_file}")
    return pids


def script_long_command(env: Env) -> Path:
    """The model runs a command with a background job and two escapees, then hangs in it."""
    pids_file = env.work / "pids"
    command = (
        f"echo $$ >> {pids_file}; sleep 1000 & echo $! >> {pids_file}; "
        f"(setsid sh -c 'echo $$ >> {pids_file}; exec sleep 1000' &); "
        f"(sh -c 'echo $$ >> {pids_file}; exec sleep 1000' &); "
        "sleep 1000"
    )
    env.model.script({"tool_calls": [{"name": "bash", "arguments": {"command": command}}]})
    return pids_file


@pytest.mark.parametrize("how", ["kill -9", "shutdown", "cancel"])
def test_command_processes_die_with_the_pod(env: Env, how: str) -> None:
    pids_file = script_long_command(env)
    pod = env.start("runner-pod", tools=["bash"])
    with pod.client() as c:
        c.run("start the long job")
    pids = command_pids(pids_file, 4)
    assert all(alive(p) for p in pids)
    if how == "kill -9":
        pod.kill9()
    elif how == "shutdown":
        assert pod.stop() == 0
    else:
        with pod.client() as c:
            assert c.cancel().cancelled
    started = time.monotonic()
    wait_until(lambda: not any(alive(p) for p in pids), timeout=10, what="command processes gone")
    assert time.monotonic() - started < 5
    if how != "kill -9":  # the model must not read that a command it started never ran
        after = pod if how == "cancel" else env.restart(pod, "--resume")

        def tool_results() -> list[dict[str, object]]:
            entries = after.call("history")["entries"]
            return [e for e in entries if e["kind"] == "tool_result"]

        # A cancel is answered at once; the call's result is committed when its task ends.
        results = wait_until(tool_results, 10, "the interrupted call's result")
        assert results[-1]["item"]["output"].startswith("interrupted:"), results[-1]
    if how == "cancel":  # the pod lives on, and its next command works
        env.model.script(
            {"tool_calls": [{"name": "bash", "arguments": {"command": "echo still-here"}}]},
            {"text": "ok"},
        )
        with pod.client() as c:
            assert c.run_wait("again").outcome == "finished"
        assert "still-here" in str(env.model.requests[-1]["body"])


# The fake server's Anthropic wire cannot carry such input itself (it parses it with json).
@pytest.mark.parametrize("kind", [k for k in PROVIDER_KINDS if k != "anthropic"])
def test_deeply_nested_tool_arguments_are_a_tool_error(env: Env, kind: str) -> None:
    deep = '{"path": ' + "[" * 3000 + "]" * 3000 + "}"
    env.model.script(
        {"tool_calls": [{"name": "read_file", "arguments": deep}]},
        {"text": "noted"},
    )
    pod = env.start("deep", kind=kind)
    with pod.client() as c:
        result = c.run_wait("go")
    assert (result.outcome, result.text) == ("finished", "noted")
    followup = str(env.model.requests[1]["body"])
    assert "nest deeper than" in followup
    assert "the pod stopped" not in followup


def test_bash_commands_do_not_see_the_provider_key(env: Env) -> None:
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": "env; echo END-OF-ENV"}}]},
        {"text": "seen"},
    )
    pod = env.start("envy", tools=["bash"])
    with pod.client() as c:
        assert c.run_wait("show env").outcome == "finished"
    followup = str(env.model.requests[1]["body"])
    assert "END-OF-ENV" in followup and "PODDAEMON_HOME=" in followup
    assert "FAKE_API_KEY" not in followup and "test-key" not in followup


@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
def test_a_command_that_kills_or_stops_the_runner_leaves_no_escapee(
    env: Env, signal_name: str
) -> None:
    # The runner is what kills a command's escapees; a command killing (or freezing) it would
    # orphan a `setsid` escapee to init, past the pod's end. The guard above the runner, out
    # of the commands' reach (Landlock scoped signals), kills them at once instead.
    if landlock.abi_version() < 6:
        pytest.skip("signals are scoped from Landlock ABI 6")
    pids_file = env.work / "pids"
    command = (
        f"(setsid sh -c 'echo $$ >> {pids_file}; exec sleep 1000' &); "
        f"until [ -s {pids_file} ]; do sleep 0.05; done; kill -{signal_name} $PPID; sleep 1000"
    )
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]},
        {"tool_calls": [{"name": "bash", "arguments": {"command": "echo runner-$((6*7))"}}]},
        {"text": "ok"},
    )
    pod = env.start("runner-guard", tools=["bash"])
    with pod.client() as c:
        assert c.run_wait("kill your runner").outcome == "finished"
    (escapee,) = command_pids(pids_file, 1)
    wait_until(lambda: not alive(escapee), timeout=10, what="the escapee killed by the guard")
    outputs = [
        e["item"]["output"] for e in pod.call("history")["entries"] if e["kind"] == "tool_result"
    ]
    assert "runner-42" in outputs[1]  # the next command gets a new runner
    assert pod.stop() == 0


def test_the_guard_above_the_runner_is_out_of_the_commands_reach(env: Env) -> None:
    if landlock.abi_version() < 6:
        pytest.skip("signals are scoped from Landlock ABI 6")
    command = "guard=$(cut -d' ' -f4 /proc/$PPID/stat); kill -9 $guard; echo status=$?"
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}, {"text": "ok"}
    )
    pod = env.start("guarded-runner", tools=["bash"])
    with pod.client() as c:
        assert c.run_wait("kill the guard").outcome == "finished"
    (output,) = [
        e["item"]["output"] for e in pod.call("history")["entries"] if e["kind"] == "tool_result"
    ]
    assert "status=1" in output and "not permitted" in output, output
    assert pod.stop() == 0
