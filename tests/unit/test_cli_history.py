"""`podctl history` paging (issue 9 item 15): the newest entries of a session of any size, and
how many earlier ones were left out, from the pod's forward-only `history(since, limit)`."""

import contextlib
import json
from typing import Any

import pytest

from cli import talk
from protocol.types import HistoryResult


class FakeClient:
    """Answers `history` like the pod: entries after `since`, at most `limit` (capped at `cap`)."""

    def __init__(self, count: int, cap: int = 10_000) -> None:
        self.entries = [{"seq": i, "kind": "assistant"} for i in range(1, count + 1)]
        self.cap = cap
        self.calls: list[tuple[int, int | None]] = []

    def history(self, since: int = 0, limit: int | None = None) -> HistoryResult:
        self.calls.append((since, limit))
        page = [e for e in self.entries if e["seq"] > since][: min(limit or 200, self.cap)]
        return HistoryResult(entries=page, next=page[-1]["seq"] if page else since)


def newest(client: Any, since: int, keep: int | None) -> tuple[list[int], int]:
    entries, earlier = talk.newest(talk.history_pages(client, since), keep)
    return [e["seq"] for e in entries], earlier


@pytest.mark.parametrize("count", [0, 1, 49, 50, 51, 1234])
def test_default_tail_of_any_session(count: int) -> None:
    client = FakeClient(count, cap=100)  # many pages
    seqs, earlier = newest(client, 0, talk.HISTORY_TAIL)
    assert seqs == list(range(max(1, count - 49), count + 1))
    assert earlier == max(0, count - 50)


def test_all_and_since_read_every_page() -> None:
    client = FakeClient(250, cap=100)
    assert newest(client, 0, None) == (list(range(1, 251)), 0)
    assert [since for since, _ in client.calls] == [0, 100, 200, 250]
    assert newest(FakeClient(250, cap=100), 240, None) == (list(range(241, 251)), 0)
    assert newest(FakeClient(250, cap=100), 240, 3) == ([248, 249, 250], 7)


def test_a_pod_whose_next_does_not_advance_cannot_loop_forever() -> None:
    class Stuck(FakeClient):
        def history(self, since: int = 0, limit: int | None = None) -> HistoryResult:
            return HistoryResult(entries=[{"seq": 1}], next=since)

    assert newest(Stuck(0), 5, None) == ([1], 0)


def test_a_limit_past_any_length_is_every_entry() -> None:
    # `podctl history POD --limit 99999999999999999999` ended in an OverflowError traceback.
    assert newest(FakeClient(120, cap=100), 0, 10**20) == (list(range(1, 121)), 0)


class Compacting(FakeClient):
    """A pod that names its session, and is compacted into a new one (seqs from 1 again)
    right after the first page it answers."""

    def __init__(self, count: int, cap: int) -> None:
        super().__init__(count, cap)
        self.logs = {"old": self.entries, "new": [{"seq": i, "kind": "user_input"} for i in (1, 2)]}
        self.current = "old"

    def history(
        self, since: int = 0, limit: int | None = None, session_id: str | None = None
    ) -> HistoryResult:
        sid = session_id or self.current
        self.entries = self.logs[sid]
        page = super().history(since, limit)
        self.current = "new"
        return HistoryResult(entries=page.entries, next=page.next, session_id=sid, last_seq=250)


def test_every_page_comes_from_the_session_of_the_first() -> None:
    """A compaction between two pages switched the pod's session: the pages after it came
    from the new log, whose entries were shown as the old one's (or none, past its end)."""
    client = Compacting(250, cap=100)
    assert newest(client, 0, None) == (list(range(1, 251)), 0)
    assert {e["kind"] for e in client.entries} == {"assistant"}


def test_podctl_history_shows_the_newest_of_the_session_it_measured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first call says where the newest 50 begin (seq 200); a compaction right after it
    left the pod in a session with two entries, and past their end podctl showed none."""
    client = Compacting(250, cap=100)
    monkeypatch.setattr(talk, "connect", lambda pod, **_: contextlib.nullcontext(client))
    talk.history("pod", all_=False, since=None, limit=None, as_json=True, session=None)
    shown = json.loads(capsys.readouterr().out)
    assert [e["seq"] for e in shown["entries"]] == list(range(201, 251))
    assert shown["earlier"] == 200
