"""PodLog.switch, compaction's change of session, when a write fails."""

import errno
import os
import tempfile

import pytest

from poddaemon.entries import SessionStart
from poddaemon.podlog import PodLog
from poddaemon.store.log import new_session_id


def test_a_failed_fsync_of_the_old_log_names_the_old_file() -> None:
    """Found by QA: the old log's fsync, the switch's last step, failing (EIO from its disk)
    stopped the pod with "cannot write the compacted session <new path>", a file written
    complete by then: an operator looked for the fault in the wrong file."""
    failures: list[str] = []
    with tempfile.TemporaryDirectory(dir="/tmp") as sessions:
        plog = PodLog(sessions, failures.append, lambda _: None, lambda _: None, SessionStart)
        plog.open(SessionStart(session_id=new_session_id(), seq=1, ts=1.0))
        old = plog.log
        assert old is not None

        def broken_disk() -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(old, "sync_now", broken_disk)
            new = SessionStart(session_id=new_session_id(), seq=1, ts=2.0)
            assert not plog.switch(new)
        assert plog.failed and plog.log is old
        assert len(failures) == 1
        assert str(old.path) in failures[0] and failures[0].endswith(os.strerror(errno.EIO))
        assert not failures[0].startswith("cannot write the compacted session")
        old.close()
