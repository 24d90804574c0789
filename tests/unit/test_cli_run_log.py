"""A run's end and its rounds' text read from the pod's session logs (cli/runs.py), for a
keyed `podctl send` whose run has ended: through the sessions it spans, newest first."""

from typing import Any

import pytest

from cli.runs import BACK_PAGE, entries_newest_first, last_run_end, rounds_text
from protocol.types import HistoryResult

RUN = "r1"


def said(text: str, run_id: str = RUN) -> dict[str, Any]:
    return {"kind": "assistant", "run_id": run_id, "item": {"type": "assistant", "text": text}}


class Sessions:
    """Answers `history` as a pod whose session `new` continues `old` (a compaction). With
    `says_last`, as pods do since they say where a log ends (`last_seq`); without, as earlier
    ones. `served` counts the entries its pages held."""

    def __init__(self, says_last: bool = True, **sessions: list[dict[str, Any]]) -> None:
        self.says_last = says_last
        self.served = 0
        self.sessions = {
            name: [{"seq": i, **e} for i, e in enumerate(entries, 1)]
            for name, entries in sessions.items()
        }

    def history(
        self, since: int = 0, limit: int | None = None, session_id: str | None = None
    ) -> HistoryResult:
        name = session_id or "new"
        log = self.sessions[name]
        page = log[since : since + min(limit or 200, 200)]  # a pod caps its pages too
        self.served += len(page)
        return HistoryResult(
            entries=page,
            next=page[-1]["seq"] if page else since,
            session_id=name,
            previous="old" if name == "new" and "old" in self.sessions else None,
            last_seq=log[-1]["seq"] if self.says_last else None,
        )


OTHER_RUNS = [
    entry
    for i in range(2_000)
    for entry in (
        {"kind": "run_start", "run_id": f"o{i}", "trigger": "input"},
        said("busy", f"o{i}"),
        {"kind": "run_end", "run_id": f"o{i}", "outcome": "finished", "text": "busy"},
    )
]


@pytest.mark.parametrize("says_last", [True, False], ids=["backward", "earlier-pod"])
def test_a_run_compacted_midway_and_paused_is_read_whole_and_ended_once(says_last: bool) -> None:
    """Its rounds before the compaction are in the earlier session, after its run_end
    `paused` there: the later session's `finished` is its end, with every round's text."""
    log = Sessions(
        says_last,
        old=[
            {"kind": "session_start"},
            {"kind": "run_start", "run_id": RUN, "trigger": "input"},
            said("one"),
            said("", "other run"),
            {"kind": "run_end", "run_id": RUN, "outcome": "paused", "text": "one"},
            {"kind": "run_start", "run_id": RUN, "trigger": "resume"},
            said("two\n"),
        ],
        new=[
            {"kind": "session_start"},
            said("three"),
            {"kind": "run_end", "run_id": RUN, "outcome": "finished", "text": "three"},
        ],
    )
    texts: list[str] = []
    end = last_run_end(log, RUN, texts)  # type: ignore[arg-type]
    assert end is not None and end["outcome"] == "finished"
    assert texts == ["one", "two\n", "three"]
    assert rounds_text(texts) == "one\ntwo\nthree"
    # Asked for its end alone, the earlier session is not read
    assert last_run_end(log, RUN)["outcome"] == "finished"  # type: ignore[arg-type,index]


def test_a_run_at_the_end_of_a_long_log_is_found_in_its_newest_page() -> None:
    """A keyed `send` on a long-lived pod: its run's end and rounds are the newest entries,
    and reading them does not page through the 6,000 before (0.36 s at 41,000 entries)."""
    log = Sessions(
        new=[
            {"kind": "session_start"},
            *OTHER_RUNS,
            {"kind": "user_input", "mode": "queue", "run_id": RUN, "text": "hi"},
            {"kind": "run_start", "run_id": RUN, "trigger": "input"},
            said("one"),
            said("two"),
            {"kind": "run_end", "run_id": RUN, "outcome": "finished", "text": "two"},
        ]
    )
    texts: list[str] = []
    assert last_run_end(log, RUN, texts)["outcome"] == "finished"  # type: ignore[arg-type,index]
    assert texts == ["one", "two"]
    assert log.served <= BACK_PAGE + 1  # the newest page, and the first entry for `last_seq`


def test_a_run_not_ended_is_known_from_its_input_at_the_end() -> None:
    """Queued, not started: its input is its first entry; nothing before it is read."""
    queued = {"kind": "user_input", "mode": "queue", "run_id": RUN, "text": "hi"}
    log = Sessions(new=[{"kind": "session_start"}, *OTHER_RUNS, queued])
    assert last_run_end(log, RUN, []) is None  # type: ignore[arg-type]
    assert log.served <= BACK_PAGE + 1


def test_every_entry_is_read_newest_first_through_the_sessions() -> None:
    """Pages from the end backward, growing, through pages the pod cuts short (200 here):
    each entry once, in order, then the earlier session's."""
    old = [{"kind": "session_start"}, said("a"), said("b")]
    new = [{"kind": "session_start"}, *OTHER_RUNS]
    for says_last in (True, False):
        log = Sessions(says_last, old=old, new=new)
        seen = [(e["seq"], e["kind"]) for e in entries_newest_first(log)]  # type: ignore[arg-type]
        want = [(e["seq"], e["kind"]) for e in reversed(log.sessions["new"])]
        want += [(e["seq"], e["kind"]) for e in reversed(log.sessions["old"])]
        assert seen == want


def test_rounds_are_joined_as_send_streams_them() -> None:
    assert rounds_text([]) == ""
    assert rounds_text(["", "a", "", "b\n", "c"]) == "a\nb\nc"
