"""The machine-wide registry of live pods and their scope claims: `<runtime>/pods.json` (SPEC §4).

Every change is one transaction under `<runtime>/pods.json.lock`: read, reclaim dead entries,
check, modify, then write a temp file, fsync it, `os.replace` it over pods.json and fsync the
directory. Readers never see a torn file, so `live()` and `get()` read without the lock.

Delegation: a pod whose `parent` is a live entry may claim write areas inside its parent's
writable scope. Those areas are recorded in the parent's `delegated` list (the parent loses
write there) in the same transaction, and handed back when the child's entry goes and no live
pod writes inside them any more (a grandchild outlives its parent under `detach`).
"""

import contextlib
import errno
import functools
import os
import re
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from poddaemon.scope import Access, Mount, Rule, Scope, on_devices, write_overlap
from protocol import paths
from protocol.unreadable import UNREADABLE

if TYPE_CHECKING:
    import filelock  # imported when a transaction first locks: readers (podctl ls) skip ~10 ms

__all__ = [
    "LOCK_TIMEOUT",
    "PodEntry",
    "Registry",
    "RegistryBusy",
    "RegistryConflict",
    "RegistryError",
    "is_alive",
    "lock_holder",
    "make_entry",
    "process_start_time",
    "start_time_of_stat",
]

LOCK_TIMEOUT = 10.0  # seconds; a transaction takes milliseconds, so this means a stuck holder
_VERSION = 1
MAX_REGISTRY_BYTES = 64 << 20  # ~100,000 pods' entries; past it, the file is not ours
_T = TypeVar("_T")


class PodEntry(msgspec.Struct, kw_only=True):
    name: str
    pid: int
    start_time: int  # clock ticks since boot, /proc/<pid>/stat field 22: tells pid reuse apart
    # The boot it was made in: after a reboot the same pid can start at the same tick (services
    # started at boot do), so a pid and start time tell nothing about an entry from before it.
    # Empty in entries of earlier versions.
    boot_id: str = ""
    socket: str
    scope: list[dict[str, Any]]  # Scope.to_dicts()
    parent: str | None = None
    session: str | None = None
    started_at: float
    delegated: list[str] = []  # write targets handed to live children
    # Those of them handed non-recursively (the target and its direct entries only). Listed in
    # `delegated` too: a reader that knows no better takes the whole tree, the safe side.
    delegated_flat: list[str] = []

    def scope_obj(self) -> Scope:
        """The scope as granted, without delegation."""
        return Scope.from_dicts(self.scope)

    def delegated_areas(self) -> list[Rule]:
        """The write areas handed to live children, as the children's rules."""
        flat = set(self.delegated_flat)
        return [
            Rule(target=t, access=Access.WRITE, recursive=t not in flat) for t in self.delegated
        ]

    def effective_scope(self) -> Scope:
        """The scope minus write areas delegated to live children."""
        return self.scope_obj().with_delegated(self.delegated_areas())

    def delegating(self, areas: Iterable[Rule]) -> "PodEntry":
        """This entry with `areas` as what it has delegated. A target handed both ways counts
        as handed whole."""
        whole: dict[str, bool] = {}
        for area in areas:
            whole[area.target] = whole.get(area.target, False) or area.recursive
        return msgspec.structs.replace(
            self,
            delegated=list(whole),
            delegated_flat=[t for t, w in whole.items() if not w],
        )


class _File(msgspec.Struct):
    version: int = _VERSION
    pods: dict[str, PodEntry] = {}


_decoder = msgspec.json.Decoder(_File)
_encoder = msgspec.json.Encoder()


class RegistryError(Exception):
    """The registry cannot be used (corrupt file, lock timeout, no such entry)."""


class RegistryConflict(RegistryError):
    """A live pod already holds the name or an overlapping write claim."""


class RegistryBusy(RegistryError):
    """The registry lock could not be had in time (a stuck holder): unlike the others, this
    passes with its holder, and trying again later may well succeed."""


class _LockLost(Exception):
    """The lock file was removed or replaced while this transaction held it: nothing written."""


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes, up to `limit`. Anything else there is an OSError at once: a FIFO
    in the registry's place blocked every pod's loop in open(), a link to /dev/zero filled its
    memory (every pod reads the registry every few seconds)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file; remove it by hand", str(path))
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, past any registry's size", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _reason(e: OSError) -> str:
    """An OSError as a short clause ("permission denied"), without errno or the file name."""
    text = str(e) if isinstance(e, paths.UnsafeDirectory) else (e.strerror or str(e))
    return text[:1].lower() + text[1:]


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when no such (living) process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return start_time_of_stat(f.read())
    except OSError:
        return None


# PF_EXITING in a task's flags: do_exit has begun. Set before the process's files are closed.
_PF_EXITING = 0x4


def start_time_of_stat(data: bytes) -> int | None:
    """The start time in a /proc/PID/stat line, or None for a process that is gone or going.

    The command name (field 2) may hold spaces and parentheses, so split at the last ')'.
    Zombies count as gone: the pod has exited and only waits for its parent to reap it. So does
    a process already in its exit: a pod killed a moment ago has closed its socket, and is not
    "starting" again while the kernel finishes tearing it down (it runs no more code of its own).
    """
    _, sep, rest = data.rpartition(b")")
    fields = rest.split()
    # rest starts at field 3 (state): field 9 (flags) is fields[6], 22 (starttime) fields[19].
    if not sep or len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    try:
        return None if int(fields[6]) & _PF_EXITING else int(fields[19])
    except ValueError:
        return None


def lock_holder(path: Path) -> str | None:
    """`pid N (its command line)` of the process holding the flock on `path`, from
    /proc/locks; None when it cannot be told."""
    try:
        st = os.stat(path)
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            pid = next(
                int(fields[4])
                for fields in map(str.split, f)
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where
            )
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError, StopIteration):
        return None
    return f"pid {pid} ({command})" if command else f"pid {pid}"


def is_alive(entry: PodEntry) -> bool:
    """The entry's process still runs and is the same process (not a reused pid, not a process
    of a later boot: a registry in a directory that outlives reboots keeps its entries)."""
    if entry.boot_id and entry.boot_id != boot_id():
        return False
    start = process_start_time(entry.pid)
    if start == entry.start_time:  # (a start time read is never None)
        return True
    # The caller's own entry is alive whatever /proc read this instant: a pod whose own
    # transaction judged its entry dead reclaimed it, removed its own socket and stopped
    # (seen once in a full test run, cause unknown: what was read is logged).
    if entry.pid == os.getpid() and _own_start_time() == entry.start_time:
        import logging

        logging.getLogger("poddaemon.registry").warning(
            "registry: /proc/%d/stat read as start time %s, not %s: this process's entry kept",
            entry.pid,
            start,
            entry.start_time,
        )
        return True
    return False


_own: tuple[int, int] | None = None  # this process's pid and start time, once read


def _own_start_time() -> int | None:
    """This process's start time, as first read (a forked child reads its own)."""
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:
        start = process_start_time(pid)
        if start is None:
            return None
        _own = (pid, start)
    return _own[1]


def _started_at(pid: int) -> float | None:
    """When `pid` started, in seconds since the epoch (None: no such live process)."""
    ticks = process_start_time(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


@functools.cache
def boot_id() -> str:
    """This boot's random id (empty where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def make_entry(
    name: str,
    socket: str,
    scope: Scope,
    *,
    parent: str | None = None,
    session: str | None = None,
    pid: int | None = None,
) -> PodEntry:
    """An entry for `pid` (default: this process) with its start time filled in."""
    pid = os.getpid() if pid is None else pid
    start = _own_start_time() if pid == os.getpid() else process_start_time(pid)
    if start is None:
        raise RegistryError(f"process {pid} is not running")
    return PodEntry(
        name=name,
        pid=pid,
        start_time=start,
        boot_id=boot_id(),
        socket=socket,
        scope=scope.to_dicts(),
        parent=parent,
        session=session,
        started_at=time.time(),
    )


def _write_claims(entry: PodEntry) -> tuple[Rule, ...]:
    return entry.scope_obj().writable_rules()


def _written_below(pods: dict[str, PodEntry], holder: PodEntry, area: Rule) -> bool:
    """Whether a live pod other than `holder` writes inside the `area` it delegated. Its
    ancestors' claims cover the area from above: they do not count."""
    ancestors: set[str] = set()
    name = holder.parent
    while name is not None and name in pods and name not in ancestors:
        ancestors.add(name)
        name = pods[name].parent
    return any(
        area.covers(rule.target)
        for pod in pods.values()
        if pod.name != holder.name and pod.name not in ancestors
        for rule in _write_claims(pod)
    )


def _overlap_message(other: PodEntry, path: str, mounted: bool = False) -> str:
    if mounted:
        return (
            f"scope conflict: pod {other.name!r} (pid {other.pid}) already holds write access "
            f"to files that {path} reaches (the same files, through a bind mount)"
        )
    return (
        f"scope conflict: pod {other.name!r} (pid {other.pid}) already holds write access to {path}"
    )


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")  # (compiled at import: a forked pod inherits it)


def read_mounts() -> list[Mount]:
    """This mount namespace's mounts, from /proc/self/mountinfo: (mount point, device, root)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    unescape = functools.partial(_OCTAL_ESCAPE.sub, lambda m: chr(int(m[1], 8)))
    mounts: list[Mount] = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            mounts.append((unescape(fields[4]), fields[2], unescape(fields[3])))
    return mounts


class Registry:
    def __init__(
        self,
        runtime_dir: Path | str,
        *,
        lock_timeout: float = LOCK_TIMEOUT,
        sessions_dir: Path | str | None = None,
    ) -> None:
        self.runtime_dir = Path(runtime_dir)
        # Where the pods' session logs are: given, a reclaimed pod's empty session file (made
        # ahead of a first input that never came) goes with its entry. Readers need none.
        self.sessions_dir = None if sessions_dir is None else Path(sessions_dir)
        self.path = self.runtime_dir / "pods.json"
        self.lock_path = self.runtime_dir / "pods.json.lock"
        self._lock_timeout = lock_timeout
        self._lock: filelock.FileLock | None = None

    # -- reading -------------------------------------------------------------------------------

    def _read(self) -> dict[str, PodEntry]:
        try:
            data = _read_regular(self.path, MAX_REGISTRY_BYTES)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise RegistryError(f"cannot read the pod registry {self.path}: {_reason(e)}") from e
        if not data.strip():
            return {}  # nothing was ever claimed in it; our writes are never empty
        try:
            doc = _decoder.decode(data)
        except UNREADABLE as e:
            # Never wipe it: other pods' claims would silently vanish.
            raise RegistryError(
                f"{self.path}: corrupt pod registry ({e}); fix or remove it by hand "
                "(live pods then register themselves again)"
            ) from e
        if doc.version != _VERSION:
            raise RegistryError(
                f"{self.path}: unsupported registry version {doc.version} (expected {_VERSION})"
            )
        for key, entry in doc.pods.items():
            if key != entry.name:
                raise RegistryError(
                    f"{self.path}: corrupt pod registry (key {key!r} holds pod {entry.name!r})"
                )
            try:
                Scope.from_dicts(entry.scope)
            except (KeyError, TypeError, ValueError) as e:
                raise RegistryError(
                    f"{self.path}: corrupt pod registry (scope of pod {key!r}: {e!r})"
                ) from e
        return doc.pods

    def live(self) -> list[PodEntry]:
        """Entries whose process still runs. Lock-free: the file is only ever replaced whole."""
        return [e for e in self._read().values() if is_alive(e)]

    def get(self, name: str) -> PodEntry | None:
        entry = self.entry(name)
        return entry if entry is not None and is_alive(entry) else None

    def entry(self, name: str) -> PodEntry | None:
        """The entry of `name`, its process alive or not (one not yet reclaimed)."""
        return self._read().get(name)

    # -- transactions --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            if not self.runtime_dir.is_dir():
                paths.ensure_dir(self.runtime_dir, "runtime directory")
        except OSError as e:
            raise RegistryError(f"cannot create {self.runtime_dir}: {_reason(e)}") from None
        import filelock

        if self._lock is None:
            self._lock = filelock.FileLock(
                self.lock_path, timeout=self._lock_timeout, mode=0o600, poll_interval=0.005
            )
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise RegistryBusy(
                f"timed out after {self._lock_timeout:g}s waiting for the registry lock "
                f"{self.lock_path}; {lock_holder(self.lock_path) or 'another process'} holds it"
            ) from None
        except OSError as e:  # e.g. a lock file another user made, that we may not open
            raise RegistryError(
                f"cannot open the registry lock {self.lock_path}: {_reason(e)}"
            ) from None
        try:
            yield
        finally:
            self._lock.release()

    def _transact(self, change: Callable[[dict[str, PodEntry]], _T]) -> _T:
        """Run `change` on the reclaimed pods under the lock and persist the result.

        `change` must check before it mutates: if it raises, only the reclaim is written.
        Run again, on what is there then, when the lock file was removed or replaced while
        we held it (see `_holds_lock_file`).
        """
        deadline = time.monotonic() + self._lock_timeout
        while True:
            try:
                return self._transact_once(change)
            except _LockLost:
                if time.monotonic() >= deadline:
                    raise RegistryBusy(
                        f"the registry lock {self.lock_path} was removed or replaced during "
                        f"every transaction for {self._lock_timeout:g}s; leave it in place"
                    ) from None

    def _transact_once(self, change: Callable[[dict[str, PodEntry]], _T]) -> _T:
        with self._locked():
            pods = self._read()
            before = dict(pods)
            reclaimed = self._reclaim(pods)
            try:
                result = change(pods)
            except BaseException:
                if reclaimed:
                    with contextlib.suppress(_LockLost):  # the next transaction reclaims
                        self._write(pods)
                        self._remove_empty_sessions(reclaimed, pods)
                raise
            if pods != before:
                self._write(pods)
            self._remove_empty_sessions(reclaimed, pods)
            return result

    def _holds_lock_file(self) -> bool:
        """The file we hold locked is still the one at the lock's path. Removed (or replaced)
        under a holder, the lock let the next transaction lock a new file and run at once: both
        decided on the same pods.json, and the later write lost the other's claim (two pods
        told yes for overlapping write scopes). True when it cannot be told (filelock keeps
        the descriptor in `_context.lock_file_fd`, from 3.13 on)."""
        fd = getattr(getattr(self._lock, "_context", None), "lock_file_fd", None)
        if not isinstance(fd, int):
            return True
        try:
            held = os.fstat(fd)
            named = os.stat(self.lock_path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True  # cannot look: not proof of anything
        return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)

    def _reclaim(self, pods: dict[str, PodEntry]) -> list[PodEntry]:
        dead = [e for e in pods.values() if not is_alive(e)]
        for entry in dead:
            self._drop(pods, entry)
            self._remove_stale_files(entry)
        return dead

    def _remove_empty_sessions(self, dead: list[PodEntry], pods: dict[str, PodEntry]) -> None:
        """Remove the session files the `dead` pods named that are still empty: a pod names
        its first session's file as soon as it makes it, ahead of its first input, and one
        killed before that input (`kill -9`, a crash loop under `Restart=on-failure`) left one
        more empty file per life. Only now, its entry gone under the lock, is nobody writing
        there: a live pod (`pods`) naming the same session keeps it. A file with any byte in
        it is never removed (see `remove_if_empty`)."""
        if self.sessions_dir is None or not dead:
            return
        from poddaemon.store.file import remove_if_empty

        held = {p.session for p in pods.values()}
        for entry in dead:
            if entry.session is not None and entry.session not in held:
                with contextlib.suppress(OSError, ValueError):  # best effort, like the socket
                    remove_if_empty(self.sessions_dir, entry.session)

    def _drop(self, pods: dict[str, PodEntry], entry: PodEntry) -> None:
        """Remove `entry` and hand the areas it wrote back to whoever had delegated them, except
        where a live pod still writes inside: the children of a spawner that died keep theirs,
        and its own spawner stays without write there until they go too (they are not its
        children: nobody else hands those areas back)."""
        del pods[entry.name]
        freed = _write_claims(entry)
        for holder in list(pods.values()):
            if not holder.delegated:
                continue
            areas = holder.delegated_areas()
            kept = [
                a
                for a in areas
                if not any(a.intersection(f) for f in freed) or _written_below(pods, holder, a)
            ]
            if len(kept) != len(areas):
                pods[holder.name] = holder.delegating(kept)

    def _remove_stale_files(self, entry: PodEntry) -> None:
        # Best effort: nobody live holds this name (claim before bind), so these are leftovers,
        # unless a live pod of this name has no entry (pods.json replaced by an older copy that
        # names an earlier process of it): its socket and pid file are its own.
        pod_dir = self.runtime_dir / "pods" / entry.name
        if _running_pid(pod_dir) not in (None, entry.pid):
            return
        for leftover in ("sock", "pid"):
            with contextlib.suppress(OSError):
                (pod_dir / leftover).unlink()

    def _write(self, pods: dict[str, PodEntry]) -> None:
        try:
            self._replace(_encoder.encode(_File(version=_VERSION, pods=pods)))
        except OSError as e:
            # The temporary file it is written to first, when that is what failed (something
            # else put in its place): pods.json itself may be fine, or absent.
            tmp = self._tmp_path
            where = f" ({tmp}; remove it)" if e.filename == str(tmp) and not e.filename2 else ""
            raise RegistryError(
                f"cannot write the pod registry {self.path}{where}: {_reason(e)}"
            ) from e

    @property
    def _tmp_path(self) -> Path:
        # One fixed name: every writer holds the lock, so no two use it at once, and what a
        # writer killed before its rename left there is overwritten by the next (a unique
        # name per write piled up one file per such crash).
        return self.runtime_dir / ".pods.json.tmp"

    def _replace(self, data: bytes) -> None:
        tmp = self._tmp_path
        fd = paths.open_private(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if not self._holds_lock_file():  # (looked at last: the fsync takes milliseconds)
                raise _LockLost
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.runtime_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)

    # -- the operations ------------------------------------------------------------------------

    def register(
        self, entry: PodEntry, kin: Collection[str] = (), *, returning: bool = False
    ) -> PodEntry:
        """Claim `entry.name` and its write scope; RegistryConflict names who holds them.

        A live pod whose entry went (pods.json removed or rewritten by hand, as the message for
        a corrupt registry advises) registers itself again (`returning`) within a second; until
        then a new pod is refused, since its scope is unknown: it could not be checked.

        With a live parent, write rules inside the parent's writable area are a delegation:
        allowed, and recorded in the parent's `delegated`. Live descendants found registered
        are taken back (their areas stay delegated): those whose parent chain leads to this
        pod, or to `kin` (children it knows of, not registered again yet). Returns the stored
        entry.
        """

        def change(pods: dict[str, PodEntry]) -> PodEntry:
            held = pods.get(entry.name)
            if held is not None:
                raise RegistryConflict(
                    f"a pod named {entry.name!r} is already running (pid {held.pid})"
                )
            if not returning:
                self._refuse_while_unlisted(pods, entry)
            return self._admit(pods, entry, kin)

        return self._transact(change)

    def _refuse_while_unlisted(self, pods: dict[str, PodEntry], entry: PodEntry) -> None:
        """RegistryConflict when a pod runs (its `<runtime>/pods/<name>/pid` names a process
        started before that file was written, and its socket is there) without an entry."""
        pods_dir = self.runtime_dir / "pods"
        try:
            names = os.listdir(pods_dir)
        except OSError:
            return
        for name in names:
            if name in pods or name == entry.name:
                continue
            pid = _running_pid(pods_dir / name)
            if pid is None or pid == entry.pid:
                continue
            raise RegistryConflict(
                f"pod {name!r} (pid {pid}) is running but has no entry in {self.path} (removed "
                "or rewritten?); it registers itself again within seconds: try again then"
            )

    def _admit(
        self, pods: dict[str, PodEntry], entry: PodEntry, kin: Collection[str] = ()
    ) -> PodEntry:
        """Check `entry`'s claims against `pods`, then store it and record any delegation."""
        if entry.session is not None:
            holder = next(
                (p for p in pods.values() if p.session == entry.session and p.name != entry.name),
                None,
            )
            if holder is not None:
                raise RegistryConflict(
                    f"session {entry.session} is held by live pod {holder.name!r}"
                    f" (pid {holder.pid}); stop it first (podctl stop {holder.name}), or start"
                    " from another session"
                )
        parent = pods.get(entry.parent) if entry.parent else None
        delegated = self._check_claims(pods, entry, parent, kin)
        stored = entry.delegating(entry.delegated_areas())  # a copy
        pods[entry.name] = stored
        if parent is not None and delegated:
            pods[parent.name] = parent.delegating([*parent.delegated_areas(), *delegated])
        return stored

    def _check_claims(
        self,
        pods: dict[str, PodEntry],
        entry: PodEntry,
        parent: PodEntry | None,
        kin: Collection[str] = (),
    ) -> list[Rule]:
        """Raise on any write overlap; return the write rules delegated from `parent`."""
        scope = entry.effective_scope()
        # A restarted spawner takes its live descendants back: their areas stay delegated.
        family = {entry.name, *kin}
        grew = True
        while grew:
            found = {o.name for o in pods.values() if o.parent in family} - family
            family |= found
            grew = bool(found)
        adopted: list[Rule] = []
        for other in pods.values():
            if other.parent not in family or other.name == entry.name:
                continue
            theirs = other.effective_scope().writable_rules()
            if all(_delegable(r, scope, other.effective_scope()) for r in theirs):
                adopted.extend(theirs)
        if adopted:
            scope = scope.with_delegated(adopted)
            held = entry.delegating([*entry.delegated_areas(), *adopted])
            entry.delegated, entry.delegated_flat = held.delegated, held.delegated_flat
        # Siblings and strangers first, so a clash with a sibling names the sibling. Then the
        # same by what the paths are: a bind mount reaches the same files by another path.
        others = [o for o in pods.values() if o.name not in (entry.name, entry.parent)]
        for other in others:
            path = write_overlap(scope, other.effective_scope())
            if path is not None:
                raise RegistryConflict(_overlap_message(other, path))
        if others:
            mounts = read_mounts()
            mine = on_devices(scope, mounts)
            for other in others:
                their_files = on_devices(other.effective_scope(), mounts)
                if write_overlap(mine, their_files) is not None:
                    # Named by our own path that reaches them (a device's paths are not ours).
                    path = next(
                        r.target
                        for r in scope.writable_rules()
                        if write_overlap(
                            on_devices(Scope(allow=(r,), deny=scope.deny), mounts), their_files
                        )
                    )
                    raise RegistryConflict(_overlap_message(other, path, True))
        if parent is None:
            return []
        parent_scope = parent.effective_scope()
        delegable = [r for r in scope.writable_rules() if _delegable(r, parent_scope, scope)]
        rest = Scope(allow=tuple(r for r in scope.allow if r not in delegable), deny=scope.deny)
        path = write_overlap(rest, parent_scope)
        if path is not None:
            raise RegistryConflict(_overlap_message(parent, path))
        return delegable

    def release(self, name: str, pid: int) -> bool:
        """Remove `name` if `pid` holds it. True when an entry was removed."""

        def change(pods: dict[str, PodEntry]) -> bool:
            entry = pods.get(name)
            if entry is None or entry.pid != pid:
                return False
            self._drop(pods, entry)
            return True

        return self._transact(change)

    def update(self, name: str, pid: int, /, **fields: Any) -> PodEntry:
        """Change fields of `pid`'s entry (e.g. `session`, `socket`). A new `scope` is checked
        against the other pods like a registration."""
        if {"name", "pid", "start_time"} & fields.keys():
            raise ValueError("name, pid and start_time identify the entry; they cannot change")
        unknown = fields.keys() - set(PodEntry.__struct_fields__)
        if unknown:
            raise ValueError(f"unknown PodEntry fields: {', '.join(sorted(unknown))}")

        def change(pods: dict[str, PodEntry]) -> PodEntry:
            entry = pods.get(name)
            if entry is None or entry.pid != pid:
                raise RegistryError(f"no live pod named {name!r} with pid {pid}")
            new = msgspec.structs.replace(entry, **fields)
            if "scope" not in fields:
                pods[name] = new
                return new
            # Re-admit on a copy: take back the old delegation, check and delegate afresh.
            trial = dict(pods)
            self._drop(trial, entry)
            stored = self._admit(trial, new)
            pods.clear()
            pods.update(trial)
            return stored

        return self._transact(change)


def _running_pid(pod_dir: Path) -> int | None:
    """The pid in `pod_dir`'s pid file when that process runs, started before the file was
    written, and the socket is there: a pod running under this name, listed or not. None when
    it is gone, or a later process reused the pid of a dead pod."""
    pid_file = pod_dir / "pid"
    try:
        pid = int(pid_file.read_text().strip())
        written = pid_file.stat().st_mtime
        if not stat.S_ISSOCK((pod_dir / "sock").lstat().st_mode):
            return None
    except (OSError, ValueError):
        return None
    started = _started_at(pid)
    return None if started is None or started > written + 1 else pid


def _delegable(rule: Rule, parent: Scope, child: Scope) -> bool:
    """`rule` lies inside one of the parent's write rules, and wherever the parent is denied
    inside it the child is denied at least as much."""
    if not any(p.contains(rule) for p in parent.writable_rules()):
        return False
    for deny in parent.deny:
        inter = rule.intersection(deny)
        if inter is not None and not inter.denied_by(child.deny, max_cap=deny.deny_cap):
            return False
    return True
