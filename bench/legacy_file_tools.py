"""The file tools as they were before issue 9 item 13 (check the resolved path, then open it
again by name): the same-run baseline of `bench.file_tools_bench`. A frozen copy; the pod never
uses it."""

import asyncio
import contextlib
import fnmatch
import functools
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from poddaemon.scope import Access
from poddaemon.tools.base import (
    FileStamp,
    ToolContext,
    ToolError,
    ToolOutcome,
    schema,
)
from poddaemon.umask import current_umask

BINARY_SNIFF_BYTES = 8192
DEFAULT_READ_LIMIT = 2000
MAX_LINE_CHARS = 2000


def is_binary(head: bytes) -> bool:
    return b"\0" in head


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
        path = ctx.check(args["path"], Access.READ)
        shown = ctx.display(path)
        budget = ctx.limits.max_bytes(self.name) - 200
        lines, stamp, total, more = await asyncio.to_thread(
            _read_lines, path, shown, offset, limit, budget
        )
        ctx.reads[path] = stamp
        if total == 0:
            return ToolOutcome(output="(empty file)", summary=f"read {shown} (empty)")
        if not lines:
            raise ToolError(f"offset {offset} is past the end: {shown} has {total} lines")
        body = "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines, offset))
        if more:
            body += f"\n[more lines follow; continue with offset={offset + len(lines)}]"
        return ToolOutcome(output=body, summary=f"read {plural(len(lines), 'line')} of {shown}")


def _read_lines(
    path: str, shown: str, offset: int, limit: int, budget: int
) -> tuple[list[str], FileStamp, int, bool]:
    """(lines from offset, stamp, lines seen, whether more follow)."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise ToolError(f"{shown} is a directory; use list_dir")
    if not stat.S_ISREG(mode):
        raise ToolError(f"{shown} is not a regular file")
    with open(path, "rb") as f:
        stamp = FileStamp.of(os.fstat(f.fileno()))
        if is_binary(f.read(BINARY_SNIFF_BYTES)):
            raise ToolError(f"{shown} is a binary file; not shown")
        f.seek(0)
        lines: list[str] = []
        used = 0
        n = 0
        for n, raw in enumerate(f, 1):
            if n < offset:
                continue
            line = raw.decode("utf-8", "replace").removesuffix("\n").removesuffix("\r")
            if len(line) > MAX_LINE_CHARS:
                line = line[:MAX_LINE_CHARS] + " … [line truncated]"
            cost = len(line.encode("utf-8", "replace")) + 8
            if len(lines) >= limit or (lines and used + cost > budget):
                return lines, stamp, n, True
            lines.append(line)
            used += cost
        return lines, stamp, n, False


def _require_fresh(ctx: ToolContext, path: str, st: os.stat_result, verb: str) -> None:
    stamp = ctx.reads.get(path)
    if stamp is None:
        raise ToolError(f"read the file before {verb} it: {ctx.display(path)}")
    if stamp != FileStamp.of(st):
        raise ToolError(f"file changed since it was read; read it again: {ctx.display(path)}")


_umask = functools.cache(current_umask)  # the legacy tools read it once


def atomic_write(path: str, data: bytes) -> os.stat_result:
    """Replace `path` with `data` via a temp file in the same directory (fsync'd), keeping an
    existing file's mode. On any failure the old file is untouched. Returns the new stat."""
    directory, base = os.path.split(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return os.stat(path)


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
        path = ctx.check(args["path"], Access.WRITE)
        shown = ctx.display(path)
        data = _encode(args["content"])
        try:
            st = os.stat(path)
        except FileNotFoundError:
            existed = False
            parent = os.path.dirname(path)
            if not os.path.isdir(parent):
                ctx.check(parent, Access.WRITE)
                os.makedirs(parent, exist_ok=True)
        else:
            existed = True
            if stat.S_ISDIR(st.st_mode):
                raise ToolError(f"{shown} is a directory")
            _require_fresh(ctx, path, st, "overwriting")
        ctx.reads[path] = FileStamp.of(atomic_write(path, data))
        verb = "updated" if existed else "created"
        lines = args["content"].count("\n") + (0 if args["content"].endswith("\n") else 1)
        if not args["content"]:
            lines = 0
        return ToolOutcome(
            output=f"{verb} {shown} ({len(data)} bytes)",
            summary=f"{'wrote' if existed else 'created'} {shown} ({plural(lines, 'line')})",
        )


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
        new: str = args["new_string"]
        if not old:
            raise ToolError("old_string is empty; use write_file to create a file")
        if old == new:
            raise ToolError("old_string and new_string are the same")
        path = ctx.check(args["path"], Access.WRITE)
        shown = ctx.display(path)
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{shown} is a directory")
        _require_fresh(ctx, path, st, "editing")
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{shown} is not UTF-8 text; cannot edit it") from None
        count = text.count(old)
        if count == 0:
            raise ToolError(f"old_string not found in {shown}")
        if count > 1 and not args.get("replace_all", False):
            raise ToolError(
                f"old_string occurs {count} times in {shown}; add context or set replace_all"
            )
        ctx.reads[path] = FileStamp.of(atomic_write(path, _encode(text.replace(old, new))))
        n = plural(count, "replacement")
        return ToolOutcome(output=f"edited {shown}: {n}", summary=f"edited {shown} ({n})")


class ListDir:
    name = "list_dir"
    description = "List a directory; subdirectories end in /."
    parameters = schema({}, {"path": ("string", "directory (default .)")})

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        path = ctx.check(args.get("path", "."), Access.READ)
        shown = ctx.display(path)
        names: list[str] = []
        with os.scandir(path) as it:
            for entry in it:
                try:
                    is_dir = entry.is_dir()
                except OSError:
                    is_dir = False
                names.append(entry.name + "/" if is_dir else entry.name)
        names.sort()
        summary = f"listed {plural(len(names), 'entry', 'entries')} in {shown}"
        return ToolOutcome(output="\n".join(names) or "(empty directory)", summary=summary)


# --- search.py as it was

MAX_GLOB_RESULTS = 500
MAX_GREP_MATCHES = 200
MAX_GREP_LINE_CHARS = 300
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
        base = ctx.check(args.get("path", "."), Access.READ)
        if not os.path.isdir(base):
            raise ToolError(f"not a directory: {ctx.display(base)}")
        found = await asyncio.to_thread(_glob, ctx, base, pattern)
        if not found:
            return ToolOutcome(output="no files match", summary=f"glob {pattern}: no matches")
        found.sort(key=lambda item: (-item[0], item[1]))
        lines = [name for _, name in found[:MAX_GLOB_RESULTS]]
        if len(found) > MAX_GLOB_RESULTS:
            lines.append(
                f"[showing {MAX_GLOB_RESULTS} of {len(found)} matches; narrow the pattern]"
            )
        return ToolOutcome(
            output="\n".join(lines),
            summary=f"glob {pattern}: {plural(len(found), 'match', 'matches')}",
        )


def _glob(ctx: ToolContext, base: str, pattern: str) -> list[tuple[int, str]]:
    """(mtime_ns, display name) of every match the scope lets the model read."""
    wanted_vcs = {part for part in Path(pattern).parts if part in VCS_DIRS}
    found: list[tuple[int, str]] = []
    try:
        for p in Path(base).glob(pattern):
            rel_parts = p.relative_to(base).parts
            if any(part in VCS_DIRS and part not in wanted_vcs for part in rel_parts):
                continue
            real = os.path.realpath(p)
            if ctx.scope.access(real) < Access.READ:
                continue
            try:
                st = os.stat(real)
            except OSError:
                continue
            name = ctx.display(str(p))
            found.append((st.st_mtime_ns, name + "/" if stat.S_ISDIR(st.st_mode) else name))
    except ValueError as e:
        raise ToolError(f"invalid glob pattern: {e}") from None
    return found


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
        try:
            rx = re.compile(pattern, re.IGNORECASE if args.get("ignore_case") else 0)
        except re.error as e:
            raise ToolError(f"invalid regex: {e}") from None
        base = ctx.check(args.get("path", "."), Access.READ)
        matches, files, capped = await asyncio.to_thread(_grep, ctx, base, rx, args.get("glob"))
        what = f"{plural(len(matches), 'match', 'matches')} in {plural(files, 'file')}"
        if capped:
            what = f"{MAX_GREP_MATCHES}+ matches"
            matches.append(f"[match limit {MAX_GREP_MATCHES} reached; narrow the search]")
        return ToolOutcome(
            output="\n".join(matches) or "no matches", summary=f"grep {pattern}: {what}"
        )


def _name_filter(name_glob: str | None) -> Any:
    if not name_glob:
        return lambda rel, name: True
    g = name_glob.removeprefix("**/")
    if "/" in g:
        return lambda rel, name: fnmatch.fnmatchcase(rel, name_glob)
    return lambda rel, name: fnmatch.fnmatchcase(name, g)


def _walk_files(ctx: ToolContext, base: str) -> Any:
    """Files under base (sorted, not following directory symlinks, pruning SKIP_DIRS and
    directories the scope hides), as (path as walked, resolved path)."""
    st = os.stat(base)
    if not stat.S_ISDIR(st.st_mode):
        yield base, base
        return
    for root, dirs, names in os.walk(base):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS and ctx.scope.access(os.path.join(root, d)) > Access.NONE
        )
        for name in sorted(names):
            full = os.path.join(root, name)
            real = os.path.realpath(full) if os.path.islink(full) else full
            if ctx.scope.access(real) >= Access.READ:
                yield full, real


def _grep(
    ctx: ToolContext, base: str, rx: re.Pattern[str], name_glob: str | None
) -> tuple[list[str], int, bool]:
    """(match lines, files with matches, whether the match cap was hit)."""
    accept = _name_filter(name_glob)
    out: list[str] = []
    files = 0
    for full, real in _walk_files(ctx, base):
        if not accept(os.path.relpath(full, base), os.path.basename(full)):
            continue
        try:
            if not stat.S_ISREG(os.stat(real).st_mode):
                continue
            with open(real, "rb") as f:
                if is_binary(f.read(BINARY_SNIFF_BYTES)):
                    continue
                f.seek(0)
                shown = ctx.display(full)
                hit = False
                for lineno, raw in enumerate(f, 1):
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if not rx.search(line):
                        continue
                    if len(out) >= MAX_GREP_MATCHES:
                        return out, files, True
                    if len(line) > MAX_GREP_LINE_CHARS:
                        line = line[:MAX_GREP_LINE_CHARS] + " …"
                    out.append(f"{shown}:{lineno}:{line}")
                    if not hit:
                        hit = True
                        files += 1
        except OSError:
            continue
    return out, files, False
