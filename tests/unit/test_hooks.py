"""`judge`: a finished hook's exit code and output to a decision (SPEC §10); pure."""

import json

import pytest

from poddaemon.hooks import TEXT_LIMIT, judge


@pytest.mark.parametrize(
    ("code", "stdout", "stderr", "expected"),
    [
        (0, "", "", ("ok", "", "")),
        (2, "", "no secrets\n", ("block", "no secrets", "")),
        (2, "", "", ("block", "no reason given", "")),  # "blocked by a PreToolUse hook: " …
        (1, "", "oops", ("warning", "exit 1: oops", "")),
        (127, "", "sh: nf", ("block", "the hook could not run (exit 127): sh: nf", "")),
        (None, "", "", ("warning", "timed out: killed with its process group", "")),
        (0, '{"decision": "block", "reason": "r"}', "", ("block", "r", "")),
    ],
)
def test_exit_codes_and_json_decisions(
    code: int | None, stdout: str, stderr: str, expected: tuple[str, str, str]
) -> None:
    assert judge("PreToolUse", code, stdout, stderr) == expected


def test_a_json_answer_that_cannot_be_read_is_a_warning_where_stdout_is_no_context() -> None:
    """A guard printing Python's `print(dict)` (single quotes) or two objects meant to block:
    read as plain output, "ok", the call ran and nobody was told."""
    for bad in ("{'decision': 'block', 'reason': 'r'}", '{"decision": "block"}\n{"x": 1}'):
        for event in ("PreToolUse", "PostToolUse", "Stop", "Notification"):
            decision, reason, _ = judge(event, 0, bad, "")
            assert decision == "warning" and "not valid JSON" in reason, (event, reason)
    assert judge("UserPromptSubmit", 0, "{not json", "") == ("ok", "", "{not json")  # context
    assert judge("PreToolUse", 0, "plain words", "") == ("ok", "", "")


def test_a_hook_that_could_not_run_blocks_only_where_it_guards() -> None:
    """sh's 127 (not found) and 126 (not executable): a guard judged nothing and fails closed;
    elsewhere, as any failing hook, a warning."""
    assert judge("UserPromptSubmit", 126, "", "")[0] == "block"
    assert judge("PostToolUse", 127, "", "nf") == ("warning", "exit 127: nf", "")


def test_permission_decisions_of_pre_tool_use() -> None:
    deny = {"hookSpecificOutput": {"permissionDecision": "deny", "permissionDecisionReason": "x"}}
    allow = {"hookSpecificOutput": {"permissionDecision": "allow"}}
    assert judge("PreToolUse", 0, json.dumps(deny), "") == ("block", "x", "")
    assert judge("PreToolUse", 0, json.dumps(allow), "") == ("allow", "", "")


def test_a_guard_that_asks_for_confirmation_blocks_where_nobody_can_give_it() -> None:
    """Claude Code's "ask" puts the call to its user; a pod has none, and running the tool
    (as any unknown value did) would let through what the guard wanted a person to see."""
    ask = {"hookSpecificOutput": {"permissionDecision": "ask", "permissionDecisionReason": "rm?"}}
    assert judge("PreToolUse", 0, json.dumps(ask), "") == (
        "block",
        "rm? (a pod has nobody to ask: not run)",
        "",
    )
    del ask["hookSpecificOutput"]["permissionDecisionReason"]
    decision, reason, _ = judge("PreToolUse", 0, json.dumps(ask), "")
    assert (decision, reason) == (
        "block",
        "the hook asks for confirmation (a pod has nobody to ask: not run)",
    )


def test_plain_stdout_is_context_only_where_the_event_takes_context() -> None:
    assert judge("UserPromptSubmit", 0, "note\n", "") == ("ok", "", "note")
    assert judge("Stop", 0, "note\n", "") == ("ok", "", "")


def test_context_and_reasons_are_cut_to_the_limit_and_say_so() -> None:
    big = "x" * (3 * TEXT_LIMIT)
    _, _, context = judge("UserPromptSubmit", 0, big, "")
    assert context.startswith("x" * TEXT_LIMIT)
    assert context.endswith(f"[hook output cut: {2 * TEXT_LIMIT} more characters]")
    _, reason, _ = judge("PreToolUse", 2, "", big)
    assert len(reason) < TEXT_LIMIT + 100 and "hook output cut" in reason
    assert judge("UserPromptSubmit", 0, "y" * TEXT_LIMIT, "")[2] == "y" * TEXT_LIMIT
    # What the reader never kept (past its 1 MiB) counts too: 50 MB cut is not "1 MB cut".
    _, _, context = judge("UserPromptSubmit", 0, big, "", unread=50_000_000)
    assert context.endswith(f"[hook output cut: {2 * TEXT_LIMIT + 50_000_000} more characters]")


@pytest.mark.parametrize(
    ("matcher", "tool", "expected"),
    [
        (None, "bash", True),
        ("*", "bash", True),
        ("bash", "bash", True),
        ("bash", "bash_output", False),  # a plain name is exact, as in Claude Code
        ("write_file|edit_file", "edit_file", True),
        ("write_file|edit_file", "write_file_x", False),
        ("^list", "list_dir", True),  # a regex is searched, unanchored: this never fired
        ("_file$", "read_file", True),
        ("_file$", "read_files", False),
        ("github__.*", "github__create_issue", True),
        ("^Bash$", "Bash", True),
    ],
)
def test_matcher_as_claude_code_reads_it(matcher: str | None, tool: str, expected: bool) -> None:
    from poddaemon.config.manifest import HookConfig
    from poddaemon.hooks import matches

    assert matches(HookConfig(command="true", matcher=matcher), tool) is expected


def test_a_json_answer_cut_at_the_output_limit_blocks_a_guard_and_warns_elsewhere() -> None:
    """A PreToolUse hook's block over 1 MiB was cut, read as plain text and let the tool run."""
    cut = '{"decision": "block", "reason": "RRRR'
    for guard in ("PreToolUse", "UserPromptSubmit"):
        decision, reason, _ = judge(guard, 0, cut, "", unread=5, stdout_cut=True)
        assert decision == "block" and "decision could not be read" in reason
    assert judge("PostToolUse", 0, cut, "", unread=5, stdout_cut=True)[0] == "warning"
    assert judge("PreToolUse", 0, "x" * 10, "", unread=5, stdout_cut=True)[0] == "ok"  # not JSON


def test_a_json_answer_nested_past_the_parser_blocks_a_guard_and_warns_elsewhere() -> None:
    """Valid JSON nested deeper than json.loads goes raised RecursionError out of `judge`: a
    SessionStart hook printing it made the pod fail its start-up with a traceback."""
    deep = '{"x": ' + "[" * 100_000 + "]" * 100_000 + ', "decision": "block"}'
    for guard in ("PreToolUse", "UserPromptSubmit"):
        decision, reason, _ = judge(guard, 0, deep, "")
        assert decision == "block" and "nested too deeply" in reason
    for other in ("SessionStart", "PostToolUse", "Stop"):
        assert judge(other, 0, deep, "")[0] == "warning"


def test_continue_false_ends_a_run_a_stop_hook_would_otherwise_keep_going() -> None:
    """Claude Code's `"continue": false` means "stop now" and beats a "block" on Stop; it was
    read as a block, which keeps the run going: the opposite."""
    stop = {"continue": False, "stopReason": "budget spent", "decision": "block", "reason": "r"}
    assert judge("Stop", 0, json.dumps(stop), "") == ("stop", "budget spent", "")
    assert judge("PreToolUse", 0, json.dumps(stop), "")[0] == "stop"  # not run, the run ends


def test_a_guard_that_rewrites_the_input_blocks_as_the_input_cannot_be_rewritten() -> None:
    """Claude Code's `updatedInput` runs the call with the hook's input; it was ignored, and
    the model's input, which the hook had replaced (say `rm -rf build` by `rm -ri build`), ran."""
    rewrite = {
        "hookSpecificOutput": {
            "permissionDecision": "allow",
            "updatedInput": {"command": "rm -ri build"},
        }
    }
    decision, reason, _ = judge("PreToolUse", 0, json.dumps(rewrite), "")
    assert decision == "block" and "updatedInput" in reason and reason.endswith("not run")
    deny = {"hookSpecificOutput": {"permissionDecision": "deny", "updatedInput": {}}}
    assert judge("PreToolUse", 0, json.dumps(deny), "")[0] == "block"


def test_a_hook_killed_by_a_signal_says_which() -> None:
    """A returncode below 0 is a signal: "exit -9: " told the user neither that the hook was
    killed nor by what (the OOM killer's SIGKILL, a SIGSEGV)."""
    assert judge("PreToolUse", -9, "", "") == ("warning", "killed by signal 9 (SIGKILL)", "")
    assert judge("Stop", -11, "", "core\n") == (
        "warning",
        "killed by signal 11 (SIGSEGV): core",
        "",
    )
