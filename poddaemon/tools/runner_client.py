"""The pod's handle on its command runner (`poddaemon/runner.py`, a helper process that starts
commands and kills every one of them, `setsid` escapees included, when the pod ends however it
ends). Started lazily at the first command, with `posix_spawn` (no fork of the pod's heap) and
`python -I` (the caller's cwd never shadows a module); closed by `ToolContext.aclose()`."""

import array
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

RUNNER_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runner.py")
START_TIMEOUT = 30.0
# Variables that look like credentials never reach a command unless the manifest passes them
# (`[worker] env_passthrough`): the provider's API key above all.
_SECRET_SUFFIXES = ("_API_KEY",)
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD")


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return (
        upper == "API_KEY"
        or upper.endswith(_SECRET_SUFFIXES)
        or any(word in upper for word in _SECRET_WORDS)
    )


def clean_env(
    environ: Mapping[str, str], passthrough: Iterable[str] = (), hidden: Iterable[str] = ()
) -> dict[str, str]:
    """`environ` without credential-like variables, nor those named in `hidden` (the
    providers' key variables, whatever their names), except those named in `passthrough`."""
    keep = set(passthrough)
    drop = set(hidden)
    return {k: v for k, v in environ.items() if k in keep or not (k in drop or is_secret_name(k))}


def _settle(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


class RunnerError(Exception):
    """The command runner could not start, or died; the text says why."""


class Command(msgspec.Struct):
    """A command the runner started. `exited` gets its returncode (negative: killed by signal)."""

    id: int
    pid: int
    exited: "asyncio.Future[int]"


class CommandRunner:
    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.pid = pid
        self.sandbox = "none"  # what the runner's policy amounted to (issue 13 fills it in)
        self.notes: list[str] = []  # what its sandbox could not do there, for `status`
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._replies: dict[tuple[str, int], asyncio.Future[dict[str, Any]]] = {}
        self._commands: dict[int, Command] = {}
        self._idle: asyncio.Future[None] | None = None  # set once _commands is empty
        self._next_id = 0
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._reader = self._loop.create_task(self._read_loop())

    @property
    def alive(self) -> bool:
        return not self._closed

    @property
    def busy(self) -> bool:
        """Commands it started are not yet done with (killed and forgotten)."""
        return bool(self._commands)

    async def idle(self) -> None:
        """Return once no command it started is left (at once if none is), or it is gone."""
        while self._commands and not self._closed:
            self._idle = self._loop.create_future()
            await self._idle

    def _forget(self, cid: int) -> None:
        self._commands.pop(cid, None)
        if not self._commands and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    @classmethod
    async def start(
        cls, env: Mapping[str, str], policy: bytes | None = None, timeout: float = START_TIMEOUT
    ) -> "CommandRunner":
        """Start a runner with environment `env` (what every command inherits), confined by
        `policy` (JSON for `poddaemon.sandbox.apply_policy`) before it starts anything."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fd = theirs.fileno()
            if fd == 3:  # dup2(3, 3) would leave close-on-exec set
                fd = os.dup(fd)
                theirs.close()
                theirs = socket.socket(fileno=fd)
            pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-I", RUNNER_PATH],
                dict(env),
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, fd, 3),
                ],
                setsid=True,  # a kill of the pod's process group leaves it to clean up
                setsigmask=(),  # whatever the spawning thread blocks
                setsigdef=(signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        runner = cls(ours, pid)
        try:
            text = policy.decode() if policy is not None else None
            await runner._send({"op": "init", "policy": text})
            ready = await asyncio.wait_for(asyncio.shield(runner._ready), timeout)
        except BaseException:
            await runner.aclose()
            raise
        runner.sandbox = str(ready.get("sandbox", "none"))
        runner.notes = [str(n) for n in ready.get("notes", [])]
        return runner

    # --- commands ------------------------------------------------------------------------------

    async def _spawn(
        self,
        argv: list[str],
        cwd: str,
        output_fd: int,
        stdio: tuple[int, int] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Command:
        """Start `argv` in its own session in `cwd`, stdout and stderr to `output_fd` (the
        caller keeps and closes its own copy) or, with `stdio` = (stdin, stderr), stdin from
        and stderr to those; `env`: variables for it besides the runner's. Raises RunnerError
        if it could not start."""
        self._next_id += 1
        cid = self._next_id
        reply = self._expect("started", cid)
        failed = self._expect("failed", cid)
        # Registered before the request: a quick command's `exited` may arrive in the same
        # read as `started`, before this coroutine resumes.
        command = Command(id=cid, pid=0, exited=self._loop.create_future())
        self._commands[cid] = command
        try:
            msg: dict[str, Any] = {"op": "start", "id": cid, "argv": argv, "cwd": cwd}
            if env:
                msg["env"] = dict(env)
            fds = [output_fd]
            if stdio is not None:
                msg["fds"] = 3
                fds = [stdio[0], output_fd, stdio[1]]
            await self._send(msg, fds)
            done, _ = await asyncio.wait({reply, failed}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._forget(cid)
            raise
        finally:
            for kind in ("started", "failed"):
                self._replies.pop((kind, cid), None)
        if failed in done:
            reply.cancel()
            self._forget(cid)
            raise RunnerError(f"could not start the command: {failed.result()['error']}")
        failed.cancel()
        command.pid = int(reply.result()["pid"])
        return command

    async def spawn(
        self,
        argv: list[str],
        cwd: str,
        output_fd: int,
        stdio: tuple[int, int] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Command:
        """`_spawn`, safe to cancel: cancelled while the runner starts the command (which may be
        forking already), it waits for it and kills it, with all it started, before the
        cancellation goes on. `_spawn` cancelled only forgot it, and it ran on."""
        spawning = asyncio.ensure_future(self._spawn(argv, cwd, output_fd, stdio, env))
        try:
            return await asyncio.shield(spawning)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await self.kill(await spawning)
            raise

    async def kill(self, command: Command) -> int:
        """Kill the command's group, every process it started (`setsid` ones too) and what it
        left behind, and forget it. Returns how many processes were killed."""
        if self._closed:
            self._kill_group(command)
            return 0
        reply = self._expect("killed", command.id)
        try:
            await self._send({"op": "kill", "id": command.id})
            msg = await reply
        finally:
            self._replies.pop(("killed", command.id), None)
            self._forget(command.id)
        return int(msg.get("count", 0))

    # --- lifetime ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the socket: the runner kills every command left and exits; reap it."""
        self._reader.cancel()
        try:
            # (Not `await self._reader` under suppress(BaseException): that swallowed the
            # caller's cancellation too, and a cancelled command went on to run.)
            await asyncio.wait({self._reader})
        finally:
            self._sock.close()
            await self._reap()
        if not self._reader.cancelled():
            self._reader.exception()  # retrieved: one that failed on its own is not logged again

    async def _reap(self) -> None:
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:  # already reaped, or no pidfd: wait in a thread
            with contextlib.suppress(ChildProcessError):
                await asyncio.to_thread(os.waitpid, self.pid, 0)
            return
        try:
            exited = self._loop.create_future()
            self._loop.add_reader(pidfd, lambda: _settle(exited))
            try:
                await exited
            finally:
                self._loop.remove_reader(pidfd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        finally:
            os.close(pidfd)

    # --- wire ----------------------------------------------------------------------------------

    def _expect(self, kind: str, cid: int) -> "asyncio.Future[dict[str, Any]]":
        if self._closed:
            raise RunnerError("the command runner has exited")
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._replies[(kind, cid)] = fut
        return fut

    async def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        data = msgspec.json.encode(msg) + b"\n"
        async with self._send_lock:
            if self._closed:
                raise RunnerError("the command runner has exited")
            try:
                if fds:  # the fds travel with the first byte of the request
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    while True:
                        try:
                            sent = self._sock.sendmsg([data], ancillary)
                            break
                        except BlockingIOError:
                            await self._writable()
                    data = data[sent:]
                if data:
                    await self._loop.sock_sendall(self._sock, data)
            except OSError as e:
                raise RunnerError(f"the command runner is gone: {e}") from None

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_writer(fd, lambda: _settle(fut))
        try:
            await fut
        finally:
            self._loop.remove_writer(fd)

    async def _read_loop(self) -> None:
        buf = b""
        try:
            while True:
                try:
                    chunk = await self._loop.sock_recv(self._sock, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    if line:
                        self._dispatch(msgspec.json.decode(line))
        finally:
            self._on_exit()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "ready":
            if not self._ready.done():
                self._ready.set_result(msg)
        elif op == "fatal":
            if not self._ready.done():
                self._ready.set_exception(RunnerError(f"command runner: {msg.get('error')}"))
        elif op == "exited":
            command = self._commands.get(int(msg["id"]))
            if command is not None and not command.exited.done():
                command.exited.set_result(int(msg["status"]))
        else:
            fut = self._replies.get((str(op), int(msg.get("id", 0))))
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _on_exit(self) -> None:
        """The runner is gone (or closed): fail everything waiting on it. It kills its commands
        as it exits; if it was itself killed, kill the groups it told us about."""
        self._closed = True
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        error = RunnerError("the command runner exited")
        waiting: list[asyncio.Future[Any]] = [self._ready, *self._replies.values()]
        waiting += [c.exited for c in self._commands.values()]
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: nobody may be waiting on it any more
        for command in self._commands.values():
            self._kill_group(command)

    @staticmethod
    def _kill_group(command: Command) -> None:
        if command.pid <= 0:  # not started yet (no `started` reply): killpg(0) is our own group
            return
        if not command.exited.done() or command.exited.exception() is not None:
            with contextlib.suppress(OSError):
                os.killpg(command.pid, signal.SIGKILL)
