"""PodLog after the pod closed it, on its way out."""

import asyncio
import os
import tempfile

from poddaemon.entries import ChildEnded, PauseRequested, RunEnd, SessionStart, SystemItem
from poddaemon.podlog import PodLog
from poddaemon.store.log import new_session_id, verify


def test_an_entry_after_the_close_is_dropped_not_a_failure() -> None:
    """Found by a full test run: a child's exit, seen by its watcher after `podctl stop --tree`
    had closed the spawner's log, was written to the closed log; the failure made the spawner,
    stopped cleanly, exit 1."""
    failures: list[str] = []

    async def go(sessions: str) -> PodLog:
        plog = PodLog(sessions, failures.append, lambda _: None, lambda _: None, SessionStart)
        plog.open(SessionStart(session_id=new_session_id(), seq=1, ts=1.0))
        plog.write(SystemItem(id="n1", text="before", source="ci", seq=2, ts=2.0))
        await plog.close()
        plog.write(ChildEnded(name="kid", spent=0, reason="it stopped", seq=3, ts=3.0))
        plog.flush()
        return plog

    with tempfile.TemporaryDirectory(dir="/tmp") as sessions:
        plog = asyncio.run(go(sessions))
        assert failures == [] and not plog.failed
        with open(plog.path, "rb") as f:
            entries = verify(f.read()).entries
    assert [e["kind"] for e in entries[1:]] == ["system_item"]


def test_an_input_after_the_close_still_fails_it_is_never_acknowledged_unwritten() -> None:
    failures: list[str] = []

    async def go(sessions: str) -> PodLog:
        plog = PodLog(sessions, failures.append, lambda _: None, lambda _: None, SessionStart)
        plog.open(SessionStart(session_id=new_session_id(), seq=1, ts=1.0))
        await plog.close()
        plog.write(SystemItem(id="n2", text="after", source="ci", seq=2, ts=2.0))
        return plog

    with tempfile.TemporaryDirectory(dir="/tmp") as sessions:
        plog = asyncio.run(go(sessions))
    assert plog.failed and "closed" in failures[0]


def test_what_a_client_is_told_waits_for_the_fsync_as_an_input_does() -> None:
    """A pause and a cancel's run end are acknowledged: a reply must survive a power cut, so
    it waits for the fsync that covers them, as an input's does (written but not fsync'd, a
    power cut took the pause back, or brought the cancelled run back). A run's other ends,
    told to nobody who asked, need not wait."""
    told = [
        PauseRequested(run_id="r1"),
        RunEnd(run_id="r1", outcome="cancelled", text=""),
    ]
    async def durable_before_and_after(entry: PauseRequested | RunEnd, sessions: str) -> bool:
        plog = PodLog(sessions, print, lambda _: None, lambda _: None, SessionStart)
        plog.open(SessionStart(session_id=new_session_id(), seq=1, ts=1.0))
        plog.sync_now()
        entry.seq, entry.ts = 2, 2.0
        plog.write(entry)
        before = plog.inputs_durable()
        plog.sync_now()
        assert plog.inputs_durable()
        await plog.close()
        return before

    for entry in [*told, RunEnd(run_id="r1", outcome="finished", text="done")]:
        with tempfile.TemporaryDirectory(dir="/tmp") as sessions:
            waits = not asyncio.run(durable_before_and_after(entry, sessions))
        assert waits is (entry in told), entry


def test_a_commit_after_the_close_forks_no_new_session() -> None:
    """Found by hand (`podctl stop --tree` of a spawner restarted while its detached child
    lived): a reply committed after the spawner had closed its log (the child's redelivered
    report, answered `accepted` without an entry) ran the fsync, which took the closed log for
    one "removed or replaced on disk" and forked a new session after the pod had shut down:
    a WARNING in its log, a stray session, and the next `--resume` continued the fork."""
    alerts: list[str] = []
    failures: list[str] = []

    async def go(sessions: str) -> PodLog:
        def fork() -> SessionStart:
            return SessionStart(session_id=new_session_id(), seq=1, ts=3.0)

        plog = PodLog(sessions, failures.append, lambda _: None, alerts.append, fork)
        plog.open(SessionStart(session_id=new_session_id(), seq=1, ts=1.0))
        plog.write(SystemItem(id="n1", text="before", source="ci", seq=2, ts=2.0))
        plog.sync_now()
        await plog.close()
        plog.sync_now()  # a reply's commit after the close: everything is durable already
        return plog

    with tempfile.TemporaryDirectory(dir="/tmp") as sessions:
        plog = asyncio.run(go(sessions))
        assert (alerts, failures, plog.forks) == ([], [], 0)
        assert len(os.listdir(sessions)) == 1
