"""The guard between a pod and one stdio MCP server: `python -I guard.py -- COMMAND...`.

The pod starts the guard (in a new session, through the MCP SDK) with stdin/stdout as the MCP
pipes and stderr as the write end of a pipe whose only reader is the pod. The guard starts the
server in its own process group with the same three descriptors, then waits for either:

- the server's exit: it reports the status on stderr and kills what is left of the group;
- the pod's end, however it ends (`kill -9` included): the pod's read end closes, which the
  guard sees as POLLERR on its stderr; it kills the whole group, the server included, even a
  server that ignores EOF on stdin.

Run as a file, not as a module of the package, and with only the standard library's smallest
modules: it starts once per server and must start fast, whatever the pod's sys.path.
"""

import os
import select
import signal
import sys

# poll() reports these on a pipe's write end once it has no reader left.
_GONE = select.POLLERR | select.POLLHUP | select.POLLNVAL
_POLL_FALLBACK_MS = 100
_MAX_FD = 1 << 20  # os.closerange uses close_range(2): the bound costs nothing


def _say(text: str) -> None:
    try:  # noqa: SIM105 - contextlib is one more import for a process that must start fast
        os.write(2, f"mcp guard: {text}\n".encode("utf-8", "replace"))
    except OSError:
        pass  # nobody reads any more: the pod is gone, and we are about to kill the group


def _kill_group() -> None:
    # Our own group (the SDK made us a session leader); this kills the guard too.
    os.killpg(0, signal.SIGKILL)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"status {os.waitstatus_to_exitcode(status)}"


def _watch(pid: int) -> None:
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
                _kill_group()
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
    try:
        pid = os.posix_spawnp(command[0], command, os.environ)
    except OSError as exc:
        _say(f"cannot start {command[0]}: {exc.strerror or exc}")
        return 127
    # The server holds the MCP pipes now; the guard must not keep them open (EOF must reach
    # the pod when the server exits, and the server must see EOF when the pod closes stdin).
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    _watch(pid)
    _kill_group()  # the server's own children, if it left any
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
