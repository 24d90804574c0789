"""What every builtin tool shares: the context it runs in, its outcome, argument checking,
output capping and `execute`, the one entry point that turns any failure into a tool error."""

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import msgspec

from poddaemon.scope import Access, Rule, ScopeDenied
from poddaemon.tools.denied import DeniedObjects
from poddaemon.tools.fsopen import open_resolved, opened_path

if TYPE_CHECKING:
    from poddaemon.tools.runner_client import CommandRunner


class ScopeLike(Protocol):
    """The part of `poddaemon.scope.Scope` the tools use."""

    def check(self, path: str, want: Access, cwd: str) -> str: ...

    def access(self, path: str) -> Access: ...

    @property
    def deny(self) -> tuple[Rule, ...]: ...


class FileStamp(NamedTuple):
    """What a file looked like when the model last read (or wrote) it."""

    mtime_ns: int
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileStamp":
        return cls(st.st_mtime_ns, st.st_size)


class ToolOutputLimits(msgspec.Struct):
    default_max_bytes: int = 16384
    per_tool: dict[str, int] = msgspec.field(default_factory=dict)

    def max_bytes(self, tool: str) -> int:
        return self.per_tool.get(tool, self.default_max_bytes)


class PodHost(Protocol):
    """What the pod tools (spawn_pod, …) act on: the pod's children (poddaemon/spawn.py).
    Each method raises ToolError with the message the model should see."""

    async def spawn(self, args: dict[str, Any]) -> dict[str, Any]: ...

    async def send(self, pod: str, message: str, mode: str) -> dict[str, Any]: ...

    async def wait(self, pods: list[str] | None, timeout: float) -> dict[str, Any]: ...

    async def list_children(self) -> list[dict[str, Any]]: ...

    async def stop(self, pod: str) -> dict[str, Any]: ...


def _identities(paths: tuple[str, ...]) -> tuple[tuple[int, int] | None, ...]:
    """Which file each path names now: (device, inode), None if there is none."""
    found: list[tuple[int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            found.append(None)
        else:
            found.append((st.st_dev, st.st_ino))
    return tuple(found)


class ToolContext(msgspec.Struct):
    scope: ScopeLike
    pwd: str
    limits: ToolOutputLimits = msgspec.field(default_factory=ToolOutputLimits)
    # resolved absolute path -> stamp at the model's last read or write of it
    reads: dict[str, FileStamp] = msgspec.field(default_factory=dict)
    # credential-like variables commands may still see (`[worker] env_passthrough`)
    env_passthrough: tuple[str, ...] = ()
    # variables commands never see unless passed through, whatever their names: the providers'
    # API keys (`api_key_env = "MY_KEY"` matches no credential-like pattern)
    env_hidden: tuple[str, ...] = ()
    # JSON for `poddaemon.sandbox.apply_policy`, applied by the command runner (issue 13)
    sandbox_policy: bytes | None = None
    # the pod's children, for the pod tools (None: this pod cannot spawn)
    host: PodHost | None = None
    # Rebuilds `sandbox_policy` from the pod's live scope (set by the sandbox wiring): when
    # delegation to a child changes the scope, later commands lose (or regain) those areas.
    policy_for_scope: Callable[[], bytes | None] | None = None
    # the deny targets by identity: moved or hard-linked elsewhere, still denied (denied.py)
    denied: DeniedObjects = msgspec.field(default_factory=DeniedObjects)
    # The hooks' policy (`hook_runner`) for the transcript a hook is given (None: hooks run in
    # the commands' runner, as when there is no sandbox).
    policy_for_hooks: Callable[[str], bytes | None] | None = None
    # files the policy grants by name (hook scripts): a runner's grant holds the file there at
    # its start, so one saved anew since (renamed over) is run by a new runner
    granted_files: tuple[str, ...] = ()
    # what the latest runner's sandbox could not do where it runs (no mount namespace: file
    # metadata outside the scope unprotected), known once it started; for `status`
    runner_notes: list[str] = msgspec.field(default_factory=list)
    _runner: "CommandRunner | None" = None
    _runner_lock: asyncio.Lock = msgspec.field(default_factory=asyncio.Lock)
    _runner_stale: bool = False
    # What granted_files named when sandbox_policy was built (None: before the first command,
    # the pod's start-up policy, whose links may have been repointed since). Taken before the
    # build: a file replaced meanwhile is seen at the next command.
    _policy_files: tuple[tuple[int, int] | None, ...] | None = None
    _retired: "list[CommandRunner]" = msgspec.field(default_factory=list)
    _hook_runner: "CommandRunner | None" = None
    # What the hooks' runner was built for: (transcript, identities of it and granted_files).
    _hook_key: tuple[str, tuple[tuple[int, int] | None, ...]] | None = None
    _hook_runner_stale: bool = False  # the scope changed since it started
    _closing: "set[asyncio.Task[None]]" = msgspec.field(default_factory=set)

    def __post_init__(self) -> None:
        self._note_denies()

    def _note_denies(self) -> bool:
        """Record what the deny targets are now (see denied.py); whether there are any."""
        denies = getattr(self.scope, "deny", ())  # (test doubles may have none)
        if denies or self.denied:
            self.denied.note(denies)
        return bool(self.denied)

    def scope_changed(self) -> None:
        """The live scope changed: the next command starts in a runner with the new policy
        (commands run one at a time, so none is cut short)."""
        self._note_denies()
        if self.policy_for_scope is not None:
            self._policy_files = _identities(self.granted_files)
            self.sandbox_policy = self.policy_for_scope()
            self._runner_stale = True
            self._hook_runner_stale = True

    async def command_runner(self) -> "CommandRunner":
        """The helper process that starts this pod's commands, started at first use (and again
        if it died, or when the scope it was confined to changed). Called for every command
        (bash; hooks through `hook_runner`): what the deny targets are just before one runs is
        recorded, so a target made or replaced since, renamed by the command, stays denied to
        the file tools."""
        self._note_denies()
        async with self._runner_lock:
            files = _identities(self.granted_files)
            if (
                self.granted_files
                and files != self._policy_files
                and self.policy_for_scope is not None
            ):
                # Another file at a granted name than when the policy was built (a link
                # repointed too: the policy follows it now). The commands still running in the
                # old runner finish there, then it goes (a scope change, below, cuts them short).
                self.sandbox_policy = self.policy_for_scope()
                self._policy_files = files
                if self._runner is not None and self._runner.alive:
                    self._retire(self._runner)
                self._runner = None
            if self._runner is None or not self._runner.alive or self._runner_stale:
                if self._runner_stale:  # none may keep the wider access: retired ones too
                    for old in list(self._retired):
                        await old.aclose()
                self._runner_stale = False
                if self._runner is not None:
                    await self._runner.aclose()
                self._runner = await self._start_runner(self.sandbox_policy)
                self.runner_notes = self._runner.notes  # what status says of the commands'
            return self._runner

    async def _start_runner(self, policy: bytes | None) -> "CommandRunner":
        from poddaemon.tools.runner_client import CommandRunner, clean_env

        env = clean_env(os.environ, self.env_passthrough, self.env_hidden)
        return await CommandRunner.start(env, policy)

    async def hook_runner(self, transcript: str) -> "CommandRunner":
        """The runner hooks run in: the commands' sandbox plus reading `transcript`, the session
        log a hook is given (Claude Code's `transcript_path`), which the pod's own commands
        (bash) never get. Not the directory of sessions: other pods' logs stay unreadable. A
        runner of its own, started anew for another transcript (a new session: compaction, a
        fork), another file at its name or a granted one's, or a new scope."""
        if self.policy_for_hooks is None:
            return await self.command_runner()
        self._note_denies()
        async with self._runner_lock:
            key = (transcript, _identities((transcript, *self.granted_files)))
            old, stale = self._hook_runner, self._hook_runner_stale
            if old is not None and old.alive and key == self._hook_key and not stale:
                return old
            self._hook_runner = None
            if stale:  # none may keep the wider access: retired ones too
                for runner in [*self._retired, *([old] if old is not None else [])]:
                    await runner.aclose()
            elif old is not None:
                self._retire(old)  # its hooks finish reading the transcript they were given
            self._hook_runner_stale = False
            self._hook_key = key
            self._hook_runner = await self._start_runner(self.policy_for_hooks(transcript))
            return self._hook_runner

    def _retire(self, runner: "CommandRunner") -> None:
        """Close `runner` once the commands it runs are done."""
        self._retired.append(runner)

        async def close_when_idle() -> None:
            try:
                await runner.idle()
            finally:
                await runner.aclose()
                if runner in self._retired:
                    self._retired.remove(runner)

        task = asyncio.ensure_future(close_when_idle())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Stop the command runner, if any: every command still running is killed."""
        async with self._runner_lock:
            runners, self._retired = self._retired, []
            for runner in (self._runner, self._hook_runner):
                if runner is not None:
                    runners.append(runner)
            self._runner = self._hook_runner = None
            for runner in runners:
                await runner.aclose()

    def check(self, path: str, want: Access) -> str:
        """The resolved absolute path, or ScopeDenied. Call before touching the filesystem."""
        if "\0" in path:  # no file has one (the OS would refuse it as an "internal error")
            raise ToolError(f"invalid path {path!r}: it contains a NUL byte")
        return self.scope.check(path, want, self.pwd)

    def open_checked(self, resolved: str, want: Access, flags: int) -> int:
        """Open a path `check` returned, following no symlink (one found now means the tree
        changed since the check: OSError ELOOP), then check what was actually opened."""
        fd = open_resolved(resolved, flags)
        try:
            self.check_opened(fd, want)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_plain(self, given: str, want: Access, flags: int) -> tuple[int, str] | None:
        """The model's path opened at once, and its resolved path, when it is plain: no `..`
        in it and no symlink on the way (the open follows none), so it is its own resolution,
        and the check of what was opened (as `open_checked` makes it) is the whole check.
        That spares `check`'s walk, an lstat per component of a path the open walks anyway.
        None for anything else (a symlink, `..`, a path that does not open, is out of scope or
        was moved meanwhile): the caller takes the long way, `check` then `open_checked`,
        whose errors say what is wrong. Not for O_CREAT, nor for what may be a FIFO or a
        device: opening those acts on them before they can be looked at."""
        if "\0" in given or ".." in given.split("/"):
            return None
        path = os.path.normpath(os.path.join(self.pwd, given))
        try:
            fd = open_resolved(path, flags)
        except OSError:
            return None
        try:
            # The kernel's name for it is the path itself, unless a rename moved it meanwhile.
            if opened_path(fd) == path:
                self.check_opened(fd, want, where=path)
                return fd, path
        except ScopeDenied:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def check_opened(self, fd: int, want: Access, name: str = "", where: str | None = None) -> None:
        """ScopeDenied unless the object behind `fd` (or its entry `name`, for a directory fd)
        is, where it is now, within scope. `where`: the kernel's name for `fd`, if read already."""
        where = opened_path(fd) if where is None else where
        actual = os.path.join(where, name) if name else where
        has = self.scope.access(actual)
        if has < want:
            raise ScopeDenied(actual, want, has)
        if self._note_denies():  # a target made or replaced since: recorded too
            self.denied.check(fd, name, where, want)

    def denied_caps(self) -> Callable[[str], Access | None]:
        """What the deny rules cap at a resolved path by identity, for a walk over many
        (DeniedObjects.walker), the deny targets recorded as they are now."""
        self._note_denies()
        return self.denied.walker()

    def refuse_if_denied(
        self, resolved: str, want: Access, caps: Callable[[str], Access | None]
    ) -> None:
        """ScopeDenied if `caps` (denied_caps) gives the object at `resolved` less than `want`:
        a denied entry moved or linked there, named as the base of a walk."""
        cap = caps(resolved)
        if cap is not None and cap < want:
            raise ScopeDenied(f"{resolved} (a denied entry moved or linked there)", want, cap)

    def display(self, resolved: str) -> str:
        """A path as the model should see it: relative to pwd when inside it, its control
        characters escaped."""
        rel = os.path.relpath(resolved, self.pwd)
        if rel == os.curdir:
            return "."
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            return escape_controls(resolved)
        return escape_controls(rel)


class ToolOutcome(msgspec.Struct, kw_only=True):
    output: str
    is_error: bool = False
    summary: str = ""
    # Lines said after the output, never cut with it ("showing 1000 of 30,000 entries"): a
    # listing cut to the byte limit would otherwise hide why it stops.
    note: str = ""


class ToolError(Exception):
    """A failure the model should see as the tool's result (its text is the whole message)."""


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome: ...


T = TypeVar("T")


class Stop:
    """What a tool's worker thread looks at between files, lines or entries: asyncio cannot
    stop the thread when the tool call is cancelled (`cancelled`, and then a cancelled run's pod
    can exit), and a search on a huge tree may be given a time limit (`stopped` looks at both)."""

    def __init__(self, seconds: float | None = None) -> None:
        self.cancelled = False
        self.timed_out = False
        self._deadline = None if seconds is None else time.monotonic() + seconds

    def stopped(self) -> bool:
        """Cancelled, or out of the time given (then `timed_out` stays set)."""
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self.timed_out = True
        return self.cancelled or self.timed_out


# The file tools' own worker threads. A read on a hung mount (NFS, FUSE) cannot be stopped, and
# its cancelled call's thread stays: in asyncio's default executor (6 threads on 2 cores) a few
# such calls left none for the pod's own `to_thread` (its session log's), which then waited for
# ever. Here they can only use up these, and then a tool call is refused at once.
TOOL_THREADS = 4
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_abandoned: set["concurrent.futures.Future[Any]"] = set()  # cancelled calls still running


async def in_thread(fn: Callable[..., T], *args: Any, stop: Stop | None = None) -> T:
    """`fn(*args, stop)` in a tool worker thread, told to stop when this call is cancelled;
    ToolError when every one of them is held by a cancelled call that does not stop."""
    global _pool
    stop = stop or Stop()
    _abandoned.difference_update([f for f in _abandoned if f.done()])
    if len(_abandoned) >= TOOL_THREADS:
        raise ToolError(
            f"earlier tool calls are still stuck in the filesystem ({len(_abandoned)} cancelled "
            "calls whose reads have not returned: a hung mount?); try again later"
        )
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tool")
    work = _pool.submit(fn, *args, stop)
    try:
        return await asyncio.wrap_future(work)
    except asyncio.CancelledError:
        stop.cancelled = True
        if not work.cancel():  # running: it may stop soon, or never
            _abandoned.add(work)
        raise


def schema(
    required: dict[str, tuple[str, str]], optional: dict[str, tuple[str, str]] | None = None
) -> dict[str, Any]:
    """A terse JSON schema for an object: name -> (JSON type, short description)."""
    props = {
        name: {"type": typ, "description": desc}
        for name, (typ, desc) in (required | (optional or {})).items()
    }
    return {"type": "object", "properties": props, "required": list(required)}


def cap_output(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8 (never inside a character), plus a marker."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    head = data[:max_bytes].decode("utf-8", "ignore")
    return f"{head}\n[output truncated: {len(data)} bytes, showing the first {max_bytes}]"


# C0 controls and DEL, written as `ls -b` writes them: a newline in a file name split it into
# two lines of a listing, two names that are not there (and could forge a line of grep's).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {9: "\\t", 10: "\\n", 13: "\\r"}


def escape_controls(name: str) -> str:
    """A file name with its control characters escaped (`a\\nb` for a, newline, b)."""
    # isprintable() is false for every C0 control and DEL: the common name skips translate(),
    # whose per-character dict lookups took list_dir over 40 names from 1.23x to 1.58x.
    return name if name.isprintable() else name.translate(_CONTROLS)


def printable_utf8(text: str) -> str:
    """`text` made encodable as UTF-8: the session log and the wire cannot hold a lone
    surrogate, and a file name that is not UTF-8 comes back from the OS as one (byte 0xE9 as
    U+DCE9). Such bytes are shown as `\\xe9`, as `ls -b` would; any other lone surrogate as
    `\\udXXX`."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_args(params: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Args checked against a flat object schema; absent or null optional fields are dropped.
    Raises ToolError naming the offending field."""
    props: dict[str, Any] = params.get("properties", {})
    required: list[str] = params.get("required", [])
    out: dict[str, Any] = {}
    for name in required:
        if args.get(name) is None:
            raise ToolError(f"missing required argument: {name}")
    for name, value in args.items():
        prop = props.get(name)
        if prop is None:
            raise ToolError(f"unknown argument: {name} (expected: {', '.join(props)})")
        if value is None:
            continue
        typ = prop.get("type", "string")
        if typ == "integer" and isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, _JSON_TYPES[typ]) and (
            typ == "boolean" or not isinstance(value, bool)
        )
        if not ok:
            article = "an" if typ[0] in "aeiou" else "a"  # an integer, an array, an object
            raise ToolError(f"argument {name} must be {article} {typ}, got {_json_type(value)}")
        out[name] = value
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    for name, types in _JSON_TYPES.items():
        if name != "number" and isinstance(value, types):
            return name
    return "number" if isinstance(value, float) else type(value).__name__


def _os_error_text(e: OSError) -> str:
    text = e.strerror or str(e)
    if e.filename is not None:
        text += f": {_path_shown(os.fsdecode(e.filename))}"
    if e.filename2 is not None:
        text += f" -> {_path_shown(os.fsdecode(e.filename2))}"
    return text


PATH_SHOWN = 200  # characters of a path an error quotes at each end (ENAMETOOLONG's: 6 KB)


def _path_shown(path: str) -> str:
    if len(path) <= 2 * PATH_SHOWN:
        return path
    return f"{path[:PATH_SHOWN]}…{path[-PATH_SHOWN:]} ({len(path)} characters)"


def _error(text: str) -> ToolOutcome:
    first = text.splitlines()[0] if text else "error"
    if len(first) > 100:
        first = first[:99] + "…"
    return ToolOutcome(output=text, is_error=True, summary=first)


# Deeper than any real tool's arguments; far below the interpreter's recursion limit, so
# neither decoding nor anything that walks the value later can overflow the stack.
MAX_ARGUMENT_DEPTH = 64


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether a decoded value nests more than `limit` lists/dicts deep. Iterative: it must
    not recurse on exactly the values that would overflow the stack."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def decode_arguments(arguments: str) -> Any:
    """A tool call's raw JSON arguments decoded, or ToolError with the reason the model sees.
    msgspec raises RecursionError past ~1000 levels, which used to escape as a crash of the
    whole run; shallower but still absurd nesting is refused too, before anything recurses on it."""
    too_deep = f"arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels"
    if not arguments.strip():
        return {}
    try:
        value = msgspec.json.decode(arguments)
    except RecursionError:
        raise ToolError(too_deep) from None
    except (msgspec.DecodeError, UnicodeError) as e:  # (a lone surrogate: UnicodeEncodeError)
        raise ToolError(f"arguments are not valid JSON: {e}") from None
    if isinstance(value, dict | list) and _depth_exceeds(value, MAX_ARGUMENT_DEPTH):
        raise ToolError(too_deep)
    return value


def args_preview(arguments: str) -> Any:
    """The arguments for an event (`tool.started`): decoded when that is safe, else the raw
    text. Never raises."""
    try:
        return decode_arguments(arguments)
    except ToolError:
        return arguments


# How much of an unknown tool name its error repeats.
MAX_NAME_SHOWN = 200


async def _run(tool: Tool, name: str, arguments: str, ctx: ToolContext) -> ToolOutcome:
    """`tool` called with the raw `arguments`: its outcome, or the error the model sees."""
    try:
        raw = decode_arguments(arguments)
    except ToolError as e:
        return _error(str(e))
    if not isinstance(raw, dict):
        return _error(f"arguments must be a JSON object, got {_json_type(raw)}")
    try:
        # MCP tools' schemas go beyond check_args' flat types; their servers validate.
        own = getattr(tool, "validates_own_args", False)
        args = raw if own else check_args(tool.parameters, raw)
        return await tool.run(ctx, args)
    except ScopeDenied as e:
        return _error(str(e))
    except ToolError as e:
        return _error(str(e))
    except OSError as e:
        return _error(_os_error_text(e))
    except Exception as e:
        return _error(f"internal error in {name}: {type(e).__name__}: {e}")


async def execute(
    name: str,
    arguments: str,
    ctx: ToolContext,
    tools: Mapping[str, Tool] | None = None,
) -> ToolOutcome:
    """Run one tool call. Never raises except CancelledError: every failure becomes an
    `is_error` outcome the model sees. `tools` defaults to the builtin tools."""
    if tools is None:
        from poddaemon.tools import BUILTIN

        tools = BUILTIN
    tool = tools.get(name)
    if tool is None:
        # The name is the model's: a megabyte of it came back whole, past every output cap,
        # into the log and every later request (and the list of names was lost after it).
        shown = name if len(name) <= MAX_NAME_SHOWN else name[: MAX_NAME_SHOWN - 1] + "…"
        outcome = _error(f"unknown tool: {shown} (available: {', '.join(sorted(tools))})")
    else:
        outcome = await _run(tool, name, arguments, ctx)
    if not getattr(tool, "caps_own_output", False):
        outcome.output = cap_output(outcome.output, ctx.limits.max_bytes(name))
    if outcome.note:
        outcome.output = f"{outcome.output}\n{outcome.note}"
    outcome.output = printable_utf8(outcome.output)
    outcome.summary = printable_utf8(outcome.summary)
    return outcome
