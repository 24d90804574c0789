"""`podctl history` paging (issue 9 item 15): the newest entries of a session of any size, and
how many earlier ones were left out, from the pod's forward-only `history(since, limit)`."""

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
