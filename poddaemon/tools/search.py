"""Search tools: glob (file names) and grep (file contents). Results outside scope are skipped;
grep opens each file without following symlinks and checks where it actually is (`fsopen`)."""

import contextlib
import fnmatch
import functools
import heapq
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from poddaemon.scope import Access, ScopeDenied
from poddaemon.tools.base import Stop, ToolContext, ToolError, ToolOutcome, in_thread, schema
from poddaemon.tools.files import (
    BINARY_SNIFF_BYTES,
    SKIP_MAX_BYTES,
    bounded_lines,
    is_binary,
    open_regular,
    plural,
    read_small,
)
from poddaemon.tools.fsopen import open_resolved

MAX_GLOB_RESULTS = 500
MAX_GREP_MATCHES = 200
MAX_GREP_LINE_CHARS = 300
SEARCH_SECONDS = 60.0  # a glob or grep on a huge tree answers with what it found by then
# A longer line is searched in its first GREP_LINE_BYTES only, and the output says so: the rest
# is never read into memory.
GREP_LINE_BYTES = 1 << 20
# A regex that needs longer than this for one line backtracks catastrophically (`(a|aa)+$`):
# an error, not a search that holds the model up for ever.
LINE_TIMEOUT = 5.0
VCS_DIRS = frozenset({".git", ".hg", ".svn"})
# Directories grep never walks into (unless `path` points inside one).
SKIP_DIRS = VCS_DIRS | {
    "node_modules",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".venv",
    ".tox",
}


class Glob:
    name = "glob"
    description = "Find files by glob pattern (** recurses), newest first."
    parameters = schema(
        {"pattern": ("string", "e.g. **/*.py")},
        {"path": ("string", "directory to search (default .)")},
    )

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        pattern: str = args["pattern"]
        if not pattern or os.path.isabs(pattern):
            raise ToolError("pattern must be a relative glob; put the directory in path")
        stop = Stop(SEARCH_SECONDS)
        lines, total = await in_thread(_glob, ctx, args.get("path", "."), pattern, stop=stop)
        late = _out_of_time_note(stop)
        if not total:
            return ToolOutcome(
                output="no files match" + late, summary=f"glob {pattern}: no matches"
            )
        more = ""
        if total > len(lines):
            more = f"[showing {len(lines)} of {total} matches; narrow the pattern]"
        return ToolOutcome(
            output="\n".join(lines),
            summary=f"glob {pattern}: {plural(total, 'match', 'matches')}",
            note=(more + late).strip("\n"),
        )


def _too_deep(ctx: ToolContext, base: str) -> str:
    """The error for a tree nested deeper than the walks' recursion can go (~1000 levels, far
    inside PATH_MAX): it was "internal error in grep: RecursionError"."""
    return (
        f"the tree under {ctx.display(base)} is nested too deep to search (over "
        f"{sys.getrecursionlimit()} levels); give a path further down"
    )


def _out_of_time_note(stop: Stop) -> str:
    if not stop.timed_out:
        return ""
    return f"\n[stopped after {SEARCH_SECONDS:g} s with what was found so far; narrow the path]"


# glob and grep resolve their path (Scope.check: an lstat per component) in their worker
# thread, not on the event loop: on a hung mount (NFS, FUSE) that lstat never returns, and the
# whole pod froze with it, a cancel included.


def _glob(ctx: ToolContext, given: str, pattern: str, stop: Stop) -> tuple[list[str], int]:
    """The display names of the newest MAX_GLOB_RESULTS matches under the model's path `given`
    the scope lets the model read, newest first, and how many matches there are."""
    parts = Path(pattern).parts
    if any("**" in part and part != "**" for part in parts):
        raise ToolError("invalid glob pattern: '**' can only be an entire path component")
    base = ctx.check(given, Access.READ)
    if not os.path.isdir(base):
        raise ToolError(f"not a directory: {ctx.display(base)}")
    caps = ctx.denied_caps()
    ctx.refuse_if_denied(base, Access.READ, caps)
    try:
        return _glob_in(ctx, base, parts, stop, caps)
    except RecursionError:
        raise ToolError(_too_deep(ctx, base)) from None


def _glob_in(
    ctx: ToolContext,
    base: str,
    parts: tuple[str, ...],
    stop: Stop,
    caps: Callable[[str], Access | None],
) -> tuple[list[str], int]:
    """`_glob`'s answer for the resolved `base`, holding the matches it shows only: every one
    was kept (its path twice, ~600 bytes) to be sorted at the end, and the 60 s a glob may
    take found a million on a big tree, 600 MB of the pod's memory for 500 shown."""
    total = 0

    def matches() -> Iterator[tuple[int, str]]:
        nonlocal total
        for found in _matches(ctx, base, parts, stop, caps):
            total += 1
            yield found

    newest = heapq.nsmallest(MAX_GLOB_RESULTS, matches(), key=lambda m: (-m[0], m[1]))
    return [name for _, name in newest], total


def _matches(
    ctx: ToolContext,
    base: str,
    parts: tuple[str, ...],
    stop: Stop,
    caps: Callable[[str], Access | None],
) -> Iterator[tuple[int, str]]:
    """(mtime_ns, display name) of every match. `caps`: the deny rules' by identity."""
    wanted_vcs = {part for part in parts if part in VCS_DIRS}

    real = _resolver(base)

    def readable(path: str) -> bool:
        resolved = real(path)
        if ctx.scope.access(resolved) < Access.READ:
            return False
        cap = caps(resolved)
        return cap is None or cap >= Access.READ

    for p in glob_paths(base, parts, readable, stop, real):
        # (not pathlib's parts: it interns every name, growing the interpreter's table of them)
        rel_parts = os.path.relpath(p, base).split(os.sep)
        if any(part in VCS_DIRS and part not in wanted_vcs for part in rel_parts):
            continue
        if not readable(p):
            continue
        try:
            st = os.stat(p)
        except OSError:
            continue
        name = ctx.display(p)
        yield st.st_mtime_ns, name + "/" if stat.S_ISDIR(st.st_mode) else name


def _resolver(base: str) -> Callable[[str], str]:
    """`os.path.realpath` for the paths a walk from the resolved `base` gives, in one lstat
    each: a path in a directory resolved before is that directory's resolution and its name,
    unless it is a symlink. realpath itself took an lstat per component, quadratic in the
    depth: 1.8 s of `**/*.py` on 2,000 directories 100 deep."""
    known = {base: base}  # directories and symlinks only: the matches may be millions

    def real(path: str) -> str:
        if path in known:  # (as it was approved: a directory is listed where it was then)
            return known[path]
        parent, name = os.path.split(path)
        resolved = known.get(parent)
        if resolved is None or name in ("", os.curdir, os.pardir):
            return os.path.realpath(path)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return os.path.realpath(path)
        if stat.S_ISLNK(mode):  # (few: each kept, as what a walk through it was approved)
            known[path] = os.path.realpath(path)
            return known[path]
        resolved = os.path.join(resolved, name)
        if stat.S_ISDIR(mode):
            known[path] = resolved
        return resolved

    return real


def glob_paths(
    base: str,
    parts: tuple[str, ...],
    enter: Callable[[str], bool],
    stop: Stop,
    resolve: Callable[[str], str] = os.path.realpath,
) -> Iterator[str]:
    """The paths under `base` that `parts` match, as pathlib's glob finds them (a part is an
    fnmatch pattern, `*` matches dot files too; `**` is any depth of directories, this one
    included, never through a symlink), without ever walking into a directory `enter` refuses:
    pathlib followed a symlink a plain part matched, so `*/**/*.conf` with `up -> /usr` in the
    scope walked all of /usr (showing none of it) and could not be stopped. A directory is
    read where `resolve` put it, following no symlink: one swapped for a link to elsewhere
    after it was resolved gives nothing (not the names of what it now leads to)."""
    # What walk(directory, i) finds depends on nothing else: each pair is walked once. Every
    # `**` tried each depth again from each depth the one before it stopped at, so `**/**/*.py`
    # on a tree 100 deep took 49 s (`**/*.py`: 1.8 s), and each `**` more was worse. A match
    # has one way there then (from its directory, or itself before a last `**`): it is given
    # once without being remembered.
    walked: set[tuple[str, int]] = set()
    matchers = [re.compile(fnmatch.translate(part)).fullmatch for part in parts]

    def walk(directory: str, i: int) -> Iterator[str]:
        if stop.stopped():
            return
        if i == len(parts):
            yield directory
            return
        if (directory, i) in walked:
            return
        walked.add((directory, i))
        part = parts[i]
        if part == "**":
            yield from walk(directory, i + 1)
            for sub in _entries(resolve(directory), dirs_only=True):
                path = os.path.join(directory, sub)
                if enter(path):  # (a denied tree may be huge: never listed, never shown)
                    yield from walk(path, i)
            return
        last, match = i + 1 == len(parts), matchers[i]
        magic = _MAGIC.search(part)
        for name in _entries(resolve(directory)) if magic else _present(resolve(directory), part):
            path = os.path.join(directory, name)
            if not match(name):
                continue
            if last or (os.path.isdir(path) and enter(path)):
                yield from walk(path, i + 1)

    yield from walk(base, 0)


_MAGIC = re.compile(r"[*?\[]")


def _entries(directory: str, dirs_only: bool = False) -> list[str]:
    """The names in the resolved `directory`, opened following no symlink (with `dirs_only`,
    of its directories that are no symlinks, as `**` walks them); none when it cannot be
    read, or when a symlink is met on the way there (it changed since it was resolved)."""
    try:
        fd = open_resolved(directory, os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, ValueError):
        return []
    try:
        with os.scandir(fd) as it:
            if dirs_only:
                return [e.name for e in it if e.is_dir(follow_symlinks=False)]
            return [e.name for e in it]
    except OSError:
        return []
    finally:
        os.close(fd)


def _present(directory: str, name: str) -> list[str]:
    """[name] if the resolved `directory`, opened following no symlink, has an entry `name`
    (a literal part of a pattern), else []."""
    try:
        fd = open_resolved(directory, os.O_PATH | os.O_DIRECTORY)
    except (OSError, ValueError):
        return []
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
        return [name]
    except (OSError, ValueError):
        return []
    finally:
        os.close(fd)


class Grep:
    name = "grep"
    description = "Search file contents with a Python regex; prints path:line:text."
    parameters = schema(
        {"pattern": ("string", "Python regex")},
        {
            "path": ("string", "file or directory (default .)"),
            "glob": ("string", "file name filter, e.g. *.py"),
            "ignore_case": ("boolean", "case-insensitive"),
        },
    )

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        pattern: str = args["pattern"]
        search = compile_search(pattern, bool(args.get("ignore_case")))
        stop = Stop(SEARCH_SECONDS)
        unread: list[str] = []  # files whose search ended at a line over SKIP_MAX_BYTES
        unreadable: list[str] = []  # files and directories the OS would not let us read
        given, name_glob = args.get("path", "."), args.get("glob")
        matches, files, capped, long_lines = await in_thread(
            _grep_path, ctx, given, search, name_glob, unread, unreadable, stop=stop
        )
        what = f"{plural(len(matches), 'match', 'matches')} in {plural(files, 'file')}"
        notes = []
        if capped:
            what = f"{MAX_GREP_MATCHES}+ matches"
            notes.append(f"[match limit {MAX_GREP_MATCHES} reached; narrow the search]")
        if long_lines:
            mib = GREP_LINE_BYTES >> 20
            lines = plural(long_lines, "line")
            notes.append(f"[{lines} over {mib} MiB: searched in their first {mib} MiB only]")
        if unread:
            mib = SKIP_MAX_BYTES >> 20
            notes.append(
                f"[not searched past a line over {mib} MiB: {', '.join(unread[:5])}"
                + (" …]" if len(unread) > 5 else "]")
            )
        if unreadable:  # else "no matches" would say the pattern is not in them
            notes.append(
                f"[could not read {plural(len(unreadable), 'path')}, not searched: "
                + ", ".join(unreadable[:5])
                + (" …]" if len(unreadable) > 5 else "]")
            )
        note = "\n".join(notes) + _out_of_time_note(stop)
        return ToolOutcome(
            output="\n".join(matches) or "no matches",
            summary=f"grep {pattern}: {what}",
            note=note.strip("\n"),
        )


def _name_filter(name_glob: str | None) -> Any:
    if not name_glob:
        return None  # every file (and no relative path to compute for each)
    g = name_glob.removeprefix("**/")
    if "/" in g:
        return lambda rel, name: fnmatch.fnmatchcase(rel, name_glob)
    return lambda rel, name: fnmatch.fnmatchcase(name, g)


def _walk_files(ctx: ToolContext, base: str, unreadable: list[str], stop: Stop) -> Any:
    """Files under base (sorted, not following directory symlinks, pruning SKIP_DIRS and
    directories the scope hides), as (path as walked, resolved path, its lstat or None).
    A directory below base that cannot be listed is added to `unreadable`; base itself
    raises the OSError."""
    st = os.stat(base)
    if not stat.S_ISDIR(st.st_mode):
        yield base, base, None
        return

    def cannot_list(e: OSError) -> None:
        if e.filename == base:
            raise e
        unreadable.append(ctx.display(os.fsdecode(e.filename)) + "/")

    for root, dirs, names in os.walk(base, onerror=cannot_list):
        # Looked at per directory too: a tree of directories alone gives no file to stop at,
        # and was walked to its end past the time limit and a cancel (the pod's exit waited).
        if stop.stopped():
            return
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS and ctx.scope.access(os.path.join(root, d)) > Access.NONE
        )
        for name in sorted(names):
            full = os.path.join(root, name)
            try:
                lst = os.lstat(full)
            except OSError:
                continue  # gone meanwhile
            if stat.S_ISLNK(lst.st_mode):  # judged, and looked at, where it leads
                real, looked = os.path.realpath(full), None
            else:
                real, looked = full, lst
            if ctx.scope.access(real) >= Access.READ:
                yield full, real, looked


# Without repetition or alternation a pattern matches in time linear in the line: `re` runs it
# as fast as ever. Only the others can backtrack catastrophically (`(a|aa)+$`, for ever, holding
# the GIL, so the pod's event loop with it); they run on `regex`, which lets go of the GIL while
# it matches and gives up after LINE_TIMEOUT (~2 µs a line more).
_CAN_BACKTRACK = frozenset("*+?{|")
Search = Callable[[str], object]  # a match or None; TimeoutError after LINE_TIMEOUT


def compile_search(pattern: str, ignore_case: bool) -> Search:
    """The search function for `pattern`, or ToolError naming what is wrong with it."""
    if not _CAN_BACKTRACK.intersection(pattern):
        with contextlib.suppress(re.error):  # (`regex` knows more syntax: \p{L}, …)
            return re.compile(pattern, re.IGNORECASE if ignore_case else 0).search
    import regex  # here: its import would add ~10 ms to every pod's start

    try:
        rx = regex.compile(pattern, regex.IGNORECASE if ignore_case else 0)
    except regex.error as e:
        raise ToolError(f"invalid regex: {e}") from None
    return functools.partial(rx.search, concurrent=True, timeout=LINE_TIMEOUT)


class _TooSlow(ToolError):
    pass


def _grep_path(
    ctx: ToolContext,
    given: str,
    search: Search,
    name_glob: str | None,
    unread: list[str],
    unreadable: list[str],
    stop: Stop,
) -> tuple[list[str], int, bool, int]:
    """`_grep` under the model's path `given`, resolved and checked here."""
    base = ctx.check(given, Access.READ)
    # (each file is judged as it is opened; a directory named is refused, not "no matches")
    ctx.refuse_if_denied(base, Access.READ, ctx.denied_caps())
    try:
        return _grep(ctx, base, search, name_glob, unread, unreadable, stop)
    except RecursionError:
        raise ToolError(_too_deep(ctx, base)) from None


def _text_lines(f: BinaryIO, size: int, cut: list[int], gave_up: list[int]) -> Iterable[str]:
    """The lines of `f` as grep searches them: decoded, their line end stripped. A small file
    is decoded in one go (a third of grep's time went to decoding it line by line): the same
    text, as no invalid UTF-8 sequence can take in a newline."""
    data = read_small(f, size)
    if data is None:
        lines = bounded_lines(f, GREP_LINE_BYTES, cut, gave_up)
        return (raw.decode("utf-8", "replace").rstrip("\r\n") for raw in lines)
    text = data.decode("utf-8", "replace")
    split = text.removesuffix("\n").split("\n") if text else []
    return [line.rstrip("\r") for line in split] if "\r" in text else split


def _grep(
    ctx: ToolContext,
    base: str,
    search: Search,
    name_glob: str | None,
    unread: list[str],
    unreadable: list[str],
    stop: Stop,
) -> tuple[list[str], int, bool, int]:
    """(match lines, files with matches, whether the match cap was hit, lines searched only in
    their first GREP_LINE_BYTES). A file named as base that cannot be searched (unreadable,
    not regular, binary) is a ToolError or OSError, as read_file's would be; one found in a
    walk is skipped, and added to `unreadable` when the OS refused to open it."""
    accept = _name_filter(name_glob)
    out: list[str] = []
    files = 0
    cut = [0]  # lines searched in their first GREP_LINE_BYTES only
    for full, real, looked in _walk_files(ctx, base, unreadable, stop):
        if stop.stopped():
            break
        if accept and not accept(os.path.relpath(full, base), os.path.basename(full)):
            continue
        shown = ctx.display(full)
        try:
            fd, st = open_regular(ctx, real, shown, looked)
            with os.fdopen(fd, "rb") as f:
                if is_binary(f.read(BINARY_SNIFF_BYTES)):
                    if full == base:
                        raise ToolError(f"{shown} is a binary file; not searched")
                    continue
                f.seek(0)
                hit = False
                gave_up: list[int] = []
                for lineno, line in enumerate(_text_lines(f, st.st_size, cut, gave_up), 1):
                    if stop.cancelled:
                        break
                    try:
                        if not search(line):
                            continue
                    except TimeoutError:
                        raise _TooSlow(
                            f"the regex took over {LINE_TIMEOUT:g} s on one line "
                            f"({shown}:{lineno}): it backtracks catastrophically (nested "
                            "repetition such as (a|aa)+ or (\\w+\\s?)+); simplify it"
                        ) from None
                    if len(out) >= MAX_GREP_MATCHES:
                        return out, files, True, cut[0]
                    if len(line) > MAX_GREP_LINE_CHARS:
                        line = line[:MAX_GREP_LINE_CHARS] + " …"
                    out.append(f"{shown}:{lineno}:{line}")
                    if not hit:
                        hit = True
                        files += 1
                if gave_up:
                    unread.append(f"{shown}:{gave_up[0]}")
        except _TooSlow:
            raise
        except (OSError, ToolError, ScopeDenied) as e:  # (TimeoutError is an OSError)
            if full == base:  # the one file asked for: say why, never "no matches"
                raise
            if isinstance(e, PermissionError):
                unreadable.append(ctx.display(full))
            continue  # unreadable, not regular, or moved outside the scope meanwhile
    return out, files, False, cut[0]
