"""The pod's session log as its executor uses it: open, append, fork when another writer moved
the head, switch to a compacted session, and know whether every input is durable yet.

Entries are staged and written together, one `os.write` per loop pass: at the end of the pass
that made them, before the group commit's fsync, and before anything that speaks of them leaves
the pod (the pod calls `flush` before an event or a reply goes out). Under load that is one
write (and one size check) for a whole batch of notifications instead of one each. A crash can
take a staged entry nobody has heard of, as a power cut can take a written one that is not yet
fsync'd: an acknowledgement always waits for both.

Failures are reported through `fail` (the pod then stops: nothing more can be acknowledged);
session changes through `moved` (the registry names the pod's session)."""

import asyncio
import contextlib
import errno
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from poddaemon.entries import (
    Entry,
    PauseRequested,
    RunEnd,
    RunStart,
    SessionStart,
    SystemItem,
    UserInput,
    body_of,
    record_of,
)
from poddaemon.store.file import HeadMoved, Reservation, SessionLog, session_path
from poddaemon.store.log import new_session_id

T = TypeVar("T")


class PodLog:
    def __init__(
        self,
        sessions_dir: str,
        fail: Callable[[str], None],
        moved: Callable[[str], None],
        alert: Callable[[str], None],
        fork: Callable[[], SessionStart],
    ) -> None:
        self.sessions_dir = sessions_dir
        self.fail = fail
        self.moved = moved
        self.alert = alert
        self.fork = fork  # the state as a new session's first entry, when another writer moved ours
        self.log: SessionLog | None = None
        self.failed = False
        self.forks = 0  # sessions forked: a fork's first entry holds every entry made before it
        self._staged = False  # entries may be staged: `flush` has work (it runs per reply)
        self._flush_due = False  # a flush is scheduled for the end of this loop pass
        self._loop: asyncio.AbstractEventLoop | None = None
        # The last input written (or decision a client is told of: see _told): acks and model
        # calls wait for it.
        self._input_seq = 0
        self._reserved: Reservation | None = None  # the first session's file, made ahead
        self._closed = False

    @property
    def path(self) -> str:
        return str(self.log.path) if self.log is not None else ""

    def restore(
        self, session_id: str, fold: Callable[[Iterator[dict[str, Any]]], T]
    ) -> tuple[T, list[str]]:
        """Reopen a session: its entries, verified as they are read, go to `fold`, whose
        result is returned with the warnings."""
        self.log, folded, warnings = SessionLog.open(self.sessions_dir, session_id, fold)
        return folded, warnings

    def reserve(self, session_id: str) -> Reservation:
        """Make the first session's file, `session_id`'s, ahead of it (blocking: call it in a
        thread, while the pod waits for its first input); hand it over with `offer`. The pod
        names the session in the registry first (see `Pod.reserve_session`)."""
        return Reservation(self.sessions_dir, session_id)

    def offer(self, reservation: Reservation) -> bool:
        """Keep `reservation` for the first session; False (the caller discards it) once a
        session is open, or the log closed, or one is kept already."""
        if self.log is not None or self._closed or self._reserved is not None:
            return False
        self._reserved = reservation
        return True

    @property
    def reserved(self) -> "Reservation | None":
        """The first session's file, when it is made and not yet taken."""
        return self._reserved

    def first_session_id(self) -> str:
        """The id the first session should take: the reserved file's, if one is ready."""
        return self._reserved.session_id if self._reserved is not None else new_session_id()

    def open(self, start: SessionStart) -> None:
        reserved, self._reserved = self._reserved, None
        if reserved is not None and reserved.session_id != start.session_id:
            reserved.discard()  # not the session it was made for
            reserved = None
        try:
            # Not fsync'd here: the first input comes right after, and its commit covers both.
            self.log = SessionLog.create(
                self.sessions_dir,
                start.session_id,
                body_of(start),
                ts=start.ts,
                durable=False,
                reserved=reserved,
            )
        except OSError as exc:
            path = session_path(self.sessions_dir, start.session_id)
            self._failed(f"cannot create session log {path}: {exc.strerror or exc}")
            return
        self.moved(start.session_id)

    def write(self, entry: Entry) -> None:
        """Stage one entry (written by `flush`, at the latest at the end of this loop pass).
        The log may fork meanwhile (another writer moved its head): then `forks` counts up and
        the fork's first entry already holds this entry and every one before it."""
        if self.failed:  # (the log may not even exist: it could not be created)
            return
        log = self.log
        assert log is not None
        if log.closed and type(entry) is not SystemItem and type(entry) is not UserInput:
            # Closed, the pod is on its way out: what its watchers see now (a child's exit) is
            # not recorded, and a restored pod learns it again. Failing here made a pod that
            # stopped cleanly exit 1. (An input still fails below: it must never be acked.)
            return
        try:
            if type(entry) is RunStart:  # a run starts: check the whole file is still ours
                log.flush()
                if not log.head_is_mine():
                    raise HeadMoved(0, "head moved")
            record = record_of(entry)  # with its kind (the tag) and ts; seq is the log's
            seq = log.stage_record(record)
            self._staged = True
            kind = type(entry)
            if kind is SystemItem or kind is UserInput or _told(entry):
                self._input_seq = seq
        except HeadMoved:
            self._fork()
            return
        except (OSError, ValueError, TypeError) as exc:
            self._failed(f"session log {log.path} write failed: {exc}")
            return
        if not self._flush_due:
            self._flush_due = True
            if self._loop is None:  # cached: get_running_loop() costs a getpid() per call
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._flush_due_now)

    def _flush_due_now(self) -> None:
        self._flush_due = False
        self.flush()

    def flush(self) -> None:
        """Write what is staged (forking if another writer moved the head)."""
        if not self._staged:
            return
        self._staged = False
        log = self.log
        if log is None or self.failed:
            return
        try:
            log.flush()
        except HeadMoved:
            self._fork()
        except OSError as exc:
            self._failed(f"session log {log.path} write failed: {exc}")

    def fork_now(self, why: str) -> None:
        """Continue in a new session forked from this one now, as when another writer moved
        the head (`why` completes "session <id> ..." in the alert)."""
        if self.log is not None and not self.failed:
            self.flush()
            if not self.failed:
                self._fork(why)

    def _fork(self, why: str = "was written by someone else") -> None:
        start = self.fork()
        assert self.log is not None
        old = self.log
        try:
            self.log = old.fork(start_body=body_of(start), new_id=start.session_id)
        except OSError as exc:  # a full disk, say: the pod stops (the old log is not ours)
            self._failed(
                f"session {old.session_id} {why} and cannot be continued in a new session: {exc}"
            )
            return
        self.forks += 1
        self._input_seq = 0  # the new session starts durable: its inputs are in its first entry
        old.close()
        self.moved(start.session_id)
        self.alert(
            f"session {old.session_id} {why}; continuing in session {start.session_id}"
            " (forked_from links them)"
        )

    def switch(self, start: SessionStart) -> bool:
        """Compaction: the new session is written completely and made durable under its name,
        then the old one (fsync'd, left intact) is closed. A crash before the rename restores
        the old session as if the compaction had not started; after it, the new one is
        complete. False if it could not be written (the pod then stops)."""
        old = self.log
        # Named as a failed append is: a unit's journal has no other trace of which file.
        path = session_path(self.sessions_dir, start.session_id)
        failing = f"cannot write the compacted session {path}"
        try:
            self.log = SessionLog.create_complete(
                self.sessions_dir,
                start.session_id,
                body_of(start),
                ts=start.ts,
                written=lambda: _crash_point("first_line"),
            )
            _crash_point("complete")
            if old is not None:
                # The new session is written by now: a failure here is the old file's.
                failing = f"session log {old.path} write failed before the switch to {path}"
                with contextlib.suppress(HeadMoved):  # then it is not ours: the new one holds all
                    old.sync_now()  # replies waiting on the old log see it durable
        except OSError as exc:
            self.log = old
            self._failed(f"{failing}: {exc.strerror or exc}")
            return False
        self._input_seq = 0  # the new session is durable: its inputs are in its first entry
        if old is not None:
            old.close()
        self.moved(start.session_id)
        return True

    def inputs_durable(self) -> bool:
        """Every input written so far is on disk: what an acknowledgement or a model call needs
        (later entries, a run's end say, need no fsync before a reply)."""
        return self.log is None or self.log.durable_seq >= self._input_seq

    def sync_now(self) -> None:
        """fsync inline what is not yet durable (the group commit's fsync); OSError if it
        fails."""
        if self.log is not None and not self.failed:
            self.flush()
            # What it makes durable, none could find. A closed log is neither: `close` made all
            # of it durable, and a reply committed after it (at shutdown) must not fork one.
            if not self.failed and not self.log.closed and not self.log.named():
                self._fork("was removed or replaced on disk")
            if self.failed:
                raise OSError(errno.EIO, "the session log could not be written")
            if self.log.closed and self.log.durable_seq < self.log.seq:  # its last fsync failed
                raise OSError(errno.EIO, "the session log was closed before it was durable")
            if _power_cut_at:
                _power_cut_point(self.log)
            self.log.sync_now()

    async def synced(self) -> None:
        self.flush()
        if self.log is not None and not self.failed:
            if _power_cut_at:
                _power_cut_point(self.log)
            await self.log.sync()

    async def close(self) -> None:
        self._closed = True
        if self._reserved is not None:
            with contextlib.suppress(OSError):
                self._reserved.discard()
            self._reserved = None
        if self.log is not None:
            with contextlib.suppress(OSError):
                await self.log.sync()
            self.log.close()

    def _failed(self, message: str) -> None:
        self.failed = True
        self.fail(message)


def _told(entry: Entry) -> bool:
    """A decision a client's reply speaks of, which must survive a power cut as an input must:
    an acknowledged pause, a run ended by `cancel` (other ends are told to nobody who asked)."""
    kind = type(entry)
    return kind is PauseRequested or (isinstance(entry, RunEnd) and entry.outcome == "cancelled")


CRASH_ENV = "PODDAEMON_TEST_CRASH_COMPACTION"
POWER_CUT_ENV = "PODDAEMON_TEST_POWER_CUT_AT_FSYNC"
# Read once: the group commit asks on every fsync.
_power_cut_at = int(os.environ.get(POWER_CUT_ENV) or 0)
_commits = 0


def _crash_point(name: str) -> None:
    """A test seam: `$PODDAEMON_TEST_CRASH_COMPACTION=<name>` kills the pod (-9) right there."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _power_cut_point(log: SessionLog) -> None:
    """A test seam: `$PODDAEMON_TEST_POWER_CUT_AT_FSYNC=<n>` makes the n-th group commit that
    has something to sync a power cut between write and fsync: the log loses everything the
    last finished fsync did not cover (what the disk may lose), then the pod is killed (-9).
    Whatever had been acknowledged must still be there."""
    global _commits
    if log.durable_seq == log.seq:
        return  # nothing to sync: not a commit
    _commits += 1
    if _commits != _power_cut_at:
        return
    lost = log.seq - log.durable_seq
    os.truncate(log.path, log.durable_size)
    os.write(2, f"test power cut: {lost} written entries were not yet fsync'd\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
