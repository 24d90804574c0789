"""The client side of the fork server (poddaemon/forkserver.py): find or start this
installation's server and have it fork a `poddaemon run` command line. Used by `podctl spawn`
and by a pod starting its children. Standard library only, and light: podctl imports it (no
typing, no subprocess until a server must be started: ~10 ms of every `podctl spawn` here;
`_socket` rather than `socket`, whose enum set-up costs ~2 ms)."""

import _socket
import array
import contextlib
import json
import os
import resource
import stat
import struct
import sys
import time

from poddaemon.umask import current_umask

try:  # the builtin module: hashlib loads OpenSSL first, ~3 ms of every `podctl spawn`
    from _sha1 import sha1  # type: ignore[import-not-found]
except ImportError:  # (an interpreter built without it)
    from hashlib import sha1

READY_TIMEOUT = 30.0


class ServerLost(Exception):
    """The server took the request and vanished before saying whether it forked."""


def enabled() -> bool:
    """`PODDAEMON_FORKSERVER=0` (or off, no, false) execs every pod."""
    return os.environ.get("PODDAEMON_FORKSERVER", "1").lower() not in ("0", "off", "no", "false")


class Request:
    """What the server is asked to fork: a `poddaemon run` command line and the caller's
    process attributes an exec'd pod would inherit."""

    __slots__ = ("argv", "cpus", "cwd", "env", "limits", "nice", "oom", "title", "token", "umask")

    def __init__(
        self,
        argv: list[str],  # `poddaemon` arguments: ["run", manifest, ...]
        env: dict[str, str],
        cwd: str,
        umask: int,
        title: list[str],  # the command line `ps` shows: what the pod would have been exec'd as
        token: str = "",  # the server's token: proof the caller may read our runtime dir
        nice: int | None = None,  # the caller's nice value, as exec would keep
        # The caller's resource limits (`ulimit -n`, `-c`, `-v`…): (name, soft, hard) each
        limits: tuple[tuple[str, int, int], ...] = (),
        cpus: tuple[int, ...] = (),  # the CPUs the caller may run on (`taskset`); (): the server's
        oom: int | None = None,  # the caller's oom_score_adj (`choom`), as exec would keep
    ) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.umask = umask
        self.title = title
        self.token = token
        self.nice = nice
        self.limits = limits
        self.cpus = cpus
        self.oom = oom

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


# Every resource limit: an exec'd pod inherits them all.
LIMITS = tuple(n for n in dir(resource) if n.startswith("RLIMIT_"))


MAX_CPUS = 1 << 16  # the kernel's own bound (CONFIG_NR_CPUS is at most 8192)


def oom_score_adj() -> int | None:
    """This process's oom_score_adj; None where there is none to be read."""
    try:
        with open("/proc/self/oom_score_adj", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def current_limits() -> tuple[tuple[str, int, int], ...]:
    return tuple((n, *resource.getrlimit(getattr(resource, n))) for n in LIMITS)


def encode_request(req: Request) -> bytes:
    body = json.dumps(req.as_dict()).encode()
    return struct.pack(">I", len(body)) + body


def decode_request(body: bytes) -> Request:
    raw = json.loads(body)
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    argv, env, cwd = raw.get("argv"), raw.get("env"), raw.get("cwd")
    umask, title = raw.get("umask"), raw.get("title", [])
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv: want a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ValueError("env: want an object of strings")
    if not isinstance(cwd, str) or not isinstance(umask, int) or not isinstance(title, list):
        raise ValueError("want cwd: str, umask: int, title: [str]")
    nice = raw.get("nice")
    if nice is not None and not (isinstance(nice, int) and not isinstance(nice, bool)):
        raise ValueError("nice: want an integer")
    if nice is not None and not -20 <= nice <= 19:
        raise ValueError("nice: want -20 to 19")
    token = raw.get("token", "")
    if not isinstance(token, str):
        raise ValueError("token: want a string")
    limits = raw.get("limits", [])
    # Each a limit setrlimit takes (-1: unlimited): a larger one raised OverflowError in the
    # server's own setrlimit, past its error handling, and the whole server died.
    if not (
        isinstance(limits, list)
        and all(
            isinstance(item, list)
            and len(item) == 3
            and item[0] in LIMITS
            and all(_is_rlimit(n) for n in item[1:])
            for item in limits
        )
    ):
        raise ValueError("limits: want [[RLIMIT_name, soft, hard], ...]")
    cpus = raw.get("cpus", [])
    if not (
        isinstance(cpus, list)
        and len(cpus) <= MAX_CPUS
        and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < MAX_CPUS for c in cpus)
    ):
        raise ValueError("cpus: want a list of CPU numbers")
    oom = raw.get("oom")
    if oom is not None and not (
        isinstance(oom, int) and not isinstance(oom, bool) and -1000 <= oom <= 1000
    ):
        raise ValueError("oom: want -1000 to 1000")
    return Request(
        argv,
        env,
        cwd,
        umask,
        [str(t) for t in title],
        token,
        nice,
        tuple((str(name), int(soft), int(hard)) for name, soft, hard in limits),
        tuple(cpus),
        oom,
    )


def _is_rlimit(n: object) -> bool:
    """A limit setrlimit takes (-1: unlimited); a larger one raised OverflowError."""
    return isinstance(n, int) and not isinstance(n, bool) and -1 <= n < 1 << 63


class Forked:
    """A pod forked by the fork server, which reports its exit on `conn` while we listen."""

    def __init__(self, conn: _socket.socket, pid: int, unread: bytes = b"") -> None:
        self.conn = conn
        self.pid = pid
        self._unread = bytearray(unread)  # read from `conn` past the pid line
        self.code: int | None = None
        self.gone = False

    def poll(self) -> int | None:
        if not self.gone:
            with contextlib.suppress(TimeoutError):
                self.wait(0.0)
        return self.code

    def wait(self, timeout: float) -> int | None:
        """Its exit status; None when the server went away. TimeoutError after `timeout`."""
        if self.gone:
            return self.code
        self.conn.settimeout(timeout)  # 0.0: only what already arrived
        try:
            line = _read_line(self.conn, self._unread)
        except (BlockingIOError, TimeoutError):
            raise TimeoutError(f"the pod did not exit within {timeout:g} s") from None
        self.gone = True
        self.conn.close()
        with contextlib.suppress(ValueError, TypeError):
            self.code = int(json.loads(line)["exit"])
        return self.code

    def close(self) -> None:
        self.conn.close()


def _read_line(conn: _socket.socket, buf: bytearray) -> bytes:
    """The next line from `conn` (what is there at EOF), taken from `buf`, which holds what
    was read past the lines taken before and keeps what is read past this one. A pod that
    ends at once (a name or scope another pod holds) has its exit sent right behind its pid:
    one recv() got both, the two lines did not decode as one reply, and `podctl spawn` said
    the fork server went away instead of the pod's own error."""
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
    end = buf.find(b"\n") + 1 or len(buf)
    line = bytes(buf[:end])
    del buf[:end]
    return line


def server_socket() -> str:
    """This installation's fork server socket: one per interpreter, code and PYTHON* settings,
    so two virtualenvs never fork each other's pods."""
    from protocol import paths

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The interpreter reads these at its start only (PYTHONPATH, PYTHONDEVMODE, PYTHONOPTIMIZE,
    # PYTHONWARNINGS, PYTHONVERBOSE…): a pod forked from a server started with others would
    # silently run without the caller's, where an exec'd one has them.
    python = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("PYTHON"))
    key = "\0".join((sys.executable, root, *python))
    digest = sha1(key.encode()).hexdigest()[:12]
    return os.path.join(paths.ensure_private_dirs()[1], f"forkserver.{digest}.sock")


def token_path(sock_path: str) -> str:
    """Where the server at `sock_path` keeps its token (see poddaemon/forkserver.py)."""
    return sock_path[: -len(".sock")] + ".token"


def _read_token(sock_path: str) -> str | None:
    """The server's token; None unless it is a regular file of ours that only we can read (what
    the server writes: anything else was put there by someone else)."""
    try:
        fd = os.open(token_path(sock_path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        return os.read(fd, 256).decode("ascii").strip()
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _connect(path: str, patience: float = 0.0) -> _socket.socket | None:
    """A connection to the server at `path`; None when none listens there. BlockingIOError
    when its backlog is full: it accepts nobody (stopped, hung), and every client that gave
    up on it left its connection queued. (Blocking, that connect() would wait for ever.)"""
    deadline = time.monotonic() + patience
    while True:
        conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        conn.settimeout(READY_TIMEOUT)  # a full backlog: EAGAIN at once, not a wait
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)  # a racing podctl's server took the lock and is about to listen
        except BaseException:
            conn.close()
            raise


def _start_server(path: str) -> bool:
    """Start a fork server for `path` and wait until it listens (or another one does)."""
    import subprocess

    from protocol.paths import open_private  # (0600 whatever the umask: the next server appends)

    log = open_private(path[: -len(".sock")] + ".log", os.O_WRONLY | os.O_APPEND)
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
        line = server.stdout.readline()  # from the server proper: it forked itself off at once
    server.wait()
    return line.startswith(b"FORKSERVER-")


def fork_pod(
    cmd: list[str], stdio: tuple[int, int, int], *, alone_ok: bool = False
) -> Forked | None:
    """Have the fork server start `cmd` (a `poddaemon run` command line) with these stdin,
    stdout and stderr; None when the server cannot be had (or is stopped, or does not answer
    in time), and the caller execs instead. With no server running, one is started only if
    another pod runs (or `alone_ok`), and never by a caller in a systemd service: the server
    would live in that unit's cgroup, and every pod it forked later, for any shell, would be
    killed with it when the unit stops (a timer's `podctl spawn` job, done). Raises
    ServerLost when it cannot be known whether the pod was started."""

    try:
        path = server_socket()
    except OSError:
        return None
    if len(os.fsencode(path)) > 100:  # sun_path is 108 bytes; leave room
        return None
    try:
        cwd = os.getcwd()
    except FileNotFoundError:  # removed since: an exec'd pod starts there as the shell is
        return None
    request = Request(
        argv=cmd[cmd.index("poddaemon") + 1 :],
        env=dict(os.environ),
        cwd=cwd,
        umask=current_umask(),
        title=cmd,
        nice=os.getpriority(os.PRIO_PROCESS, 0),
        limits=current_limits(),
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        oom=oom_score_adj(),
    )
    for attempt in range(2):  # a stale server steps aside: the second try starts a fresh one
        try:
            conn = _connect(path)
            if conn is None:
                if attempt == 0 and not alone_ok and not _pods_alive(os.path.dirname(path)):
                    return None  # a lone pod is exec'd: a server would cost more than it shares
                if "INVOCATION_ID" in os.environ:  # systemd sets it for a unit's processes
                    return None
                if _start_server(path):
                    conn = _connect(path, patience=2.0)
        except BlockingIOError:  # its backlog is full: it never had our request, exec
            return None
        if conn is None:
            return None
        token = _read_token(path)  # read once connected: the token of the server that listens
        server = _peer_pid(conn)
        # Stopped, it would not answer before the timeout; in other cgroups, what it forks
        # would not live where an exec'd pod does.
        if token is None or _stopped(server) or not _same_cgroups(server):
            conn.close()
            return None
        request.token = token
        frame = encode_request(request)
        try:
            conn.settimeout(READY_TIMEOUT)
            sent = _send_fds(conn, frame, stdio)
            if sent < len(frame):  # (an empty send to a server that already answered is EPIPE)
                conn.sendall(frame[sent:])
        except OSError:
            conn.close()
            return None  # it never had the request: exec
        try:
            unread = bytearray()
            reply = json.loads(_read_line(conn, unread))
        except TimeoutError:  # hung: hang up, and it will not fork the request if it gets to it
            conn.close()
            return None
        except (OSError, ValueError):  # it had the request and no answer came: exec'ing could
            conn.close()  # start the pod twice
            raise ServerLost(
                "the fork server went away while starting the pod; see `podctl ls`"
            ) from None
        if isinstance(reply.get("pid"), int):
            return Forked(conn, reply["pid"], bytes(unread))
        conn.close()
        if not reply.get("stale"):
            return None
    return None


def _send_fds(conn: _socket.socket, data: bytes, fds: tuple[int, ...]) -> int:
    """`socket.send_fds`: `data` with the descriptors `fds` passed along (SCM_RIGHTS)."""
    rights = (_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", fds))
    return int(conn.sendmsg([data], [rights]))


def _peer_pid(conn: _socket.socket) -> int:
    """The server at the other end (it called listen: SO_PEERCRED names it)."""
    creds = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


def _same_cgroups(pid: int) -> bool:
    """The server `pid` is in our cgroups. A pod it forks lives in its cgroups, where nobody
    can move it who may not move the server, so a caller elsewhere execs: a `podctl spawn` in
    a systemd unit or another login session made a pod that escaped that unit's limits and
    its stop, and died with the session that happened to start the server. True when either
    cannot be read (as before)."""
    try:
        with open("/proc/self/cgroup", "rb") as ours, open(f"/proc/{pid}/cgroup", "rb") as its:
            return ours.read() == its.read()
    except OSError:
        return True


def _stopped(pid: int) -> bool:
    """The server `pid` is stopped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return False
    return state in ([b"T"], [b"t"])


def _pods_alive(runtime: str) -> bool:
    """Does another pod seem to run here (a socket in `pods/`)? A stale one left by a kill -9
    only starts the server one pod early."""
    try:
        names = os.listdir(os.path.join(runtime, "pods"))
    except OSError:
        return False
    return any(os.path.exists(os.path.join(runtime, "pods", n, "sock")) for n in names)
