"""`podctl unit install|remove`: a pod as a systemd user service (SPEC §7).

The unit runs this installation's own `poddaemon` (an absolute path: a unit must not depend on
PATH or on a `~/.local/bin` that no install created) with `--resume`, so every restart continues
the pod's session and processes what it had acknowledged. `Type=notify`: systemd calls the unit
active only once the pod's socket listens; `WatchdogSec=`: a pod whose event loop stops turning
is killed and restarted. API keys come from `EnvironmentFile=-<config>/env`.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from cli.common import unit_name
from poddaemon.readyline import EXIT_REFUSED

if TYPE_CHECKING:
    from poddaemon.config.manifest import Manifest

EXIT_ERROR = 1
WATCHDOG_SEC = 30
TIMEOUT_STOP_SEC = 30
RESTART_SEC = 2
SYSTEMCTL_TIMEOUT = 90.0
MARKER = "# Written by `podctl unit install`"
# Directory overrides a unit pod must share with the podctl that installed it (SPEC §2): otherwise
# `podctl ls/send/stop` would look for its socket somewhere else.
DIR_VARS = ("PODDAEMON_HOME", "PODDAEMON_CONFIG_DIR", "PODDAEMON_DATA_DIR", "PODDAEMON_RUNTIME_DIR")
NO_MANAGER = (
    "no systemd user manager answers (is `systemctl --user` available? "
    "For a server: `sudo loginctl enable-linger $USER` keeps one running without a login)"
)

unit_app = typer.Typer(
    help="Run a pod as a systemd user service.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


class UnitError(Exception):
    pass


def unit_dir(manager_env: dict[str, str] | None = None) -> Path:
    """Where the user manager reads units: `$XDG_CONFIG_HOME/systemd/user` as the manager sees
    it, else `~/.config/systemd/user`. Not this shell's XDG_CONFIG_HOME: set in a profile the
    manager never reads, it put the unit where `enable` said "Unit file ... does not exist"."""
    if manager_env is None:
        try:
            manager_env = manager_environment()
        except UnitError:
            manager_env = {}
    base = manager_env.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):  # systemd ignores a relative one too
        base = os.path.join(manager_env.get("HOME") or os.path.expanduser("~"), ".config")
    return Path(base) / "systemd" / "user"


def unit_path(pod: str, manager_env: dict[str, str] | None = None) -> Path:
    return unit_dir(manager_env) / unit_name(pod)


def poddaemon_executable() -> Path:
    """This installation's `poddaemon` console script (next to the running interpreter)."""
    here = Path(sys.executable).parent / "poddaemon"
    if here.is_file() and os.access(here, os.X_OK):
        return here.absolute()
    found = shutil.which("poddaemon")
    if found:
        return Path(found).resolve()
    raise UnitError(f"cannot find the poddaemon executable (looked in {here.parent} and PATH)")


def _quote(escaped: str) -> str:
    if any(c.isspace() or c in "\"'\\;" for c in escaped) or not escaped:
        return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return escaped


def quote_arg(arg: str) -> str:
    """One ExecStart= word: `%` and `$` escaped (specifiers, variables), quoted when needed."""
    return _quote(arg.replace("%", "%%").replace("$", "$$"))


def quote_env(assignment: str) -> str:
    """One Environment= assignment. systemd expands specifiers there but not variables, so a
    `$$` would stay `$$` in the value (another PODDAEMON_HOME than podctl's)."""
    return _quote(assignment.replace("%", "%%"))


def env_file_arg(path: str) -> str:
    """EnvironmentFile= takes the rest of the line as the path, unquoted (quotes make it "not
    absolute" and systemd ignores it): only specifiers are escaped."""
    return "-" + path.replace("%", "%%")


def _one_line(what: str, value: str) -> None:
    """A unit file is read line by line, and no quoting spans a newline: one in a path would
    end its directive and turn the rest of the name into directives of their own (a broken
    unit, installed and enabled, or one that runs what the file name says)."""
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise UnitError(
            f"{what} {value!r} contains a control character (a newline, a tab...), which a "
            f"systemd unit cannot hold: rename it"
        )


def render_unit(
    pod: str,
    manifest: Path,
    executable: Path,
    config_dir: Path,
    environment: dict[str, str],
    watchdog_sec: int = WATCHDOG_SEC,
) -> str:
    _one_line("the manifest path", str(manifest))
    _one_line("the poddaemon path", str(executable))
    _one_line("the config directory", str(config_dir))
    for key, value in environment.items():
        _one_line(key, value)
    exec_start = " ".join(quote_arg(a) for a in (str(executable), "run", str(manifest), "--resume"))
    env_lines = "".join(
        f"Environment={quote_env(f'{k}={v}')}\n" for k, v in sorted(environment.items())
    )
    return f"""{MARKER} from {manifest}.
# `podctl unit remove {pod}` stops, disables and deletes it.
[Unit]
Description=poddaemon pod {pod}
Documentation=https://pypi.org/project/poddaemon/
# A pod that keeps failing right after it starts is given up on (failed) after 5 tries a minute.
StartLimitIntervalSec=60
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
# API keys: NAME=value lines in a 0600 file (the leading - : the file is optional).
EnvironmentFile={env_file_arg(str(config_dir / "env"))}
{env_lines}Restart=on-failure
RestartSec={RESTART_SEC}
# A pod that refused to start (its manifest, its scope taken, a session it cannot restore):
# starting it again changes nothing, so systemd does not.
RestartPreventExitStatus={EXIT_REFUSED}
# The pod pings from its event loop at half this: a wedged pod is killed and restarted.
WatchdogSec={watchdog_sec}
# SIGTERM to the pod (a graceful shutdown that stops its children); SIGKILL for what is left.
KillMode=mixed
TimeoutStopSec={TIMEOUT_STOP_SEC}

[Install]
WantedBy=default.target
"""


# Commands that wait for a start or stop job: systemd bounds those itself (TimeoutStartSec,
# which a pod with slow SessionStart hooks or MCP servers extends; TimeoutStopSec), so podctl
# adds no shorter limit of its own.
JOBS = ("start", "stop", "restart", "--now")


def systemctl(*args: str, check: bool = True) -> "subprocess.CompletedProcess[str]":
    """`systemctl --user ARGS`; UnitError with systemd's own message when it fails."""
    exe = shutil.which("systemctl")
    if exe is None:
        raise UnitError("systemctl not found: " + NO_MANAGER)
    job = any(a in JOBS for a in args)
    try:
        out = subprocess.run(
            [exe, "--user", *args],
            capture_output=True,
            text=True,
            timeout=None if job else SYSTEMCTL_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise UnitError(f"systemctl --user {' '.join(args)} did not finish in time") from None
    if check and out.returncode != 0:
        raise UnitError(
            f"systemctl --user {' '.join(args)} failed: "
            + (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}")
        )
    return out


def manager_environment() -> dict[str, str]:
    """The user manager's environment; UnitError when there is no manager to ask."""
    try:
        out = systemctl("show-environment")
    except UnitError as exc:
        raise UnitError(f"{NO_MANAGER}: {exc}") from None
    env = {}
    for line in out.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            env[key] = value
    return env


def read_env_file(path: Path) -> dict[str, str]:
    """`NAME=value` lines as systemd's EnvironmentFile= reads the simple cases."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    env = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        if sep:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            env[key.strip()] = value
    return env


def env_file_problem(env_file: Path) -> str | None:
    """None when `env_file` is missing or safe; else why the unit must not read it. systemd
    passes its variables to the pod as they are: one another user can write could set
    LD_PRELOAD or PYTHONPATH and run code as you, and one others can read gives away the API
    keys in it (`echo KEY=... >> env` makes it 0644 under the usual umask)."""
    from protocol import paths

    try:
        paths.check_file(env_file, "environment file", "as it could run code in your pods")
        mode = os.stat(env_file).st_mode & 0o7777
    except FileNotFoundError:
        return None
    except paths.UnsafeDirectory as exc:
        return str(exc)
    if mode & 0o044:
        return (
            f"environment file {env_file} is readable by group or others (mode {mode:04o}) and "
            f"holds API keys: refusing it; run chmod 600 {env_file}"
        )
    return None


def manifest_problem(manifest: Path) -> str | None:
    """Why the unit must not run `manifest`, or None. The unit reads it at every start,
    unattended, as you: one another user owns or could change (or swap, through a directory
    or a symlink of theirs) would let them pick the pod's scope, sandbox and hook commands."""
    from protocol import paths

    why = "as they could pick the scope, sandbox and hooks the unit runs as you"
    try:
        for path in dict.fromkeys((manifest, manifest.resolve())):  # the link and its target
            paths.check_file(path, "manifest", why)
    except paths.UnsafeDirectory as exc:
        return str(exc)
    return None


def config_dir_problem(config: Path) -> str | None:
    """None when nobody else can put files in `config`; else why the unit must not use it.
    The unit reads `<config>/env` at every start, unattended, as you, whether it is there
    today or not: in a directory another user may write in (or make first, in /tmp) they could
    create it later with LD_PRELOAD or PYTHONPATH and run code as you. A missing one is made
    0700, as the pod makes its own directories, so that nobody else can make it first."""
    from protocol import paths

    try:
        paths.ensure_dir(config, "config directory")
    except paths.UnsafeDirectory as exc:
        return str(exc)
    except OSError as exc:
        return f"config directory {config}: {exc.strerror or exc}"
    return None


def key_problem(var: str, env_file: Path, manager_env: dict[str, str]) -> str | None:
    """None when the pod's API key variable reaches the unit; else how to make it so."""
    from_file = read_env_file(env_file)
    if var in from_file and not from_file[var]:
        # EnvironmentFile= wins over the manager's environment, an empty value too.
        return (
            f"{var} (the provider's API key) is empty in {env_file}, which overrides the user "
            f"manager's environment, so the pod could not start: set it there or remove the line"
        )
    if from_file.get(var) or manager_env.get(var):
        return None
    if any(key.split() == ["export", var] for key in from_file):
        # A shell's (or a .env file's) line: systemd ignores it as an invalid assignment, and
        # "set neither in <the file that holds it>" left the user staring at their key.
        return (
            f"{var} (the provider's API key) is set in {env_file} as `export {var}=...`, "
            f"a line systemd ignores (it takes no `export`), so the pod could not start: "
            f"write it as {var}=... there"
        )
    return f"{var} (the provider's API key) {_set_neither(var, env_file)}"


def _set_neither(var: str, env_file: Path) -> str:
    """What a unit's pod lacks, and the two ways to give it."""
    return (
        f"is set neither in {env_file} nor in the user manager's environment, so the pod "
        f"could not start. Set it with:\n"
        f"  mkdir -p {env_file.parent}\n"
        f"  (umask 077; echo '{var}=...' >> {env_file})   # 0600 from the start\n"
        f"or: systemctl --user set-environment {var}=..."
    )


def mcp_env_problem(m: "Manifest", env_file: Path, manager_env: dict[str, str]) -> str | None:
    """None when every `${VAR}` a stdio MCP server's `env` takes from the pod's environment
    reaches the unit (the env file or the manager's environment); else which, and how. The
    pod refuses to start without one: with the provider's key checked and a token for its
    server only in the shell, `unit install` without --now installed a unit that failed at
    its first start."""
    from poddaemon.mcp.env import referenced

    from_file = read_env_file(env_file)
    for i, server in enumerate(m.mcp.servers):
        if server.command is None:
            continue
        for var in referenced(server.env):
            if var in from_file or var in manager_env:
                continue
            return (
                f"{m.source}: mcp.servers[{i}].env takes ${{{var}}}, which "
                f"{_set_neither(var, env_file)}"
            )
    return None


def command_path_problem(
    m: "Manifest", env_file: Path, manager_env: dict[str, str], shell_path: str
) -> str | None:
    """Why a stdio MCP server of manifest `m` named by a bare command would not start under
    the unit though it does from this shell, or None: the unit's pod finds it in the user
    manager's PATH (or the env file's), which a shell profile (`~/.local/bin`, `~/go/bin`)
    does not reach. The pod then started without the server's tools, a warning in the journal
    and "enabled and started" on the terminal."""
    unit_path = read_env_file(env_file).get("PATH") or manager_env.get("PATH", "")
    for i, server in enumerate(m.mcp.servers):
        if server.command is None or "/" in server.command[0] or "PATH" in server.env:
            continue
        name = server.command[0]
        here = shutil.which(name, path=shell_path)
        if here is None or shutil.which(name, path=unit_path) is not None:
            continue
        return (
            f"{m.source}: mcp.servers[{i}].command: {name!r} is {here} in this shell's PATH "
            f"but is not in the PATH the unit's pod gets ({unit_path or 'none'}), so the "
            f"server would not start there: give its absolute path, or set PATH in {env_file}"
        )
    return None


def env_file_dirs_problem(env_file: Path, environment: dict[str, str]) -> str | None:
    """None unless the env file sets a PODDAEMON_* directory variable to another directory
    than podctl uses; else why the unit must not run so. systemd applies EnvironmentFile=
    after Environment=, so the file's value wins over the one written into the unit
    (`environment`): the pod kept its socket and sessions elsewhere, and `podctl` said it was
    not running right after "enabled and started"."""
    from protocol import paths

    from_file = read_env_file(env_file)
    resolved = {
        "PODDAEMON_CONFIG_DIR": paths.config_dir,
        "PODDAEMON_DATA_DIR": paths.data_dir,
        "PODDAEMON_RUNTIME_DIR": paths.runtime_dir,
    }
    for var in DIR_VARS:
        if var not in from_file:
            continue
        value, ours = from_file[var], environment.get(var, "")
        same = os.path.normpath(value) if value else ""
        if same == ours or (value and var in resolved and same == os.path.abspath(resolved[var]())):
            continue  # (a directory of podctl's own, said again)
        return (
            f"{env_file} sets {var}={value}, which wins over the unit's "
            f"{f'{var}={ours}' if ours else var + ' (unset)'} (systemd applies EnvironmentFile= "
            f"last): the pod would keep its socket and sessions where podctl does not look. "
            f"Remove that line; the unit gets the directories podctl uses"
        )
    return None


def _xdg_pins(manager_env: dict[str, str], environment: dict[str, str]) -> dict[str, str]:
    """Without PODDAEMON_HOME, podctl finds config, data and runtime dirs from this shell's
    XDG_* variables and the pod from the manager's, which a shell profile does not reach: where
    they differ, the unit gets podctl's dirs (else its sessions and defaults.toml are others)."""
    from protocol import paths

    if os.environ.get("PODDAEMON_HOME"):
        return {}
    pins = {
        "PODDAEMON_CONFIG_DIR": ("XDG_CONFIG_HOME", paths.config_dir),
        "PODDAEMON_DATA_DIR": ("XDG_DATA_HOME", paths.data_dir),
        "PODDAEMON_RUNTIME_DIR": ("XDG_RUNTIME_DIR", paths.runtime_dir),
    }
    return {
        var: os.path.abspath(resolve())
        for var, (xdg, resolve) in pins.items()
        if var not in environment and os.environ.get(xdg, "") != manager_env.get(xdg, "")
    }


def installed_from(unit: Path) -> str | None:
    """The manifest an installed unit runs, as its first line names it; None when there is no
    such unit or it was not written by `unit install`."""
    try:
        with unit.open(encoding="utf-8", errors="replace") as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return None
    head = f"{MARKER} from "
    if not first.startswith(head) or not first.endswith("."):
        return None
    return first[len(head) : -1]


def install(
    manifest: str, now: bool, watchdog_sec: int = WATCHDOG_SEC
) -> tuple[str, bool, str | None]:
    """Write and load the unit; with `now`, enable and start it. Returns the pod's name,
    whether its unit was running already (then nothing was started: the pod keeps the unit
    and manifest it started with until its next start), and the other manifest the unit it
    replaced ran, if it ran another (two manifests that name the same pod)."""
    from poddaemon.config.load import ManifestError, files_problem, load_manifest
    from protocol import paths

    path = Path(manifest).absolute()
    try:
        m = load_manifest(str(path), (), paths.defaults_path())
    except ManifestError as exc:
        raise UnitError(str(exc)) from None
    problem = manifest_problem(path) or files_problem(m)
    if problem:
        raise UnitError(problem)
    pod = m.pod.name
    if now:
        _refuse_if_running_elsewhere(pod)
    executable = poddaemon_executable()
    manager_env = manager_environment()
    config = Path(os.path.abspath(paths.config_dir()))
    key_vars = [m.provider.api_key_var]
    if m.compaction is not None and m.compaction.provider is not None:
        key_vars.append(m.compaction.provider.api_key_var)
    problem = (
        config_dir_problem(config)
        or env_file_problem(config / "env")
        or next((p for v in key_vars if (p := key_problem(v, config / "env", manager_env))), None)
        or mcp_env_problem(m, config / "env", manager_env)
        or command_path_problem(m, config / "env", manager_env, os.environ.get("PATH", ""))
    )
    if problem:
        raise UnitError(problem)
    running = now and _unit_running(unit_name(pod))
    # Absolute: systemd ignores a relative EnvironmentFile= and runs the pod from another cwd.
    environment = {k: os.path.abspath(os.environ[k]) for k in DIR_VARS if os.environ.get(k)}
    environment.update(_xdg_pins(manager_env, environment))
    problem = env_file_dirs_problem(config / "env", environment)
    if problem:
        raise UnitError(problem)
    text = render_unit(pod, path, executable, config, environment, watchdog_sec)
    target = unit_path(pod, manager_env)
    target.parent.mkdir(parents=True, exist_ok=True)
    before = installed_from(target)
    replaced = before if before is not None and before != str(path) else None
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
    systemctl("daemon-reload")
    if now:
        # Type=notify: this returns once the pod has sent READY=1 (or failed to). A start that
        # failed is not left enabled: at each login it raced the pod holding the scope it was
        # refused, and won some (found by QA).
        unit = unit_name(pod)
        try:
            start_unit(
                unit,
                "enable",
                "--now",
                then=f"It stays installed, not enabled: fix that, then `podctl unit install "
                f"{manifest} --now` again, or `podctl unit remove {pod}`.",
            )
        except UnitError:
            with contextlib.suppress(UnitError):
                systemctl("disable", unit)
            raise
    return pod, running, replaced


def start_unit(unit: str, *how: str, then: str) -> None:
    """`systemctl --user HOW… UNIT`, a job that starts the pod (Type=notify: it returns once
    the pod is READY). When the pod refuses to start, UnitError with the pod's own error, as
    `podctl spawn` shows it, and `then` (what to do next), not systemd's "see systemctl status"."""
    since = time.time()
    try:
        systemctl(*how, unit)
    except UnitError as exc:
        ended = _ended_properties(unit)  # first: systemd resets them as it starts it again
        said = _journal_since(unit, since)
        gave_up = ended.get("Result") == "start-limit-hit"  # (its journal line may lag)
        if gave_up or any("Start request repeated too quickly" in line for line in said):
            raise UnitError(  # systemctl blames the last failure ("a fatal signal was ...")
                f"{unit} was started too often (StartLimitBurst= starts within "
                f"StartLimitIntervalSec=) and systemd gave up on it: run `systemctl --user "
                f"reset-failed {unit}`, then start it again"
            ) from None
        # Its own errors; not its warnings (a server script in the write scope), which are
        # no reason it ended: one killed after one of those was said to have "not started:
        # warning: ..." (found by a test once start-up warned of more).
        errors = [
            line.removeprefix("poddaemon: ")
            for line in said
            if line.startswith("poddaemon: ") and not line.startswith("poddaemon: warning: ")
        ]
        if not errors:  # a journal we may not read: the pod's status line (STATUS=) says it
            errors = _why_not_started(unit)
        if not errors:
            # Killed, crashed or timed out before READY, with no word of its own: what systemd
            # saw (systemctl printed its "Job for ... failed because ..." over three lines).
            what, again = _how_it_ended(unit, ended, str(exc))
            # Being started again by systemd, "fix that, then restart it" is no next step.
            next_step = "" if again else f"\n{then}"
            raise UnitError(f"{unit} did not start: {what}{next_step}") from None
        # The pod's own error (what `podctl spawn` would have shown), this start's only.
        why = f"{unit} did not start: {errors[-1]}"
        raise UnitError(f"{why}\n{then}") from None


# systemd's Result= of a service whose main process ended before READY (`man systemd.exec`).
_RESULTS = {
    "timeout": "did not get ready within TimeoutStartSec= and was stopped",
    "watchdog": "stopped pinging the watchdog (WatchdogSec=) and was killed",
    "oom-kill": "was killed for want of memory (the OOM killer)",
    "protocol": "exited without telling systemd it was ready",
    "resources": "could not be started: systemd lacked a resource it needed",
}
# `Job for U failed because <why>.` (`systemctl start`'s words), when the unit says no more.
_JOB_FAILED = re.compile(r"Job for \S+ failed because (.+?)\.(?:\s|$)")


def _ended_properties(unit: str) -> dict[str, str]:
    """The unit's properties that say how its last main process ended and what systemd does
    now; they hold until systemd starts it again (RestartSec=). {} when systemctl cannot say."""
    from cli.common import pod_of_unit, unit_properties

    wanted = ("Result", "ExecMainPID", "ExecMainCode", "ExecMainStatus", "SubState")
    return dict(unit_properties(pod_of_unit(unit), *wanted, "RestartUSec")).get(unit, {})


def _how_it_ended(unit: str, props: dict[str, str], said: str) -> tuple[str, bool]:
    """What became of the pod of a start that failed before READY (`props`: the unit's
    `_ended_properties`; `said`: systemctl's error), what systemd does now, and where its
    lines are, in one line; and whether systemd starts it again."""
    from cli.common import pod_of_unit

    name = pod_of_unit(unit)
    result, pid = props.get("Result", ""), props.get("ExecMainPID", "0")
    code, status = props.get("ExecMainCode", "0"), props.get("ExecMainStatus", "0")
    pod = f"its pod (pid {pid})" if pid not in ("", "0") else "its pod"
    if result in _RESULTS:
        what = f"{pod} {_RESULTS[result]}"
    elif result in ("signal", "core-dump") and code in ("2", "3") and status.isdigit():
        how = "was killed by" if code == "2" else "dumped core on"
        what = f"{pod} {how} signal {status} ({_signal_name(int(status))}) before it was ready"
    elif result == "exit-code" and code == "1":
        what = f"{pod} exited with status {status} before it was ready"
    else:  # systemd started it again already, or says no more than systemctl did
        found = _JOB_FAILED.search(said)
        what = "it failed before it was ready" + (f" ({found.group(1)})" if found else "")
    again = props.get("SubState") == "auto-restart"
    if again:
        after = props.get("RestartUSec") or "RestartSec="
        what += f"; systemd starts it again in {after} (Restart=on-failure)"
    return f"{what}. Its lines: podctl logs {name} (or systemctl --user status {unit})", again


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


def _why_not_started(unit: str) -> list[str]:
    """Why the pod of this start refused or failed, from the unit's status line, which the
    pod sets before it exits (systemd clears it at each start); [] when it did not say."""
    try:
        status = systemctl("show", "--property=StatusText", "--value", unit, check=False).stdout
    except UnitError:
        return []
    for outcome in ("refused: ", "failed: "):
        if status.startswith(outcome):
            return [status.removeprefix(outcome).strip()]
    return []


def _journal_since(unit: str, since: float) -> list[str]:
    """The unit's journal lines (its pod's and the manager's about it) since `since`; none
    when the journal cannot be read."""
    exe = shutil.which("journalctl")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [
                exe,
                f"--user-unit={unit}",
                f"--since=@{int(since)}",  # whole seconds: what every journalctl takes
                "--lines=50",
                "--output=cat",
                "--no-pager",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=SYSTEMCTL_TIMEOUT,
            stdin=subprocess.DEVNULL,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.splitlines()


def active_state(unit: str) -> str:
    """`systemctl --user is-active UNIT`: active, activating (an auto-restart too), ...; ""
    when systemctl cannot say."""
    try:
        return systemctl("is-active", unit, check=False).stdout.strip()
    except UnitError:
        return ""


def _unit_running(unit: str) -> bool:
    """Whether the unit runs or is starting: `enable --now` would then start nothing."""
    return active_state(unit) in ("active", "activating", "reloading")


def _refuse_if_running_elsewhere(pod: str) -> None:
    """`--now` while the pod runs outside systemd would fail on the registry; say so plainly."""
    from cli.service import _live_status, unit_of_pid

    status = _live_status(pod)
    if status is not None and unit_of_pid(int(status["pid"])) != unit_name(pod):
        raise UnitError(
            f"pod '{pod}' is already running (pid {status['pid']}) outside its unit; "
            f"stop it first (podctl stop {pod}), then install with --now"
        )


def remove(pod: str) -> bool:
    """Stop, disable, delete and reload. False when there was no such unit file."""
    target = unit_path(pod, manager_environment())  # a clear error first when no manager
    name = unit_name(pod)
    existed = target.exists()
    systemctl("disable", "--now", name, check=False)  # fine when not enabled or not loaded
    if existed:
        target.unlink()
    systemctl("daemon-reload")
    systemctl("reset-failed", name, check=False)
    return existed


@unit_app.command("install")
def install_cmd(
    manifest: Annotated[str, typer.Argument(metavar="MANIFEST", help="The pod's manifest (TOML).")],
    now: Annotated[bool, typer.Option("--now", help="Enable and start it (waits for READY).")] = (
        False
    ),
    watchdog: Annotated[
        int, typer.Option("--watchdog", metavar="SEC", help="WatchdogSec= (0 disables).", min=0)
    ] = WATCHDOG_SEC,
) -> None:
    """Write ~/.config/systemd/user/poddaemon-NAME.service for a pod and load it.

    The unit runs `poddaemon run MANIFEST --resume` (Type=notify, Restart=on-failure,
    WatchdogSec=, KillMode=mixed). API keys: NAME=value lines in <config>/env. A unit that
    is running already is not restarted by --now: `podctl restart NAME` applies the new one.
    """
    if not manifest:  # Path("").absolute() is the working directory: "Is a directory"
        from cli.common import EXIT_USAGE, fail

        fail("MANIFEST is empty: give the path of a pod's manifest", EXIT_USAGE)
    try:
        pod, running, replaced = install(manifest, now, watchdog)
    except UnitError as exc:
        _fail(str(exc))
    if replaced is not None:  # two manifests name this pod: the last one installed wins
        sys.stderr.write(
            f"podctl: warning: replaced the unit of pod '{pod}', which ran {replaced}\n"
        )
    if running:  # systemd starts nothing for a running unit: say so, not "started"
        sys.stdout.write(
            f"{unit_path(pod)} (enabled; it was already running and keeps its old unit and "
            f"manifest until it restarts: podctl restart {pod})\n"
        )
    elif now:
        sys.stdout.write(f"{unit_path(pod)} (enabled and started)\n")
    elif _unit_running(unit_name(pod)):  # "start it" said of a running unit misled
        sys.stdout.write(
            f"{unit_path(pod)}\nit runs with its old unit and manifest until it restarts: "
            f"podctl restart {pod}\n"
        )
    else:
        sys.stdout.write(
            f"{unit_path(pod)}\nstart it: systemctl --user enable --now {unit_name(pod)}\n"
        )


def _unit_pod_name(value: str) -> str:
    """A unit is named after its pod: any other name (or a socket's path) names none. A usage
    error, before the user manager is asked (it answered 'no manager', exit 1)."""
    from cli.app import pod_name

    if "/" in value:
        raise typer.BadParameter(f"{value!r} is not a pod name (a unit is named after its pod)")
    pod_name(value)
    return value


@unit_app.command("remove")
def remove_cmd(
    name: Annotated[
        str, typer.Argument(metavar="NAME", help="The pod's name.", callback=_unit_pod_name)
    ],
) -> None:
    """Stop, disable and delete a pod's unit."""
    try:
        existed = remove(name)
    except UnitError as exc:
        _fail(str(exc))
    if not existed:
        _fail(f"no unit for pod '{name}' ({unit_path(name)})")
    sys.stdout.write(f"removed {unit_name(name)}\n")


def _fail(message: str) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.write(f"podctl: {message}\n")
    raise typer.Exit(EXIT_ERROR)
