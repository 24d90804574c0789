"""Issue 9 items 11 and 12: the command runner kills every process a command started (`setsid`
escapees and double forks too) on exit, timeout, cancellation and the pod's death; commands get a
clean environment. Real processes throughout."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from poddaemon.config import ManifestError, load_manifest
from poddaemon.scope import Scope
from poddaemon.testing.cleanup import alive
from poddaemon.tools import ToolContext, ToolOutcome, execute
from poddaemon.tools.runner_client import CommandRunner, RunnerError, clean_env, is_secret_name
from tests.unit.cancelling import left_running

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def ctx(tmp_path: Path) -> AsyncIterator[ToolContext]:
    context = ToolContext(
        scope=Scope.from_config([(str(tmp_path), "write", True)]), pwd=str(tmp_path)
    )
    yield context
    await context.aclose()


async def bash(ctx: ToolContext, command: str, **args: Any) -> ToolOutcome:
    return await execute("bash", msgspec.json.encode({"command": command, **args}).decode(), ctx)


def wait_dead(pids: list[int], deadline: float = 5.0) -> list[int]:
    end = time.monotonic() + deadline
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < end:
        time.sleep(0.01)
    return left


def pids_in(path: Path, n: int, deadline: float = 10.0) -> list[int]:
    """The first `n` pids written one per line to `path` by a command."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if path.exists():
            lines = path.read_text().splitlines()
            if len(lines) >= n:
                return [int(x) for x in lines[:n]]
        time.sleep(0.01)
    raise AssertionError(f"{path}: fewer than {n} pids")


# `setsid` in a subshell that exits at once: the sleeper is re-parented (to the runner, a
# subreaper) and is in neither the shell's process group nor its tree any more.
ESCAPE = (
    "(setsid sh -c 'echo $$ >> {f}; exec sleep 1000' &) ; "
    "(sh -c 'echo $$ >> {f}; exec sleep 1000' &)"
)


async def test_setsid_escapees_die_when_the_shell_exits(ctx: ToolContext, tmp_path: Path) -> None:
    f = tmp_path / "pids"
    wait = f"until [ -f {f} ] && [ $(wc -l < {f}) -ge 2 ]; do sleep 0.01; done"
    out = await bash(ctx, f"{ESCAPE.format(f=f)}; {wait}; echo bye")
    assert out.output == "bye", out.output
    assert wait_dead(pids_in(f, 2)) == []


async def test_setsid_escapees_die_on_timeout(ctx: ToolContext, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    out = await bash(ctx, ESCAPE.format(f=pids_file) + "; sleep 1000", timeout=1)
    assert out.is_error and out.output.endswith("timed out after 1s")
    assert wait_dead(pids_in(pids_file, 2)) == []


async def test_setsid_escapees_die_on_cancel(ctx: ToolContext, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    task = asyncio.create_task(bash(ctx, ESCAPE.format(f=pids_file) + "; sleep 1000"))
    pids = await asyncio.to_thread(pids_in, pids_file, 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert wait_dead(pids) == []


async def test_aclose_kills_running_commands_and_reaps_the_runner(
    ctx: ToolContext, tmp_path: Path
) -> None:
    pids_file = tmp_path / "pids"
    task = asyncio.create_task(bash(ctx, ESCAPE.format(f=pids_file) + "; sleep 1000"))
    pids = await asyncio.to_thread(pids_in, pids_file, 2)
    runner = await ctx.command_runner()
    await ctx.aclose()
    out = await task
    assert out.is_error
    assert wait_dead([*pids, runner.pid]) == []
    with pytest.raises(ChildProcessError):
        os.waitpid(runner.pid, os.WNOHANG)  # reaped, not a zombie


async def test_a_dead_runner_is_replaced(ctx: ToolContext) -> None:
    first = await ctx.command_runner()
    os.kill(first.pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while first.alive and time.monotonic() < end:
        await asyncio.sleep(0.01)
    out = await bash(ctx, "echo again")
    assert out.output == "again"
    assert (await ctx.command_runner()).pid != first.pid


def _hooked_context(tmp_path: Path) -> ToolContext:
    """A tool context whose policy grants the hook script tmp_path/hook.sh by name."""
    hook = tmp_path / "hook.sh"
    hook.write_text("#!/bin/sh\n")
    scope = Scope.from_config([(str(tmp_path), "write", True)])
    return ToolContext(
        scope=scope, pwd=str(tmp_path), granted_files=(str(hook),), policy_for_scope=lambda: None
    )


async def _running(ctx: ToolContext, tmp_path: Path, seconds: int) -> "asyncio.Task[ToolOutcome]":
    """A bash command under way (it has started) that sleeps `seconds`, then says finished."""
    started = tmp_path / "started"
    task = asyncio.create_task(bash(ctx, f"touch {started}; sleep {seconds}; echo finished"))
    await asyncio.to_thread(lambda: wait_until_exists(started))
    return task


def _save_anew(path: Path) -> None:
    """An editor's save: a new file renamed over `path`."""
    saved = path.with_name(path.name + ".new")
    saved.write_text("#!/bin/sh\n")
    saved.rename(path)


async def test_a_granted_file_saved_anew_gets_a_new_runner_and_the_old_one_finishes_first(
    tmp_path: Path,
) -> None:
    """A hook script renamed over (an editor's save): the runner's grant holds the old file,
    so the next command starts in a new runner; a command running in the old one is not cut
    short, and the old runner goes once it is done."""
    ctx = _hooked_context(tmp_path)
    try:
        long = await _running(ctx, tmp_path, 1)
        old = await ctx.command_runner()
        assert await ctx.command_runner() is old  # nothing changed: the same runner
        _save_anew(tmp_path / "hook.sh")
        new = await ctx.command_runner()
        assert new is not old and old.alive
        assert (await long).output == "finished"  # not cut short
        end = time.monotonic() + 10  # and gone once done, with no command after it
        while old.alive and time.monotonic() < end:
            await asyncio.sleep(0.01)
        assert not old.alive and await ctx.command_runner() is new
    finally:
        await ctx.aclose()


async def test_a_scope_change_cuts_short_the_commands_of_a_retired_runner_too(
    tmp_path: Path,
) -> None:
    """A runner retired for a hook script saved anew still runs a command under the policy of
    its start; a delegation to a child then narrows the scope: that command must not keep the
    wider access any more than the current runner's (it finished in peace before)."""
    ctx = _hooked_context(tmp_path)
    try:
        long = await _running(ctx, tmp_path, 30)
        old = await ctx.command_runner()
        _save_anew(tmp_path / "hook.sh")
        assert await ctx.command_runner() is not old and old.alive
        ctx.scope_changed()
        await ctx.command_runner()
        assert not old.alive
        assert (await long).is_error
    finally:
        await ctx.aclose()


def wait_until_exists(path: Path, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.01)


POD_STANDIN = textwrap.dedent(
    """
    import asyncio, sys
    from poddaemon.scope import Scope
    from poddaemon.tools import ToolContext, execute

    async def main():
        ctx = ToolContext(scope=Scope.from_config([(sys.argv[1], "write", True)]), pwd=sys.argv[1])
        await execute("bash", sys.argv[2], ctx)

    asyncio.run(main())
    """
)


def test_kill_9_of_the_pod_kills_every_command_process(tmp_path: Path) -> None:
    """The pod process (here a stand-in running the real tool) dies by SIGKILL mid-command:
    the shell, its background job and its setsid escapees die within seconds."""
    pids_file = tmp_path / "pids"
    command = (
        f"echo $$ >> {pids_file}; sleep 1000 & echo $! >> {pids_file}; "
        + ESCAPE.format(f=pids_file)
        + "; sleep 1000"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            POD_STANDIN,
            str(tmp_path),
            msgspec.json.encode({"command": command}).decode(),
        ],
        cwd=ROOT,
    )
    try:
        pids = pids_in(pids_file, 4)
        assert all(alive(p) for p in pids)
        proc.kill()
        proc.wait(10)
        assert wait_dead(pids) == []
    finally:
        proc.kill()
        proc.wait(10)


# --- item 12: a clean environment -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("ANTHROPIC_API_KEY", True),
        ("OPENAI_API_KEY", True),
        ("GITHUB_TOKEN", True),
        ("gh_token", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("DB_PASSWORD", True),
        ("API_KEY", True),
        ("PATH", False),
        ("HOME", False),
        ("KEYBOARD", False),
        ("TOKENIZERS_PARALLELISM", True),  # errs on the safe side; pass it through if needed
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_clean_env_keeps_what_is_passed_through() -> None:
    env = {"PATH": "/bin", "FAKE_API_KEY": "k", "GITHUB_TOKEN": "t", "HOME": "/root"}
    assert clean_env(env) == {"PATH": "/bin", "HOME": "/root"}
    assert clean_env(env, ["GITHUB_TOKEN"]) == {
        "PATH": "/bin",
        "HOME": "/root",
        "GITHUB_TOKEN": "t",
    }


async def test_commands_do_not_see_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-SHOULD-NOT-LEAK")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-SHOULD-NOT-LEAK")
    monkeypatch.setenv("DEPLOY_PASSWORD", "pw-passed")
    monkeypatch.setenv("PLAIN_SETTING", "plain-ok")
    ctx = ToolContext(
        scope=Scope.from_config([(str(tmp_path), "write", True)]),
        pwd=str(tmp_path),
        env_passthrough=("DEPLOY_PASSWORD",),
    )
    try:
        out = await bash(ctx, "env")
    finally:
        await ctx.aclose()
    assert "SHOULD-NOT-LEAK" not in out.output
    assert "PLAIN_SETTING=plain-ok" in out.output
    assert "DEPLOY_PASSWORD=pw-passed" in out.output


def test_manifest_env_passthrough(tmp_path: Path) -> None:
    base = '[pod]\nname = "p"\n[provider]\nkind = "openai"\nmodel = "m"\n'
    scope = '[[scope.allow]]\ntarget = "."\npermission = "write"\n'
    path = tmp_path / "m.toml"
    path.write_text(base + '[worker]\nenv_passthrough = ["GITHUB_TOKEN"]\n' + scope)
    assert load_manifest(str(path)).worker.env_passthrough == ["GITHUB_TOKEN"]
    path.write_text(base + scope)
    assert load_manifest(str(path)).worker.env_passthrough == []
    path.write_text(base + '[worker]\nenv_passthrough = ["A=B"]\n' + scope)
    with pytest.raises(ManifestError, match="env_passthrough"):
        load_manifest(str(path))


# --- the runner itself ------------------------------------------------------------------------


async def test_runner_starts_small_and_fast() -> None:
    started = time.perf_counter()
    runner = await CommandRunner.start(clean_env(os.environ))
    elapsed = time.perf_counter() - started
    try:
        with open(f"/proc/{runner.pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        with open(f"/proc/{runner.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    finally:
        await runner.aclose()
    assert b"-I" in argv  # isolated: the cwd cannot shadow a module
    assert rss_kb < 40_000, rss_kb  # stdlib only (~12 MB); the pod's heap is not copied
    assert elapsed < 10, elapsed


async def test_a_policy_the_runner_cannot_apply_fails_its_start_with_the_reason() -> None:
    """The runner applies its policy (`poddaemon.sandbox.apply_policy`) before any command: a
    policy it cannot apply stops it at start, with the reason, rather than running unconfined."""
    for policy, reason in ((b"{}", "missing required field `rules`"), (b"not json", "JSON")):
        with pytest.raises(RunnerError, match=reason):
            await CommandRunner.start(clean_env(os.environ), policy=policy)


async def test_killing_one_command_spares_a_concurrent_ones_escapees(
    ctx: ToolContext, tmp_path: Path
) -> None:
    """Orphans are attributed by the tag in their environment: finishing command B kills B's
    escapees, not those of command A still running beside it."""
    a_pids, b_pids = tmp_path / "a", tmp_path / "b"
    a = asyncio.create_task(bash(ctx, ESCAPE.format(f=a_pids) + "; sleep 1000", timeout=30))
    (a_escapee, _) = await asyncio.to_thread(pids_in, a_pids, 2)
    wait = f"until [ -f {b_pids} ] && [ $(wc -l < {b_pids}) -ge 2 ]; do sleep 0.01; done"
    out = await bash(ctx, f"{ESCAPE.format(f=b_pids)}; {wait}; echo b-done")
    assert out.output == "b-done"
    assert wait_dead(pids_in(b_pids, 2)) == []
    assert alive(a_escapee)
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert wait_dead(pids_in(a_pids, 2)) == []


async def test_a_command_that_cannot_start_is_a_tool_error_and_the_runner_lives_on(
    ctx: ToolContext, tmp_path: Path
) -> None:
    out = await bash(ctx, "echo a\0b")
    assert out.is_error and out.output.startswith("could not start the command: ValueError")
    ctx.pwd = str(tmp_path / "gone")
    out = await bash(ctx, "true")
    assert out.is_error and "could not start the command" in out.output
    ctx.pwd = str(tmp_path)
    first = (await ctx.command_runner()).pid
    assert (await bash(ctx, "echo fine")).output == "fine"
    assert (await ctx.command_runner()).pid == first


async def test_a_command_not_started_yet_has_no_group_to_kill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command is known with pid 0 until the runner says it started. A runner closed in that
    window (a stop while a hook was starting) killed process group 0, the pod's own."""
    from poddaemon.tools.runner_client import Command

    killed: list[int] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: killed.append(pgid))
    loop = asyncio.get_running_loop()
    CommandRunner._kill_group(Command(id=1, pid=0, exited=loop.create_future()))
    assert killed == []
    CommandRunner._kill_group(Command(id=2, pid=4242, exited=loop.create_future()))
    assert killed == [4242]


async def test_hooks_get_a_runner_of_their_own_per_transcript_and_scope(tmp_path: Path) -> None:
    """Hooks read their transcript (the session log), which the pod's commands may not: their
    runner is another than bash's, kept while the transcript is the same file, replaced for a
    new session's (the old one goes once idle) and closed at once when the scope changes."""
    built: list[str] = []

    def policy_for_hooks(transcript: str) -> bytes | None:
        built.append(transcript)
        return None

    ctx = _hooked_context(tmp_path)
    ctx.policy_for_hooks = policy_for_hooks
    first, second = tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"
    first.write_text("")
    try:
        hooks = await ctx.hook_runner(str(first))
        assert hooks is not await ctx.command_runner()
        assert await ctx.hook_runner(str(first)) is hooks and built == [str(first)]
        after = await ctx.hook_runner(str(second))  # compaction: another session
        assert after is not hooks and built == [str(first), str(second)]
        end = time.monotonic() + 10
        while hooks.alive and time.monotonic() < end:  # retired: gone once idle
            await asyncio.sleep(0.01)
        assert not hooks.alive
        second.write_text("")  # its file made since: granted anew
        made = await ctx.hook_runner(str(second))
        assert made is not after
        ctx.scope_changed()
        assert await ctx.hook_runner(str(second)) is not made and not made.alive
    finally:
        await ctx.aclose()


@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8])
async def test_a_hook_cancelled_while_it_starts_leaves_no_process(
    ctx: ToolContext, tmp_path: Path, yields: int
) -> None:
    # Cancelled while the runner started it (a run cancelled as its PreToolUse hook began), a
    # hook's command was forgotten, not killed: it ran on, its timeout unenforced.
    from poddaemon.hooks import _run_command

    runner = await ctx.command_runner()
    token = f"{1987 + yields}.{os.getpid()}"  # a unique `sleep` argument
    task = asyncio.create_task(
        _run_command(runner, f"sleep {token} & sleep {token}", str(tmp_path), b"", 60.0)
    )
    for _ in range(yields):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The runner takes requests in order: once a later command ran, the hook's start request
    # (if it was sent) has been carried out, and its shell is running unless it was killed.
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        probe = await runner.spawn(["/bin/true"], str(tmp_path), null)
    finally:
        os.close(null)
    assert await probe.exited == 0
    assert await left_running(token) == []


async def test_a_command_cancelled_while_a_stale_runner_closes_does_not_run(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A scope change makes the next command close the old runner and start a new one. A
    # cancellation landing in that close was swallowed with the runner's reader's: the call
    # went on, a new runner started and ran the command it was cancelled for.
    assert not (await bash(ctx, "true")).is_error
    ctx._runner_stale = True
    close = CommandRunner.aclose

    async def cancelled_meanwhile(runner: CommandRunner) -> None:
        monkeypatch.setattr(CommandRunner, "aclose", close)  # once
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await close(runner)

    started: list[list[str]] = []
    spawn = CommandRunner._spawn

    async def recorded(runner: CommandRunner, argv: list[str], *args: Any) -> Any:
        started.append(argv)
        return await spawn(runner, argv, *args)

    monkeypatch.setattr(CommandRunner, "aclose", cancelled_meanwhile)
    monkeypatch.setattr(CommandRunner, "_spawn", recorded)
    call = asyncio.create_task(bash(ctx, "echo ran"))
    with pytest.raises(asyncio.CancelledError):
        await call
    assert started == []  # the runner was never asked to start it
