"""Loading a manifest: TOML, `defaults.toml` merged under it, `--set` overrides, validation, paths.

Every problem is a `ManifestError` reading `<file>[:<line>]: <field>: <problem>`, where the file is
the one the offending value came from (the manifest or defaults.toml, as given) and the field is
dotted (`scope.allow[0].permission`). Values set with `--set` name the override instead of a line.
"""

import copy
import errno
import os
import re
import stat
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import msgspec

from poddaemon.overrides import split_override
from protocol import paths

from .manifest import (
    LOADER_FIELDS,
    FieldError,
    HookConfig,
    HooksSection,
    Manifest,
    ProviderConfig,
    SandboxConfig,
    ScopeRule,
    SpawnConfig,
    script_start,
)

__all__ = [
    "MAX_FILE_BYTES",
    "ManifestError",
    "files_problem",
    "load_manifest",
    "manifest_to_dict",
    "manifest_to_toml",
    "pwd_problem",
    "read_bounded",
]

Key = tuple[str | int, ...]

# Only these sections may come from defaults.toml: scope is granted by the pod's own manifest alone.
DEFAULTABLE = ("provider", "worker")
# Keys that only make sense for the provider kind they were written for.
_KIND_SPECIFIC = ("model", "base_url", "api_key_env")
_INSTRUCTION_KEYS = ("instruction", "instruction_file")

_CHOICES: dict[str, tuple[str, ...]] = {
    "kind": get_args(ProviderConfig.__annotations__["kind"]),
    "permission": get_args(ScopeRule.__annotations__["permission"]),
    "on_parent_exit": get_args(SpawnConfig.__annotations__["on_parent_exit"]),
    "mode": get_args(SandboxConfig.__annotations__["mode"]),
}


class ManifestError(Exception):
    """A manifest that cannot be used; the message names the file, the field and the line."""


def manifest_to_dict(m: Manifest) -> dict[str, Any]:
    return m.to_dict()


def manifest_to_toml(m: Manifest) -> str:
    return m.to_toml()


class _Source(msgspec.Struct):
    """Where values came from, for error messages."""

    name: str  # the file as given by the caller
    text: str | None = None  # for finding lines
    note: str = ""  # for values from --set
    _lines: dict[Key, int] | None = None

    def line_of(self, key: Key) -> int | None:
        if self.text is None:
            return None
        if self._lines is None:
            self._lines = _key_lines(self.text)
        for n in range(len(key), 0, -1):  # the key itself, else its nearest enclosing table
            if key[:n] in self._lines:
                return self._lines[key[:n]]
        return None

    def error(self, key: Key, problem: str, *, locate: bool = True) -> ManifestError:
        line = self.line_of(key) if locate else None
        where = f"{self.name}:{line}" if line else self.name
        suffix = f" ({self.note})" if self.note else ""
        return ManifestError(f"{where}: {_dotted(key)}: {problem}{suffix}")


def load_manifest(
    path: str | Path,
    overrides: Sequence[str] = (),
    defaults_path: str | Path | None = None,
) -> Manifest:
    """Load, merge, override, validate and resolve a manifest; raises ManifestError.

    `defaults_path` None means the user's `<config>/defaults.toml`; a missing file is no defaults.
    """
    if not str(path):  # Path("") is ".": it said ": cannot read: Is a directory"
        raise ManifestError("the manifest's path is empty")
    src = _Source(str(path))
    src.text = _read(Path(path), src.name, missing="manifest not found")
    data = _parse(src.text, src.name)
    origins: dict[Key, _Source] = {}

    dpath = Path(defaults_path) if defaults_path is not None else paths.defaults_path()
    try:
        dtext: str | None = _read(dpath, str(dpath), missing=None)
    except FileNotFoundError:
        dtext = None
    if dtext is not None:
        _check_ours(dpath)
        dsrc = _Source(str(dpath), dtext)
        _merge_defaults(data, _parse(dtext, dsrc.name), dsrc, origins)

    for text in overrides:
        _apply_override(data, text, src.name, origins)
    for name in LOADER_FIELDS:  # Manifest fields, but set by us, never by the user
        if name in data:
            raise _origin((name,), src, origins).error((name,), "unknown key")

    try:
        manifest = msgspec.convert(data, Manifest)
    except msgspec.ValidationError as e:
        raise _translate(e, data, src, origins) from None
    worker = data.get("worker")
    for key in _INSTRUCTION_KEYS:
        if isinstance(worker, dict) and key in worker:
            origin = _origin(("worker", key), src, origins)
            if origin is not src:  # from defaults.toml or a --set: a template error names it
                note = f" ({origin.note})" if origin.note else ""
                manifest = msgspec.structs.replace(manifest, instruction_source=origin.name + note)
            if key == "instruction_file" and not origin.note and origin is not src:
                manifest = _file_from_defaults(manifest, origin.name)
    manifest = _resolve_paths(manifest, Path(path))
    _check_utf8(manifest.to_dict(), (), src.name)
    return manifest


def _file_from_defaults(m: Manifest, defaults: str) -> Manifest:
    """defaults.toml's `instruction_file`, when relative, is relative to defaults.toml: it goes
    under every pod, and against each pod's own pwd it named a different file (or none) each."""
    name = m.worker.instruction_file
    if name is None:
        return m
    found = os.path.join(os.path.dirname(_absolute(defaults)), os.path.expanduser(name))
    return msgspec.structs.replace(
        m, worker=msgspec.structs.replace(m.worker, instruction_file=found)
    )


def _check_utf8(value: Any, key: Key, shown: str) -> None:
    """Every value must be text the kept configuration, the registry and the wire can hold: a
    `--set` value or a directory name that is not UTF-8 (held as lone surrogates) started the
    pod, which then died with a UnicodeEncodeError traceback writing them."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as e:
            code = ord(value[e.start])
            bad = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:X}"
            shown_value = value.encode("utf-8", "backslashreplace").decode()
            raise ManifestError(
                f"{shown}: {_dotted(key)}: '{shown_value}' is not UTF-8 text ({bad})"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(v, (*key, k), shown)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_utf8(v, (*key, i), shown)


# --- reading ---------------------------------------------------------------------------------


def _check_ours(defaults: Path) -> None:
    """defaults.toml goes under every manifest (it can add tools, an instruction, a provider
    URL): like ssh with its config, refuse one that another user owns or could change."""
    try:
        paths.check_file(defaults, "defaults file", "another user could change what your pods run")
    except paths.UnsafeDirectory as exc:
        raise ManifestError(str(exc)) from None


def files_problem(m: Manifest) -> str | None:
    """Why the pod of manifest `m` must not start for the files it names, or None. At every
    start, as you (a unit's or a crash restart's unattended), the pod reads its instruction file
    and runs its hook scripts and stdio MCP servers named by path (a server outside any sandbox):
    another user who could change or swap one of them would write your pod's prompt or run code
    as you, as with defaults.toml. Files of yours or root's that only you and root may change."""
    for what, file in m.named_files():
        try:
            if not stat.S_ISREG(os.stat(file).st_mode):
                continue  # missing, a device: the pod's own start says so, in its words
            paths.check_unchangeable(Path(file), f"{m.source}: {what}", "as they could change it")
        except paths.UnsafeDirectory as exc:  # (before OSError: it is a PermissionError)
            return str(exc)
        except OSError:
            continue
    return None


def pwd_problem(m: Manifest, pwd: str) -> str | None:
    """Why `pwd` (the manifest's pod.pwd, resolved) cannot be the pod's working directory."""
    if not os.path.exists(pwd):
        return f"{m.source}: pod.pwd: {pwd} does not exist"
    if not os.path.isdir(pwd):
        return f"{m.source}: pod.pwd: {pwd} is not a directory"
    return None


# A manifest, defaults.toml or instruction file past this is a wrong path (a log, a device),
# not a configuration: a system prompt of 4 MiB is already ~1M tokens.
MAX_FILE_BYTES = 4 * 1024 * 1024


def read_bounded(path: str | Path, limit: int = MAX_FILE_BYTES, *, wait: bool = True) -> bytes:
    """A configuration file's bytes; OSError (with a strerror) for a directory, a device or
    socket, or more than `limit` bytes. Read whole, `/dev/zero` took all memory. A pipe
    (`poddaemon run <(envsubst < m.toml)`) is read as `cat` would, unless `wait` is False:
    then it is refused, and opening it does not wait for a writer (O_NONBLOCK)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (0 if wait else os.O_NONBLOCK))
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not (stat.S_ISREG(mode) or (wait and stat.S_ISFIFO(mode))):
            raise OSError(errno.EINVAL, "not a regular file")
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit // (1024 * 1024)} MiB")
    return raw


def _read(path: Path, shown: str, *, missing: str | None) -> str:
    try:
        raw = read_bounded(path)
    except FileNotFoundError:
        if missing is None:
            raise
        raise ManifestError(f"{shown}: {missing}") from None
    except OSError as e:
        raise ManifestError(f"{shown}: cannot read: {e.strerror or e}") from None
    try:
        # An editor's "UTF-8 with BOM" (Notepad's default) put U+FEFF before the first key:
        # "invalid TOML: Invalid statement (at line 1, column 1)", a character nobody can see.
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ManifestError(
            f"{shown}: invalid TOML: not UTF-8 ({e.reason} at byte {e.start})"
        ) from None


def _parse(text: str, shown: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column \d+\)", str(e))
        where = f"{shown}:{m[1]}" if m else shown
        raise ManifestError(f"{where}: invalid TOML: {e}") from None


# --- defaults and overrides ------------------------------------------------------------------


def _merge_defaults(
    data: dict[str, Any], defaults: dict[str, Any], dsrc: _Source, origins: dict[Key, _Source]
) -> None:
    for section, table in defaults.items():
        if section not in DEFAULTABLE:
            raise dsrc.error((section,), "not allowed in defaults (only [provider] and [worker])")
        if not isinstance(table, dict):
            raise dsrc.error((section,), f"expected table, got {_toml_type(table)}")
    defaults = copy.deepcopy(defaults)
    mine_provider = data.get("provider")
    their_provider = defaults.get("provider")
    if isinstance(mine_provider, dict) and their_provider is not None:
        mine_kind, their_kind = mine_provider.get("kind"), their_provider.get("kind")
        # A model or endpoint written for another kind would only mislead this one.
        if mine_kind is not None and their_kind is not None and mine_kind != their_kind:
            for k in _KIND_SPECIFIC:
                their_provider.pop(k, None)
    mine_worker = data.get("worker")
    their_worker = defaults.get("worker")
    # instruction and instruction_file are one setting in two forms: the manifest's wins whole.
    if (
        isinstance(mine_worker, dict)
        and their_worker is not None
        and any(k in mine_worker for k in _INSTRUCTION_KEYS)
    ):
        for k in _INSTRUCTION_KEYS:
            their_worker.pop(k, None)
    _merge_under(data, defaults, (), dsrc, origins)


def _merge_under(
    mine: dict[str, Any],
    theirs: dict[str, Any],
    prefix: Key,
    dsrc: _Source,
    origins: dict[Key, _Source],
) -> None:
    for k, v in theirs.items():
        if k not in mine:
            mine[k] = v
            origins[(*prefix, k)] = dsrc
        elif isinstance(mine[k], dict) and isinstance(v, dict):
            _merge_under(mine[k], v, (*prefix, k), dsrc, origins)


def _apply_override(
    data: dict[str, Any], text: str, shown: str, origins: dict[Key, _Source]
) -> None:
    split = split_override(text)
    if split is None:
        raise ManifestError(f"{shown}: --set {text}: expected section.key=value")
    parts, raw = split
    value = _parse_value(raw)
    node: Any = data
    key: list[str | int] = []
    made: list[Key] = []  # tables this override creates: an error about one names it
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        step: str | int = part
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ManifestError(f"{shown}: --set {text}: {_dotted(tuple(key))} has no [{part}]")
            step = int(part)
        elif not isinstance(node, dict):
            raise ManifestError(f"{shown}: --set {text}: {_dotted(tuple(key))} is not a table")
        key.append(step)
        if last:
            node[step] = value
        else:
            if isinstance(node, dict) and part not in node:
                node[part] = {}
                made.append(tuple(key))
            node = node[step]
    if len(key) == 2 and key[0] == "worker" and key[1] in _INSTRUCTION_KEYS:
        # Setting one form of the instruction replaces the other, wherever that came from.
        other = "instruction_file" if key[1] == "instruction" else "instruction"
        data["worker"].pop(other, None)
    full = tuple(key)
    for k in [k for k in origins if k[: len(full)] == full]:
        del origins[k]
    source = _Source(shown, note=f"--set {text}")
    for table in (*made, full):
        origins[table] = source


def _parse_value(raw: str) -> Any:
    """A TOML value, or the text itself when it is not one (`provider.model=gpt-4o`)."""
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    return parsed["v"] if parsed.keys() == {"v"} else raw


# --- validation errors -----------------------------------------------------------------------


def _translate(
    e: msgspec.ValidationError, data: dict[str, Any], src: _Source, origins: dict[Key, _Source]
) -> ManifestError:
    msg, _, at = str(e).partition(" - at `")
    key = _parse_key(at.rstrip("`"))
    locate = True
    cause = e.__cause__
    if isinstance(cause, FieldError):
        key = (*key, *_parse_key("$." + cause.field))
        problem = cause.problem
    elif m := re.fullmatch(r"Object contains unknown field `(.*)`", msg):
        problem = "unknown key" + _known_keys(key, m[1])
        key = (*key, m[1])
    elif m := re.fullmatch(r"Object missing required field `(.*)`", msg):
        key = (*key, m[1])
        problem = "required field is missing"
        locate = False  # the line would be some other key's
    elif m := re.fullmatch(r"Invalid enum value (.*)", msg):
        choices = _CHOICES.get(str(key[-1]) if key else "", ())
        expected = ", ".join(repr(c) for c in choices)
        problem = f"invalid value {m[1]}" + (f" (expected one of {expected})" if expected else "")
    elif m := re.fullmatch(r"Expected `(.*?)`, got `(.*?)`", msg):
        problem = f"expected {_type_names(m[1])}, got {_type_names(m[2])}"
    elif m := re.fullmatch(r"Expected `(.*?)` (.*)", msg):  # a constraint like ">= 1"
        problem = f"expected {_type_names(m[1])} {m[2]}"
        found = _get(data, key)
        if found is not _MISSING:
            problem += f", got {found!r}"
    else:
        problem = msg
    # A missing field is missing from the manifest: that is where the user would add it.
    origin = _origin(key, src, origins) if locate else src
    return origin.error(key, problem, locate=locate)


def _known_keys(table: Key, unknown: str) -> str:
    """What the user may have meant by `unknown` in `table`: the key spelled most like it, or
    else the keys the table takes ("" when the table cannot be found: a map's keys)."""
    import difflib

    import msgspec.inspect  # (an error's path only)

    def unwrapped(info: Any) -> Any:  # `X | None`: X
        while isinstance(info, msgspec.inspect.UnionType):
            info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
        return info

    info = unwrapped(msgspec.inspect.type_info(Manifest))
    for part in table:
        if isinstance(part, int) and isinstance(info, msgspec.inspect.ListType):
            info = unwrapped(info.item_type)
        elif isinstance(part, str) and isinstance(info, msgspec.inspect.StructType):
            info = unwrapped(next((f.type for f in info.fields if f.encode_name == part), None))
        else:
            return ""
    if not isinstance(info, msgspec.inspect.StructType):
        return ""
    keys = [f.encode_name for f in info.fields if f.encode_name not in LOADER_FIELDS]
    close = difflib.get_close_matches(unknown, keys, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (expected one of: {', '.join(keys)})"


def _origin(key: Key, src: _Source, origins: dict[Key, _Source]) -> _Source:
    for n in range(len(key), 0, -1):
        if key[:n] in origins:
            return origins[key[:n]]
    return src


def _parse_key(at: str) -> Key:
    """`$.scope.allow[0].permission` -> ("scope", "allow", 0, "permission")."""
    out: list[str | int] = []
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]", at):
        if name:
            out.append(name)
        elif index != "...":  # a dict value: msgspec does not say which key
            out.append(int(index))
    return tuple(out)


def _dotted(key: Key) -> str:
    out = ""
    for part in key:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


_TYPE_NAMES = {"object": "table", "array": "array", "datetime": "datetime"}


def _type_names(union: str) -> str:
    # TOML has no null: "int | null" is simply an int that may be left out.
    names = [n.strip() for n in union.split("|") if n.strip() != "null"]
    return " or ".join(_TYPE_NAMES.get(n, n) for n in names)


def _toml_type(value: Any) -> str:
    if isinstance(value, dict):
        return "table"
    return "array" if isinstance(value, list) else type(value).__name__


_MISSING = object()


def _get(data: Any, key: Key) -> Any:
    for part in key:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


# --- finding a key's line --------------------------------------------------------------------

_KEY_PART = r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'"""
_DOTTED = rf"(?:{_KEY_PART})(?:\s*\.\s*(?:{_KEY_PART}))*"
# Used only to name an error's line: compiled (and cached by `re`) then, not at every start.
_HEADER = rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]\]?\s*(#.*)?$"
_KEY = rf"^\s*({_DOTTED})\s*="


def _split_key(dotted: str) -> list[str]:
    return [_unquote(p) for p in re.findall(_KEY_PART, dotted)]


def _unquote(part: str) -> str:
    """A key part as the parser names it: a basic string's escapes (`"caf\\u00e9"`) decoded,
    else an unknown key written so was pinned on its table's line, not its own."""
    if part.startswith('"') and "\\" in part:
        try:
            return next(iter(tomllib.loads(f"{part} = 0")))
        except tomllib.TOMLDecodeError:
            pass
    return part.strip("\"'")


def _key_lines(text: str) -> dict[Key, int]:
    """The 1-based line where each table and key first appears, by full path (array items by index).

    A line scanner, not a parser: it only has to point a human at the right place.
    """
    lines: dict[Key, int] = {}
    arrays: dict[Key, int] = {}  # array-of-tables path -> items seen so far
    table: Key = ()
    in_multiline: str | None = None

    def resolve(parts: list[str]) -> Key:
        out: list[str | int] = []
        for p in parts:
            out.append(p)
            if tuple(out) in arrays:  # a sub-table of an array item belongs to its last item
                out.append(arrays[tuple(out)] - 1)
        return tuple(out)

    def record(key: Key, n: int) -> None:
        for i in range(1, len(key) + 1):
            lines.setdefault(key[:i], n)

    for n, line in enumerate(text.splitlines(), 1):
        if in_multiline is not None:
            if line.count(in_multiline) % 2:
                in_multiline = None
            continue
        if header := re.match(_HEADER, line):
            parts = _split_key(header[2])
            if header[1] == "[[":
                path = (*resolve(parts[:-1]), parts[-1])
                arrays[path] = arrays.get(path, 0) + 1
                table = (*path, arrays[path] - 1)
            else:
                table = resolve(parts)
            record(table, n)
            continue
        if key := re.match(_KEY, line):
            record((*table, *_split_key(key[1])), n)
            rest = line[key.end() :]
            for delim in ('"""', "'''"):
                if rest.count(delim) % 2:
                    in_multiline = delim
                    break
    return lines


# --- paths -----------------------------------------------------------------------------------


def _absolute(path: str) -> str:
    """`path` made absolute and normalised, meaning what it means to the kernel.

    Symlinks stay as written (they are scope's business), except before a `..`: `link/..` is
    the parent of where `link` points, which `abspath` would get wrong.
    """
    # (not getcwd() for an absolute path: from a directory removed since, it raises)
    parts = (path if os.path.isabs(path) else os.path.join(os.getcwd(), path)).split(os.sep)
    if ".." not in parts:
        return os.path.normpath(os.sep.join(parts))
    last = len(parts) - parts[::-1].index("..")  # just past the last `..`
    head = os.path.realpath(os.sep.join(parts[:last]))
    return os.path.normpath(os.path.join(head, *parts[last:]))


_PROJECT = r"\$(?:CLAUDE_PROJECT_DIR\b|\{CLAUDE_PROJECT_DIR\})"
_PLAIN = r"/[^\s\"'$`\\;|&<>()]*"  # the rest of a path up to what the shell would read
# Claude Code's way to name a project's hook script, as its docs write it or near:
# "$CLAUDE_PROJECT_DIR"/x, "$CLAUDE_PROJECT_DIR/x", $CLAUDE_PROJECT_DIR/x, with ${...} too.
_PROJECT_SCRIPT = (  # (compiled at first use: hooks only)
    rf'\s*(?:"{_PROJECT}"(?P<a>{_PLAIN})|"{_PROJECT}(?P<b>/[^"$`\\]*)"|{_PROJECT}(?P<c>{_PLAIN}))'
    r"(?=\s|$)"
)


def _project_script(command: str, pwd: str) -> str:
    """`command` with a script named through CLAUDE_PROJECT_DIR named by its path under
    `pwd` (the pod's project), so it is checked at start-up and granted like any script, and
    a child pod (another pwd) runs its spawner's file, not one under its own pwd."""
    at = script_start(command)
    found = None if at is None else re.compile(_PROJECT_SCRIPT).match(command, at)
    if found is None:
        return command
    import shlex  # (hooks only: not at every start)

    rest = found["a"] or found["b"] or found["c"] or ""
    start = found.end() - len(found.group(0).lstrip())
    return command[:start] + shlex.quote(pwd + rest) + command[found.end() :]


def _resolve_paths(m: Manifest, path: Path) -> Manifest:
    """Make every path absolute: pwd from the manifest's directory, the rest from pwd."""

    def under(base: str, p: str) -> str:
        return _absolute(os.path.join(base, os.path.expanduser(p)))

    source = _absolute(os.fspath(path))
    pwd = under(os.path.dirname(source), m.pod.pwd)

    def rules(rs: list[ScopeRule]) -> list[ScopeRule]:
        return [msgspec.structs.replace(r, target=under(pwd, r.target)) for r in rs]

    for i, rule in enumerate(m.scope.allow):
        # Resolved once, at start-up: another user's link on the way would choose what the pod
        # may write. Checked as written: `_absolute` resolves what comes before a `..`, which
        # would hide such a link.
        raw = os.path.join(pwd, os.path.expanduser(rule.target))
        if (link := paths.foreign_symlink(Path(raw))) is not None:
            raise ManifestError(
                f"{source}: scope.allow[{i}].target: {rule.target} is reached through the "
                f"symlink {link[0]}, owned by uid {link[1]}, who could repoint it: refusing it"
            )

    def hook(h: HookConfig) -> HookConfig:
        # A script named by path runs from anywhere: a child pod (another pwd) runs it too,
        # and the sandbox grants that one file (SPEC §10: a child keeps its spawner's hooks).
        h = msgspec.structs.replace(h, command=_project_script(h.command, pwd))
        found = h.script_word()
        if found is None or found.path.startswith("/"):
            return h
        import shlex  # (hooks only: not at every start)

        word = shlex.quote(under(pwd, found.path))
        command = h.command[: found.start] + word + h.command[found.end :]
        return msgspec.structs.replace(h, command=command)

    events = HooksSection.__struct_fields__
    hooks = msgspec.structs.replace(
        m.hooks, **{e: [hook(h) for h in getattr(m.hooks, e)] for e in events}
    )
    # A stdio server's relative words (`python3 server.py`) are relative to its cwd: the pwd
    # it was written for, kept for a child, whose pwd is the area its spawner's confined
    # commands may write (they could plant a server.py there, run unconfined by the child).
    servers = [
        msgspec.structs.replace(s, cwd=under(pwd, s.cwd or ".")) if s.command is not None else s
        for s in m.mcp.servers
    ]
    worker = m.worker
    if worker.instruction_file is not None:
        worker = msgspec.structs.replace(
            worker, instruction_file=under(pwd, worker.instruction_file)
        )
    return msgspec.structs.replace(
        m,
        pod=msgspec.structs.replace(m.pod, pwd=pwd),
        worker=worker,
        hooks=hooks,
        mcp=msgspec.structs.replace(m.mcp, servers=servers),
        scope=msgspec.structs.replace(
            m.scope, allow=rules(m.scope.allow), deny=rules(m.scope.deny)
        ),
        source=source,
    )
