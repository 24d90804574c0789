"""Issue 13: command hooks (SPEC §10), Claude Code's contract, through real pods."""

import json
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from poddaemon.sandbox import available
from protocol.errors import RpcError
from tests.conftest import Env, PodProcess, collect_run, drained, wait_until
from tests.integration.test_durability import check_restored, intrude, settled

PY = sys.executable


def hooks_toml(event: str, command: str, matcher: str | None = None, timeout: float = 30) -> str:
    lines = [f"[[hooks.{event}]]", f"command = {json.dumps(command)}", f"timeout = {timeout}"]
    if matcher is not None:
        lines.append(f"matcher = {json.dumps(matcher)}")
    return "\n".join(lines) + "\n"


def script(env: Env, name: str, body: str) -> str:
    path = env.work / name
    path.write_text(body)
    return f"{PY} {path}"


def entries(pod: Any) -> list[dict[str, Any]]:
    return list(pod.call("history", since=0, limit=10_000)["entries"])


def hook_runs(pod: Any) -> list[dict[str, Any]]:
    return [e for e in entries(pod) if e["kind"] == "hook_run"]


def tool_results(pod: Any) -> list[dict[str, Any]]:
    """The items of the pod's tool results, in order."""
    return [e["item"] for e in entries(pod) if e["kind"] == "tool_result"]


GUARD = """
import json, sys
data = json.load(sys.stdin)
path = data["tool_input"].get("path", "")
if path.startswith("secrets/"):
    print(f"{data['tool_name']} may not touch {path}", file=sys.stderr)
    sys.exit(2)
"""


def test_pre_tool_use_exit_2_blocks_the_call_and_the_model_gets_the_reason(env: Env) -> None:
    (env.work / "secrets").mkdir()
    env.model.script(
        {
            "tool_calls": [
                {"name": "write_file", "arguments": {"path": "secrets/k", "content": "x"}}
            ]
        },
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "notes", "content": "y"}}]},
        {"text": "done"},
    )
    guard = hooks_toml("PreToolUse", script(env, "guard.py", GUARD), matcher="write_file|edit_file")
    pod = env.start("guarded", tools=["write_file"], extra=guard)
    with pod.client() as c:
        assert c.run_wait("write things").outcome == "finished"
    assert not (env.work / "secrets" / "k").exists()
    assert (env.work / "notes").read_text() == "y"
    results = tool_results(pod)
    assert results[0]["is_error"] and "write_file may not touch secrets/k" in results[0]["output"]
    assert not results[1]["is_error"]
    runs = hook_runs(pod)
    assert [(r["event"], r["exit"], r["decision"]) for r in runs] == [
        ("PreToolUse", 2, "block"),
        ("PreToolUse", 0, "ok"),
    ]


def test_a_claude_code_hook_script_works_unchanged(env: Env) -> None:
    # Written against Claude Code's documented contract: the fields it reads and the JSON
    # decision it prints are Claude Code's own.
    claude_hook = """
import json, sys
event = json.load(sys.stdin)
assert {"session_id", "transcript_path", "cwd", "hook_event_name"} <= event.keys(), event
if event["hook_event_name"] == "PreToolUse" and event["tool_name"] == "list_dir":
    print(json.dumps({"hookSpecificOutput": {
        "hookEventName": "PreToolUse",
        "permissionDecision": "deny",
        "permissionDecisionReason": "listing directories is not allowed here",
    }}))
sys.exit(0)
"""
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "ok"}
    )
    extra = hooks_toml("PreToolUse", script(env, "claude_hook.py", claude_hook), matcher="*")
    pod = env.start("claude", tools=["list_dir"], extra=extra)
    with pod.client() as c:
        assert c.run_wait("list").outcome == "finished"
    (result,) = tool_results(pod)
    assert result["is_error"] and "listing directories is not allowed here" in result["output"]


def test_user_prompt_submit_adds_context_or_refuses_the_prompt(env: Env) -> None:
    hook = """
import json, sys
prompt = json.load(sys.stdin)["prompt"]
if "forbidden" in prompt:
    print("prompts about forbidden things are refused", file=sys.stderr)
    sys.exit(2)
print("CONTEXT: the build is green")
"""
    env.model.script({"text": "fine"})
    pod = env.start("prompted", extra=hooks_toml("UserPromptSubmit", script(env, "ups.py", hook)))
    with pod.client() as c:
        assert c.run_wait("how is the build?").outcome == "finished"
        with pytest.raises(RpcError) as err:
            c.run("tell me the forbidden thing")
        assert err.value.code == -32009
        assert "prompts about forbidden things are refused" in err.value.message
    body = str(env.model.requests[0]["body"])
    assert "how is the build?" in body and "CONTEXT: the build is green" in body
    texts = [e.get("text", "") for e in entries(pod) if e["kind"] == "user_input"]
    assert texts == ["how is the build?"]  # the refused prompt was never committed


def test_session_start_context_comes_before_the_first_prompt_and_its_context(env: Env) -> None:
    """Found by QA: the first request read the prompt, its UserPromptSubmit context, then the
    SessionStart context committed before them all. Claude Code shows SessionStart's first."""
    extra = hooks_toml("SessionStart", "echo SS-CONTEXT") + hooks_toml(
        "UserPromptSubmit", "echo UPS-CONTEXT"
    )
    env.model.script({"text": "ok"})
    pod = env.start("ordered", extra=extra)
    wait_until(lambda: "SS-CONTEXT" in str(pod.call("history", since=0)), what="the context")
    with pod.client() as c:
        assert c.run_wait("please run echo").outcome == "finished"
    (request,) = env.model.requests
    texts = [str(m["content"]) for m in request["body"]["messages"]]

    def first(said: str) -> int:
        return next(i for i, text in enumerate(texts) if said in text)

    assert first("SS-CONTEXT") < first("please run echo") < first("UPS-CONTEXT"), texts


def test_a_hook_flooding_its_output_is_cut_and_the_note_counts_all_of_it(env: Env) -> None:
    """3 MB of context: 10,000 characters reach the model, and the note counts the 2,990,000
    cut (it counted only up to the 1 MiB the reader keeps)."""
    flood = "head -c 3000000 /dev/zero | tr '\\0' x"
    env.model.script({"text": "fine"})
    pod = env.start("flooded", extra=hooks_toml("UserPromptSubmit", flood))
    with pod.client() as c:
        assert c.run_wait("hello").outcome == "finished"
    body = str(env.model.requests[0]["body"])
    assert "[hook output cut: 2990000 more characters]" in body


def test_an_unanchored_matcher_guards_and_a_block_over_the_output_limit_still_blocks(
    env: Env,
) -> None:
    """`matcher = "^list"` never fired (the regex had to match the whole name; Claude Code
    searches it), and a JSON block of 3 MB was cut, read as plain text, and the tool ran."""
    huge_block = script(
        env,
        "huge.py",
        'import json; print(json.dumps({"decision": "block", "reason": "R" * 3_000_000}))',
    )
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "done"}
    )
    pod = env.start("huge", tools=["list_dir"], extra=hooks_toml("PreToolUse", huge_block, "^list"))
    with pod.client() as c:
        assert c.run_wait("look").outcome == "finished"
    [result] = tool_results(pod)
    assert result["is_error"] and "decision could not be read" in result["output"]
    [run] = hook_runs(pod)
    assert (run["event"], run["exit"], run["decision"]) == ("PreToolUse", 0, "block")


def test_prompts_pipelined_on_one_connection_are_queued_in_the_order_sent(env: Env) -> None:
    """The first prompt's UserPromptSubmit hook is slow, the second's instant: the second
    must not be committed, and its run queued, before the first."""
    hook = """
import json, sys, time
if json.load(sys.stdin)["prompt"] == "first":
    time.sleep(0.5)
"""
    env.model.script({"text": "one"}, {"text": "two"})
    pod = env.start("ordered", extra=hooks_toml("UserPromptSubmit", script(env, "slow.py", hook)))
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(pod.socket)
    line = '{"jsonrpc":"2.0","id":%d,"method":"run","params":{"input":"%s","wait":true}}\n'
    sock.sendall((line % (1, "first") + line % (2, "second")).encode())
    sock.shutdown(socket.SHUT_WR)
    with sock.makefile("rb") as replies:
        done = {r["id"]: r["result"] for r in map(json.loads, replies)}
    sock.close()
    assert (done[1]["text"], done[2]["text"]) == ("one", "two")
    inputs = [e["text"] for e in entries(pod) if e["kind"] == "user_input"]
    assert inputs == ["first", "second"]


def test_a_stop_while_a_prompts_hook_is_starting_is_a_clean_shutdown(env: Env) -> None:
    """A `run` and a `shutdown` in one batch (whose items are not decided in order), the
    prompt's hook slow: the stop closed the command runner before it said the hook had
    started, and the pod SIGKILLed process group 0, its own (and with it `podctl spawn`'s,
    a unit's, a `timeout`'s): exit 137 where a requested shutdown exits 0. The run, read
    before the stop, is answered (it was dropped with the connection)."""
    slow = env.work / "slow.sh"
    slow.write_text("#!/bin/sh\nsleep 0.5\n")
    slow.chmod(0o755)
    pod = env.start("stopped", extra=hooks_toml("UserPromptSubmit", str(slow)))
    batch = [
        {"jsonrpc": "2.0", "id": "run", "method": "run", "params": {"input": "x", "wait": True}},
        {"jsonrpc": "2.0", "id": "sd", "method": "shutdown"},
    ]
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(pod.socket)
    sock.sendall(json.dumps(batch).encode() + b"\n")
    with sock.makefile("rb") as lines:
        (reply,) = [json.loads(line) for line in lines]
    sock.close()
    assert pod.proc.wait(20) == 0, pod.text()
    replies = {r["id"]: r for r in reply}
    assert replies["sd"]["result"] == {"ok": True}
    assert replies["run"]["error"]["code"] == -32004, replies  # shutting down: not committed


def test_requests_pipelined_after_a_hooked_prompt_are_decided_after_it(env: Env) -> None:
    """`run A`, `cancel`, `notify N` in one write to an idle pod whose prompt hook is slow:
    the cancel and the notify were decided while the hook ran, so the cancel found nothing,
    the notification woke a turn of its own and A was queued behind it (found by a QA pass)."""
    slow = env.work / "slow.sh"
    slow.write_text("#!/bin/sh\nsleep 0.3\n")
    slow.chmod(0o755)
    env.model.script({"text": "never", "gate": "never"}, {"text": "after"})
    pod = env.start("inorder", extra=hooks_toml("UserPromptSubmit", str(slow)))
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(pod.socket)
    line = '{"jsonrpc":"2.0","id":"%s","method":"%s","params":%s}\n'
    sock.sendall(
        (
            line % ("run", "run", '{"input":"A"}')
            + line % ("cancel", "cancel", "{}")
            + line % ("note", "notify", '{"message":"N"}')
        ).encode()
    )
    sock.shutdown(socket.SHUT_WR)
    with sock.makefile("rb") as lines:
        replies = {r["id"]: r["result"] for r in map(json.loads, lines)}
    sock.close()
    assert replies["run"]["state"] == "started", replies
    assert replies["cancel"] == {"cancelled": True}
    kinds = [(e["kind"], e.get("text")) for e in entries(pod)]
    assert kinds.index(("user_input", "A")) < kinds.index(("system_item", "N")), kinds


def test_stop_hook_sees_the_outcome_and_a_hanging_hook_is_killed(env: Env) -> None:
    seen = env.work / "stop.json"
    stop = f"cat > {seen}"
    hang = "sleep 137; echo never"
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "all done"}
    )
    extra = hooks_toml("Stop", stop) + hooks_toml("PreToolUse", hang, timeout=0.5)
    pod = env.start("stopper", tools=["list_dir"], extra=extra)
    with pod.client() as c:
        result = c.run_wait("work")
    assert result.outcome == "finished"  # the hung hook was a warning: the tool ran
    (tool,) = tool_results(pod)
    assert not tool["is_error"]
    data = wait_until(lambda: seen.exists() and seen.read_text() and json.loads(seen.read_text()))
    assert data["hook_event_name"] == "Stop" and data["outcome"] == "finished"
    assert data["pod"] == "stopper" and data["session_id"]
    pre = [e for e in hook_runs(pod) if e["event"] == "PreToolUse"]
    assert pre[0]["exit"] is None and pre[0]["decision"] == "warning"
    leftovers = subprocess.run(["pgrep", "-f", "sleep 137"], capture_output=True, text=True)
    assert leftovers.stdout == "", "the hook's process group outlived its timeout"


def test_hooks_run_inside_the_sandbox(env: Env) -> None:
    outside = env.home / "outside.txt"
    outside.write_text("not for hooks\n")
    out = env.work / "hook-out.txt"
    hook = f"cat {outside} > {out} 2>&1; exit 0"
    env.model.script({"text": "ok"})
    pod = env.start("boxed", extra=hooks_toml("UserPromptSubmit", hook))
    with pod.client() as c:
        assert c.run_wait("go").outcome == "finished"
    text = out.read_text()
    assert "not for hooks" not in text and "Permission denied" in text
    assert Path(outside).read_text() == "not for hooks\n"


def test_prompt_context_is_committed_only_with_an_accepted_prompt(env: Env) -> None:
    # An idempotent retry (same client_key and input) and a conflicting key (-32006) commit
    # nothing: the hook's context must not pile up in the history either.
    env.model.script({"text": "fine"})
    pod = env.start("retried", extra=hooks_toml("UserPromptSubmit", "echo CONTEXT-MARK"))
    first = pod.call("run", input="deploy", client_key="k1", wait=True)
    again = pod.call("run", input="deploy", client_key="k1", wait=True)
    assert again["run_id"] == first["run_id"]
    with pytest.raises(RpcError) as err:
        pod.call("run", input="something else", client_key="k1")
    assert err.value.code == -32006
    # Committed with its input (user_input.context), or as a context item for a steer.
    contexts = [
        e["context"] if e["kind"] == "user_input" else e["text"]
        for e in entries(pod)
        if e.get("context") and e["kind"] in ("user_input", "system_item")
    ]
    assert contexts == ["CONTEXT-MARK"]


SH_GUARD = """#!/bin/sh
cat > /dev/null
echo "guarded: no writes here" >&2
exit 2
"""


@pytest.mark.parametrize("linked", [False, True], ids=["its directory", "a linked directory"])
def test_a_guard_script_outside_the_scope_still_guards(env: Env, linked: bool) -> None:
    """Kept out of the scope so the model cannot rewrite its own guard: the sandbox lets
    commands read and run that one file, so the hook runs (it failed open with exit 126).
    Also through a hooks directory that is a symlink (stow, /home linked elsewhere): the
    sandbox opens its grants following no link on the way, so the grant must name the
    directory the link resolves to, or the guard cannot run (exit 126: it blocks every call,
    never with its own reason)."""
    hooks = env.home / "hooks"
    hooks.mkdir()
    (hooks / "guard.sh").write_text(SH_GUARD)
    (hooks / "guard.sh").chmod(0o755)
    if linked:
        (env.home / "linked").symlink_to(hooks)
        hooks = env.home / "linked"
    env.model.script(
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "x.txt", "content": "x"}}]},
        {"text": "done"},
    )
    extra = hooks_toml("PreToolUse", str(hooks / "guard.sh"), matcher="write_file")
    pod = env.start("outguard", tools=["write_file", "bash"], extra=extra)
    with pod.client() as c:
        assert c.run_wait("write").outcome == "finished"
    assert not (env.work / "x.txt").exists()
    (result,) = tool_results(pod)
    assert result["is_error"] and "guarded: no writes here" in result["output"], result
    assert any("a hook script" in n for n in pod.call("status")["sandbox_notes"])


def _guards_before_and_after(env: Env, name: str, guard: Path, replace: Callable[[], None]) -> None:
    """A pod whose PreToolUse guard `guard` blocks write_file: a write is blocked, `replace`
    puts the guard's second version ("still no writes") in place, and a write is blocked by
    that one."""
    write = {"tool_calls": [{"name": "write_file", "arguments": {"path": "x.txt", "content": "x"}}]}
    env.model.script(write, {"text": "done"}, write, {"text": "done"})
    extra = hooks_toml("PreToolUse", str(guard), matcher="write_file")
    pod = env.start(name, tools=["write_file", "bash"], extra=extra)
    with pod.client() as c:
        assert c.run_wait("write").outcome == "finished"
        replace()
        assert c.run_wait("write again").outcome == "finished"
    assert not (env.work / "x.txt").exists()
    results = tool_results(pod)
    assert [r["is_error"] for r in results] == [True, True], results
    assert "guarded: still no writes" in results[1]["output"]


SH_GUARD_V2 = SH_GUARD.replace("no writes here", "still no writes")


def test_a_guard_script_saved_anew_still_guards(env: Env) -> None:
    """An editor's save, `sed -i`, `git checkout`: a new file renamed over the script. The
    sandbox's grant held the old file, so the new one could not run (exit 126, a warning) and
    the call it guards went ahead, until the pod restarted."""
    hooks = env.home / "hooks"
    hooks.mkdir()
    guard = hooks / "guard.sh"
    guard.write_text(SH_GUARD)
    guard.chmod(0o755)

    def save_anew() -> None:
        saved = hooks / "guard.sh.new"
        saved.write_text(SH_GUARD_V2)
        saved.chmod(0o755)
        saved.rename(guard)

    _guards_before_and_after(env, "resaved", guard, save_anew)


def _guard_versions(env: Env) -> tuple[Path, Path]:
    """An empty hooks dir, and a dir outside the scope holding the guard's two versions
    (v1.sh, v2.sh)."""
    hooks, real = env.home / "hooks", env.home / "real"
    hooks.mkdir()
    real.mkdir()
    for name, text in (("v1.sh", SH_GUARD), ("v2.sh", SH_GUARD_V2)):
        (real / name).write_text(text)
        (real / name).chmod(0o755)
    return hooks, real


def _link_anew(guard: Path, target: Path) -> None:
    """`ln -sf`: a link made beside `guard`, renamed over it."""
    new = guard.with_name("new.sh")
    new.symlink_to(target)
    new.rename(guard)


@pytest.mark.parametrize("when", ["from the start", "linked anew"])
def test_a_guard_script_that_is_a_symlink_still_guards(env: Env, when: str) -> None:
    """A hook script that is a symlink (a dotfile manager, stow, `ln -sf`) to a file outside
    the scope: the sandbox grants a file it opens without following links, so the link granted
    nothing, the script could not run (exit 126, a warning) and the call it guards went ahead.
    The link lies where the pod cannot write (it could repoint it): its file is the grant."""
    hooks, real = _guard_versions(env)
    guard = hooks / "guard.sh"
    if when == "from the start":
        guard.symlink_to(real / "v1.sh")
    else:
        guard.write_text(SH_GUARD)
        guard.chmod(0o755)

    _guards_before_and_after(env, "linked", guard, lambda: _link_anew(guard, real / "v2.sh"))


def test_a_guard_link_repointed_before_its_first_use_guards(env: Env) -> None:
    """The policy the pod starts with grants the file its guard's link pointed to then; a link
    repointed before the first command ran the new file unguarded (exit 126, the call went
    ahead) until it changed again."""
    hooks, real = _guard_versions(env)
    guard = hooks / "guard.sh"
    guard.symlink_to(real / "v1.sh")
    write = {"tool_calls": [{"name": "write_file", "arguments": {"path": "x.txt", "content": "x"}}]}
    env.model.script(write, {"text": "done"})
    extra = hooks_toml("PreToolUse", str(guard), matcher="write_file")
    pod = env.start("repointed", tools=["write_file", "bash"], extra=extra)
    _link_anew(guard, real / "v2.sh")
    with pod.client() as c:
        assert c.run_wait("write").outcome == "finished"
    assert not (env.work / "x.txt").exists()
    (result,) = tool_results(pod)
    assert result["is_error"] and "guarded: still no writes" in result["output"], result


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("./missing.sh", "does not exist"),
        ("./plain.sh --x", "is not executable"),
        ("python3 hooks/gone.py", "does not exist"),
        ('"$CLAUDE_PROJECT_DIR"/.claude/hooks/gone.sh', "does not exist"),  # Claude Code's way
    ],
)
def test_a_hook_script_that_cannot_run_is_a_startup_error(
    env: Env, command: str, problem: str
) -> None:
    (env.work / "plain.sh").write_text(SH_GUARD)
    path = env.manifest("broken", extra=hooks_toml("PreToolUse", command))
    started = env.podctl("spawn", str(path))
    assert started.returncode != 0
    assert "hooks.PreToolUse[0].command" in started.stderr and problem in started.stderr


def test_session_start_context_is_no_queued_notification_and_podctl_wait_returns(env: Env) -> None:
    """The context a SessionStart hook adds waits for the next input and wakes no run: it is
    not in `queue.notifications`, so the pod is idle with an empty queue (SPEC §5, §6 wait)."""
    pod = env.start("ctx", extra=hooks_toml("SessionStart", "echo remember the milk"))
    wait_until(lambda: "remember the milk" in str(pod.call("history", since=0)), what="the context")
    assert pod.call("status")["queue"] == {"runs": 0, "notifications": 0}
    waited = env.podctl("wait", "ctx", "--timeout", "10")
    assert waited.returncode == 0, waited.stderr
    with pod.client() as c:
        assert c.run_wait("what should I remember?").outcome == "finished"
    assert "remember the milk" in str(env.model.requests[-1]["body"])


def test_session_start_context_of_an_earlier_start_no_request_read_is_replaced(env: Env) -> None:
    """Found by QA: a unit pod restarted while idle (a crash, the watchdog, a login) stacked
    one SessionStart output per start, and its next request read them all, stale snapshots
    (`git status`, say) beside the current one. Only the newest start's waits."""
    count = env.work / "starts"
    hook = f"n=$(($(cat {count} 2>/dev/null || echo 0) + 1)); echo $n > {count}; echo start no. $n"
    extra = hooks_toml("SessionStart", hook)
    pod = env.start("restarts", extra=extra)
    with pod.client() as c:
        assert c.run_wait("first").outcome == "finished"
    assert "start no. 1" in str(env.model.requests[-1]["body"])

    def logged(pod: PodProcess, text: str) -> Callable[[], bool]:
        return lambda: text in str(pod.call("history", since=0))

    for n in (2, 3):
        pod.stop()
        pod = env.restart(pod, "--resume")
        wait_until(logged(pod, f"start no. {n}"), what=f"start no. {n}")
    with pod.client() as c:
        assert c.run_wait("after two restarts").outcome == "finished"
    body = str(env.model.requests[-1]["body"])
    assert "start no. 3" in body and "start no. 2" not in body
    assert "start no. 2" in str(pod.call("history", since=0))  # in the log, never read


def test_session_start_at_first_start_gets_the_session_its_first_input_starts(env: Env) -> None:
    seen = env.work / "session-start.json"
    env.model.script({"text": "ok"})
    pod = env.start("fresh", extra=hooks_toml("SessionStart", f"cat > {seen}"))
    wait_until(lambda: seen.exists() and seen.read_text().endswith("}"), what="the hook's input")
    with pod.client() as c:
        assert c.status().session_id is None
        assert c.run_wait("first input").outcome == "finished"
        sid = c.status().session_id
    event = json.loads(seen.read_text())
    assert (event["hook_event_name"], event["source"]) == ("SessionStart", "startup")
    assert event["session_id"] == sid
    assert Path(event["transcript_path"]).name.startswith(sid)
    assert Path(event["transcript_path"]).exists()


def test_the_first_prompt_of_a_fresh_pod_tells_its_hook_the_session_it_starts(env: Env) -> None:
    # A client that sends at once after READY: the session's file may not be made yet.
    seen = env.work / "prompt.json"
    env.model.script({"text": "ok"})
    pod = env.start("eager", extra=hooks_toml("UserPromptSubmit", f"cat > {seen}"))
    pod.call("run", input="first input", wait=True)
    event = json.loads(seen.read_text())
    sid = pod.call("status")["session_id"]
    assert event["session_id"] == sid
    assert Path(event["transcript_path"]).name.startswith(sid)


def test_a_retried_run_gets_its_original_result_whatever_the_hook_says_now(env: Env) -> None:
    # SPEC §5: same client_key + same input => the original result. The prompt was judged
    # (and committed) the first time; a hook that refuses the retry must not make the client
    # believe that nothing was committed (-32009), nor run again for a prompt it already saw.
    count = env.work / "count"
    hook = f"""
import sys
from pathlib import Path
count = Path({str(count)!r})
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n > 1:
    print(f"refused on call {{n}}", file=sys.stderr)
    sys.exit(2)
"""
    env.model.script({"text": "fine"})
    pod = env.start("retry", extra=hooks_toml("UserPromptSubmit", script(env, "once.py", hook)))
    first = pod.call("run", input="deploy", client_key="k1", wait=True)
    again = pod.call("run", input="deploy", client_key="k1", wait=True)
    assert again["run_id"] == first["run_id"] and again["outcome"] == "finished"
    with pytest.raises(RpcError) as err:
        pod.call("run", input="something else", client_key="k1")
    assert err.value.code == -32006  # the key conflict, not the hook's refusal
    assert count.read_text() == "1"


def test_a_redelivered_notification_or_child_report_runs_its_hook_once(env: Env) -> None:
    # A retried notify (same client_key) and a child's report delivered again (same
    # event_id: its acknowledgement was lost) are accepted once; their hooks see them once.
    extra = hooks_toml("Notification", "cat > /dev/null") + hooks_toml("SubagentStop", "true")
    pod = env.start("hooked", extra=extra)
    for _ in range(2):
        pod.call("notify", message="build failed", source="ci", client_key="n1")
        pod.call("pod_event", pod="kid", kind="run.finished", event_id="e1", outcome="finished")

    def events() -> list[str]:
        return sorted(e["event"] for e in hook_runs(pod))

    wait_until(lambda: len(events()) >= 2, what="both hooks")
    drained(pod)  # a turn later: a second run of either hook would have been recorded
    assert events() == ["Notification", "SubagentStop"]


def test_a_burst_of_notifications_runs_its_hooks_a_few_at_a_time(env: Env) -> None:
    # Each Notification hook started as its notification came: a burst of 300 ran 300 hook
    # commands at once, and a flood could exhaust the user's processes. Now at most
    # handlers.MAX_BACKGROUND_HOOKS run at once; every one still runs.
    from poddaemon.handlers import MAX_BACKGROUND_HOOKS

    log = env.work / "hooks.log"
    hook = f"echo start >> {log}; sleep 0.2; echo end >> {log}"
    pod = env.start("hooked", extra=hooks_toml("Notification", hook))
    count = 3 * MAX_BACKGROUND_HOOKS
    with pod.client() as c:
        for i in range(count):
            c.notify(f"burst {i}")

    wait_until(lambda: len(hook_runs(pod)) == count, what="every Notification hook")
    running = most = 0
    for line in log.read_text().split():
        running += 1 if line == "start" else -1
        most = max(most, running)
    assert most <= MAX_BACKGROUND_HOOKS


REASON = "2 tests still fail: run pytest before you stop"
# Blocks only while the run is not already continuing because of it (Claude Code's way to
# avoid an endless loop), and logs each stop_hook_active it is given.
STOP_UNLESS_ACTIVE = """
import json, sys
data = json.load(sys.stdin)
with open({seen!r}, "a") as f:
    f.write(json.dumps(data["stop_hook_active"]) + "\\n")
assert data["outcome"] == "finished", data
if not data["stop_hook_active"]:
    {block}
"""
BLOCKS = {
    "exit 2": f"print({REASON!r}, file=sys.stderr); sys.exit(2)",
    "json": f"print(json.dumps({{'decision': 'block', 'reason': {REASON!r}}}))",
}


@pytest.mark.parametrize("form", BLOCKS)
def test_a_blocking_stop_hook_gives_the_model_its_reason_and_the_run_goes_on(
    env: Env, form: str
) -> None:
    seen = env.work / "stop_hook_active.log"
    body = STOP_UNLESS_ACTIVE.format(seen=str(seen), block=BLOCKS[form])
    env.model.script({"text": "first answer"}, {"text": "second answer"})
    pod = env.start("keepgoing", extra=hooks_toml("Stop", script(env, "stop.py", body)))
    with pod.client() as watcher:
        watcher.subscribe()
        with pod.client() as c:
            result = c.run_wait("make the tests pass")
        events = collect_run(watcher, result.run_id)
    assert result.outcome == "finished" and result.text == "second answer"
    first, second = (str(r["body"]) for r in env.model.requests)
    assert REASON not in first and f"Stop hook: {REASON}" in second
    notes = [e.data for e in events if e.type == "notification.committed"]
    assert [(n["source"], n["message"]) for n in notes] == [("hook:Stop", f"Stop hook: {REASON}")]
    assert [e.type for e in events].count("run.finished") == 1
    stops = [e for e in hook_runs(pod) if e["event"] == "Stop"]
    assert [(e["exit"], e["decision"]) for e in stops] == [
        (2 if form == "exit 2" else 0, "block"),
        (0, "ok"),
    ]
    assert [e["kind"] for e in entries(pod)].count("run_end") == 1
    # The stop waits for hooks still running in the background: a Stop hook run again after
    # run_end would have logged a third line by the time the pod has exited.
    assert pod.stop() == 0
    assert seen.read_text().split() == ["false", "true"]


ALWAYS_BLOCK = """
import json, sys
data = json.load(sys.stdin)
with open({seen!r}, "a") as f:
    f.write(f"{{data['outcome']}} {{json.dumps(data['stop_hook_active'])}}\\n")
sys.exit(2)
"""


def test_a_run_a_stop_hook_kept_going_to_its_limit_says_so_after_the_fact(env: Env) -> None:
    """Blocked at its first answer, the run reaches max_turns in a tool round: the Stop hooks
    it runs after the fact are told stop_hook_active true, as on every call since the first
    block."""
    seen = env.work / "stops.log"
    body = ALWAYS_BLOCK.format(seen=str(seen))
    env.model.script({"text": "one"}, {"tool_calls": [{"name": "list_dir", "arguments": {}}]})
    hook = script(env, "block.py", body)
    extra = hooks_toml("Stop", hook)
    pod = env.start("stubborn", "--set", "worker.max_turns=2", tools=["list_dir"], extra=extra)
    with pod.client() as c:
        assert c.run_wait("finish it").outcome == "limit_reached"
    assert pod.stop() == 0  # the after-the-fact hook has run by then
    assert seen.read_text().splitlines() == ["finished false", "limit_reached true"]


def test_a_stop_hook_blocking_the_answer_of_the_last_round_runs_once_for_it(env: Env) -> None:
    """Found by QA: blocked at its answer on the round max_turns allows last, the run ends
    `limit_reached`, and its end ran every Stop hook again after the fact: twice for one
    end. The hooks that judged that answer were its end's."""
    seen = env.work / "stops.log"
    env.model.script({"text": "one"}, {"text": "two"})
    hook = script(env, "block.py", ALWAYS_BLOCK.format(seen=str(seen)))
    pod = env.start("stubborn", "--set", "worker.max_turns=2", extra=hooks_toml("Stop", hook))
    with pod.client() as c:
        result = c.run_wait("finish it")
    assert (result.outcome, result.text) == ("limit_reached", "two")
    assert pod.stop() == 0  # a hook run after the fact has run by then
    assert seen.read_text().splitlines() == ["finished false", "finished true"]


SLOW_STOP = """
import sys, time
from pathlib import Path
marker = Path({marker!r})
if not marker.exists():
    marker.write_text("running")
    time.sleep(1391)
"""


def hook_gone(env: Env, name: str = "slow_stop.py") -> bool:
    found = subprocess.run(["pgrep", "-f", str(env.work / name)], check=False)
    return found.returncode == 1


def held_in_a_stop_hook(env: Env, name: str, answer: str) -> tuple[PodProcess, str]:
    """A pod whose run "the work" gave its final answer and waits on a slow Stop hook."""
    marker = env.work / "stop-hook-started"
    hook = script(env, "slow_stop.py", SLOW_STOP.format(marker=str(marker)))
    env.model.script({"text": answer})
    pod = env.start(name, extra=hooks_toml("Stop", hook, timeout=3600))
    with pod.client() as c:
        run_id = c.run("the work").run_id
    wait_until(marker.exists, what="the Stop hook to run")
    return pod, run_id


def test_a_kill_during_a_stop_hook_loses_nothing_and_the_run_ends_once(env: Env) -> None:
    pod, first = held_in_a_stop_hook(env, "slowstop", "first answer")
    with pod.client() as c:
        queued = c.run("more work")  # acknowledged while the Stop hook runs
        sid = c.status().session_id
    assert queued.state == "queued" and sid
    pod.kill9()
    before = len(env.model.requests)
    again = env.restart(pod, "--resume")
    entries_ = check_restored(
        env,
        again,
        sid,
        runs={first: "the work", queued.run_id: "more work"},
        interrupted=first,
        before=before,
    )
    ends = [e for e in entries_ if e["kind"] == "run_end"]
    assert [e["run_id"] for e in ends] == [first, queued.run_id]
    assert ends[1]["outcome"] == "finished"
    wait_until(lambda: hook_gone(env), what="the killed pod's Stop hook to be gone")


# A resume's context comes late (1 s): a model call that did not wait for it went out without it.
SESSION_START_SOURCE = """
import json, sys, time
source = json.load(sys.stdin)["source"]
if source == "resume":
    time.sleep(1)
print(f"SS-CONTEXT-{source}")
"""


def test_restored_work_waits_for_the_session_start_hooks(env: Env) -> None:
    """Found by QA: a restart took the interrupted run up (its model call) before the
    SessionStart ("resume") hooks had run: the request lacked their context, committed after
    the run had ended. Claude Code runs them before the model acts; so does a restored pod."""
    marker = env.work / "stop-hook-started"
    slow = script(env, "slow_stop.py", SLOW_STOP.format(marker=str(marker)))
    stop = hooks_toml("Stop", slow, timeout=3600)
    start = hooks_toml("SessionStart", script(env, "ss.py", SESSION_START_SOURCE))
    env.model.script({"text": "first answer"}, {"text": "after restart"})
    pod = env.start("ssresume", extra=stop + start)
    with pod.client() as c:
        first = c.run("the work").run_id
    wait_until(marker.exists, what="the Stop hook to run")
    pod.kill9()
    before = len(env.model.requests)
    again = env.restart(pod, "--resume")
    wait_until(lambda: settled(again), what="the restored pod to take its work up")
    (request,) = env.model.requests[before:]
    assert "SS-CONTEXT-resume" in str(request["body"])
    log = entries(again)
    context = [e["seq"] for e in log if e.get("source") == "hook:SessionStart"]
    started = [e["seq"] for e in log if e["kind"] == "run_start" and e["run_id"] != first]
    assert len(context) == 2 and len(started) == 1 and context[1] < started[0], log
    wait_until(lambda: hook_gone(env), what="the killed pod's Stop hook to be gone")


def test_cancel_during_a_stop_hook_kills_it_and_ends_the_run_cancelled(env: Env) -> None:
    pod, run_id = held_in_a_stop_hook(env, "cancelstop", "an answer")
    assert pod.call("status")["state"] == "running"
    assert pod.call("cancel")["cancelled"]
    ends = wait_until(
        lambda: [e for e in entries(pod) if e["kind"] == "run_end"], what="the run's end"
    )
    assert [(e["run_id"], e["outcome"], e["text"]) for e in ends] == [
        (run_id, "cancelled", "an answer")
    ]
    wait_until(lambda: hook_gone(env), timeout=5, what="the Stop hook to be killed")
    assert pod.stop() == 0


COUNTING_STOP = """
import json, sys, time
with open({seen!r}, "a") as f:
    f.write(json.load(sys.stdin)["outcome"] + "\\n")
time.sleep(1391)
"""


@pytest.mark.parametrize("how", ["cancel", "stop"])
def test_a_stop_hook_killed_on_a_final_answer_is_not_started_again_after_the_fact(
    env: Env, how: str
) -> None:
    """A cancel or a stop kills the Stop hook that holds up a run's end; it ran again at once
    for the same run (outcome `cancelled` or `error`), and a stop waited 5 s on it."""
    seen = env.work / "seen"
    hook = script(env, "counting_stop.py", COUNTING_STOP.format(seen=str(seen)))
    env.model.script({"text": "an answer"})
    pod = env.start("countstop", extra=hooks_toml("Stop", hook, timeout=3600))
    with pod.client() as c:
        c.run("the work")
    # Its line, not only its file: a hook cancelled between open() and its buffered write
    # leaves the file empty (the test failed so under load, once).
    wait_until(lambda: seen.exists() and seen.read_text(), what="the Stop hook to run")
    if how == "cancel":
        assert pod.call("cancel")["cancelled"]
        wait_until(
            lambda: [e for e in entries(pod) if e["kind"] == "run_end"], what="the run's end"
        )
    assert pod.stop() == 0  # (background hooks have up to 5 s: an after-the-fact one started)
    assert seen.read_text().splitlines() == ["finished"]
    wait_until(lambda: hook_gone(env, "counting_stop.py"), what="the Stop hook to be killed")


def test_a_hook_script_run_with_interpreter_options_outside_the_scope_runs(env: Env) -> None:
    """`python -u /elsewhere/stop.py`: the script behind an option was not granted, Python
    exited 2 ("can't open file"), which a Stop hook means as a block: every final answer was
    refused, and the run went on to max_turns (50 model calls)."""
    hooks = env.home / "hooks"
    hooks.mkdir()
    (hooks / "stop.py").write_text("import json, sys\nassert json.load(sys.stdin)['outcome']\n")
    env.model.script(*[{"text": "the answer"}] * 3)
    pod = env.start("optioned", extra=hooks_toml("Stop", f"{PY} -u {hooks}/stop.py"))
    with pod.client() as c:
        assert c.run_wait("go").outcome == "finished"
    assert len(env.model.requests) == 1
    assert [(r["event"], r["exit"], r["decision"]) for r in hook_runs(pod)] == [("Stop", 0, "ok")]


def _held_in_a_post_hook(env: Env, name: str) -> PodProcess:
    """A pod whose `bash` call appended a line (once) and waits on a slow PostToolUse hook."""
    marker = env.work / "post-hook-started"
    hook = script(env, "slow_post.py", SLOW_STOP.format(marker=str(marker)))
    command = "echo line >> appended.txt; echo appended-once"
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]},
        {"text": "after"},
    )
    extra = hooks_toml("PostToolUse", hook, matcher="bash", timeout=3600)
    pod = env.start(name, tools=["bash"], extra=extra)
    with pod.client() as c:
        c.run("append a line")
    wait_until(marker.exists, what="the PostToolUse hook to run")
    assert (env.work / "appended.txt").read_text() == "line\n"
    return pod


@pytest.mark.parametrize("how", ["cancel", "stop", "kill9"])
def test_a_call_whose_posttooluse_hook_is_cut_short_keeps_what_the_tool_did(
    env: Env, how: str
) -> None:
    """The command had finished (its output in hand) when a cancel, a shutdown or a crash cut
    its slow PostToolUse hook short: its result told the model "It did not finish: check its
    effects before running it again" and dropped the output, so a model would run an append
    twice."""
    pod = _held_in_a_post_hook(env, "cutpost")
    if how == "cancel":
        assert pod.call("cancel")["cancelled"]
        wait_until(lambda: tool_results(pod), what="the call's result")
        (result,) = tool_results(pod)
    else:
        if how == "stop":
            assert pod.stop() == 0
        else:
            pod.kill9()
        again = env.restart(pod, "--resume")
        (result,) = tool_results(again)
        assert "not run to the end" in result["output"], result
    assert "appended-once" in result["output"], result
    assert "did not finish" not in result["output"], result
    wait_until(lambda: hook_gone(env, "slow_post.py"), what="the PostToolUse hook to be killed")


def test_a_call_whose_posttooluse_hook_a_crash_cuts_short_after_a_fork_keeps_its_output(
    env: Env,
) -> None:
    """Another writer moved the log's head while the hook ran: the pod forked at its next
    entry (a notification), and the fork's first entry did not carry the call's tool_output.
    A crash then restored the finished command as "It did not finish: check its effects"."""
    pod = _held_in_a_post_hook(env, "forkpost")
    old = pod.call("status")["session_id"]
    intrude(env, old)
    pod.call("notify", message="while the hook runs", source="ci")
    new = pod.call("status")["session_id"]
    assert new != old
    pod.kill9()
    again = env.restart(pod, "--resume")
    (result,) = tool_results(again)
    assert "appended-once" in result["output"] and "not run to the end" in result["output"]
    assert "did not finish" not in result["output"], result
    assert (env.work / "appended.txt").read_text() == "line\n"
    assert env.podctl("sessions", "verify", new).returncode == 0
    wait_until(lambda: hook_gone(env, "slow_post.py"), what="the PostToolUse hook to be killed")


DEEP_JSON = 'import sys; sys.stdout.write("{\\"a\\": " + "[" * 200000)\n'


def test_a_hook_printing_json_nested_too_deeply_neither_breaks_start_up_nor_a_tool_call(
    env: Env,
) -> None:
    # Before: json.loads' RecursionError escaped the hook's verdict: the pod's start-up died
    # with a traceback (SessionStart), the guarded call was an "internal error" with no record.
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "done"}
    )
    deep = script(env, "deep.py", DEEP_JSON)
    extra = hooks_toml("SessionStart", deep) + hooks_toml("PreToolUse", deep)
    pod = env.start("deep", tools=["list_dir"], extra=extra)
    with pod.client() as c:
        assert c.run_wait("go").outcome == "finished"
    runs = [(e["event"], e["decision"]) for e in hook_runs(pod)]
    assert runs == [("SessionStart", "warning"), ("PreToolUse", "block")]
    (tool,) = tool_results(pod)
    assert tool["is_error"] and "nested too deeply" in tool["output"]


ALLOW = json.dumps({"hookSpecificOutput": {"permissionDecision": "allow"}})


def test_an_allow_from_one_hook_does_not_skip_another_hooks_deny(env: Env) -> None:
    # Claude Code runs every matching hook and a deny beats an allow; the first allow here
    # skipped the hooks after it, so a guard listed after an auto-approver never ran.
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "done"}
    )
    approve = hooks_toml("PreToolUse", f"echo '{ALLOW}'")
    guard = hooks_toml("PreToolUse", "echo 'no listing' >&2; exit 2", matcher="list_dir")
    pod = env.start("twoguards", tools=["list_dir"], extra=approve + guard)
    with pod.client() as c:
        assert c.run_wait("go").outcome == "finished"
    runs = [(e["event"], e["decision"]) for e in hook_runs(pod)]
    assert runs == [("PreToolUse", "allow"), ("PreToolUse", "block")]
    (tool,) = tool_results(pod)
    assert tool["is_error"] and "no listing" in tool["output"]


def test_a_guard_the_model_kept_from_starting_blocks_instead_of_waving_calls_through(
    env: Env,
) -> None:
    # The model moved the pod's pwd (the hooks' cwd) away with bash: the guard could not be
    # started, which counted as a warning, and the write it guards went through.
    sub = env.work / "sub"
    sub.mkdir()
    target = str(env.work / "moved" / "x")
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": "cd .. && mv sub moved"}}]},
        {"tool_calls": [{"name": "write_file", "arguments": {"path": target, "content": "x"}}]},
        {"text": "done"},
    )
    guard = hooks_toml("PreToolUse", "echo no writes >&2; exit 2", matcher="write_file")
    pod = env.start("unstarted", tools=["bash", "write_file"], pwd=str(sub), extra=guard)
    with pod.client() as c:
        assert c.run_wait("go").outcome == "finished"
    assert not Path(target).exists()
    (run,) = hook_runs(pod)
    assert run["decision"] == "block" and "could not start" in run["reason"]
    write = tool_results(pod)[-1]
    assert write["is_error"] and "could not start" in write["output"]


def test_a_stop_hook_saying_continue_false_ends_the_run(env: Env) -> None:
    # Read as a block, Claude Code's "stop now" gave the model another round, each of which
    # the hook answered alike, until max_turns.
    stop = json.dumps({"continue": False, "stopReason": "out of time"})
    env.model.script({"text": "first answer"}, {"text": "second answer"})
    pod = env.start("stopnow", extra=hooks_toml("Stop", f"echo '{stop}'"))
    with pod.client() as c:
        result = c.run_wait("work")
    assert (result.outcome, result.text) == ("finished", "first answer")
    assert len(env.model.requests) == 1


def test_continue_false_from_any_stop_hook_beats_another_ones_block(env: Env) -> None:
    # Claude Code runs every Stop hook and "continue": false wins over a block. The first
    # hook's block ended the hooks there, and the run went on against the second's word.
    stop = json.dumps({"continue": False, "stopReason": "out of time"})
    extra = hooks_toml("Stop", "echo 'keep going' >&2; exit 2") + hooks_toml(
        "Stop", f"echo '{stop}'"
    )
    env.model.script({"text": "first answer"}, {"text": "second answer"})
    pod = env.start("stopwins", extra=extra)
    with pod.client() as c:
        result = c.run_wait("work")
    assert (result.outcome, result.text) == ("finished", "first answer")
    assert len(env.model.requests) == 1
    assert [r["decision"] for r in hook_runs(pod)] == ["block", "stop"]


def test_a_post_tool_use_hooks_additional_context_reaches_the_model(env: Env) -> None:
    # Claude Code adds it for the model to read after the tool's result (a linter's verdict
    # on the file just written); it was parsed and dropped.
    said = {"hookSpecificOutput": {"hookEventName": "PostToolUse", "additionalContext": "lint: ok"}}
    hook = f"echo {shlex.quote(json.dumps(said))}"
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "done"}
    )
    pod = env.start("context", tools=["list_dir"], extra=hooks_toml("PostToolUse", hook))
    with pod.client() as c:
        assert c.run_wait("list").outcome == "finished"
    (result,) = tool_results(pod)
    assert result["output"].endswith("\n[PostToolUse hook] lint: ok")
    assert "[PostToolUse hook] lint: ok" in json.dumps(env.model.requests[-1]["body"])


def test_tool_hooks_get_claude_codes_tool_use_id(env: Env) -> None:
    # A guard written for Claude Code that read it failed with a KeyError (exit 1, a warning)
    # and the call it guards ran.
    seen = env.work / "ids"
    guard = f"python3 -c 'import json,sys; print(json.load(sys.stdin)[\"tool_use_id\"])' >> {seen}"
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "ok"}
    )
    extra = hooks_toml("PreToolUse", guard) + hooks_toml("PostToolUse", guard)
    pod = env.start("ids", tools=["list_dir"], extra=extra)
    with pod.client() as c:
        assert c.run_wait("list").outcome == "finished"
    (call,) = tool_results(pod)
    assert seen.read_text().split() == [call["call_id"], call["call_id"]]


LAST_WORDS = """
import json, sys
event = json.load(sys.stdin)
last = ""
with open(event["transcript_path"]) as log:
    for line in log:
        entry = json.loads(line)
        if entry["kind"] == "assistant" and entry["item"]["text"]:
            last = entry["item"]["text"]
with open(sys.argv[1], "a") as out:
    out.write(json.dumps([event["session_id"], last]) + "\\n")
"""


@pytest.mark.skipif(available() == 0, reason="this kernel has no Landlock")
def test_a_stop_hook_reads_its_transcript_when_the_home_is_reached_through_a_link(
    env: Env,
) -> None:
    """The sandbox opens its grants following no link on the way (another user could swap a
    directory for one): the transcript's grant names the file as resolved, or a home reached
    through a symlink (`/home` linked elsewhere) left the hook unable to read it."""
    link = env.home.parent / f"{env.home.name}-link"
    link.symlink_to(env.home)
    try:
        env.env["PODDAEMON_HOME"] = str(link)
        seen = env.work / "seen.jsonl"
        env.model.script({"text": "the last words"})
        stop = hooks_toml("Stop", f"{script(env, 'last.py', LAST_WORDS)} {seen}")
        pod = env.start("linkedhome", tools=["bash"], extra=stop)
        with pod.client() as c:
            assert c.run_wait("talk").outcome == "finished"
            session = pod.call("status")["session_id"]
        assert json.loads(seen.read_text()) == [session, "the last words"]
    finally:
        link.unlink()


# A jq-free shell hook: the transcript's size (`wc` fails if it cannot open it: exit 1).
PROBE = """p=$(sed 's/.*"transcript_path": "\\([^"]*\\)".*/\\1/'); wc -c "$p" >&2"""


@pytest.mark.skipif(available() == 0, reason="this kernel has no Landlock")
def test_a_stop_hook_reads_its_transcript_and_the_pods_bash_still_cannot(env: Env) -> None:
    """Claude Code's Stop hooks read `transcript_path` (the last assistant message). The hook
    ran confined to the pod's scope, which never grants the session logs: it could not open
    it (exit 1, a warning). Only the hooks get it, read-only, and after a compaction the new
    session's: the model's bash still cannot read any."""
    seen = env.work / "seen.jsonl"
    env.model.script({"text": "the last words"})
    stop = hooks_toml("Stop", f"{script(env, 'last.py', LAST_WORDS)} {seen}")
    probe = hooks_toml("PostToolUse", PROBE)
    pod = env.start("reader", tools=["bash"], extra=stop + probe)
    with pod.client() as c:
        assert c.run_wait("talk").outcome == "finished"
        session = pod.call("status")["session_id"]
        assert json.loads(seen.read_text()) == [session, "the last words"]
        transcript = env.home / "data" / "sessions" / f"{session}.jsonl"
        env.model.script(
            {"tool_calls": [{"name": "bash", "arguments": {"command": f"cat {transcript}"}}]},
            {"text": "more words"},
        )
        assert c.run_wait("read your log").outcome == "finished"
    (result,) = tool_results(pod)
    assert "Permission denied" in result["output"] and "session_start" not in result["output"]
    runs = [(r["event"], r["decision"], r.get("reason")) for r in hook_runs(pod)]
    assert runs == [("Stop", "ok", None), ("PostToolUse", "ok", None), ("Stop", "ok", None)], runs
    assert json.loads(seen.read_text().splitlines()[1]) == [session, "more words"]
    assert transcript.read_text().count("session_start") == 1  # not written to
    # Compaction moves the pod to a new session (a new file): its hooks read that one.
    assert env.podctl("compact", "reader").returncode == 0
    env.model.script({"text": "compacted words"})
    with pod.client() as c:
        assert c.run_wait("go on").outcome == "finished"
    now = pod.call("status")["session_id"]
    assert now != session
    assert json.loads(seen.read_text().splitlines()[-1]) == [now, "compacted words"]


def test_exit_2_of_a_hook_that_cannot_block_tells_the_user_its_stderr(env: Env) -> None:
    """Claude Code's contract: exit 2 of a Notification (SessionStart, PreCompact) hook blocks
    nothing and "shows stderr to user only". It was recorded as a block no one acted on, and
    no one saw it: an alert says it now, as for any other failing hook."""
    hook = "echo 'the pager is down' >&2; exit 2"
    env.model.script({"text": "ok"})
    pod = env.start("paged", extra=hooks_toml("Notification", hook))
    with pod.client() as watcher, pod.client() as c:
        watcher.subscribe()
        c.notify("disk at 91%", source="monitor")
        alert = next(e for e in watcher.events() if e.type == "alert")
    assert alert.data["source"] == "hook" and "the pager is down" in alert.data["message"]
    assert "Notification hook" in alert.data["message"]


@pytest.mark.parametrize("event", ["PreToolUse", "PostToolUse"])
def test_continue_false_from_a_tool_hook_stops_the_run(env: Env, event: str) -> None:
    """Claude Code's `"continue": false` stops the agent, unlike a block, which only refuses
    the call. Read as a block, the model was told the reason and went on working (other
    tools, other calls) against the hook's word."""
    halt = json.dumps({"continue": False, "stopReason": "too many edits: stop"})
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]},
        {"text": "never asked"},
    )
    extra = hooks_toml(event, f"echo {shlex.quote(halt)}", matcher="list_dir")
    pod = env.start("halted", tools=["list_dir"], extra=extra)
    with pod.client() as c:
        result = c.run_wait("work")
    assert result.outcome == "cancelled", result
    assert f"stopped by a {event} hook: too many edits: stop" in str(result.error)
    assert len(env.model.requests) == 1
    (tool,) = tool_results(pod)
    assert tool["is_error"] == (event == "PreToolUse")  # a PreToolUse halt runs no call
    with pod.client() as c:  # the next run is not stopped too
        env.model.script({"text": "fine"})
        assert c.run_wait("again").outcome == "finished"


def first_alert_of_a_finished_run(pod: Any, text: str) -> Any:
    """The first `alert` event a subscriber sees while a run of `text` finishes."""
    with pod.client() as watcher, pod.client() as c:
        watcher.subscribe()
        assert c.run_wait(text).outcome == "finished"
        return next(e for e in watcher.events() if e.type == "alert")


def test_a_hooks_system_message_reaches_the_user(env: Env) -> None:
    """Claude Code's common JSON field `systemMessage` is "a warning message shown to the
    user", on any event; a pod dropped it: now it is an alert (the model never sees it)."""
    said = json.dumps({"systemMessage": "the linter is slow today"})
    env.model.script({"text": "ok"})
    pod = env.start("told", extra=hooks_toml("UserPromptSubmit", f"echo {shlex.quote(said)}"))
    alert = first_alert_of_a_finished_run(pod, "go")
    assert alert.data["source"] == "hook" and "the linter is slow today" in alert.data["message"]
    assert "the linter is slow today" not in str(env.model.requests[0]["body"])


def test_a_hook_command_finds_its_script_through_claude_project_dir(env: Env) -> None:
    """Claude Code gives hook commands CLAUDE_PROJECT_DIR, and its documented way to name a
    project's hook script is `"$CLAUDE_PROJECT_DIR"/.claude/hooks/guard.sh`. Unset here, the
    command ran `/.claude/hooks/guard.sh`: not found (exit 127, a warning), and the call it
    guards went ahead."""
    hooks = env.work / ".claude" / "hooks"
    hooks.mkdir(parents=True)
    (hooks / "guard.sh").write_text(SH_GUARD)
    (hooks / "guard.sh").chmod(0o755)
    env.model.script(
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "x.txt", "content": "x"}}]},
        {"text": "done"},
    )
    guard = '"$CLAUDE_PROJECT_DIR"/.claude/hooks/guard.sh'
    pod = env.start("ported", tools=["write_file"], extra=hooks_toml("PreToolUse", guard))
    with pod.client() as c:
        assert c.run_wait("write").outcome == "finished"
    assert not (env.work / "x.txt").exists()
    (result,) = tool_results(pod)
    assert result["is_error"] and "guarded: no writes here" in result["output"]


def test_a_stop_hooks_stop_reason_reaches_the_user(env: Env) -> None:
    """Claude Code's stopReason is "shown to the user when continue is false". A Stop hook's
    ends the run `finished`: the reason was only in the log, and nobody was told why the
    run stopped there."""
    stop = json.dumps({"continue": False, "stopReason": "out of time"})
    env.model.script({"text": "first answer"})
    pod = env.start("stopsaid", extra=hooks_toml("Stop", f"echo {shlex.quote(stop)}"))
    alert = first_alert_of_a_finished_run(pod, "work")
    assert alert.data["source"] == "hook" and "out of time" in alert.data["message"]


def test_a_block_that_stops_nothing_does_not_skip_the_events_other_hooks(env: Env) -> None:
    """Claude Code runs every matching hook of an event. A pod stopped at the first block, which
    is right where the block refuses something (PreToolUse, UserPromptSubmit), but exit 2 of a
    SessionStart or PostToolUse hook stops nothing: the hooks after it never ran, and the
    context they add (the project's notes, a linter's report) silently never reached the model."""
    fail = "echo 'lint is unhappy' >&2; exit 2"
    notes = "echo 'NOTES: use tabs'"
    linted = json.dumps({"hookSpecificOutput": {"additionalContext": "LINT: 2 warnings"}})
    extra = (
        hooks_toml("SessionStart", fail)
        + hooks_toml("SessionStart", notes)
        + hooks_toml("PostToolUse", fail, matcher="list_dir")
        + hooks_toml("PostToolUse", f"echo {shlex.quote(linted)}", matcher="list_dir")
    )
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "done"}
    )
    pod = env.start("allrun", tools=["list_dir"], extra=extra)
    with pod.client() as c:
        assert c.run_wait("work").outcome == "finished"
    assert "NOTES: use tabs" in str(env.model.requests[0]["body"])
    (tool,) = tool_results(pod)
    assert "lint is unhappy" in tool["output"] and "LINT: 2 warnings" in tool["output"]
    runs = [(r["event"], r["decision"]) for r in hook_runs(pod)]
    assert runs.count(("SessionStart", "ok")) == 1 and runs.count(("PostToolUse", "ok")) == 1


@pytest.mark.parametrize("disarm", ["rm -f guard.sh", "chmod -x guard.sh"])
def test_a_guard_script_the_model_removes_still_guards(env: Env, disarm: str) -> None:
    """A guard script in the pod's writable scope: the model's own bash removed it (or made it
    not executable), sh exited 127 (126), a warning, and every call it guarded ran from then
    on. A guard that cannot run has judged nothing: it blocks, as one that cannot start."""
    guard = env.work / "guard.sh"
    guard.write_text(SH_GUARD)
    guard.chmod(0o755)
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": disarm}}]},
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "x.txt", "content": "x"}}]},
        {"text": "done"},
    )
    extra = hooks_toml("PreToolUse", str(guard), matcher="write_file")
    pod = env.start("disarmed", tools=["bash", "write_file"], extra=extra)
    alert = first_alert_of_a_finished_run(pod, "work")  # the user hears of it too
    assert alert.data["source"] == "hook" and "could not run" in alert.data["message"]
    assert not (env.work / "x.txt").exists()
    disarmed, write = tool_results(pod)
    assert not disarmed["is_error"]
    assert write["is_error"] and "the hook could not run (exit 12" in write["output"]


def test_stop_hooks_of_a_burst_of_cancelled_runs_run_a_few_at_a_time(env: Env) -> None:
    """A run that does not finish runs its Stop hooks after the fact, in the background. Each
    started as its run ended: cancelling 40 queued runs ran 40 hook commands at once (80
    processes with their shells), where Notification hooks are held to a few at a time."""
    from poddaemon.hooks import AFTER_THE_FACT

    log = env.work / "stops.log"
    stop = f"echo start >> {log}; sleep 0.2; echo end >> {log}"
    env.model.script({"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]})
    extra = hooks_toml("PreToolUse", "sleep 193", timeout=60) + hooks_toml("Stop", stop)
    pod = env.start("cancels", tools=["list_dir"], extra=extra)
    count = 3 * AFTER_THE_FACT
    with pod.client() as c:
        c.call_raw("run", {"input": "held in its guard"})
        wait_until(lambda: any(e["kind"] == "assistant" for e in entries(pod)))
        queued = [json.loads(bytes(c.call_raw("run", {"input": f"q{i}"}))) for i in range(count)]
        assert all(q["state"] == "queued" for q in queued)
        for q in queued:
            c.call_raw("cancel", {"run_id": q["run_id"]})
        c.call_raw("cancel", {})  # the held one too

    stops = lambda: [r for r in hook_runs(pod) if r["event"] == "Stop"]  # noqa: E731
    wait_until(lambda: len(stops()) == count + 1, what="every Stop hook")
    running = most = 0
    for line in log.read_text().split():
        running += 1 if line == "start" else -1
        most = max(most, running)
    assert most <= AFTER_THE_FACT


@pytest.mark.skipif(not available(), reason="needs Landlock")
def test_status_says_which_guard_scripts_the_pods_commands_can_replace(env: Env) -> None:
    """A guard in the pod's writable scope is one `printf 'exit 0' > guard.sh` from letting
    everything through (a deny rule on it keeps its contents, not its name: a new file can be
    renamed over it). README says to keep guards outside; nothing told a user who did not."""
    inside = env.work / "guard.sh"
    outside = env.home / "outside-guard.sh"
    for guard in (inside, outside):
        guard.write_text(SH_GUARD)
        guard.chmod(0o755)
    extra = hooks_toml("PreToolUse", str(inside)) + hooks_toml("PreToolUse", str(outside))
    pod = env.start("exposed", tools=["list_dir"], extra=extra)
    status = env.podctl("status", pod.name).stdout
    replaceable = [line for line in status.splitlines() if "can replace it" in line]
    assert len(replaceable) == 1 and str(inside) in replaceable[0], status


# A JSON answer's "\ud800" escape: json.loads makes it a lone surrogate, which UTF-8 cannot carry.
LONE_SURROGATE = r"""print('{"decision": "block", "reason": "no \\ud800 here", '
      '"systemMessage": "said \\udfff", '
      '"hookSpecificOutput": {"additionalContext": "ctx \\ud800"}}')
"""


@pytest.mark.parametrize("event", ["PreToolUse", "PostToolUse", "UserPromptSubmit"])
def test_a_hook_answer_with_a_lone_surrogate_escape_does_not_stop_the_pod(
    env: Env, event: str
) -> None:
    """Found by QA: the text of a hook's JSON answer went to the session log as it came, and
    one holding a lone surrogate (valid JSON) failed the log's write: the pod stopped (exit 1)
    in the middle of the run. It is kept with U+FFFD in its place."""
    hook = script(env, "surrogate.py", LONE_SURROGATE)
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}, {"text": "done"}
    )
    pod = env.start("lone", tools=["list_dir"], extra=hooks_toml(event, hook))
    with pod.client() as c:
        if event == "UserPromptSubmit":
            with pytest.raises(RpcError) as refused:
                c.run_wait("go")
            assert refused.value.code == -32009 and "no \ufffd here" in refused.value.message
        else:
            assert c.run_wait("go").outcome == "finished"
    if event != "UserPromptSubmit":  # (a refused prompt commits nothing)
        (run,) = hook_runs(pod)
        assert run["decision"] == "block" and run["reason"] == "no \ufffd here", run
        (result,) = tool_results(pod)
        said = "blocked by a PreToolUse hook: " if event == "PreToolUse" else "[PostToolUse hook] "
        assert f"{said}no \ufffd here" in result["output"], result
        sid = pod.call("status")["session_id"]
        assert env.podctl("sessions", "verify", sid).returncode == 0
    assert pod.stop() == 0
