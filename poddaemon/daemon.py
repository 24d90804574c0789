"""`poddaemon run MANIFEST`: validate, claim the scope, listen, serve, release.

Start-up fails fast, with one clear line on stderr and exit status 1, on anything a user can
fix: a bad manifest, a missing API key, a pwd outside the scope, a template error, a registry
conflict, a session that cannot be restored, a directory another user could tamper with.

Exit status (SPEC §7): 0 only after a requested shutdown (the `shutdown` call, SIGTERM, SIGINT,
SIGHUP); 1 after any failure: a session log that cannot be written, a lost registry claim or
socket, a crash. A supervisor's `Restart=on-failure` then restarts the pod.

Shutdown gives the name up first: once the pod has stopped its run and closed its log, the
socket and pid files go, then the registry entry (so `podctl stop p; podctl spawn m.toml` works
at once), and only then does the process exit, at once: without waiting for threads that
cancelled calls left behind (an SDK import can take half a second), nor for the interpreter to
tear its modules down (up to 800 ms with the anthropic SDK loaded).
"""

import asyncio
import contextlib
import errno
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poddaemon import collector, readyline, sdnotify
from protocol import paths
from protocol.errors import os_error_line

if TYPE_CHECKING:
    import argparse

    from poddaemon.config.manifest import Manifest
    from poddaemon.sandbox.pod import PodSandbox
    from poddaemon.scope import Rule, Scope

log = logging.getLogger("poddaemon")

USUAL_START = 30.0  # seconds start-up takes at most without them (podctl waits as much)
EXIT_OK = 0
EXIT_FAILURE = 1
# Each asks for a shutdown: SIGHUP too, when the terminal of a pod run in the foreground closes.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
CLAIM_CHECK_INTERVAL = 0.5  # seconds between looks at pods.json (a stat; a read when it changed)


class StartupError(Exception):
    """The pod does not start. `lasting`: starting it again as it is changes nothing (its
    manifest, a name or scope taken, a session it cannot restore): it exits EXIT_REFUSED, which
    a unit does not restart. Otherwise (the disk, a server that did not come up) exit 1."""

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # what a restart would not change


def _check_writable(directory: Path) -> None:
    """Session logs are made in `directory`: a pod that may not write there is refused now,
    not at its first input after READY (under a unit: restarted in a loop). A file made and
    removed (tens of µs, no fsync) says it as the first session's file would."""
    probe = directory / f".writable-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise StartupError(
            f"cannot write session logs in {directory}: {exc.strerror}",
            lasting=exc.errno in _NOT_WRITABLE,
        ) from None


# The options of `run`, and their defaults (argparse's Namespace for the same argv).
_RUN_DEFAULTS: dict[str, Any] = {
    "command": "run",
    "set": [],
    "session": None,
    "resume": False,
    "adopt": False,
    "callback": None,
    "stderr_log": False,
}
_RUN_FLAGS = {"--resume": "resume", "--adopt": "adopt", "--stderr-log": "stderr_log"}
_RUN_VALUES = {"--set": "set", "--session": "session", "--callback": "callback"}


def _parse_plain(argv: list[str]) -> "argparse.Namespace | None":
    """The common `run MANIFEST [options]` without argparse (~5 ms of every pod's start to
    import and build): exact option spellings only; anything else (help, abbreviations,
    `--opt=value`, a repeated or conflicting option) returns None and goes to argparse."""
    if len(argv) < 2 or argv[0] != "run" or argv[1].startswith("-"):
        return None
    ns: dict[str, Any] = {**_RUN_DEFAULTS, "set": [], "manifest": argv[1]}
    seen: set[str] = set()
    rest = iter(argv[2:])
    for arg in rest:
        if arg in _RUN_FLAGS and arg not in seen:
            ns[_RUN_FLAGS[arg]] = True
        elif arg in _RUN_VALUES and (arg == "--set" or arg not in seen):
            value = next(rest, None)
            if value is None or value.startswith("-"):
                return None
            if arg == "--set":
                ns["set"].append(value)
            else:
                ns[_RUN_VALUES[arg]] = value
        else:
            return None
        seen.add(arg)
    if ns["resume"] and ns["session"] is not None:
        return None  # mutually exclusive: argparse says so
    import types

    return types.SimpleNamespace(**ns)  # type: ignore[return-value]


def parse_args(argv: list[str] | None) -> "argparse.Namespace":
    plain = _parse_plain(sys.argv[1:] if argv is None else argv)
    if plain is not None:
        return plain
    import argparse

    from poddaemon import version_line

    parser = argparse.ArgumentParser(prog="poddaemon", description="Run one pod.")
    # Which build a unit runs (its `ExecStart=` names an installation, not a version).
    parser.add_argument("--version", action="version", version=version_line("poddaemon"))
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pod in the foreground")
    run.add_argument("manifest")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--session", metavar="ID", help="restore this session")
    group.add_argument(
        "--resume", action="store_true", help="restore the session this pod wrote last"
    )
    run.add_argument("--adopt", action="store_true", help="started by a parent pod")
    run.add_argument("--callback", metavar="SOCKET", help="the spawner's socket")
    run.add_argument(
        "--stderr-log",
        action="store_true",
        help="after READY, move stderr to <log>/<name>.log, linked from "
        "<runtime>/pods/<name>/stderr.log (used by podctl spawn)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM and SIGINT mean shutdown (SPEC §7), and SIGHUP too (the terminal of a pod run in
    # the foreground closed), while starting too: until the event loop takes them over (see
    # amain), they interrupt start-up and the pod exits 0.
    for sig in (signal.SIGTERM, signal.SIGHUP):  # (SIGINT: Python's own, unless ignored)
        signal.signal(sig, signal.default_int_handler)
    sdnotify.claim()
    # Killed for a fatal signal, the pod says where each thread was: the watchdog's SIGABRT
    # (WatchdogSec=: a wedged event loop) left only "dumped core" in the journal, no word of
    # what held the loop, and a restart that wedges again the same way.
    faulthandler.enable(all_threads=True)
    paths.absolute_env()  # before a hook, command or child pod inherits them
    args = parse_args(argv)
    # The model thread parses streams while the loop answers clients; a waiting thread gets the
    # GIL only after this interval (default 5 ms), which an ack would pay several times over.
    sys.setswitchinterval(float(os.environ.get("PODDAEMON_SWITCH", "0.00005")))
    logging.basicConfig(
        level=os.environ.get("PODDAEMON_LOG_LEVEL", "INFO").upper(),
        format="%(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpx2", "openai", "anthropic"):  # one INFO line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    sdnotify.use_journal_prefixes("poddaemon[%(process)d]")
    if args.stderr_log:
        _said_before_ready.start()
    try:
        code = run_pod(args)
    except StartupError as exc:
        print(f"{_err_prefix()}poddaemon: {exc}", file=sys.stderr, flush=True)
        code = readyline.EXIT_REFUSED if exc.lasting else EXIT_FAILURE
        _status_why("refused" if exc.lasting else "failed", str(exc))
    except OSError as exc:  # e.g. a permission problem nobody foresaw: one line, no traceback
        print(f"{_err_prefix()}poddaemon: {os_error_line(exc)}", file=sys.stderr, flush=True)
        code = EXIT_FAILURE
        _status_why("failed", os_error_line(exc))
    except KeyboardInterrupt:  # a stop signal before the event loop ran (see above)
        log.info("stopped while starting")
        code = EXIT_OK
    for sig in STOP_SIGNALS:  # the pod is gone: nothing left to interrupt
        signal.signal(sig, signal.SIG_IGN)
    _exit_at_once(code)
    return code


def _status_why(outcome: str, why: str) -> None:
    """Under systemd, the unit's status line (`systemctl --user status`: `Status: "refused:
    …"`) says why the pod did not start: read by `podctl unit install --now` and `restart`, and
    by a user who may not read the journal (a volatile one, outside group systemd-journal)."""
    sdnotify.notify(f"STATUS={outcome}: {' '.join(why.split())}")


def _err_prefix() -> str:
    """`<3>` (err) where stderr is the journal, so `journalctl -p err` shows why it ended."""
    return "<3>" if sdnotify.stderr_is_journal() else ""


TAKE_BACK_TRIES = 6  # passes (CLAIM_CHECK_INTERVAL apart) a pod tries to register again
RELEASE_LOCK_TIMEOUT = 2.0  # seconds a stopping pod waits for the registry lock
MIN_OPEN_FILES = 64  # an idle pod holds ~25 (its loops, socket, log, the SDK's), then clients
OPEN_FILES = 4096  # what a pod raises its soft limit to, when the hard one allows


def _raise_open_file_limit() -> None:
    """Raise the soft open-file limit toward the hard one, as Go's runtime does: a pod holds a
    descriptor per client, MCP server and child, and at a soft limit of 64 idle clients could
    starve its model connection. A limit too low to run at all (its event loop could not even
    start) refuses the pod in one line, before it claims anything."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        raise StartupError(
            f"the open-file limit (ulimit -n) is {soft}; a pod needs at least {MIN_OPEN_FILES}"
        )


def _exit_at_once(code: int) -> None:
    """Exit now, without the interpreter's own shutdown.

    By now everything the pod owns is persisted and given up. What that shutdown would still
    do costs and serves nothing: join a thread a cancelled run left behind (an SDK import, a
    blocking read whose result nobody wants: concurrent.futures' atexit hook), and tear down
    every module, which takes 130 ms with the openai SDK loaded and 350-800 ms with anthropic
    (`make bench`, section stop). Only our log handlers and stdio need flushing first.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a reader that went away
            stream.flush()
    os._exit(code)


def _own_dirs() -> tuple[str, ...]:
    """This user's poddaemon directories, resolved, and wherever a mount shows them too (a
    bind mount of the data dir inside the scope): no tool or command may touch them."""
    from poddaemon.registry import read_mounts
    from poddaemon.scope import aliases

    own = (paths.data_dir(), paths.runtime_dir(), paths.log_dir(), paths.config_dir())
    dirs = [os.path.realpath(d) for d in own]
    mounts = read_mounts()
    return tuple(dict.fromkeys(dirs + [a for d in dirs for a in aliases(d, mounts)]))


def run_pod(args: "argparse.Namespace") -> int:
    import msgspec

    _raise_open_file_limit()
    # Another user's home is refused as such before its defaults.toml is read (that read said
    # only "permission denied").
    paths.check_private_dirs()

    from poddaemon.config.load import ManifestError, load_manifest, pwd_problem
    from poddaemon.llm import CredentialsError, check_manifest_credentials
    from poddaemon.prompt import PromptError, load_instruction
    from poddaemon.scope import Access, Scope, resolve
    from poddaemon.tools import BUILTIN_NAMES

    try:
        manifest = load_manifest(args.manifest, args.set, paths.defaults_path())
    except ManifestError as exc:
        raise StartupError(str(exc)) from None
    _refuse_foreign_files(manifest)
    from poddaemon.mcp import preload_sdk

    preload_sdk(manifest)  # the SDK import overlaps the rest of start-up
    try:
        check_manifest_credentials(manifest)
        instruction = load_instruction(
            manifest.worker.instruction,
            manifest.worker.instruction_file,
            manifest.instruction_source or manifest.source,
        )
    except CredentialsError as exc:
        raise StartupError(f"{manifest.source}: {exc}") from None
    except PromptError as exc:  # already names the manifest or the instruction file
        raise StartupError(str(exc)) from None
    missing = [t for t in manifest.worker.tools if t not in BUILTIN_NAMES]
    if missing:
        raise StartupError(
            f"{manifest.source}: worker.tools: {', '.join(missing)} not available in this version"
        )
    pwd = resolve(manifest.pod.pwd, "/")
    problem = pwd_problem(manifest, pwd)
    if problem is not None:
        raise StartupError(problem)
    scope = Scope.from_config(manifest.scope.allow, manifest.scope.deny, cwd=manifest.pod.pwd)
    scope = msgspec.structs.replace(scope, private=_own_dirs())
    if scope.access(pwd) < Access.READ:
        if msgspec.structs.replace(scope, private=()).access(pwd) >= Access.READ:
            # Not the scope's doing: "not readable under the pod's scope" with a scope that
            # covers it left the user nowhere to look.
            raise StartupError(
                f"{manifest.source}: pod.pwd: {pwd} is inside poddaemon's own directories "
                f"({', '.join(scope.private)}), which no pod may use, whatever its scope says"
            )
        targets = ", ".join(f"{r.target} ({r.access.name.lower()})" for r in scope.allow)
        raise StartupError(
            f"{manifest.source}: pod.pwd: {pwd} is not readable under the pod's scope "
            f"(scope.allow resolves to {targets or 'nothing'}; relative targets are relative "
            f"to pod.pwd)"
        )
    for i, rule in enumerate(scope.allow):  # a typo, most likely: say so, it may appear later
        if not os.path.exists(rule.target):
            _warn(f"{manifest.source}: scope.allow[{i}].target: {rule.target} does not exist")
        elif rule.access is Access.WRITE and (shared := _shared_with_others(rule.target)):
            # SPEC §4 refuses overlapping write scopes, but the registry is this user's: a pod
            # of another user's writing the same tree starts without a word from either.
            _warn(
                f"{manifest.source}: scope.allow[{i}]: {rule.target} {shared}: pods of other "
                "users (not in this user's registry) may write there too, unchecked"
            )
        if rule.access is Access.WRITE and rule.target == "/" and rule.recursive:
            # The registry gives it all: a mistake (a relative target with one `..` too many)
            # or not, the user should hear it before another pod is refused for it.
            _warn(
                f"{manifest.source}: scope.allow[{i}]: write access to / (the whole "
                "filesystem): while it runs, any other pod's write scope overlaps it and is "
                "refused (its own children's excepted)"
            )
        if rule.access is Access.WRITE and "bash" in manifest.worker.tools:
            for own in scope.private:
                if rule.covers(own):  # the file tools refuse it; the kernel cannot fully
                    _warn(
                        f"{manifest.source}: scope.allow[{i}]: writable, it covers poddaemon's "
                        f"own directory {own}: bash can still create, remove or rename "
                        "entries there (Landlock cannot carve a writable tree)"
                    )
    _warn_rewritable(manifest, scope)

    box = _sandbox(manifest, scope, pwd, _hook_scripts(manifest))
    try:
        return _claim_and_serve(args, manifest, scope, instruction, box)
    finally:
        box.close()  # its temp dir: a start refused here leaves none behind either


def _claim_and_serve(
    args: "argparse.Namespace",
    manifest: "Manifest",
    scope: "Scope",
    instruction: object,
    box: "PodSandbox",
) -> int:
    """Claim the name and scope in the registry, then serve until the pod stops."""
    from poddaemon.registry import (
        Registry,
        RegistryBusy,
        RegistryConflict,
        RegistryError,
        make_entry,
    )
    from poddaemon.sandbox.pod import replace_leftover

    name = manifest.pod.name
    try:
        _, runtime = paths.ensure_private_dirs()
    except OSError as exc:
        raise StartupError(os_error_line(exc), lasting=False) from None
    pod_dir = paths.pod_dir(name)
    sock_path = pod_dir / "sock"
    problem = paths.socket_path_problem(sock_path)
    if problem:
        raise StartupError(problem)
    registry = Registry(runtime, sessions_dir=paths.sessions_dir())
    session_id = _session_to_restore(args, name, registry)
    try:
        parent, spawner_entry = _spawner(args, registry)
    except RegistryError as exc:  # a corrupt pods.json, read for the spawner: as register says
        busy = isinstance(exc, RegistryBusy)
        raise StartupError(f"cannot start pod {name!r}: {exc}", lasting=not busy) from None
    if parent is not None and spawner_entry is None:
        _refuse_orphan_start(args, manifest, parent)
    # The session is claimed with the name, in one locked transaction: no two pods restore it.
    entry = make_entry(name, str(sock_path), scope, parent=parent, session=session_id)
    try:
        registry.register(entry)
    except (RegistryConflict, RegistryError) as exc:
        # A lock a stuck process held is no lasting refusal: under a unit, exit 1 has systemd
        # try again (Restart=on-failure), where 78 left the pod down once the holder was gone.
        busy = isinstance(exc, RegistryBusy)
        raise StartupError(f"cannot start pod {name!r}: {exc}", lasting=not busy) from None
    claim = Claim(registry, entry, pod_dir)
    claim.spawner = spawner_entry
    try:
        try:
            paths.ensure_dir(pod_dir)
            paths.write_private(pod_dir / "pid", f"{os.getpid()}\n")
            replace_leftover(pod_dir / "tmpdir", name, box.tmpdir)
            _keep_config(manifest, args.callback if args.adopt else None)
        except OSError as exc:  # (a full disk: said as the registry's failure is)
            said = f"cannot start pod {name!r}: {os_error_line(exc)}"
            raise StartupError(said, lasting=False) from None
        return _serve(args, manifest, scope, claim, instruction, session_id, box)
    finally:
        claim.release()  # once only: on the normal path _serve gave it up already


class Claim:
    """What a running pod holds: its registry entry (name, scope, session) and its files
    `<runtime>/pods/<name>/{sock,pid}`. Given up once, files first: the moment the entry goes,
    a new pod of this name may bind the same socket path, and must not lose it to our cleanup."""

    def __init__(self, registry: Any, entry: Any, pod_dir: Path) -> None:
        from poddaemon.registry import PodEntry, Registry

        assert isinstance(registry, Registry) and isinstance(entry, PodEntry)
        self.registry = registry
        self.entry = entry
        self.pod_dir = pod_dir
        self.sock_path = pod_dir / "sock"
        self.released = False
        self.lost = False
        self.sock_ino: int | None = None  # the socket we bound (see socket_gone)
        self.spawner: PodEntry | None = None  # the live spawner we started under, if any

    def still_held(self) -> bool:
        """True while pods.json names this process for this pod (a dead or reused pid never
        passes `get`; another process's entry under our name is someone else's claim)."""
        held = self.registry.get(self.entry.name)
        return held is not None and (held.pid, held.start_time) == (
            self.entry.pid,
            self.entry.start_time,
        )

    def take_back(self, session: str | None, children: Mapping[str, list["Rule"]]) -> bool:
        """Register this pod again when its entry went from pods.json (the file removed, emptied
        or rewritten: what one does with a corrupt registry) and nobody has taken its name or
        an overlapping scope since. True when the entry is ours again."""
        import msgspec

        from poddaemon.registry import RegistryError

        # Its live children's areas stay theirs (delegated), registered again yet or not, and
        # so do those of descendants found registered (adopted).
        areas = [rule for rules in children.values() for rule in rules]
        entry = msgspec.structs.replace(self.entry, session=session).delegating(areas)
        try:
            self.entry = self.registry.register(entry, kin=list(children), returning=True)
        except RegistryError as exc:
            # Refused because our entry is there again: a transaction that read pods.json
            # before it was replaced wrote it back meanwhile ("a pod named … is already
            # running", our own pid). Ours, not lost.
            with contextlib.suppress(RegistryError):
                if self.still_held():
                    return True
            log.warning("cannot register the pod again (yet): %s", exc)
            return False
        return True

    def entry_gone(self) -> bool:
        """No live process holds this pod's name (its entry is gone, not taken over)."""
        from poddaemon.registry import RegistryError

        try:
            return self.registry.get(self.entry.name) is None
        except RegistryError:
            return False

    def socket_gone(self) -> bool:
        """True when the socket we bound was removed or replaced: no client can reach us."""
        if self.sock_ino is None:
            return False  # not bound yet
        try:
            return os.stat(self.sock_path).st_ino != self.sock_ino
        except (FileNotFoundError, NotADirectoryError):  # (its directory replaced by a file)
            return True
        except OSError:
            return False  # cannot look right now; not proof of anything

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        pid_file = self.pod_dir / "pid"
        with contextlib.suppress(OSError):
            if pid_file.read_text().strip() == str(self.entry.pid):
                pid_file.unlink()
        if self.lost:
            return  # the name may be someone else's now: leave their socket and entry alone
        if not self.socket_gone():  # (a file put in its place is not ours to remove)
            with contextlib.suppress(OSError):
                self.sock_path.unlink()
        from poddaemon.registry import Registry, RegistryError

        # Not the full lock wait: an entry left behind is stale once this process is gone (the
        # next transaction reclaims it), and a stop should not wait on a stuck lock holder.
        registry = Registry(
            self.registry.runtime_dir,
            lock_timeout=RELEASE_LOCK_TIMEOUT,
            sessions_dir=self.registry.sessions_dir,
        )
        try:
            registry.release(self.entry.name, self.entry.pid)
        except RegistryError as exc:
            log.error("could not release the registry entry (left stale): %s", exc)


def _keep_config(manifest: object, callback: str | None = None) -> None:
    """`<data>/pods/<name>.toml`: the fully resolved manifest, so `podctl restart` can start the
    same pod again whatever happened to the file it came from (SPEC §2). A child also keeps
    `<name>.callback` (its spawner's socket), so a restarted child reports to it again."""
    from poddaemon.config.manifest import Manifest

    assert isinstance(manifest, Manifest)
    config = paths.kept_config(manifest.pod.name)
    paths.ensure_dir(config.parent)
    _replace_file(config, manifest.to_toml())
    sidecar = paths.kept_callback(manifest.pod.name)
    if callback is None:
        with contextlib.suppress(FileNotFoundError):
            sidecar.unlink()
    else:
        _replace_file(sidecar, callback + "\n")


def _replace_file(target: Path, text: str) -> None:
    """Write `target` whole, through a temporary file renamed over it. A failure (a full
    disk) names `target` and leaves no temporary file behind."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        paths.write_private(tmp, text)  # a kept configuration grants scope on restart
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(exc.errno, exc.strerror, str(target)) from None


def _spawner(args: "argparse.Namespace", registry: Any) -> tuple[str | None, Any]:
    """`--adopt --callback SOCKET`: the name of the live pod serving SOCKET (our parent), and
    its entry (None when it is not running). A
    spawner that is not running (a child restarted while it is down) is still named by its
    socket path, `<runtime>/pods/<name>/sock`: our entry keeps it as parent, so the spawner
    takes us back (and our area stays delegated) when it is restored; our reports wait in our
    log until then. Without that name the restored spawner's write scope would clash with
    ours and it could not start at all."""
    if not args.callback:
        return None, None
    if not args.adopt:
        raise StartupError("--callback needs --adopt")
    callback = os.path.abspath(args.callback)
    for entry in registry.live():
        if os.path.abspath(entry.socket) == callback:
            return str(entry.name), entry
    name = os.path.basename(os.path.dirname(callback))
    if paths.POD_NAME_RE.match(name) and os.path.abspath(paths.socket_path(name)) == callback:
        return str(name), None
    return None, None


def _refuse_orphan_start(args: "argparse.Namespace", manifest: "Manifest", parent: str) -> None:
    """A child its spawner's spawn_pod started (`--adopt --callback` without `--resume` or
    `--session`: `podctl restart` of a child always resumes) whose spawner is gone by the time
    the child looks for it: the spawner died (kill -9, a crash) while the child started up. With
    on_parent_exit = "stop" the child stops with its spawner, so it does not start: taking the
    spawner for one a `podctl restart` of the child found down, it waited for it to come back,
    and ran on for good, holding its area, with no task and nobody to report to. A spawner that
    lives but is missing from pods.json (removed: it registers again) still takes connections
    on its socket: the child then starts, and follows it once it is back."""
    if args.resume or args.session or manifest.spawn.on_parent_exit != "stop":
        return
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(os.path.abspath(args.callback))
            return
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTDIR):
                return  # (its backlog full, say): not proof that it went
    raise StartupError(
        f"its spawner {parent!r} is not running (it went while this child started up); "
        'with spawn.on_parent_exit = "stop" the child does not start without it'
    )


def _refuse_foreign_files(manifest: "Manifest") -> None:
    """Refuse a pwd named through another user's symlink, and an instruction file, hook script
    or MCP server another user owns or could change or swap (`files_problem`). The pod checks
    where such a path leads at start-up, then goes on using it as written: hooks ran
    `<pwd>/hooks/guard.sh` wherever the link's owner had pointed it since, and another user's
    own script ran as you (an MCP server outside any sandbox)."""
    found = paths.foreign_symlink(Path(manifest.pod.pwd))
    if found is not None:
        link, uid = found
        raise StartupError(
            f"{manifest.source}: pod.pwd: {manifest.pod.pwd} is reached through the symlink "
            f"{link}, owned by uid {uid}, who could repoint it while the pod runs: refusing it"
        )
    from poddaemon.config.load import files_problem

    problem = files_problem(manifest)
    if problem is not None:
        raise StartupError(problem)


def _warn_rewritable(manifest: "Manifest", scope: "Scope") -> None:
    """Files read at the pod's next start that the pod itself may rewrite: whatever it writes
    there is outside its confinement then (SPEC §3 [sandbox]), as the kernel cannot tell."""
    from poddaemon.sandbox.policy import may_replace

    commands = "bash" in manifest.worker.tools
    if manifest.source and may_replace(manifest.source, scope, commands):
        _warn(
            f"{manifest.source}: the pod may rewrite its own manifest (it lies in its write "
            "scope): the scope, sandbox, hooks and MCP servers it writes there are what its next "
            "start from this file (podctl spawn, its systemd unit) gets; keep it outside"
        )
    if not any(server.command for server in manifest.mcp.servers):
        return
    from poddaemon.mcp.connection import rewritable_files

    for i, server in enumerate(manifest.mcp.servers):
        for path in rewritable_files(server, manifest.pod.pwd, scope, commands):
            _warn(
                f"{manifest.source}: mcp.servers[{i}].command: {path} lies in the pod's write "
                "scope, and the server runs outside the sandbox: what the pod writes there runs "
                "with your rights at its next start; keep it outside"
            )


def _hook_scripts(manifest: Any) -> list[str]:
    """The script files hook commands run (`./guard.sh`, `bash ./guard.sh`). One that is missing
    or not executable would fail every run (exit 127 or 126: a warning, and the guard lets
    everything through): a start-up error instead."""
    scripts = []
    for event in manifest.hooks.__struct_fields__:
        for i, hook in enumerate(getattr(manifest.hooks, event)):
            found = hook.script_word()
            if found is None:
                continue
            where = f"{manifest.source}: hooks.{event}[{i}].command"
            if not os.path.isfile(found.path):
                raise StartupError(f"{where}: {found.path} does not exist (or is not a file)")
            if found.direct and not os.access(found.path, os.X_OK):
                raise StartupError(f"{where}: {found.path} is not executable (chmod +x)")
            scripts.append(found.path)
            if found.interpreter is not None:  # `/opt/py/bin/python3 g.py`: it runs too
                if not os.access(found.interpreter, os.X_OK) or os.path.isdir(found.interpreter):
                    raise StartupError(f"{where}: {found.interpreter} is not an executable file")
                scripts.append(found.interpreter)
    return scripts


def _sandbox(manifest: "Manifest", scope: "Scope", pwd: str, scripts: list[str]) -> "PodSandbox":
    """The pod's sandbox (SPEC §3 [sandbox]): `enforce` without Landlock is a start-up error.
    `scripts`: hook scripts its commands may read and run wherever they are."""
    from poddaemon.sandbox import SandboxUnavailable
    from poddaemon.sandbox.pod import pod_sandbox
    from poddaemon.sandbox.policy import manager_sockets, root_secrets

    tools = manifest.worker.tools
    try:
        return pod_sandbox(
            name=manifest.pod.name,
            mode=manifest.sandbox.mode,
            network=manifest.sandbox.network,
            scope=scope,
            pwd=pwd,
            # Commands never touch this user's session logs, registry, sockets' directories
            # and keys (the config directory's env file), nor read root's secrets in /etc, nor
            # have the service manager start what they like outside the sandbox. (The scope's
            # private directories are those: `_own_dirs()`, worked out once per start.)
            protect=list(scope.private),
            hide=root_secrets() + manager_sockets(),
            commands="bash" in tools or manifest.hooks.any(),
            scripts=scripts,
        )
    except SandboxUnavailable as exc:
        raise StartupError(f"{manifest.source}: {exc}") from None


def _session_to_restore(args: "argparse.Namespace", name: str, registry: Any) -> str | None:
    if args.session:
        from poddaemon.store.file import session_path

        sid = str(args.session)
        sessions = paths.sessions_dir()
        try:
            path = session_path(sessions, sid)
        except ValueError as exc:
            raise StartupError(f"--session: {exc}") from None
        if not path.exists():
            raise StartupError(f"--session: no session {sid} under {sessions}")
        if not path.is_file():  # there, but a fifo or a directory: not "no session"
            raise StartupError(f"--session: {path}: not a regular file")
        with contextlib.suppress(OSError):  # (unreadable: the restore says why)
            if path.stat().st_size == 0:
                # A file made ahead of a first input that never came (its pod was killed
                # first): no entry, no conversation, nothing acknowledged to continue.
                raise StartupError(
                    f"--session: session {sid} has no entries (an empty file a pod made "
                    "ahead of a first input that never came): nothing to restore; start "
                    "without --session for a new session, or with --resume"
                )
        return sid
    if args.resume:
        from poddaemon.store.file import damaged_continuations, session_to_resume

        found, unreadable = session_to_resume(paths.sessions_dir(), name)
        later = damaged_continuations(paths.sessions_dir(), found, unreadable) if found else []
        if later:
            # Its continuation is damaged, not gone: continuing `found` would branch the chain
            # and leave what was acknowledged there unprocessed (SPEC §8: an error, not a skip).
            raise StartupError(
                f"--resume: session {found} is continued by session {later[0]}, whose first "
                "line is damaged (`podctl sessions verify` names it): repair it, or start with "
                "--session ID"
            )
        held = _last_held_session(registry, name)
        if held in unreadable:
            # Its own, by what it held when it died: starting without it would leave what it
            # acknowledged there unprocessed (SPEC §8: an error, not a skip).
            raise StartupError(
                f"--resume: session {held}, which pod {name!r} held when it stopped (its entry "
                "in pods.json says so), has a damaged first line (`podctl sessions verify` "
                "names it): what it acknowledged is there; repair it, or move it out of "
                f"{paths.sessions_dir()} to start without it"
            )
        if unreadable:
            which = f"continuing {found}, but" if found else "no session of this pod, and"
            _warn(
                f"--resume: {which} session log(s) {', '.join(unreadable)} written since name "
                "no pod (a damaged first line, a copy of another session, or not a readable "
                "file): if one is this pod's, what it acknowledged is there; repair it, or start "
                "with --session ID"
            )
        return found  # None: no session yet, so start one (a unit always passes --resume)
    return None


def _last_held_session(registry: Any, name: str) -> str | None:
    """The session the last process of `name` held, when its entry is still in pods.json and
    that process is gone (a crash: no later transaction reclaimed the entry yet)."""
    from poddaemon.registry import RegistryError, is_alive

    try:
        entry = registry.entry(name)
    except RegistryError:  # a corrupt registry: register says so next
        return None
    if entry is None or is_alive(entry):
        return None
    return str(entry.session) if entry.session is not None else None


def _serve(
    args: "argparse.Namespace",
    manifest: object,
    scope: object,
    claim: Claim,
    instruction: object,
    session_id: str | None,
    box: Any,
) -> int:
    from poddaemon.config.manifest import Manifest
    from poddaemon.events import EventBus
    from poddaemon.llm import make_client
    from poddaemon.llm.threaded import ThreadedModel
    from poddaemon.pod import Pod, Services
    from poddaemon.prompt import Instruction, PromptError
    from poddaemon.scope import Rule, Scope
    from poddaemon.server import RpcServer
    from poddaemon.store.file import remove_leftovers
    from poddaemon.store.log import LogCorrupt
    from poddaemon.toolset import Toolset

    assert isinstance(manifest, Manifest) and isinstance(scope, Scope)
    assert isinstance(instruction, Instruction)
    try:
        sessions_dir = paths.ensure_dir(paths.sessions_dir(), "sessions directory")
    except OSError as exc:
        raise StartupError(os_error_line(exc), lasting=False) from None
    _check_writable(sessions_dir)
    bus = EventBus(first_seq=time.time_ns() // 1000)  # see EventBus: cursors of earlier lives
    services = Services(
        manifest=manifest,
        scope=scope,
        registry=claim.registry,
        entry=claim.entry,
        bus=bus,
        sessions_dir=str(sessions_dir),
        instruction=instruction,
        tools=Toolset.from_names(manifest.worker.tools),
        model=ThreadedModel(make_client(manifest.provider)),
        compaction_model=(
            ThreadedModel(make_client(manifest.compaction.provider))
            if manifest.compaction is not None and manifest.compaction.provider is not None
            else None
        ),
        callback=os.path.abspath(args.callback) if args.adopt and args.callback else None,
        sandbox=box,
    )
    sock_path = claim.sock_path

    async def amain() -> int:
        from poddaemon.mcp import McpStartupError, start_mcp

        loop = asyncio.get_running_loop()
        starting = asyncio.current_task()
        assert starting is not None
        for sig in STOP_SIGNALS:  # until READY: stop starting (see below)
            loop.add_signal_handler(sig, starting.cancel)

        def alert(level: str, source: str, message: str) -> None:
            log.warning("%s", message)
            bus.publish("alert", {"level": level, "source": source, "message": message})

        if allowance := _startup_allowance(manifest):
            _say(f"{readyline.STARTING}\t{allowance:g}")
            # systemd's TimeoutStartSec (90 s by default) is extended likewise.
            sdnotify.notify(f"EXTEND_TIMEOUT_USEC={int((allowance + USUAL_START) * 1e6)}")
        # Servers start while the pod restores and binds; READY waits for them.
        mcp_start = asyncio.ensure_future(start_mcp(manifest, alert))
        checking = _preflight(manifest)  # (in a thread, while the pod is built)
        try:
            pod = Pod(services)
        except PromptError as exc:  # a variable the template names but has not: one line
            raise StartupError(str(exc)) from None
        if session_id is not None:
            try:
                warnings = await pod.restore(session_id)
            except LogCorrupt as exc:  # the way on, too: the file is the user's to mend
                raise StartupError(
                    f"cannot restore session {session_id}: {exc}; nothing was written to it: "
                    "repair that line, or move the file out of the sessions directory to start "
                    "from the session before it (or afresh), its unprocessed input left undone"
                ) from None
            except (FileNotFoundError, ValueError) as exc:
                raise StartupError(f"cannot restore session {session_id}: {exc}") from None
            except OSError as exc:
                raise StartupError(
                    f"cannot restore session {session_id}: {os_error_line(exc)}",
                    lasting=exc.errno in _NOT_WRITABLE,
                ) from None
            for warning in warnings:
                pod.alert("warning", warning)
        for warning in await checking:
            _provider_warning(pod, warning)
        if manifest.sandbox.mode == "best_effort" and box.status == "none":
            pod.alert("warning", "; ".join(box.notes), source="sandbox")
        if pod.hooks is not None and pod.hooks.wants("SessionStart"):
            if session_id is None:  # the hook is told the session the first input will start
                await pod.reserve_session()
            context = await pod.hooks.session_start("resume" if session_id else "startup")
            if context:
                # (this start's output stands for the state now: an earlier start's, unread,
                # is stale)
                pod.feed(pod.machine.add_context(context, "hook:SessionStart", replaces=True))
        try:
            mcp = await mcp_start
        except McpStartupError as exc:
            raise StartupError(str(exc), lasting=exc.lasting) from None
        for tool in mcp.tools.values():
            services.tools.add(tool)
        _check_tool_count(pod, manifest.provider.kind, len(services.tools))
        pod.mcp = mcp
        pod.children.adopt()  # a restored spawner takes its live children back
        pod.start_work()  # (restored work waited for the SessionStart context and MCP tools)
        ending = Ending(pod.request_shutdown, lambda: pod.pod_state == "stopping")
        handlers = pod.handlers()
        handlers["shutdown"] = ending.wrap_shutdown(handlers["shutdown"])
        server = RpcServer(handlers, bus, before_send=pod.plog.flush)
        try:
            await server.listen(sock_path)
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {sock_path}: {os_error_line(exc)}", lasting=False
            ) from None
        claim.sock_ino = os.stat(sock_path).st_ino
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, ending.request)
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # `kill -USR1 PID`: what it awaits
        # The log file and its link are there before READY (`podctl spawn x && podctl logs x`);
        # stderr moves to it after, once READY is in the pipe the spawner reads.
        log_file = (
            _open_stderr_log(manifest.pod.name, sock_path.parent) if args.stderr_log else None
        )
        _say(f"{readyline.READY}\t{manifest.pod.name}\t{sock_path}")
        kept_log = None
        if log_file is not None:
            kept_log, fd = log_file
            _stderr_to(fd)
            _said_before_ready.replay()
        sdnotify.notify("READY=1")
        collector.resume()  # paused since the process started (poddaemon/__main__.py)
        log.info("ready on %s (session %s)", sock_path, pod.state.session_id or "not yet started")
        supervisor = asyncio.create_task(sdnotify.supervise(pod))
        registry_changed = asyncio.Event()
        tree = _follow_spawner(pod, claim, manifest, ending, registry_changed)
        pod.warm_up()
        # A crash's temp files, after READY: a directory of thousands of sessions took ~20 ms
        # to list. (A start that cannot remove them goes on.)
        with contextlib.suppress(OSError):
            remove_leftovers(sessions_dir, manifest.pod.name)

        def changed() -> None:
            pod.children.registry_changed()
            registry_changed.set()

        def lost(reason: str, name_lost: bool = True) -> None:
            claim.lost = name_lost
            source = "registry" if name_lost else "socket"
            bus.publish("alert", {"level": "error", "source": source, "message": reason})
            ending.fail(reason)

        def children() -> dict[str, list[Rule]]:  # live ones, and the areas they write
            return {
                name: list(c.write_areas())
                for name, c in pod.machine.state.children.items()
                if c.live
            }

        watch = asyncio.create_task(watch_claim(claim, lost, changed, pod.named_session, children))
        rotation = asyncio.create_task(keep_log_bounded(kept_log)) if kept_log else None
        try:
            await pod.serve()
            if pod.failure is not None and ending.failure is None:
                ending.failure = pod.failure  # said when it happened (Pod._fail), and stopped
        except Exception:
            log.exception("the pod failed")
            ending.fail("internal error (see the traceback above)")
        finally:
            watch.cancel()
            supervisor.cancel()
            if rotation is not None:
                rotation.cancel()
            if tree is not None:
                tree.cancel()
            sdnotify.stopping()
            # The run is stopped and the log closed: give the name up before anything slower
            # (the last replies' writing, MCP servers' exits).
            server.close()
            claim.release()
            await server.drain()
            await mcp.aclose()
        if ending.code != EXIT_OK:
            log.error("exiting with status %d: %s", ending.code, ending.why())
            return ending.code
        log.info("shut down")
        return ending.code

    try:
        return _run_loop(amain())
    except asyncio.CancelledError:  # a stop signal while starting: a requested stop
        log.info("stopped while starting")
        return EXIT_OK


def _follow_spawner(
    pod: Any, claim: Claim, manifest: Any, ending: "Ending", changed: asyncio.Event
) -> Any:
    """A child: deliver its reports, and stop with its spawner when on_parent_exit = "stop"
    (however the spawner ends, kill -9 included: its pidfd tells us at once). A child
    restarted while its spawner is down follows the spawner from when it is back (`changed`:
    pods.json changed), as that one takes it back."""
    if pod.outbox is None:
        return None
    pod.outbox.start()
    name = claim.entry.parent
    if not name or manifest.spawn.on_parent_exit != "stop":
        return None
    from poddaemon.outbox import watch_parent

    async def follow() -> None:
        from poddaemon.registry import RegistryError, is_alive

        def spawner() -> Any:
            try:
                return claim.registry.entry(name)
            except RegistryError:  # watch_claim says so; look again at the next change
                return None

        # The spawner that was live as we started is the one we follow, even when it is gone
        # by now: one kill -9ed while we started up (its spawn_pod waiting for our READY)
        # left us running for good, waiting for it to come back, under "stop".
        parent = claim.spawner
        if parent is None:  # restarted while it is down: follow it once it is back
            stale = spawner()  # a spawner that died before we started
            if stale is not None and is_alive(stale):
                stale = None
            while True:
                changed.clear()
                parent = spawner()
                if parent is not None and parent != stale:
                    break
                await changed.wait()

        def parent_gone() -> None:
            log.info("spawner %s (pid %d) is gone; stopping with it", parent.name, parent.pid)
            # Nobody to deliver to: its shutdown report (what it spent) waits in its log for
            # the restored spawner, which charged it its whole grant as "errored" without it.
            pod.outbox.enabled = False
            ending.request("parent exited")

        if is_alive(parent):
            await watch_parent(parent.pid, parent_gone)
        else:  # back, and gone again before we looked
            parent_gone()

    return asyncio.create_task(follow())


class Ending:
    """Why the pod stops, hence its exit status: 0 only when it was asked to stop (SPEC §7).

    A stop the pod decides on its own (its session log failed: it calls `request_shutdown`
    itself) or one `fail` records is a failure, so `Restart=on-failure` restarts it.
    """

    def __init__(
        self, request_shutdown: Callable[[str], None], stopping: Callable[[], bool]
    ) -> None:
        self._request_shutdown = request_shutdown
        self._stopping = stopping
        self.requested = False
        self.failure: str | None = None

    def request(self, reason: str = "requested") -> None:
        """A user or supervisor asks the pod to stop (the `shutdown` call, a stop signal), or
        its spawner went (`reason` "parent exited")."""
        if not self._stopping():  # already stopping on its own: that stop stays a failure
            self.requested = True
        self._request_shutdown(reason)

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("%s; the pod stops", reason)
        self._request_shutdown("failed")

    def wrap_shutdown(self, handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def shutdown(params: Any, conn: Any) -> Any:
            if not self._stopping():
                self.requested = True
            return handler(params, conn)

        return shutdown

    @property
    def code(self) -> int:
        return EXIT_OK if self.requested and self.failure is None else EXIT_FAILURE

    def why(self) -> str:
        return self.failure or "the pod stopped without being asked to (see the error above)"


async def watch_claim(
    claim: Claim,
    lost: Callable[..., None],
    changed: Callable[[], None] | None = None,
    session: Callable[[], str | None] | None = None,
    children: Callable[[], Mapping[str, list["Rule"]]] = dict,
) -> None:
    """Stop the pod if its registry entry is taken over (another process under its name, or
    its entry gone and its name or scope claimed meanwhile): it could no longer promise that
    its name and scope are its own. An entry only gone (pods.json edited or removed) is
    registered again, naming the pod's `session()`. Likewise stop if its socket goes: nobody
    could reach it, not even to stop it, while it holds name and scope (`lost(reason,
    name_lost=False)`: the entry is still ours to release). `changed` is called when pods.json
    changed and the entry is (again) ours. Registering again is tried TAKE_BACK_TRIES times,
    a pass apart, before the claim counts as lost: the pods of a tree register again in any
    order, and a grandchild back before its parent holds part of this pod's area meanwhile."""
    path = claim.registry.path
    seen: tuple[int, int, int] | bool | None = False  # False: not looked yet (None: no file)
    tries = TAKE_BACK_TRIES
    while True:
        await asyncio.sleep(CLAIM_CHECK_INTERVAL)
        if claim.socket_gone():
            lost(f"the pod's socket {claim.sock_path} was removed or replaced", name_lost=False)
            return
        try:
            st = os.stat(path)
            now: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            now = None
        except OSError:
            continue  # cannot look right now; not proof of anything
        if now == seen:
            continue
        seen = now
        from poddaemon.registry import RegistryError

        try:
            held = claim.still_held()
        except RegistryError as exc:
            log.warning("cannot check the registry entry: %s", exc)
            continue
        if not held and not (session is not None and claim.take_back(session(), children())):
            tries -= 1
            if session is not None and tries > 0 and claim.entry_gone():
                seen = False  # look again next pass, changed or not
                continue
            lost(
                f"lost the registry claim on pod {claim.entry.name!r}: its entry in "
                f"{path} is gone or belongs to another process"
            )
            return
        if not held:
            log.warning("the pod's entry was gone from %s; registered it again", path)
        tries = TAKE_BACK_TRIES
        if changed is not None:
            changed()


def _startup_allowance(manifest: "Manifest") -> float:
    """Seconds start-up may take on top of the usual: what the slowest MCP server may take to
    start or be given up on, or the SessionStart hooks' timeouts (they run meanwhile)."""
    hooks = sum(h.timeout for h in manifest.hooks.SessionStart)
    if not manifest.mcp.servers:  # the MCP client is loaded only for a pod with servers
        return hooks
    from poddaemon.mcp.connection import GIVE_UP

    return max(max(s.start_timeout + GIVE_UP for s in manifest.mcp.servers), hooks)


def _preflight(manifest: Any) -> "asyncio.Task[list[str]]":
    """Warnings (never a failure: the server may start later) about a base URL that cannot be
    right. Started now, in a thread (it may connect), for the caller to await later; as a task,
    so that a start-up that fails cancels it with the rest."""
    from poddaemon.llm.preflight import preflight

    provider = manifest.provider
    loop = asyncio.get_running_loop()
    checked = loop.run_in_executor(None, preflight, provider.kind, provider.base_url)

    async def warnings() -> list[str]:
        return await checked

    return asyncio.ensure_future(warnings())


def _check_tool_count(pod: Any, kind: str, count: int) -> None:
    from poddaemon.llm.preflight import too_many_tools

    if warning := too_many_tools(kind, count):
        _provider_warning(pod, warning)


def _provider_warning(pod: Any, message: str) -> None:
    _warn(message)  # stderr once (an alert would log it a second time): subscribers too
    pod.bus.publish("alert", {"level": "warning", "source": "provider", "message": message})


def _shared_with_others(path: str) -> str | None:
    """Why other users may write in the directory `path` (its owner, its mode), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o002:
        return f"is writable by others (mode {st.st_mode & 0o7777:04o})"
    return None


def _warn(message: str) -> None:
    """A start-up warning on stderr, where `podctl spawn` shows it to the user."""
    _said_before_ready.keep_warning(message)
    _say(f"poddaemon: warning: {message}")


def _say(line: str) -> None:
    """A line on stderr for whoever started the pod. If they are gone (`podctl spawn` killed,
    an ssh session dropped: the pipe has no reader), the pod runs on: stderr goes nowhere
    until READY moves it to stderr.log, where the warnings said meanwhile are said again."""
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, 2)  # what is still buffered is flushed there, and logging goes on
        os.close(nowhere)


class _SaidBeforeReady(logging.Handler):
    """What the pod logged before READY, while stderr is still `podctl spawn`'s: said again at
    the top of stderr.log, so `podctl logs` shows why an MCP server is missing a day later, and
    what it said while starting (spawn shows the head and tail of it, and points to the log:
    once, only warnings were kept, and a server's start-up lines were nowhere). A start that
    logs more than KEEP_BYTES (servers flooding their stderr) keeps only its warnings from
    there on: the lines are held in memory until READY."""

    KEEP_BYTES = 1024 * 1024

    def __init__(self) -> None:
        super().__init__()  # every record the root logger lets through, as stderr showed it
        self.lines: list[str] | None = None  # None: not keeping (no --stderr-log, or moved)
        self.room = self.KEEP_BYTES
        self.dropped = 0  # lines below WARNING not kept, once `room` was spent

    def start(self) -> None:
        self.lines = []
        root = logging.getLogger()
        shown = next((h for h in root.handlers if isinstance(h, logging.StreamHandler)), None)
        if shown is not None:  # the same lines as stderr shows
            self.setFormatter(shown.formatter)
        root.addHandler(self)

    def keep(self, line: str, level: int = logging.WARNING) -> None:
        if self.lines is None:
            return
        if level < logging.WARNING and (self.dropped or len(line) >= self.room):
            self.dropped += 1  # (and all the lines after it: the log has no gaps but one)
            return
        self.room -= len(line)
        self.lines.append(line)

    def keep_warning(self, message: str) -> None:
        """A warning said on stderr as a plain line: kept as a log record of its time, stamped
        like the lines around it in stderr.log (`podctl logs --since` dropped it unstamped)."""
        if self.lines is not None:
            self.keep(self.format(self._record(message)))

    def emit(self, record: logging.LogRecord) -> None:
        self.keep(self.format(record), record.levelno)

    def replay(self) -> None:
        logging.getLogger().removeHandler(self)
        lines, self.lines = self.lines or [], None
        if self.dropped:
            kept = self.KEEP_BYTES // 1024
            note = f"{self.dropped} lines logged while starting are not kept here (over {kept} KiB)"
            lines.append(self.format(self._record(note)))
        if lines:
            sys.stderr.write("".join(f"{line}\n" for line in lines))
            sys.stderr.flush()

    @staticmethod
    def _record(message: str) -> logging.LogRecord:
        return logging.LogRecord("poddaemon", logging.WARNING, "", 0, message, None, None)


_said_before_ready = _SaidBeforeReady()


def _dump_tasks() -> None:
    """Every task and where it waits, to the pod's log: for a pod that seems stuck. The whole
    chain of awaits (`Task.print_stack` shows only the task's outermost coroutine). Then the
    other threads' stacks, and the collector's state (for a pod that seems to grow). One log
    record: stamped like every other line, so `podctl logs --since` shows it."""
    lines = []
    for task in asyncio.all_tasks():
        lines.append(f"{task!r} waits in:")
        lines.extend(f"  {where}" for where in await_chain(task.get_coro()))
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():  # the model thread, an SDK import...
        if ident != threading.get_ident():
            lines.append(f"thread {names.get(ident, ident)}:")
            lines.append("".join(traceback.format_stack(frame)).rstrip("\n"))
    state = "on" if gc.isenabled() else "OFF"
    lines.append(f"collector {state}, {gc.get_freeze_count()} objects frozen")
    log.warning("kill -USR1: where the pod's tasks and threads are\n%s", "\n".join(lines))


def await_chain(coro: Any) -> list[str]:
    """`file:line in function` of each coroutine (or async generator) `coro` awaits, outermost
    first."""
    import inspect

    out = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            code = frame.f_code
            out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        awaited = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        if awaited is not None and type(awaited).__name__ == "async_generator_asend":
            # `async for`: the generator behind its step is only reachable through the
            # collector's view of it.
            awaited = next((r for r in gc.get_referents(awaited) if inspect.isasyncgen(r)), None)
        coro = awaited
    return out


def _run_loop(main: Coroutine[Any, Any, int]) -> int:
    """`asyncio.run` without its last step, which joins the default executor's threads: one may
    still be importing an SDK for a run the shutdown cancelled (see main)."""
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


# A log longer than this is kept as <name>.log.1 (one only) and started afresh: at the pod's
# start, and while it runs (looked at every LOG_CHECK_INTERVAL seconds: an fstat).
LOG_KEEP_BYTES = 16 << 20
LOG_CHECK_INTERVAL = 1.0


def _open_stderr_log(name: str, pod_dir: Path) -> tuple[Path, int]:
    """The file stderr is to go to, and a descriptor appending to it: `<log>/<name>.log`
    (SPEC §2: kept, where the runtime dir is wiped at reboot with the reason a pod died), and
    `<runtime>/pods/<name>/stderr.log` (SPEC §7) a symlink to it. A log directory we may not
    use (another user's) leaves the file in the pod dir."""
    link = pod_dir / "stderr.log"
    try:
        kept = paths.ensure_dir(paths.log_dir(), "log directory") / f"{name}.log"
    except OSError as exc:
        log.warning("keeping the log in %s: %s", pod_dir, os_error_line(exc))
        if link.is_symlink():  # to the log directory, from an earlier start
            link.unlink()
        return link, _open_log(link)
    with contextlib.suppress(OSError):  # (a first start: no log yet)
        if os.stat(kept).st_size > LOG_KEEP_BYTES:
            os.replace(kept, kept.with_name(f"{name}.log.1"))
    fd = _open_log(kept)
    tmp = pod_dir / ".stderr.log.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a start killed between these two steps left it
    os.symlink(kept, tmp)
    os.replace(tmp, link)  # (the file an older version kept here goes)
    return kept, fd


async def keep_log_bounded(kept: Path) -> None:
    """Rotate the log while the pod runs too: a pod that runs for months and logs a line per
    run would otherwise fill the disk before its next start rotates it. Only while stderr is
    still `kept` (a file moved or replaced there by the user is theirs). A failure is tried
    again: giving up at the first (a disk full for a minute) left the log unbounded for the
    rest of the pod's life."""
    failing = False  # warned of a failure, not yet rotated since: once per streak
    while True:
        await asyncio.sleep(LOG_CHECK_INTERVAL)
        try:
            ours = os.fstat(2)
            if ours.st_size <= LOG_KEEP_BYTES:
                continue
            named = os.stat(kept)
            if (named.st_dev, named.st_ino) != (ours.st_dev, ours.st_ino):
                continue
            os.replace(kept, kept.with_name(f"{kept.name}.1"))
            _stderr_to(_open_log(kept))
            failing = False
        except FileNotFoundError:
            # Renamed, but the new file could not be made (a full disk): make it now, while
            # stderr still goes to `.1` (a log the user moved away is skipped above).
            with contextlib.suppress(OSError):
                if _same_file(kept.with_name(f"{kept.name}.1"), os.fstat(2)):
                    _stderr_to(_open_log(kept))
                    failing = False
        except OSError as exc:  # a full disk: the log goes on where it is, until it passes
            if not failing:
                failing = True
                log.warning("could not rotate the log %s: %s", kept, os_error_line(exc))


def _same_file(path: Path, st: os.stat_result) -> bool:
    named = os.stat(path)
    return (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)


def _open_log(path: Path) -> int:
    # 0600 whatever the umask: a 0400 log refused the restarted pod its stderr
    return paths.open_private(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)


def _stderr_to(fd: int) -> None:
    """Make `fd` the process's stderr (threads and children writing it see the switch)."""
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
