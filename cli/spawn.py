"""`podctl spawn`: start `poddaemon run` detached and wait for its READY line (SPEC §7).

From the second live pod on, the pod is forked by this installation's fork server
(poddaemon/forkserver.py, started then), so pods share the imported code and SDKs. A lone pod,
`PODDAEMON_FORKSERVER=0`, or a server that cannot be reached, execs `poddaemon run` instead: a
server costs one pod's worth of memory and pays for itself only when shared. Either way the pod
is the same process: the command line in `ps`, the environment, working directory and umask
are this podctl's.

The pod runs in its own session (no controlling terminal, immune to the shell's Ctrl-C). Its
stderr is a pipe to podctl until it prints `PODDAEMON-READY\\t<name>\\t<socket>`; with
`--stderr-log` the daemon then moves its stderr to `<log>/<name>.log` (linked from
`<runtime>/pods/<name>/stderr.log`), so podctl can close the pipe and exit. Anything the pod
printed before READY is its own error message when start-up fails, and is passed on to the user
either way, except `PODDAEMON-STARTING\t<seconds>`: the pod may take that much longer (its MCP
servers' start_timeout, SessionStart hooks), and podctl waits for it that much longer.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator

from poddaemon import forkclient
from poddaemon.readyline import parse_ready, parse_starting

READY_TIMEOUT = 30.0
EXIT_WAIT = 5.0


class SpawnFailed(Exception):
    """The pod did not become ready. `output` is everything it wrote to stderr."""

    def __init__(self, message: str, output: bytes) -> None:
        super().__init__(message)
        self.message = message
        self.output = output


def daemon_command(manifest: str, sets: list[str], session: str | None, resume: bool) -> list[str]:
    """The `poddaemon run` command line for these podctl spawn options.

    `-P` (Python 3.11+): do not put the current directory on `sys.path`, or a `poddaemon/`
    folder where the user stands would be imported instead of the installed package.
    """
    if manifest.startswith("-"):
        # `podctl spawn -- -x.toml`: `poddaemon run` took it for an option and printed its own
        # usage ("the following arguments are required: manifest"). Options follow the
        # manifest (callers append more), so no `--` can go before it: a path can.
        manifest = os.path.join(".", manifest)
    cmd = [sys.executable, "-P", "-m", "poddaemon", "run", manifest]
    for item in sets:
        cmd += ["--set", item]
    if session:
        cmd += ["--session", session]
    if resume:
        cmd.append("--resume")
    return cmd


def podctl_descriptor(manifest: str) -> bool:
    """Whether `manifest` names one of podctl's own descriptors (`<(…)` gives `/dev/fd/63`):
    a detached pod, another process, opens its own descriptor of that number, or none."""
    import re

    path = "/" + os.path.normpath(os.path.abspath(manifest)).lstrip("/")  # (`//dev`: `/dev`)
    return (
        re.fullmatch(r"/(?:dev|proc/self|proc/thread-self)/fd/\d+|/dev/std(?:in|out|err)", path)
        is not None
    )


def is_fifo(manifest: str) -> bool:
    """Whether `manifest` is a named pipe (`mkfifo`), which the pod waits on for a writer."""
    import stat

    try:
        return stat.S_ISFIFO(os.stat(manifest).st_mode)
    except (OSError, ValueError):  # missing, unreadable, a NUL in it: the pod says which
        return False


TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from typing import Protocol

    class Started(Protocol):
        """A pod process podctl started, exec'd or forked."""

        pid: int

        def poll(self) -> int | None: ...

        def wait(self, timeout: float) -> int | None:
            """Its exit status; None when it is unknowable (a forked pod whose server went
            away). Raises TimeoutError."""
            ...

        def close(self) -> None:
            """We wait for it no more (it runs on, detached)."""
            ...


class Execd:
    def __init__(self, cmd: list[str], stderr: int) -> None:
        import subprocess  # (only here: ~7 ms of every forked `podctl spawn` otherwise)

        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        import subprocess

        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the pod did not exit within {timeout:g} s") from None

    def close(self) -> None:
        pass  # nothing held: a detached pod we never reap (it outlives podctl)


def start(cmd: list[str], stderr: int) -> Started:
    """Start the pod with stdin and stdout on /dev/null and stderr on `stderr`."""
    if forkclient.enabled():
        null = os.open(os.devnull, os.O_RDWR)
        try:
            forked = forkclient.fork_pod(cmd, (null, null, stderr))
        finally:
            os.close(null)
        if forked is not None:
            return forked
    return Execd(cmd, stderr)


def _kill_group(proc: Started, sig: signal.Signals) -> None:
    if proc.pid <= 0:  # (Unseen: killpg(0) would be podctl's own group)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(TimeoutError):
        proc.wait(EXIT_WAIT)


def spawn_detached(cmd: list[str], timeout: float = READY_TIMEOUT) -> tuple[str, str, bytes]:
    """Start the pod and wait for READY: `(name, socket, stderr before READY)`.

    Raises SpawnFailed when the pod exits (or closes stderr) first, or after `timeout` seconds,
    plus those a `PODDAEMON-STARTING` line asks for (then its whole process group is killed).
    """
    with _terminate_as_exit() as release:
        return _spawn_detached(cmd, timeout, release)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[Callable[[], None]]:
    """SIGTERM or SIGHUP to a waiting podctl (`timeout 10 podctl spawn`, a cancelled CI job, a
    closed terminal) raise SystemExit(128 + signal), as Ctrl-C raises KeyboardInterrupt: the
    pod being started is stopped with it. By default podctl died on the spot and left the pod,
    in a session of its own, starting (or stuck: a FIFO manifest without writer) for nobody.

    Until the function it yields is called, a signal is held: while the pod is being started
    podctl does not yet know its pid, and a SystemExit there left the pod running. Called, it
    raises for a signal held."""
    held: list[int] = []
    released = False

    def terminated(signum: int, _frame: object) -> None:
        if not released:
            held.append(signum)
            return
        raise SystemExit(128 + signum)

    def release() -> None:
        nonlocal released
        released = True
        if held:
            raise SystemExit(128 + held[0])

    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, terminated)
    except ValueError:  # not the main thread (a pod's): only that one may set handlers
        yield lambda: None
        return
    try:
        yield release
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _spawn_detached(
    cmd: list[str], timeout: float, release: Callable[[], None]
) -> tuple[str, str, bytes]:
    cmd = [*cmd, "--stderr-log"]
    fd, write_end = os.pipe2(os.O_CLOEXEC)
    first = b""
    try:
        proc = start(cmd, write_end)  # (SIGTERM held: see _terminate_as_exit)
    except forkclient.ServerLost:
        os.close(write_end)
        proc, fd, first = _after_server_lost(cmd, fd, timeout)
    except BaseException:
        os.close(write_end)
        os.close(fd)
        raise
    else:
        os.close(write_end)
    try:
        return _await_ready(proc, fd, timeout, release, first)
    finally:
        os.close(fd)
        proc.close()


class Unseen:
    """A pod the fork server forked and went away before it told us its pid: what it writes
    comes on our pipe, and its exit status is unknowable. Nothing can be sent to it."""

    pid = 0

    def poll(self) -> int | None:
        return None

    def wait(self, timeout: float) -> int | None:
        return None

    def close(self) -> None:
        pass


def _after_server_lost(cmd: list[str], fd: int, timeout: float) -> tuple[Started, int, bytes]:
    """The fork server went away once it had the request: whether it forked the pod is told
    by the pipe of the pod's stderr, whose write end it was sent. Output on it comes from that
    pod, which starts on (its pid unknown); the end of it with nothing read means no process
    holds it any more, so none was forked (or the one forked ended at once): the pod is
    exec'd. `(pod, read end, what was read)`. Reported as a failure, the pod a server forked
    just before it died started anyway, and a retry was refused as "already running"."""
    if not select.select([fd], [], [], timeout)[0]:
        os.close(fd)
        raise SpawnFailed(
            f"the fork server went away while starting the pod, and nothing came from it within "
            f"{timeout:.0f} s; see `podctl ls`",
            b"",
        )
    first = os.read(fd, 65536)
    if first:
        return Unseen(), fd, first
    os.close(fd)
    fd, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        return Execd(cmd, write_end), fd, b""
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(write_end)


EARLY_HEAD, EARLY_TAIL = 30, 10  # lines shown of what a pod wrote before READY


def shortened(output: bytes, pod: str | None = None) -> bytes:
    """What a pod wrote while starting, as podctl shows it: the first lines (its warnings come
    first) and the last (a failure's reason comes last). An MCP server flooding its stderr put
    up to 256 KiB of it on the terminal of a spawn that worked; all of it is in its log.

    Control characters are shown as \\xNN, as in every error podctl prints: the paths a
    child's errors name were chosen by the model (`podctl restart CHILD` of one whose pwd is
    gone wrote its OSC 52 to the terminal), and an MCP server's stderr is anyone's text."""
    from cli.render import printable

    output = printable(output.decode("utf-8", "backslashreplace")).encode()
    lines = output.splitlines(keepends=True)
    if len(lines) <= EARLY_HEAD + EARLY_TAIL:
        return output
    cut = len(lines) - EARLY_HEAD - EARLY_TAIL
    where = f"`podctl logs {pod}`" if pod else "the pod's log (`podctl logs`)"
    note = f"podctl: … {cut} more lines ({where} has them all)\n".encode()
    return b"".join([*lines[:EARLY_HEAD], note, *lines[-EARLY_TAIL:]])


def _await_ready(
    proc: Started, fd: int, timeout: float, release: Callable[[], None], first: bytes = b""
) -> tuple[str, str, bytes]:
    """`first`: what was read from `fd` already."""
    pending = bytearray()  # the incomplete last line
    output = bytearray()  # complete lines before READY
    started = time.monotonic()
    deadline = started + timeout
    try:
        release()  # a SIGTERM from now on (or one held) stops the pod too
        poller = select.poll()  # (not selectors: ~1.5 ms of podctl's start-up to import)
        poller.register(fd, select.POLLIN)
        while True:
            if first:
                chunk, first = first, b""
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _kill_group(proc, signal.SIGKILL)
                    done = "killed it" if proc.pid > 0 else "its pid unknown: see `podctl ls`"
                    raise SpawnFailed(
                        f"pod did not become ready within {deadline - started:.0f} s ({done})",
                        bytes(output + pending),
                    )
                if not poller.poll(remaining * 1000):
                    continue
                chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
            while (nl := pending.find(b"\n")) >= 0:
                line = bytes(pending[:nl])
                del pending[: nl + 1]
                ready = parse_ready(line)
                if ready is not None:
                    return ready[0], ready[1], bytes(output)
                longer = parse_starting(line)
                if longer is not None:  # its MCP servers or hooks may take this much
                    deadline = max(deadline, time.monotonic() + longer + timeout)
                    continue
                output += line + b"\n"
    except BaseException:
        if proc.poll() is None and not isinstance(sys.exc_info()[1], SpawnFailed):
            # Ctrl-C (or SIGTERM, SIGHUP) while waiting: do not leave a half pod
            _kill_group(proc, signal.SIGTERM)
        raise
    # EOF before READY: the pod is exiting (or closed its stderr, which is as good as failing).
    output += pending
    try:
        code = proc.wait(EXIT_WAIT)
    except TimeoutError:
        _kill_group(proc, signal.SIGKILL)
        raise SpawnFailed("pod closed its stderr without becoming ready", bytes(output)) from None
    status = "" if code is None else f" with status {code}"
    raise SpawnFailed(f"pod exited{status} before it was ready", bytes(output))
