"""The file store: create/open/append, torn tails, corruption, group commit, other writers."""

import asyncio
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from poddaemon.session import fold
from poddaemon.store.file import (
    HeadMoved,
    Reservation,
    SessionLog,
    SessionScan,
    damaged_continuations,
    list_sessions,
    newest_session_for,
    read_page,
    read_session,
    remove_if_empty,
    remove_leftovers,
    session_to_resume,
)
from poddaemon.store.log import LogCorrupt, new_session_id, verify


@pytest.fixture
def sessions() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="pdst"))
    try:
        yield root / "data" / "sessions"
    finally:
        shutil.rmtree(root, ignore_errors=True)


START = {"pod": "rev", "system_prompt": "sys", "config": {"x": 1}, "history": []}


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch, sessions: Path) -> list[str]:
    """What each os.fsync call synced, in order: "file" or "dir". The sessions directory exists
    (the fsyncs of making it are a test of their own)."""
    sessions.mkdir(parents=True)
    calls: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        calls.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_create_append_reopen(sessions: Path) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    assert stat.S_IMODE(os.stat(sessions).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600
    assert log.path == sessions / f"{sid}.jsonl"
    written = [log.append("user_input", {"run_id": "r", "text": f"m{i}"}) for i in range(5)]
    assert [e["seq"] for e in written] == [2, 3, 4, 5, 6]
    log.close()

    log2, entries, warnings = SessionLog.open(sessions, sid, list)
    assert warnings == []
    assert entries[0]["kind"] == "session_start"
    assert {k: entries[0][k] for k in START} == START
    assert entries[1:] == written
    assert log2.seq == 6 and log2.head == written[-1]["hash"]
    more = log2.append("run_start", {"run_id": "r"})
    assert more["seq"] == 7 and more["prev"] == written[-1]["hash"]
    log2.close()
    assert verify(log2.path.read_bytes()).entries[-1] == more


def test_create_refuses_an_existing_session(sessions: Path) -> None:
    sid = new_session_id()
    SessionLog.create(sessions, sid, START).close()
    with pytest.raises(FileExistsError):
        SessionLog.create(sessions, sid, START)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "x" * 200])
def test_bad_session_ids_are_refused(sessions: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid session id"):
        SessionLog.create(sessions, bad, START)


def test_open_missing_session(sessions: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no session"):
        SessionLog.open(sessions, "0190a0b0-0000-7000-8000-000000000000", list)


def test_torn_tail_is_cut_and_the_chain_continues(sessions: Path) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    kept = log.append("user_input", {"text": "kept"})
    log.append("user_input", {"text": "torn " * 10})
    log.close()
    data = log.path.read_bytes()
    torn_len = len(data.splitlines(keepends=True)[-1])
    cut_to = len(data) - 7  # leave a partial third line
    os.truncate(log.path, cut_to)

    log2, entries, warnings = SessionLog.open(sessions, sid, list)
    assert [e["seq"] for e in entries] == [1, 2]
    assert entries[-1] == kept
    assert warnings == [f"session {sid}: cut a torn last line ({torn_len - 7} bytes) at line 3"]
    assert log2.path.stat().st_size == len(data) - torn_len
    assert log2.head_is_mine()
    again = log2.append("user_input", {"text": "after"})
    assert again["seq"] == 3 and again["prev"] == kept["hash"]
    log2.close()

    log3, entries3, warnings3 = SessionLog.open(sessions, sid, list)
    assert warnings3 == [] and entries3[-1] == again
    log3.close()


def test_open_hands_the_entries_over_as_it_reads_them_and_never_holds_the_log(
    sessions: Path,
) -> None:
    """A restore folds each entry as it is read: the file's bytes and a list of every entry
    outlived a long session's restore, a heap ~1.7x the pod's."""
    sid = new_session_id()
    with SessionLog.create(sessions, sid, START) as log:
        for i in range(4000):
            log.append("tool_result", {"output": f"{i:04d} " + "x" * 2000})
    size = log.path.stat().st_size

    def count(entries: Iterator[dict[str, Any]]) -> int:
        return sum(1 for _ in entries)

    tracemalloc.start()
    try:
        opened, counted, warnings = SessionLog.open(sessions, sid, count)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 8_000_000 and peak < size / 20
    assert counted == 4001 and warnings == []
    assert opened.seq == 4001 and opened.head_is_mine()
    opened.close()


def test_open_reads_to_the_end_whatever_the_fold_took(sessions: Path) -> None:
    sid = new_session_id()
    with SessionLog.create(sessions, sid, START) as log:
        last = [log.append("user_input", {"text": f"m{i}"}) for i in range(3)][-1]
    opened, first, _ = SessionLog.open(sessions, sid, next)
    assert first["kind"] == "session_start"
    assert opened.seq == 4 and opened.head == last["hash"] and opened.head_is_mine()
    assert opened.append("run_start", {"run_id": "r"})["prev"] == last["hash"]
    opened.close()


def test_corruption_refuses_with_the_line_and_leaves_the_file(sessions: Path) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    for i in range(4):
        log.append("user_input", {"text": f"message {i}"})
    log.close()
    data = log.path.read_bytes()
    bad = data.replace(b"message 1", b"message X")
    log.path.write_bytes(bad)
    with pytest.raises(LogCorrupt) as info:
        SessionLog.open(sessions, sid, list)
    assert info.value.line == 3
    assert "line 3:" in str(info.value) and str(log.path) in str(info.value)
    assert log.path.read_bytes() == bad
    with pytest.raises(LogCorrupt):
        read_session(sessions, sid)


def test_a_line_that_is_not_utf8_is_corruption_naming_its_line(sessions: Path) -> None:
    sid = new_session_id()
    with SessionLog.create(sessions, sid, START) as log:
        log.append("user_input", {"text": "caf\u00e9"})
        log.append("user_input", {"text": "after"})
    data = log.path.read_bytes()
    bad = data.replace("caf\u00e9".encode(), b"caf\xff")
    log.path.write_bytes(bad)
    with pytest.raises(LogCorrupt, match="line 2: not valid JSON"):
        SessionLog.open(sessions, sid, list)
    with pytest.raises(LogCorrupt, match="line 2: not valid JSON"):
        list(SessionScan(sessions, sid))
    assert log.path.read_bytes() == bad


def test_a_sound_line_holding_no_entry_the_fold_reads_is_corruption_naming_its_line(
    sessions: Path,
) -> None:
    """Hash-valid but not an entry (a hand-made or foreign line): the restore said only the
    schema's complaint, without the file or the line."""
    sid = new_session_id()
    with SessionLog.create(sessions, sid, START) as log:
        log.append("user_input", {"run_id": "r", "text": "fine", "mode": "queue"})
        log.append("llm_usage", {"input": "lots"})
    with pytest.raises(LogCorrupt, match="line 3: not an entry this version can read") as info:
        SessionLog.open(sessions, sid, fold)
    assert info.value.path == str(log.path)


def test_a_log_without_session_start_is_refused(sessions: Path) -> None:
    sessions.mkdir(parents=True)
    path = sessions / "abc.jsonl"
    path.write_bytes(b'{"seq":1,"ts":1.0')  # crashed during create: torn first line
    with pytest.raises(LogCorrupt, match="line 1: "):
        SessionLog.open(sessions, "abc", list)
    assert path.read_bytes() == b'{"seq":1,"ts":1.0'


def test_a_log_under_another_sessions_name_is_refused_by_every_reader(sessions: Path) -> None:
    """Each log's chain starts afresh, so a copy (or a swap) verified whole: a pod continued
    it under the new name while its session_start, its status and its history named the old."""
    sid, other = new_session_id(), new_session_id()
    with SessionLog.create(sessions, sid, {**START, "session_id": sid}) as log:
        log.append("user_input", {"text": "x"})
    copy = sessions / f"{other}.jsonl"
    shutil.copyfile(log.path, copy)
    data = copy.read_bytes()
    why = f"line 1: session_start is session {sid}'s, not {other}'s"
    with pytest.raises(LogCorrupt, match=why):
        SessionLog.open(sessions, other, list)
    with pytest.raises(LogCorrupt, match=why):
        read_session(sessions, other)
    with pytest.raises(LogCorrupt, match=why):
        list(SessionScan(sessions, other))
    with pytest.raises(LogCorrupt, match=why):
        read_page(sessions, other, 0, 10, 1 << 20)
    assert copy.read_bytes() == data  # left for a human to look at
    assert len(read_session(sessions, sid).entries) == 2  # the original reads as before


def test_read_session_does_not_truncate(sessions: Path) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    log.append("user_input", {"text": "x"})
    log.close()
    with open(log.path, "ab") as f:
        f.write(b'{"seq":3,')
    size = log.path.stat().st_size
    result = read_session(sessions, sid)
    assert result.torn and len(result.entries) == 2
    assert log.path.stat().st_size == size


def test_reserved_keys_and_unencodable_bodies_write_nothing(sessions: Path) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    size = log.path.stat().st_size
    with pytest.raises(ValueError):
        log.append("x", {"seq": 5})
    with pytest.raises(TypeError):
        log.append("x", {"v": object()})
    assert log.path.stat().st_size == size
    assert log.append("x", {})["seq"] == 2
    log.close()


def test_append_never_reads_the_file(sessions: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    for i in range(50):
        log.append("user_input", {"text": str(i)})

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("append read the file")

    for name in ("read", "pread", "open", "stat"):
        monkeypatch.setattr(os, name, refuse)
    real_lseek = os.lseek

    def size_only(fd: int, pos: int, how: int) -> int:  # the size check, not a read
        if (pos, how) != (0, os.SEEK_END):
            raise AssertionError("append seeks into the file")
        return real_lseek(fd, pos, how)

    monkeypatch.setattr(os, "lseek", size_only)
    monkeypatch.setattr("builtins.open", refuse)
    for i in range(50):
        log.append("user_input", {"text": str(i)})
    monkeypatch.undo()
    assert log.seq == 101
    log.close()


def test_head_is_mine_false_after_a_second_writer(sessions: Path) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    log.append("user_input", {"text": "a"})
    assert log.head_is_mine()
    other, _, _ = SessionLog.open(sessions, sid, list)
    other.append("user_input", {"text": "from elsewhere"})
    other.close()
    assert not log.head_is_mine()
    with pytest.raises(HeadMoved):
        log.append("user_input", {"text": "would break the chain"})
    log.close()
    # The file is still a valid chain: the refused append wrote nothing.
    assert len(read_session(sessions, sid).entries) == 3


def test_head_is_mine_false_when_the_file_is_replaced(sessions: Path) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    data = log.path.read_bytes()
    tmp = log.path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, log.path)
    assert not log.head_is_mine()
    log.close()
    assert not log.head_is_mine()


def test_fork_links_to_the_old_session(sessions: Path) -> None:
    old = SessionLog.create(sessions, new_session_id(), START)
    new = old.fork(None, None, {**START, "history": [{"type": "user", "text": "x"}]})
    assert new.session_id != old.session_id
    _, entries, _ = SessionLog.open(sessions, new.session_id, list)
    assert entries[0]["forked_from"] == old.session_id
    assert entries[0]["history"] == [{"type": "user", "text": "x"}]
    [info] = [i for i in list_sessions(sessions) if i.id == new.session_id]
    assert info.forked_from == old.session_id
    old.close()
    new.close()


def test_list_sessions_and_newest_for(sessions: Path) -> None:
    assert list_sessions(sessions) == []
    assert newest_session_for(sessions, "a") is None
    made: list[tuple[str, str]] = []
    for pod in ["a", "b", "a", "c", "a", "b"]:
        sid = new_session_id()
        SessionLog.create(sessions, sid, {**START, "pod": pod}).close()
        made.append((sid, pod))
    (sessions / "notes.txt").write_text("ignored")
    (sessions / "junk.jsonl").write_bytes(b"not json\n")
    infos = list_sessions(sessions)
    real = [i for i in infos if i.id != "junk"]
    assert [(i.id, i.pod) for i in real] == list(reversed(made))
    assert all(i.size > 0 and i.started is not None for i in real)
    [junk] = [i for i in infos if i.id == "junk"]
    assert junk.pod is None
    assert newest_session_for(sessions, "a") == made[4][0]
    assert newest_session_for(sessions, "b") == made[5][0]
    assert newest_session_for(sessions, "zzz") is None


def test_names_that_are_no_readable_file_are_listed_as_no_pods_and_never_fail(
    sessions: Path,
) -> None:
    """One link loop in the sessions dir made every pod's --resume, and `podctl sessions
    list`, fail ("Too many levels of symbolic links")."""
    sessions.mkdir(parents=True)
    loop, dangling, folder, first = (new_session_id() for _ in range(4))
    os.symlink(f"{loop}.jsonl", sessions / f"{loop}.jsonl")
    os.symlink("/nonexistent/x.jsonl", sessions / f"{dangling}.jsonl")
    (sessions / f"{folder}.jsonl").mkdir()
    (sessions / f"{first}.jsonl").write_bytes(b'{"kind":"session_start","pod":"\xff"}\n')
    infos = {i.id: i for i in list_sessions(sessions)}
    assert set(infos) == {loop, dangling, folder, first}
    assert all(i.pod is None for i in infos.values())


def test_resume_names_the_sessions_written_since_that_name_no_pod(sessions: Path) -> None:
    """A pod's newest session with a damaged first line names no pod: --resume took an older
    one (or a new session), silently leaving what the damaged one acknowledged."""
    older, damaged = new_session_id(), new_session_id()
    SessionLog.create(sessions, older, {**START, "pod": "a"}).close()
    assert session_to_resume(sessions, "a") == (older, [])
    with SessionLog.create(sessions, damaged, {**START, "pod": "a"}) as log:
        log.append("user_input", {"text": "acknowledged"})
    os.utime(sessions / f"{older}.jsonl", (1, 1))  # written long before the damaged one
    data = log.path.read_bytes()
    log.path.write_bytes(b"#" + data[1:])
    assert session_to_resume(sessions, "a") == (older, [damaged])
    assert session_to_resume(sessions, "b") == (None, [damaged])
    os.utime(log.path, (0, 0))  # older than the one resumed: not this pod's newest
    assert session_to_resume(sessions, "a") == (older, [])


def test_list_sessions_reads_only_the_first_line(sessions: Path) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    log.close()
    with open(log.path, "ab") as f:
        f.write(b"\x00garbage that would not verify\n" * 10)
    [info] = list_sessions(sessions)
    assert info.pod == "rev"


def test_a_session_created_without_fsync_is_made_durable_by_its_first_commit(
    sessions: Path, synced: list[str]
) -> None:
    """`durable=False`: nothing is fsync'd at creation; the first commit fsyncs the file and then
    its directory (the new name), once; later commits fsync the file only."""
    log = SessionLog.create(sessions, new_session_id(), START, durable=False)
    assert synced == [] and (log.seq, log.durable_seq, log.durable_size) == (1, 0, 0)
    log.append("user_input", {"text": "first"})
    log.sync_now()
    assert synced == ["file", "dir"]
    assert (log.durable_seq, log.durable_size) == (2, log.path.stat().st_size)
    log.append("user_input", {"text": "second"})
    log.sync_now()
    assert synced == ["file", "dir", "file"] and log.durable_seq == 3
    log.close()
    durable = SessionLog.create(sessions, new_session_id(), START)  # the default
    assert synced[3:] == ["file", "dir"] and durable.durable_seq == 1
    durable.close()


def test_the_directories_made_for_the_first_session_are_made_durable_at_once(
    sessions: Path, synced: list[str]
) -> None:
    """Two directories do not exist yet: each one's name is fsync'd in its parent as it is made
    (the session file's own fsyncs cover only the file and its name)."""
    fresh = sessions / "more" / "sessions"
    log = SessionLog.create(fresh, new_session_id(), START, durable=False)
    assert synced == ["dir", "dir"]  # sessions/ (for more/), then more/ (for sessions/)
    log.append("user_input", {"text": "first"})
    log.sync_now()
    assert synced == ["dir", "dir", "file", "dir"]
    log.close()
    SessionLog.create(fresh, new_session_id(), START, durable=False).close()
    assert len(synced) == 4  # made once


def test_a_reserved_file_makes_its_session_need_one_fsync_at_its_first_commit(
    sessions: Path, synced: list[str]
) -> None:
    """A reservation is an empty file made durable ahead (file, then directory): the session
    written into it later fsyncs its file only, its name being durable already. Until then the
    file is no session; a reservation is used once, and only for its own session."""
    reserved = Reservation(sessions, new_session_id())
    assert synced == ["file", "dir"]
    assert reserved.path.stat().st_size == 0 and list_sessions(sessions) == []
    with pytest.raises(ValueError, match="is not for"):
        SessionLog.create(sessions, new_session_id(), START, durable=False, reserved=reserved)
    log = SessionLog.create(sessions, reserved.session_id, START, durable=False, reserved=reserved)
    assert log.path == reserved.path and synced == ["file", "dir"]
    log.append("user_input", {"text": "first"})
    log.sync_now()
    assert synced == ["file", "dir", "file"] and log.durable_seq == 2
    log.close()
    assert [i.id for i in list_sessions(sessions)] == [reserved.session_id]
    assert [e["kind"] for e in verify(log.path.read_bytes()).entries] == [
        "session_start",
        "user_input",
    ]
    with pytest.raises(ValueError, match="already used"):
        SessionLog.create(sessions, reserved.session_id, START, reserved=reserved)
    reserved.discard()  # taken by the log: the session stays
    assert log.path.exists()


def test_a_reserved_file_removed_before_its_session_is_made_anew(
    sessions: Path, synced: list[str]
) -> None:
    """Someone removes the empty file (clearing "empty" files, say) before the first input:
    the session must not go into the unnamed file, where an acknowledged input would be lost;
    it is created anew under its name, and its first commit fsyncs the directory too."""
    reserved = Reservation(sessions, new_session_id())
    reserved.path.unlink()
    log = SessionLog.create(sessions, reserved.session_id, START, durable=False, reserved=reserved)
    log.append("user_input", {"text": "first"})
    log.sync_now()
    assert synced == ["file", "dir", "file", "dir"]  # the reservation's, then the new file's
    assert [i.id for i in list_sessions(sessions)] == [reserved.session_id]
    assert log.path.stat().st_size == log.durable_size
    log.close()


def test_a_discarded_reservation_leaves_nothing(sessions: Path) -> None:
    reserved = Reservation(sessions, new_session_id())
    with pytest.raises(FileExistsError):
        Reservation(sessions, reserved.session_id)
    reserved.discard()
    reserved.discard()  # twice is harmless
    assert list(sessions.iterdir()) == []


# --- group commit ------------------------------------------------------------------------------


class FsyncSpy:
    """Wraps os.fsync: records the file size each fsync saw when it started, and whether it
    finished; optionally holds the first one until released, so that callers pile up."""

    def __init__(self, fd: int, hold_first: bool = False) -> None:
        self.fd = fd
        self.real = os.fsync
        self.lock = threading.Lock()
        self.started: list[int] = []  # file size at start, per call
        self.finished: list[bool] = []
        self.first_started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.error: OSError | None = None
        self.during_first: Callable[[], None] | None = None  # run inside the first fsync

    def __call__(self, fd: int) -> None:
        with self.lock:
            index = len(self.started)
            self.started.append(os.fstat(fd).st_size)
            self.finished.append(False)
        if index == 0:
            self.first_started.set()
            self.release.wait(10)
            if self.during_first is not None:
                self.during_first()
        if self.error is not None:
            raise self.error
        self.real(fd)
        with self.lock:
            self.finished[index] = True

    def covered(self, end: int) -> bool:
        """A finished fsync started when the file already held ``end`` bytes."""
        with self.lock:
            return any(f and s >= end for s, f in zip(self.started, self.finished, strict=True))


async def test_group_commit_shares_fsyncs(sessions: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    monkeypatch.setattr(os, "fsync", spy)

    async def writer(i: int) -> None:
        log.append("user_input", {"text": f"m{i}"})
        end = os.fstat(log.fileno()).st_size
        await log.sync()
        assert spy.covered(end), i

    await asyncio.gather(*(writer(i) for i in range(100)))
    assert 1 <= len(spy.started) < 100
    assert log.durable_seq == log.seq == 101
    log.close()


async def test_callers_arriving_during_an_fsync_wait_for_the_next(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fsync runs inline once per loop pass: the first wave's appends all share it; an
    append made once it has started (here from inside it, the only way on one loop) is not
    counted durable by it, and its caller gets the next fsync, shared by the second wave."""
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    late: list[asyncio.Task[None]] = []

    async def late_writer() -> None:
        end = os.fstat(log.fileno()).st_size
        await log.sync()
        assert spy.covered(end)

    def during_first() -> None:
        log.append("user_input", {"text": "during"})
        late.append(asyncio.get_running_loop().create_task(late_writer()))

    spy.during_first = during_first
    monkeypatch.setattr(os, "fsync", spy)
    returned: list[int] = []

    async def writer(i: int) -> None:
        log.append("user_input", {"text": f"m{i}"})
        end = os.fstat(log.fileno()).st_size
        await log.sync()
        assert spy.covered(end), i
        returned.append(i)

    first = [asyncio.create_task(writer(i)) for i in range(10)]
    await asyncio.gather(*first)
    await asyncio.gather(*late)
    # One fsync for the whole first wave; the entry appended during it needed another (its
    # writer checked that a later-started fsync covered it).
    assert sorted(returned) == list(range(10)) and len(spy.started) == 2
    assert spy.started[1] > spy.started[0]
    second = [asyncio.create_task(writer(i)) for i in range(10, 20)]
    await asyncio.gather(*second)
    assert sorted(returned) == list(range(20))
    assert len(spy.started) == 3  # the second wave shares one
    assert log.durable_seq == log.seq == 22
    log.close()


async def test_sync_with_nothing_pending_does_not_fsync(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    monkeypatch.setattr(os, "fsync", spy)
    await log.sync()
    assert spy.started == []
    log.append("x", {})
    await log.sync()
    await log.sync()
    assert len(spy.started) == 1
    log.close()


async def test_fsync_error_reaches_every_waiter_and_poisons(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    spy.error = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", spy)

    async def writer(i: int) -> None:
        log.append("user_input", {"text": f"m{i}"})
        await log.sync()

    tasks = [asyncio.create_task(writer(i)) for i in range(5)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert len(results) == 5
    for r in results:
        assert isinstance(r, OSError) and r.errno == errno.ENOSPC, r
    # Poisoned: no later append or sync pretends all is well.
    with pytest.raises(OSError) as info:
        log.append("x", {})
    assert info.value.errno == errno.ENOSPC
    assert log.durable_seq == 1
    log.close()


async def test_a_failed_write_is_cut_back_and_the_log_continues(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    real_write = os.write
    calls = 0

    def half_then_enospc(fd: int, data: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_enospc)
    with pytest.raises(OSError):
        log.append("user_input", {"text": "lost"})
    monkeypatch.undo()
    entry = log.append("user_input", {"text": "fine"})
    assert entry["seq"] == 2
    await log.sync()
    log.close()
    result = read_session(sessions, sid)
    assert not result.torn and [e.get("text") for e in result.entries] == [None, "fine"]


async def test_close_while_an_fsync_is_due(sessions: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    monkeypatch.setattr(os, "fsync", spy)
    log.append("x", {})
    task = asyncio.create_task(log.sync())
    await asyncio.sleep(0)  # the waiter has scheduled the fsync; it runs on the next pass
    assert spy.started == []
    log.close()
    await task
    assert spy.finished == [True]  # it ran on the still open descriptor, then closed it
    assert log.closed
    with pytest.raises(ValueError, match="closed"):
        log.append("x", {})


async def test_a_cancelled_waiter_does_not_cancel_the_shared_fsync(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    monkeypatch.setattr(os, "fsync", spy)
    log.append("x", {})
    end = os.fstat(log.fileno()).st_size
    impatient = asyncio.create_task(log.sync())
    patient = asyncio.create_task(log.sync())
    await asyncio.sleep(0)  # both wait on the fsync due on the next pass
    impatient.cancel()
    await patient
    assert impatient.cancelled()
    assert spy.covered(end) and len(spy.started) == 1
    assert log.durable_seq == 2
    log.close()


def test_damaged_complete_last_line_is_refused_not_cut(sessions: Path) -> None:
    # SPEC §8: the last line has its newline, so it was written whole (and acknowledged):
    # damage there is corruption, never a torn write to cut silently.
    sid = new_session_id()
    with SessionLog.create(sessions, sid, START) as log:
        log.append("user_input", {"text": "acknowledged"})
    data = bytearray(log.path.read_bytes())
    data[-2] ^= 0x01  # the closing brace of the last line: no longer JSON
    log.path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt) as info:
        SessionLog.open(sessions, sid, list)
    assert info.value.line == 2 and str(log.path) in str(info.value)
    with pytest.raises(LogCorrupt):
        read_session(sessions, sid)
    assert log.path.read_bytes() == bytes(data)  # left for a human to look at


def test_sync_now_fsyncs_what_is_not_durable_once(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    monkeypatch.setattr(os, "fsync", spy)
    log.sync_now()  # nothing written since create: no fsync
    assert spy.started == []
    for i in range(3):
        assert log.write("user_input", {"text": str(i)}) == i + 2
    end = os.fstat(log.fileno()).st_size
    log.sync_now()
    assert spy.started == [end] and spy.covered(end)
    assert (log.durable_seq, log.durable_size) == (4, end)
    log.sync_now()
    assert len(spy.started) == 1
    log.close()
    log.sync_now()  # closed, and nothing to sync: no error


def test_sync_now_failure_poisons_the_log(sessions: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = SessionLog.create(sessions, new_session_id(), START)
    spy = FsyncSpy(log.fileno())
    spy.error = OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "fsync", spy)
    log.write("user_input", {"text": "lost"})
    with pytest.raises(OSError, match="fsync failed"):
        log.sync_now()
    assert log.durable_seq == 1
    spy.error = None
    with pytest.raises(OSError, match="failed earlier"):  # a later fsync would prove nothing
        log.sync_now()
    with pytest.raises(OSError):
        log.write("user_input", {"text": "after"})
    log.close()


def test_resume_takes_the_end_of_a_chain_written_last(sessions: Path) -> None:
    """`--resume`: a session some other one continues (compaction, fork) is never taken, even
    when it was written after; of the rest, the one written last, not the one made last."""
    older = SessionLog.create(sessions, new_session_id(), START)
    newer = SessionLog.create(sessions, new_session_id(), START)
    newer.close()
    older.append("system_item", {"id": "n1", "source": "ci", "text": "restored, then more"})
    older.sync_now()
    later = time.time_ns() + 10**12
    os.utime(older.path, ns=(later, later))  # written last, whatever the clock's grain
    assert newest_session_for(sessions, "rev") == older.session_id
    fork = older.fork(None, None, {**START, "history": []})
    fork.close()
    older.close()
    os.utime(older.path, ns=(later + 10**12, later + 10**12))
    assert newest_session_for(sessions, "rev") == fork.session_id


def test_an_empty_session_file_is_no_session(sessions: Path) -> None:
    """What a crash or a power cut while a session is created can leave (the file made, its
    first line not yet on disk; nothing in it was acknowledged): listings skip it, and
    `--resume` takes the pod's newest session with a session_start."""
    older = SessionLog.create(sessions, new_session_id(), START)
    older.close()
    empty = new_session_id()
    (sessions / f"{empty}.jsonl").write_bytes(b"")
    assert [i.id for i in list_sessions(sessions)] == [older.session_id]
    assert newest_session_for(sessions, "rev") == older.session_id


def test_remove_if_empty_removes_only_an_empty_regular_file(sessions: Path) -> None:
    """What the registry does with a dead pod's session file: an empty one (a reservation the
    first input never came to) goes; a file with any byte in it, even one torn line, stays."""
    reserved = Reservation(sessions, new_session_id())
    os.close(reserved.take())  # as a pod killed before its first input leaves it
    assert remove_if_empty(sessions, reserved.session_id) is True
    assert not reserved.path.exists()
    assert remove_if_empty(sessions, reserved.session_id) is False  # gone: nothing to do
    started = SessionLog.create(sessions, new_session_id(), START)
    started.close()
    torn = sessions / f"{new_session_id()}.jsonl"
    torn.write_bytes(b'{"seq":1')  # a first line cut short: bytes, so never removed
    target = sessions / "elsewhere"
    target.write_bytes(b"")
    link = sessions / f"{new_session_id()}.jsonl"
    link.symlink_to(target)  # a link is no file a pod made: left alone
    for path in (started.path, torn, link):
        assert remove_if_empty(sessions, path.name.removesuffix(".jsonl")) is False
        assert os.path.lexists(path)
    assert target.exists()


def test_a_reader_that_allows_it_sees_an_empty_file_as_a_session_with_no_entries(
    sessions: Path,
) -> None:
    """`podctl sessions verify`/`show` read with allow_empty; a restore (SessionLog.open) never
    takes an empty file as a session, and a first line cut short stays damage for both."""
    sid = new_session_id()
    sessions.mkdir(parents=True)
    (sessions / f"{sid}.jsonl").write_bytes(b"")
    scan = SessionScan(sessions, sid, allow_empty=True)
    assert list(scan) == [] and scan.empty and scan.count == 0 and not scan.torn
    with pytest.raises(LogCorrupt, match="never started"):
        list(SessionScan(sessions, sid))
    with pytest.raises(LogCorrupt, match="never started"):
        SessionLog.open(sessions, sid, list)
    (sessions / f"{sid}.jsonl").write_bytes(b'{"seq":1')
    scan = SessionScan(sessions, sid, allow_empty=True)
    with pytest.raises(LogCorrupt, match="never started"):
        list(scan)
    assert not scan.empty


# --- staged lines: entries of one loop pass, one os.write ----------------------------------------


def _record(text: str) -> dict[str, Any]:
    return {"kind": "system_item", "ts": 1.0, "text": text}


def test_staged_lines_count_at_once_and_are_written_by_one_flush(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    size = log.path.stat().st_size
    seqs = [log.stage_record(_record(f"n{i}")) for i in range(5)]
    assert seqs == [2, 3, 4, 5, 6] and log.seq == 6
    assert log.path.stat().st_size == size  # nothing written yet
    writes: list[int] = []
    real_write = os.write

    def count(fd: int, data: Any) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", count)
    log.flush()
    log.flush()  # nothing more staged: no write
    monkeypatch.undo()
    assert len(writes) == 1
    entries = read_session(sessions, sid).entries
    assert [e.get("text") for e in entries] == [None, "n0", "n1", "n2", "n3", "n4"]
    assert entries[-1]["hash"] == log.head
    log.close()


def test_a_write_a_sync_or_close_writes_the_staged_lines_first(
    sessions: Path, synced: list[str]
) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    log.stage_record(_record("a"))
    log.write("user_input", {"text": "b"})  # after "a", in the chain and in the file
    log.stage_record(_record("c"))
    log.sync_now()  # durable covers the staged line: it was written before the fsync
    assert log.durable_seq == 4 and log.durable_size == log.path.stat().st_size
    log.stage_record(_record("d"))
    log.close()
    texts = [e.get("text") for e in read_session(sessions, sid).entries]
    assert texts == [None, "a", "b", "c", "d"]


def test_a_flush_after_another_writer_moved_the_head_writes_nothing_and_poisons(
    sessions: Path,
) -> None:
    sid = new_session_id()
    log = SessionLog.create(sessions, sid, START)
    log.stage_record(_record("ours"))
    other, _, _ = SessionLog.open(sessions, sid, list)
    other.append("user_input", {"text": "from elsewhere"})
    other.close()
    with pytest.raises(HeadMoved):
        log.flush()
    with pytest.raises(OSError):  # its seq and head count a line the file will never hold
        log.stage_record(_record("later"))
    log.close()  # closes without writing
    texts = [e.get("text") for e in read_session(sessions, sid).entries]
    assert texts == [None, "from elsewhere"]


# --- read_page: a page of a long log without reading all of it ------------------------------


def _log_of(sessions: Path, n: int, text: str = "x") -> str:
    """A session of `n` entries (its session_start and n - 1 notes); its id."""
    sid = new_session_id()
    with SessionLog.create(sessions, sid, START) as log:
        for i in range(2, n + 1):
            log.append("system_item", {"id": f"n{i}", "text": f"{text}{i}"})
    return sid


@pytest.mark.parametrize(
    ("since", "limit", "seqs"),
    [
        (0, 3, [1, 2, 3]),
        (1, 2, [2, 3]),
        (4_990, 100, list(range(4_991, 5_001))),
        (5_000, 10, []),
        (9_999, 10, []),
    ],
)
def test_read_page_is_what_the_whole_log_says(
    sessions: Path, since: int, limit: int, seqs: list[int]
) -> None:
    sid = _log_of(sessions, 5_000)
    whole = read_session(sessions, sid).entries
    page = read_page(sessions, sid, since, limit, 1 << 20)
    assert [e["seq"] for e in page.entries] == seqs
    assert page.entries == [e for e in whole if e["seq"] > since][:limit]
    assert page.first == whole[0] and page.last == 5_000


def test_read_page_keeps_to_its_byte_budget_but_gives_one_entry(sessions: Path) -> None:
    sid = _log_of(sessions, 10, text="y" * 1000)
    assert len(read_page(sessions, sid, 1, 10, 2_500).entries) == 2  # two ~1.1 KB lines fit
    assert [e["seq"] for e in read_page(sessions, sid, 1, 10, 10).entries] == [2]


def test_read_page_leaves_out_a_torn_last_line(sessions: Path) -> None:
    sid = _log_of(sessions, 4)
    path = sessions / f"{sid}.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"seq":5,"kind":"system_it')
    page = read_page(sessions, sid, 2, 10, 1 << 20)
    assert [e["seq"] for e in page.entries] == [3, 4] and page.last == 4


def test_read_page_names_a_line_whose_seq_is_not_its_own(sessions: Path) -> None:
    sid = _log_of(sessions, 6)
    path = sessions / f"{sid}.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    del lines[2]  # line 3 now holds seq 4
    path.write_bytes(b"".join(lines))
    with pytest.raises(LogCorrupt, match="line 3: seq 4 where 3 belongs"):
        read_page(sessions, sid, 1, 10, 1 << 20)
    assert [e["seq"] for e in read_page(sessions, sid, 0, 2, 1 << 20).entries] == [1, 2]


def test_read_page_of_a_log_without_session_start_is_refused(sessions: Path) -> None:
    sid = _log_of(sessions, 1)
    path = sessions / f"{sid}.jsonl"
    path.write_bytes(b"")
    with pytest.raises(LogCorrupt):
        read_page(sessions, sid, 0, 10, 1 << 20)


def test_read_page_of_a_file_that_shrank_since_its_size_was_taken(
    sessions: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer cut the file back after read_page took its size (an append that failed
    is truncated away; a restore cuts a torn tail). It reads short and says what it found: a
    mapping of the file killed the process with SIGBUS when it touched the lost pages."""
    sid = _log_of(sessions, 50)
    real_size = (sessions / f"{sid}.jsonl").stat().st_size
    real_fstat = os.fstat

    def grown(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        fields = list(st)
        fields[stat.ST_SIZE] = real_size + 3 * 4096  # what it was before it shrank
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", grown)
    page = read_page(sessions, sid, 45, 100, 1 << 20)
    assert [e["seq"] for e in page.entries] == [46, 47, 48, 49, 50] and page.last == 50


def test_a_new_complete_session_removes_the_tmp_files_its_pod_left_in_a_crash(
    sessions: Path,
) -> None:
    # A compaction cut short by a crash left `<id>.jsonl.tmp` (nothing reads it) for good.
    def leftover(pod: str) -> Path:
        sid = new_session_id()
        log = SessionLog.create(sessions, sid, {"pod": pod})
        log.close()
        tmp = sessions / f"{sid}.jsonl.tmp"
        (sessions / f"{sid}.jsonl").rename(tmp)
        return tmp

    mine, theirs = leftover("p"), leftover("q")
    garbage = sessions / f"{new_session_id()}.jsonl.tmp"
    garbage.write_bytes(b"\x00 not a line")
    held = sessions / f"{new_session_id()}.jsonl.tmp"
    held.write_bytes(b"")
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # its writer is at work
        log = SessionLog.create_complete(sessions, new_session_id(), {"pod": "p"})
        log.close()
    finally:
        os.close(fd)
    assert not mine.exists() and not garbage.exists()  # nobody names it, nobody writes it
    assert theirs.exists() and held.exists()  # another pod's, and one being written


def test_a_temp_file_being_written_is_never_removed_as_a_leftover(sessions: Path) -> None:
    """A writer holds its temp file locked until the rename: a start cleaning up (even of the
    same pod name) between the write and the rename leaves it, and the session comes whole."""
    sid = new_session_id()
    tmp = sessions / f"{sid}.jsonl.tmp"
    seen: list[bool] = []

    def cleaner_meanwhile() -> None:
        remove_leftovers(sessions, "p")
        seen.append(tmp.exists())

    log = SessionLog.create_complete(sessions, sid, {"pod": "p"}, written=cleaner_meanwhile)
    log.close()
    assert seen == [True] and not tmp.exists()
    assert read_session(sessions, sid).entries[0]["pod"] == "p"


def test_resume_never_picks_a_copy_under_another_sessions_name(sessions: Path) -> None:
    """A copy saved under a newer id (`cp X.jsonl X-copy.jsonl`: a newer mtime too) was the
    `--resume` choice, and restoring it is refused: the pod could not start at all."""
    sid = new_session_id()
    with SessionLog.create(sessions, sid, {**START, "session_id": sid}) as log:
        log.append("user_input", {"text": "x"})
    copy = new_session_id()
    shutil.copyfile(log.path, sessions / f"{copy}.jsonl")
    os.utime(log.path, (1.0, 1.0))  # the copy is written after
    assert session_to_resume(sessions, "rev") == (sid, [copy])  # picked: the original; named
    infos = {i.id: i for i in list_sessions(sessions)}
    assert infos[copy].pod is None and infos[sid].pod == "rev"


def test_damaged_continuations_are_the_unreadable_logs_that_still_link_to_the_session(
    sessions: Path,
) -> None:
    sessions.mkdir(parents=True)
    sid, compacted, forked, other = (new_session_id() for _ in range(4))
    for name, link in ((compacted, "compacted_from"), (forked, "forked_from"), (other, "x")):
        damaged = f'{{"{link}":"{sid}","kind":"session_sta\n'  # cut short, then a newline
        (sessions / f"{name}.jsonl").write_bytes(damaged.encode())
    assert damaged_continuations(sessions, sid, [compacted, forked, other, "gone"]) == [
        compacted,
        forked,
    ]


def test_an_empty_line_is_said_to_be_one(sessions: Path) -> None:
    """An editor's extra newline read as "not valid JSON (Input data was truncated)" (found by
    QA), which sent the user looking for a torn write."""
    sid = new_session_id()
    with SessionLog.create(sessions, sid, START) as log:
        log.append("user_input", {"text": "one"})
    log.path.write_bytes(log.path.read_bytes() + b"\n")
    with pytest.raises(LogCorrupt, match="line 3: an empty line, where an entry belongs"):
        SessionLog.open(sessions, sid, list)
