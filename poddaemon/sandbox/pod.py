"""The sandbox as one pod uses it: decided at start-up from `[sandbox]`, handed to the command
runner (which confines itself before it starts anything) and shown by `status`."""

import contextlib
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from poddaemon.sandbox import NO_SANDBOX, SandboxUnavailable, available, build_policy, describe
from poddaemon.sandbox.landlock import FS
from poddaemon.sandbox.policy import Grant, Mode, Policy, system_grants
from poddaemon.scope import Access, Scope
from protocol.paths import write_private


class PodSandbox(msgspec.Struct):
    status: str = NO_SANDBOX  # what `status.sandbox` says: "landlock-abi-N" | "none"
    notes: list[str] = msgspec.field(default_factory=list)  # what the kernel cannot express
    policy: bytes | None = None  # for the command runner's `apply_policy`
    tmpdir: str | None = None  # the commands' private $TMPDIR
    # The policy again for another scope (delegation to child pods narrows the pod's own), and
    # files to read besides (a hook's transcript: see `ToolContext.hook_runner`).
    rebuild: Callable[[Scope, Sequence[str]], bytes] | None = None
    # Files the policy grants one by one (hook scripts). Landlock holds the file a runner
    # found at its start: one saved anew since (a new file renamed over it) needs a new runner.
    files: tuple[str, ...] = ()

    def close(self) -> None:
        if self.tmpdir is not None:
            with contextlib.suppress(OSError):
                _rmtree(self.tmpdir)


def _rmtree(path: str) -> None:
    import shutil  # not at start: it imports bz2 and lzma (see _make_tmpdir)

    shutil.rmtree(path)


def _tmpdir_prefix(name: str) -> str:
    return f"poddaemon-{name}-"


def _make_tmpdir(prefix: str) -> str:
    """What `tempfile.mkdtemp(prefix=prefix)` does for a POSIX host: a new directory only we
    may enter, under $TMPDIR or /tmp. Not tempfile itself: it imports shutil, and shutil bz2
    and lzma, ~2 ms of every pod's start."""
    base = os.path.abspath(os.environ.get("TMPDIR") or "/tmp")
    for _ in range(100):
        path = os.path.join(base, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        # mkdir's mode went through the umask: under 0277 the dir was 0500 and the commands
        # could not make a file in their own $TMPDIR.
        os.chmod(path, 0o700)
        return path
    raise FileExistsError(f"no unused name for a temporary directory in {base}")


def replace_leftover(record: Path, name: str, tmpdir: str | None) -> None:
    """`record` names the commands' temp dir of the last pod of this name. A pod killed with
    no chance to clean up (kill -9) left it behind: remove it, then record ours. Only a dir
    of ours, under the name mkdtemp gave it: `record` lies in our private runtime dir, but
    what it names may have changed hands since."""
    with contextlib.suppress(OSError):
        old = record.read_text().strip()
        if old != tmpdir and os.path.basename(old).startswith(_tmpdir_prefix(name)):
            st = os.lstat(old)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                _rmtree(old)
    if tmpdir is None:
        with contextlib.suppress(FileNotFoundError):
            record.unlink()
    else:
        write_private(record, tmpdir + "\n")


def script_grants(scripts: Sequence[str], scope: Scope) -> list[Grant]:
    """Hook scripts run wherever they are (outside the scope, in a denied directory, in the
    spawner's tree for a child): that one file is readable and executable, nothing around it.
    A grant holds the file itself, never a symlink to it (Landlock rules are opened following
    no link, on the way either): it names the directory the script lies in as resolved now, and
    a script that is a link is granted the file it points to now, unless the pod could repoint
    the link (it lies where it may write) and have any file granted."""
    grants = []
    for path in scripts:
        where = os.path.realpath(os.path.dirname(path))  # the dir the link lies in
        target = os.path.join(where, os.path.basename(path))
        if os.path.islink(target) and scope.access(where) < Access.WRITE:
            target = os.path.realpath(target)
        grants.append(Grant(target, FS.READ_FILE | FS.EXECUTE, exempt=True))
    return grants


def _script_note(path: str, scope: Scope) -> str:
    """What `podctl status` says of a hook script. One lying where the pod's commands may write
    can be replaced by them (rewritten, or a new file renamed over it: a deny rule on the file
    keeps its contents, not its name), and a guard there guards only until the model does so."""
    note = f"{path}: a hook script: commands may read and run it"
    if scope.access(os.path.realpath(os.path.dirname(path))) >= Access.WRITE:
        note += "; it lies in the pod's writable scope: they can replace it (keep guards out)"
    return note


def pod_sandbox(
    *,
    name: str,
    mode: Mode,
    network: bool,
    scope: Scope,
    pwd: str,
    protect: list[str],
    commands: bool,
    hide: Sequence[str] = (),
    scripts: Sequence[str] = (),
) -> PodSandbox:
    """Decide the pod's sandbox. `enforce` without Landlock raises `SandboxUnavailable` (a
    start-up error); `best_effort` then runs unconfined and says so (`warnings`, for an alert).
    `commands`: the pod can start commands (bash, hooks): only then is a policy built."""
    scripts = list(dict.fromkeys(scripts))  # one script in several hooks: granted, noted once
    if mode == "off":
        return PodSandbox(notes=["[sandbox] mode = off: commands run unconfined"])
    abi = available()
    if abi == 0:
        if mode == "enforce":
            raise SandboxUnavailable(
                "sandbox.mode = enforce: this kernel has no Landlock (Linux >= 5.13 with "
                'landlock in lsm=); set [sandbox] mode = "best_effort" or "off" to run '
                "commands unconfined"
            )
        note = "best_effort: this kernel has no Landlock; commands run unconfined"
        return PodSandbox(notes=[note])
    box = PodSandbox(status=describe(abi))
    if not commands:
        return box
    tmpdir = box.tmpdir = _make_tmpdir(_tmpdir_prefix(name))

    def build(live: Scope, reads: Sequence[str] = ()) -> Policy:
        # `reads`: files granted read-only by identity, deny rules aside (the session log
        # lies in poddaemon's own data dir, which commands are never granted).
        # Resolved: grants are opened following no link on the way (sandbox.landlock).
        files = [
            Grant(os.path.realpath(p), FS.READ_FILE, exempt=True)
            for p in reads
            if os.path.isfile(p)
        ]
        return build_policy(
            live,
            pwd=pwd,
            tmpdir=tmpdir,
            network=network,
            mode=mode,
            protect=protect,
            extra=system_grants() + script_grants(scripts, live) + files,  # links as now
            hide=hide,
            # Areas handed to children: read-only in the runner's view (modes, times, entries:
            # what Landlock cannot take out of this pod's writable tree).
            readonly=[r.target for r in live.deny if r not in scope.deny],
        )

    policy = build(scope)
    box.policy = policy.encode()
    box.files = tuple(scripts)
    extra_notes = [_script_note(p, scope) for p in scripts]
    if abi < 6:  # the scopes came with ABI 6
        extra_notes.append(
            f"Landlock ABI {abi}: commands can send signals to any process of this user and "
            "connect to abstract unix sockets (ABI 6 confines both)"
        )
    box.notes = [*policy.notes, *extra_notes]

    def rebuild(live: Scope, reads: Sequence[str] = ()) -> bytes:
        again = build(live, reads)
        if not reads:
            box.notes = [*again.notes, *extra_notes]  # the live scope's: what `status` says
        return again.encode()

    box.rebuild = rebuild
    return box
