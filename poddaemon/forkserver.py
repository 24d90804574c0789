"""The fork server: one process per user and installation that has imported the pod's code and
its provider SDKs, and forks the pods `podctl spawn` starts beside another pod, and the children
pods spawn (its client: poddaemon/forkclient.py).

Why: a pod is one Python process per agent, and each would import its own copy of the pod's
modules and of the provider SDK (its client: openai ~12 MB of heap, anthropic ~21 MB, with
poddaemon/llm/sdkload.py). Forked from here, pods share one copy of those pages
(copy-on-write; `gc.freeze()` keeps the collector from touching them), and a pod skips the
imports on its way to READY. Measured: ten idle pods after one turn each, exec'd 331 MB PSS,
forked 228 MB, this server included. Forking is safe because this process never starts a thread.

The wire, on `<runtime>/forkserver.<key>.sock` (0600, same uid only):
- request: a 4-byte big-endian length and a JSON object `{argv, env, cwd, umask, title,
  nice, limits, cpus, oom, token}` (nice, limits, cpus and oom: the caller's nice value,
  resource limits, CPU affinity and oom_score_adj, which the pod gets, as an exec would;
  token: the contents of `<runtime>/forkserver.<key>.token`, written by the server at start,
  0600); the first chunk carries the pod's stdin, stdout and stderr (SCM_RIGHTS). The pod
  gets the caller's I/O priority (`ionice`) too, read from the caller's pid (SO_PEERCRED);
- replies, one JSON line each: `{"pid": N}` once forked, then `{"exit": code}` when the pod
  exits while the client is still connected; or `{"error": why}` (nothing was forked), or
  `{"stale": true}` when a module this server loaded changed on disk (an upgrade, an edit): the
  server then gives up its socket and lock at once, and exits once its waiting clients are
  answered; the client starts a fresh one. So is every client still queued when the server
  gives its socket up for any reason (stale, socket removed, idle).
- a client that finds the server stopped execs the pod itself, and so does one that waited
  `READY_TIMEOUT` for the reply in vain, after hanging up: the server forks no request whose
  client has hung up.

Why the token: a pod's sandboxed commands can connect to this socket (Landlock restricts
connecting to a socket by its path only from ABI 9), and this unconfined process would fork
any manifest they wrote, sandbox off and scope `/`: a complete escape. They cannot read the
runtime dir the token is in (it is among the directories the sandbox never grants), podctl and
the pods can. A request without it is refused and nothing is forked. So is one from a pod's
command runner or below it (`_from_a_pods_command`): where a pod's write scope covers the
runtime dir, its commands can put a socket of their own in this one's place and be sent a
client's token.

It exits after `PODDAEMON_FORKSERVER_IDLE` seconds (default 600) without a request, and steps
aside (as when stale) once its socket file is removed (no client could reach it); its pods
live on.
"""

import contextlib
import errno
import fcntl
import functools
import gc
import hmac
import importlib
import json
import os
import resource
import secrets
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import tomllib
import traceback
from collections.abc import Callable

import setproctitle

from poddaemon import collector, ioprio
from poddaemon.forkclient import Request, decode_request, oom_score_adj, token_path

READY = b"FORKSERVER-READY\n"
RUNNING = b"FORKSERVER-RUNNING\n"  # another server holds the lock: use that one
MAX_REQUEST = 1 << 20
REQUEST_TIMEOUT = 5.0  # seconds a client has to send its whole request
IDLE_EXIT = 600.0
CHECK_INTERVAL = 1.0  # seconds between looks at our socket file while listening
ACCEPT_BACKOFF = 0.05  # seconds to wait after accept() ran out of descriptors or memory
OWN = frozenset({"poddaemon", "cli", "protocol"})

# Imported before the first fork: what every pod imports on its way to READY.
BASE = (
    "poddaemon.daemon",
    "poddaemon.config.load",
    "poddaemon.registry",
    "filelock",  # the registry imports it lazily (podctl ls skips it); a pod's claim needs it
    "poddaemon.pod",
    "poddaemon.server",
    "poddaemon.handlers",
    "poddaemon.toolset",
    "poddaemon.tools",
    "poddaemon.tools.files",  # (a pod loads its tools after READY: a forked one finds them here)
    "poddaemon.tools.search",
    "poddaemon.tools.bash",
    "poddaemon.tools.pods",
    "poddaemon.llm",
    "poddaemon.llm.threaded",
    "poddaemon.prompt",
    "poddaemon.sandbox.pod",
    "poddaemon.spawn",
    "poddaemon.outbox",
    "protocol.aio",  # (a pod loads it at its first child or report: a forked one finds it here)
    "poddaemon.mcp",
    "poddaemon.mcp.env",
    "poddaemon.llm.preflight",
    "uvloop",
)
# Imported while idle, once a pod of that provider kind was asked for, through the same
# deferred import as a pod's (poddaemon/llm/sdkload.py): the adapter, the SDK's client and what
# it imports (openai: 38 modules, not 520). Then a throwaway client is built, as a pod builds
# its own: the SDK imports its HTTP stack only then (~8 MB more per pod otherwise). The HTTP
# stack's async backend is imported only by the first request.
_ANYIO = ("anyio._backends._asyncio", "anyio._core._sockets", "anyio.streams.stapled")
SDKS: dict[str, tuple[str, ...]] = {
    "openai": ("poddaemon.llm.openai_chat", *_ANYIO),
    "openai_responses": ("poddaemon.llm.openai_responses", *_ANYIO),
    "anthropic": ("poddaemon.llm.anthropic", *_ANYIO),
}


def peek_kind(argv: list[str], cwd: str) -> str | None:
    """The provider kind a `run` command line asks for, as a preload hint: `--set
    provider.kind=` or the manifest's `[provider] kind`. None when unknown (defaults.toml may
    still set it: then the pod simply imports its SDK itself)."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "--set" and argv[i + 1].startswith("provider.kind="):
            return argv[i + 1].split("=", 1)[1].strip().strip("\"'")
    if len(argv) < 2:
        return None
    from poddaemon.config.load import read_bounded  # (preloaded)

    try:
        # Bounded and never blocking: this one server serves every spawn of the user, and a
        # manifest that is a FIFO hung it in open() for good, one that is /dev/zero grew it to
        # all free memory (after the pod itself had refused the file).
        raw = read_bounded(os.path.join(cwd, argv[1]), wait=False)  # (a FIFO: not waited for)
        provider = tomllib.loads(raw.decode()).get("provider")
    except (OSError, ValueError):
        return None
    kind = provider.get("kind") if isinstance(provider, dict) else None  # (`provider = 3`)
    return kind if isinstance(kind, str) else None


def _rehearse(kind: str) -> None:
    """Do what a pod's warm-up does short of the network (poddaemon/llm/retry.py `_load_sdk`):
    build (and drop) a client, which imports the HTTP stack, and find the platform for the
    SDK's headers (`uname -p`, cached by the platform module): forked pods inherit all of it.
    No thread is left, no connection made."""
    from poddaemon.llm.sdkload import load_sdk  # with the adapter's preload, not at start

    sdk = "anthropic" if kind == "anthropic" else "openai"
    module = load_sdk(sdk)
    if sdk == "anthropic":
        module.AsyncAnthropic(api_key="preload", base_url="http://127.0.0.1:9", max_retries=0)
    else:
        module.AsyncOpenAI(api_key="preload", base_url="http://127.0.0.1:9/v1", max_retries=0)
    importlib.import_module(f"{sdk}._base_client").get_platform()


_REHEARSAL = """\
[pod]
name = "rehearsal"
[provider]
kind = "openai"
model = "m"
[worker]
instruction = "Rehearse."
[[scope.allow]]
target = "."
permission = "write"
"""


def _rehearse_start() -> None:
    """Do once, here, the first-time work of every pod's start-up, which forked pods then
    inherit done: load and keep a manifest (the modules it imports lazily, msgspec's type
    information for each of its structs, the annotations it evaluates for them, the regexes
    compiled on first use). (filelock's constructor cache is no use warmed: it clears it in
    every fork child.) Nothing stays on disk; nothing of the user's is read (no defaults.toml)."""
    import tempfile

    from poddaemon.config.load import load_manifest

    with tempfile.TemporaryDirectory(prefix="poddaemon-rehearsal-") as here:
        manifest = os.path.join(here, "rehearsal.toml")
        with open(manifest, "w") as f:
            f.write(_REHEARSAL)
        load_manifest(manifest, defaults_path=os.path.join(here, "none.toml")).to_toml()


class Server:
    """The accept loop: single-threaded by design (a fork copies only the calling thread)."""

    def __init__(self, sock_path: str, lock_fd: int, token: str) -> None:
        self.sock_path = sock_path
        self.lock_fd = lock_fd
        self.token = token  # what a request must carry (see the module's docstring)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sel = selectors.DefaultSelector()
        self.waiting: dict[int, socket.socket] = {}  # pod pid -> the client awaiting its exit
        self.accept_failing = ""  # why accept() failed last, until it succeeds again
        self.preload: list[Callable[[], object]] = []  # done one at a time while idle
        self.loaded_kinds: set[str] = set()
        self.stats: dict[str, tuple[int, int, int]] = {}  # path -> _signature() at import
        self.sock_ino = 0  # of the socket file we bound
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Held in reserve: out of descriptors, accept() fails and its client would wait its
        # whole reply timeout (30 s) for an answer; this one, let go, lets us give it one.
        self.spare = _spare()

    # --- start-up ------------------------------------------------------------------------------

    def listen(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock_path)  # a dead server's: we hold the lock, so nobody serves it
        old = os.umask(0o177)
        try:
            self.listener.bind(self.sock_path)
        finally:
            os.umask(old)
        self.sock_ino = os.stat(self.sock_path).st_ino
        self.listener.listen(64)
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select; reaped in the loop
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    def load(self, steps: list[Callable[[], object]]) -> None:
        if not steps:
            return
        with collector.paused():  # what it imports is kept and frozen (poddaemon/collector.py)
            for step in steps:
                try:
                    step()
                except Exception as exc:  # a broken optional SDK: the pod will say so itself
                    sys.stderr.write(f"poddaemon forkserver: preload {step}: {exc}\n")
            self._snapshot()
            gc.collect()  # once, here: its garbage would otherwise be frozen into every pod

    def _snapshot(self) -> None:
        """Note the files to check before each fork: every module of ours (edited in place in a
        checkout), and each other package's top module (an upgrade rewrites all its files)."""
        for name, mod in list(sys.modules.items()):
            if "." in name and name.split(".", 1)[0] not in OWN:
                continue
            path = getattr(mod, "__file__", None)
            if isinstance(path, str) and path not in self.stats:
                try:
                    self.stats[path] = _signature(path)
                except OSError:
                    continue
        watched = os.environ.get(WATCH_ENV)
        if watched and watched not in self.stats:
            with contextlib.suppress(OSError):
                self.stats[watched] = _signature(watched)

    def stale(self) -> bool:
        """Has any module this server loaded changed on disk? Then a fork would run old code."""
        for path, signature in self.stats.items():
            try:
                if _signature(path) != signature:
                    return True
            except OSError:
                return True
        return False

    # --- the loop -------------------------------------------------------------------------------

    def serve(self) -> int:
        idle = float(os.environ.get("PODDAEMON_FORKSERVER_IDLE") or IDLE_EXIT)
        last = time.monotonic()
        while True:
            listening = self.listener.fileno() >= 0
            if self.preload and listening:
                timeout: float | None = 0.0
            elif self.waiting:
                timeout = None  # a client waits for its pod's exit: not idle
            elif listening:
                timeout = max(0.0, last + idle - time.monotonic())
            else:
                return 0  # stale, and nobody waits any more
            if listening:  # look at our socket file now and then
                timeout = CHECK_INTERVAL if timeout is None else min(timeout, CHECK_INTERVAL)
            events = self.sel.select(timeout)
            if listening and not self._reachable():
                self.stop_listening()  # its file was removed: a new server may take over
                continue
            if self.waiting:
                last = time.monotonic()
            if not events:
                if self.preload:
                    self.load([self.preload.pop(0)])  # a request waits at most for one step
                    continue
                if not self.waiting and time.monotonic() >= last + idle:
                    return 0  # idle long enough; the pods live on without us
            for key, _ in events:
                if key.fileobj is self.listener:
                    last = time.monotonic()
                    self._accept_one()
                elif key.fileobj == self.wake_r:
                    self._reap()
                else:  # a waiting client hung up: its pod lives on regardless
                    assert isinstance(key.fileobj, socket.socket)
                    self._forget(key.fileobj)

    def _reachable(self) -> bool:
        """Our socket file is still where clients look for it."""
        try:
            return os.stat(self.sock_path).st_ino == self.sock_ino
        except OSError:
            return False

    def _accept_one(self) -> None:
        """Serve one request. An OSError ends that request, not this server, which every spawn
        of the user goes through (its clients exec their pods meanwhile)."""
        try:
            conn, _ = self.listener.accept()
        except OSError as exc:
            if str(exc) != self.accept_failing:  # once, not every ACCEPT_BACKOFF
                sys.stderr.write(f"poddaemon forkserver: accept: {exc}\n")
            self.accept_failing = str(exc)
            if exc.errno in (errno.EMFILE, errno.ENFILE) and self.spare >= 0:
                self._refuse_one(f"the fork server is out of file descriptors: {exc.strerror}")
            elif exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(ACCEPT_BACKOFF)  # the connection stays queued: no spinning on it
            return
        self.accept_failing = ""
        try:
            self._serve(conn)
        except OSError as exc:
            sys.stderr.write(f"poddaemon forkserver: request: {exc}\n")
            if conn in self.waiting.values():  # its pod was forked: it lives on regardless
                with contextlib.suppress(KeyError):
                    self.sel.unregister(conn)
                self.waiting = {pid: c for pid, c in self.waiting.items() if c is not conn}
            else:  # nothing forked: the client execs its pod (a hang-up would fail its spawn)
                self._reply(conn, {"error": f"the fork server failed: {exc}"})
            conn.close()

    def _refuse_one(self, why: str) -> None:
        """Answer the next client an error at once (it execs its pod), with the descriptor
        held in reserve; then hold one again."""
        os.close(self.spare)
        self.spare = -1
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            self._reply(conn, {"error": why})
            conn.close()
            sys.stderr.write(f"poddaemon forkserver: a request refused: {why}\n")
        self.spare = _spare()

    def _serve(self, conn: socket.socket) -> None:
        """Fork the pod `conn` asks for, or say this server is stale and stop listening."""
        conn.settimeout(REQUEST_TIMEOUT)  # a client that says nothing does not stall the rest
        if not self._same_user(conn):
            return
        # Before reading a byte: a pod's command is refused whatever it sends, and one that
        # trickled its request byte by byte held this one-request-at-a-time server (every
        # spawn of the user) for as long as it liked.
        caller = _peer(conn)[0]
        if _from_a_pods_command(caller):
            self._reply(conn, {"error": "refused: the request comes from a command a pod started"})
            conn.close()
            return
        try:
            req, fds = self._read_request(conn)
        except (OSError, ValueError) as exc:
            self._reply(conn, {"error": f"bad request: {exc}"})
            conn.close()
            return
        refusal = None
        if not hmac.compare_digest(req.token.encode(), self.token.encode()):
            refusal = "refused: the request does not carry this server's token"
        if refusal is not None:
            for fd in fds:
                os.close(fd)
            self._reply(conn, {"error": refusal})
            conn.close()
            return
        try:
            if self.stale():
                self.stop_listening()  # first, so the client's fresh server can take over
                self._reply(conn, {"stale": True})
                conn.close()
                return
            # A kind's SDK half-loaded is no use: this pod would import the rest itself. The
            # wait (~0.3 s) happens once, to the pod spawned right after the first of its kind.
            self.load(self.preload)
            self.preload = []
            if _hung_up(conn):  # it gave up waiting (a server that seemed hung): it execs
                conn.close()
                return
            # Its I/O priority (`ionice -c3 podctl spawn`), read here: nothing to carry.
            pid = self._fork(req, fds, ioprio.of(caller))
        except OSError as exc:  # EAGAIN, ENOMEM…: the client execs instead
            self._reply(conn, {"error": f"cannot fork: {exc}"})
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self._reply(conn, {"pid": pid})
        self.waiting[pid] = conn
        self.sel.register(conn, selectors.EVENT_READ)
        kind = peek_kind(req.argv, req.cwd)
        if kind in SDKS and kind not in self.loaded_kinds:
            self.loaded_kinds.add(kind)
            self.preload += [_importer(m) for m in SDKS[kind]]
            self.preload.append(functools.partial(_rehearse, kind))

    def _same_user(self, conn: socket.socket) -> bool:  # (before anything is read)
        if _peer(conn)[1] != os.getuid():
            conn.close()
            return False
        return True

    def _read_request(self, conn: socket.socket) -> tuple[Request, list[int]]:
        # One deadline for the whole request, not per read: a client sending a byte now and
        # then kept each read short of its timeout and this server busy with it for good.
        deadline = time.monotonic() + REQUEST_TIMEOUT
        data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            raise ValueError("expected 3 file descriptors (stdin, stdout, stderr)")
        try:
            while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
                if len(data) >= 4 and struct.unpack(">I", data[:4])[0] > MAX_REQUEST:
                    raise ValueError("request too large")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(f"request not complete within {REQUEST_TIMEOUT:.0f} s")
                conn.settimeout(left)
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    raise ValueError(
                        f"request not complete within {REQUEST_TIMEOUT:.0f} s"
                    ) from None
                if not chunk:
                    raise ValueError("truncated request")
                data += chunk
            req = decode_request(data[4:])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return req, fds

    @staticmethod
    def _reply(conn: socket.socket, msg: dict[str, object]) -> None:
        with contextlib.suppress(OSError):  # the client is gone; its pod is not affected
            conn.sendall(json.dumps(msg).encode() + b"\n")

    def _forget(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        conn.close()
        for pid, c in list(self.waiting.items()):
            if c is conn:
                del self.waiting[pid]

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.waiting.pop(pid, None)
            if conn is not None:
                self._reply(conn, {"exit": os.waitstatus_to_exitcode(status)})
                self.sel.unregister(conn)
                conn.close()

    # --- the fork -------------------------------------------------------------------------------

    def _fork(self, req: Request, fds: list[int], io: int | None) -> int:
        """Fork the pod `req` asks for, with the caller's I/O priority `io` (None: this
        server's)."""
        if threading.active_count() != 1:  # a preload started one: a fork could deadlock
            raise OSError(f"{threading.active_count()} threads in the fork server")
        _allow_limits(req)
        _allow_nice(req.nice)
        _allow_cpus(req.cpus)
        _allow_oom(req.oom)
        _allow_ioprio(io)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()  # the preloads were frozen (load()): what a request made stays collectable
        if pid == 0:
            self._child(req, fds, io)  # never returns
        return pid

    def _child(self, req: Request, fds: list[int], io: int | None) -> None:
        code = 1
        try:
            os.setsid()  # its own session and group, like `podctl spawn`'s exec'd pods
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the lock, the listener, clients…
            if req.title:  # before the environment changes: the title lives next to it
                sys.argv = req.title
                _set_title(" ".join(req.title))
            os.chdir(req.cwd)
            os.umask(req.umask)
            # The caller's limits (`ulimit -n`, `-c 0`, `-v`…), not this server's (started from
            # another shell)
            for name, soft, hard in req.limits:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            if req.cpus:  # the caller's (`taskset -c 0 podctl spawn`), not this server's
                os.sched_setaffinity(0, req.cpus)
            if req.oom is not None:  # the caller's (`choom -n 500 -- podctl spawn`)
                _set_oom(req.oom)
            if req.nice is not None:  # the caller's (`nice podctl spawn`), not this server's
                os.setpriority(os.PRIO_PROCESS, 0, req.nice)
            if io is not None and io != ioprio.of(0):  # the caller's (`ionice -c3 podctl spawn`)
                ioprio.set_own(io)
            os.environ.clear()
            os.environ.update(req.env)
            time.tzset()  # the caller's TZ, for the pod's log timestamps
            from poddaemon.daemon import main

            code = main(req.argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def stop_listening(self) -> None:
        """Give the socket and the lock up: a new server may start while this one finishes."""

        if self.listener.fileno() < 0:
            return
        with contextlib.suppress(KeyError):
            self.sel.unregister(self.listener)
        if self._reachable():  # not a successor's: ours was removed, and one took its place
            with contextlib.suppress(OSError):
                os.unlink(self.sock_path)
        self._send_away()
        self.listener.close()
        os.close(self.lock_fd)

    def _send_away(self) -> None:
        """Tell each client still queued on the listener (it connected before the unlink) to
        start a fresh server, as a stale one does. Closed with them queued, the listener reset
        their connections after they had sent their requests, and such a client cannot tell
        that nothing was forked: its `podctl spawn` failed ("the fork server went away")."""
        self.listener.setblocking(False)
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # none left (or none to be had: those are reset, as before)
                return
            self._reply(conn, {"stale": True})
            conn.close()


# A test seam: a file this server watches as it watches its modules, so that a test makes its
# own server stale without editing the checkout every other test's server runs from (which
# made theirs stale too, and their pods were forked by a successor they did not expect).
WATCH_ENV = "PODDAEMON_TEST_FORKSERVER_WATCH"


def _signature(path: str) -> tuple[int, int, int]:
    """What tells that a module's file changed: its mtime, and its inode and size, for an
    upgrade that keeps the files' times (`cp -a`, `rsync -a`, an installer keeping those of its
    archive) and so rewrote every file under the old mtime."""
    st = os.stat(path)
    return st.st_mtime_ns, st.st_ino, st.st_size


def _spare() -> int:
    """A descriptor to give up when out of them (-1: none to be had now)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel says (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


MAX_ANCESTORS = 1024  # deeper than any client's process tree: a longer chain is a command's


def _from_a_pods_command(pid: int) -> bool:
    """Is `pid` a pod's command runner or below one (a bash call, a hook, what they started)?
    Those run sandboxed; forked from here, a pod of theirs would not be. Their orphans stay
    below the runner (a child subreaper) while it lives, and it outlives them. Besides the
    token: a command whose write scope covers the runtime dir can put a socket of its own in
    this one's place and be sent a client's token.

    Fails closed: a chain of ancestors too long to be a client's (a command nested 64 shells
    deep was not followed up to its runner), or one that changes under the walk (an ancestor
    reaped meanwhile), counts as a command's."""
    first = True
    for _ in range(MAX_ANCESTORS):
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            # The client gone: its request is not forked either way (it hung up). An ancestor
            # gone: its children now hang below a subreaper (the runner?) the walk missed.
            return not first
        if any(arg.endswith(b"/poddaemon/runner.py") for arg in argv):  # any installation's
            return True
        pid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # the parent
        first = False
    return True


def _write_token(path: str) -> str:
    """A new token, in `path` (0600) before the socket listens: a client reads it once it has
    connected, so it always finds the token of the server that holds the lock.

    Written to a new file of an unguessable name (O_EXCL: never through a symlink planted in
    its place, which a command whose write scope covers the runtime dir can make: entries
    there are beyond what Landlock can deny it), then renamed over `path`, which replaces
    whatever is there, a symlink included."""
    token = secrets.token_hex(16)
    tmp = f"{path}.{secrets.token_hex(8)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def _hung_up(conn: socket.socket) -> bool:
    """The client closed the connection (not merely its writing side)."""
    poller = select.poll()
    poller.register(conn, select.POLLHUP)
    return any(events & select.POLLHUP for _, events in poller.poll(0))


def _importer(module: str) -> Callable[[], object]:
    return functools.partial(importlib.import_module, module)


def _set_title(title: str) -> None:
    """`ps` shows the pod as the command line it would have been exec'd with."""
    # An argument that is not UTF-8 (a manifest named in Latin-1, a `--set` value) is held as
    # lone surrogates, which setproctitle cannot encode: it raised, and the forked pod died
    # with a traceback where an exec'd one starts. `ps` shows such a byte as `?` either way.
    setproctitle.setproctitle(title.encode("utf-8", "replace").decode())


def _allow_limits(req: Request) -> None:
    """Let a pod have its caller's resource limits: raise this server's hard limits to them,
    when the server was started from a shell with lower ones. OSError (the client then execs
    the pod itself) when that is not allowed."""
    for name, _, want in req.limits:
        res = getattr(resource, name)
        soft, hard = resource.getrlimit(res)
        if hard == resource.RLIM_INFINITY or (want != resource.RLIM_INFINITY and want <= hard):
            continue
        try:
            resource.setrlimit(res, (soft, want))
        except (ValueError, OSError):
            what = "open-file limit" if name == "RLIMIT_NOFILE" else name
            raise OSError(f"the caller's {what} ({want}) is above this server's") from None


def _allow_nice(nice: int | None) -> None:
    """Make sure a pod can have its caller's nice value: a server started by `nice -n 19 podctl
    spawn` forked every later pod at 19. A lower value than this server's needs the privilege
    to raise a priority (CAP_SYS_NICE or RLIMIT_NICE): tried here, on this process, and put
    back; OSError (the client then execs the pod itself) when it is not allowed."""
    if nice is None:
        return
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if nice >= own:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        raise OSError(f"the caller's nice value ({nice}) is below this server's ({own})") from None
    os.setpriority(os.PRIO_PROCESS, 0, own)


def _allow_cpus(cpus: tuple[int, ...]) -> None:
    """Make sure a pod can have its caller's CPU affinity: tried here, on this process, and
    put back; OSError (the client then execs the pod itself) when none of those CPUs is ours
    to run on (a caller in another cgroup's cpuset)."""
    if not cpus:
        return
    own = os.sched_getaffinity(0)
    if set(cpus) == own:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise OSError(f"the caller's CPUs ({cpus}) are not this server's: {exc}") from None
    os.sched_setaffinity(0, own)


def _allow_ioprio(io: int | None) -> None:
    """Make sure a pod can have its caller's I/O priority: a server started by `ionice -c3
    podctl spawn` forked every later pod in the idle class, from any shell, until it went
    idle itself. The realtime class needs CAP_SYS_NICE: tried here, on this process, and put
    back; OSError (the client then execs the pod itself) when it is not allowed."""
    own = ioprio.of(0)
    if io is None or own is None or io == own:
        return
    try:
        ioprio.set_own(io)
    except OSError as exc:
        raise OSError(f"the caller's I/O priority ({io:#x}) is not this server's: {exc}") from None
    ioprio.set_own(own)


def _set_oom(value: int) -> None:
    with open("/proc/self/oom_score_adj", "wb") as f:
        f.write(b"%d" % value)


def _allow_oom(oom: int | None) -> None:
    """Make sure a pod can have its caller's oom_score_adj: a server started by `choom -n 1000
    podctl spawn` had every later pod killed first when memory ran out. A lower value than
    this server's needs CAP_SYS_RESOURCE: tried here, on this process, and put back; OSError
    (the client then execs the pod itself) when it is not allowed."""
    own = oom_score_adj()
    if oom is None or own is None or oom >= own:
        return
    try:
        _set_oom(oom)
    except OSError:
        why = f"the caller's oom_score_adj ({oom}) is below this server's ({own})"
        raise OSError(why) from None
    _set_oom(own)


def _open_lock(path: str) -> int:
    """The server's lock file, opened for writing (it holds the pid), 0600 whatever the umask:
    one made under umask 0277 came out 0400 and stayed, and every later server of that user
    died opening it ("Permission denied"), each spawn falling back to exec. One left so by
    an earlier version is mended: it lies in our private runtime dir (checked 0700, ours)."""
    from protocol.paths import open_private

    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return open_private(path, flags)
    except PermissionError:
        os.chmod(path, 0o600)  # (a symlink planted there fails the open: O_NOFOLLOW)
        return open_private(path, flags)


def main(argv: list[str] | None = None) -> int:
    """`python -m poddaemon.forkserver SOCKET`: serve until idle. Prints READY (or RUNNING when
    another server holds this socket's lock) on stdout, then detaches stdout."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m poddaemon.forkserver SOCKET\n")
        return 2
    sock_path = args[0]
    if os.fork():  # whoever started us (podctl, a pod) reaps this parent now, never the server
        os._exit(0)
    lock_fd = _open_lock(sock_path + ".lock")
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.write(1, RUNNING)
        return 0
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)  # who holds it: for tests and curious users
    _set_title(" ".join(sys.orig_argv))  # claims the argv area now, while environ is intact
    server = Server(sock_path, lock_fd, _write_token(token_path(sock_path)))
    try:
        server.load([_importer(m) for m in BASE])
        server.preload.append(_rehearse_start)  # (while idle: the first pod does not wait)
        server.listen()
        os.write(1, READY)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # the client closes its end of the pipe: no SIGPIPE later
        os.close(devnull)
        return server.serve()
    finally:
        server.stop_listening()


if __name__ == "__main__":
    sys.exit(main())
