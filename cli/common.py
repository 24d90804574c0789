"""What podctl's commands share without typer: exit codes, error handling, one call to a pod,
reading a message, and exiting. `cli/plain.py` runs the most used one-call commands with this
module alone (no typer: half of `podctl notify`'s time); `cli/app.py` adds the typer app.

Exit codes (SPEC §6): 0 ok · 1 error (an RPC error prints `podctl: <message> (<code>)`), a run
that ended in error, was cancelled or paused · 2 usage error only, except `send`'s "limit
reached" · 3 the pod is not running (`podctl: pod 'x' is not running`). A pod that does not
answer (ANSWER_TIMEOUT) is an error: podctl never hangs on one. `fail` ends a command with its
message and code as a `SystemExit`, which typer lets through to `run`/`invoke` alike.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from typing import Any, NoReturn, TypeVar

    from protocol.client import PodClient
    from protocol.errors import PodNotRunning

    T = TypeVar("T")

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3
EXIT_LIMIT = 2  # `send` only, documented in its --help (SPEC §6)
EXIT_INTERRUPTED = 130
# A pod that has not answered a request within this many seconds (SIGSTOPped, its loop wedged)
# is an error, not a hang: `podctl notify` in cron or CI must end. Only the answer is timed:
# `send` waits for its run as long as it lasts, and `compact` and `rpc` (a summary, `run` with
# `wait`) as long as the pod takes.
ANSWER_TIMEOUT = 30.0


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    from cli.render import printable

    try:
        sys.stdout.flush()  # what was said before, first
    except BrokenPipeError:
        raise  # the reader went: podctl stops quietly (run)
    except OSError:
        pass  # our stdout fails (a full disk): the message may say so, it must not be lost
    # (A stderr that fails, to a full disk or a closed pipe, must not change the exit status
    # that says what happened: 3 is "not running" to a script whatever became of the words.)
    with contextlib.suppress(OSError):
        sys.stderr.write(f"podctl: {printable(message)}\n")  # it may quote a pod's error text
    raise SystemExit(code)


def say_taken(write: Callable[[], object], taken: str) -> None:
    """`write`, then flush, what podctl prints once the pod took input (`taken`: "run R",
    "notification N"). An OSError there is our stdout's (a full disk), not the pod's: said
    so, with what was taken, since a script reading a failure would send it again."""
    _say_done(write, f"{taken} was taken")


def say_started(name: str, socket: str) -> None:
    """`NAME<tab>SOCKET` once a pod runs (`spawn`, `restart`). A stdout that fails there (a
    full disk) said only "No space left on device", exit 1: read as a start that failed, a
    retry then failed on the name the running pod holds. Said so, with the pod's name."""
    done = f"pod '{name}' was started and runs (podctl stop {name})"
    _say_done(lambda: sys.stdout.write(f"{name}\t{socket}\n"), done)


def say_compacted(pod: str, write: Callable[[], object], session_id: str | None) -> None:
    """`write` and flush what `podctl compact` prints. A stdout that fails there (a full disk)
    said only "No space left on device", exit 1: read as a compaction that failed, a retry
    paid for another summary. Said so, with the session the pod went on in."""
    if session_id:
        _say_done(write, f"pod '{pod}' compacted into session {session_id}")
    else:
        _say_done(write, f"pod '{pod}' had nothing to compact")


def _say_done(write: Callable[[], object], done: str) -> None:
    """`write` and flush; an OSError of our stdout's (not the pod's) fails saying `done`."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        raise  # the reader went, as ever
    except OSError as exc:
        from protocol.errors import os_error_line

        fail(f"cannot write the output: {os_error_line(exc)}; {done}")


def names_a_pod(target: str) -> bool:
    """A pod name or a socket path: what a POD argument may be. Any other text is a usage
    error, not 'not running' (a typo in the case of a letter would read as a stopped pod)."""
    from protocol.paths import POD_NAME_RE

    return "/" in target or POD_NAME_RE.fullmatch(target) is not None


STARTING = "its socket does not listen yet"


def not_running(exc: PodNotRunning, stopped: str = "") -> NoReturn:
    """`pod 'x' is not running: no socket at …`: where podctl looked is half the answer. One
    that holds its registry entry and does not listen yet is starting, as `podctl ls` says
    (still exit 3: it cannot take the request yet). `stopped`: what to do instead, said after
    (`history`: the sessions on disk)."""
    if starting(exc.target):
        target = exc.target
        fail(f"pod '{target}' is starting: {STARTING} (podctl wait {target})", EXIT_NOT_RUNNING)
    why = failed_unit(exc.target)
    fail(str(exc) + (why or stopped or _way_on(exc.target)), EXIT_NOT_RUNNING)


def _way_on(target: str) -> str:
    """For a pod name that does not run: `podctl restart` when its configuration is kept, or
    the name meant when one kept is close to it (a typo); else "". Kept is not "it ran": a
    start that failed (an MCP server's `${VAR}` unset) keeps it too, and `podctl restart`
    starts it once that is fixed."""
    import difflib

    from protocol import paths

    if "/" in target:
        return ""
    kept = paths.data_dir() / "pods"
    if (kept / f"{target}.toml").is_file():
        return f" (its configuration is kept: `podctl restart {target}` starts it)"
    try:
        names = [p.stem for p in kept.glob("*.toml") if not p.name.startswith(".")]
    except OSError:
        return ""
    close = difflib.get_close_matches(target, sorted(names), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def starting(target: str) -> bool:
    """A pod that holds its registry entry but does not listen yet (its SessionStart hooks or
    MCP servers are still at work): `ls` lists it as `starting`, and it is running."""
    from protocol import paths

    if "/" in target:  # a socket path: no name to look up
        return False
    # Its pid file first (written right after the claim, gone after a clean stop): for the
    # usual "not running" the registry, and the msgspec it needs (~10 ms), is never loaded.
    try:
        os.kill(int((paths.pod_dir(target) / "pid").read_text().split()[0]), 0)
    except PermissionError:
        pass  # someone's process: the registry says whose
    except (OSError, ValueError):
        return False
    from poddaemon.registry import Registry, RegistryError

    try:
        return Registry(paths.runtime_dir()).get(target) is not None
    except (RegistryError, OSError):
        return False


def restarting(target: str) -> bool:
    """`podctl restart` holds the pod's restart lock: it is stopping the pod to start it again
    (a moment when no pod of that name runs, or the old one refuses input while it stops)."""
    import fcntl

    from protocol import paths

    if "/" in target:
        return False
    try:
        fd = os.open(paths.pod_dir(target) / "restart.lock", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (released as it is closed)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def connection_lost(target: str, when: str = "") -> NoReturn:
    """The pod closed our connection. When its socket no longer answers it went away (killed,
    crashed, stopped): exit 3 like any pod that is not running. Otherwise it dropped just this
    client: an error."""
    from protocol import oneshot
    from protocol.errors import ConnectionClosed, PodNotRunning

    gone = f"pod '{target}' is not running: it went away {when or 'while podctl was connected'}"
    try:
        oneshot.call(target, "status", timeout=2.0)
    except PodNotRunning:
        fail(gone, EXIT_NOT_RUNNING)
    except ConnectionClosed:  # (a dying pod may still accept, then drop us)
        pid = _live_pid(target)
        if pid is None:
            fail(gone, EXIT_NOT_RUNNING)
        # It runs, and takes connections only to drop them.
        fail(
            f"pod '{target}' (pid {pid}) runs but dropped the connection without answering: "
            "it may be at its open-file limit (clients that keep connections open)"
        )
    except Exception:  # it is there, in no state to answer: all we know is that it closed
        pass
    fail(f"pod '{target}' closed the connection")


def _live_pid(target: str) -> int | None:
    """The pid of pod `target` (a name) when the registry has it alive, serving the socket
    podctl used: a pod out of descriptors drops every connection the moment it accepts it."""
    import time

    from poddaemon.registry import Registry, RegistryError
    from protocol import paths

    if "/" in target:
        return None
    time.sleep(0.2)  # a pod that dropped us as it exits is gone by then
    try:
        entry = Registry(paths.runtime_dir()).get(target)
    except (OSError, RegistryError):
        return None
    if entry is None or entry.socket != str(paths.socket_path(target)):
        return None
    return entry.pid


def check_stdout() -> None:
    """BrokenPipeError when our stdout is a pipe whose reader went (`podctl attach x | head`).
    A follower with nothing to write asks now and then: it would otherwise only learn it at its
    next write, which a quiet pod may never cause."""
    import select

    poller = select.poll()
    poller.register(sys.stdout.fileno(), 0)  # errors are always reported: POLLERR, no reader
    if poller.poll(0):
        raise BrokenPipeError("podctl's stdout has no reader")


def print_json(value: Any) -> None:
    import json

    from cli.render import json_text

    sys.stdout.write(json_text(json.dumps(value, indent=2, ensure_ascii=False)) + "\n")


# What the one-line refusal of a message too large for any pod adds (podctl cannot know the
# pod's own limit without asking it: a pod refuses one over it with -32602, naming it).
DEFAULT_MAX_INPUT_KIB = 256  # worker.max_input_bytes's default (test_cli_common checks)
TOO_LARGE_ADVICE = (
    f"a pod takes at most its worker.max_input_bytes of input in one message "
    f"({DEFAULT_MAX_INPUT_KIB} KiB unless its manifest says more): save it in a file the pod can "
    "read and send its path"
)


def check_client_key(key: str | None) -> None:
    """An empty `--client-key` (`"$BUILD_ID"` unset in a cron line) would make no retry
    idempotent: a usage error, before anything is sent (the pod refuses it too)."""
    if key is not None and not key:
        fail(
            "--client-key: empty (an unset variable?); give a key, or leave the option out",
            EXIT_USAGE,
        )


def read_message(message: str, what: str = "message") -> str:
    """MESSAGE as given, or stdin for `-` (without its trailing newlines). Empty, or not UTF-8
    (the wire is UTF-8 JSON, and the pod gets nothing altered): a usage error (`what` is what
    an empty one is said to be)."""
    if message == "-":
        from protocol.framing import DEFAULT_MAX_FRAME_BYTES as limit

        # No pod reads a frame larger than this: read no more of stdin (a runaway pipe of
        # gigabytes was all read into memory, then refused).
        raw = sys.stdin.buffer.read(limit + 1)
        if len(raw) > limit:
            fail(
                f"stdin holds more than {limit >> 20} MiB, more than one request to a pod "
                f"carries; {TOO_LARGE_ADVICE}",
                EXIT_USAGE,
            )
        try:
            text = raw.decode()
        except UnicodeDecodeError as exc:
            fail(
                f"stdin is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})",
                EXIT_USAGE,
            )
        text = text.rstrip("\n")
    else:
        text = message
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            not_utf8(exc, "MESSAGE")
    if not text.strip():
        fail(f"empty {what}", EXIT_USAGE)
    return text


def not_utf8(exc: UnicodeEncodeError, what: str = "an argument") -> NoReturn:
    """Text that cannot go on the UTF-8 wire (nothing was sent): bytes from the shell that are
    not UTF-8 (Python holds byte B as the lone surrogate U+DC00+B), or a lone surrogate of
    its own (`\ud83d` in rpc's JSON)."""
    code = ord(exc.object[exc.start])
    bad = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:X}"
    fail(f"{what} is not UTF-8 text ({bad})", EXIT_USAGE)


# Said when a pod that was sent input does not answer: stopped or wedged, it still reads its
# socket once it runs again, so "failed" would invite a retry that delivers the input twice.
INPUTS = ("run", "notify")  # the methods that hand a pod input (its acknowledgement counts)
UNANSWERED_INPUT = "; it may have taken what was sent, or take it once it runs again"


@contextlib.contextmanager
def rpc_errors(
    target: str, timeout: float | None = None, unanswered: str = "", stopped: str = ""
) -> Iterator[None]:
    """Map the client's exceptions to podctl's one-line messages and exit codes (`unanswered`:
    added to the message of a pod that did not answer in time; `stopped`: to that of a pod
    that is not running)."""
    from protocol.errors import (
        SHUTTING_DOWN,
        ConnectionClosed,
        FrameTooLarge,
        PodNotRunning,
        RpcError,
    )

    try:
        yield
    except PodNotRunning as exc:
        not_running(exc, stopped)
    except FrameTooLarge as exc:
        # Refused before a byte was sent: the caller's input is larger than any request a pod
        # reads (a message of 8 MiB or a little less, or one its JSON escapes make so). A usage
        # error, as the same message on stdin over 8 MiB is (2), not a pod's error (1).
        fail(f"{exc.message}; {TOO_LARGE_ADVICE}", EXIT_USAGE)
    except RpcError as exc:
        if exc.code == SHUTTING_DOWN and unanswered:
            # It took nothing: to a script, as a pod that is not running (SPEC §6: exit 3).
            fail(
                f"pod '{target}' is shutting down and takes no input; nothing was sent "
                f"({exc.code})",
                EXIT_NOT_RUNNING,
            )
        fail(f"{exc.message} ({exc.code})")
    except ConnectionClosed:
        connection_lost(target)
    except BrokenPipeError:
        raise  # our stdout went away (e.g. `| head`): main() handles it
    except UnicodeEncodeError as exc:  # encoding the request: nothing was sent
        not_utf8(exc)
    except TimeoutError:
        within = f"within {timeout:g} s" if timeout else "in time"
        fail(f"pod '{target}' did not answer {within}{unanswered}")
    except KeyboardInterrupt:
        if not unanswered:
            raise  # nothing handed over: 130 without a word, as ever
        # Ctrl-C before a stopped or slow pod acknowledged input: like a timeout, what was
        # sent may still be taken, and a silent 130 read as "not sent" (sent again: twice).
        fail(f"interrupted before pod '{target}' answered{unanswered}", EXIT_INTERRUPTED)
    except OSError as exc:
        fail(f"cannot talk to pod '{target}': {exc}")


def call(
    target: str,
    method: str,
    params: dict[str, Any] | None = None,
    timeout: float | None = ANSWER_TIMEOUT,
) -> Any:
    """One call to `target`, its result as plain JSON data, with podctl's error handling
    (`timeout`: a pod that does not answer within it is an error; None waits for ever).

    Through `protocol.oneshot` (standard library only): for a one-call command, importing
    PodClient would cost more than the rest of podctl's own start-up.
    """
    from protocol import paths

    result: Any = None
    unanswered = UNANSWERED_INPUT if method in INPUTS else ""
    with rpc_errors(target, timeout, unanswered):
        paths.check_private_dirs()  # another user must not be able to swap what we talk to
        result = one_call(target, method, params, timeout)
    return result


def one_call(target: str, method: str, params: dict[str, Any] | None, timeout: float | None) -> Any:
    """`oneshot.call`, input (`run`, `notify`) waiting out a restart of the pod's unit
    (UnitRestart); the client's exceptions as they are (`call` maps them)."""
    from protocol import oneshot

    def attempt() -> Any:
        return oneshot.call(target, method, params, timeout=timeout)

    return through_restart(target, timeout, attempt) if method in INPUTS else attempt()


@contextlib.contextmanager
def connect(
    target: str, timeout: float | None = ANSWER_TIMEOUT, unanswered: str = "", stopped: str = ""
) -> Iterator[PodClient]:
    """A PodClient for `target`, with podctl's error handling around everything in the block.
    `timeout` bounds each call's answer (and each read: follow events with `next_event`)."""
    from protocol import paths

    with rpc_errors(target, timeout, unanswered, stopped):
        paths.check_private_dirs()  # another user must not be able to swap what we talk to
        with _connected(target, timeout, inputs=bool(unanswered)) as client:
            yield client


def _connected(target: str, timeout: float | None, inputs: bool) -> PodClient:
    """`PodClient.connect`; for input (`send`), through a restart of its unit (UnitRestart)."""
    from protocol.client import PodClient

    def attempt() -> PodClient:
        return PodClient.connect(target, timeout=timeout)

    return through_restart(target, timeout, attempt) if inputs else attempt()


def through_restart(target: str, timeout: float | None, attempt: Callable[[], T]) -> T:
    """`attempt()`, tried again while the pod does not listen because systemd is restarting
    its unit or it starts (UnitRestart): what a pod that is not listening was sent, it never
    got; nor did one that refused it while `podctl restart` stopped it."""
    from protocol.errors import SHUTTING_DOWN, PodNotRunning, RpcError

    restart = UnitRestart(target, timeout)
    while True:
        try:
            return attempt()
        except PodNotRunning:
            if not restart.waited():
                raise
        except RpcError as exc:
            if exc.code != SHUTTING_DOWN or not restarting(target) or not restart.waited():
                raise


UNIT_PREFIX = "poddaemon-"  # `podctl unit install`'s units
TEMPLATE_PREFIX = "poddaemon@"  # instances of systemd/poddaemon@.service


def unit_name(pod: str) -> str:
    """The unit `podctl unit install` writes for a pod."""
    return f"{UNIT_PREFIX}{pod}.service"


def template_unit_name(pod: str) -> str:
    """The instance of the template unit shipped in systemd/poddaemon@.service."""
    return f"{TEMPLATE_PREFIX}{pod}.service"


def pod_of_unit(unit: str) -> str:
    """The pod a unit of either name runs (`poddaemon-NAME.service`, `poddaemon@NAME.service`);
    "" for any other unit."""
    for prefix in (UNIT_PREFIX, TEMPLATE_PREFIX):
        if unit.startswith(prefix) and unit.endswith(".service"):
            return unit[len(prefix) : -len(".service")]
    return ""


UNIT_RESTART_POLL = 0.1  # seconds between looks at a unit that systemd is restarting
UNIT_RESTART_GRACE = 2.0  # seconds another state is waited out once it was seen restarting


def unit_properties(name: str, *properties: str) -> list[tuple[str, dict[str, str]]]:
    """`(unit, {property: value})` of each unit that may run pod `name` (`podctl unit
    install`'s, and the shipped template's instance), in one `systemctl --user show`; [] for
    a socket path, no user manager or a systemctl that fails. No typer (`cli.unit` has the
    rest): asked only of a pod that does not listen."""
    import shutil
    import subprocess

    exe = shutil.which("systemctl")
    if exe is None or "/" in name:
        return []
    units = [unit_name(name), template_unit_name(name)]
    asked = [f"--property={p}" for p in properties]
    try:
        out = subprocess.run(
            [exe, "--user", "show", *asked, *units],
            capture_output=True,
            text=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    blocks = out.stdout.strip().split("\n\n")  # one per unit, in the order asked
    found = [dict(line.partition("=")[::2] for line in b.splitlines()) for b in blocks]
    return list(zip(units, found, strict=False))


def restarting_unit(name: str) -> str | None:
    """The unit of pod `name` when systemd is starting it (`activating`: RestartSec= after a
    crash, or start-up until READY), else None: no such unit, no user manager, or any other
    state."""
    for unit, props in unit_properties(name, "ActiveState"):
        if props.get("ActiveState") in ("activating", "reloading"):
            return unit
    return None


def failed_unit(name: str) -> str:
    """`; its unit U failed: <why>` when a unit of pod `name` has failed, from the status the
    pod gave systemd as it refused to start (`refused: …`), else "". A restart refused (an
    edited manifest that is wrong) left `wait`, `status` and `send` saying "not running"
    alone, and the reason in `systemctl --user status` only."""
    for unit, props in unit_properties(name, "ActiveState", "StatusText"):
        if props.get("ActiveState") == "failed":
            why = props.get("StatusText") or f"see systemctl --user status {unit}"
            return f"; its unit {unit} failed: {why}"
    return ""


class UnitRestart:
    """Input for a pod that does not listen yet but will: one still starting (its SessionStart
    hooks or MCP servers at work: it holds its registry entry), or a unit pod that systemd is
    restarting (its unit `activating`: a crash's RestartSec=, then start-up until READY). It
    waits for the pod to listen, within the time podctl gives a pod to acknowledge input.
    Before, `send` and `notify` said "not running" (exit 3) for the seconds it lasts, to a
    timer unit or a CI hook too, where `wait` and `stop` saw the same pod starting. A pod
    that is not listening was sent nothing, so sending again delivers the input once."""

    def __init__(self, target: str, timeout: float | None) -> None:
        import time

        self.target = target
        self.deadline = time.monotonic() + (ANSWER_TIMEOUT if timeout is None else timeout)
        self.unit: str | None = None  # once seen restarting
        self.grace = 0.0  # until when another answer is taken for a moment of that restart
        self.said = False  # that it waits for a starting pod

    def waited(self) -> bool:
        """True after a short wait while the pod starts or systemd restarts its unit; False
        when neither (no such pod, its unit stopped, failed, given up on) or the time is up."""
        import time

        now = time.monotonic()
        if "/" in self.target or now >= self.deadline:
            return False
        unit = restarting_unit(self.target)
        if unit is None:
            if starting(self.target) or restarting(self.target):
                if not self.said:
                    self.said = True
                    sys.stderr.write(
                        f"podctl: pod '{self.target}' is starting; waiting until it listens\n"
                    )
                    sys.stderr.flush()
            # Seen restarting a moment ago: its unit `active` before the pod listens to us,
            # or a systemctl that failed under load, is no proof that it will not.
            elif self.unit is None or now >= self.grace:
                return False
        else:
            if self.unit is None:
                sys.stderr.write(f"podctl: pod '{self.target}' is being restarted by {unit}\n")
                sys.stderr.flush()
            self.unit, self.grace = unit, now + UNIT_RESTART_GRACE
        time.sleep(UNIT_RESTART_POLL)
        return True


def run(command: Callable[[], object]) -> int:
    """Run a command; its exit status, with podctl's handling of what ends it early."""
    try:
        command()
    except SystemExit as exc:
        return _status(exc)
    except KeyboardInterrupt:  # Ctrl-C: as typer ends a command it runs
        return EXIT_INTERRUPTED
    except EOFError:
        sys.stderr.write("\nAborted!\n")
        return EXIT_ERROR
    except BrokenPipeError:
        return _reader_gone()
    except OSError as exc:  # an unsafe directory, a full disk under our stdout: one line
        from protocol.errors import os_error_line

        sys.stderr.write(f"podctl: {os_error_line(exc)}\n")
        return EXIT_ERROR
    return 0


def _status(exc: SystemExit) -> int:
    """The exit status `sys.exit` gives: a non-integer is printed to stderr and means 1."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    sys.stderr.write(f"{exc.code}\n")
    return EXIT_ERROR


def _reader_gone() -> int:
    """Our stdout's reader went away (`podctl history x | head`): stop quietly, as other Unix
    tools do, with nothing more to flush there."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_ERROR


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's shutdown: a finished command holds nothing that needs it
    (no threads, no temporary files, no log handlers), and tearing down typer's modules takes
    about a sixth of a `podctl status`. Only stdio is flushed first."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = code or _reader_gone()
    except OSError as exc:
        if not code:  # the command went well, its output did not get out: say so once
            from protocol.errors import os_error_line

            sys.stderr.write(f"podctl: cannot write the output: {os_error_line(exc)}\n")
            code = EXIT_ERROR
    except ValueError:  # stdout closed by the command itself
        pass
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(code)
