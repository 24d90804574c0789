"""Session logs on disk: ``<sessions_dir>/<session-id>.jsonl``, one per session.

Writes go out at once with a single ``os.write`` on an ``O_APPEND`` descriptor, or are staged
(``stage_record``) and go out together, one ``os.write`` at the next ``flush`` or sync (the pod
stages what a loop pass commits: one write and one size check for a batch, not one per entry);
durability is a separate step: ``sync_now()`` fsyncs inline (the pod's group commit,
``acks.DurableReplies``, calls it once per loop pass and then answers), and ``await log.sync()``
group-commits for awaiting callers: one ``fsync``, run inline on the loop once per loop pass,
covers every append made before it started; callers after it share the next. Either skips the
fsync when everything written is already durable. (Inline rather than in a worker thread: a
thread costs two hand-offs per commit, and with the GIL the fsync thread waits for the busy loop
to let go; inline, the requests that arrive during an fsync wait in the socket buffers and are
all committed by the next.)

``fsync``, not ``fdatasync``: every write here is an append, so the size changes each time and
``fdatasync`` must write the inode all the same (the size is needed to read the data back);
only a timestamp-only change would be skipped, which never happens here. Measured on this
ext4: the same time (within noise) for appends.

A ``SessionLog`` belongs to one event loop and one thread. Once an fsync fails (or a failed
write cannot be cut back off) the log is poisoned: every later ``append``/``sync`` raises
``OSError``. After a failed fsync the kernel may already have dropped the pages, so a later
fsync "succeeding" would prove nothing. The owner should stop or fork into a new session.
"""

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, TypeVar

import msgspec

from poddaemon.store.log import (
    GENESIS,
    LogCorrupt,
    VerifyResult,
    encode_entry,
    encode_line,
    encode_record,
    new_session_id,
    verify,
    verify_line,
)
from protocol import paths
from protocol.unreadable import UNREADABLE

__all__ = [
    "HeadMoved",
    "Reservation",
    "ResumeChoice",
    "SessionInfo",
    "SessionLog",
    "SessionNotFound",
    "SessionPage",
    "SessionScan",
    "continued_by",
    "damaged_continuations",
    "list_sessions",
    "newest_session_for",
    "read_page",
    "read_session",
    "remove_if_empty",
    "session_path",
    "session_pod",
    "session_to_resume",
]

SUFFIX = ".jsonl"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_CHUNK = 64 * 1024

StrPath = str | os.PathLike[str]
T = TypeVar("T")


class HeadMoved(OSError):
    """Someone else changed the file under this writer; appending would break the chain."""


class SessionInfo(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    path: str
    size: int
    mtime: float
    pod: str | None = None
    started: float | None = None  # ts of the session_start entry
    forked_from: str | None = None
    compacted_from: str | None = None


class _Head(msgspec.Struct):
    """The few fields of a first line that a listing needs; the rest is skipped undecoded."""

    kind: str | None = None
    ts: float | None = None
    pod: str | None = None
    forked_from: str | None = None
    compacted_from: str | None = None
    session_id: str | None = None


_head_decoder = msgspec.json.Decoder(_Head)


def _check_id(session_id: str) -> None:
    if not _ID_RE.fullmatch(session_id):
        raise ValueError(f"invalid session id {session_id!r}")


def session_path(sessions_dir: StrPath, session_id: str) -> Path:
    """The log file of a session (the id is checked: no path separators, no dot-dot)."""
    _check_id(session_id)
    return Path(sessions_dir) / f"{session_id}{SUFFIX}"


def _ensure_dir(path: Path) -> None:
    """The sessions directory, made if need be (0700, parents too, whatever the umask). What it
    makes is made durable at once, each new name in its parent: a session file's fsyncs cover
    its own name, not the directories above it (done once per home)."""
    if path.is_dir():
        return
    made = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    paths.ensure_dir(path, "sessions directory")
    for directory in reversed(made):
        _fsync_dir(directory.parent)


def _new_file(path: Path) -> int:
    """Create a session's file (and its directory, if need be); FileExistsError if it exists."""
    _ensure_dir(path.parent)
    # 0600 whatever the umask: under 0277 the file came out 0400 and a restore, which reopens
    # it for appending, was refused it ("Permission denied") for any uid but root.
    return paths.open_private(path, os.O_RDWR | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _close_and_remove(fd: int, path: Path) -> None:
    """Undo a file being made: close it and remove its name (if nothing removed it yet)."""
    os.close(fd)
    with contextlib.suppress(OSError):
        path.unlink()


def remove_leftovers(sessions_dir: StrPath, pod: str) -> None:
    """Remove the ``.tmp`` files a crash left before their rename (a compaction cut short):
    nothing reads them. Those of `pod` (only one pod of a name lives at a time, so no other
    writer is making one of them now), and those whose first line is unreadable (a power cut
    can leave one empty or torn: it names no pod, and was kept for ever) that no writer holds:
    a writer keeps its temp file locked until it is renamed (`_open_locked`)."""
    with os.scandir(sessions_dir) as entries:  # (glob's pattern matching: 2x the time)
        leftovers = [Path(e.path) for e in entries if e.name.endswith(".jsonl.tmp")]
    for tmp in leftovers:
        with contextlib.suppress(OSError):
            _remove_leftover(tmp, pod)


def _remove_leftover(tmp: Path, pod: str) -> None:
    fd = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # being written now
        owner = _head(_first_line(tmp)).pod
        if (owner == pod or not owner) and _still_named(tmp, fd):
            tmp.unlink()  # (under the lock: a writer that opened it before makes another)
    finally:
        os.close(fd)


def _open_locked(tmp: Path) -> int:
    """`tmp` created (emptied) for writing and locked until it is closed: `remove_leftovers`
    removes no temp file a writer holds. One removed between its creation and the lock is
    created again."""
    while True:
        fd = paths.open_private(tmp, os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _still_named(tmp, fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _still_named(path: Path, fd: int) -> bool:
    """`path` still names the open file `fd`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


class Reservation:
    """An empty file under a session's name, made durable (file and directory fsync'd) before
    the session starts: the session's first commit then fsyncs its file only. A new name costs
    a directory fsync, and a new file's first fsync is the dearest: paid here, while the pod is
    idle, instead of on its first turn. Empty, the file is no session (listings skip it); a pod
    that never starts the session removes it with ``discard``."""

    def __init__(self, sessions_dir: StrPath, session_id: str) -> None:
        path = session_path(sessions_dir, session_id)
        fd = _new_file(path)
        try:
            os.fsync(fd)
            _fsync_dir(path.parent)
        except BaseException:
            _close_and_remove(fd, path)
            raise
        self.path = path
        self.session_id = session_id
        self.fd: int | None = fd  # None once taken by a log or discarded

    def take(self) -> int:
        fd, self.fd = self.fd, None
        if fd is None:
            raise ValueError(f"reservation {self.session_id} already used")
        return fd

    def discard(self) -> None:
        """Remove the file, unless a log took it."""
        if self.fd is not None:
            _close_and_remove(self.take(), self.path)


def remove_if_empty(sessions_dir: StrPath, session_id: str) -> bool:
    """Remove a session's file if it is empty (0 bytes): a `Reservation` whose pod died before
    its first input (``kill -9``, a crash loop), which nothing removed. Empty, it holds no
    entry, so nothing acknowledged: an input is acked only once it is fsync'd after the
    session's first line. A file with any byte in it is never removed. Call it only for a
    session whose writer is gone (the registry, reclaiming a dead pod's entry under its lock):
    a live pod's reservation is empty too until its first input. True if it was removed."""
    path = session_path(sessions_dir, session_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone already, or no file of ours (a link, say)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != 0 or not _still_named(path, fd):
            return False
        path.unlink()
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class SessionNotFound(FileNotFoundError):
    """No log file for this session id. `str()` is one plain line (no errno, no repr)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _missing(path: Path, session_id: str) -> SessionNotFound:
    return SessionNotFound(errno.ENOENT, f"no session {session_id} under {path.parent}", str(path))


def _check_start(result: VerifyResult, path: Path, session_id: str) -> None:
    if not result.entries:
        _check_first(None, path)
    _check_start_entry(result.entries[0], path, session_id)


def _check_start_entry(entry: dict[str, Any], path: Path, session_id: str) -> None:
    """A session's first entry must be its `session_start`, and name this session: each log's
    chain starts afresh, so a file copied or renamed over another session's name verifies
    whole, and a pod continuing it wrote under one id while it named (and paged) the other."""
    _check_first(entry.get("kind"), path)
    named = entry.get("session_id")
    if named and named != session_id:
        raise LogCorrupt(1, f"session_start is session {named}'s, not {session_id}'s", str(path))


def _check_first(kind: str | None, path: Path) -> None:
    """A session's first entry (None: it has none) must be its `session_start`."""
    if kind is None:
        raise LogCorrupt(1, "no complete entry: the session never started", str(path))
    if kind != "session_start":
        raise LogCorrupt(1, f"first entry is {kind!r}, not 'session_start'", str(path))


class SessionLog:
    """The append side of one session log. Build it with ``create``, ``open`` or ``fork``."""

    def __init__(
        self, path: Path, session_id: str, fd: int, seq: int, head: str, size: int, last: bytes
    ) -> None:
        self.path = path
        self.session_id = session_id
        self._fd = fd
        self._seq = seq  # seq of the last entry written
        self._head = head  # hash of the last entry written
        self._size = size  # file size after our last write
        self._last = last  # our last line, as written
        self._staged: list[bytes] = []  # lines encoded (seq and head count them), not yet written
        self._durable = seq  # highest seq covered by a finished fsync
        self._durable_size = size  # the file's size as far as a finished fsync covered it
        self._failed: OSError | None = None
        self._fsync_task: asyncio.Task[None] | None = None
        self._closed = False
        self._dir_unsynced = False  # created without fsync: the first one covers its name too
        held = os.fstat(fd)
        self._ident = (held.st_dev, held.st_ino)  # the file's, for `named` (a stat per commit)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        sessions_dir: StrPath,
        session_id: str,
        start_body: Mapping[str, Any],
        ts: float | None = None,
        *,
        durable: bool = True,
        reserved: Reservation | None = None,
    ) -> "SessionLog":
        """Start a new session: write its ``session_start`` entry and make it durable (file and
        directory fsync'd). Raises ``FileExistsError`` if the session already exists.

        With ``durable=False`` both fsyncs are left to the log's first ``sync``: a pod creates
        its session with its first input, and one commit then covers the two (a new file's
        first fsync is the dearest of all). Until then a power cut may leave no file, or an
        empty one: a session nobody was told about, which listings skip. With a ``reserved``
        file (this session's, still empty) the log is written there: its name is durable
        already, so only the file needs an fsync."""
        path = session_path(sessions_dir, session_id)
        line, entry = encode_entry(
            1, time.time() if ts is None else ts, "session_start", GENESIS, start_body
        )
        fd = -1
        if reserved is not None:
            if reserved.path != path:
                raise ValueError(f"reservation {reserved.session_id} is not for {session_id}")
            fd = reserved.take()
            if not _still_named(path, fd):
                # Removed (or replaced) since it was made: what went into it would be written
                # to a file no name reaches, so make the file anew, as without a reservation.
                os.close(fd)
                fd, reserved = -1, None
        if fd < 0:
            fd = _new_file(path)
        try:
            _write_all(fd, line)
            if durable:
                os.fsync(fd)
                if reserved is None:
                    _fsync_dir(path.parent)
        except BaseException:
            _close_and_remove(fd, path)
            raise
        log = cls(path, session_id, fd, 1, entry["hash"], len(line), line)
        if not durable:
            log._durable, log._durable_size = 0, 0
            log._dir_unsynced = reserved is None
        return log

    @classmethod
    def create_complete(
        cls,
        sessions_dir: StrPath,
        session_id: str,
        start_body: Mapping[str, Any],
        ts: float | None = None,
        written: Callable[[], None] | None = None,
    ) -> "SessionLog":
        """Like ``create``, but the session appears under its name only once its first line is
        complete and durable: it is written to a temporary file, fsync'd, then renamed into
        place (and the directory fsync'd). A crash before the rename leaves no session at all,
        only a ``.tmp`` file no listing reads. ``written`` runs after the line is written and
        before the rename (a crash-test hook)."""
        path = session_path(sessions_dir, session_id)
        _ensure_dir(path.parent)
        tmp = path.with_name(path.name + ".tmp")
        line, entry = encode_entry(
            1, time.time() if ts is None else ts, "session_start", GENESIS, start_body
        )
        fd = _open_locked(tmp)
        try:
            _write_all(fd, line)
            if written is not None:
                written()
            os.fsync(fd)
            if path.exists():
                raise FileExistsError(errno.EEXIST, f"session {session_id} exists", str(path))
            os.rename(tmp, path)
            _fsync_dir(path.parent)
        except BaseException:
            _close_and_remove(fd, tmp)
            raise
        pod = start_body.get("pod")
        if isinstance(pod, str):
            remove_leftovers(path.parent, pod)
        return cls(path, session_id, fd, 1, entry["hash"], len(line), line)

    @classmethod
    def open(
        cls,
        sessions_dir: StrPath,
        session_id: str,
        consume: Callable[[Iterator[dict[str, Any]]], T],
    ) -> tuple["SessionLog", T, list[str]]:
        """Open an existing session to continue it.

        Verifies the whole file, a line at a time: `consume` is handed the entries as they are
        read and what it returns is returned (a fold keeps what it needs of each entry, so a
        long log is never in memory whole: the list of every entry, and the file's bytes,
        outlived a restore as a heap ~1.7x the pod's). Damage raises ``LogCorrupt`` naming the
        line, out of `consume`, and leaves the file untouched; so does a line `consume` finds
        no entry it can read in (``msgspec.ValidationError``). A torn last line is cut off the
        file (and the cut fsync'd) with a warning in the returned list. Returns the log, what
        `consume` returned and the warnings.
        """
        path = session_path(sessions_dir, session_id)
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _missing(path, session_id) from None
        warnings: list[str] = []
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"not a regular file: {path}")
            scan = SessionScan(sessions_dir, session_id, fd)
            entries = iter(scan)
            try:
                consumed = consume(entries)
            except msgspec.ValidationError as exc:  # a sound line, but no entry `consume` reads
                reason = f"not an entry this version can read ({exc})"
                raise LogCorrupt(scan.count, reason, str(path)) from None
            for _ in entries:  # what `consume` left: the end must be known to append after it
                pass
            if scan.torn:
                cut = os.fstat(fd).st_size - scan.end_offset
                os.ftruncate(fd, scan.end_offset)
                os.fsync(fd)
                warnings.append(
                    f"session {session_id}: cut a torn last line ({cut} bytes)"
                    f" at line {scan.count + 1}"
                )
        except BaseException:
            os.close(fd)
            raise
        log = cls(path, session_id, fd, scan.count, scan.head, scan.end_offset, scan.last)
        return log, consumed, warnings

    def fork(
        self,
        sessions_dir: StrPath | None = None,
        new_id: str | None = None,
        start_body: Mapping[str, Any] | None = None,
    ) -> "SessionLog":
        """``create`` a new session whose ``session_start`` body carries
        ``forked_from=<this session's id>`` (unless ``start_body`` sets it already). Defaults:
        this log's directory and a fresh UUIDv7. This log is left as it is."""
        body = dict(start_body or {})
        body.setdefault("forked_from", self.session_id)
        return SessionLog.create(
            self.path.parent if sessions_dir is None else sessions_dir,
            new_session_id() if new_id is None else new_id,
            body,
        )

    # --- state --------------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """Seq of the last entry written or staged (durable or not)."""
        return self._seq

    @property
    def head(self) -> str:
        """Hash of the last entry written."""
        return self._head

    @property
    def durable_seq(self) -> int:
        """Highest seq known to be on disk (covered by a finished fsync)."""
        return self._durable

    @property
    def durable_size(self) -> int:
        """Bytes of the file known to be on disk (what a power cut could not take back)."""
        return self._durable_size

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._fd

    def _usable(self) -> None:
        if self._closed:
            raise ValueError(f"session log {self.session_id} is closed")
        if self._failed is not None:
            raise OSError(
                self._failed.errno,
                f"session log {self.path} failed earlier ({self._failed.strerror});"
                " nothing more can be written to it",
            )

    # --- writing ------------------------------------------------------------------------------

    def append(self, kind: str, body: Mapping[str, Any], ts: float | None = None) -> dict[str, Any]:
        """Write one entry now (one ``os.write``; not fsync'd: ``await sync()`` for that) and
        return it as a reader will see it. Never reads the file.

        Raises ``HeadMoved`` if the file's size is not what this writer left (someone else
        wrote to it), ``ValueError``/``TypeError`` for a bad body (nothing written) and
        ``OSError`` if the write fails (a partial line is cut back off, so a later append may
        succeed; if the cut fails too the log is poisoned).
        """
        self._usable()
        line, entry = encode_entry(
            self._seq + 1, time.time() if ts is None else ts, kind, self._head, body
        )
        self._write_line(line, entry["hash"])
        return entry

    def write(self, kind: str, body: Mapping[str, Any], ts: float | None = None) -> int:
        """``append`` for a writer that does not need the entry back: returns its seq."""
        self._usable()
        line, digest = encode_line(
            self._seq + 1, time.time() if ts is None else ts, kind, self._head, body
        )
        self._write_line(line, digest)
        return self._seq

    def stage_record(self, record: dict[str, Any]) -> int:
        """Encode a record holding its own ``kind`` and ``ts`` (see ``encode_record``; the
        record is modified) and keep its line for ``flush`` (or the next sync, write or close),
        so that entries staged together cost one ``os.write``. Returns its seq (counted by
        ``seq`` and ``head`` at once; not by the file until flushed)."""
        if self._closed or self._failed is not None:  # (a call saved on every entry)
            self._usable()
        line, digest = encode_record(self._seq + 1, self._head, record)
        self._staged.append(line)
        self._seq += 1
        self._head = digest
        return self._seq

    def flush(self) -> None:
        """Write the staged lines, in one ``os.write``. Raises as a write does (``HeadMoved``,
        ``OSError``); the staged lines are then gone and the log is poisoned: its seq and head
        count lines the file will never hold."""
        if not self._staged:
            return
        self._usable()
        lines, self._staged = self._staged, []
        data = b"".join(lines)  # (one line is joined without a copy)
        try:
            self._append(data)
        except OSError as exc:
            self._failed = exc
            raise
        self._last = lines[-1]

    def _write_line(self, line: bytes, digest: str) -> None:
        if self._staged:
            self.flush()  # in order
        self._append(line)
        self._seq += 1
        self._head = digest
        self._last = line

    def _append(self, data: bytes) -> None:
        # The file's size, by seeking to its end: what fstat would say, without building a
        # stat result (appends ignore the offset; reads here use pread).
        size = os.lseek(self._fd, 0, os.SEEK_END)
        if size != self._size:
            raise HeadMoved(
                errno.ESTALE,
                f"session log {self.path} changed under its writer"
                f" (size {size}, expected {self._size})",
            )
        try:
            _write_all(self._fd, data)
        except OSError:
            # Cut any partial line back off so the next append continues a clean chain; if even
            # that fails the file is in an unknown state and the log is poisoned.
            try:
                os.ftruncate(self._fd, self._size)
            except OSError as cut_exc:
                self._failed = cut_exc
            raise
        self._size += len(data)

    async def sync(self) -> None:
        """Return once every entry appended before this call is on disk.

        Group commit: one fsync per loop pass at most, inline (on the next pass after the first
        caller: every append of this pass is covered); it covers every append made before it
        started. Callers arriving after it started wait for the next one and all share it.
        An fsync error is raised (as ``OSError`` with its errno) to every caller
        waiting for it, and to every later caller with entries not yet durable (appends fail
        from then on too).
        """
        target = self._seq
        while self._durable < target:
            self._usable()
            task = self._fsync_task
            if task is None:
                task = self._fsync_task = asyncio.get_running_loop().create_task(self._fsync())
                task.add_done_callback(_retrieve)
            await asyncio.shield(task)

    async def _fsync(self) -> None:
        try:
            if self._durable < self._seq:  # a sync_now() of this pass may have covered it all
                self._fsync_covering()
        finally:
            self._fsync_task = None
            if self._closed:
                os.close(self._fd)

    def sync_now(self) -> None:
        """fsync at once, inline, if anything written is not yet durable: waiters of ``sync``
        see everything written as durable. Raises ``OSError`` (and poisons the log) if it
        fails."""
        if self._durable < self._seq:  # like sync(): nothing to do is no error, even closed
            self._usable()
            self._fsync_covering()

    def _fsync_covering(self) -> None:
        # Everything appended up to now is written once the staged lines are; the fsync starts
        # after this point, so it covers them.
        self.flush()
        covered, size = self._seq, self._size
        try:
            os.fsync(self._fd)  # inline: see the module's docstring
            if self._dir_unsynced:
                _fsync_dir(self.path.parent)
                self._dir_unsynced = False
        except OSError as exc:
            self._failed = exc
            raise OSError(
                exc.errno, f"session log {self.path}: fsync failed: {exc.strerror}"
            ) from exc
        if covered > self._durable:
            self._durable, self._durable_size = covered, size

    def named(self) -> bool:
        """The file at this log's path is still the one this writer holds (not removed or
        replaced): what it makes durable can be found by its session id."""
        if self._closed:
            return False
        try:
            named = os.stat(self.path)
        except OSError:
            return False
        return (named.st_dev, named.st_ino) == self._ident

    def head_is_mine(self) -> bool:
        """True if the file at this log's path is still the one this writer holds, with the
        size and last line it left there. False once another writer appended, truncated or
        replaced it (or it is gone)."""
        if self._closed:
            return False
        try:
            st = os.fstat(self._fd)
            at_path = os.stat(self.path)
            if (st.st_dev, st.st_ino) != (at_path.st_dev, at_path.st_ino):
                return False
            if st.st_size != self._size:
                return False
            n = len(self._last)
            return os.pread(self._fd, n, self._size - n) == self._last
        except OSError:
            return False

    def close(self) -> None:
        """Close the file, after writing what is staged (``OSError`` if that fails). Does not
        fsync: ``await sync()`` first for durability. If an fsync is still due, the descriptor
        is closed when it has run."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.flush()
        finally:
            self._closed = True
            if self._fsync_task is None:
                os.close(self._fd)

    def __enter__(self) -> "SessionLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SessionLog({str(self.path)!r}, seq={self._seq}, durable={self._durable})"


def _retrieve(task: "asyncio.Task[None]") -> None:
    # Waiters get the error through shield(); this keeps asyncio from logging it again when
    # every waiter was cancelled.
    if not task.cancelled():
        task.exception()


def _write_all(fd: int, data: bytes) -> None:
    n = os.write(fd, data)
    if n == len(data):  # nearly always: a short write is for a full disk or a signal
        return
    view = memoryview(data)[n:]
    while view:
        n = os.write(fd, view)
        view = view[n:]


# --- reading ------------------------------------------------------------------------------------


def read_session(sessions_dir: StrPath, session_id: str) -> VerifyResult:
    """Verify a session log read-only (never modifies the file). A torn last line is reported
    with ``torn=True``; other damage raises ``LogCorrupt`` naming the file and line."""
    path = session_path(sessions_dir, session_id)
    with _open_log(path, session_id) as f:
        data = f.read()
    try:
        result = verify(data)
    except LogCorrupt as exc:
        raise LogCorrupt(exc.line, exc.reason, str(path)) from None
    _check_start(result, path, session_id)
    return result


def _open_log(path: Path, session_id: str) -> BinaryIO:
    """A session's file, opened to read; a fifo or a directory there is an OSError (opened
    without blocking: a fifo would wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _missing(path, session_id) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "rb")


class SessionScan:
    """A session log verified read-only one line at a time, in little memory whatever its
    size (``read_session`` holds all of it). Iterate it for the entries (``LogCorrupt`` naming
    the file and line for damage); then ``count``, ``head``, ``torn``, ``end_offset`` and
    ``last`` (the last complete line, its newline included) say what was read. Given `fd` (at
    offset 0), it reads that descriptor and leaves it open.

    An empty file (0 bytes) is an error (``LogCorrupt``: the session never started), as for
    a restore, unless `allow_empty`: then it is a session with no entries (``empty`` says so),
    as a reader such as ``podctl sessions verify`` sees it: a pod's file made ahead of a first
    input that never came. A file with bytes but no complete entry stays an error."""

    def __init__(
        self,
        sessions_dir: StrPath,
        session_id: str,
        fd: int | None = None,
        *,
        allow_empty: bool = False,
    ) -> None:
        self.path = session_path(sessions_dir, session_id)
        self.session_id = session_id
        self.count = 0
        self.head = GENESIS
        self.torn = False
        self.end_offset = 0
        self.last = b""
        self.empty = False  # the file was empty (only with allow_empty)
        self._fd = fd
        self._allow_empty = allow_empty

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._fd is None:
            f = _open_log(self.path, self.session_id)
        else:
            f = os.fdopen(self._fd, "rb", closefd=False)
        with f:
            for line in f:
                if not line.endswith(b"\n"):
                    self.torn = True  # an append cut short (see verify)
                    break
                try:
                    entry = verify_line(line[:-1], self.count + 1, self.head)
                except LogCorrupt as exc:
                    raise LogCorrupt(exc.line, exc.reason, str(self.path)) from None
                if self.count == 0:
                    _check_start_entry(entry, self.path, self.session_id)
                self.count += 1
                self.head = entry["hash"]
                self.end_offset += len(line)
                self.last = line
                yield entry
        if self.count == 0:
            if self._allow_empty and not self.torn:
                self.empty = True
                return
            _check_first(None, self.path)


class SessionPage(msgspec.Struct, frozen=True):
    first: dict[str, Any]  # the session_start entry
    entries: list[dict[str, Any]]  # the entries asked for, oldest first
    last: int  # the seq of the newest complete entry


_PAGE_CHUNK = 1 << 20
_page_decoder = msgspec.json.Decoder(dict[str, Any])


def read_page(
    sessions_dir: StrPath, session_id: str, since: int, limit: int, max_bytes: int
) -> SessionPage:
    """The entries after seq `since`, at most `limit` of them and `max_bytes` of their lines
    (but at least one), read without decoding or verifying what comes before: in a log line N
    holds seq N, so the page starts after the since-th newline. A long-lived pod's `history`
    read and hashed its whole log per page (0.4 s at 100,000 entries, and `podctl history`
    asked for every page to show the newest 50). An entry whose seq is not its line's raises
    ``LogCorrupt`` (``read_session`` and ``SessionScan`` verify the whole chain). Read by
    offset: a file that shrinks meanwhile reads short (a mapping of it was a SIGBUS)."""
    path = session_path(sessions_dir, session_id)
    with _open_log(path, session_id) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        first = next(_lines_from(fd, 0, size), None)
        if first is None:
            _check_first(None, path)
        assert first is not None
        start = _page_entry(first[0], 1, path)
        _check_start_entry(start, path, session_id)
        last = _page_entry(_last_line(fd, size), None, path)
        entries: list[dict[str, Any]] = []
        used = 0
        seq = max(0, since) + 1
        for line, _ in _lines_from(fd, _after_lines(fd, seq - 1, size), size):
            if len(entries) >= limit or (entries and used + len(line) + 1 > max_bytes):
                break
            entries.append(_page_entry(line, seq, path))
            used += len(line) + 1
            seq += 1
    return SessionPage(first=start, entries=entries, last=int(last["seq"]))


def _lines_from(fd: int, pos: int, size: int) -> Iterator[tuple[bytes, int]]:
    """The complete lines (without their newline) from offset `pos` up to `size`, each with the
    offset after it. A last line without its newline (torn) is none."""
    buf = b""
    while pos < size:
        chunk = os.pread(fd, min(_CHUNK, size - pos), pos)
        if not chunk:
            return  # the file shrank
        pos += len(chunk)
        buf += chunk
        begin = 0
        while (nl := buf.find(b"\n", begin)) >= 0:
            yield buf[begin:nl], pos - len(buf) + nl + 1
            begin = nl + 1
        buf = buf[begin:]


def _after_lines(fd: int, count: int, size: int) -> int:
    """The offset just after the `count`-th newline (`size` if the log has fewer)."""
    pos = 0
    while count and pos < size:
        chunk = os.pread(fd, min(_PAGE_CHUNK, size - pos), pos)
        if not chunk:
            return size
        found = chunk.count(b"\n")
        if found < count:
            count -= found
            pos += len(chunk)
            continue
        at = -1
        for _ in range(count):
            at = chunk.find(b"\n", at + 1)
        return pos + at + 1
    return pos if not count else size


def _last_line(fd: int, size: int) -> bytes:
    """The last complete line (a torn one after it left out), without its newline."""
    window = _CHUNK
    while True:
        begin = max(0, size - window)
        data = os.pread(fd, size - begin, begin)
        end = data.rfind(b"\n")
        if end >= 0:
            start = data.rfind(b"\n", 0, end)
            if start >= 0 or begin == 0:
                return data[start + 1 : end]
        elif begin == 0:
            return b""
        window *= 2


def _page_entry(line: bytes, seq: int | None, path: Path) -> dict[str, Any]:
    """The entry `line` holds; `seq` what it must hold (None: the last line, number unknown)."""
    try:
        entry = _page_decoder.decode(line)
    except UNREADABLE as exc:
        if seq is None:  # its number is not known without counting every line
            raise LogCorrupt(0, f"not a JSON object: {exc}", str(path)) from None
        raise LogCorrupt(seq, f"not a JSON object: {exc}", str(path)) from None
    if seq is not None and entry.get("seq") != seq:
        raise LogCorrupt(seq, f"seq {entry.get('seq')!r} where {seq} belongs", str(path))
    return entry


def _first_line(path: Path) -> bytes:
    """A file's first line (without its newline). A fifo or a device named as a session is an
    OSError, opened without blocking: read, a fifo left `--resume` (and every start, under a
    `.tmp` name) waiting for a writer that never comes."""
    parts: list[bytes] = []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    with os.fdopen(fd, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            nl = chunk.find(b"\n")
            if nl >= 0:
                parts.append(chunk[:nl])
                break
            parts.append(chunk)
    return b"".join(parts)


def _head(first: bytes, session_id: str | None = None) -> _Head:
    """What a first line says, or nothing (``_Head()``) unless it is a `session_start` (of
    `session_id`, when given: a copy under another session's name is no session of its pod,
    and restoring it is refused, so `--resume` must not pick it)."""
    try:
        head = _head_decoder.decode(first)
    except UNREADABLE:
        return _Head()
    if head.kind != "session_start":
        return _Head()
    if session_id is not None and head.session_id and head.session_id != session_id:
        return _Head()
    return head


def list_sessions(sessions_dir: StrPath) -> list[SessionInfo]:
    """Every session log in ``sessions_dir``, newest first (UUIDv7 ids sort by creation time).

    Reads only each file's first line; files that vanish meanwhile are skipped, and so are
    empty ones (a session created without fsync whose first commit a power cut prevented:
    nothing in it was ever acknowledged). A first line that cannot be decoded or names another
    session (a copy under this name), and a name that is no readable file (a dangling link, a
    link loop, a directory, no permission), leave ``pod`` (and the link fields) None: listed
    as no pod's, never a reason to fail.
    """
    root = Path(sessions_dir)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    infos: list[SessionInfo] = []
    for name in names:
        if not name.endswith(SUFFIX):
            continue
        sid = name[: -len(SUFFIX)]
        if not _ID_RE.fullmatch(sid):
            continue
        path = root / name
        head = _Head()
        try:
            st = os.stat(path)
            if stat.S_ISREG(st.st_mode):
                if st.st_size == 0:
                    continue
                head = _head(_first_line(path), sid)
        except OSError:
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone
        infos.append(
            SessionInfo(
                id=sid,
                path=str(path),
                size=st.st_size,
                mtime=st.st_mtime,
                pod=head.pod,
                started=head.ts,
                forked_from=head.forked_from,
                compacted_from=head.compacted_from,
            )
        )
    infos.sort(key=lambda i: i.id, reverse=True)
    return infos


def continued_sessions(sessions_dir: StrPath, session_id: str) -> list[str]:
    """The sessions ``session_id`` continues, newest first: the one it was compacted or forked
    from, that one's, and so on. Reads one first line per session; stops at one it cannot
    read or has seen."""
    found: list[str] = []
    sid = session_id
    while True:
        try:
            head = _head_decoder.decode(_first_line(session_path(sessions_dir, sid)))
        except (OSError, ValueError, msgspec.DecodeError):
            return found
        link = head.compacted_from or head.forked_from
        if not link or link == session_id or link in found:
            return found
        found.append(link)
        sid = link


def continued_by(sessions_dir: StrPath, session_id: str, pod_name: str) -> list[str]:
    """The sessions of ``pod_name`` that continue ``session_id`` (compacted or forked from it),
    newest first: none for the end of its chain, the only kind its `--resume` picks (another
    pod's fork does not count; see ``session_to_resume``)."""
    return [
        i.id
        for i in list_sessions(sessions_dir)
        if i.pod == pod_name and session_id in (i.compacted_from, i.forked_from)
    ]


def session_pod(sessions_dir: StrPath, session_id: str) -> str | None:
    """The pod a session's first line names (None if it cannot be read)."""
    try:
        return _head(_first_line(session_path(sessions_dir, session_id))).pod
    except OSError:
        return None


def newest_session_for(sessions_dir: StrPath, pod_name: str) -> str | None:
    """The session ``pod_name`` continues with `--resume`, if any (see ``session_to_resume``)."""
    return session_to_resume(sessions_dir, pod_name).session_id


def damaged_continuations(
    sessions_dir: StrPath, session_id: str, unreadable: list[str]
) -> list[str]:
    """Of the `unreadable` sessions (first lines that name no pod), those whose first line
    still links, byte for byte, to `session_id` (``"compacted_from":"<id>"`` or
    ``"forked_from":"<id>"``, as a writer encodes it): damaged, they may hold what was
    acknowledged after `session_id` was compacted or forked."""
    links = [f'"{key}":"{session_id}"'.encode() for key in ("compacted_from", "forked_from")]
    found: list[str] = []
    for sid in unreadable:
        try:
            first = _first_line(session_path(sessions_dir, sid))
        except (OSError, ValueError):
            continue
        if any(link in first for link in links):
            found.append(sid)
    return found


class ResumeChoice(NamedTuple):
    session_id: str | None
    # Sessions written since that one (or ever, with none) whose file names no pod: one may be
    # this pod's, its first line damaged, and hold acknowledged input.
    unreadable: list[str]


def session_to_resume(sessions_dir: StrPath, pod_name: str) -> ResumeChoice:
    """The session ``pod_name`` continues with `--resume`, if any: the end of a chain (one no
    compaction or fork continued), and of those the one written last, not the one created
    last: a pod restored from an older session (`--session`) writes on in that one, and
    acknowledged input may wait there after a crash."""
    infos = list_sessions(sessions_dir)
    # Continued by this pod (a compaction, a fork): no longer its end. Another pod's fork of
    # one of its sessions (`--session`) leaves this pod's own where it was.
    continued = {i.compacted_from or i.forked_from for i in infos if i.pod == pod_name}
    ends = [i for i in infos if i.pod == pod_name and i.id not in continued]
    found = max(ends, key=lambda info: (info.mtime, info.id)) if ends else None
    since = found.mtime if found is not None else 0.0
    # A first line naming another pod is only believed if it verifies: one damaged byte in
    # the name made this pod's newest session another's, and `--resume` went on in the one
    # it was compacted from, leaving what was acknowledged after the compaction behind.
    unreadable = [
        i.id
        for i in infos
        if i.mtime >= since and (i.pod is None or (i.pod != pod_name and not _intact(i.path)))
    ]
    return ResumeChoice(found.id if found is not None else None, unreadable)


def _intact(path: str) -> bool:
    """Whether a log's first line verifies (its hash matches what it says)."""
    try:
        verify_line(_first_line(Path(path)), 1, GENESIS)
    except (OSError, LogCorrupt):
        return False
    return True
