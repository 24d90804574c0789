"""The pod manifest (SPEC §3) as msgspec Structs, plus a writer back to TOML.

Structs validate themselves in `__post_init__`, so a Manifest built in code obeys the same rules as
one loaded from a file. Problems are raised as `FieldError`, which names the offending field
relative to the Struct; the loader turns that into `<file>:<line>: <dotted.field>: <problem>`.
"""

import math
import os
import re
from typing import Annotated, Any, Literal, NamedTuple

from msgspec import Meta, Struct, field

from protocol.paths import pod_name_problem

FILE_TOOLS = ("read_file", "write_file", "edit_file", "list_dir", "glob", "grep")
POD_TOOLS = ("spawn_pod", "send_to_pod", "wait_pods", "list_pods", "stop_pod")
KNOWN_TOOLS = frozenset(
    (*FILE_TOOLS, "bash", *POD_TOOLS),
)

PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
# What the pod's event loop waits on itself (hooks, MCP servers): `inf` or 1e300 raised an
# OverflowError in its timers and ended the pod. A week is longer than anyone means.
MAX_TIMEOUT = 7 * 24 * 3600.0
Timeout = Annotated[float, Meta(gt=0, le=MAX_TIMEOUT)]


class FieldError(ValueError):
    """A rule broken by one field; `field` is dotted and relative to the Struct that raised it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def _check_path(field: str, value: str) -> None:
    """A path the kernel can take: TOML's `\\u0000` made one that every os call refuses with a
    ValueError, a traceback at start-up instead of a line naming the field."""
    if not value:
        raise FieldError(field, "must not be empty")
    if "\0" in value:
        raise FieldError(field, f"{value!r} contains a NUL character")


class PodSection(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    pwd: str = "."

    def __post_init__(self) -> None:
        if problem := pod_name_problem(self.name):
            raise FieldError("name", problem)
        _check_path("pwd", self.pwd)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ProviderConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    kind: Literal["anthropic", "openai", "openai_responses"]
    model: str
    base_url: str | None = None
    api_key_env: str | None = None
    max_retries: NonNegativeInt = 4
    connect_timeout: PositiveFloat = 10.0
    first_byte_timeout: PositiveFloat = 120.0
    stream_idle_timeout: PositiveFloat = 120.0
    retry_initial_delay: PositiveFloat = 0.5
    retry_max_delay: PositiveFloat = 30.0
    retry_total_timeout: PositiveFloat = 300.0

    def __post_init__(self) -> None:
        if not self.model:
            raise FieldError("model", "must not be empty")
        if self.base_url is not None and not self.base_url.strip():
            # Empty is unset, as start-up's checks took it (`--set provider.base_url=` undoes
            # a defaults.toml one): the SDK was given "" and every call failed, unannounced.
            self.base_url = None
        if self.api_key_env is not None and not self.api_key_env:
            raise FieldError("api_key_env", "must not be empty")
        if self.api_key_env and not _ENV_NAME.fullmatch(self.api_key_env):
            # (it said "MY KEY is not set", with the key in the environment as MY_KEY)
            raise FieldError(
                "api_key_env",
                f"{self.api_key_env!r} is no environment variable's name "
                "(letters, digits and _, not starting with a digit)",
            )

    @property
    def api_key_var(self) -> str:
        """The environment variable with the API key: the configured one, else the kind's."""
        if self.api_key_env:
            return self.api_key_env
        return "ANTHROPIC_API_KEY" if self.kind == "anthropic" else "OPENAI_API_KEY"


class ToolOutputConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    default_max_bytes: PositiveInt = 16384
    per_tool: dict[str, int] = {}

    def __post_init__(self) -> None:
        # Checked here rather than with Meta so the message can name the tool.
        for tool, limit in self.per_tool.items():
            # `<server>__<tool>` names an MCP tool; Manifest checks that the server exists.
            if tool not in KNOWN_TOOLS and MCP_SEP not in tool:
                raise FieldError(f"per_tool.{tool}", f"unknown tool {tool!r}")
            if limit <= 0:
                raise FieldError(f"per_tool.{tool}", f"expected int >= 1, got {limit}")


class WorkerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    instruction: str | None = None
    instruction_file: str | None = None
    max_tokens: PositiveInt = 4096
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    max_turns: PositiveInt = 50
    # A `run` input or `notify` message larger than this is refused (-32602), and a model
    # request carries at most this much of the notifications waiting (the rest follow in the
    # next round). Once delivered, an input stays in the context: one too large for the
    # model's window failed every later run, and every compaction's summary, for good.
    max_input_bytes: PositiveInt = 262144
    # Runs waiting behind the active one; past it a `run` is refused (-32002), as `notify` is
    # past `[notify] max_pending`. Each holds its input in memory until it starts: a script
    # sending `podctl send --no-wait` in a loop grew the pod without bound.
    max_queued_runs: PositiveInt = 1000
    tools: list[str] = field(default_factory=lambda: list(FILE_TOOLS))
    tool_output: ToolOutputConfig = field(default_factory=ToolOutputConfig)
    # Credential-like variables (*_API_KEY, *TOKEN*, *SECRET*, *PASSWORD*) commands may see.
    env_passthrough: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i, name in enumerate(self.env_passthrough):
            if not name or "=" in name:
                raise FieldError(f"env_passthrough[{i}]", f"not a variable name: {name!r}")
        # Neither is fine (an empty instruction); both is ambiguous.
        if self.instruction is not None and self.instruction_file is not None:
            raise FieldError(
                "instruction_file", "instruction and instruction_file are exclusive; set only one"
            )
        if self.instruction_file is not None:
            _check_path("instruction_file", self.instruction_file)
        seen: set[str] = set()
        for i, tool in enumerate(self.tools):
            if tool not in KNOWN_TOOLS:
                raise FieldError(
                    f"tools[{i}]",
                    f"unknown tool {tool!r} (known: {', '.join(sorted(KNOWN_TOOLS))})",
                )
            if tool in seen:
                raise FieldError(f"tools[{i}]", f"tool {tool!r} is listed twice")
            seen.add(tool)


class ScopeRule(Struct, kw_only=True, forbid_unknown_fields=True):
    target: str
    permission: Literal["read", "write"]
    recursive: bool = True

    def __post_init__(self) -> None:
        _check_path("target", self.target)


class ScopeSection(Struct, kw_only=True, forbid_unknown_fields=True):
    allow: list[ScopeRule] = []
    deny: list[ScopeRule] = []


class CompactionConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    compact_threshold: PositiveInt = 120000
    compact_retained_turns: NonNegativeInt = 2
    provider: ProviderConfig | None = None  # None: the pod's own provider


class BudgetConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    max_total_tokens: PositiveInt | None = None


class NotifyConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    max_pending: PositiveInt = 1000


class SpawnConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    on_parent_exit: Literal["stop", "detach"] = "stop"
    max_children: NonNegativeInt = 8  # live children at once
    max_depth: NonNegativeInt = 3  # levels of the tree below this pod


class SandboxConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["enforce", "best_effort", "off"] = "enforce"
    network: bool = True  # False: commands the pod starts get no network


# A command's first word when it names a file by path (`./hooks/guard.sh --strict`): no quotes,
# expansions or operators in it, so it can be made absolute and granted as one file.
_WORD = r"[^\s'\"\\$`;&|<>(){}*?\[\]#]"  # a character that needs no quoting in sh
# (These are for hooks only: compiled, and cached by `re`, at first use, not at every start.)
_SCRIPT = rf"\s*(~?(?:(?![~=]){_WORD})*/{_WORD}*)(?=\s|$)"
# ... or single-quoted, as `shlex.quote` writes a path with a space (the resolved manifest does)
_QUOTED_SCRIPT = r"\s*'((?!~)[^']*/[^']*)'(?=\s|$)"
# ... or the second word, after an interpreter that runs it: `bash ./guard.sh`, `python3 g/x.py`
# The interpreter may be named by its path and given options (`/usr/bin/python3 -u g.py`):
# read as the script itself, or stopped at an option, it left the real script unchecked and
# ungranted, and a Python hook outside the scope exited 2 ("can't open file"), which from a
# Stop hook blocked every final answer until max_turns. (A relative path, `./venv/bin/python`,
# stays the script itself, made absolute against pwd as before.)
_INTERPRETERS = r"sh|bash|dash|zsh|python3?(?:\.\d+)?|node|perl|ruby"
_INTERPRETER = (
    rf"\s*(?P<dir>(?:/{_WORD}*/|/)?)(?P<name>{_INTERPRETERS})\s+"
    r"(?P<options>(?:--?[A-Za-z][A-Za-z-]*\s+)*)"
)
# The options after which the next word is code or a module, not a script (`sh -c ./g.sh`)
_CODE_OPTIONS = {
    "sh": "c",
    "bash": "c",
    "dash": "c",
    "zsh": "c",
    "python": "cm",
    "node": "ep",
    "perl": "eE",
    "ruby": "e",
}
_CODE_LONG_OPTIONS = ("--eval", "--print", "--command")


def script_start(command: str) -> int | None:
    """Where a hook command's script word may start: 0, or after an interpreter and its
    options; None when an option makes the next word code (`sh -c`, `python3 -m`)."""
    found = re.match(_INTERPRETER, command)
    if found is None:
        return 0
    if any(_code_option(found["name"], option) for option in found["options"].split()):
        return None
    return found.end()


def _code_option(interpreter: str, option: str) -> bool:
    """Does `option` make the next word code or a module (`sh -c`, `python3 -Bm`, `--eval`)?"""
    code = _CODE_OPTIONS[interpreter.rstrip("0123456789.")]
    if option.startswith("--"):
        return option in _CODE_LONG_OPTIONS
    return any(c in code for c in option[1:])


def _interpreter_options(command: list[str]) -> tuple[str, list[str], str | None] | None:
    """An interpreter's argument vector read as `script_start` reads a hook's: (the
    interpreter, its options up to the first that makes the next word code, the word after
    them: its script unless such an option came last); None when `command[0]` is none."""
    interpreter = os.path.basename(command[0])
    if not re.fullmatch(_INTERPRETERS, interpreter):
        return None
    options: list[str] = []
    for word in command[1:]:
        if not word.startswith("-"):
            return interpreter, options, word
        options.append(word)
        if _code_option(interpreter, word):
            break
    return interpreter, options, None


def argv_script(command: list[str]) -> str | None:
    """The script an interpreter runs in an argument vector (a stdio MCP server's
    `["python3", "-u", "/srv/mcp.py"]`: its first word after the options), as `script_start`
    finds a hook's; None when `command[0]` is no interpreter or an option makes the next word
    code (`python3 -m srv`)."""
    read = _interpreter_options(command)
    return None if read is None else read[2]


# Package runners: what they run comes first from the project in their working directory (its
# node_modules, package.json or pyproject.toml, .npmrc or uv.toml).
_RUNNERS = frozenset(("npx", "pnpx", "bunx", "uvx", "npm", "pnpm", "yarn", "bun", "uv"))


def loads_from_cwd(command: list[str]) -> bool:
    """Does `command` run code from its working directory that it names by no file? `python3 -m`
    or `-c` (Python puts the cwd first on sys.path: a module there, or one named as one of the
    standard library's, is what it imports; not with -P or -I), `sh -c`, `node -e` and the
    like (their code's relative names are the cwd's), and package runners (`npx`, `uvx`)."""
    if os.path.basename(command[0]) in _RUNNERS:
        return True
    read = _interpreter_options(command)
    if read is None or not read[1]:
        return False
    interpreter, options, _ = read
    if interpreter.startswith("python") and any(
        not o.startswith("--") and ("P" in o or "I" in o) for o in options
    ):
        return False  # the cwd is not on sys.path
    return _code_option(interpreter, options[-1])


def _interpreter_path(command: str) -> str | None:
    """The interpreter's own word when it is a path (`/usr/bin/python3 g.py`), else None."""
    found = re.match(_INTERPRETER, command)
    return found["dir"] + found["name"] if found is not None and found["dir"] else None


_PLAIN_NAMES = re.compile(r"[\w|-]+", re.ASCII)  # a matcher of names, as hooks._NAMES


class Script(NamedTuple):
    """The file a hook command runs, and where its word is in the command (quotes included)."""

    start: int
    end: int
    path: str
    direct: bool  # run itself (so it must be executable), not by an interpreter before it
    interpreter: str | None = None  # the interpreter running it, when named by a path


class HookConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """One `[[hooks.<Event>]]` entry (SPEC §10, Claude Code's contract)."""

    command: str  # run with `sh -c`, cwd = pwd, inside the sandbox, JSON on stdin
    matcher: str | None = None  # tool names or a regex (PreToolUse / PostToolUse): hooks.matches
    timeout: Timeout = 60.0  # seconds; then the hook's process group is killed

    def script(self) -> str | None:
        """The file the command runs when its first word is a path, or the second after an
        interpreter (`bash ./guard.sh`); else None."""
        found = self.script_word()
        return found.path if found else None

    def script_word(self) -> Script | None:
        at = script_start(self.command)
        if at is not None:
            direct = at == 0
            interpreter = None if direct else _interpreter_path(self.command)
            if found := re.compile(_SCRIPT).match(self.command, at):
                return Script(found.start(1), found.end(1), found.group(1), direct, interpreter)
            if found := re.compile(_QUOTED_SCRIPT).match(self.command, at):
                start, end = found.start(1) - 1, found.end(1) + 1
                return Script(start, end, found.group(1), direct, interpreter)
        if at != 0 and (found := re.match(_SCRIPT, self.command)):
            # No script after it (`/opt/py/bin/python3 -c …`): the interpreter, named by its
            # path, is the file that runs.
            return Script(found.start(1), found.end(1), found.group(1), True)
        return None

    def __post_init__(self) -> None:
        if not self.command.strip():
            raise FieldError("command", "must not be empty")
        if "\0" in self.command:  # `sh -c` could not be given it
            raise FieldError("command", f"{self.command!r} contains a NUL character")
        if self.matcher not in (None, "", "*"):  # those two match every tool
            assert self.matcher is not None
            try:
                re.compile(self.matcher)
            except re.error as exc:
                raise FieldError("matcher", f"not a valid regular expression: {exc}") from None


def _check_tool_names(field: str, matcher: str | None) -> None:
    """A matcher of plain names (matched exactly, hooks.matches) must name tools: one no tool
    has made a guard that never ran, silently (Claude Code's "Bash" here, where it is "bash")."""
    if matcher is None or not _PLAIN_NAMES.fullmatch(matcher):
        return
    for name in matcher.split("|"):
        server, _, tool = name.partition(MCP_SEP)
        if server == "mcp" and MCP_SEP in tool:
            # Claude Code's name for an MCP tool (mcp__<server>__<tool>), which no tool here
            # has: passed as an MCP name (it has a "__"), the guard never ran, silently.
            raise FieldError(
                field,
                f"no tool is named {name!r}: MCP tools are <server>__<tool> here, without "
                f"Claude Code's mcp__ prefix ({tool!r})",
            )
        if name not in KNOWN_TOOLS and MCP_SEP not in name:
            raise FieldError(
                field,
                f"no tool is named {name!r} (known: {', '.join(sorted(KNOWN_TOOLS))}; MCP "
                "tools are <server>__<tool>)",
            )


class HooksSection(Struct, kw_only=True, forbid_unknown_fields=True, rename=None):
    SessionStart: list[HookConfig] = []
    UserPromptSubmit: list[HookConfig] = []
    PreToolUse: list[HookConfig] = []
    PostToolUse: list[HookConfig] = []
    Notification: list[HookConfig] = []
    Stop: list[HookConfig] = []
    SubagentStop: list[HookConfig] = []
    PreCompact: list[HookConfig] = []

    def __post_init__(self) -> None:
        # A matcher elsewhere was read as "every time" (Claude Code's SessionStart "compact"
        # hook ran at every start): refused, as SPEC §10 gives matchers to tool events only.
        for event in self.__struct_fields__:
            if event in ("PreToolUse", "PostToolUse"):
                for i, hook in enumerate(getattr(self, event)):
                    _check_tool_names(f"{event}[{i}].matcher", hook.matcher)
                continue
            for i, hook in enumerate(getattr(self, event)):
                if hook.matcher not in (None, "", "*"):
                    raise FieldError(
                        f"{event}[{i}].matcher",
                        "only PreToolUse and PostToolUse hooks take a matcher (a tool name)",
                    )

    def any(self) -> bool:
        return any(getattr(self, f) for f in self.__struct_fields__)


MCP_SEP = "__"  # MCP tools are offered to the model as <server>__<tool>
_MCP_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*(?:_[A-Za-z0-9-]+)*")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class McpServerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """One `[[mcp.servers]]` entry: a stdio `command` the pod starts, or a streamable HTTP `url`.

    `env` values are kept as written (`${VAR}` unexpanded, so no secret reaches the resolved
    config on disk); the pod expands them when it starts the server.
    """

    name: str
    command: list[str] | None = None
    url: str | None = None
    env: dict[str, str] = {}
    tools: list[str] | None = None  # allow-list of the server's own tool names
    timeout: Timeout = 60.0  # seconds per call
    start_timeout: Timeout = 30.0  # seconds for start, handshake and tool list
    required: bool = False  # a server that fails to start fails the pod's start-up
    # A stdio server's working directory, relative to pod.pwd (its default); made absolute at
    # load, so a child pod, another pwd, runs its spawner's servers from the same place.
    cwd: str | None = None

    def __post_init__(self) -> None:
        # Providers accept tool names of [A-Za-z0-9_-]{1,64}; `__` separates server and tool.
        if not _MCP_NAME_RE.fullmatch(self.name) or len(self.name) > 32:
            raise FieldError(
                "name",
                f"{self.name!r} is not a valid MCP server name (letters, digits, '-' and single "
                "'_', at most 32 characters, starting with a letter or digit)",
            )
        if (self.command is None) == (self.url is None):
            raise FieldError("command", "set exactly one of command (stdio) and url (HTTP)")
        if self.command is not None:
            if not self.command:
                raise FieldError("command", "must not be empty")
            for i, arg in enumerate(self.command):
                if "\0" in arg or (i == 0 and not arg):
                    raise FieldError(f"command[{i}]", "must be a non-empty string without NUL")
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise FieldError("url", f"{self.url!r} is not an http:// or https:// URL")
            if self.env:
                raise FieldError("env", "only a stdio server (command) gets an environment")
            if self.cwd is not None:
                raise FieldError("cwd", "only a stdio server (command) has a working directory")
        for key in self.env:
            if not _ENV_NAME_RE.fullmatch(key):
                raise FieldError(f"env.{key}", f"{key!r} is not a valid environment variable name")
        if self.tools is not None:
            seen: set[str] = set()
            for i, tool in enumerate(self.tools):
                if not tool:
                    raise FieldError(f"tools[{i}]", "must not be empty")
                if tool in seen:
                    raise FieldError(f"tools[{i}]", f"tool {tool!r} is listed twice")
                seen.add(tool)


class McpSection(Struct, kw_only=True, forbid_unknown_fields=True):
    servers: list[McpServerConfig] = []

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, server in enumerate(self.servers):
            if server.name in seen:
                raise FieldError(f"servers[{i}].name", f"server {server.name!r} is listed twice")
            seen.add(server.name)


class Manifest(Struct, kw_only=True, forbid_unknown_fields=True):
    pod: PodSection
    provider: ProviderConfig
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    scope: ScopeSection = field(default_factory=ScopeSection)
    compaction: CompactionConfig | None = None  # None: never compact
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    spawn: SpawnConfig = field(default_factory=SpawnConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    mcp: McpSection = field(default_factory=McpSection)
    hooks: HooksSection = field(default_factory=HooksSection)
    # Where this manifest was loaded from; set by the loader, never a TOML key.
    source: str = ""
    # Where worker.instruction(_file) came from when not from the manifest itself (defaults.toml,
    # a --set): what a template error names. Set by the loader, never a TOML key.
    instruction_source: str = ""

    def __post_init__(self) -> None:
        if not self.scope.allow:
            raise FieldError("scope.allow", "at least one [[scope.allow]] rule is required")
        servers = {s.name for s in self.mcp.servers}
        for tool in self.worker.tool_output.per_tool:
            server = tool.split(MCP_SEP, 1)[0]
            if MCP_SEP in tool and server not in servers:
                raise FieldError(
                    f"worker.tool_output.per_tool.{tool}", f"no [[mcp.servers]] is named {server!r}"
                )

    @property
    def compaction_provider(self) -> ProviderConfig:
        """The provider compaction uses: its own if configured, else the pod's."""
        if self.compaction is not None and self.compaction.provider is not None:
            return self.compaction.provider
        return self.provider

    def named_files(self) -> list[tuple[str, str]]:
        """(field, path) of the files the pod reads or runs by path at every start: its
        instruction file, its hook scripts, its stdio MCP servers named by path or run by an
        interpreter (`python3 /srv/mcp.py`; these run outside any sandbox). Whoever may change
        one, or swap it, writes its prompt or runs code as its user."""
        named: list[tuple[str, str]] = []
        if self.worker.instruction_file is not None:
            named.append(("worker.instruction_file", self.worker.instruction_file))
        for event in self.hooks.__struct_fields__:
            for i, hook in enumerate(getattr(self.hooks, event)):
                if (script := hook.script()) is not None:
                    named.append((f"hooks.{event}[{i}].command", script))
        for i, server in enumerate(self.mcp.servers):
            if server.command is None:
                continue
            # Found by QA: only command[0] was checked, and `python3 /tmp/x/ww.py` ran a
            # world-writable script as you, where a hook `python3 /tmp/x/ww.py` was refused.
            words = [server.command[0]] if "/" in server.command[0] else []
            if (script := argv_script(server.command)) is not None:
                words.append(script)
            for word in words:
                path = os.path.join(server.cwd or self.pod.pwd, word)
                named.append((f"mcp.servers[{i}].command", path))
        return named

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the manifest, without None values and without LOADER_FIELDS."""
        return _struct_to_dict(self)

    def to_toml(self) -> str:
        """TOML text that `load_manifest` turns back into an equal Manifest (but LOADER_FIELDS)."""
        lines: list[str] = []
        _write_table(lines, (), self, "")
        return "\n".join(lines).lstrip("\n") + "\n"


LOADER_FIELDS = ("source", "instruction_source")  # Manifest fields that are no TOML keys


def _struct_to_dict(s: Struct) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in s.__struct_fields__:
        value = getattr(s, name)
        if value is None or (isinstance(s, Manifest) and name in LOADER_FIELDS):
            continue
        if isinstance(value, Struct):
            out[name] = _struct_to_dict(value)
        elif isinstance(value, list):
            out[name] = [_struct_to_dict(v) if isinstance(v, Struct) else v for v in value]
        elif isinstance(value, dict):
            out[name] = dict(value)
        else:
            out[name] = value
    return out


# --- a tiny TOML writer for our own shapes ---------------------------------------------------
# Structs become [tables], lists of Structs [[arrays of tables]], dicts inline tables.

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _string(k)


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _is_struct_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, Struct) for x in v)


def _write_table(lines: list[str], path: tuple[str, ...], s: Struct, header: str) -> None:
    own: list[str] = []
    children: list[tuple[str, Any]] = []
    for name in s.__struct_fields__:
        value = getattr(s, name)
        if value is None or (isinstance(s, Manifest) and name in LOADER_FIELDS):
            continue
        if isinstance(value, Struct) or _is_struct_list(value):
            children.append((name, value))
        else:
            own.append(f"{_key(name)} = {_value(value)}")
    # An [[array]] header makes an item, so it always stays; an empty [table] says nothing.
    if header and (own or header.startswith("[[")):
        lines.extend(["", header])
    lines.extend(own)
    for name, value in children:
        sub = (*path, name)
        dotted = ".".join(_key(p) for p in sub)
        if isinstance(value, Struct):
            _write_table(lines, sub, value, f"[{dotted}]")
        else:
            for item in value:
                _write_table(lines, sub, item, f"[[{dotted}]]")
