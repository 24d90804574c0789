"""The Landlock policy builder: scope -> rules, carved around deny rules (no syscalls here)."""

import glob
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poddaemon.sandbox import Grant, Policy, build_policy, system_grants
from poddaemon.sandbox.landlock import FS
from poddaemon.sandbox.policy import (
    CONTENT,
    ENTRIES,
    ENTRY_WRITE,
    READ,
    WRITE,
    host_keys,
    manager_sockets,
)
from poddaemon.scope import Access, Scope


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        yield Path(os.path.realpath(d))


def tree(root: Path, *files: str) -> None:
    for f in files:
        p = root / f
        if f.endswith("/"):
            p.mkdir(parents=True, exist_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f)


def policy(scope: Scope, root: Path, **kw: object) -> Policy:
    kw.setdefault("tmpdir", None)
    kw.setdefault("extra", [])
    return build_policy(scope, pwd=str(root), **kw)  # type: ignore[arg-type]


def rules(p: Policy) -> dict[str, int]:
    return {r.path: r.access for r in p.rules}


def test_recursive_write_is_one_rule(root: Path) -> None:
    tree(root, "proj/a.c", "other/x")
    scope = Scope.from_config([("proj", "write", True)], cwd=str(root))
    p = policy(scope, root)
    assert rules(p) == {f"{root}/proj": WRITE}
    assert p.access(f"{root}/proj/a.c") == WRITE
    assert p.access(f"{root}/other/x") == 0


def test_deny_read_is_carved_around(root: Path) -> None:
    tree(root, "proj/src/a.c", "proj/secrets/key", "proj/README", "proj/lib/")
    scope = Scope.from_config(
        [("proj", "write", True)], [("proj/secrets", "read", True)], cwd=str(root)
    )
    p = policy(scope, root)
    proj = f"{root}/proj"
    assert rules(p) == {
        proj: ENTRIES,  # listing, creating, removing: no file contents
        f"{proj}/README": WRITE,
        f"{proj}/lib": WRITE,
        f"{proj}/src": WRITE,
    }
    key = p.access(f"{proj}/secrets/key")
    assert not key & (FS.READ_FILE | FS.WRITE_FILE | FS.TRUNCATE | FS.EXECUTE)
    assert p.access(f"{proj}/src/a.c") & (FS.READ_FILE | FS.WRITE_FILE)
    notes = "\n".join(p.notes)
    assert f"{proj}/secrets: denied, but entries inside it can still be created" in notes
    assert f"{proj}/secrets: denied, but the names inside it can still be listed" in notes
    assert (
        f"{proj}: files created directly in it after the sandbox was built cannot be read "
        "or written" in notes
    )


def test_a_denied_file_gets_no_note_about_names_inside_it(root: Path) -> None:
    # A root pod denies /etc/shadow in the readable /etc: a file has no entries to list,
    # create or remove, so status must not say it has (nor for the tree's directory deny).
    tree(root, "etc/passwd", "etc/shadow", "etc/ssl/private/k")
    scope = Scope.from_config(
        [("etc", "read", True)],
        [("etc/shadow", "read", True), ("etc/ssl/private", "read", True)],
        cwd=str(root),
    )
    notes = "\n".join(policy(scope, root).notes)
    assert f"{root}/etc/shadow:" not in notes, notes
    assert f"{root}/etc/ssl/private: denied, but the names inside it can still be listed" in notes
    assert not policy(scope, root).access(f"{root}/etc/shadow") & FS.READ_FILE


def test_deny_write_keeps_read(root: Path) -> None:
    tree(root, "proj/vendor/lib.c", "proj/main.c")
    scope = Scope.from_config(
        [("proj", "write", True)], [("proj/vendor", "write", True)], cwd=str(root)
    )
    p = policy(scope, root)
    proj = f"{root}/proj"
    assert rules(p)[proj] == ENTRIES | FS.READ_FILE | FS.EXECUTE
    assert f"{proj}/vendor" not in rules(p)  # read-only: the parent's rule already says so
    vendored = p.access(f"{proj}/vendor/lib.c")
    assert vendored & FS.READ_FILE and not vendored & (FS.WRITE_FILE | FS.TRUNCATE)
    assert "names inside" not in "\n".join(p.notes)  # reading was never denied


def test_nested_denies(root: Path) -> None:
    tree(root, "p/a/b/c", "p/a/d", "p/e")
    scope = Scope.from_config(
        [("p", "write", True)], [("p/a", "write", True), ("p/a/b", "read", True)], cwd=str(root)
    )
    p = policy(scope, root)
    assert p.access(f"{root}/p/e") & FS.WRITE_FILE
    assert p.access(f"{root}/p/a/d") & FS.READ_FILE
    assert not p.access(f"{root}/p/a/d") & FS.WRITE_FILE
    assert not p.access(f"{root}/p/a/b/c") & CONTENT


def test_deny_covering_the_allow_target_caps_it(root: Path) -> None:
    tree(root, "p/x")
    scope = Scope.from_config([("p", "write", True)], [("p", "write", True)], cwd=str(root))
    assert rules(policy(scope, root)) == {f"{root}/p": READ}
    scope = Scope.from_config([("p/x", "write", True)], [("p", "read", True)], cwd=str(root))
    assert rules(policy(scope, root)) == {}


def test_non_recursive_rule(root: Path) -> None:
    tree(root, "p/top.txt", "p/sub/deep.txt")
    scope = Scope.from_config([("p", "write", False)], cwd=str(root))
    p = policy(scope, root)
    assert rules(p) == {f"{root}/p": ENTRIES, f"{root}/p/top.txt": WRITE & CONTENT}
    assert not p.access(f"{root}/p/sub/deep.txt") & CONTENT
    assert any("not recursive" in n for n in p.notes)


def test_symlinks_grant_nothing(root: Path) -> None:
    tree(root, "p/keep/x", "p/secret/y", "outside/z")
    os.symlink(f"{root}/outside", f"{root}/p/link")
    scope = Scope.from_config([("p", "write", True)], [("p/secret", "read", True)], cwd=str(root))
    p = policy(scope, root)
    assert all(not r.path.startswith(f"{root}/outside") for r in p.rules)
    assert f"{root}/p/link" not in rules(p)  # Landlock would follow it to its target


def test_protected_dirs_are_never_granted(root: Path) -> None:
    tree(root, "home/proj/a", "home/data/sessions/s.jsonl", "home/run/pods.json")
    scope = Scope.from_config([("home", "write", True)], cwd=str(root))
    p = policy(scope, root, protect=[f"{root}/home/data", f"{root}/home/run", f"{root}/nope"])
    assert p.access(f"{root}/home/proj/a") & FS.WRITE_FILE
    for f in ("home/data/sessions/s.jsonl", "home/run/pods.json"):
        assert not p.access(f"{root}/{f}") & CONTENT
    # Inside a writable scope, removing entries there stays possible: said, so the pod can refuse.
    assert any(n.startswith(f"{root}/home/run: denied, but entries inside") for n in p.notes)


def test_private_tmpdir_is_writable_even_inside_a_protected_dir(root: Path) -> None:
    tree(root, "run/pods/x/tmp/", "proj/")
    scope = Scope.from_config([("proj", "read", True)], cwd=str(root))
    p = policy(scope, root, tmpdir=f"{root}/run/pods/x/tmp", protect=[f"{root}/run"])
    assert p.tmpdir == f"{root}/run/pods/x/tmp"
    assert p.access(f"{root}/run/pods/x/tmp/f") == WRITE
    assert not p.access(f"{root}/run/pods.json") & CONTENT


def test_missing_target_is_noted(root: Path) -> None:
    scope = Scope.from_config([("later", "write", True)], cwd=str(root))
    p = policy(scope, root)
    assert p.rules == ()
    assert any("does not exist yet" in n for n in p.notes)
    assert any("working directory is not readable" in n for n in p.notes)


def test_network_note_and_json_round_trip(root: Path) -> None:
    scope = Scope.from_config([(".", "read", True)], cwd=str(root))
    p = policy(scope, root, network=False, mode="best_effort")
    assert any("seccomp" in n for n in p.notes)
    again = msgspec.json.decode(p.encode(), type=Policy)
    assert again == p and not again.network and again.mode == "best_effort"


def test_system_grants_are_a_short_named_list(root: Path) -> None:
    tree(root, "home/.gitconfig", "home/.ssh/id_ed25519", "home/.bashrc", "home/.config/git/config")
    grants = system_grants(home=f"{root}/home")
    paths = {g.path: g for g in grants}
    assert paths["/usr"].access == READ
    assert paths[f"{root}/home/.gitconfig"].access == FS.READ_FILE
    assert paths["/dev/null"].exempt and paths["/dev/null"].access & FS.WRITE_FILE
    assert all(
        not p.startswith(f"{root}/home") or p.endswith(("/.gitconfig", "/git/config"))
        for p in paths
    )
    assert not any(g.access & (FS.WRITE_FILE | ENTRY_WRITE) for g in grants if not g.exempt)


def test_redundant_rules_are_dropped(root: Path) -> None:
    tree(root, "a/b/c")
    scope = Scope.from_config([("a", "read", True), ("a/b", "read", True)], cwd=str(root))
    extra = [Grant(f"{root}/a/b/c", FS.READ_FILE)]
    assert rules(policy(scope, root, extra=extra)) == {f"{root}/a": READ}


# --- properties: on random trees, no path gets file contents the scope does not give it, and
# every file that existed when the policy was built gets what the scope gives it.

NAMES = st.sampled_from(["a", "b", "c"])
REL = st.lists(NAMES, min_size=1, max_size=3).map("/".join)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    files=st.lists(REL, min_size=1, max_size=8),
    allows=st.lists(
        st.tuples(REL, st.sampled_from(["read", "write"]), st.booleans()), min_size=1, max_size=3
    ),
    denies=st.lists(st.tuples(REL, st.sampled_from(["read", "write"])), max_size=3),
)
def test_sound_and_complete_for_file_contents(
    files: list[str], allows: list[tuple[str, str, bool]], denies: list[tuple[str, str]]
) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        base = os.path.realpath(d)
        made: list[str] = []
        for f in files:
            path = os.path.join(base, "t", f)
            if any(
                os.path.isfile(os.path.join(base, "t", *f.split("/")[:i]))
                for i in range(1, f.count("/") + 1)
            ):
                continue  # a prefix is already a file
            if os.path.isdir(path):
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Path(path).write_text("x")
            made.append(path)
        scope = Scope.from_config(
            [(os.path.join("t", t), perm, rec) for t, perm, rec in allows],
            [(os.path.join("t", t), perm, True) for t, perm in denies],
            cwd=base,
        )
        p = build_policy(scope, pwd=base, tmpdir=None, extra=[])
        for path in made:
            want = {
                Access.NONE: 0,
                Access.READ: FS.READ_FILE,
                Access.WRITE: FS.READ_FILE | FS.WRITE_FILE,
            }[scope.access(path)]
            got = p.access(path) & (FS.READ_FILE | FS.WRITE_FILE)
            assert got == want, (path, scope, p.rules)


def test_a_deny_below_a_file_changes_nothing(root: Path) -> None:
    tree(root, "p/f", "p/d/g")
    scope = Scope.from_config(
        [("p", "write", True), ("p/f", "read", False)],
        [("p/f/x", "read", True), ("p/d", "write", True)],
        cwd=str(root),
    )
    p = policy(scope, root)
    assert p.access(f"{root}/p/f") & FS.WRITE_FILE


def test_stale_once_an_enumerated_dir_changes(root: Path) -> None:
    tree(root, "p/secret/k", "p/src/a", "q/x")
    scope = Scope.from_config(
        [("p", "write", True), ("q", "read", False)], [("p/secret", "read", True)], cwd=str(root)
    )
    p = policy(scope, root)
    assert [path for path, _ in p.listed] == [f"{root}/p", f"{root}/q"]
    assert not p.stale()
    (root / "p" / "src" / "b").write_text("deeper: still covered")
    assert not p.stale()
    (root / "p" / "new.txt").write_text("next to the deny")
    assert p.stale()
    assert not policy(scope, root).stale()
    (root / "q" / "y").write_text("in a non-recursive target")
    assert p.stale()


def test_manager_sockets_are_the_user_managers_and_the_session_bus_sockets() -> None:
    # A short directory: a socket's path must fit in 108 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        run = Path(d)
        (run / "systemd").mkdir()
        (run / "other").mkdir()
        made = []
        for path in (run / "systemd" / "private", run / "other" / "dbus"):
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            made.append(s)
        (run / "bus").write_text("not a socket\n")  # a file is no way in
        env = {
            "XDG_RUNTIME_DIR": d,
            "DBUS_SESSION_BUS_ADDRESS": f"unix:guid=x,path={d}/other/dbus;unix:abstract=/y",
        }
        try:
            found = [p for p in manager_sockets(env) if p.startswith(d)]
        finally:
            for s in made:
                s.close()
        assert found == [str(run / "systemd" / "private"), str(run / "other" / "dbus")]


def test_host_keys_are_what_the_glob_ssh_host_star_key_finds(tmp_path: Path) -> None:
    names = [
        "ssh_host_rsa_key",
        "ssh_host_ed25519_key",
        "ssh_host__key",  # `*` matches nothing too
        "ssh_host_rsa_key.pub",
        "ssh_host_key",  # too short for the prefix and the suffix both
        "ssh_config",
        ".ssh_host_rsa_key",
    ]
    for name in names:
        (tmp_path / name).write_text("")
    expected = sorted(glob.glob(str(tmp_path / "ssh_host_*_key")))
    assert host_keys(str(tmp_path)) == expected
    assert [os.path.basename(p) for p in expected] == [
        "ssh_host__key",
        "ssh_host_ed25519_key",
        "ssh_host_rsa_key",
    ]
    assert host_keys(str(tmp_path / "missing")) == []
