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
        (127, "", "sh: not found", ("warning", "exit 127: sh: not found", "")),
        (None, "", "", ("warning", "timed out: killed with its process group", "")),
        (0, '{"decision": "block", "reason": "r"}', "", ("block", "r", "")),
        (0, "{not json", "", ("ok", "", "")),
    ],
)
def test_exit_codes_and_json_decisions(
    code: int | None, stdout: str, stderr: str, expected: tuple[str, str, str]
) -> None:
    assert judge("PreToolUse", code, stdout, stderr) == expected


def test_permission_decisions_of_pre_tool_use() -> None:
    deny = {"hookSpecificOutput": {"permissionDecision": "deny", "permissionDecisionReason": "x"}}
    allow = {"hookSpecificOutput": {"permissionDecision": "allow"}}
    assert judge("PreToolUse", 0, json.dumps(deny), "") == ("block", "x", "")
    assert judge("PreToolUse", 0, json.dumps(allow), "") == ("allow", "", "")


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
