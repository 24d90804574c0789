"""The guard between a pod and one stdio MCP server: `python -I guard.py -- COMMAND...`.

The pod starts the guard (in a new session, through the MCP SDK) with stdin/stdout as the MCP
pipes and stderr as the write end of a pipe whose only reader is the pod. The guard starts the
server in its own process group with the same three descriptors, then waits for either:

- the server's exit: it reports the status on stderr and kills what is left of the group;
- the pod's end, however it ends (`kill -9` included): the pod's read end closes, which the
  guard sees as POLLERR on its stderr; it kills the whole group, the server included, even a
  server that ignores EOF on stdin.

The guard is a child subreaper: what the server started in a session of its own (`setsid`, a
double fork: a browser some servers start detached) is re-parented to it rather than to init,
and is killed with the rest, every descendant first, then the group.

Run as a file, not as a module of the package, and with only the standard library's smallest
modules: it starts once per server and must start fast, whatever the pod's sys.path.
"""

import os
import select
import signal
import sys
from types import ModuleType

# poll() reports these on a pipe's write end once it has no reader left.
_GONE = select.POLLERR | select.POLLHUP | select.POLLNVAL
_POLL_FALLBACK_MS = 100
_MAX_FD = 1 << 20  # os.closerange uses close_range(2): the bound costs nothing


def _say(text: str) -> None:
    try:  # noqa: SIM105 - contextlib is one more import for a process that must start fast
        os.write(2, f"mcp guard: {text}\n".encode("utf-8", "replace"))
    except OSError:
        pass  # nobody reads any more: the pod is gone, and we are about to kill the group


def _runner() -> ModuleType:
    """poddaemon/runner.py, the command runner, by its path (standard library only, as this
    file): its subreaper and process-tree helpers."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runner.py")
    spec = importlib.util.spec_from_file_location("_poddaemon_runner", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kill_group(runner: ModuleType | None) -> None:
    # Every descendant (the server's tree, and orphans re-parented to us from other sessions),
    # then our own group (the SDK made us a session leader): this kills the guard too.
    for _ in range(3):  # a process forking meanwhile: its new children, on the next pass
        if runner is None or not runner.kill_all(runner.descendants(os.getpid())):
            break
    os.killpg(0, signal.SIGKILL)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"status {os.waitstatus_to_exitcode(status)}"


def _watch(pid: int, runner: ModuleType | None) -> None:
    """Return once the server exited (reported on stderr); kill the group if the pod goes."""
    poller = select.poll()
    poller.register(2, 0)  # no events asked: POLLERR/POLLHUP are always reported
    pidfd = -1
    try:
        pidfd = os.pidfd_open(pid)
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):
        pass  # kernel < 5.3: fall back to polling waitpid
    while True:
        try:
            ready = poller.poll(None if pidfd >= 0 else _POLL_FALLBACK_MS)
        except InterruptedError:
            continue
        for fd, events in ready:
            if fd == 2 and events & _GONE:
                _kill_group(runner)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _say(f"server exited with {_describe(status)}")
            return


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--":
        _say("usage: guard.py -- COMMAND [ARG...]")
        return 2
    command = argv[1:]
    # Only the three pipes pass to the server. uvloop's spawn leaks copies of a child's stdio
    # pipes under their first numbers: one of stdout kept in here and in the server would hide
    # from the pod that the server closed it (and no answer can come any more).
    os.closerange(3, _MAX_FD)
    runner: ModuleType | None = None
    try:
        runner = _runner()
        runner.set_child_subreaper()
    except (OSError, ImportError, AttributeError) as exc:  # the group kill still holds
        _say(f"cannot become a subreaper ({exc}): what the server detaches may outlive it")
    try:
        # The dispositions a program expects at exec, not the ones Python set for the guard
        # (SIGPIPE, SIGXFSZ ignored): a shell server's `yes | head` must end its writer.
        pid = os.posix_spawnp(
            command[0],
            command,
            os.environ,
            setsigmask=(),
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
    except OSError as exc:
        _say(f"cannot start {command[0]}: {exc.strerror or exc}")
        return 127
    # The server holds the MCP pipes now; the guard must not keep them open (EOF must reach
    # the pod when the server exits, and the server must see EOF when the pod closes stdin).
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    _watch(pid, runner)
    _kill_group(runner)  # the server's own children, if it left any
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
