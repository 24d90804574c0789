"""A run's end and its rounds' text read from the pod's session logs (cli/runs.py), for a
keyed `podctl send` whose run has ended: through the sessions it spans, newest first."""

from typing import Any

from cli.runs import last_run_end, rounds_text
from protocol.types import HistoryResult

RUN = "r1"


def said(text: str, run_id: str = RUN) -> dict[str, Any]:
    return {"kind": "assistant", "run_id": run_id, "item": {"type": "assistant", "text": text}}


class Sessions:
    """Answers `history` as a pod whose session `new` continues `old` (a compaction)."""

    def __init__(self, **sessions: list[dict[str, Any]]) -> None:
        self.sessions = {
            name: [{"seq": i, **e} for i, e in enumerate(entries, 1)]
            for name, entries in sessions.items()
        }

    def history(
        self, since: int = 0, limit: int | None = None, session_id: str | None = None
    ) -> HistoryResult:
        name = session_id or "new"
        page = [e for e in self.sessions[name] if e["seq"] > since][: limit or 200]
        return HistoryResult(
            entries=page,
            next=page[-1]["seq"] if page else since,
            session_id=name,
            previous="old" if name == "new" else None,
        )


def test_a_run_compacted_midway_and_paused_is_read_whole_and_ended_once() -> None:
    """Its rounds before the compaction are in the earlier session, after its run_end
    `paused` there: the later session's `finished` is its end, with every round's text."""
    log = Sessions(
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


def test_rounds_are_joined_as_send_streams_them() -> None:
    assert rounds_text([]) == ""
    assert rounds_text(["", "a", "", "b\n", "c"]) == "a\nb\nc"
