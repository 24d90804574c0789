"""Builtin file and search tools against a real filesystem under a real Scope."""

import asyncio
import contextlib
import errno
import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from poddaemon.scope import Access, Scope
from poddaemon.tools import (
    BUILTIN,
    DEFAULT_TOOLS,
    ToolContext,
    ToolOutcome,
    ToolOutputLimits,
    cap_output,
    execute,
    tool_specs,
)
from poddaemon.tools import files as files_mod
from poddaemon.tools import search as search_mod
from poddaemon.tools.base import FileStamp, Stop, escape_controls
from poddaemon.toolset import Toolset


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "pod"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "outside"
    o.mkdir()
    (o / "secret.txt").write_text("TOPSECRET\n")
    return o


def make_ctx(root: Path, permission: str = "write", **limits: Any) -> ToolContext:
    scope = Scope.from_config([(str(root), permission, True)])
    return ToolContext(scope=scope, pwd=str(root), limits=ToolOutputLimits(**limits))


@pytest.fixture
def ctx(root: Path) -> ToolContext:
    return make_ctx(root)


async def call(ctx: ToolContext, name: str, **args: Any) -> ToolOutcome:
    return await execute(name, msgspec.json.encode(args).decode(), ctx)


async def read(ctx: ToolContext, path: str) -> ToolOutcome:
    out = await call(ctx, "read_file", path=path)
    assert not out.is_error, out.output
    return out


# --- read_file ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["read_file", "grep"])
async def test_a_fifo_is_refused_without_being_opened(
    ctx: ToolContext, root: Path, tool: str
) -> None:
    # Opened to find out what it was: a writer blocked on the FIFO was released (and a device
    # node in a scope, /dev under a read scope of /, would have been opened: a watchdog armed).
    os.mkfifo(root / "f")
    released = threading.Event()

    def writer() -> None:
        fd = os.open(root / "f", os.O_WRONLY)
        released.set()
        os.close(fd)

    threading.Thread(target=writer, daemon=True).start()
    args = {"path": "f"} if tool == "read_file" else {"pattern": "x", "path": "f"}
    out = await call(ctx, tool, **args)
    assert not released.wait(0.5)
    assert out.output == "f is not a regular file"  # (grep named it: never "no matches")
    assert out.is_error
    os.close(os.open(root / "f", os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
    assert released.wait(5)


async def test_read_file_numbers_lines_and_records_stamp(ctx: ToolContext, root: Path) -> None:
    f = root / "a.txt"
    f.write_text("alpha\nbeta\ngamma\n")
    out = await call(ctx, "read_file", path="a.txt")
    assert not out.is_error
    assert out.output == "     1\talpha\n     2\tbeta\n     3\tgamma"
    assert out.summary == "read 3 lines of a.txt"
    st = f.stat()
    assert ctx.reads[str(f)] == FileStamp(st.st_mtime_ns, st.st_size)


async def test_read_file_offset_and_limit(ctx: ToolContext, root: Path) -> None:
    (root / "n.txt").write_text("".join(f"line{i}\n" for i in range(1, 11)))
    out = await call(ctx, "read_file", path="n.txt", offset=4, limit=3)
    assert out.output.splitlines()[:3] == ["     4\tline4", "     5\tline5", "     6\tline6"]
    assert "continue with offset=7" in out.output
    tail = await call(ctx, "read_file", path="n.txt", offset=9)
    assert tail.output == "     9\tline9\n    10\tline10"
    past = await call(ctx, "read_file", path="n.txt", offset=50)
    assert past.is_error and "past the end" in past.output and "10 lines" in past.output
    bad = await call(ctx, "read_file", path="n.txt", offset=0)
    assert bad.is_error and "offset" in bad.output


async def test_read_file_offset_past_the_end_counts_lines_in_good_english(
    ctx: ToolContext, root: Path
) -> None:
    (root / "one.txt").write_text("hi\n")
    (root / "two.txt").write_text("a\nb\n")
    out = await call(ctx, "read_file", path="one.txt", offset=5)
    assert out.output == "offset 5 is past the end: one.txt has 1 line"  # it was "1 lines"
    out = await call(ctx, "read_file", path="two.txt", offset=5)
    assert out.output == "offset 5 is past the end: two.txt has 2 lines"


async def test_read_file_refuses_binary_directory_and_missing(ctx: ToolContext, root: Path) -> None:
    (root / "b.bin").write_bytes(b"ELF\0\1\2")
    out = await call(ctx, "read_file", path="b.bin")
    assert out.is_error and "binary" in out.output
    (root / "d").mkdir()
    out = await call(ctx, "read_file", path="d")
    assert out.is_error and "directory" in out.output
    out = await call(ctx, "read_file", path="nope.txt")
    assert out.is_error
    assert out.output == f"No such file or directory: {root / 'nope.txt'}"


async def test_an_overlong_path_is_quoted_by_its_ends(ctx: ToolContext, root: Path) -> None:
    """Found by QA: a 6,000-character path came back whole in "File name too long: …"."""
    path = "a/" * 3000 + "x.txt"
    for tool, args in (("read_file", {}), ("write_file", {"content": "x"})):
        out = await call(ctx, tool, path=path, **args)
        assert out.is_error and len(out.output) < 600, out.output
        assert out.output.startswith(f"File name too long: {root}/a/a/"), out.output
        said = out.output.rsplit(" (", 1)  # the path as written, its length last
        assert "…" in said[0] and int(said[1].removesuffix(" characters)")) > 6000, out.output


async def test_read_file_empty_and_non_utf8(ctx: ToolContext, root: Path) -> None:
    (root / "e.txt").write_text("")
    out = await read(ctx, "e.txt")
    assert out.output == "(empty file)"
    (root / "l1.txt").write_bytes(b"caf\xe9\n")
    out = await read(ctx, "l1.txt")
    assert out.output == "     1\tcaf\ufffd"


async def test_read_file_stops_at_output_budget_with_continue_note(root: Path) -> None:
    ctx = make_ctx(root, per_tool={"read_file": 1000})
    (root / "big.txt").write_text("".join(f"{'x' * 50} {i}\n" for i in range(200)))
    out = await read(ctx, "big.txt")
    assert len(out.output.encode()) <= 1000
    assert "[more lines follow; continue with offset=" in out.output
    assert "truncated" not in out.output


# --- write_file --------------------------------------------------------------------------------


async def test_write_file_creates_parents_and_records_stamp(ctx: ToolContext, root: Path) -> None:
    out = await call(ctx, "write_file", path="new/dir/f.txt", content="hello\nworld\n")
    assert not out.is_error, out.output
    f = root / "new/dir/f.txt"
    assert f.read_text() == "hello\nworld\n"
    assert out.summary == "created new/dir/f.txt (2 lines)"
    assert ctx.reads[str(f)] == FileStamp(f.stat().st_mtime_ns, f.stat().st_size)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask
    # A file we wrote may be written again without reading it.
    again = await call(ctx, "write_file", path="new/dir/f.txt", content="v2")
    assert not again.is_error and f.read_text() == "v2"


@pytest.mark.parametrize("tool", ["write_file", "edit_file"])
async def test_a_write_waiting_on_the_disk_leaves_the_event_loop_free(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch, tool: str
) -> None:
    # The fsync ran on the pod's event loop: a 30 MB write_file and edit_file stalled every
    # client of the pod (status too) 0.6 s on a quiet disk here, for as long as the disk takes
    # under writeback. This fsync waits until the loop has run a callback.
    (root / "f.txt").write_text("old\n")
    await read(ctx, "f.txt")
    loop_ran = threading.Event()
    waited: list[bool] = []
    fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        waited.append(loop_ran.wait(5))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    edit = {"old_string": "old", "new_string": "new"}
    args = {"content": "new\n"} if tool == "write_file" else edit
    task = asyncio.ensure_future(call(ctx, tool, path="f.txt", **args))
    asyncio.get_running_loop().call_soon(loop_ran.set)
    out = await task
    assert not out.is_error, out.output
    assert (root / "f.txt").read_text() == "new\n"
    assert waited and all(waited)  # the file's fsync and its directory's
    # still durable: the data and the rename are synced before the tool answers
    assert len(waited) == 2


async def test_write_file_requires_read_first(ctx: ToolContext, root: Path) -> None:
    f = root / "x.txt"
    f.write_text("original")
    out = await call(ctx, "write_file", path="x.txt", content="new")
    assert out.is_error
    assert out.output.startswith("read the file before overwriting it")
    assert f.read_text() == "original"


async def test_write_file_refuses_file_changed_since_read(ctx: ToolContext, root: Path) -> None:
    f = root / "x.txt"
    f.write_text("original")
    await read(ctx, "x.txt")
    f.write_text("someone else was here")
    out = await call(ctx, "write_file", path="x.txt", content="new")
    assert out.is_error
    assert out.output.startswith("file changed since it was read; read it again")
    assert f.read_text() == "someone else was here"
    await read(ctx, "x.txt")
    out = await call(ctx, "write_file", path="x.txt", content="new")
    assert not out.is_error and f.read_text() == "new"
    assert out.summary == "wrote x.txt (1 line)"


async def test_write_file_keeps_mode(ctx: ToolContext, root: Path) -> None:
    f = root / "run.sh"
    f.write_text("#!/bin/sh\n")
    f.chmod(0o751)
    await read(ctx, "run.sh")
    out = await call(ctx, "write_file", path="run.sh", content="#!/bin/sh\necho hi\n")
    assert not out.is_error
    assert stat.S_IMODE(f.stat().st_mode) == 0o751


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
@pytest.mark.parametrize("tool", ["write_file", "edit_file"])
async def test_write_keeps_another_users_file_theirs(
    ctx: ToolContext, root: Path, tool: str
) -> None:
    # A pod of root's in a shared tree: the file stays its owner's, who can still write it.
    f = root / "notes.txt"
    f.write_text("hello\n")
    f.chmod(0o664)
    os.chown(f, 65534, 65534)
    await read(ctx, "notes.txt")
    if tool == "write_file":
        out = await call(ctx, "write_file", path="notes.txt", content="bye\n")
    else:
        out = await call(ctx, "edit_file", path="notes.txt", old_string="hello", new_string="bye")
    assert not out.is_error, out.output
    st = f.stat()
    assert f.read_text() == "bye\n"
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o664)


async def test_write_file_is_atomic_when_replace_fails(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = root / "keep.txt"
    f.write_text("precious")
    await read(ctx, "keep.txt")

    def broken_rename(src: str, dst: str, **dir_fds: int) -> None:
        raise OSError(28, "No space left on device", dst)

    monkeypatch.setattr(os, "rename", broken_rename)
    out = await call(ctx, "write_file", path="keep.txt", content="x" * 10000)
    assert out.is_error and "No space left on device" in out.output
    assert f.read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == ["keep.txt"]  # no temp file left


async def test_a_failed_write_names_the_file_not_its_temp_file(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An immutable file or a read-only directory made the error name our temp file, one the
    # model never named and cannot find: "Operation not permitted: .f.txt.6ec5f9fc.tmp ->
    # f.txt"; a directory write_file could not create was named without its path ("...: new").
    (root / "d").mkdir()
    (root / "d" / "f.txt").write_text("a\n")
    await read(ctx, "d/f.txt")
    rename, mkdir = os.rename, os.mkdir

    def refused(src: Any, dst: Any, **dir_fds: Any) -> None:  # as the kernel reports it
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), src, None, dst)

    def no_mkdir(name: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), name)

    monkeypatch.setattr(os, "rename", refused)
    out = await call(ctx, "write_file", path="d/f.txt", content="b\n")
    assert out.output == "cannot write d/f.txt: Operation not permitted"
    out = await call(ctx, "edit_file", path="d/f.txt", old_string="a", new_string="b")
    assert out.output == "cannot write d/f.txt: Operation not permitted"
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "mkdir", no_mkdir)
    out = await call(ctx, "write_file", path="d/new/x.txt", content="b\n")
    assert out.output == "cannot create directory d/new: Read-only file system"
    monkeypatch.setattr(os, "mkdir", mkdir)
    assert sorted(p.name for p in (root / "d").iterdir()) == ["f.txt"]  # no temp file left


READ_ONLY_WRITES = """
import asyncio, sys
from tests.unit.test_tools import call, make_ctx, read
from pathlib import Path

async def main() -> None:
    ctx = make_ctx(Path(sys.argv[1]))
    await read(ctx, "ro.txt")
    for tool, args in (
        ("write_file", {"content": "new"}),
        ("edit_file", {"old_string": "old", "new_string": "new"}),
    ):
        print((await call(ctx, tool, path="ro.txt", **args)).output)

asyncio.run(main())
"""


def test_write_and_edit_leave_a_file_the_user_made_read_only_alone() -> None:
    # The write goes through a temp file renamed over the old one, which needs the directory
    # writable only: a file its owner had `chmod a-w` against edits was replaced (and stayed
    # 0444), where `>`, an editor or open(2) are refused. Run as a user other than root, whom
    # no mode refuses.
    top = tempfile.mkdtemp(prefix="ro", dir="/tmp")
    try:
        os.chmod(top, 0o755)
        (Path(top) / "ro.txt").write_text("old")
        os.chmod(Path(top) / "ro.txt", 0o444)
        nobody: int | None = None
        if os.geteuid() == 0:
            nobody = 65534
            os.chown(top, nobody, nobody)
            os.chown(Path(top) / "ro.txt", nobody, nobody)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        done = subprocess.run(
            [sys.executable, "-c", READ_ONLY_WRITES, top],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd="/",
            user=nobody,
            group=nobody,
            extra_groups=None if nobody is None else [],
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            "cannot write ro.txt: Permission denied (this user may not write it)",
            "cannot write ro.txt: Permission denied (this user may not write it)",
        ]
        assert (Path(top) / "ro.txt").read_text() == "old"
    finally:
        shutil.rmtree(top)


async def test_write_file_unencodable_content_is_a_tool_error(ctx: ToolContext, root: Path) -> None:
    f = root / "keep.txt"
    f.write_text("precious")
    await read(ctx, "keep.txt")
    out = await call_raw(ctx, "write_file", {"path": "keep.txt", "content": "bad \ud800"})
    assert out.is_error and "UTF-8" in out.output
    assert f.read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == ["keep.txt"]


async def call_raw(ctx: ToolContext, name: str, args: dict[str, Any]) -> ToolOutcome:
    """Like execute, for arguments JSON cannot carry (lone surrogates)."""
    return await execute(name, "{}", ctx, {name: _Fixed(BUILTIN[name], args)})


class _Fixed:
    def __init__(self, tool: Any, args: dict[str, Any]) -> None:
        self.name = tool.name
        self.description = tool.description
        self.parameters: dict[str, Any] = {"type": "object", "properties": {}}
        self._tool = tool
        self._args = args

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        result: ToolOutcome = await self._tool.run(ctx, self._args)
        return result


# --- edit_file ---------------------------------------------------------------------------------


async def test_edit_file_unique_replacement(ctx: ToolContext, root: Path) -> None:
    f = root / "code.py"
    f.write_text("def f():\n    return 1\n")
    await read(ctx, "code.py")
    out = await call(ctx, "edit_file", path="code.py", old_string="return 1", new_string="return 2")
    assert not out.is_error, out.output
    assert f.read_text() == "def f():\n    return 2\n"
    assert out.summary == "edited code.py (1 replacement)"
    # the stamp follows our own write: a second edit needs no re-read
    out = await call(ctx, "edit_file", path="code.py", old_string="f()", new_string="g()")
    assert not out.is_error and f.read_text() == "def g():\n    return 2\n"


async def test_edit_file_refuses_a_file_too_large_to_hold(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files_mod, "EDIT_MAX_BYTES", 3 << 20)
    big = root / "big.log"
    big.write_bytes(b"old\n" + b"x" * (4 << 20))
    await read(ctx, "big.log")
    out = await call(ctx, "edit_file", path="big.log", old_string="old", new_string="new")
    assert out.is_error
    assert out.output == "big.log is too large to edit (4 MiB; edit_file takes files up to 3 MiB)"
    assert big.read_bytes().startswith(b"old\n")


async def test_edit_file_refuses_an_edit_that_would_make_the_file_too_large(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # replace_all multiplies new_string by the count: a 1 MiB file of `a` and a 2,000-character
    # new_string became a 2 GB file, built in 4 GB of the pod's memory on its event loop.
    monkeypatch.setattr(files_mod, "EDIT_MAX_BYTES", 3 << 20)
    f = root / "many.txt"
    f.write_bytes(b"a" * (1 << 20))
    await read(ctx, "many.txt")
    out = await call(
        ctx, "edit_file", path="many.txt", old_string="a", new_string="ccc", replace_all=True
    )
    assert (out.is_error, out.output) == (False, "edited many.txt: 1048576 replacements")
    assert f.stat().st_size == 3 << 20  # up to the limit itself: edited
    out = await call(
        ctx, "edit_file", path="many.txt", old_string="c", new_string="dd", replace_all=True
    )
    assert out.is_error
    assert out.output == "the edit would make many.txt 6 MiB; edit_file writes files up to 3 MiB"
    assert f.read_bytes() == b"ccc" * (1 << 20)


async def test_edit_file_not_found_and_multiple(ctx: ToolContext, root: Path) -> None:
    f = root / "t.txt"
    f.write_text("a b a b a\n")
    await read(ctx, "t.txt")
    out = await call(ctx, "edit_file", path="t.txt", old_string="zzz", new_string="y")
    assert out.is_error and out.output.startswith("old_string not found")
    out = await call(ctx, "edit_file", path="t.txt", old_string="a", new_string="c")
    assert out.is_error
    assert out.output.startswith("old_string occurs 3 times")
    assert "add context or set replace_all" in out.output
    assert f.read_text() == "a b a b a\n"
    out = await call(
        ctx, "edit_file", path="t.txt", old_string="a", new_string="c", replace_all=True
    )
    assert not out.is_error and f.read_text() == "c b c b c\n"
    assert out.summary == "edited t.txt (3 replacements)"


async def test_edit_file_says_when_old_string_misses_only_by_crlf_line_ends(
    ctx: ToolContext, root: Path
) -> None:
    # read_file shows a CRLF file's lines without their \r, so a model gives old_string with
    # \n alone: "old_string not found", and it tried again and again with the same text.
    f = root / "win.txt"
    f.write_bytes(b"one\r\ntwo\r\nthree\r\n")
    await read(ctx, "win.txt")
    out = await call(ctx, "edit_file", path="win.txt", old_string="one\ntwo", new_string="x")
    assert out.is_error
    assert out.output == (
        "old_string not found in win.txt; its lines end in \\r\\n (CRLF), and old_string's in "
        "\\n: give them as \\r\\n"
    )
    assert f.read_bytes() == b"one\r\ntwo\r\nthree\r\n"
    out = await call(ctx, "edit_file", path="win.txt", old_string="zzz\nq", new_string="x")
    assert out.output == "old_string not found in win.txt"


async def test_edit_file_read_first_rules(ctx: ToolContext, root: Path) -> None:
    f = root / "t.txt"
    f.write_text("hello\n")
    out = await call(ctx, "edit_file", path="t.txt", old_string="hello", new_string="bye")
    assert out.is_error and out.output.startswith("read the file before editing it")
    await read(ctx, "t.txt")
    f.write_text("hello there\n")
    out = await call(ctx, "edit_file", path="t.txt", old_string="hello", new_string="bye")
    assert out.is_error and out.output.startswith("file changed since it was read")
    assert f.read_text() == "hello there\n"
    out = await call(ctx, "edit_file", path="missing.txt", old_string="a", new_string="b")
    assert out.is_error and out.output.startswith("No such file or directory")


# --- list_dir ----------------------------------------------------------------------------------


async def test_list_dir_sorted_with_dir_slashes(ctx: ToolContext, root: Path) -> None:
    (root / "b.txt").write_text("")
    (root / "a").mkdir()
    (root / "c.py").write_text("")
    (root / "a" / "inner").write_text("")
    out = await call(ctx, "list_dir")
    assert out.output == "a/\nb.txt\nc.py"
    assert out.summary == "listed 3 entries in ."
    out = await call(ctx, "list_dir", path="a")
    assert out.output == "inner"
    (root / "empty").mkdir()
    assert (await call(ctx, "list_dir", path="empty")).output == "(empty directory)"


async def test_list_dir_shows_the_first_names_and_counts_the_rest(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files_mod, "MAX_LIST_ENTRIES", 5)
    for i in reversed(range(10)):
        (root / f"f{i}").write_text("")
    (root / "d").mkdir()
    (root / "e").mkdir()
    out = await call(ctx, "list_dir")
    assert out.output.splitlines() == [
        "d/",
        "e/",
        "f0",
        "f1",
        "f2",
        "[showing the first 5 of 12 entries by name; use glob to narrow]",
    ]
    assert out.summary == "listed 12 entries in ."


async def test_a_listing_cut_to_the_byte_limit_still_says_how_many_there_are(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files_mod, "MAX_LIST_ENTRIES", 50)
    for i in range(80):
        (root / f"file-with-a-long-name-{i:03}").write_text("")
    out = await call(make_ctx(root, default_max_bytes=200), "list_dir")
    *_, cut, note = out.output.splitlines()
    assert cut.startswith("[output truncated:")
    assert note == "[showing the first 50 of 80 entries by name; use glob to narrow]"


async def test_list_dir_reads_a_big_directory_off_the_event_loop(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory of millions takes seconds to read: the pod must keep answering meanwhile.
    A small one is read at once (a thread hand-off would cost more than the listing)."""
    threads: list[threading.Thread] = []
    real_scandir = os.scandir

    def scandir(fd: Any) -> Any:
        threads.append(threading.current_thread())
        return real_scandir(fd)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(files_mod, "MAX_LIST_ENTRIES", 3)
    for name in "abc":
        (root / name).write_text("")
    assert (await call(ctx, "list_dir")).output == "a\nb\nc"
    assert threads == [threading.main_thread()]
    (root / "d").write_text("")
    threads.clear()
    assert (await call(ctx, "list_dir")).output.splitlines()[:3] == ["a", "b", "c"]
    assert threads[0] is threading.main_thread() and threads[-1] is not threads[0]


class CountingScope:
    """A scope that counts `check`, the walk that resolves a path (an lstat per component)."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.checks = 0
        self.deny = scope.deny

    def check(self, path: str, want: Access, cwd: str) -> str:
        self.checks += 1
        return self.scope.check(path, want, cwd)

    def access(self, path: str) -> Access:
        return self.scope.access(path)


@pytest.mark.parametrize("opener", ["openat2", "walk"])
async def test_list_dir_of_a_plain_path_is_judged_by_what_it_opened_without_a_walk_first(
    root: Path, outside: Path, opener: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if opener == "walk":  # as on kernels without openat2 (< 5.6) or under seccomp
        from poddaemon.tools import fsopen

        monkeypatch.setattr(fsopen._openat2(), "works", False)
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "m.py").write_text("")
    (root / "inner").symlink_to(root / "src")
    (root / "door").symlink_to(outside)
    scope = CountingScope(
        Scope.from_config([(str(root), "write", True)], [(str(root / "src"), "write", True)])
    )  # (a deny of writing: src may still be read)
    ctx = ToolContext(scope=scope, pwd=str(root))
    for path in ["src", "src/", "./src", str(root / "src"), "src/pkg", ""]:
        out = await call(ctx, "list_dir", path=path)
        want = {"src/pkg": "m.py", "": "door\ninner\nsrc/"}.get(path, "pkg/")
        assert not out.is_error and out.output == want, (path, out.output)
    assert scope.checks == 0
    # A symlink on the way or `..` in it: resolved first (`check`), as before.
    assert (await call(ctx, "list_dir", path="inner")).output == "pkg/"
    assert (await call(ctx, "list_dir", path="src/pkg/..")).output == "pkg/"
    assert scope.checks == 2
    for path in ["door", "door/", "..", str(outside), "/etc", "src/../door"]:
        out = await call(ctx, "list_dir", path=path)
        assert out.is_error and out.output.startswith("outside scope:"), (path, out.output)
        assert "secret.txt" not in out.output
    # What the long way says of a path that does not open, as before.
    out = await call(ctx, "list_dir", path="nope")
    assert out.is_error and "nope" in out.output


async def test_list_dir_refuses_a_plain_path_under_a_deny_rule_or_in_poddaemons_own_dirs(
    root: Path,
) -> None:
    (root / "secrets").mkdir()
    (root / "secrets" / "key.pem").write_text("")
    (root / "own").mkdir()
    (root / "own" / "pods.json").write_text("")
    scope = Scope.from_config([(str(root), "write", True)], [(str(root / "secrets"), "read", True)])
    ctx = ToolContext(
        scope=msgspec.structs.replace(scope, private=(str(root / "own"),)), pwd=str(root)
    )
    for path in ["secrets", "own"]:
        out = await call(ctx, "list_dir", path=path)
        assert out.is_error and out.output.startswith("outside scope:"), out.output
        assert "key.pem" not in out.output and "pods.json" not in out.output


async def test_list_dir_of_a_plain_path_moved_away_as_it_is_opened_is_judged_again(
    root: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`d` is swapped for a link to outside right after the open, before what was opened is
    named: the opened directory is no longer at `d`, so the path is resolved anew (the link:
    outside the scope), never listed as `d`."""
    from poddaemon.tools import base

    (root / "d").mkdir()
    (outside / "d-was-here").mkdir()
    (root / "link").symlink_to(outside)
    racer = SwapAfterCheck(
        Scope.from_config([(str(root), "write", True)]), root / "d", root / "link"
    )
    real = base.opened_path

    def swap_then_name(fd: int) -> str:
        monkeypatch.setattr(base, "opened_path", real)
        racer.swap()
        return real(fd)

    monkeypatch.setattr(base, "opened_path", swap_then_name)
    out = await call(ToolContext(scope=racer.scope, pwd=str(root)), "list_dir", path="d")
    assert out.is_error and out.output.startswith(f"outside scope: {outside}"), out.output
    assert "d-was-here" not in out.output and "secret.txt" not in out.output


# --- glob --------------------------------------------------------------------------------------


async def test_glob_recursive_newest_first(ctx: ToolContext, root: Path) -> None:
    (root / "src/pkg").mkdir(parents=True)
    files = {"src/a.py": 100, "src/pkg/b.py": 300, "top.py": 200, "src/notes.txt": 400}
    for name, mtime in files.items():
        (root / name).write_text("x")
        os.utime(root / name, (mtime, mtime))
    (root / ".git").mkdir()
    (root / ".git/hook.py").write_text("x")
    out = await call(ctx, "glob", pattern="**/*.py")
    assert out.output == "src/pkg/b.py\ntop.py\nsrc/a.py"
    out = await call(ctx, "glob", pattern="*.py", path="src")
    assert out.output == "src/a.py"
    out = await call(ctx, "glob", pattern="*.rs")
    assert out.output == "no files match"
    out = await call(ctx, "glob", pattern="/etc/*")
    assert out.is_error


async def test_glob_skips_out_of_scope_symlinks(
    ctx: ToolContext, root: Path, outside: Path
) -> None:
    (root / "in.txt").write_text("x")
    (root / "link.txt").symlink_to(outside / "secret.txt")
    (root / "linkdir").symlink_to(outside)
    out = await call(ctx, "glob", pattern="**/*.txt")
    assert out.output == "in.txt"
    out = await call(ctx, "glob", pattern="linkdir/*")
    assert out.output == "no files match"


async def test_glob_never_walks_through_a_symlink_out_of_the_scope(
    ctx: ToolContext, root: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain part (`*`) matching a symlink to a directory outside, with `**` after it: pathlib
    # walked the whole target (all of /usr for `up -> /usr`), showing none of it.
    (outside / "etc" / "deep").mkdir(parents=True)
    (outside / "etc" / "deep" / "x.conf").write_text("x")
    (root / "up").symlink_to(outside)
    (root / "conf").mkdir()
    (root / "conf" / "in.conf").write_text("x")
    listed: list[str] = []
    entries = search_mod._entries

    def recording(directory: str, dirs_only: bool = False) -> list[str]:
        listed.append(os.path.realpath(directory))
        return entries(directory, dirs_only)

    monkeypatch.setattr(search_mod, "_entries", recording)
    out = await call(ctx, "glob", pattern="*/**/*.conf")
    assert out.output == "conf/in.conf"
    assert listed and not [d for d in listed if d.startswith(str(outside))]


def test_glob_double_star_never_walks_into_a_directory_the_scope_hides(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `**` listed every directory of a denied tree (a deny-read `data/` of millions of files
    # cost a glob its 60 s, and the matches it would have found after) only to drop the names.
    (root / "secret" / "a" / "b").mkdir(parents=True)
    (root / "pub").mkdir()
    (root / "pub" / "x.txt").write_text("x")
    listed: list[str] = []
    entries = search_mod._entries

    def recording(directory: str, dirs_only: bool = False) -> list[str]:
        listed.append(directory)
        return entries(directory, dirs_only)

    monkeypatch.setattr(search_mod, "_entries", recording)
    hidden = str(root / "secret")
    found = list(search_mod.glob_paths(str(root), ("**", "*.txt"), lambda p: p != hidden, Stop()))
    assert found == [str(root / "pub" / "x.txt")]
    assert not [d for d in listed if d.startswith(hidden)], listed


@pytest.mark.parametrize(
    "pattern",
    ["*", "**", "**/*.py", "src/*", "src/**/*.py", "*/*.py", ".*", "src/pkg", "**/pkg/*",
     "s?c/*.py", "[st]*", "link/*.py", "**/*", "**/**/b.py", "missing/*", "src/../top.py"],
)  # fmt: skip
def test_glob_paths_finds_what_pathlib_finds(root: Path, pattern: str) -> None:
    for name in ("src/a.py", "src/pkg/b.py", "src/pkg/c.txt", "top.py", ".hidden.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    (root / "link").symlink_to(root / "src")  # inside: followed by a plain part, as pathlib does
    stop = Stop()
    ours = search_mod.glob_paths(str(root), Path(pattern).parts, lambda _: True, stop)
    assert sorted(ours) == sorted(str(p) for p in root.glob(pattern))


def chain(root: Path, depth: int) -> Path:
    """Directories d0/d1/…/d{depth-1} under root, each with one f.py; the deepest."""
    d = root
    for i in range(depth):
        d = d / f"d{i}"
        d.mkdir()
        (d / "f.py").write_text("x")
    return d


def test_glob_lists_each_directory_once_whatever_the_stars(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each `**` tried every depth again from every depth the one before it stopped at:
    # `**/**/*.py` on a tree 100 deep took 49 s (`**/*.py`: 1.8 s), a third `**` far longer.
    chain(root, 40)
    listed: list[str] = []
    entries = search_mod._entries

    def recording(directory: str, dirs_only: bool = False) -> list[str]:
        listed.append(directory)
        return entries(directory, dirs_only)

    monkeypatch.setattr(search_mod, "_entries", recording)
    for pattern in ("**/**/*.py", "**/**/**/*.py", "**/d*/**/*.py"):
        listed.clear()
        found = search_mod.glob_paths(str(root), Path(pattern).parts, lambda _: True, Stop())
        assert sorted(found) == sorted(str(p) for p in root.glob(pattern))
        # each directory listed at most once per part of the pattern
        assert max(map(listed.count, listed)) <= len(Path(pattern).parts), pattern


async def test_glob_resolves_each_path_in_a_deep_tree_in_constant_time(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every directory entered and every match was resolved by os.path.realpath, an lstat per
    # component of it: quadratic in the depth, 1.8 s of `**/*.py` on 2,000 dirs 100 deep.
    depth = 200
    chain(root, depth)
    lstats = 0
    lstat = os.lstat

    def counting(*args: Any, **kwargs: Any) -> os.stat_result:
        nonlocal lstats
        lstats += 1
        return lstat(*args, **kwargs)

    monkeypatch.setattr(os, "lstat", counting)
    out = await call(ctx, "glob", pattern="**/*.py")
    assert out.summary == f"glob **/*.py: {depth} matches"
    assert lstats < 10 * depth


async def test_glob_holds_the_matches_it_shows_not_every_match(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every match was kept (its path twice: ~600 bytes each) to be sorted at the end, for 500
    # shown: the 60 s a glob may take found a million on a big tree, 600 MB of the pod's memory.
    monkeypatch.setattr(search_mod, "MAX_GLOB_RESULTS", 3)
    for d in range(20):
        (root / f"d{d}").mkdir()
        for f in range(250):
            (root / f"d{d}" / f"{f:03}.txt").write_text("")
    newest = root / "d7" / "123.txt"
    os.utime(newest, (2**31, 2**31))
    await call(ctx, "glob", pattern="*")  # (what a first call allocates for good)
    tracemalloc.start()
    try:
        out = await call(ctx, "glob", pattern="**/*.txt")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    lines = out.output.splitlines()
    assert lines[0] == "d7/123.txt" and len(lines) == 4
    assert lines[-1] == "[showing 3 of 5000 matches; narrow the pattern]"
    assert peak < 300_000, peak  # 5,000 matches kept took 3 MB


class SwapOnAccess:
    """A scope that, the first time it is asked about `target`, swaps that directory for a
    symlink to `to` (after resolving, before listing: the worst moment)."""

    def __init__(self, scope: Scope, target: Path, to: Path) -> None:
        self.scope, self.target, self.to = scope, target, to
        self.swapped = False

    @property
    def deny(self) -> Any:
        return self.scope.deny

    def check(self, path: str, want: Access, cwd: str) -> str:
        return self.scope.check(path, want, cwd)

    def access(self, path: str) -> Access:
        if path == str(self.target) and not self.swapped:
            self.swapped = True
            self.target.rename(self.target.with_name("moved"))
            self.target.symlink_to(self.to)
        return self.scope.access(path)


async def test_glob_shows_no_name_from_a_directory_swapped_for_a_symlink_mid_walk(
    root: Path, outside: Path
) -> None:
    # A directory resolved once stands for its whole subtree (one lstat a path, not one a
    # component): swapped for a link to outside after that, its listing came from outside and
    # the names there were shown as in the scope. Directories are listed by their resolved
    # path, following no symlink.
    (root / "a").mkdir()
    (root / "a" / "in.txt").write_text("")
    (outside / "sub").mkdir()
    (outside / "sub" / "leak.txt").write_text("")
    scope = SwapOnAccess(Scope.from_config([(str(root), "write", True)]), root / "a", outside)
    ctx = ToolContext(scope=scope, pwd=str(root))
    out = await call(ctx, "glob", pattern="**/*.txt")
    assert scope.swapped
    assert "leak" not in out.output and "secret" not in out.output, out.output


async def test_glob_pattern_with_a_partial_double_star_is_an_error(ctx: ToolContext) -> None:
    out = await call(ctx, "glob", pattern="src/a**b")
    assert out.is_error and "'**' can only be an entire path component" in out.output


async def test_glob_caps_results(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search_mod, "MAX_GLOB_RESULTS", 5)
    for i in range(12):
        (root / f"f{i:02}.txt").write_text("x")
    out = await call(ctx, "glob", pattern="*.txt")
    lines = out.output.splitlines()
    assert len(lines) == 6
    assert lines[-1] == "[showing 5 of 12 matches; narrow the pattern]"


# --- grep --------------------------------------------------------------------------------------


async def test_grep_matches_with_paths_and_line_numbers(ctx: ToolContext, root: Path) -> None:
    (root / "src").mkdir()
    (root / "src/a.py").write_text("import os\ndef main():\n    pass\n")
    (root / "src/b.txt").write_text("nothing\nDEF here\n")
    out = await call(ctx, "grep", pattern=r"^def \w+")
    assert out.output == "src/a.py:2:def main():"
    assert out.summary == r"grep ^def \w+: 1 match in 1 file"
    out = await call(ctx, "grep", pattern="def", ignore_case=True)
    assert out.output == "src/a.py:2:def main():\nsrc/b.txt:2:DEF here"
    out = await call(ctx, "grep", pattern="def", ignore_case=True, glob="*.txt")
    assert out.output == "src/b.txt:2:DEF here"
    out = await call(ctx, "grep", pattern="def", ignore_case=True, glob="**/*.py")
    assert out.output == "src/a.py:2:def main():"
    out = await call(ctx, "grep", pattern="pass", path="src/a.py")
    assert out.output == "src/a.py:3:    pass"
    out = await call(ctx, "grep", pattern="zzz")
    assert out.output == "no matches" and not out.is_error


async def test_grep_skips_binary_files_and_vcs_dirs(ctx: ToolContext, root: Path) -> None:
    (root / "data.bin").write_bytes(b"needle\0\1\2needle")
    (root / ".git").mkdir()
    (root / ".git/config").write_text("needle\n")
    (root / "text.txt").write_text("a needle\n")
    out = await call(ctx, "grep", pattern="needle")
    assert out.output == "text.txt:1:a needle"


async def test_grep_on_a_named_file_it_cannot_search_says_why(ctx: ToolContext, root: Path) -> None:
    # It answered "no matches": the model took a binary or special file it named for one
    # without the pattern.
    (root / "blob").write_bytes(b"\0\1needle\n")
    out = await call(ctx, "grep", pattern="needle", path="blob")
    assert (out.is_error, out.output) == (True, "blob is a binary file; not searched")
    os.mkfifo(root / "sub.fifo")
    out = await call(ctx, "grep", pattern="needle", path="sub.fifo")
    assert (out.is_error, out.output) == (True, "sub.fifo is not a regular file")
    out = await call(ctx, "grep", pattern="needle")  # in a walk they are skipped, as before
    assert (out.is_error, out.output) == (False, "no matches")


GREP_AS_ANOTHER_USER = """
import asyncio, sys
import msgspec
from poddaemon.scope import Scope
from poddaemon.tools import ToolContext, execute
root = sys.argv[1]
ctx = ToolContext(scope=Scope.from_config([(root, "write", True)]), pwd=root)
for args in ({"pattern": "secret", "path": "locked.txt"}, {"pattern": "secret"},
             {"pattern": "secret", "path": "closed"}):
    out = asyncio.run(execute("grep", msgspec.json.encode(args).decode(), ctx))
    print(msgspec.json.encode([out.is_error, out.output]).decode())
"""


def test_grep_says_which_files_and_directories_it_could_not_read() -> None:
    # A file or directory the OS refused to open was skipped without a word: "no matches"
    # told the model the secret was not in a file grep never read (read_file says "Permission
    # denied"). Root reads everything, so the search runs as another user (nobody).
    root = Path(tempfile.mkdtemp(prefix="grep-perm-", dir="/tmp"))
    try:
        (root / "locked.txt").write_text("secret\n")
        (root / "closed").mkdir()
        (root / "closed" / "in.txt").write_text("secret\n")
        (root / "open.txt").write_text("no secret here\n")
        user = 65534 if os.geteuid() == 0 else None
        if user is not None:
            for p in (root, *root.rglob("*")):
                os.chown(p, user, user)
        root.chmod(0o755)
        (root / "locked.txt").chmod(0)
        (root / "closed").chmod(0)
        done = subprocess.run(
            [sys.executable, "-c", GREP_AS_ANOTHER_USER, str(root)],
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode and "Permission denied" in done.stderr and "poddaemon" in done.stderr:
            pytest.skip("this python or checkout is out of another user's reach")
        assert done.returncode == 0, done.stderr
        named, walked, named_dir = (msgspec.json.decode(line) for line in done.stdout.splitlines())
    finally:
        for p in (root / "locked.txt", root / "closed"):
            p.chmod(0o700)
        shutil.rmtree(root)
    assert named == [True, f"Permission denied: {root}/locked.txt"]
    assert walked == [
        False,
        "open.txt:1:no secret here\n[could not read 2 paths, not searched: locked.txt, closed/]",
    ]
    assert named_dir == [True, f"Permission denied: {root}/closed"]


_LINE_BYTES = [b"a", b"\n", b"\r", b"\xe2\x82", b"\xac", b"\xff", b"\xc3"]  # (UTF-8 cut, bad)


@given(st.binary(max_size=60) | st.lists(st.sampled_from(_LINE_BYTES)).map(b"".join))
def test_grep_decodes_a_small_file_at_once_into_the_lines_it_decoded_one_by_one(
    data: bytes,
) -> None:
    by_line = [raw.decode("utf-8", "replace").rstrip("\r\n") for raw in io.BytesIO(data)]
    assert list(search_mod._text_lines(io.BytesIO(data), len(data), [0], [])) == by_line


async def test_grep_invalid_regex(ctx: ToolContext) -> None:
    out = await call(ctx, "grep", pattern="(unclosed")
    assert out.is_error and out.output.startswith("invalid regex:")


async def test_grep_skips_out_of_scope_symlinks(
    ctx: ToolContext, root: Path, outside: Path
) -> None:
    (root / "link.txt").symlink_to(outside / "secret.txt")
    (root / "linkdir").symlink_to(outside)
    (root / "mine.txt").write_text("TOPSECRET is my word too\n")
    out = await call(ctx, "grep", pattern="TOPSECRET")
    assert out.output == "mine.txt:1:TOPSECRET is my word too"


async def test_grep_respects_deny_rules(root: Path) -> None:
    (root / "secrets").mkdir()
    (root / "secrets/key").write_text("password=1\n")
    (root / "app.cfg").write_text("password=\n")
    scope = Scope.from_config([(str(root), "write", True)], [(str(root / "secrets"), "read", True)])
    ctx = ToolContext(scope=scope, pwd=str(root))
    out = await call(ctx, "grep", pattern="password")
    assert out.output == "app.cfg:1:password="
    out = await call(ctx, "read_file", path="secrets/key")
    assert out.is_error and out.output.startswith("outside scope:")


async def test_a_denied_entry_moved_or_linked_to_an_allowed_name_stays_denied(root: Path) -> None:
    # What a command can do in a directory it may write (SPEC §3: a deny is enforced for
    # contents): rename the denied directory, hard-link a denied file under another name.
    (root / "secrets").mkdir()
    (root / "secrets/key").write_text("password=1\n")
    (root / ".env").write_text("TOKEN=2\n")
    (root / ".git").mkdir()
    (root / ".git/config").write_text("[core]\n")
    scope = Scope.from_config(
        [(str(root), "write", True)],
        [
            (str(root / "secrets"), "read", True),
            (str(root / ".env"), "read", True),
            (str(root / ".git"), "write", True),
        ],
    )
    ctx = ToolContext(scope=scope, pwd=str(root))
    (root / "secrets").rename(root / "public")
    os.link(root / ".env", root / "env.txt")
    (root / ".git").rename(root / "git")
    for path in ("public/key", "env.txt"):
        out = await call(ctx, "read_file", path=path)
        assert out.is_error and "a denied entry moved or linked there" in out.output, out.output
    out = await call(ctx, "write_file", path="public/new.txt", content="x")
    assert out.is_error and not (root / "public/new.txt").exists()
    assert (await call(ctx, "grep", pattern="password|TOKEN")).output == "no matches"
    # Nor their names (found by QA: glob listed them), and a walk named there is refused.
    for pattern in ("**/*", "*"):
        listed = (await call(ctx, "glob", pattern=pattern)).output.splitlines()
        assert "git/" in listed and not {"public/", "public/key", "env.txt"} & set(listed)
    for tool, args in (("glob", {"pattern": "*"}), ("grep", {"pattern": "password"})):
        out = await call(ctx, tool, path="public", **args)
        assert out.is_error and "a denied entry moved or linked there" in out.output, out.output
    # A deny on write still lets it be read, never changed, under its new name.
    assert (await read(ctx, "git/config")).output == "     1\t[core]"
    out = await call(ctx, "edit_file", path="git/config", old="[core]", new="[x]")
    assert out.is_error and (root / "git/config").read_text() == "[core]\n"
    # Other files keep their rights; a rule that goes takes its identity with it.
    assert not (await call(ctx, "write_file", path="notes.txt", content="y")).is_error
    ctx.scope = Scope.from_config([(str(root), "write", True)])
    ctx.scope_changed()
    assert (await read(ctx, "public/key")).output == "     1\tpassword=1"


async def test_a_non_recursive_deny_caps_its_level_only_even_moved(root: Path) -> None:
    # SPEC §3: `recursive = false` is the target and its direct children. The record of the
    # target's identity once capped everything below it, whatever the rule said.
    (root / "d/e").mkdir(parents=True)
    (root / "d/top.txt").write_text("top\n")
    scope = Scope.from_config([(str(root), "write", True)], [(str(root / "d"), "write", False)])
    ctx = ToolContext(scope=scope, pwd=str(root))
    for where in ("d", "moved"):
        out = await call(ctx, "write_file", path=f"{where}/e/{where}.txt", content=where)
        assert not out.is_error, out.output
        assert (root / where / "e" / f"{where}.txt").read_text() == where
        out = await call(ctx, "write_file", path=f"{where}/top.txt", content="no")
        assert out.is_error and (root / where / "top.txt").read_text() == "top\n", out.output
        if where == "d":
            (root / "d").rename(root / "moved")  # as a command may: its entries stay capped
    assert "a denied entry moved or linked there" in out.output
    listed = (await call(ctx, "glob", pattern="**/*.txt")).output.splitlines()
    assert "moved/e/moved.txt" in listed and "moved/top.txt" in listed  # a write cap: readable


async def test_a_deny_target_made_or_replaced_after_start_stays_denied_when_moved(
    root: Path,
) -> None:
    # The rule names a path: what is there when a command starts or a tool looks (made after
    # start, or replaced by a new directory) is recorded, so renaming it hands nothing over.
    scope = Scope.from_config([(str(root), "write", True)], [(str(root / "secrets"), "read", True)])
    ctx = ToolContext(scope=scope, pwd=str(root))
    try:
        (root / "secrets").mkdir()  # made after start (by the user)
        (root / "secrets/key").write_text("password=1\n")
        out = await call(ctx, "bash", command="mv secrets public")
        assert not out.is_error, out.output
        out = await call(ctx, "read_file", path="public/key")
        assert out.is_error and "a denied entry moved or linked there" in out.output, out.output
        # Replaced: the new one is denied where it goes; the old one, still about, stays so.
        (root / "secrets").mkdir()
        (root / "secrets/key2").write_text("password=2\n")
        assert not (await call(ctx, "bash", command="mv secrets public2")).is_error
        assert (await call(ctx, "grep", pattern="password")).output == "no matches"
        # One removed from every directory is let go: no later file is refused for it.
        shutil.rmtree(root / "public2")
        assert not (await call(ctx, "write_file", path="later.txt", content="x")).is_error
        assert (await read(ctx, "later.txt")).output == "     1\tx"
    finally:
        await ctx.aclose()


async def test_grep_caps_matches(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search_mod, "MAX_GREP_MATCHES", 3)
    (root / "m.txt").write_text("hit\n" * 10)
    out = await call(ctx, "grep", pattern="hit")
    lines = out.output.splitlines()
    assert lines == ["m.txt:1:hit", "m.txt:2:hit", "m.txt:3:hit", lines[3]]
    assert "match limit 3 reached" in lines[3]


def time_runs_out_after(checks: int) -> type[Stop]:
    """A Stop whose search time is up after `checks` looks at the clock."""

    class Late(Stop):
        looks = 0

        def stopped(self) -> bool:
            Late.looks += 1
            self.timed_out = Late.looks > checks
            return self.timed_out

    return Late


async def test_grep_out_of_time_answers_with_what_it_found(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a.txt", "b.txt", "c.txt"):
        (root / name).write_text("hit\n")
    monkeypatch.setattr(search_mod, "Stop", time_runs_out_after(3))  # the directory, then each file
    out = await call(ctx, "grep", pattern="hit")
    assert out.output.splitlines() == [
        "a.txt:1:hit",
        "b.txt:1:hit",
        "[stopped after 60 s with what was found so far; narrow the path]",
    ]
    assert not out.is_error


async def test_grep_out_of_time_stops_in_a_tree_of_directories_alone(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The time was looked at before each file only: a tree of empty directories (millions of
    # them) was walked to its end, past the limit and past a cancel.
    deep = root.joinpath(*(f"d{i}" for i in range(10)))
    deep.mkdir(parents=True)
    (deep / "f.txt").write_text("hit\n")
    monkeypatch.setattr(search_mod, "Stop", time_runs_out_after(3))
    out = await call(ctx, "grep", pattern="hit")
    assert out.output.splitlines() == [
        "no matches",
        "[stopped after 60 s with what was found so far; narrow the path]",
    ]


@pytest.mark.parametrize(
    ("tool", "args"), [("grep", {"pattern": "needle"}), ("glob", {"pattern": "**/f.txt"})]
)
async def test_a_tree_nested_past_the_recursion_limit_is_a_clear_error(
    ctx: ToolContext, root: Path, tool: str, args: dict[str, str]
) -> None:
    # Its walks recurse per level: ~1000 levels (2,000 characters of path, far inside PATH_MAX)
    # answered "internal error in grep: RecursionError: maximum recursion depth exceeded".
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)  # (1000 as it is: glob's walk there takes 13 s to get so deep)
    try:
        await deep_call(ctx, root, tool, args)
    finally:
        sys.setrecursionlimit(limit)
        remove_chain(root)


def remove_chain(top: Path) -> None:
    """Remove top/d/d/…/d level by level: rmtree (pytest's too) recurses once per level."""
    while (top / "d").exists():
        (top / "d").rename(top / "x")
        if (top / "x" / "d").exists():
            (top / "x" / "d").rename(top / "d")
        for leftover in (top / "x").iterdir():
            leftover.unlink()
        (top / "x").rmdir()


async def deep_call(ctx: ToolContext, root: Path, tool: str, args: dict[str, str]) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(sys.getrecursionlimit() + 50):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(os.open("f.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    out = await call(ctx, tool, **args)
    assert out.is_error
    assert out.output == (
        f"the tree under . is nested too deep to search (over {sys.getrecursionlimit()} "
        "levels); give a path further down"
    )


async def test_glob_out_of_time_answers_with_what_it_found(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a/x.py", "b/y.py"):
        (root / name).parent.mkdir()
        (root / name).write_text("")
    monkeypatch.setattr(search_mod, "Stop", time_runs_out_after(3))  # base, a dir, its file
    out = await call(ctx, "glob", pattern="*/*.py")
    found, note = out.output.splitlines()
    assert found in ("a/x.py", "b/y.py")  # whichever directory the listing gave first
    assert note == "[stopped after 60 s with what was found so far; narrow the path]"
    monkeypatch.setattr(search_mod, "Stop", time_runs_out_after(0))
    out = await call(ctx, "glob", pattern="*/*.py")
    assert out.output.startswith("no files match\n[stopped after 60 s")


async def test_a_slow_regex_is_a_tool_error_naming_the_line(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(search_mod, "LINE_TIMEOUT", 0.2)
    (root / "ok.txt").write_text("aaa\n")
    (root / "slow.txt").write_text("fine\n" + "a" * 60 + "b\n")
    out = await call(ctx, "grep", pattern="(a|aa)+$")
    assert out.is_error
    assert "took over 0.2 s on one line (slow.txt:2)" in out.output
    assert "simplify it" in out.output
    # Literal patterns (and others that cannot backtrack) still take the fast path.
    assert (await call(ctx, "grep", pattern="fi.e")).output == "slow.txt:1:fine"
    assert "invalid regex" in (await call(ctx, "grep", pattern="(a|")).output


async def test_tool_calls_stuck_in_the_filesystem_never_starve_the_pods_own_threads(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read on a hung mount (NFS, FUSE) cannot be stopped: its cancelled call left a thread of
    # asyncio's default executor behind. As many as that executor has (6 on 2 cores) and every
    # later `to_thread` of the pod waited for ever, its session log's among them.
    (root / "f.txt").write_text("x\n")
    hung = threading.Event()
    started: asyncio.Queue[None] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def stuck_read(*args: Any) -> Any:
        loop.call_soon_threadsafe(started.put_nowait, None)
        hung.wait(30)
        raise OSError("the mount came back")

    monkeypatch.setattr(files_mod, "_read_lines", stuck_read)
    refusals: list[str] = []
    try:
        for _ in range(min(32, (os.cpu_count() or 1) + 4) + 2):
            task = asyncio.ensure_future(call(ctx, "read_file", path="f.txt"))
            began = asyncio.ensure_future(started.get())
            await asyncio.wait({task, began}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            if task.done():  # refused at once: nothing more is queued behind the stuck ones
                began.cancel()
                refusals.append(task.result().output)
                continue
            assert began.done(), "a tool call neither ran nor answered"
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 5) == 42
        assert refusals and refusals[-1].startswith("earlier tool calls are still stuck")
    finally:
        hung.set()


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("read_file", {"path": "d/f.txt"}),
        ("write_file", {"path": "d/f.txt", "content": "new\n"}),
        ("edit_file", {"path": "d/f.txt", "old_string": "x", "new_string": "y"}),
        ("glob", {"pattern": "*.txt", "path": "d"}),
        ("grep", {"pattern": "x", "path": "d"}),
    ],
)
async def test_file_tools_resolve_their_path_off_the_event_loop(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch, tool: str, args: Any
) -> None:
    # The scope check resolves the path (an lstat per component) on the event loop: on a hung
    # mount (NFS, FUSE) that lstat never returns, and the whole pod froze, a cancel included.
    (root / "d").mkdir()
    (root / "d" / "f.txt").write_text("x\n")
    await read(ctx, "d/f.txt")
    on_loop: list[str] = []
    realpath = os.path.realpath

    def recording(path: Any, *rest: Any, **kw: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            on_loop.append(path)
        return realpath(path, *rest, **kw)

    monkeypatch.setattr(os.path, "realpath", recording)
    out = await call(ctx, tool, **args)
    assert not out.is_error, out.output
    assert on_loop == []


class _HeldAtSecond:
    """A generator for a tool's worker thread (as a stand-in for what it iterates) that holds at
    its second item until `resume`, noting every item asked of it: a cancelled call must ask
    no more (asyncio cannot stop a thread: it went on to the end, and the pod's exit waited)."""

    def __init__(self, item: Callable[[int], Any]) -> None:
        self.item = item
        self.asked: list[int] = []
        self.resume = threading.Event()
        self.holding = threading.Event()
        self.ended = threading.Event()

    def __call__(self, *_: Any, **__: Any) -> Any:
        try:
            for i in range(1000):
                self.asked.append(i)
                if i == 1:
                    self.holding.set()
                    self.resume.wait(10)
                yield self.item(i)
        finally:
            self.ended.set()

    async def cancel_while_held(self, task: "asyncio.Future[Any]") -> None:
        assert await asyncio.to_thread(self.holding.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        self.resume.set()
        assert await asyncio.to_thread(self.ended.wait, 10)
        assert self.asked == [0, 1]


async def test_a_cancelled_grep_stops_its_thread(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walk = _HeldAtSecond(lambda i: (str(root / f"none{i}"), str(root / f"none{i}"), None))
    monkeypatch.setattr(search_mod, "_walk_files", walk)
    await walk.cancel_while_held(asyncio.ensure_future(call(ctx, "grep", pattern="x")))


async def test_a_cancelled_read_file_stops_its_thread(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An offset past the end of a big log reads every line of it (26 s for 400 MB).
    lines = _HeldAtSecond(lambda i: b"y\n")
    (root / "big.log").write_text("y\n")
    monkeypatch.setattr(files_mod, "lines_of", lines)
    task = asyncio.ensure_future(call(ctx, "read_file", path="big.log", offset=10**9))
    await lines.cancel_while_held(task)


async def test_read_file_gives_up_on_an_offset_it_cannot_reach_in_time(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counting lines to an offset far into a huge log had no time limit (310 MB: 2.2 s; a
    # 100 GB one: 12 minutes of the run, stopped only by a cancel).
    (root / "big.log").write_text("y\n" * 5000)
    monkeypatch.setattr(files_mod, "Stop", time_runs_out_after(2))
    out = await call(ctx, "read_file", path="big.log", offset=4000)
    assert out.is_error
    assert out.output == (
        "stopped after 60 s at line 3072 of big.log, short of offset 4000: the file is too "
        "big to count its lines that far; find what you need with grep"
    )
    monkeypatch.setattr(files_mod, "Stop", time_runs_out_after(2))
    out = await call(ctx, "read_file", path="big.log", offset=2, limit=3)  # time enough
    assert out.output.startswith("     2\ty\n     3\ty\n     4\ty\n[more lines follow")


async def test_a_file_of_one_huge_line_is_read_and_searched_in_bounded_memory(
    ctx: ToolContext, root: Path
) -> None:
    # Lines used to be read whole: a 1 GB one-line data dump cost gigabytes of the pod's memory.
    import tracemalloc

    size = 24 << 20
    with open(root / "dump.json", "wb") as f:
        f.write(b"first\n" + b"x" * size + b"needle\nlast needle\n")
    tracemalloc.start()
    try:
        out = await read(ctx, "dump.json")
        grepped = await call(ctx, "grep", pattern="needle", path="dump.json")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    first, long, last = out.output.splitlines()
    assert first.endswith("\tfirst") and last.endswith("\tlast needle")
    assert long.endswith("x" * 10 + " … [line truncated]")
    assert grepped.output.splitlines() == [
        "dump.json:3:last needle",
        "[1 line over 1 MiB: searched in their first 1 MiB only]",
    ]


@pytest.mark.parametrize("tool", ["read_file", "grep"])
async def test_a_small_file_that_grows_after_the_stat_is_read_in_bounded_memory(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch, tool: str
) -> None:
    # A file small when looked at was read with its own line iterator, to the end of each line
    # however long it had become: a log written meanwhile was held whole (600 MB: 1.8 GB RSS).
    import tracemalloc

    grow = root / "grow.log"
    grow.write_text("first\n")
    opened = files_mod.open_regular

    def open_then_grow(*args: Any) -> tuple[int, os.stat_result]:
        fd, st = opened(*args)
        with open(grow, "ab") as f:  # what another process appends right after the stat
            for _ in range(48):
                f.write(b"x" * (1 << 20))
            f.write(b" needle\n")
        return fd, st

    monkeypatch.setattr(files_mod, "open_regular", open_then_grow)
    monkeypatch.setattr(search_mod, "open_regular", open_then_grow)
    tracemalloc.start()
    try:
        if tool == "read_file":
            out = await read(ctx, "grow.log")
        else:
            out = await call(ctx, "grep", pattern="first|needle", path="grow.log")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    if tool == "read_file":
        first, long = out.output.splitlines()
        assert first.endswith("\tfirst") and long.endswith("x" * 10 + " … [line truncated]")
    else:
        assert out.output.splitlines()[0] == "grow.log:1:first"


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (b"abcd\nef\n", [(b"abcd\n", False), (b"ef\n", False)]),
        (b"abcd\r\nef", [(b"abcd\r", False), (b"ef", False)]),  # only its line break left
        (b"abcde\nef\n", [(b"abcde", False), (b"ef\n", False)]),
        (b"abcdefgh\nxy", [(b"abcde", True), (b"xy", False)]),
        (b"abcde", [(b"abcde", False)]),
        (b"abcdefghij" * 10000 + b"\nz\n", [(b"abcde", True), (b"z\n", False)]),
    ],
)
def test_bounded_lines_cut_long_lines_and_keep_the_next(
    data: bytes, lines: list[tuple[bytes, bool]]
) -> None:
    import io

    from poddaemon.tools.files import bounded_lines

    cut = [0]
    assert list(bounded_lines(io.BufferedReader(io.BytesIO(data)), 5, cut)) == [
        line for line, _ in lines
    ]
    assert cut == [sum(was_cut for _, was_cut in lines)]


async def test_a_line_that_never_ends_is_not_read_to_its_end(
    ctx: ToolContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Text, then a hole: one endless line of NULs past the binary sniff. read_file and grep read
    # all of it to find the next line (1 TiB, sparse, made by `truncate`: 45 minutes of
    # read_file, grep 20 minutes past its 60 s, neither stoppable). Scaled down here.
    monkeypatch.setattr(files_mod, "SKIP_MAX_BYTES", 1 << 20, raising=False)
    monkeypatch.setattr(search_mod, "SKIP_MAX_BYTES", 1 << 20, raising=False)
    with open(root / "big.log", "wb") as f:
        f.write(b"needle " * 2000)
        f.truncate(64 << 20)
        f.seek(60 << 20)
        f.write(b"\nneedle after\n")
    out = await call(ctx, "read_file", path="big.log")
    assert not out.is_error and "the rest of the file is not read" in out.output, out.output[-200:]
    out = await call(ctx, "grep", pattern="needle", path="big.log")
    assert out.output.startswith("big.log:1:needle")
    assert "needle after" not in out.output
    assert "[not searched past a line over 1 MiB: big.log:1]" in out.output


# --- scope -------------------------------------------------------------------------------------


async def test_scope_refuses_absolute_path_outside(ctx: ToolContext) -> None:
    out = await call(ctx, "read_file", path="/etc/passwd")
    assert out.is_error
    assert out.output == "outside scope: /etc/passwd (needs read, has none)"
    assert not ctx.reads


async def test_a_path_with_a_nul_byte_is_a_plain_tool_error(ctx: ToolContext) -> None:
    for name, args in [
        ("read_file", {"path": "a\0b"}),
        ("write_file", {"path": "a\0b", "content": "x"}),
        ("list_dir", {"path": "a\0b"}),
        ("grep", {"pattern": "x", "path": "a\0b"}),
    ]:
        out = await call(ctx, name, **args)
        assert out.is_error and out.output == "invalid path 'a\\x00b': it contains a NUL byte"


async def test_write_file_to_a_path_ending_in_a_slash_writes_nothing(
    ctx: ToolContext, root: Path
) -> None:
    out = await call(ctx, "write_file", path="new/", content="x")
    assert out.is_error and out.output == "new/ names a directory; give the file's path"
    assert not (root / "new").exists()


async def test_scope_refuses_dotdot(ctx: ToolContext, outside: Path) -> None:
    out = await call(ctx, "read_file", path="../outside/secret.txt")
    assert out.is_error and out.output.startswith("outside scope:")
    assert "TOPSECRET" not in out.output
    out = await call(ctx, "write_file", path="../outside/new.txt", content="x")
    assert out.is_error and out.output.startswith("outside scope:")
    assert not (outside / "new.txt").exists()
    for name, args in [
        ("list_dir", {"path": ".."}),
        ("glob", {"pattern": "*", "path": "../outside"}),
        ("grep", {"pattern": "TOP", "path": "../outside"}),
    ]:
        out = await call(ctx, name, **args)
        assert out.is_error and out.output.startswith("outside scope:"), name
        assert "TOPSECRET" not in out.output and "secret.txt" not in out.output


async def test_scope_refuses_symlink_pointing_outside(
    ctx: ToolContext, root: Path, outside: Path
) -> None:
    (root / "innocent.txt").symlink_to(outside / "secret.txt")
    out = await call(ctx, "read_file", path="innocent.txt")
    assert out.is_error and out.output.startswith("outside scope:")
    assert "TOPSECRET" not in out.output
    assert not ctx.reads
    assert str(outside / "secret.txt") not in ctx.reads
    out = await call(ctx, "write_file", path="innocent.txt", content="pwned")
    assert out.is_error and out.output.startswith("outside scope:")
    assert (outside / "secret.txt").read_text() == "TOPSECRET\n"
    (root / "door").symlink_to(outside)
    out = await call(ctx, "write_file", path="door/new.txt", content="x")
    assert out.is_error and not (outside / "new.txt").exists()


async def test_read_only_scope_refuses_write_and_edit(root: Path) -> None:
    ctx = make_ctx(root, permission="read")
    f = root / "r.txt"
    f.write_text("keep\n")
    await read(ctx, "r.txt")
    out = await call(ctx, "write_file", path="r.txt", content="x")
    assert out.is_error
    assert out.output == f"outside scope: {f} (needs write, has read)"
    out = await call(ctx, "edit_file", path="r.txt", old_string="keep", new_string="x")
    assert out.is_error and out.output.startswith("outside scope:")
    out = await call(ctx, "write_file", path="new.txt", content="x")
    assert out.is_error and not (root / "new.txt").exists()
    assert f.read_text() == "keep\n"


# --- execute: errors and output caps -----------------------------------------------------------


def test_cap_output_is_utf8_safe() -> None:
    assert cap_output("short", 100) == "short"
    text = "é" * 10  # 20 bytes
    capped = cap_output(text, 5)
    assert capped == "éé\n[output truncated: 20 bytes, showing the first 5]"


async def test_execute_caps_output_per_tool(root: Path) -> None:
    ctx = make_ctx(root, default_max_bytes=100, per_tool={"grep": 50})
    (root / "f.txt").write_text("needle " * 40 + "\n")
    out = await call(ctx, "grep", pattern="needle")
    head, marker = out.output.split("\n[output truncated: ")
    assert len(head.encode()) == 50
    assert marker.endswith("bytes, showing the first 50]")
    out = await call(ctx, "list_dir")
    assert "output truncated" not in out.output


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("nope", "{}", "unknown tool: nope"),
        ("read_file", "{not json", "arguments are not valid JSON"),
        ("read_file", '{"path": "\ud800"}', "arguments are not valid JSON"),  # lone surrogate
        ("read_file", "[1, 2]", "arguments must be a JSON object, got array"),
        ("read_file", "{}", "missing required argument: path"),
        ("read_file", '{"path": null}', "missing required argument: path"),
        ("read_file", '{"path": 3}', "argument path must be a string, got integer"),
        ("read_file", '{"path": "a", "limit": "10"}', "argument limit must be an integer"),
        ("read_file", '{"path": "a", "limit": true}', "argument limit must be an integer"),
        ("read_file", '{"path": "a", "colour": 1}', "unknown argument: colour"),
        ("edit_file", '{"path": "a", "old_string": "x"}', "missing required argument: new_string"),
        (
            "grep",
            '{"pattern": "x", "ignore_case": "yes"}',
            "argument ignore_case must be a boolean",
        ),
    ],
)
async def test_execute_reports_malformed_arguments(
    ctx: ToolContext, name: str, arguments: str, expected: str
) -> None:
    out = await execute(name, arguments, ctx)
    assert out.is_error
    assert out.output.startswith(expected), out.output
    assert out.summary


async def test_execute_accepts_empty_arguments_and_integral_floats(
    ctx: ToolContext, root: Path
) -> None:
    (root / "a.txt").write_text("1\n2\n3\n")
    assert not (await execute("list_dir", "", ctx)).is_error
    out = await execute("read_file", '{"path": "a.txt", "limit": 1.0}', ctx)
    assert out.output.startswith("     1\t1\n[more lines follow")


class _Boom:
    name = "boom"
    description = "explodes"
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # noqa: RUF012

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        raise self.exc


async def test_execute_turns_unexpected_exceptions_into_errors(ctx: ToolContext) -> None:
    out = await execute("boom", "{}", ctx, {"boom": _Boom(RuntimeError("kaput"))})
    assert out.is_error
    assert out.output == "internal error in boom: RuntimeError: kaput"


async def test_execute_lets_cancellation_through(ctx: ToolContext) -> None:
    with pytest.raises(asyncio.CancelledError):
        await execute("boom", "{}", ctx, {"boom": _Boom(asyncio.CancelledError())})


# --- registry and specs ------------------------------------------------------------------------


def test_default_tools_and_specs_are_small() -> None:
    assert set(DEFAULT_TOOLS) <= set(BUILTIN)
    assert "bash" in BUILTIN and "bash" not in DEFAULT_TOOLS
    specs = tool_specs(DEFAULT_TOOLS)
    assert [s.name for s in specs] == list(DEFAULT_TOOLS)
    assert len(msgspec.json.encode(specs)) < 3000
    for spec in tool_specs(BUILTIN):
        assert len(spec.description) <= 80
        assert spec.parameters["type"] == "object"
    with pytest.raises(ValueError, match="unknown tool: no_such_tool"):
        tool_specs(["no_such_tool"])
    # The pod tools go into every request of a pod that lists them: small schemas.
    pod_tools = ["spawn_pod", "send_to_pod", "wait_pods", "list_pods", "stop_pod"]
    assert len(msgspec.json.encode(tool_specs(pod_tools))) < 2000


def test_builtin_tools_load_when_first_used_not_at_start_up() -> None:
    """A pod's start imports the tools package and builds its Toolset before READY; the
    tools' own modules (~2.5 ms) load at its first use of them (the warm-up after READY)."""
    code = """
import sys
from poddaemon.toolset import Toolset
impls = ["poddaemon.tools." + m for m in ("files", "search", "bash", "pods")]
tools = Toolset.from_names(["read_file", "grep", "read_file"])
print(len(tools), [m for m in impls if m in sys.modules])
print(list(tools.tools), [m for m in impls if m in sys.modules])
print(len(tools), [s.name for s in tools.specs])
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [
        "2 []",
        "['read_file', 'grep'] ['poddaemon.tools.files', 'poddaemon.tools.search']",
        "2 ['read_file', 'grep']",
    ]
    with pytest.raises(ValueError, match="not available in this version: nope"):
        Toolset.from_names(["read_file", "nope"])


# --- issue 9 item 3: absurdly nested arguments are a tool error, never a crash ---------------


@pytest.mark.parametrize(
    "arguments",
    [
        "[" * 3000 + "]" * 3000,
        '{"path": ' + '{"a": ' * 3000 + "1" + "}" * 3001,
        '{"path": "x", "extra": ' + "[" * 100 + "]" * 100 + "}",
    ],
    ids=["array-3000", "object-3000", "array-100"],
)
def test_deeply_nested_arguments_are_a_tool_error(ctx: ToolContext, arguments: str) -> None:
    out = asyncio.run(execute("read_file", arguments, ctx))
    assert out.is_error
    assert "nest deeper than" in out.output


def test_args_preview_never_raises() -> None:
    from poddaemon.tools import args_preview

    deep = "[" * 3000 + "]" * 3000
    assert args_preview(deep) == deep
    assert args_preview('{"path": "a"}') == {"path": "a"}
    assert args_preview("not json") == "not json"
    assert args_preview("") == {}


# --- issue 9 item 13: no check-then-use race ------------------------------------------------


class SwapAfterCheck:
    """A scope whose check swaps `a` and `b` (renameat2 RENAME_EXCHANGE) right after it has
    resolved and approved a path: the worst moment, every time."""

    def __init__(self, scope: Scope, a: Path, b: Path) -> None:
        import ctypes

        self.scope = scope
        self.a, self.b = os.fsencode(a), os.fsencode(b)
        self.libc = ctypes.CDLL(None, use_errno=True)

    def swap(self) -> None:
        if self.libc.renameat2(-100, self.a, -100, self.b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
            raise OSError("renameat2 failed")

    def check(self, path: str, want: Access, cwd: str) -> str:
        resolved = self.scope.check(path, want, cwd)
        self.swap()
        return resolved

    def access(self, path: str) -> Access:
        return self.scope.access(path)


@pytest.fixture(params=["openat2", "walk"])
def swapping(
    request: pytest.FixtureRequest, root: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[ToolContext, SwapAfterCheck]:
    if request.param == "walk":  # as on kernels without openat2 (< 5.6) or under seccomp
        from poddaemon.tools import fsopen

        monkeypatch.setattr(fsopen._openat2(), "works", False)
    (root / "d").mkdir()
    (root / "d" / "f.txt").write_text("INSIDE\n")
    (root / "link").symlink_to(outside)  # swapped with d after each check
    racer = SwapAfterCheck(
        Scope.from_config([(str(root), "write", True)]), root / "d", root / "link"
    )
    return ToolContext(scope=racer, pwd=str(root)), racer


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("read_file", {"path": "d/secret.txt"}),
        ("list_dir", {"path": "d"}),
        ("grep", {"pattern": "TOP", "path": "d"}),
        ("write_file", {"path": "d/new.txt", "content": "x"}),
        ("write_file", {"path": "d/sub/new.txt", "content": "x"}),
    ],
)
async def test_a_directory_swapped_for_a_symlink_after_the_check_is_not_followed(
    swapping: tuple[ToolContext, SwapAfterCheck], outside: Path, tool: str, args: dict[str, Any]
) -> None:
    ctx, _ = swapping
    # d/secret.txt exists only outside: the check sees d as the real directory (no such file,
    # judged by d), then d becomes the link to outside.
    out = await call(ctx, tool, **args)
    assert "TOPSECRET" not in out.output
    if tool == "list_dir":
        assert "secret.txt" not in out.output
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "TOPSECRET\n"


async def test_edit_after_a_swap_never_touches_the_outside(
    root: Path, outside: Path, swapping: tuple[ToolContext, SwapAfterCheck]
) -> None:
    ctx, racer = swapping
    (outside / "f.txt").write_text("OUTSIDE\n")
    ctx.scope = racer.scope  # read without a swap, so the edit is allowed to start
    await read(ctx, "d/f.txt")
    ctx.scope = racer
    out = await call(ctx, "edit_file", path="d/f.txt", old_string="E", new_string="X")
    assert (outside / "f.txt").read_text() == "OUTSIDE\n"
    assert out.is_error or "INSIDX" in (root / "link" / "f.txt").read_text()


def test_deny_targets_are_held_open_while_recorded_and_let_go_with_their_rule(root: Path) -> None:
    # Held, a deleted target's inode number cannot be reused by an unrelated file that the
    # tools would then refuse as "moved there"; a rule that goes closes its hold.
    from poddaemon.tools.denied import DeniedObjects

    (root / ".env").write_text("TOKEN=1\n")
    rules = Scope.from_config([(str(root), "write", True)], [(str(root / ".env"), "read", True)])
    before = len(os.listdir("/proc/self/fd"))
    denied = DeniedObjects()
    denied.note(rules.deny)
    denied.note(rules.deny)  # seen again: the same hold
    assert len(os.listdir("/proc/self/fd")) == before + 1
    (root / ".env").unlink()
    (root / "new.txt").write_text("fresh\n")
    assert os.stat(root / "new.txt").st_ino not in {i for _, i in denied._caps}
    denied.note(())
    assert len(os.listdir("/proc/self/fd")) == before and not denied


def test_escape_controls_escapes_every_c0_control_and_del_and_nothing_else() -> None:
    for code in (*range(32), 127):
        shown = escape_controls(f"a{chr(code)}b")
        assert shown.startswith("a\\") and shown.endswith("b") and shown.isprintable()
    assert escape_controls("a\nb\tc\rd") == "a\\nb\\tc\\rd"
    # Printable and other non-ASCII names come back as they are (the fast path), and so do
    # non-printable characters that are no control (a zero-width space, a no-break space).
    for name in ("mod_07.py", "naïve résumé.txt", "数据.csv", "a\u200bb", "a\u00a0b", ""):
        assert escape_controls(name) == name
