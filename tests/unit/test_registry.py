"""The pods.json registry: claims, conflicts, reclaim, delegation, file hygiene."""

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from poddaemon.registry import (
    PodEntry,
    Registry,
    RegistryConflict,
    RegistryError,
    is_alive,
    make_entry,
    process_start_time,
    start_time_of_stat,
)
from poddaemon.scope import Access, Rule, Scope
from tests.conftest import ROOT

# A child that lives until its stdin closes: we decide when it dies, without sleeping.
WAIT_STDIN = [sys.executable, "-c", "import sys; sys.stdin.read()"]


@pytest.fixture
def runtime() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="reg-"))
    yield path / "run"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def reg(runtime: Path) -> Registry:
    return Registry(runtime)


def scope(*writes: str, reads: tuple[str, ...] = ()) -> Scope:
    return Scope.from_config(
        [(w, "write", True) for w in writes] + [(r, "read", True) for r in reads], cwd="/"
    )


def entry(name: str, sc: Scope, *, parent: str | None = None, pid: int | None = None) -> PodEntry:
    return make_entry(name, f"/run/{name}/sock", sc, parent=parent, session="s-" + name, pid=pid)


def test_register_list_release(reg: Registry, runtime: Path) -> None:
    a = reg.register(entry("alpha", scope("/w/a")))
    reg.register(entry("beta", scope("/w/b")))
    assert [e.name for e in reg.live()] == ["alpha", "beta"]
    assert reg.get("alpha") == a
    assert a.pid == os.getpid() and a.start_time == process_start_time(os.getpid())
    assert reg.release("alpha", pid=os.getpid() + 1) is False  # not its holder
    assert reg.get("alpha") is not None
    assert reg.release("alpha", pid=os.getpid()) is True
    assert reg.get("alpha") is None
    assert [e.name for e in reg.live()] == ["beta"]
    doc = msgspec.json.decode((runtime / "pods.json").read_bytes())
    assert doc["version"] == 1 and list(doc["pods"]) == ["beta"]


def test_empty_registry(reg: Registry) -> None:
    assert reg.live() == []
    assert reg.get("nobody") is None
    assert reg.release("nobody", os.getpid()) is False


def test_duplicate_name(reg: Registry) -> None:
    reg.register(entry("dup", scope("/w/1")))
    with pytest.raises(RegistryConflict) as e:
        reg.register(entry("dup", scope("/w/2")))
    assert str(e.value) == f"a pod named 'dup' is already running (pid {os.getpid()})"


def test_write_overlap_names_pod_and_path(reg: Registry) -> None:
    reg.register(entry("owner", scope("/w/proj")))
    with pytest.raises(RegistryConflict) as e:
        reg.register(entry("intruder", scope("/w/proj/src/lib")))
    assert str(e.value) == (
        f"scope conflict: pod 'owner' (pid {os.getpid()}) already holds write access to "
        "/w/proj/src/lib"
    )
    with pytest.raises(RegistryConflict, match=r"pod 'owner'.* /w/proj$"):
        reg.register(entry("wider", scope("/w")))
    assert [e.name for e in reg.live()] == ["owner"]  # failed claims leave nothing behind


def test_read_overlap_allowed(reg: Registry) -> None:
    reg.register(entry("writer", scope("/w/proj")))
    reg.register(entry("reader", scope("/w/other", reads=("/w/proj",))))
    reg.register(entry("reader2", scope(reads=("/w",))))
    assert {e.name for e in reg.live()} == {"writer", "reader", "reader2"}


def test_component_prefix_is_no_overlap(reg: Registry) -> None:
    reg.register(entry("b", scope("/w/b")))
    reg.register(entry("bc", scope("/w/bc")))


def _dead_pid() -> tuple[int, int]:
    proc = subprocess.Popen(WAIT_STDIN, stdin=subprocess.PIPE)
    start = process_start_time(proc.pid)
    assert start is not None
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait()
    return proc.pid, start


def test_reclaims_dead_process(reg: Registry, runtime: Path) -> None:
    pid, start = _dead_pid()
    ghost = PodEntry(
        name="ghost",
        pid=pid,
        start_time=start,
        socket="/x",
        scope=scope("/w/proj").to_dicts(),
        started_at=0.0,
    )
    assert not is_alive(ghost)
    # Plant the claim as a crashed pod would have left it, with its socket and pid files.
    (runtime / "pods" / "ghost").mkdir(parents=True)
    (runtime / "pods" / "ghost" / "sock").write_text("")
    (runtime / "pods" / "ghost" / "pid").write_text(str(pid))
    (runtime / "pods" / "ghost" / "stderr.log").write_text("kept")
    (runtime / "pods.json").write_bytes(
        msgspec.json.encode({"version": 1, "pods": {"ghost": ghost}})
    )
    assert reg.live() == [] and reg.get("ghost") is None  # readers filter it
    reg.register(entry("heir", scope("/w/proj")))
    reg.register(entry("ghost", scope("/w/other")))  # the name is free again too
    assert {e.name for e in reg.live()} == {"heir", "ghost"}
    assert not (runtime / "pods" / "ghost" / "sock").exists()
    assert not (runtime / "pods" / "ghost" / "pid").exists()
    assert (runtime / "pods" / "ghost" / "stderr.log").read_text() == "kept"


def test_reclaims_reused_pid(reg: Registry, runtime: Path) -> None:
    me = entry("old", scope("/w/proj"))
    impostor = msgspec.structs.replace(me, start_time=me.start_time - 1)  # same pid, other process
    assert not is_alive(impostor)
    (runtime).mkdir(parents=True)
    (runtime / "pods.json").write_bytes(
        msgspec.json.encode({"version": 1, "pods": {"old": impostor}})
    )
    reg.register(entry("new", scope("/w/proj")))
    raw = msgspec.json.decode((runtime / "pods.json").read_bytes())
    assert list(raw["pods"]) == ["new"]


def test_a_transaction_never_reclaims_its_own_process_entry_on_a_misread_of_proc(
    reg: Registry, runtime: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen once: a pod's own registry update judged the pod's entry dead, reclaimed it with
    its socket, and the pod stopped. Whatever /proc reads for this process, its entry as made
    (its start time) stays, and the misread is logged; one of an earlier process that had our
    pid (another start time) is still reclaimed."""
    reg.register(entry("me", scope("/w/proj")))
    import poddaemon.registry as registry

    monkeypatch.setattr(registry, "process_start_time", lambda pid: None)
    # What the pod did: name its session (a transaction, which first reclaims the dead).
    named = reg.update("me", os.getpid(), session="s-named")
    assert named.session == "s-named"
    assert [e.name for e in reg.live()] == ["me"]
    assert "this process's entry kept" in caplog.text
    mine = reg.get("me")
    assert mine is not None
    assert not is_alive(msgspec.structs.replace(mine, start_time=mine.start_time - 1))


def test_reclaims_an_entry_of_an_earlier_boot_whose_pid_and_start_match_a_live_process(
    reg: Registry, runtime: Path
) -> None:
    # A registry that outlives a reboot (PODDAEMON_HOME on disk): a process of this boot can
    # have the same pid and start tick as the pod that held the entry (services started at boot
    # do). The entry is not that process's: the pod it names is gone, and its name and scope
    # are free. Entries of earlier versions, which hold no boot id, are judged as before.
    me = entry("before-reboot", scope("/w/proj"))
    assert me.boot_id and is_alive(me)
    earlier = msgspec.structs.replace(me, boot_id="0b5e11a2-0000-4000-8000-000000000000")
    unknown = msgspec.structs.replace(me, name="old-version", boot_id="")
    assert not is_alive(earlier) and is_alive(unknown)
    runtime.mkdir(parents=True)
    (runtime / "pods.json").write_bytes(
        msgspec.json.encode({"version": 1, "pods": {"before-reboot": earlier}})
    )
    assert reg.live() == []
    reg.register(entry("after-reboot", scope("/w/proj")))
    assert [e.name for e in reg.live()] == ["after-reboot"]


def test_reclaim_happens_even_when_the_change_fails(reg: Registry, runtime: Path) -> None:
    pid, start = _dead_pid()
    reg.register(entry("live", scope("/w/live")))
    ghost = PodEntry(name="ghost", pid=pid, start_time=start, socket="/x", scope=[], started_at=0.0)
    reg.register(ghost)  # a dead registrant is stored, and reclaimed by the next transaction
    with pytest.raises(RegistryConflict):
        reg.register(entry("live", scope("/w/else")))
    raw = msgspec.json.decode((runtime / "pods.json").read_bytes())
    assert list(raw["pods"]) == ["live"]


def _ghost(name: str, session: str) -> PodEntry:
    """The entry a pod killed with -9 left, naming `session`."""
    pid, start = _dead_pid()
    sc = scope(f"/w/{name}").to_dicts()
    return PodEntry(
        name=name, pid=pid, start_time=start, socket="/x", scope=sc, started_at=0, session=session
    )


def test_reclaiming_a_dead_pod_removes_its_empty_session_file_and_nothing_else(
    runtime: Path,
) -> None:
    """A pod names its first session's file as soon as it makes it, ahead of its first input;
    killed before that input, it left an empty file, one more per life of a crash loop. The
    reclaim removes it: empty, it holds nothing acknowledged. A file with bytes stays, and so
    does an empty one a live pod names (the same session: a restore asked for it)."""
    sessions = runtime.parent / "data" / "sessions"
    sessions.mkdir(parents=True)
    files = {n: sessions / f"s-{n}.jsonl" for n in ("empty", "full", "shared")}
    for path in files.values():
        path.write_bytes(b"")
    files["full"].write_bytes(b'{"seq":1')  # even a torn first line: bytes are kept
    runtime.mkdir(parents=True)
    ghosts = {n: _ghost(n, f"s-{n}") for n in files}
    (runtime / "pods.json").write_bytes(msgspec.json.encode({"version": 1, "pods": ghosts}))
    reg = Registry(runtime, sessions_dir=sessions)
    holder = make_entry("holder", "/run/holder/sock", scope("/w/holder"), session="s-shared")
    reg.register(holder)
    assert [e.name for e in reg.live()] == ["holder"]
    assert not files["empty"].exists()
    assert files["full"].read_bytes() == b'{"seq":1'
    assert files["shared"].exists()


def test_a_registry_told_no_sessions_dir_removes_no_session_file(runtime: Path) -> None:
    sessions = runtime.parent / "data" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "s-ghost.jsonl").write_bytes(b"")
    runtime.mkdir(parents=True)
    ghost = _ghost("ghost", "s-ghost")
    (runtime / "pods.json").write_bytes(
        msgspec.json.encode({"version": 1, "pods": {"ghost": ghost}})
    )
    reg = Registry(runtime)  # as podctl makes one, to read: it knows no sessions directory
    reg.register(entry("other", scope("/w/other")))
    assert reg.entry("ghost") is None  # reclaimed
    assert (sessions / "s-ghost.jsonl").exists()


def test_file_modes(reg: Registry, runtime: Path) -> None:
    reg.register(entry("m", scope("/w")))
    assert stat.S_IMODE((runtime / "pods.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((runtime / "pods.json.lock").stat().st_mode) == 0o600
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert [p.name for p in runtime.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("make", ["fifo", "dev-zero"])
def test_a_registry_that_is_no_regular_file_is_an_error_at_once(
    reg: Registry, runtime: Path, make: str
) -> None:
    """A FIFO there blocked every reader in open() (each live pod's loop, every podctl), a link
    to /dev/zero read without end."""
    runtime.mkdir(parents=True)
    path = runtime / "pods.json"
    if make == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            reg.live()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the registry read blocked"
    [err] = outcome
    assert isinstance(err, RegistryError) and "not a regular file" in str(err)
    assert str(path) in str(err)


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"version": 1, "pods": {"\xff": {}}}',  # not UTF-8: msgspec's UnicodeDecodeError
        b'{"version": 1, "pods": {"a": {"name": "a"}}}',
        b'{"version": 9, "pods": {}}',
        b'{"version": 1, "pods": {"a": {"name": "a", "pid": 1, "start_time": 1, "socket": "s", '
        b'"scope": [{"target": "rel", "permission": "write"}], "started_at": 0}}}',
    ],
)
def test_corrupt_file_is_an_error_naming_it(reg: Registry, runtime: Path, content: bytes) -> None:
    runtime.mkdir(parents=True)
    (runtime / "pods.json").write_bytes(content)
    with pytest.raises(RegistryError, match=re.escape(str(runtime / "pods.json"))):
        reg.register(entry("x", scope("/w")))
    with pytest.raises(RegistryError, match=re.escape(str(runtime / "pods.json"))):
        reg.live()
    assert (runtime / "pods.json").read_bytes() == content  # never wiped


def test_update(reg: Registry) -> None:
    reg.register(entry("u", scope("/w/u")))
    reg.register(entry("v", scope("/w/v")))
    got = reg.update("u", os.getpid(), session="s2", socket="/new")
    assert got.session == "s2" and reg.get("u") == got
    with pytest.raises(RegistryConflict, match="pod 'v'"):
        reg.update("u", os.getpid(), scope=scope("/w/v/x").to_dicts())
    assert reg.get("u") == got
    with pytest.raises(RegistryError, match="no live pod named 'u' with pid"):
        reg.update("u", os.getpid() + 1, session="s3")
    with pytest.raises(ValueError):
        reg.update("u", os.getpid(), pid=1)


def test_lock_timeout_is_a_clear_error(runtime: Path) -> None:
    reg = Registry(runtime, lock_timeout=0.05)
    holder = Registry(runtime)
    with holder._locked(), pytest.raises(RegistryError, match=r"timed out .*pods\.json\.lock"):
        reg.register(entry("t", scope("/w")))


def test_lock_timeout_names_the_process_holding_the_lock(runtime: Path) -> None:
    """A transaction takes milliseconds: a lock held for long is a stuck (stopped, hung)
    process, and the error says which."""
    runtime.mkdir(mode=0o700)
    hold = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(runtime / "pods.json.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        reg = Registry(runtime, lock_timeout=0.05)
        with pytest.raises(RegistryError) as failed:
            reg.register(entry("t", scope("/w")))
    finally:
        holder.kill()
        holder.wait()
    assert f"pid {holder.pid} ({sys.executable} -c import fcntl" in str(failed.value)


def test_start_time_with_odd_command_name() -> None:
    # comm may hold spaces and parens; the parser must split at the last ')'.
    code = (
        "import ctypes, sys; ctypes.CDLL(None).prctl(15, b'x) y (z', 0, 0, 0); "
        "print('ok', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ok\n"
        raw = Path(f"/proc/{proc.pid}/stat").read_text()
        assert "(x) y (z)" in raw
        expected = int(raw.rsplit(")", 1)[1].split()[19])
        assert process_start_time(proc.pid) == expected
        own = process_start_time(os.getpid())
        assert own is not None and expected >= own
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    assert process_start_time(proc.pid) is None


def test_a_process_in_its_exit_or_a_zombie_has_no_start_time() -> None:
    """A pod killed a moment ago has closed its socket while the kernel still tears it down
    (PF_EXITING in its flags, not yet a zombie): `podctl wait` took it for a pod starting."""
    own = Path("/proc/self/stat").read_bytes()
    head, _, rest = own.rpartition(b")")
    fields = rest.split()
    assert start_time_of_stat(own) == int(fields[19])

    def with_(state: bytes, flags: int) -> bytes:
        changed = [state, *fields[1:6], str(flags).encode(), *fields[7:]]
        return head + b") " + b" ".join(changed) + b"\n"

    running = int(fields[6])
    assert start_time_of_stat(with_(b"R", running & ~0x4)) == int(fields[19])
    assert start_time_of_stat(with_(b"R", running | 0x4)) is None  # PF_EXITING
    assert start_time_of_stat(with_(b"D", running | 0x4)) is None
    assert start_time_of_stat(with_(b"Z", running & ~0x4)) is None
    assert start_time_of_stat(b"12 (no closing paren R 1 2") is None


def test_start_time_of_nothing() -> None:
    assert process_start_time(0) is None
    assert process_start_time(-5) is None
    assert process_start_time(2**22 + 12345) is None


# -- delegation -----------------------------------------------------------------------------


def test_child_inside_parent_is_delegation(reg: Registry) -> None:
    reg.register(entry("parent", scope("/w")))
    reg.register(entry("kid", scope("/w/kid"), parent="parent"))
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == ["/w/kid"]
    assert parent.effective_scope().access("/w/kid/f").name == "READ"
    # A sibling may not take the same area; the error names the sibling, not the parent.
    with pytest.raises(RegistryConflict, match=r"pod 'kid'.* /w/kid/x$"):
        reg.register(entry("sib", scope("/w/kid/x"), parent="parent"))
    reg.register(entry("sib", scope("/w/sib"), parent="parent"))
    # A stranger still clashes with the parent's remaining area.
    with pytest.raises(RegistryConflict, match=r"pod 'parent'.* /w/other$"):
        reg.register(entry("stranger", scope("/w/other")))
    # A grandchild inside the child's area clashes with neither ancestor.
    reg.register(entry("grandkid", scope("/w/kid/g"), parent="kid"))
    kid = reg.get("kid")
    assert kid is not None and kid.delegated == ["/w/kid/g"]
    # The area returns when the child's entry goes, and no grandchild writes there any more.
    assert reg.release("kid", os.getpid())
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == ["/w/kid", "/w/sib"]
    assert reg.release("grandkid", os.getpid())
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == ["/w/sib"]


def test_a_grandchild_keeps_its_area_from_its_grandparent_when_its_parent_goes(
    reg: Registry,
) -> None:
    # A detached tree whose middle pod died: its child still writes /w/a/g, so the root must
    # not get write on /w/a back until that grandchild goes too.
    reg.register(entry("root", scope("/w")))
    reg.register(entry("mid", scope("/w/a"), parent="root"))
    reg.register(entry("leaf", scope("/w/a/g"), parent="mid"))
    reg.register(entry("sib", scope("/w/s"), parent="root"))
    assert reg.release("mid", os.getpid())
    root = reg.get("root")
    assert root is not None and root.delegated == ["/w/a", "/w/s"]
    assert root.effective_scope().access("/w/a/g/f") is Access.READ
    assert reg.release("leaf", os.getpid())
    root = reg.get("root")
    assert root is not None and root.delegated == ["/w/s"]
    assert root.effective_scope().access("/w/a/g/f") is Access.WRITE


def test_a_pod_whose_spawner_writes_the_same_area_still_hands_it_back(reg: Registry) -> None:
    # Ancestors' claims cover a delegated area from above: they never keep it delegated.
    reg.register(entry("root", scope("/w/a")))
    reg.register(entry("mid", scope("/w/a"), parent="root"))
    reg.register(entry("leaf", scope("/w/a/g"), parent="mid"))
    assert reg.release("leaf", os.getpid())
    mid, root = reg.get("mid"), reg.get("root")
    assert mid is not None and mid.delegated == []
    assert root is not None and root.delegated == ["/w/a"]


def test_a_non_recursive_child_takes_only_its_level_from_the_parent(reg: Registry) -> None:
    reg.register(entry("parent", scope("/w")))
    flat = Scope.from_config([("/w/d", "write", False)], cwd="/")
    reg.register(entry("kid", flat, parent="parent"))
    parent = reg.get("parent")
    assert parent is not None
    assert parent.delegated == ["/w/d"] and parent.delegated_flat == ["/w/d"]
    mine = parent.effective_scope()
    # The child's: /w/d and its direct entries. Deeper, the files stay the parent's.
    assert [mine.access(p).name for p in ("/w/d", "/w/d/f", "/w/d/e/f")] == [
        "READ",
        "READ",
        "WRITE",
    ]
    # A sibling may take a tree below the child's level: neither holds it.
    reg.register(entry("deep", scope("/w/d/e/g"), parent="parent"))
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == ["/w/d", "/w/d/e/g"]
    assert parent.delegated_flat == ["/w/d"]
    assert parent.effective_scope().access("/w/d/e/g/x").name == "READ"
    assert reg.release("kid", os.getpid())
    parent = reg.get("parent")
    assert parent is not None
    assert parent.delegated == ["/w/d/e/g"] and parent.delegated_flat == []


def test_a_target_delegated_both_ways_is_delegated_whole() -> None:
    parent = entry("parent", scope("/w"))
    flat = Rule(target="/w/d", access=Access.WRITE, recursive=False)
    whole = Rule(target="/w/d", access=Access.WRITE)
    both = parent.delegating([flat, whole, flat])
    assert both.delegated == ["/w/d"] and both.delegated_flat == []
    assert both.effective_scope().access("/w/d/e/f").name == "READ"


def test_an_entry_of_an_earlier_version_delegates_whole_trees(runtime: Path) -> None:
    # pods.json written before `delegated_flat` existed: every area read as a whole tree.
    old = msgspec.json.encode(entry("parent", scope("/w")))
    old = old.replace(b'"delegated":[]', b'"delegated":["/w/d"]').replace(
        b',"delegated_flat":[]', b""
    )
    decoded = msgspec.json.decode(old, type=PodEntry)
    assert decoded.delegated_flat == []
    assert decoded.effective_scope().access("/w/d/e/f").name == "READ"


def test_child_reaching_outside_parent_conflicts_with_parent(reg: Registry) -> None:
    reg.register(entry("parent", scope("/w/p")))
    with pytest.raises(RegistryConflict, match=r"pod 'parent'.* /w/p$"):
        reg.register(entry("greedy", scope("/w"), parent="parent"))
    reg.register(entry("elsewhere", scope("/v"), parent="parent"))  # unrelated: a plain claim
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == []


def test_child_must_keep_parents_denies(reg: Registry) -> None:
    parent_scope = Scope.from_config(
        [("/w", "write", True)], [("/w/secret", "read", True)], cwd="/"
    )
    reg.register(entry("parent", parent_scope))
    # Without the parent's deny, the child would gain write on /w/secret: no delegation.
    with pytest.raises(RegistryConflict, match=r"pod 'parent'.* /w$"):
        reg.register(entry("leaky", scope("/w"), parent="parent"))
    ok = Scope.from_config([("/w", "write", True)], [("/w/secret", "read", True)], cwd="/")
    # Even with the same deny the child would take the parent's whole area: that is delegation
    # of /w, allowed; the parent keeps only read.
    reg.register(entry("heir", ok, parent="parent"))
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == ["/w"]


def test_dead_child_returns_area_on_reclaim(reg: Registry) -> None:
    reg.register(entry("parent", scope("/w")))
    pid, start = _dead_pid()
    kid = msgspec.structs.replace(
        entry("kid", scope("/w/kid"), parent="parent"), pid=pid, start_time=start
    )
    reg.register(kid)
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == ["/w/kid"]  # stored; gone next transaction
    reg.register(entry("other", scope("/v")))
    parent = reg.get("parent")
    assert parent is not None and parent.delegated == []


def test_a_writer_killed_before_its_rename_leaves_nothing_behind(runtime: Path) -> None:
    # kill -9 between writing the new registry and renaming it over pods.json (a crash at the
    # worst moment): the next writer must neither trip over nor keep adding what it left.
    killed_at_rename = (
        "import os, signal, sys; from poddaemon.registry import Registry, make_entry; "
        "from poddaemon.scope import Scope; "
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL); "
        "sc = Scope.from_config([('/w/' + sys.argv[2], 'write', True)], cwd='/'); "
        "Registry(sys.argv[1]).register(make_entry(sys.argv[2], '/x', sc))"
    )
    for name in ("one", "two"):
        crashed = subprocess.run(
            [sys.executable, "-c", killed_at_rename, str(runtime), name], cwd=ROOT
        )
        assert crashed.returncode == -9
    reg = Registry(runtime)
    reg.register(entry("alive", scope("/w/alive")))
    assert [e.name for e in reg.live()] == ["alive"]
    assert sorted(p.name for p in runtime.iterdir() if p.name.startswith(".")) == []


def _pod_files(runtime: Path, name: str, pid: int) -> None:
    """What a running pod keeps in the runtime dir: its pid file and its bound socket."""
    pod_dir = runtime / "pods" / name
    pod_dir.mkdir(parents=True)
    (pod_dir / "pid").write_text(f"{pid}\n")
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(pod_dir / "sock"))


def test_a_live_pod_without_an_entry_holds_off_new_pods_until_it_returns(
    reg: Registry, runtime: Path
) -> None:
    # pods.json removed by hand (as the corrupt-registry message advises): a pod started in
    # the second before the live one registered again took its write scope, and the live one
    # then stopped ("lost the registry claim").
    holder = subprocess.Popen(["sleep", "60"])
    try:
        _pod_files(runtime, "ghost", holder.pid)
        with pytest.raises(RegistryConflict, match=r"'ghost'.*has no entry"):
            reg.register(entry("rival", scope("/w")))
        ghost = entry("ghost", scope("/w"), pid=holder.pid)
        reg.register(ghost, returning=True)  # the live pod itself comes back
        with pytest.raises(RegistryConflict, match="already holds write access to /w"):
            reg.register(entry("rival", scope("/w")))
    finally:
        holder.kill()
        holder.wait()


def test_the_files_of_a_dead_pod_hold_nobody_off(reg: Registry, runtime: Path) -> None:
    pid, _ = _dead_pid()
    _pod_files(runtime, "dead", pid)
    reg.register(entry("alive", scope("/w")))
    _pod_files(runtime, "reused", os.getppid())  # a pid file older than the process: reused
    os.utime(runtime / "pods" / "reused" / "pid", (0, 0))
    reg.register(entry("alive2", scope("/x")))


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_lock_file_removed_mid_transaction_never_lets_two_claims_in(
    runtime: Path, how: str
) -> None:
    """pods.json.lock removed (or replaced: a new file in its place) while a transaction holds
    it: the next transaction locks the new file and runs at once. The first one wrote its
    decision over the second's (both were told yes, for overlapping write scopes; the second
    pod's entry vanished, and it stopped seconds later with "lost the registry claim"). It
    must find its lock gone before it writes, and decide again under the new one."""
    first, second = Registry(runtime), Registry(runtime, lock_timeout=2.0)
    admit = first._admit
    calls = []

    def admit_then_lose_the_lock(*args: object, **kwargs: object) -> PodEntry:
        stored = admit(*args, **kwargs)  # type: ignore[arg-type]
        if not calls:
            calls.append(1)
            lock = runtime / "pods.json.lock"
            lock.unlink()
            if how == "replaced":
                lock.write_text("")
            second.register(entry("second", scope("/w/sub")))
        return stored

    first._admit = admit_then_lose_the_lock  # type: ignore[method-assign]
    with pytest.raises(RegistryConflict, match=r"'second'.*already holds write access to /w/sub"):
        first.register(entry("first", scope("/w")))
    assert [e.name for e in Registry(runtime).live()] == ["second"]


def test_reclaiming_a_stale_entry_leaves_the_files_of_a_live_pod_of_its_name(
    reg: Registry, runtime: Path
) -> None:
    """pods.json replaced by an older copy, which names an earlier (dead) process of a pod
    running now: the reclaim of that stale entry removed the live pod's socket and pid file
    (the name's files), and the live pod, unreachable, stopped with status 1."""
    dead, start = _dead_pid()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        _pod_files(runtime, "px", holder.pid)  # the pod running now, unlisted
        stale = PodEntry(
            name="px",
            pid=dead,
            start_time=start,
            socket=str(runtime / "pods" / "px" / "sock"),
            scope=scope("/w/px").to_dicts(),
            started_at=0.0,
        )
        (runtime / "pods.json").write_bytes(
            msgspec.json.encode({"version": 1, "pods": {"px": stale}})
        )
        reg.register(entry("px", scope("/w/px"), pid=holder.pid), returning=True)
        assert (runtime / "pods" / "px" / "pid").read_text() == f"{holder.pid}\n"
        assert stat.S_ISSOCK((runtime / "pods" / "px" / "sock").lstat().st_mode)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_temporary_file_that_cannot_be_written_is_named(runtime: Path, kind: str) -> None:
    """Something else where a transaction writes the new pods.json first (`.pods.json.tmp`): no
    pod could register, and the error named pods.json ("cannot write the pod registry
    …/pods.json: is a directory"), which was fine or absent: nothing to look at."""
    runtime.mkdir(mode=0o700)
    tmp = runtime / ".pods.json.tmp"
    if kind == "directory":
        tmp.mkdir()
    else:
        tmp.symlink_to(runtime / "elsewhere")
    with pytest.raises(RegistryError) as failed:
        Registry(runtime).register(entry("t", scope("/w")))
    assert str(tmp) in str(failed.value), failed.value
    assert not (runtime / "elsewhere").exists()
