"""Where poddaemon keeps its files (SPEC §2). Shared by the daemon, podctl and client programs.

Strings inside, `Path` at the edges: pathlib (with the urllib.parse it imports) is ~9 ms of a
process's start-up here, and `podctl spawn`, `notify`, `send` and `status POD` never need one.
The functions that hand out a `Path` import it when first called; the checks take either.
"""

from __future__ import annotations

import errno
import os
import re
import stat

from protocol import userdirs

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from pathlib import Path
    from typing import TypeVar

    P = TypeVar("P", str, Path)

APP = "poddaemon"
POD_NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9_-]{0,47}\Z")


def _path(text: str) -> Path:
    from pathlib import Path

    return Path(text)


def pod_name_problem(name: str) -> str | None:
    """Why `name` is no pod name (the manifest's `pod.name`, podctl's POD), or None."""
    if POD_NAME_RE.fullmatch(name):
        return None
    return (
        f"{name!r} is not a valid pod name "
        "(lowercase letters, digits, '-' and '_', at most 48 characters)"
    )


MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value or None  # empty variables count as unset


_DIR_VARS = (
    "PODDAEMON_HOME",
    "PODDAEMON_CONFIG_DIR",
    "PODDAEMON_DATA_DIR",
    "PODDAEMON_RUNTIME_DIR",
)


def absolute_env() -> None:
    """Make a relative directory variable (`PODDAEMON_HOME=h podctl spawn …`) absolute, from
    where the user stands. A pod's hooks and commands run in its pwd and inherit the variable:
    `podctl status` from a hook looked for the pods under `<pwd>/h` and found none."""
    for name in _DIR_VARS:
        value = os.environ.get(name)
        if value and not os.path.isabs(value):
            os.environ[name] = os.path.abspath(value)


def _home(sub: str) -> str | None:
    home = _env("PODDAEMON_HOME")
    return os.path.join(home, sub) if home else None


def _config_dir() -> str:
    return _env("PODDAEMON_CONFIG_DIR") or _home("config") or userdirs.user_config_dir(APP)


def _data_dir() -> str:
    return _env("PODDAEMON_DATA_DIR") or _home("data") or userdirs.user_data_dir(APP)


def _runtime_dir() -> str:
    return _env("PODDAEMON_RUNTIME_DIR") or _home("run") or userdirs.user_runtime_dir(APP)


def _log_dir() -> str:
    return _home("log") or userdirs.user_log_dir(APP)


def home_dir() -> Path | None:
    home = _env("PODDAEMON_HOME")
    return _path(home) if home else None


def config_dir() -> Path:
    return _path(_config_dir())


def data_dir() -> Path:
    return _path(_data_dir())


def runtime_dir() -> Path:
    return _path(_runtime_dir())


def log_dir() -> Path:
    return _path(_log_dir())


# --- private directories (SPEC §2) -------------------------------------------------------------
#
# Whoever can write to a directory on the way to a pod's socket or session log can swap it for
# their own: a fake socket that collects what root sends it, a log that restores a conversation
# nobody had. So the home, data and runtime directories must be ours and writable by nobody else,
# and so must every directory above them, unless it belongs to root (or us) and is sticky, like
# /tmp, where nobody may rename what another user made.


class UnsafeDirectory(PermissionError):
    """A directory another user could tamper with. `str()` is the one-line reason."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPERM, message)

    def __str__(self) -> str:
        return str(self.strerror)


_WHY = "another user could swap what it holds"


def _parents(path: str) -> list[str]:
    """The directories above absolute, normalized `path`, nearest first."""
    found = []
    parent = os.path.dirname(path)
    while parent != path:
        found.append(parent)
        path, parent = parent, os.path.dirname(parent)
    return found


def _ancestors(path: str | os.PathLike[str]) -> list[str]:
    """Every directory above `path`, as written and as resolved (a symlink's own parent
    matters as much as its target's)."""
    seen: dict[str, None] = {}
    for p in (os.path.abspath(path), os.path.realpath(path)):
        for parent in _parents(p):
            seen.setdefault(parent, None)
    return list(seen)


def check_dir(path: str | os.PathLike[str], what: str = "directory") -> None:
    """Raise `UnsafeDirectory` unless `path` is a directory owned by this user, not writable by
    group or others, under parents nobody else can rename it in. `what` names it in the message
    ("home directory", ...). A missing `path` raises FileNotFoundError."""
    try:
        os.fspath(path).encode()
    except UnicodeEncodeError:
        # Its name goes into the registry, the kept configurations and the wire, all UTF-8:
        # a PODDAEMON_HOME that is not ended in a UnicodeEncodeError traceback instead.
        raise UnsafeDirectory(f"{what} {path} is not UTF-8: refusing it") from None
    try:
        st = os.stat(path)
    except PermissionError:  # behind a directory we may not enter: someone else's
        raise UnsafeDirectory(
            f"{what} {path} is out of your reach (permission denied): refusing it"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{what} {path} is not a directory")
    _check_ours(st, path, what, _WHY)
    _check_links(path, what)
    _check_parents(path, what)


def _parts(path: str) -> list[str]:
    """The names in `path`, as pathlib parts them: empty and "." ones dropped, ".." kept."""
    return [part for part in path.split("/") if part and part != "."]


def _links_on_the_way(path: str | os.PathLike[str]) -> list[tuple[str, os.stat_result]]:
    """Every symlink the kernel follows to reach `path`, where it lies, with its lstat: those
    of the path as written and those met on the way from one link to the next (a link of ours
    to another user's link: only the first and the last path of the chain were looked at)."""
    whole = os.fspath(path)
    if not os.path.isabs(whole):  # (getcwd() of a directory removed since raises)
        whole = os.path.join(os.getcwd(), whole)
    todo = list(reversed(_parts(whole)))
    here = "/"
    found: list[tuple[str, os.stat_result]] = []
    while todo and len(found) <= 40:  # (ELOOP past that: stat, before us, said so)
        part = todo.pop()
        if part == "..":
            here = os.path.dirname(here)
            continue
        step = os.path.join(here, part)
        try:
            lst = os.lstat(step)
        except OSError:
            break  # (stat reached it: a parent we may not look into)
        if not stat.S_ISLNK(lst.st_mode):
            here = step
            continue
        found.append((step, lst))
        target = os.readlink(step)
        if target.startswith("/"):
            here = "/"
        todo.extend(reversed(_parts(target)))
    return found


def foreign_symlink(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """The first symlink on the way to `path` (link chains included) that another user owns,
    and its owner: they may repoint it whenever they like. None when there is none."""
    me = os.geteuid()
    for link, lst in _links_on_the_way(path):
        if lst.st_uid not in (0, me) and not _root_unmapped_here(lst.st_uid):
            return link, lst.st_uid
    return None


def _check_links(path: str | os.PathLike[str], what: str) -> None:
    """Raise `UnsafeDirectory` if a symlink on the way to `path` is another user's (its owner
    may repoint it, even in /tmp) or lies where another user could swap it."""
    me = os.geteuid()
    for link, lst in _links_on_the_way(path):
        if lst.st_uid not in (0, me) and not _root_unmapped_here(lst.st_uid):
            raise UnsafeDirectory(
                f"{what} {path} is reached through the symlink {link}, owned by uid "
                f"{lst.st_uid}, who could repoint it: refusing it"
            )
        _check_parents(path, what, below=link)


def _check_parents(
    path: str | os.PathLike[str], what: str, below: str | os.PathLike[str] | None = None
) -> None:
    """Raise `UnsafeDirectory` if another user could rename or swap what lies at `path`: a
    directory above `below` (default: `path`; it need not exist) is theirs, or writable by
    others without the sticky bit."""
    me = os.geteuid()
    for parent in _ancestors(path if below is None else below):
        pst = os.stat(parent)
        if pst.st_uid not in (0, me) and not _root_unmapped_here(pst.st_uid):
            raise UnsafeDirectory(
                f"{what} {path} is inside {parent}, owned by uid {pst.st_uid}, who could "
                f"swap it: refusing it"
            )
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            raise UnsafeDirectory(
                f"{what} {path} is inside {parent}, writable by group or others "
                f"(mode {pst.st_mode & 0o7777:04o}) without the sticky bit: refusing it, {_WHY}"
            )


def _root_unmapped_here(uid: int) -> bool:
    """`uid` is the overflow uid and this process is in a user namespace that does not map
    root: a pod's command runner, not root, maps only its own uid, so root's directories (`/`,
    `/home`) read as 65534 there. Whose they are cannot be told from inside (another user's
    directory reads the same): accepted only there, where the mode check still applies."""
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            if uid != int(f.read()):
                return False
        with open("/proc/self/uid_map") as f:
            fields = [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return False
    ranges = zip(fields[0::3], fields[2::3], strict=False)  # (first inside, count)
    return not any(first <= 0 < first + count for first, count in ranges)


def check_file(path: Path, what: str, why: str) -> None:
    """Raise `UnsafeDirectory` unless file `path` is this user's and writable by nobody else,
    in a directory `check_dir` accepts; `why` says what another user could do with it."""
    _check_ours(os.stat(path), path, what, why)
    check_dir(path.parent, f"{what}'s directory")
    _check_links(path, what)  # the file itself may be a link, to a link of another user's


def check_unchangeable(path: Path, what: str, why: str) -> None:
    """Raise `UnsafeDirectory` unless nobody but you and root could change file `path` or swap
    it: a file run or read as you that you need not own (a hook script in /usr/local/bin)."""
    st = os.stat(path)
    # (root's, read inside a command runner's user namespace: a pod spawned by a command)
    if st.st_uid not in (0, os.geteuid()) and not _root_unmapped_here(st.st_uid):
        raise UnsafeDirectory(f"{what} {path} is owned by uid {st.st_uid}: refusing it, {why}")
    if st.st_mode & 0o022:
        raise UnsafeDirectory(
            f"{what} {path} is writable by group or others (mode {st.st_mode & 0o7777:04o}): "
            f"refusing it, {why}; run chmod go-w {path}"
        )
    _check_links(path, what)
    _check_parents(path, what)


def _check_ours(st: os.stat_result, path: str | os.PathLike[str], what: str, why: str) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeDirectory(
            f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {me}): refusing it, {why}"
        )
    if st.st_mode & 0o022:
        raise UnsafeDirectory(
            f"{what} {path} is writable by group or others (mode {st.st_mode & 0o7777:04o}): "
            f"refusing it, {why}; run chmod go-w {path}"
        )


def ensure_dir(path: P, what: str = "directory") -> P:
    """Create `path` and any missing parents with mode 0700, whatever the umask, then
    `check_dir` it. An existing directory keeps its mode (if it passes the check)."""
    try:
        check_dir(path, what)
        return path  # there already, the usual case
    except FileNotFoundError:
        pass  # (and one we may not even look at is refused, not made)
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    # Judged before anything is made: in another user's directory they could swap what we
    # make for a symlink before our chmod (any file of ours would go 0700).
    if missing:
        _check_parents(path, what, below=missing[-1])
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue  # someone made it meanwhile: check_dir judges it like any other
        _chmod_dir(p)  # mkdir's mode went through the umask
    check_dir(path, what)
    return path


def _chmod_dir(path: str) -> None:
    """Mode 0700 for the directory at `path`, never following a symlink found there instead
    (what we made was swapped: check_dir then refuses it)."""
    nofollow = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:  # O_PATH: a umask that took our own read bit away must not stop us
        fd = os.open(path, os.O_PATH | nofollow)
    except OSError:
        return
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)  # fchmod refuses O_PATH descriptors
        return
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | nofollow)  # no /proc: a descriptor we can read, if we may
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """`os.open(path, flags | O_CREAT)`, the file mode 0600 whatever the umask (an existing file
    too): what poddaemon keeps on disk is nobody else's to read or change, and under umask 0277
    its own files came out 0400, which the next start could not reopen for writing."""
    fd = os.open(path, flags | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, text: str) -> None:
    """Write `path` whole as UTF-8, mode 0600 whatever the umask (an existing file too): what
    a pod keeps on disk is nobody else's to read or change, wherever its directory came from."""
    fd = open_private(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)


def ensure_private_dirs() -> tuple[str, str]:
    """For a pod: the home (when set), data and runtime directories, created 0700 and checked.
    Returns `(data, runtime)`."""
    home = _env("PODDAEMON_HOME")
    if home is not None:
        ensure_dir(home, "home directory")
    data = ensure_dir(_data_dir(), "data directory")
    return data, ensure_dir(_runtime_dir(), "runtime directory")


def check_private_dirs() -> None:
    """For a client: refuse the home, data or runtime directory if it exists and another user
    could tamper with it (one that does not exist yet holds nothing to fear)."""
    for path, what in (
        (_env("PODDAEMON_HOME"), "home directory"),
        (_data_dir(), "data directory"),
        (_runtime_dir(), "runtime directory"),
    ):
        if path is None:
            continue
        try:
            check_dir(path, what)
        except FileNotFoundError:
            continue  # (not lexists: that is False for a path we may not even look at)


def sessions_dir() -> Path:
    return data_dir() / "sessions"


def registry_path() -> Path:
    return runtime_dir() / "pods.json"


def pod_dir(name: str) -> Path:
    return runtime_dir() / "pods" / name


def kept_config(name: str) -> Path:
    """`<data>/pods/<name>.toml`: a pod's fully resolved configuration (SPEC §9), what
    `podctl restart` starts it from."""
    return data_dir() / "pods" / f"{name}.toml"


def kept_callback(name: str) -> Path:
    """`<data>/pods/<name>.callback`: the socket of the pod that spawned `name` (its parent),
    kept with its configuration so that a restarted child reports to it again."""
    return data_dir() / "pods" / f"{name}.callback"


def socket_path(name: str) -> Path:
    return _path(socket_file(name))


def socket_file(name: str) -> str:
    """`socket_path(name)` as a string, written as pathlib writes it, without pathlib."""
    return tidy(os.path.join(_runtime_dir(), "pods", name, "sock"))


def tidy(path: str) -> str:
    """`path` as `str(Path(path))` writes it: no doubled slashes, "." parts or trailing slash."""
    head = "//" if path[:2] == "//" and path[2:3] != "/" else "/" if path[:1] == "/" else ""
    return head + "/".join(_parts(path)) or "."


def defaults_path() -> Path:
    return config_dir() / "defaults.toml"


def socket_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot be a Unix socket address, or None when it can."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        return (
            f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow "
            f"{MAX_SOCKET_PATH}: use a shorter PODDAEMON_RUNTIME_DIR or pod name"
        )
    return None
