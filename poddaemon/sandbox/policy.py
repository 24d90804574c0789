"""What a command may touch, as Landlock rules: built from the pod's scope plus a short named list.

No Landlock syscall here: the builder reads directories (to carve around deny rules) and returns
a `Policy` value that `apply_policy` turns into a domain, in this process or another one.

Landlock rules are recursive ("everything beneath this directory") and only ever add access.
So a deny inside an allowed tree is built *around*: the allowed directory keeps only what its
entries need (listing, creating, removing), and each sibling on the way down to the denied path
gets the full rule. What that cannot express is returned as `Policy.notes` (SPEC §3 [sandbox]).
"""

import hashlib
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal

import msgspec

from poddaemon.sandbox.landlock import FS
from poddaemon.scope import Access, Scope

__all__ = [
    "ENTRY_WRITE",
    "READ",
    "WRITE",
    "Grant",
    "PathRule",
    "Policy",
    "build_pod_policy",
    "build_policy",
    "system_grants",
]

Mode = Literal["enforce", "best_effort", "off"]

READ = FS.READ_FILE | FS.READ_DIR | FS.EXECUTE
# Creating and removing entries; MAKE_CHAR/MAKE_BLOCK need CAP_MKNOD and are never granted.
ENTRY_WRITE = (
    FS.REMOVE_DIR
    | FS.REMOVE_FILE
    | FS.MAKE_DIR
    | FS.MAKE_REG
    | FS.MAKE_SOCK
    | FS.MAKE_FIFO
    | FS.MAKE_SYM
    | FS.REFER
)
WRITE = READ | FS.WRITE_FILE | FS.TRUNCATE | ENTRY_WRITE
# Rights about a file's contents; the rest are about a directory's entries.
CONTENT = FS.READ_FILE | FS.WRITE_FILE | FS.TRUNCATE | FS.EXECUTE | FS.IOCTL_DEV
ENTRIES = FS.READ_DIR | ENTRY_WRITE
DEVICE = FS.READ_FILE | FS.WRITE_FILE | FS.TRUNCATE | FS.IOCTL_DEV
PROC_READ = FS.READ_FILE | FS.READ_DIR

_BITS_FOR = {Access.NONE: 0, Access.READ: READ, Access.WRITE: WRITE}


class PathRule(msgspec.Struct, frozen=True, array_like=True):
    """One Landlock rule: `access` bits for `path` and everything beneath it."""

    path: str
    access: int


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `apply_policy` needs, as plain data (it crosses process boundaries as JSON)."""

    rules: tuple[PathRule, ...]
    network: bool = True  # False: no TCP bind/connect (Landlock ABI >= 4)
    mode: Mode = "enforce"
    tmpdir: str | None = None  # the private $TMPDIR the launcher exports
    notes: tuple[str, ...] = ()  # what the kernel cannot express, for `podctl status`
    # Abstract unix sockets and signals stay inside the domain (ABI >= 6). Off only for the pod's
    # own layer: a pod signals and probes other pods.
    scoped: bool = True
    # Directories whose entries were enumerated (carved around a deny, or non-recursive), with a
    # digest of their names then: an entry added later is not covered until a rebuild.
    listed: tuple[tuple[str, str], ...] = ()
    # What the rules let commands write in (scope write paths, the private $TMPDIR): the command
    # runner keeps these writable and mounts everything else read-only (sandbox/mounts.py).
    writable: tuple[str, ...] = ()
    # What the runner hides by a mount over it (reads as empty): root's secrets in /etc, which
    # the read grant of /etc would show (sandbox/mounts.py).
    hidden: tuple[str, ...] = ()
    # Areas delegated to a child inside a write grant: the runner binds each onto itself
    # read-only, so commands cannot change their modes, times or entries either (Landlock
    # cannot subtract those from the grant; file contents it denies by the rules).
    readonly: tuple[str, ...] = ()

    def stale(self) -> bool:
        """An enumerated directory gained or lost entries since the build: a rebuilt policy
        would differ (one listdir per such directory; for a helper deciding to restart).
        Names, not mtimes: a coarse mtime can miss an entry made in the same tick."""
        return any(_names_digest(path) != digest for path, digest in self.listed)

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    def access(self, path: str) -> int:
        """The bits the rules give `path` (resolved): the union of every rule at or above it.
        For tests and explanations; the kernel computes this itself."""
        bits = 0
        for rule in self.rules:
            if _within(path, rule.path):
                bits |= rule.access
        return bits


def _names_digest(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return ""
    return hashlib.blake2b(
        "\0".join(names).encode(errors="surrogateescape"), digest_size=16
    ).hexdigest()


class Grant(msgspec.Struct, frozen=True):
    """Access to give before deny rules are applied. `exempt`: deny rules do not cap it (the
    private temp dir and devices, which a command needs whatever the scope says)."""

    path: str
    access: int
    recursive: bool = True
    exempt: bool = False


def _within(path: str, top: str) -> bool:
    """`path` is `top` or below it, by components."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def _existing(paths: Iterable[str]) -> Iterator[str]:
    seen: set[str] = set()
    for p in paths:
        if not p:
            continue
        real = os.path.realpath(p)
        if real not in seen and os.path.exists(real):
            seen.add(real)
            yield real


def _command_dirs(path_var: str, home: str) -> list[str]:
    """Where commands are found: each absolute `$PATH` directory (`~/.local/bin`, a venv's
    `bin`), and for a version manager's `shims` directory its root (`~/.pyenv`, `~/.rbenv`:
    a shim runs the real tool from there). Never the home directory or `/` itself."""
    out: list[str] = []
    for entry in path_var.split(os.pathsep):
        if not os.path.isabs(entry):
            continue
        real = os.path.realpath(entry)
        if real in ("/", os.path.realpath(home)):
            continue
        out.append(real)
        root = os.path.dirname(real)
        if os.path.basename(real) == "shims" and root not in ("/", os.path.realpath(home)):
            out.append(root)
    return out


def system_grants(*, home: str | None = None) -> list[Grant]:
    """The named list beyond the scope: what a command needs to run at all.

    System directories read/execute, the Python installation the pod runs on (so `python3` and
    the sandbox launcher work), `/proc` and two read-only bits of `/sys` that runtimes consult
    for CPU counts, a few character devices, and the user's git configuration read-only so
    `git` behaves as usual. Never the home directory itself, `~/.ssh` or other dotfiles.
    """
    read_exec = [
        "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt",
        "/nix/store",
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
    ]  # fmt: skip
    # This package and its sibling `protocol`, for a confined helper that imports lazily.
    import protocol

    read_exec += [
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        os.path.dirname(os.path.abspath(protocol.__file__)),
    ]
    read_exec += _command_dirs(os.environ.get("PATH", ""), home or os.path.expanduser("~"))
    grants = [Grant(p, READ) for p in _existing(read_exec)]
    # /etc/resolv.conf is often a symlink into /run; grant the one file it points to.
    grants += [Grant(p, FS.READ_FILE) for p in _existing(["/etc/resolv.conf"])]
    grants += [Grant(p, PROC_READ) for p in _existing(["/proc"])]
    grants += [
        Grant(p, PROC_READ) for p in _existing(["/sys/devices/system/cpu", "/sys/fs/cgroup"])
    ]
    devices = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"]
    grants += [Grant(p, DEVICE, exempt=True) for p in _existing(devices)]
    home = home if home is not None else os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    git_config = [os.path.join(home, ".gitconfig"), os.path.join(xdg, "git", "config")]
    grants += [Grant(p, FS.READ_FILE) for p in _existing(git_config) if os.path.isfile(p)]
    return grants


def root_secrets() -> list[str]:
    """For a pod run as root: what the read grant of /etc would show its commands and no other
    user can read (password hashes, host and TLS private keys), to be hidden."""
    if os.geteuid() != 0:
        return []
    found = ["/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssl/private"]
    return list(_existing(found + host_keys("/etc/ssh")))


def host_keys(folder: str) -> list[str]:
    """`folder/ssh_host_*_key`, matched by hand: a glob compiles its pattern at every start
    (~1 ms of a pod's way to READY)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    prefix, suffix = "ssh_host_", "_key"
    return sorted(
        os.path.join(folder, name)
        for name in names
        if name.startswith(prefix) and name.endswith(suffix)
        and len(name) >= len(prefix) + len(suffix)
    )


def manager_sockets(environ: Mapping[str, str] | None = None) -> list[str]:
    """The service manager's control sockets a command reaches by path (Landlock judges no
    connect to a path below ABI 9): through them `systemd-run --user` runs any command as this
    user, outside the sandbox (a unit pod always has that manager). As root: systemd's own and
    the system bus too. To be hidden, as root's secrets are."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    found = [os.path.join(runtime, "systemd", "private"), os.path.join(runtime, "bus")]
    for address in env.get("DBUS_SESSION_BUS_ADDRESS", "").split(";"):
        kind, _, params = address.partition(":")
        for param in params.split(",") if kind == "unix" else ():
            key, _, value = param.partition("=")
            if key == "path" and value:
                found.append(value)
    if os.geteuid() == 0:
        found += ["/run/systemd/private", "/run/dbus/system_bus_socket"]
    return [p for p in _existing(found) if _is_socket(p)]


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def may_replace(path: str, scope: Scope, commands: bool) -> bool:
    """The pod may rewrite the file at `path`: its file tools where the scope lets them write
    it, its commands (`commands`) also where they may write its directory (a file renamed over
    it; a deny on the file keeps its contents, not its name)."""
    real = os.path.realpath(path)
    if scope.access(real) >= Access.WRITE:
        return True
    link_dir = os.path.realpath(os.path.dirname(os.path.abspath(path)))  # where a link lies
    dirs = {os.path.dirname(real), link_dir}
    return commands and any(scope.access(d) >= Access.WRITE for d in dirs)


class _Deny(msgspec.Struct, frozen=True):
    path: str
    cap: int  # the bits a path under it may keep


ListDir = Callable[[str], list[tuple[str, bool]]]


def _listdir(path: str) -> list[tuple[str, bool]]:
    """(child path, is a directory) for every entry that is not a symlink. A symlink grants
    nothing: Landlock would follow it to its target, which may lie outside the scope."""
    out: list[tuple[str, bool]] = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                if not entry.is_symlink():
                    out.append((entry.path, entry.is_dir(follow_symlinks=False)))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        pass
    return sorted(out)


class _Builder:
    def __init__(self, denies: list[_Deny], listdir: ListDir) -> None:
        self.denies = denies
        self.listdir = listdir
        self.rules: dict[str, int] = {}
        self.notes: dict[str, None] = {}  # ordered set
        self.listed: dict[str, str] = {}

    def emit(self, path: str, bits: int) -> None:
        if bits:
            self.rules[path] = self.rules.get(path, 0) | bits

    def note(self, text: str) -> None:
        self.notes[text] = None

    def grant(self, g: Grant) -> None:
        bits = g.access
        below: list[_Deny] = []
        if not g.exempt:
            for d in self.denies:
                if _within(g.path, d.path):
                    bits &= d.cap
                elif _within(d.path, g.path):
                    below.append(d)
        below = [d for d in below if bits & ~d.cap]  # a deny that takes nothing needs no carving
        if not bits:
            return
        if not os.path.lexists(g.path):
            self.note(f"{g.path}: does not exist yet; commands get no access to it")
            return
        if not os.path.isdir(g.path):
            self.emit(g.path, bits)  # a file: nothing beneath it to carve around
        elif g.recursive:
            self.carve(g.path, bits, below)
        else:
            self.shallow(g.path, bits, below)

    def enumerate(self, path: str) -> list[tuple[str, bool]]:
        self.listed[path] = _names_digest(path)
        return self.listdir(path)

    def carve(self, top: str, bits: int, below: list[_Deny]) -> None:
        """`bits` for `top` and everything beneath it except the `below` denies."""
        if not below:
            self.emit(top, bits)
            return
        # The directory itself keeps its entry rights (and whatever contents every deny below
        # allows); they reach the denied paths too, which is what the notes report.
        keep = CONTENT
        for d in below:
            keep &= d.cap
        own = bits & (keep | ENTRIES)
        self.emit(top, own)
        self.report(top, bits, own, below)
        for child, is_dir in self.enumerate(top):
            here = [d for d in below if d.path == child]
            # A file has nothing beneath it: a deny below it names a path that cannot exist.
            deeper = [d for d in below if is_dir and d.path != child and _within(d.path, child)]
            sub = bits
            for d in here:
                sub &= d.cap
            if sub:
                self.carve(child, sub, [d for d in deeper if sub & ~d.cap])

    def shallow(self, top: str, bits: int, below: list[_Deny]) -> None:
        """A non-recursive rule: the directory and its direct children only. Its entries are
        listed now: children created later get only what the directory itself has."""
        self.emit(top, bits & ENTRIES)
        if bits & ENTRY_WRITE:
            self.note(
                f"{top} (not recursive): entries can also be created and removed in its "
                "subdirectories (Landlock rules reach every level)"
            )
        if bits & FS.READ_DIR:
            self.note(f"{top} (not recursive): its subdirectories stay listable")
        self.note(
            f"{top} (not recursive): files created in it after the sandbox was built cannot "
            "be read or written by commands until it is rebuilt"
        )
        for child, is_dir in self.enumerate(top):
            if is_dir:
                continue  # its contents are two levels down: not covered
            sub = bits & CONTENT
            for d in below:
                if _within(child, d.path):
                    sub &= d.cap
            self.emit(child, sub)

    def report(self, top: str, bits: int, own: int, below: list[_Deny]) -> None:
        for d in below:
            if os.path.lexists(d.path) and not os.path.isdir(d.path):
                continue  # a file (/etc/shadow): no entries or names inside it to leak
            leaked = own & ~d.cap
            if leaked & ENTRY_WRITE:
                self.note(
                    f"{d.path}: denied, but entries inside it can still be created, removed or "
                    "renamed (it lies inside a writable tree and Landlock cannot subtract from "
                    "an allowed tree); file contents are protected"
                )
            if leaked & FS.READ_DIR:
                self.note(f"{d.path}: denied, but the names inside it can still be listed")
        lost = bits & ~own & (FS.READ_FILE | FS.WRITE_FILE)
        if lost:
            what = (
                "read or written"
                if lost == FS.READ_FILE | FS.WRITE_FILE
                else ("read" if lost & FS.READ_FILE else "written")
            )
            self.note(
                f"{top}: files created directly in it after the sandbox was built cannot be "
                f"{what} by commands until it is rebuilt (it contains a denied path)"
            )


def _minimal(rules: dict[str, int]) -> list[tuple[str, int]]:
    """Sorted, without rules an ancestor rule already implies (/usr/bin under /usr)."""
    out: list[tuple[str, int]] = []
    for path, bits in sorted(rules.items()):
        implied = 0
        for top, top_bits in rules.items():
            if top != path and _within(path, top):
                implied |= top_bits
        if bits & ~implied:
            out.append((path, bits))
    return out


def _writable(rules: Iterable[PathRule]) -> tuple[str, ...]:
    """The rules' paths with a write right, not nested, devices left out (a device node stays
    writable on a read-only mount; binding /dev/null on itself would only cost a mount)."""
    out: list[str] = []
    for rule in sorted(rules, key=lambda r: r.path):
        if not rule.access & (FS.WRITE_FILE | FS.TRUNCATE | ENTRY_WRITE):
            continue
        if any(_within(rule.path, top) for top in out):
            continue
        try:
            mode = os.stat(rule.path).st_mode
        except OSError:
            continue  # gone since the build: nothing to keep writable
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            out.append(rule.path)
    return tuple(out)


def _readonly(paths: Iterable[str], writable: Iterable[str]) -> tuple[str, ...]:
    """`paths` (areas delegated to children) that exist inside a write grant: the runner's
    mount namespace makes them read-only."""
    tops = list(writable)
    out = {os.path.realpath(p) for p in paths}
    return tuple(sorted(p for p in out if os.path.lexists(p) and any(_within(p, w) for w in tops)))


def build_policy(
    scope: Scope,
    *,
    pwd: str,
    tmpdir: str | None,
    network: bool = True,
    mode: Mode = "enforce",
    protect: Iterable[str] = (),
    extra: Iterable[Grant] | None = None,
    listdir: ListDir = _listdir,
    hide: Iterable[str] = (),
    readonly: Iterable[str] = (),
) -> Policy:
    """The Landlock rules for commands a pod with `scope` starts.

    `protect`: directories commands must never touch even when the scope covers them (this
    user's poddaemon data, runtime and log directories: session logs, registry, sockets'
    directories). `extra`: the named list beyond the scope (default `system_grants()`).
    `tmpdir`: the private temp dir, writable. `listdir` is a seam for tests.
    """
    denies = [_Deny(r.target, _BITS_FOR[r.deny_cap]) for r in scope.deny]
    denies += [_Deny(p, 0) for p in _existing(protect)]
    b = _Builder(denies, listdir)
    for r in scope.deny:
        if not r.recursive:
            b.note(f"{r.target}: a non-recursive deny is enforced recursively for commands")
    grants = [Grant(r.target, _BITS_FOR[r.access], r.recursive) for r in scope.allow]
    grants += list(extra) if extra is not None else system_grants()
    if tmpdir is not None:
        grants.append(Grant(os.path.realpath(tmpdir), WRITE, exempt=True))
    for g in grants:
        b.grant(g)
    real_pwd = os.path.realpath(pwd)
    if scope.access(real_pwd) < Access.READ:
        b.note(f"{real_pwd}: the working directory is not readable under the scope")
    b.note(
        "unix sockets reached by path (this user's pod sockets among them) stay connectable: "
        "Landlock restricts them only from ABI 9"
    )
    if not network:
        b.note(
            "network = false: TCP by Landlock (ABI >= 4), every other IP socket by a seccomp "
            "filter (x86_64 and arm64); unix sockets stay usable"
        )
    rules = tuple(PathRule(p, bits) for p, bits in _minimal(b.rules))
    writable = _writable(rules)
    return Policy(
        writable=writable,
        readonly=_readonly(readonly, writable),
        hidden=tuple(_existing(hide)),
        rules=rules,
        network=network,
        mode=mode,
        tmpdir=os.path.realpath(tmpdir) if tmpdir is not None else None,
        notes=tuple(b.notes),
        listed=tuple(sorted(b.listed.items())),
    )


def build_pod_policy(
    scope: Scope,
    *,
    pwd: str,
    own: Iterable[str],
    read: Iterable[str] = (),
    tmpdir: str | None = None,
    mode: Mode = "enforce",
) -> Policy:
    """The outer layer for the pod process itself (optional, see docs/sandbox.md): its allow
    rules as written, without carving around denies (the file tools check those per path, and
    carving would hide files the pod creates next to a denied path), plus what the pod needs:
    `own` directories writable (its data, runtime and log dirs: session log, registry, socket),
    `read` ones readable (its config, manifests), the network (its model calls), and no signal
    scoping (it probes and stops other pods). Commands get `build_policy`'s layer on top."""
    extra = system_grants()
    extra += [Grant(os.path.realpath(d), WRITE, exempt=True) for d in own]
    extra += [Grant(os.path.realpath(d), READ, exempt=True) for d in read]
    policy = build_policy(
        Scope(allow=scope.allow), pwd=pwd, tmpdir=tmpdir, network=True, mode=mode, extra=extra
    )
    return msgspec.structs.replace(policy, scoped=False)
