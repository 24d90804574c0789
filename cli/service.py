"""`podctl logs | wait | restart`, the `--version` text, and how a unit-managed pod is found
(SPEC §6, §7).

A pod started by its systemd unit is the same pod to every command. What makes it a unit pod is
where its process lives: its cgroup path ends in `poddaemon-<name>.service` (also true of its
children, which are stopped with it). Stopping or restarting such a pod goes through
`systemctl --user`, or systemd would just start it again.
"""

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from poddaemon.config.manifest import Manifest

from cli.app import PodArg, app, seconds
from cli.common import (
    EXIT_INTERRUPTED,
    EXIT_NOT_RUNNING,
    EXIT_USAGE,
    STARTING,
    check_stdout,
    fail,
    print_json,
    restarting,
    restarting_unit,
    say_started,
)
from cli.common import starting as is_starting

EXIT_TIMEOUT = 4
WAIT_POLL = 0.05
WAIT_CALL_TIMEOUT = 30.0  # `wait` without --timeout: a pod silent this long is an error
WAIT_CALL_MIN = 0.5  # the least a status call is given, however little of --timeout is left
FOLLOW_POLL = 0.2
RESTART_WAIT = 120.0  # seconds a restart waits for another restart of the same pod
# `poddaemon-<name>.service` (podctl unit install) or `poddaemon@<name>.service` (the template
# shipped in systemd/).
_UNIT_IN_CGROUP = re.compile(r"/(poddaemon[-@][a-z0-9][a-z0-9_-]{0,47}\.service)(?:/|$)")
_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


# --- which pods are units -------------------------------------------------------------------


def unit_of_pid(pid: int) -> str | None:
    """`poddaemon-<name>.service` (or `poddaemon@<name>.service`) when the process runs in that
    unit's cgroup, else None."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        found = _UNIT_IN_CGROUP.search(line.split(":", 2)[-1])
        if found:
            return found.group(1)
    return None


def _live_status(target: str, timeouts: bool = False) -> dict[str, Any] | None:
    """The pod's status, or None when it is not running (or, unless `timeouts`, when it does
    not answer: TimeoutError then)."""
    from protocol import oneshot
    from protocol.errors import ConnectionClosed, PodNotRunning, RpcError

    try:
        result: dict[str, Any] = oneshot.call(target, "status", timeout=5.0)
        return result
    except TimeoutError:
        if timeouts:
            raise
        return None
    except (PodNotRunning, ConnectionClosed, RpcError, OSError):
        return None


def _own_unit(status: dict[str, Any]) -> str | None:
    """The pod's own unit. A child of a unit pod lives in its parent's cgroup, but it is not
    that unit: stopping it must not stop its parent."""
    from cli.common import template_unit_name, unit_name

    name, pid = status["name"], status["pid"]
    if not isinstance(name, str) or not isinstance(pid, int):  # not a pod's: no unit of ours
        return None
    unit = unit_of_pid(pid)
    return unit if unit in (unit_name(name), template_unit_name(name)) else None


def pod_unit(target: str, status: dict[str, Any] | None) -> str | None:
    """The unit that runs this pod: from its process when it runs, else an installed unit file
    or an instance of the shipped template that systemd holds as the pod's."""
    from cli.common import unit_name
    from cli.unit import unit_path

    if status is not None:
        return _own_unit(status)
    if "/" in target:
        return None
    if unit_path(target).exists():
        return unit_name(target)
    return _template_instance(target)


def _template_instance(name: str) -> str | None:
    """`poddaemon@NAME.service` when it is enabled or not inactive (failed, between a crash and
    its restart): a stopped pod of the template is restarted by systemd, and its log is the
    journal. Else (started once and stopped, or no such template) None."""
    from cli.common import template_unit_name
    from cli.unit import UnitError, systemctl

    unit = template_unit_name(name)
    try:
        props = "--property=LoadState,UnitFileState,ActiveState"
        out = systemctl("show", props, unit, check=False).stdout
    except UnitError:  # no systemctl, no manager: no unit
        return None
    state = dict(line.partition("=")[::2] for line in out.splitlines())
    if state.get("LoadState") != "loaded":
        return None
    if state.get("UnitFileState", "").startswith("enabled"):
        return unit
    return unit if state.get("ActiveState", "inactive") != "inactive" else None


def stop_unit_pod(
    target: str, timeout: float, before: Callable[[str, list[str]], None] | None = None
) -> bool:
    """`podctl stop` of a unit-managed pod: stop its unit (after `before(name, children)`,
    for `--tree`), also when the pod does not answer (systemd kills it and keeps it down) or
    is between a crash and its restart. False when it is not one; TimeoutError when it does
    not answer within `timeout` and is no unit's (asking again would only wait as long)."""
    from protocol import oneshot
    from protocol.errors import ConnectionClosed, PodNotRunning, RpcError

    try:
        status: dict[str, Any] = oneshot.call(target, "status", timeout=timeout)
    except TimeoutError:
        # Wedged or stopped: SIGTERM to its pid would leave systemd to restart it (watchdog).
        name, unit = _unanswering_unit(target)
        if unit is None:
            raise
        return _stop_unit(name, unit, [], before)
    except (PodNotRunning, ConnectionClosed, RpcError, OSError):
        # Between a crash and systemd's restart (activating, auto-restart): still its unit's.
        unit = restarting_unit(target)
        if unit is None:
            return False
        return _stop_unit(target, unit, [], before)
    unit = _own_unit(status)
    if unit is None:
        return False
    children = [str(c["name"]) for c in status.get("children") or []]
    if not _manager_answers():
        # A shell with no user bus (cron, su, ssh without a session): systemctl cannot stop
        # the unit, but the pod answers, and its clean exit 0 after `shutdown` is one
        # Restart=on-failure leaves down: the caller's shutdown over the socket stops the unit.
        sys.stderr.write(
            f"podctl: no systemd user manager answers here; shutting {status['name']} down "
            f"over its socket (its unit {unit} stays down: it exits 0)\n"
        )
        return False
    return _stop_unit(str(status["name"]), unit, children, before)


def _manager_answers() -> bool:
    """Whether `systemctl --user` reaches a user manager from this environment."""
    from cli.unit import UnitError, manager_environment

    try:
        manager_environment()
    except UnitError:
        return False
    return True


def _stop_unit(
    name: str, unit: str, children: list[str], before: Callable[[str, list[str]], None] | None
) -> bool:
    if before is not None:
        before(name, children)
    _systemctl_or_fail("stop", unit)
    sys.stdout.write(f"stopped {name} (unit {unit})\n")
    return True


def _unanswering_unit(target: str) -> tuple[str, str | None]:
    """The name and own unit of a pod that does not answer, from its registry entry."""
    from cli.pods import live_entry

    entry = live_entry(target)
    if entry is None:
        return target, None
    return str(entry.name), _own_unit({"name": entry.name, "pid": entry.pid})


def _systemctl_or_fail(*args: str) -> None:
    from cli.unit import UnitError, systemctl

    try:
        systemctl(*args)
    except UnitError as exc:
        fail(str(exc))


# --- restart --------------------------------------------------------------------------------


def restart(pod: PodArg) -> None:
    """Stop the pod (if running), then start it again with --resume.

    A unit pod is restarted by systemd; any other pod from its kept configuration
    (<data>/pods/NAME.toml, written when it started).
    """
    from protocol import paths

    paths.check_private_dirs()  # the kept configuration grants scope: it must be ours alone
    with _one_restart_at_a_time(pod):
        _restart(pod)


@contextlib.contextmanager
def _one_restart_at_a_time(pod: str) -> Iterator[None]:
    """Restarts of one pod take turns, each stopping it and starting it again, as systemd
    queues them: at once, they stopped each other's pods mid-start, and three of four said it
    was not running."""
    import filelock

    from protocol import paths

    name = _name_of(pod)
    # In the pod's own runtime dir (its stderr.log stays there too), made if it ran here
    # before a reboot emptied the runtime dir: a name with neither has nothing to restart,
    # and leaves nothing behind.
    home = paths.socket_path(name).parent if name is not None else None
    if home is None or not (home.is_dir() or paths.kept_config(str(name)).exists()):
        yield
        return
    paths.ensure_dir(home, "pod directory")
    lock = filelock.FileLock(home / "restart.lock", timeout=RESTART_WAIT, mode=0o600)
    try:
        lock.acquire()
    except filelock.Timeout:
        fail(f"another restart of pod '{pod}' has not finished in {RESTART_WAIT:g} s")
    try:
        yield
    finally:
        lock.release()


def _name_of(pod: str) -> str | None:
    """The pod name `pod` gives: a name, or a socket path, in our runtime dir
    (`<runtime>/pods/NAME/sock`, whether its pod runs or not) or where a live pod listens."""
    from protocol import paths

    if "/" not in pod:
        return pod
    path = Path(os.path.abspath(pod))
    if path.name == "sock" and path == paths.socket_path(path.parent.name):
        return path.parent.name
    from cli.pods import live_entry

    entry = live_entry(pod)
    return None if entry is None else str(entry.name)


def _restart(pod: str) -> None:
    from protocol import paths

    unanswering = False
    try:
        status = _live_status(pod, timeouts=True)
    except TimeoutError:  # stopped, wedged: stopped by its pid below (SIGTERM), then started
        status, unanswering = None, True
    name = str(status["name"]) if status is not None else _name_of(pod) or pod
    unit = pod_unit(pod, status)
    if unit is not None:
        from cli.unit import UnitError, manager_environment, start_unit

        try:  # cron, su, ssh without a session: say so (systemctl said only "Failed to connect")
            manager_env = manager_environment()
        except UnitError as exc:
            fail(f"cannot restart {unit}: {exc}")
        problem = _unit_cannot_start(unit, manager_env)
        if problem is not None:  # found before the stop, as below: a typo kept the pod down
            left = " (it is left running)" if status is not None else ""
            fail(f"cannot restart pod '{name}'{left}: {problem}")
        _forget_earlier_starts(unit)
        try:
            start_unit(unit, "restart", then=f"Fix that, then `podctl restart {name}`.")
        except UnitError as exc:
            fail(str(exc))
        started = _unit_pod(unit)
        socket = paths.socket_path(name) if started is None else started.socket
        name = name if started is None else str(started.name)
        sys.stdout.write(f"{name}\t{socket}\n")  # as `spawn` and any restart
        return
    if "/" in name:
        fail(f"pod '{pod}' is not running; restart it by name", EXIT_NOT_RUNNING)
    config = paths.kept_config(name)
    if not config.exists():
        if status is None:
            fail(f"pod '{name}' is not running and has no kept configuration", EXIT_NOT_RUNNING)
        fail(f"pod '{name}' has no kept configuration ({config}); stop it and spawn it again")
    callback = paths.kept_callback(name)
    spawner = callback.read_text().strip() if callback.exists() else None
    problem = _cannot_start(config) or (_too_many_children(name, spawner) if spawner else None)
    if problem is not None:  # found before the stop: a restart that cannot start keeps the pod
        left = " (it is left running)" if status is not None else ""
        fail(f"cannot restart pod '{name}'{left}: {problem}")
    if status is not None or unanswering:
        from cli.pods import _stop

        # (not top: a pod another restart stopped meanwhile is no error)
        if _stop(pod, tree=False, top=False, unanswered=unanswering):
            fail(f"pod '{name}' did not stop; it was not restarted")
    from cli.spawn import SpawnFailed, daemon_command, shortened, spawn_detached

    try:
        cmd = daemon_command(str(config), [], None, True)
        if spawner:  # a child: it reports to its spawner again
            cmd += ["--adopt", "--callback", spawner]
        started, socket, early = spawn_detached(cmd)
    except SpawnFailed as exc:
        sys.stderr.buffer.write(shortened(exc.output, name))
        fail(exc.message)
    except (KeyboardInterrupt, SystemExit) as exc:
        # Ctrl-C, SIGTERM or SIGHUP (SystemExit(128 + signal), cli.spawn) while the pod starts
        # again: the start is undone, and the pod, stopped above, is left stopped. A silent
        # 130 after "stopped NAME" read as a restart cut short with the old pod still there.
        code = exc.code if isinstance(exc, SystemExit) else EXIT_INTERRUPTED
        if not isinstance(code, int) or code <= 128:
            raise  # an exit of its own, not a signal
        fail(
            f"interrupted: pod '{name}' was stopped and not started again (podctl restart {name})",
            code,
        )
    sys.stderr.buffer.write(shortened(early, name))
    say_started(started, socket)


def _forget_earlier_starts(unit: str) -> None:
    """Reset the unit's start counter before a restart the user asked for, when the unit runs
    or was stopped. StartLimitBurst= is there to give up on a pod that keeps failing, but
    systemd counts every start: the sixth `podctl restart` within a minute of a healthy pod
    (applying manifest edits) stopped it and left it down, "started too often". A unit that is
    failing (restarting after a crash, failed, given up on) keeps its count: that is what the
    limit is for, and a restart of one it gave up on says so."""
    from cli.unit import UnitError, active_state, systemctl

    if active_state(unit) in ("active", "inactive"):
        # reset-failed resets the start rate counter of a unit in any state; at worst (it
        # failed) the restart is counted as before
        with contextlib.suppress(UnitError):
            systemctl("reset-failed", unit, check=False)


def _unit_pod(unit: str) -> Any:
    """The registry entry of the pod the unit runs now (its MainPID), or None. The manifest is
    read at each start: an edited `[pod] name` comes back as another pod, whose name and
    socket a restart must print (it printed the old ones, where nothing listens)."""
    from cli.pods import _registry_entries
    from cli.unit import UnitError, systemctl

    try:
        pid = systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip()
    except UnitError:
        return None
    return next((e for e in _registry_entries().values() if str(e.pid) == pid), None)


def _too_many_children(name: str, spawner_socket: str) -> str | None:
    """Why child `name` may not start again under its spawner: the spawner's other live
    children are already its `spawn.max_children` (SPEC §9: live children at once), which it
    would pass on taking `name` back. None when it may (or its spawner cannot be told)."""
    from poddaemon.config.load import ManifestError, load_manifest
    from protocol import paths

    spawner = _name_of(spawner_socket)
    if spawner is None:
        return None
    # The spawner's own limit (its kept configuration); a child inherits it, as a fallback.
    config = paths.kept_config(spawner)
    try:
        manifest = load_manifest(
            str(config if config.exists() else paths.kept_config(name)), (), paths.defaults_path()
        )
    except ManifestError:
        return None
    limit = manifest.spawn.max_children
    from cli.pods import _registry_entries

    others = sorted(e.name for e in _registry_entries().values() if e.parent == spawner)
    others = [n for n in others if n != name]
    if len(others) < limit:
        return None
    return (
        f"its spawner '{spawner}' has {len(others)} live children ({', '.join(others)}), "
        f"its spawn.max_children = {limit}; stop one first"
    )


def _unit_cannot_start(unit: str, manager_env: dict[str, str]) -> str | None:
    """Why the manifest that `unit install` wrote `unit` for could not start a pod now (edited
    into one that no longer loads, or that another user could change), or None; None for a
    unit it did not write (the shipped template's), whose manifest podctl does not know. The
    unit stops the pod before it starts it again, and a start refused is not retried."""
    from cli.unit import installed_from, manifest_problem, unit_dir
    from poddaemon.config.load import ManifestError, load_manifest
    from protocol import paths

    manifest = installed_from(unit_dir(manager_env) / unit)
    if manifest is None:
        return None
    try:
        loaded = load_manifest(manifest, (), paths.defaults_path())
    except ManifestError as exc:
        return str(exc)
    return manifest_problem(Path(manifest)) or _files_problem(loaded)


def _files_problem(manifest: "Manifest") -> str | None:
    """What the pod's start would refuse of the files it needs, as it says it: its pwd gone,
    its instruction file unreadable, one another user could change. (Found by QA: a restart
    stopped the pod, which then refused to start, and stayed down.)"""
    from poddaemon.config.load import files_problem, pwd_problem
    from poddaemon.prompt import PromptError, load_instruction
    from poddaemon.scope import resolve

    problem = pwd_problem(manifest, resolve(manifest.pod.pwd, "/")) or files_problem(manifest)
    if problem is not None:
        return problem
    worker = manifest.worker
    try:
        origin = manifest.instruction_source or manifest.source  # (as the pod names it)
        load_instruction(worker.instruction, worker.instruction_file, origin)
    except PromptError as exc:
        return str(exc)
    return None


def _set_for_units_only(manifest: "Manifest") -> str:
    """Where the key a pod restarted from this shell lacks is set for its units (the child of
    a unit pod, say), and how to bring it here; "" when it is not set there either."""
    from cli.unit import read_env_file
    from protocol import paths

    env_file = paths.config_dir() / "env"
    names = [manifest.provider.api_key_var]
    if manifest.compaction is not None and manifest.compaction.provider is not None:
        names.append(manifest.compaction.provider.api_key_var)
    found = read_env_file(env_file)
    if not any(found.get(name) and not os.environ.get(name) for name in names):
        return ""
    return (
        f"; it is set in {env_file}, which only units read: `set -a; . {env_file}; set +a`, "
        "then restart it again"
    )


def _cannot_start(config: Path) -> str | None:
    """Why the kept configuration could not start a pod from this shell (its provider's API key
    variable unset here, a configuration that no longer loads, a corrupt pods.json), or None.
    A pod restarted by `podctl` gets this shell's environment, not the one it was spawned with."""
    from poddaemon.config.load import ManifestError, load_manifest
    from poddaemon.llm import CredentialsError, check_manifest_credentials
    from poddaemon.registry import Registry, RegistryError
    from protocol import paths

    try:
        manifest = load_manifest(str(config), (), paths.defaults_path())
        check_manifest_credentials(manifest)
        Registry(paths.runtime_dir()).live()  # a corrupt pods.json: no pod can register
    except ManifestError as exc:
        return str(exc)
    except CredentialsError as exc:
        said = f"{config}: {exc} in this shell (a restarted pod gets this environment)"
        return said + _set_for_units_only(manifest)
    except RegistryError as exc:
        return str(exc)
    return _files_problem(manifest)


# --- wait -----------------------------------------------------------------------------------


def wait(
    pod: PodArg,
    until: Annotated[
        str, typer.Option("--until", metavar="STATE", help="The state to wait for: idle.")
    ] = "idle",
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            metavar="S",
            min=0,
            callback=seconds,
            help="Give up after S seconds (exit 4).",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the final status as JSON.")
    ] = False,
) -> None:
    """Block until the pod is idle with an empty queue.

    Exit 0 when it is, 4 on timeout, 3 when the pod is not running. A pod still starting
    (`podctl ls`: starting) is waited for. A pod that does not answer (stopped, wedged) is not
    idle yet with --timeout; without it, one silent for 30 s is an error (exit 1).
    """
    from cli.common import rpc_errors
    from protocol import oneshot, paths
    from protocol.errors import ConnectionClosed, PodNotRunning

    if until != "idle":
        fail(f"--until: only 'idle' is supported, not {until!r}", EXIT_USAGE)
    deadline = None if timeout is None else time.monotonic() + timeout
    status: dict[str, Any] | None = None
    told: str | None = None
    looked_again = starting = False
    with rpc_errors(pod, WAIT_CALL_TIMEOUT):
        paths.check_private_dirs()
        while True:
            # Each call within what is left of --timeout (give or take WAIT_CALL_MIN): a pod
            # that does not answer (SIGSTOP, a wedged loop) is just not idle yet.
            left = WAIT_CALL_TIMEOUT if deadline is None else deadline - time.monotonic()
            try:
                status = oneshot.call(
                    pod, "status", timeout=min(max(left, WAIT_CALL_MIN), WAIT_CALL_TIMEOUT)
                )
                starting = False
            except TimeoutError:
                if deadline is None:
                    raise
                status = None
            except (PodNotRunning, ConnectionClosed):
                status = None
                # Registered, not listening (SessionStart hooks, MCP servers), or between the
                # stop and the start of a `podctl restart`.
                starting = is_starting(pod) or restarting(pod)
                if starting:
                    if told != STARTING:
                        told = STARTING
                        sys.stderr.write(f"podctl: pod '{pod}' is starting ({STARTING})\n")
                        sys.stderr.flush()
                else:
                    # Between a crash and its restart its unit is activating. Active: the pod
                    # came up since this call, or went down before systemd saw it: look again.
                    unit, state = _unit_state(pod)
                    if unit is None or state not in ("activating", "reloading", "active"):
                        raise
                    if state == "active" and looked_again:
                        raise
                    looked_again = state == "active"
                    if told != unit:  # between a crash and its restart: its queue is still to do
                        told = unit
                        sys.stderr.write(f"podctl: pod '{pod}' is being restarted by {unit}\n")
                        sys.stderr.flush()
            if status is not None and _idle(status):
                break
            why = _why_not_idle(status) if status is not None else None
            if status is not None and why is not None and why != told:
                told = why  # it may wait for a long time, or forever: a silent wait looks hung
                sys.stderr.write(f"podctl: pod '{status.get('name', pod)}' {why}\n")
                sys.stderr.flush()
            if deadline is not None and time.monotonic() >= deadline:
                if as_json:
                    print_json({"idle": False, "status": status})
                name = status.get("name", pod) if status else pod
                doing = f"still {_doing(status)}" if status else "not answering"
                if status is None and starting:
                    doing = "still starting"
                sys.stderr.write(f"podctl: pod '{name}' {doing} after {timeout:g} s\n")
                raise typer.Exit(EXIT_TIMEOUT)
            time.sleep(WAIT_POLL)  # polling a condition: status is cheap and always answered
    if as_json:
        print_json({"idle": True, "status": status})


def _unit_state(target: str) -> tuple[str | None, str]:
    """The unit of a pod that does not listen, and its ActiveState; (None, "") for no unit."""
    from cli.unit import active_state

    unit = pod_unit(target, None)
    return (unit, active_state(unit)) if unit is not None else (None, "")


def _idle(status: dict[str, Any]) -> bool:
    return status.get("state") == "idle" and not _queued(status)


def _queued(status: dict[str, Any]) -> int:
    queue = status.get("queue") or {}
    return int(queue.get("runs") or 0) + int(queue.get("notifications") or 0)


def _doing(status: dict[str, Any]) -> str:
    """What keeps it from being idle: "running", "idle with 2 inputs queued", ..."""
    queued = _queued(status)
    state = str(status.get("state"))
    return f"{state} with {queued} input{'s' * (queued != 1)} queued" if queued else state


def _why_not_idle(status: dict[str, Any]) -> str | None:
    """Why `wait` may wait long, or forever, when the pod will not get there by itself."""
    if status.get("state") == "paused":
        return "is paused: it is idle once resumed (or its paused run cancelled) and done"
    budget = status.get("budget") or {}
    if status.get("state") == "idle" and _queued(status) and budget.get("left") == 0:
        return (
            f"has no token budget left (budget.max_total_tokens = {budget.get('limit')}): "
            "its queued inputs wait until a child's unused grant comes back, or until it "
            "restarts with a larger budget"
        )
    return None


# --- logs -----------------------------------------------------------------------------------


def parse_since(value: str, now: float | None = None) -> float:
    """An epoch time from `30s`/`10m`/`2h`/`1d`/`90` (ago) or an ISO date/time."""
    from datetime import datetime

    now = time.time() if now is None else now
    age = _AGE.match(value.strip())
    if age:
        unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[age.group(2)]
        return now - float(age.group(1)) * unit
    try:
        # timestamp() too: a date it cannot place (0001-01-01 in local time) said only
        # "year 0 is out of range".
        return datetime.fromisoformat(value.strip()).timestamp()
    except (ValueError, OverflowError, OSError):
        raise ValueError(
            f"--since: {value!r} is neither an age (30s, 10m, 2h, 1d) nor a date/time"
        ) from None


def _line_time(line: str) -> float | None:
    """The timestamp a pod log line starts with (`YYYY-MM-DD HH:MM:SS.mmm`), if any."""
    from datetime import datetime

    head = line[:23]
    if len(head) < 19 or head[4] != "-" or head[10] != " ":
        return None
    try:
        return datetime.fromisoformat(head.replace(",", ".")).timestamp()
    except ValueError:
        return None


def logs(
    pod: PodArg,
    follow: Annotated[
        bool, typer.Option("-f", "--follow", help="Keep printing new lines.")
    ] = False,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            metavar="WHEN",
            help="Only lines since: an age (30s, 10m, 2h, 1d; a bare number is seconds) "
            "or an ISO date/time (2026-11-29T08:00).",
        ),
    ] = None,
) -> None:
    """The pod's own log lines, with timestamps.

    From the journal for a pod run by its systemd unit, else from <log>/NAME.log (where
    podctl spawn keeps it); for a stopped pod whose unit was removed, from the journal still,
    unless it ran since without one. `-f` follows until Ctrl-C (exit 130).
    """
    from protocol import paths

    try:
        after = None if since is None else parse_since(since)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    paths.check_private_dirs()  # another user could have written the log file we would show
    status = _live_status(pod)
    if status is None and "/" in pod:
        # A socket path that does not answer names no pod: joined under <runtime>/pods it read
        # `<path>/stderr.log` (`../../x` anywhere, a stopped pod's socket path never its log).
        fail(f"pod '{pod}' is not running; show its log by name", EXIT_NOT_RUNNING)
    name = str(status["name"]) if status is not None else pod
    unit = pod_unit(pod, status)
    if unit is not None and status is None and _ran_since_without(name):
        # Its unit is installed but stopped, and it ran since as a plain pod (podctl spawn):
        # its latest lines, a crash of that run's say, are in its log file, not the journal.
        unit = None
    if unit is not None:
        _journal(unit, follow, after)
    unread = ""
    if status is None:  # no unit now: one removed since may have logged last (its journal)
        former, unread = _removed_unit_journal(name)
        if former is not None:
            sys.stderr.write(
                f"podctl: pod '{name}' has no unit now; its lines from {former}, "
                f"which was removed, are in the journal\n"
            )
            _journal(former, follow, after)
    _stderr_log(name, follow, after, running=status is not None, unread=unread)


def _removed_unit_journal(name: str) -> tuple[str | None, str]:
    """The unit of pod `name` whose journal holds its latest lines, when that unit is gone
    (`podctl unit remove`) and the pod has logged nothing since to its log file (started
    otherwise): `remove` deletes the unit file, not the journal, and `logs` looked for a
    unit file only, saying "no log for pod" over every line the pod had written. None when the
    journal has none, with journalctl's complaint when it cannot be read ("" otherwise)."""
    from cli.common import template_unit_name, unit_name

    last, unread = _newest_unit_entry(name)
    if last is None or _logged_since(name, last[0]):
        return None, unread
    # Whichever of the two the entry is about (a unit's own line, or the manager's on it).
    units = (unit_name(name), template_unit_name(name))
    return next((u for u in units if u in last[1]), units[0]), ""


def _ran_since_without(name: str) -> bool:
    """Whether stopped pod `name` wrote its log file after the newest journal line of its
    units (or the journal has none: installed, never started): it ran as a plain pod since.
    False when the journal cannot be read (then it is where to look, and `logs` says why)."""
    last, unread = _newest_unit_entry(name)
    if last is None:
        return not unread and _logged_since(name, 0.0)
    return _logged_since(name, last[0])


def _newest_unit_entry(name: str) -> tuple[tuple[float, set[str]] | None, str]:
    """When the newest journal entry of pod `name`'s units (`poddaemon-NAME.service`,
    `poddaemon@NAME.service`) was written and which units it is about (the pod's own line or
    the manager's on it); None when there is none, with journalctl's complaint when it cannot
    be read ("" otherwise)."""
    import json
    import shutil
    import subprocess

    from cli.common import template_unit_name, unit_name

    exe = shutil.which("journalctl")
    if exe is None:
        return None, ""
    units = (unit_name(name), template_unit_name(name))
    try:  # the newest entry of either unit: the pod's lines and the manager's about it
        out = subprocess.run(
            [exe, *(f"--user-unit={u}" for u in units), "-n1", "-ojson", "--no-pager", "-q"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None, ""
    if out.returncode != 0:
        return None, out.stderr.strip().rstrip(".") or f"journalctl: exit {out.returncode}"
    try:
        last = json.loads(out.stdout.splitlines()[-1]) if out.stdout.strip() else None
        when = int(last["__REALTIME_TIMESTAMP"]) / 1e6 if last else None
    except (ValueError, KeyError, TypeError):
        return None, ""
    if last is None or when is None:
        return None, ""
    return (when, {str(last.get("_SYSTEMD_USER_UNIT")), str(last.get("USER_UNIT"))}), ""


def _logged_since(name: str, when: float) -> bool:
    """Whether pod `name`'s log file (podctl spawn's) was written after `when`."""
    from protocol import paths

    for path in (paths.log_dir() / f"{name}.log", paths.pod_dir(name) / "stderr.log"):
        with contextlib.suppress(OSError):
            return os.stat(path).st_mtime > when  # it ran since, not as that unit: its file
    return False


def _journal(unit: str, follow: bool, after: float | None) -> None:
    import shutil
    import subprocess

    exe = shutil.which("journalctl")
    if exe is None:
        fail("journalctl not found; the pod's log lines are in the journal")
    cmd = [exe, f"--user-unit={unit}", "-o", "short-iso-precise", "--no-pager", "--quiet"]
    # Asked first (a line-less read): handed over, journalctl alone would say "No journal
    # files were opened due to insufficient permissions", neither what it read nor the way out.
    probe = subprocess.run(
        [*cmd, "--lines=0"], capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if probe.returncode != 0:
        said = probe.stderr.strip().rstrip(".") or f"exit {probe.returncode}"
        fail(
            f"cannot read the journal, which holds the log lines of {unit} ({said}). Where it "
            f"is volatile, only group systemd-journal may: `sudo usermod -aG systemd-journal "
            f"$USER` (then log in again); or keep it on disk, where each user reads their own: "
            f"`sudo mkdir -p /var/log/journal && sudo systemctl restart systemd-journald`. "
            f"`systemctl --user status {unit}` shows its state (and why a start failed)."
        )
    if after is not None:
        cmd.append(f"--since=@{after:.0f}")
    if follow:
        cmd.append("--follow")
    sys.stdout.flush()
    os.execv(exe, cmd)


def _stderr_log(
    name: str, follow: bool, after: float | None, running: bool, unread: str = ""
) -> None:
    from cli.render import printable
    from protocol import paths

    path = kept = paths.log_dir() / f"{name}.log"
    with contextlib.suppress(FileNotFoundError):
        paths.check_dir(path.parent, "log directory")  # another user's: their lines, not ours
    if not path.exists():  # one started by a version that kept it in the pod's runtime dir
        path = paths.pod_dir(name) / "stderr.log"
    try:
        f: IO[str] = path.open("r", errors="replace")
    except FileNotFoundError:
        path = kept  # name where the log is kept, not the old place looked at last
        if running:  # started some other way (`poddaemon run`, spawn --foreground): exit 3 lies
            fail(
                f"pod '{name}' keeps no log file ({path}): its stderr goes where its starter "
                "sent it (podctl spawn without --foreground keeps one)"
            )
        if unread:  # a removed unit's lines may be there: say where, and why podctl cannot
            from cli.common import unit_name

            fail(
                f"no log for pod '{name}' ({path}); if it ran as a systemd unit, its lines are "
                f"in the journal (`journalctl --user-unit={unit_name(name)}`), which podctl "
                f"cannot read here ({unread})",
                EXIT_NOT_RUNNING,
            )
        fail(f"no log for pod '{name}' ({path})", EXIT_NOT_RUNNING)
    try:
        showing = after is None
        if after is not None:  # the rotation moved the older lines: theirs first
            showing = _rotated_since(path.with_name(f"{path.name}.1"), f, after)
        try:
            while True:
                line = f.readline()
                if not line:
                    if not follow:
                        return
                    sys.stdout.flush()
                    check_stdout()  # `logs -f | head`: ends once head has its lines
                    newer = _rotated(path, f)
                    if newer is not None:  # all of the old file read: on to the new one
                        f.close()
                        f = newer
                        continue
                    time.sleep(FOLLOW_POLL)  # tail -f: wait for the pod to write more
                    continue
                if not showing:
                    stamp = _line_time(line)
                    showing = stamp is not None and after is not None and stamp >= after
                if showing:  # a provider's error body it quotes: no escape sequences
                    sys.stdout.write(printable(line))
        except KeyboardInterrupt:  # as `tail -f` and every other podctl command: 130
            raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        f.close()


def _rotated_since(kept: Path, f: IO[str], after: float) -> bool:
    """Print the lines of `kept` (the log the pod rotated past 16 MiB) from the first one at
    or after `after`: `--since` reaches back before the rotation. True when one was printed
    (every line of the open log `f` is then newer). Not when `kept` is `f` itself (rotated
    since `f` was opened: its lines come from `f`)."""
    from cli.render import printable

    try:
        old = kept.open("r", errors="replace")
    except OSError:
        return False
    with old:
        held, named = os.fstat(f.fileno()), os.fstat(old.fileno())
        if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return False
        showing = False
        for line in old:
            if not showing:
                stamp = _line_time(line)
                showing = stamp is not None and stamp >= after
            if showing:
                sys.stdout.write(printable(line))
    return showing


def _rotated(path: Path, f: IO[str]) -> IO[str] | None:
    """The file `path` names now, opened, when it is another than the open `f`: the pod rotated
    its log (past 16 MiB it renames it `<name>.log.1` and writes a new `<name>.log`, at its
    start or while it runs), so `-f` follows the name, as `tail -F` does; reading on in `f`
    showed no line again. None while it is the same file, or there is no new one yet."""
    try:
        named = os.stat(path)
        held = os.fstat(f.fileno())
        if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return None
        return path.open("r", errors="replace")
    except OSError:
        return None


# --- version --------------------------------------------------------------------------------


def version_text() -> str:
    from poddaemon import version_line

    return version_line("podctl") + "\n"


__all__ = [
    "logs",
    "restart",
    "stop_unit_pod",
    "unit_of_pid",
    "version_text",
    "wait",
]


# --- registered on podctl when cli/main.py imports this module ---------------------------------


def _register() -> None:
    from cli.unit import unit_app

    app.add_typer(unit_app, name="unit")
    for command in (logs, wait, restart):
        app.command()(command)


_register()
