"""`podctl spawn`: start `poddaemon run` detached and wait for its READY line (SPEC §7).

From the second live pod on, the pod is forked by this installation's fork server
(poddaemon/forkserver.py, started then), so pods share the imported code and SDKs. A lone pod,
`PODDAEMON_FORKSERVER=0`, or a server that cannot be reached, execs `poddaemon run` instead: a
server costs one pod's worth of memory and pays for itself only when shared. Either way the pod
is the same process: the command line in `ps`, the environment, working directory and umask
are this podctl's.

The pod runs in its own session (no controlling terminal, immune to the shell's Ctrl-C). Its
stderr is a pipe to podctl until it prints `PODDAEMON-READY\\t<name>\\t<socket>`; with
`--stderr-log` the daemon then moves its stderr to `<runtime>/pods/<name>/stderr.log`, so podctl
can close the pipe and exit. Anything the pod printed before READY is its own error message when
start-up fails, and is passed on to the user either way.
"""

import contextlib
import hashlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Protocol

READY_PREFIX = b"PODDAEMON-READY\t"
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
    cmd = [sys.executable, "-P", "-m", "poddaemon", "run", manifest]
    for item in sets:
        cmd += ["--set", item]
    if session:
        cmd += ["--session", session]
    if resume:
        cmd.append("--resume")
    return cmd


def parse_ready(line: bytes) -> tuple[str, str] | None:
    """`(name, socket)` from a READY line, or None when the line is something else."""
    if not line.startswith(READY_PREFIX):
        return None
    parts = line.rstrip(b"\r").decode("utf-8", "replace").split("\t")
    if len(parts) < 3 or not parts[1]:
        return None
    return parts[1], parts[2]


class Started(Protocol):
    """A pod process podctl started, exec'd or forked."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float) -> int | None:
        """Its exit status; None when it is unknowable (a forked pod whose server went away).
        Raises subprocess.TimeoutExpired."""
        ...


class Forked:
    """A pod forked by the fork server, which reports its exit on `conn` while we listen."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.code: int | None = None
        self.gone = False

    def poll(self) -> int | None:
        if not self.gone:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0.0)
        return self.code

    def wait(self, timeout: float) -> int | None:
        if self.gone:
            return self.code
        self.conn.settimeout(timeout)  # 0.0: only what already arrived
        try:
            line = _read_line(self.conn)
        except (BlockingIOError, TimeoutError):
            raise subprocess.TimeoutExpired("pod", timeout) from None
        self.gone = True
        self.conn.close()
        with contextlib.suppress(ValueError, TypeError):
            self.code = int(json.loads(line)["exit"])
        return self.code

    def close(self) -> None:
        self.conn.close()


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def server_socket() -> str:
    """This installation's fork server socket: one per interpreter, code and PYTHONPATH, so two
    virtualenvs never fork each other's pods."""
    from protocol import paths

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    key = "\0".join((sys.executable, root, os.environ.get("PYTHONPATH", "")))
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return str(paths.ensure_private_dirs()[1] / f"forkserver.{digest}.sock")


def _connect(path: str, patience: float = 0.0) -> socket.socket | None:
    deadline = time.monotonic() + patience
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)  # a racing podctl's server took the lock and is about to listen


def _start_server(path: str) -> bool:
    """Start a fork server for `path` and wait until it listens (or another one does)."""
    log = os.open(path[: -len(".sock")] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        server = subprocess.Popen(
            [sys.executable, "-P", "-m", "poddaemon.forkserver", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    finally:
        os.close(log)
    assert server.stdout is not None
    with server.stdout:
        line = server.stdout.readline()
    return line.startswith(b"FORKSERVER-")


def _fork(cmd: list[str], stdio: tuple[int, int, int]) -> Forked | None:
    """Have the fork server start `cmd` (a `poddaemon run` command line); None when the server
    cannot be had, and the caller execs instead."""
    from poddaemon.forkserver import Request, encode_request

    try:
        path = server_socket()
    except OSError:
        return None
    if len(path.encode()) > 100:  # sun_path is 108 bytes; leave room
        return None
    request = Request(
        argv=cmd[cmd.index("poddaemon") + 1 :],
        env=dict(os.environ),
        cwd=os.getcwd(),
        umask=_umask(),
        title=cmd,
    )
    frame = encode_request(request)
    for attempt in range(2):  # a stale server steps aside: the second try starts a fresh one
        conn = _connect(path)
        if conn is None:
            if attempt == 0 and not _pods_alive(os.path.dirname(path)):
                return None  # a lone pod is exec'd: a server would cost more than it shares
            if _start_server(path):
                conn = _connect(path, patience=2.0)
        if conn is None:
            return None
        try:
            conn.settimeout(READY_TIMEOUT)
            sent = socket.send_fds(conn, [frame], list(stdio))
            conn.sendall(frame[sent:])
            reply = json.loads(_read_line(conn) or b"{}")
        except (OSError, ValueError):
            conn.close()
            return None
        if isinstance(reply.get("pid"), int):
            return Forked(conn, reply["pid"])
        conn.close()
        if not reply.get("stale"):
            return None
    return None


def _pods_alive(runtime: str) -> bool:
    """Does another pod seem to run here (a socket in `pods/`)? A stale one left by a kill -9
    only starts the server one pod early."""
    try:
        names = os.listdir(os.path.join(runtime, "pods"))
    except OSError:
        return False
    return any(os.path.exists(os.path.join(runtime, "pods", n, "sock")) for n in names)


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


class Execd:
    def __init__(self, cmd: list[str], stderr: int) -> None:
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
        return self.proc.wait(timeout)


def start(cmd: list[str], stderr: int) -> Forked | Execd:
    """Start the pod with stdin and stdout on /dev/null and stderr on `stderr`."""
    if os.environ.get("PODDAEMON_FORKSERVER", "1") not in ("0", "off", "no", "false"):
        null = os.open(os.devnull, os.O_RDWR)
        try:
            forked = _fork(cmd, (null, null, stderr))
        finally:
            os.close(null)
        if forked is not None:
            return forked
    return Execd(cmd, stderr)


def _kill_group(proc: Started, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(EXIT_WAIT)


def spawn_detached(cmd: list[str], timeout: float = READY_TIMEOUT) -> tuple[str, str, bytes]:
    """Start the pod and wait for READY: `(name, socket, stderr before READY)`.

    Raises SpawnFailed when the pod exits (or closes stderr) first, or after `timeout` seconds
    (then its whole process group is killed).
    """
    fd, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        proc = start([*cmd, "--stderr-log"], write_end)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(write_end)
    try:
        return _await_ready(proc, fd, timeout)
    finally:
        os.close(fd)
        if isinstance(proc, Forked):
            proc.close()


def _await_ready(proc: Started, fd: int, timeout: float) -> tuple[str, str, bytes]:
    pending = bytearray()  # the incomplete last line
    output = bytearray()  # complete lines before READY
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _kill_group(proc, signal.SIGKILL)
                    raise SpawnFailed(
                        f"pod did not become ready within {timeout:g} s (killed it)",
                        bytes(output + pending),
                    )
                if not sel.select(remaining):
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
                    output += line + b"\n"
    except BaseException:
        if proc.poll() is None and not isinstance(sys.exc_info()[1], SpawnFailed):
            _kill_group(proc, signal.SIGTERM)  # Ctrl-C while waiting: do not leave a half pod
        raise
    # EOF before READY: the pod is exiting (or closed its stderr, which is as good as failing).
    output += pending
    try:
        code = proc.wait(EXIT_WAIT)
    except subprocess.TimeoutExpired:
        _kill_group(proc, signal.SIGKILL)
        raise SpawnFailed("pod closed its stderr without becoming ready", bytes(output)) from None
    status = "" if code is None else f" with status {code}"
    raise SpawnFailed(f"pod exited{status} before it was ready", bytes(output))
