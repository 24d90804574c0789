"""File tools: read_file, write_file, edit_file, list_dir. Every path is scope-checked first, then
opened without following symlinks and checked again where it actually is (`fsopen`); writes go
through a temp file renamed relative to the directory's fd, never by name."""

import contextlib
import errno
import functools
import heapq
import io
import itertools
import os
import stat
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO, NamedTuple

from poddaemon.scope import Access
from poddaemon.tools.base import (
    FileStamp,
    Stop,
    ToolContext,
    ToolError,
    ToolOutcome,
    escape_controls,
    in_thread,
    schema,
)
from poddaemon.tools.fsopen import open_resolved
from poddaemon.umask import current_umask

BINARY_SNIFF_BYTES = 8192
DEFAULT_READ_LIMIT = 2000
MAX_LINE_CHARS = 2000
EDIT_MAX_BYTES = 32 << 20  # edit_file holds a file ~5 times over (bytes, text, edited, encoded)
MAX_LIST_ENTRIES = 1000  # names list_dir shows; it says how many more there are
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS + 1  # enough for MAX_LINE_CHARS of any UTF-8, and one more
# A file no bigger than this is read a whole line at a time (no line of it can cost more), at
# the speed of the file's own line iterator; a bigger one through `bounded_lines`.
WHOLE_LINES_MAX = 1 << 20
READ_SECONDS = 60.0  # how long read_file may count lines to reach its offset


def is_binary(head: bytes) -> bool:
    return b"\0" in head


# How far past its first `max_bytes` a line is read through to find the next one. Beyond it
# the rest of the file is left unread: a sparse file of 1 TiB (text, then a hole: one line of
# NULs) kept read_file busy for 45 minutes, and grep for 20 past its 60 s.
SKIP_MAX_BYTES = 256 << 20


def lines_of(
    f: BinaryIO,
    size: int,
    max_bytes: int,
    cut: list[int] | None = None,
    unread: list[int] | None = None,
) -> Iterable[bytes]:
    """The lines of `f` (`size` bytes), each of a big file at most its first `max_bytes`."""
    data = read_small(f, size)
    if data is not None:
        return io.BytesIO(data)
    return bounded_lines(f, max_bytes, cut, unread)


def read_small(f: BinaryIO, size: int) -> bytes | None:
    """The rest of `f` (`size` bytes) when it is at most WHOLE_LINES_MAX, read in one go; None
    (nothing read) for a bigger file, or one that grew since its stat (a log written now)."""
    if size > WHOLE_LINES_MAX:
        return None
    # Never past `size` and one byte: the file's own line iterator read on to the end of the
    # line, and a file that grew after the stat was held whole, a 600 MB line as 1.8 GB of the
    # pod's memory.
    start = f.tell()
    data = f.read(size + 1)
    if len(data) <= size:
        return data
    f.seek(start)  # it grew: read like any big file
    return None


def bounded_lines(
    f: BinaryIO, max_bytes: int, cut: list[int] | None = None, unread: list[int] | None = None
) -> Iterator[bytes]:
    """Each line of `f`, at most its first `max_bytes`: the rest of a longer line is skipped,
    never held (`cut[0]` counts such lines), so a file of one 1 GB line (a data dump, a
    minified bundle) costs no more memory than a short one. A line longer than SKIP_MAX_BYTES
    is the last one given (its number is appended to `unread`): the rest is not read."""
    n = 0
    while line := f.readline(max_bytes):
        n += 1
        if len(line) == max_bytes:
            longer = skip_rest_of_line(f, line)
            if longer is None:
                if unread is not None:
                    unread.append(n)
                yield line
                return
            if longer and cut is not None:
                cut[0] += 1
        yield line


def skip_rest_of_line(f: BinaryIO, line: bytes) -> bool | None:
    """After `line = f.readline(n)` returned n bytes: read past the end of that line, if it
    goes on; whether it had more than its line break (None: it goes on past SKIP_MAX_BYTES,
    and the file was left there)."""
    if line.endswith(b"\n"):
        return False
    cut = False
    skipped = 0
    while more := f.readline(65536):
        if more.endswith(b"\n"):
            return cut or more not in (b"\n", b"\r\n")
        cut = True
        skipped += len(more)
        if skipped > SKIP_MAX_BYTES:
            return None
    return cut


def plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


class ReadFile:
    name = "read_file"
    description = "Read a text file; lines are numbered."
    parameters = schema(
        {"path": ("string", "file path")},
        {"offset": ("integer", "first line, 1-based"), "limit": ("integer", "max lines")},
    )

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        offset: int = args.get("offset", 1)
        limit: int = args.get("limit", DEFAULT_READ_LIMIT)
        if offset < 1:
            raise ToolError("offset must be >= 1")
        if limit < 1:
            raise ToolError("limit must be >= 1")
        budget = ctx.limits.max_bytes(self.name) - 200
        path, shown, (lines, stamp, total, more) = await in_thread(
            _read, ctx, args["path"], offset, limit, budget, stop=Stop(READ_SECONDS)
        )
        ctx.reads[path] = stamp
        if total == 0:
            return ToolOutcome(output="(empty file)", summary=f"read {shown} (empty)")
        if not lines:
            raise ToolError(f"offset {offset} is past the end: {shown} has {plural(total, 'line')}")
        body = "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines, offset))
        if more:
            body += f"\n[more lines follow; continue with offset={offset + len(lines)}]"
        return ToolOutcome(output=body, summary=f"read {plural(len(lines), 'line')} of {shown}")


def open_regular(
    ctx: ToolContext, path: str, shown: str, looked: os.stat_result | None = None
) -> tuple[int, os.stat_result]:
    """A checked file opened for reading, and its stat; ToolError if it is not a regular file.
    What it is is looked at before it is opened (`looked`: the caller's lstat of `path`):
    opening a FIFO releases a writer blocked on it, opening a device node acts on the device
    (a watchdog starts, a tty becomes ours). What was opened is looked at again (a swap in
    between; O_NONBLOCK: a FIFO cannot hang us). An `O_PATH` handle reopened through /proc
    would close that gap too, at 3 µs more per file."""
    if looked is None:
        with contextlib.suppress(OSError):  # gone or unreachable: the open says why
            looked = os.stat(path, follow_symlinks=False)
    if looked is not None:
        _must_be_regular(looked, shown)
    fd = ctx.open_checked(path, Access.READ, os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    try:
        _must_be_regular(st, shown)
    except ToolError:
        os.close(fd)
        raise
    return fd, st


def _must_be_regular(st: os.stat_result, shown: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{shown} is a directory; use list_dir")
        raise ToolError(f"{shown} is not a regular file")


# Every file tool resolves its path (Scope.check: an lstat per component) in its worker thread,
# not on the event loop: on a hung mount (NFS, FUSE) that lstat never returns, and the whole
# pod froze with it, a cancel included.


def _read(
    ctx: ToolContext, given: str, offset: int, limit: int, budget: int, stop: Stop
) -> tuple[str, str, tuple[list[str], FileStamp, int, bool]]:
    """(resolved path, as shown, what `_read_lines` gives) for the model's path `given`."""
    path = ctx.check(given, Access.READ)
    shown = ctx.display(path)
    return path, shown, _read_lines(ctx, path, shown, offset, limit, budget, stop)


def _read_lines(
    ctx: ToolContext, path: str, shown: str, offset: int, limit: int, budget: int, stop: Stop
) -> tuple[list[str], FileStamp, int, bool]:
    """(lines from offset, stamp, lines seen, whether more follow); once cancelled, whatever
    it has (nobody reads it)."""
    fd, st = open_regular(ctx, path, shown)
    with os.fdopen(fd, "rb") as f:
        stamp = FileStamp.of(st)
        if is_binary(f.read(BINARY_SNIFF_BYTES)):
            raise ToolError(f"{shown} is a binary file; not shown")
        f.seek(0)
        lines: list[str] = []
        used = 0
        n = 0
        unread: list[int] = []
        # A line cut at MAX_LINE_BYTES decodes to more than MAX_LINE_CHARS: truncated below.
        for n, raw in enumerate(lines_of(f, st.st_size, MAX_LINE_BYTES, unread=unread), 1):
            # An offset past the end of a big log goes through every line of it (26 s for
            # 400 MB): cancelled, the thread went on, and the pod's exit waited for it.
            if stop.cancelled:
                break
            if n < offset:
                # Counted to the offset with no time limit: 2.2 s for 310 MB, 12 minutes of
                # the run for a 100 GB log. Looked at now and then: a clock read per line
                # would cost a third more.
                if not n & 1023 and stop.stopped():
                    raise ToolError(
                        f"stopped after {READ_SECONDS:g} s at line {n} of {shown}, short of "
                        f"offset {offset}: the file is too big to count its lines that far; "
                        "find what you need with grep"
                    )
                continue
            line = raw.decode("utf-8", "replace").removesuffix("\n").removesuffix("\r")
            if len(line) > MAX_LINE_CHARS:
                line = line[:MAX_LINE_CHARS] + " … [line truncated]"
            cost = len(line.encode("utf-8", "replace")) + 8
            if len(lines) >= limit or (lines and used + cost > budget):
                return lines, stamp, n, True
            lines.append(line)
            used += cost
        if unread and lines:
            mib = SKIP_MAX_BYTES >> 20
            lines[-1] += f" … [this line goes on past {mib} MiB; the rest of the file is not read]"
        return lines, stamp, n, False


def _require_fresh(ctx: ToolContext, path: str, st: os.stat_result, verb: str) -> None:
    stamp = ctx.reads.get(path)
    if stamp is None:
        raise ToolError(f"read the file before {verb} it: {ctx.display(path)}")
    if stamp != FileStamp.of(st):
        raise ToolError(f"file changed since it was read; read it again: {ctx.display(path)}")


def _require_writable(dfd: int, name: str, shown: str) -> None:
    """ToolError unless this process could open the existing file `name` for writing. The
    write renames a temp file over it, which needs the directory writable only: a file its
    owner had made read-only (`chmod a-w`), or another user's, was replaced all the same."""
    if not os.access(name, os.W_OK, dir_fd=dfd, effective_ids=True):
        raise ToolError(f"cannot write {shown}: Permission denied (this user may not write it)")


_umask = functools.cache(current_umask)  # the pod's umask does not change while it runs


def open_parent(ctx: ToolContext, path: str, create: bool) -> int:
    """The directory `path` is to be written in, opened without following symlinks and checked
    for write where it actually is; missing directories are made one by one under it when
    `create` (each relative to its parent's fd, so none can be redirected)."""
    parent = os.path.dirname(path)
    missing: list[str] = []
    while True:
        try:
            dfd = open_resolved(parent, os.O_RDONLY | os.O_DIRECTORY)
            break
        except FileNotFoundError:
            if not create or parent == "/":
                raise
            ctx.check(parent, Access.WRITE)
            parent, name = os.path.split(parent)
            missing.append(name)
    made = parent
    try:
        for name in reversed(missing):
            made = os.path.join(made, name)
            ctx.check_opened(dfd, Access.WRITE, name)
            try:
                os.mkdir(name, dir_fd=dfd)
            except FileExistsError:
                pass
            except OSError as e:  # (its name alone said nothing of where it was)
                raise ToolError(
                    f"cannot create directory {ctx.display(made)}: {e.strerror}"
                ) from None
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            os.close(dfd)
            dfd = sub
        ctx.check_opened(dfd, Access.WRITE, os.path.basename(path))
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def lstat_at(dfd: int, name: str, shown: str) -> os.stat_result | None:
    """The entry `name` of directory `dfd` (None if absent); never a symlink: the path was
    resolved, so a symlink there now means it changed since the scope check."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise ToolError(f"{shown} changed while being opened (it is now a symlink); try again")
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{shown} is a directory")
    return st


def atomic_write_at(
    dfd: int, name: str, data: bytes, old: os.stat_result | None, shown: str
) -> os.stat_result:
    """Replace entry `name` (`shown`) of directory `dfd` with `data`: `_atomic_write_at`, its
    failures a ToolError naming the file: the OS's error named our temp file, one the model never
    named and cannot find ("Operation not permitted: .f.txt.6ec5f9fc.tmp -> f.txt")."""
    try:
        return _atomic_write_at(dfd, name, data, old)
    except OSError as e:
        raise ToolError(f"cannot write {shown}: {e.strerror or e}") from None


def _atomic_write_at(
    dfd: int, name: str, data: bytes, old: os.stat_result | None
) -> os.stat_result:
    """Replace entry `name` of directory `dfd` with `data` via a temp file beside it (fsync'd),
    keeping an existing file's mode, and its owner and group as far as we may set them (root
    may: a pod of root's editing another user's file in a shared tree would otherwise hand it
    to root, and its owner could no longer write it). On any failure the old file is untouched."""
    mode = stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~_umask()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        tmp = f".{name}.{os.urandom(4).hex()}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if old is not None:
                _keep_owner(f.fileno(), old)  # before fchmod: a chown clears set-id bits
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    with contextlib.suppress(OSError):
        os.fsync(dfd)
    return os.stat(name, dir_fd=dfd, follow_symlinks=False)


def _keep_owner(fd: int, old: os.stat_result) -> None:
    """Give the file at `fd` the owner and group of `old`, or its group alone, or neither:
    whatever this process may (a chown to another user needs root, a group needs membership)."""
    st = os.fstat(fd)
    for uid, gid in ((old.st_uid, old.st_gid), (-1, old.st_gid)):
        if (uid in (-1, st.st_uid)) and gid == st.st_gid:
            return
        try:
            os.fchown(fd, uid, gid)
            return
        except PermissionError:
            continue


def _encode(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ToolError(f"content cannot be encoded as UTF-8: {e.reason}") from None


class WriteFile:
    name = "write_file"
    description = "Create or overwrite a file. Read an existing file first."
    parameters = schema({"path": ("string", "file path"), "content": ("string", "full content")})

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        if args["path"].endswith("/"):  # resolving drops the slash: `new/` would write `new`
            raise ToolError(f"{args['path']} names a directory; give the file's path")
        data = _encode(args["content"])
        path, shown, st, new = await in_thread(_write, ctx, args["path"], data)
        ctx.reads[path] = FileStamp.of(new)
        existed = st is not None
        verb = "updated" if existed else "created"
        lines = args["content"].count("\n") + (0 if args["content"].endswith("\n") else 1)
        if not args["content"]:
            lines = 0
        return ToolOutcome(
            output=f"{verb} {shown} ({len(data)} bytes)",
            summary=f"{'wrote' if existed else 'created'} {shown} ({plural(lines, 'line')})",
        )


# write_file's and edit_file's work runs in a worker thread: their fsync waits for the disk, and
# on the event loop it stalled every client of the pod (a 30 MB write and edit: 0.6 s on a
# quiet disk; as long as the disk takes under writeback). Cancelled, the write still completes
# or leaves the file as it was (atomic_write_at), and the tool answers only once it is durable.


def _write(
    ctx: ToolContext, given: str, data: bytes, stop: Stop
) -> tuple[str, str, os.stat_result | None, os.stat_result]:
    """(resolved path, as shown, the file's stat before if it existed, after) of writing
    `data` to the model's path `given`."""
    path = ctx.check(given, Access.WRITE)
    shown = ctx.display(path)
    dfd = open_parent(ctx, path, create=True)
    try:
        st = lstat_at(dfd, os.path.basename(path), shown)
        if st is not None:
            _require_fresh(ctx, path, st, "overwriting")
            _require_writable(dfd, os.path.basename(path), shown)
        return path, shown, st, atomic_write_at(dfd, os.path.basename(path), data, st, shown)
    finally:
        os.close(dfd)


class EditFile:
    name = "edit_file"
    description = "Replace exact text in a file. Read the file first."
    parameters = schema(
        {
            "path": ("string", "file path"),
            "old_string": ("string", "exact text to replace"),
            "new_string": ("string", "replacement"),
        },
        {"replace_all": ("boolean", "replace every occurrence")},
    )

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        old: str = args["old_string"]
        new_text: str = args["new_string"]
        if not old:
            raise ToolError("old_string is empty; use write_file to create a file")
        if old == new_text:
            raise ToolError("old_string and new_string are the same")
        replace_all: bool = args.get("replace_all", False)
        path, shown, stamp, new = await in_thread(
            _edit, ctx, args["path"], old, new_text, replace_all
        )
        ctx.reads[path] = stamp
        n = plural(new.replacements, "replacement")
        return ToolOutcome(output=f"edited {shown}: {n}", summary=f"edited {shown} ({n})")


class _Edit(NamedTuple):
    encoded: bytes
    replacements: int


def _edit(
    ctx: ToolContext, given: str, old: str, new: str, replace_all: bool, stop: Stop
) -> tuple[str, str, FileStamp, _Edit]:
    """(resolved path, as shown, the stamp after, the edit) of replacing `old` by `new` in the
    file at the model's path `given`."""
    path = ctx.check(given, Access.WRITE)
    shown = ctx.display(path)
    name = os.path.basename(path)
    dfd = open_parent(ctx, path, create=False)
    try:
        st = lstat_at(dfd, name, shown)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        _require_fresh(ctx, path, st, "editing")
        _require_writable(dfd, name, shown)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(EDIT_MAX_BYTES + 1)  # (the file may have grown since the stat)
        if max(st.st_size, len(raw)) > EDIT_MAX_BYTES:
            raise ToolError(
                f"{shown} is too large to edit ({max(st.st_size, len(raw)) >> 20} MiB; "
                f"edit_file takes files up to {EDIT_MAX_BYTES >> 20} MiB)"
            )
        edit = _edited(raw, old, new, shown, replace_all)
        new_st = atomic_write_at(dfd, name, edit.encoded, st, shown)
        return path, shown, FileStamp.of(new_st), edit
    finally:
        os.close(dfd)


def _edited(raw: bytes, old: str, new: str, shown: str, replace_all: bool) -> _Edit:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{shown} is not UTF-8 text; cannot edit it") from None
    count = text.count(old)
    if count == 0:
        # read_file shows lines without their \r: a model editing a CRLF file gave \n alone,
        # and tried the same text again and again.
        if "\n" in old and "\r\n" not in old and old.replace("\n", "\r\n") in text:
            raise ToolError(
                f"old_string not found in {shown}; its lines end in \\r\\n (CRLF), and "
                "old_string's in \\n: give them as \\r\\n"
            )
        raise ToolError(f"old_string not found in {shown}")
    if count > 1 and not replace_all:
        raise ToolError(
            f"old_string occurs {count} times in {shown}; add context or set replace_all"
        )
    # Looked at before the text is built: replace_all multiplies new_string by the count, so a
    # 1 MiB file of `a` and a 2,000-character new_string made 2 GB (4 GB of the pod's memory).
    grows = len(new.encode("utf-8", "surrogatepass")) - len(old.encode("utf-8", "surrogatepass"))
    size = len(raw) + count * grows
    if size > EDIT_MAX_BYTES:
        raise ToolError(
            f"the edit would make {shown} {size >> 20} MiB; edit_file writes files up to "
            f"{EDIT_MAX_BYTES >> 20} MiB"
        )
    return _Edit(_encode(text.replace(old, new)), count)


class ListDir:
    name = "list_dir"
    description = "List a directory; subdirectories end in /."
    parameters = schema({}, {"path": ("string", "directory (default .)")})

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        given = args.get("path", ".")
        # A directory is opened at no cost to anyone (O_DIRECTORY: never a FIFO or a device).
        opened = ctx.open_plain(given, Access.READ, _DIR_FLAGS)
        fd, path = opened or (None, ctx.check(given, Access.READ))
        shown = ctx.display(path)
        # Most directories are small: read at once (a thread hand-off would triple the cost).
        # A big one is read again in a thread, where millions of entries stall nobody.
        listed = _list(ctx, path, Stop(), most=MAX_LIST_ENTRIES, fd=fd)
        listed = listed or await in_thread(_list, ctx, path)
        assert listed is not None  # (with no `most`, always a listing)
        names, total = listed
        summary = f"listed {plural(total, 'entry', 'entries')} in {shown}"
        note = ""
        if total > len(names):
            note = (
                f"[showing the first {len(names)} of {total} entries by name; use glob to narrow]"
            )
        output = "\n".join(names) or "(empty directory)"
        return ToolOutcome(output=output, summary=summary, note=note)


def _list(
    ctx: ToolContext, path: str, stop: Stop, most: int | None = None, fd: int | None = None
) -> tuple[list[str], int] | None:
    """The first MAX_LIST_ENTRIES names in sort order (a directory's end in /) and how many
    there are, holding that many names at most however big the directory; None when there are
    more than `most`. `fd`: the directory, opened and checked already (closed here)."""
    if fd is None:
        fd = ctx.open_checked(path, Access.READ, _DIR_FLAGS)
    try:
        with os.scandir(fd) as it:
            if most is None:
                return _first_names(it, stop)
            some = list(itertools.islice(it, most + 1))
    finally:
        os.close(fd)
    if len(some) > most:
        return None
    names = []
    for entry in some:  # _shown, inlined: a call per entry showed in list_dir's time
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        names.append(entry.name + "/" if is_dir else entry.name)
    if not all(map(str.isprintable, names)):
        names = list(map(escape_controls, names))  # ("/" is printable: escaped alike)
    return sorted(names), len(names)


def _first_names(entries: Iterator[os.DirEntry[str]], stop: Stop) -> tuple[list[str], int]:
    total = 0

    def names() -> Iterator[str]:
        nonlocal total
        for entry in entries:
            if stop.cancelled:
                return
            total += 1
            yield _shown(entry)

    return heapq.nsmallest(MAX_LIST_ENTRIES, names()), total


def _shown(entry: os.DirEntry[str]) -> str:
    try:
        is_dir = entry.is_dir()
    except OSError:
        is_dir = False
    name = entry.name
    if not name.isprintable():  # checked here: a call per entry showed in list_dir's time
        name = escape_controls(name)
    return name + "/" if is_dir else name
