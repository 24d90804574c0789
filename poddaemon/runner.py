"""The command runner: a small helper process, one per pod, that starts the pod's commands
(the bash tool today, hooks later) and makes sure none outlives the pod.

It is started by `poddaemon.tools.runner_client` as `python -I <this file>`, so it imports only
the standard library (fast, ~12 MB) and the caller's cwd can never shadow a module. It:

- given a policy, takes a mount namespace of its own in which everything but the policy's
  write grants is read-only (`poddaemon.sandbox.mounts`: Landlock cannot refuse chmod, chown,
  utimes), then confines itself with Landlock;
- makes itself a child subreaper, so every orphan of a command (`setsid`, double forks, a shell
  that exited before its background jobs) is re-parented to it and stays findable;
- talks to the pod over one Unix stream socket (fd 3): newline-delimited JSON, the pipe a
  command writes its output to passed along with the start request (SCM_RIGHTS), so output
  goes straight to the pod and never through here;
- on EOF of that socket (the pod exited, however: `kill -9` included), SIGTERM or SIGHUP, kills
  every descendant it has and exits.

Messages, pod -> runner: `{"op": "init", "policy": str | null}` first (a sandbox policy the
runner applies to itself before any command starts: `poddaemon.sandbox.apply_policy`, imported
only when a policy is given); `{"op": "start", "id", "argv", "cwd", "fds"?, "env"?}` + one fd
(stdout and stderr) or three (stdin, stdout, stderr: `"fds": 3`), `env` variables for that
command only;
`{"op": "kill", "id"}`: kill the command's process group, its whole process tree and the orphans
it left, then forget it. Runner -> pod: `ready {pid, sandbox, notes}` (notes: what the sandbox
could not do here, for `podctl status`) | `fatal {error}`, `started {id,
pid}` | `failed {id, error}`, `exited {id, status}` (a returncode: negative = signal), `killed
{id, count}`.
"""

import array
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

SOCKET_FD = 3
PR_SET_CHILD_SUBREAPER = 36
ENV_TAG = "PODDAEMON_COMMAND"  # set in every command's environment: attributes orphans to it
MAX_FDS_PER_MESSAGE = 4


def set_child_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, from every thread's /proc children list."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before children."""
    out: list[int] = []
    todo = [pid]
    seen = {pid}
    while todo:
        for child in children_of(todo.pop()):
            if child not in seen:
                seen.add(child)
                out.append(child)
                todo.append(child)
    return out


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # gone
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"Z"


def command_tag(pid: int) -> str | None:
    """The ENV_TAG value a process started with (None: none, or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    key = ENV_TAG.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(key):
            return item[len(key) :].decode(errors="replace")
    return None


def killpg(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def kill_all(pids: list[int]) -> int:
    n = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            n += 1
        except OSError:
            pass
    return n


class Runner:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = b""
        self.fds: list[int] = []  # received with start requests, in order
        self.commands: dict[int, subprocess.Popen[bytes]] = {}  # id -> its shell, until killed
        # shell pid -> (id, shell) until reaped: Popen must never be dropped unreaped, or
        # subprocess's own cleanup would reap it behind our back
        self.by_pid: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}
        self.running = True
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    # --- I/O ---------------------------------------------------------------------------------

    def send(self, **msg: Any) -> None:
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:
            self.running = False  # the pod is gone; the main loop cleans up

    def receive(self) -> list[dict[str, Any]]:
        fds = array.array("i")
        try:
            data, ancdata, _flags, _addr = self.sock.recvmsg(
                65536, socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * fds.itemsize)
            )
        except (InterruptedError, BlockingIOError):
            return []
        except OSError:
            self.running = False
            return []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self.fds.extend(fds)
        if not data:
            self.running = False
            return []
        self.inbuf += data
        *lines, self.inbuf = self.inbuf.split(b"\n")
        return [json.loads(line) for line in lines if line]

    # --- requests ------------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "start":
            self.start(msg["id"], msg["argv"], msg["cwd"], msg.get("fds", 1), msg.get("env"))
        elif op == "kill":
            self.kill(msg["id"])

    def start(
        self, cid: int, argv: list[str], cwd: str, nfds: int = 1, env: dict[str, str] | None = None
    ) -> None:
        # One fd: stdout and stderr merged (bash). Three: stdin, stdout, stderr (hooks). `env`:
        # variables for this command only (a hook's CLAUDE_PROJECT_DIR).
        fds = [self.fds.pop(0) if self.fds else -1 for _ in range(nfds)]
        stdin, out, err = (subprocess.DEVNULL, fds[0], subprocess.STDOUT) if nfds == 1 else fds
        try:
            if min(fds) < 0:
                raise OSError("the pipes did not come with the start request")
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env={**os.environ, **(env or {}), ENV_TAG: str(cid)},
                stdin=stdin,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: killed as one
            )
        except (OSError, ValueError, subprocess.SubprocessError) as e:  # ValueError: a NUL byte
            self.send(op="failed", id=cid, error=f"{type(e).__name__}: {e}")
            return
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        self.commands[cid] = proc
        self.by_pid[proc.pid] = (cid, proc)
        self.send(op="started", id=cid, pid=proc.pid)

    def kill(self, cid: int) -> None:
        """Kill command `cid`: its group, its tree, and orphans that carry its tag (or none)."""
        proc = self.commands.pop(cid, None)
        killed: set[int] = set()
        if proc is not None:
            live_tags = {str(c) for c in self.commands}
            while True:  # until a pass finds nothing new (a fork may race one pass)
                victims: list[int] = []
                if proc.returncode is None:  # not reaped yet, so its pid is still its own
                    victims += [proc.pid, *descendants(proc.pid)]
                    killpg(proc.pid)
                for orphan in children_of(os.getpid()):
                    if orphan in self.by_pid:
                        continue  # another command's shell
                    if command_tag(orphan) not in live_tags:  # ours, untagged, or a dead one's
                        victims += [orphan, *descendants(orphan)]
                new = [p for p in victims if p not in killed and not is_zombie(p)]
                if not new:
                    break
                kill_all(new)
                killed.update(new)
                self.reap()
            if proc.returncode is None:  # killed above; its exit is a moment away
                self.reap_shell(proc)
        self.send(op="killed", id=cid, count=len(killed))

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited(pid, status)

    def reap_shell(self, proc: "subprocess.Popen[bytes]") -> None:
        """Wait for a command's shell (already sent SIGKILL), so `exited` precedes `killed`."""
        try:
            pid, status = os.waitpid(proc.pid, 0)
        except ChildProcessError:
            return
        self.exited(pid, status)

    def exited(self, pid: int, status: int) -> None:
        shell = self.by_pid.pop(pid, None)
        if shell is None:
            return  # an adopted orphan
        cid, proc = shell
        proc.returncode = os.waitstatus_to_exitcode(status)
        self.send(op="exited", id=cid, status=proc.returncode)

    def kill_everything(self) -> None:
        """Every descendant, until none is left (the pod is gone)."""
        killed: set[int] = set()
        while True:
            for _cid, proc in self.by_pid.values():
                killpg(proc.pid)
            new = [p for p in descendants(os.getpid()) if p not in killed and not is_zombie(p)]
            if not new:
                break
            kill_all(new)
            killed.update(new)
            self.reap()
        self.reap()

    # --- main loop -----------------------------------------------------------------------------

    def on_signal(self, signum: int, frame: Any) -> None:
        if signum != signal.SIGCHLD:
            self.running = False

    def loop(self) -> None:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self.on_signal)
        while self.running:
            self.reap()
            try:
                ready, _, _ = select.select([self.sock.fileno(), self.wake_r], [], [])
            except InterruptedError:
                continue
            if self.wake_r in ready:
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            if self.sock.fileno() in ready:
                for msg in self.receive():
                    self.handle(msg)
        self.kill_everything()


def apply_policy(policy: str) -> tuple[str, Callable[[], None] | None, list[str]]:
    """Confine this process (and so every command) by the pod's sandbox policy. Also returns,
    where the kernel scopes signals (Landlock ABI >= 6), what puts a process one layer below
    (see `guard`), and notes for `podctl status` on what the read-only view could not cover."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.append(root)  # -I left the package off the path; add it only now, last
    from poddaemon.sandbox import apply_policy as apply  # type: ignore[import-not-found,unused-ignore]
    from poddaemon.sandbox import landlock  # type: ignore[import-not-found,unused-ignore]

    fields = json.loads(policy)
    notes: list[str] = []
    if fields.get("mode") != "off":  # before Landlock: a domain forbids mount(2)
        notes = read_only_view(
            fields.get("writable", []), fields.get("hidden", []), fields.get("readonly", [])
        )
    effective = str(apply(policy.encode()))
    scoped = effective != "none" and landlock.abi_version() >= 6
    # Commands inherit this environment: their private temp dir, and what confines them.
    tmpdir = fields.get("tmpdir")
    if tmpdir:
        os.environ["TMPDIR"] = tmpdir
    os.environ["PODDAEMON_SANDBOX"] = effective
    return effective, (landlock.restrict_scope if scoped else None), notes


def read_only_view(
    writable: list[str], hidden: list[str] | None = None, readonly: list[str] | None = None
) -> list[str]:
    """Mount everything but the write grants read-only for this process and its commands:
    Landlock has no right for file metadata (chmod, chown, utimes). Never fails the pod: what
    is left unprotected, and why, becomes a note."""
    from poddaemon.sandbox import mounts  # type: ignore[import-not-found,unused-ignore]

    # Before the user namespace: inside it, groups it does not map read as 65534.
    groups = sorted(set(os.getgroups()) - {os.getgid()}) if os.geteuid() != 0 else []
    try:
        left = mounts.isolate(writable, hidden or (), readonly or ())
    except OSError as e:
        why = f"the read-only mount namespace failed: {e.strerror}"
        notes = [
            "file modes, owners and times outside the write scope are not protected (Landlock "
            f"has no right for them; {why})"
        ]
        if hidden:
            notes.append(f"{', '.join(hidden)} stay readable by commands ({why})")
        return notes
    notes = []
    if groups:
        notes.append(
            "supplementary groups ("
            + ", ".join(map(str, groups))
            + ") are not mapped in the commands' user namespace: they still grant access, but "
            "show as 65534, chgrp to them fails (Invalid argument), cp -a/-p give copies the "
            "primary group instead, tar --same-owner fails"
        )
    if left:
        notes.append(
            "file modes, owners and times stay changeable on these mounts (they could not be "
            f"made read-only): {', '.join(left)}"
        )
    return notes


def guard(scope_below: Callable[[], None], sock: socket.socket) -> int | None:
    """Fork. The child goes on as the runner, one Landlock layer down with signals scoped, and
    so do its commands: none can signal (kill, stop) this process, which stays behind as the
    guard of last resort. None in the child; in the guard, the exit code once the runner has
    ended and every descendant left behind is dead. A command may kill or stop the runner
    (same layer) to orphan its escapees: they are re-parented here (a subreaper) and killed.

    Not per command (a `preexec_fn` costs every command a full fork instead of a vfork,
    +1.2-1.9 ms measured): one fork per runner."""
    pid = os.fork()
    if pid == 0:
        scope_below()
        set_child_subreaper()  # not inherited: the runner collects its commands' orphans
        return None
    sock.close()  # the pod must see EOF when the runner ends, whatever ends it
    for sig in (signal.SIGTERM, signal.SIGHUP):  # asked to stop: the runner cleans up
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    while True:
        try:
            _, status = os.waitpid(pid, os.WUNTRACED)
        except InterruptedError:
            continue
        if not os.WIFSTOPPED(status):
            break
        os.kill(pid, signal.SIGKILL)  # stopped by a command: it could not clean up any more
    kill_below_me()
    return os.waitstatus_to_exitcode(status)


def kill_below_me() -> None:
    """Kill and reap every descendant, until none is left."""
    while True:
        left = [p for p in descendants(os.getpid()) if not is_zombie(p)]
        kill_all(left)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not left:
            return


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is for the pod
    # A mask inherited from the spawning thread must not hide SIGCHLD (or reach commands).
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    sock = socket.socket(fileno=SOCKET_FD)
    runner = Runner(sock)
    try:
        set_child_subreaper()
        first: list[dict[str, Any]] = []
        while runner.running and not first:
            first = runner.receive()
        if not first or first[0].get("op") != "init":
            return 1
        policy = first[0].get("policy")
        sandbox, scope_below, notes = "none", None, list[str]()
        if policy is not None:
            sandbox, scope_below, notes = apply_policy(policy)
        if scope_below is not None:
            code = guard(scope_below, runner.sock)
            if code is not None:
                return code
    except Exception as e:  # the pod must hear why, whatever it was
        runner.send(op="fatal", error=f"{type(e).__name__}: {e}")
        return 1
    runner.send(op="ready", pid=os.getpid(), sandbox=sandbox, notes=notes)
    for msg in first[1:]:
        runner.handle(msg)
    runner.loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
