"""Finding a pod's socket, and refusing one that another user owns or serves (SPEC §2).

Standard library only, and `_socket` rather than `socket` (whose enum set-up costs ~2 ms): the
one-call client of podctl (`protocol.oneshot`) uses this without the rest of the package.
"""

import _socket
import errno
import os
import stat
import struct

from protocol import paths
from protocol.errors import PodNotRunning, UnsafeSocket

_UCRED_SIZE = 12  # struct ucred: pid, uid, gid as C ints


def resolve_socket(target: str | os.PathLike[str]) -> str:
    """A pod name maps to its socket under the runtime dir; anything with a slash is a path."""
    text = os.fspath(target)
    if "/" in text:
        return paths.tidy(text)
    return paths.socket_file(text)


def _check_uid(uid: int, what: str) -> None:
    # Our own uid only (SPEC §2), root's included: a pod of root's refuses us anyway, and only
    # after our request has gone out to it.
    me = os.getuid()
    if uid != me:
        raise UnsafeSocket(
            f"{what} belongs to uid {uid}, not to you (uid {me}): refusing to use it"
        )


def check_socket_owner(path: str) -> None:
    """Refuse a socket file another user owns (SPEC §2): it may be an impostor's.

    Raises FileNotFoundError when there is no socket, like connect() would.
    """
    try:
        st = os.stat(path)
    except PermissionError:  # a directory on the way we may not enter: someone else's
        raise UnsafeSocket(
            f"socket {path} is out of your reach (permission denied): another user's, most likely"
        ) from None
    _check_uid(st.st_uid, f"socket {path}")


def check_peer(sock: _socket.socket, path: str) -> None:
    """Refuse a connection whose listening process runs as another user (no race with a swap)."""
    raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _UCRED_SIZE)
    pid, uid, _ = memoryview(raw).cast("i")
    if pid == 0:  # no peer: an asyncio connect that met a full backlog (EAGAIN) looks done
        raise ConnectionError(
            errno.EAGAIN, f"{path}: the pod did not take the connection (too many at once)"
        )
    _check_uid(uid, f"the process (pid {pid}) behind socket {path}")


GONE = (FileNotFoundError, ConnectionRefusedError, NotADirectoryError)


def not_running_error(target: str | os.PathLike[str], path: str, exc: OSError) -> PodNotRunning:
    """What `connect` raises when nothing serves `path`, saying where it looked: a user whose
    environment points elsewhere (XDG_RUNTIME_DIR, PODDAEMON_HOME) sees it at once."""
    if isinstance(exc, ConnectionRefusedError):  # a dead pod's socket file, not yet reclaimed
        try:
            socket_file = stat.S_ISSOCK(os.stat(path).st_mode)
        except OSError:
            socket_file = True  # gone meanwhile: as it was
        if not socket_file:  # `podctl send pod.toml hi`: a manifest given for the pod
            hint = " (a manifest? `podctl spawn` it, then name the pod)"
            return PodNotRunning(
                os.fspath(target), f"{path} is not a socket{hint if path.endswith('.toml') else ''}"
            )
        return PodNotRunning(os.fspath(target), f"nothing listens on {path}")
    return PodNotRunning(os.fspath(target), f"no socket at {path}")


def _connect(sock: _socket.socket, path: str, timeout: float | None) -> None:
    """connect(), waiting up to `timeout` for room when the pod's listen backlog is full.

    A timeout makes Python's socket non-blocking, and a Unix socket's connect() then fails at
    once with EAGAIN on a full backlog (a burst of clients, or one flooding the pod): `podctl
    stop` said "Resource temporarily unavailable" with 30 s left to wait. Blocking, the kernel
    waits for room itself, up to SO_SNDTIMEO, then says EAGAIN: a timeout here."""
    if not timeout:
        sock.connect(path)  # blocking (waits as long as it takes) or non-blocking by choice
        return
    whole = int(timeout)
    sock.settimeout(None)
    sock.setsockopt(
        _socket.SOL_SOCKET,
        _socket.SO_SNDTIMEO,
        struct.pack("ll", whole, int((timeout - whole) * 1e6)),
    )
    try:
        sock.connect(path)
    except BlockingIOError:
        raise TimeoutError(
            errno.ETIMEDOUT,
            f"{path}: the pod took no new connection in {timeout:g} s (too many at once)",
        ) from None
    finally:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
        sock.settimeout(timeout)


def connect(target: str | os.PathLike[str], timeout: float | None) -> _socket.socket:
    """A connected socket to a pod, after checking that this user owns the socket and the pod
    serving it. PodNotRunning when nothing listens there; UnsafeSocket for another user's."""
    path = resolve_socket(target)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        check_socket_owner(path)
        _connect(sock, path, timeout)
        check_peer(sock, path)
    except GONE as exc:
        sock.close()
        raise not_running_error(target, path, exc) from exc
    except BaseException:
        sock.close()
        raise
    return sock
