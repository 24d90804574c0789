"""`status`: answered inline when the pod has no live children, and its scope entries follow the
pod's current `Scope` (converted once per value, not per call)."""

import os
import tempfile
from typing import Any

import msgspec

from poddaemon.handlers import ScopeEntries, status_reply
from protocol.types import StatusResult
from tests.unit.test_restore import make_pod


class _Sandbox:
    status = "none"
    notes = ()
    rebuild = None


def _pod(tmp: str) -> Any:
    pod = make_pod(tmp)
    pod.s.entry = type("Entry", (), {"pid": os.getpid(), "parent": None})()
    pod.s.sandbox = _Sandbox()
    return pod


def test_without_children_status_is_a_plain_result_not_a_coroutine() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        pod = _pod(tmp)
        result = status_reply(pod, ScopeEntries())
        assert isinstance(result, StatusResult)
        assert result.children == [] and result.state == "idle"
        assert [e.target for e in result.scope] == [tmp]


def test_scope_entries_follow_a_replaced_scope_and_are_not_shared() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        pod = _pod(tmp)
        entries = ScopeEntries()
        first = status_reply(pod, entries)
        again = status_reply(pod, entries)
        assert msgspec.to_builtins(first.scope) == msgspec.to_builtins(again.scope)
        assert first.scope is not again.scope  # a caller may change its own list
        # Delegating an area to a child swaps in a new Scope value: status sees it at once.
        pod.scope = pod.scope.with_delegated([os.path.join(tmp, "child")])
        after = status_reply(pod, entries)
        denied = [e.target for e in after.scope if e.deny]
        assert denied == [os.path.join(tmp, "child")]
