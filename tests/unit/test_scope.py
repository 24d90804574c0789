"""Scope rules: property tests against a slow reference, and real-filesystem resolution."""

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poddaemon.scope import (
    Access,
    Rule,
    Scope,
    ScopeDenied,
    device_path,
    on_devices,
    resolve,
    write_overlap,
)

# A tiny alphabet so generated paths collide often; "b" and "bc" exercise prefix confusion.
NAMES = ("a", "b", "bc")
Parts = tuple[str, ...]

parts_st = st.lists(st.sampled_from(NAMES), max_size=4).map(tuple)


def to_path(parts: Parts) -> str:
    return "/" + "/".join(parts)


def to_parts(path: str) -> Parts:
    return tuple(p for p in path.split("/") if p)


@st.composite
def rules(draw: st.DrawFn) -> Rule:
    return Rule(
        target=to_path(draw(parts_st)),
        access=draw(st.sampled_from([Access.READ, Access.WRITE])),
        recursive=draw(st.booleans()),
    )


@st.composite
def scopes(draw: st.DrawFn, max_deny: int = 3) -> Scope:
    allow = draw(st.lists(rules(), max_size=4))
    deny = draw(st.lists(rules(), max_size=max_deny))
    return Scope(allow=tuple(allow), deny=tuple(deny))


# -- a reference written differently: on component tuples, one rule kind at a time ------------


def ref_covers(rule: Rule, path: Parts) -> bool:
    target = to_parts(rule.target)
    if path[: len(target)] != target:
        return False
    extra = len(path) - len(target)
    return rule.recursive or extra <= 1


def ref_access(scope: Scope, path: Parts) -> Access:
    granted = [r.access for r in scope.allow if ref_covers(r, path)]
    result = max(granted, default=Access.NONE)
    for d in scope.deny:
        if not ref_covers(d, path):
            continue
        if d.access == Access.READ:  # deny read: nothing left
            result = Access.NONE
        elif result == Access.WRITE:  # deny write: read at most
            result = Access.READ
    return result


# Every path up to depth 5 over the alphabet plus a name no rule uses: enough to witness any
# overlap between rules whose targets have at most 4 components.
ALL_PATHS: list[Parts] = [
    tuple(p) for n in range(6) for p in itertools.product((*NAMES, "z"), repeat=n)
]


# -- properties ---------------------------------------------------------------------------------


@given(scopes(), parts_st)
def test_access_matches_reference(scope: Scope, path: Parts) -> None:
    assert scope.access(to_path(path)) == ref_access(scope, path)


@given(scopes(), parts_st)
def test_deny_caps(scope: Scope, path: Parts) -> None:
    p = to_path(path)
    got = scope.access(p)
    for d in scope.deny:
        if d.covers(p):
            assert got <= (Access.NONE if d.access == Access.READ else Access.READ)


@given(rules(), parts_st)
def test_rule_covers_by_components(rule: Rule, path: Parts) -> None:
    assert rule.covers(to_path(path)) == ref_covers(rule, path)


@given(parts_st, st.sampled_from(NAMES), st.lists(st.sampled_from(NAMES), min_size=1, max_size=3))
def test_recursive_vs_direct_children(base: Parts, child: str, deeper: list[str]) -> None:
    for recursive in (True, False):
        rule = Rule(target=to_path(base), access=Access.READ, recursive=recursive)
        assert rule.covers(to_path(base))
        assert rule.covers(to_path((*base, child)))
        assert rule.covers(to_path((*base, child, *deeper))) is recursive


def test_component_matching_not_string_prefix() -> None:
    scope = Scope(allow=(Rule(target="/a/b", access=Access.WRITE),))
    assert scope.access("/a/b") is Access.WRITE
    assert scope.access("/a/b/c") is Access.WRITE
    assert scope.access("/a/bc") is Access.NONE
    assert scope.access("/a/bc/d") is Access.NONE
    assert scope.access("/a") is Access.NONE
    root = Scope(allow=(Rule(target="/", access=Access.READ, recursive=False),))
    assert root.access("/") is Access.READ
    assert root.access("/x") is Access.READ
    assert root.access("/x/y") is Access.NONE


def test_private_directories_are_out_of_reach_whatever_the_rules_say() -> None:
    scope = Scope(allow=(Rule(target="/home/u", access=Access.WRITE),), private=("/home/u/.pd",))
    assert scope.access("/home/u/.pd") is Access.NONE
    assert scope.access("/home/u/.pd/run/pods.json") is Access.NONE
    assert scope.access("/home/u/.pdx") is Access.WRITE  # by components
    with pytest.raises(ScopeDenied, match="poddaemon's own files"):
        scope.check("../.pd/run/pods.json", Access.READ, "/home/u/work")
    with pytest.raises(ScopeDenied, match=r"needs write, has none"):
        scope.check("/etc/passwd", Access.WRITE, "/")
    delegated = scope.with_delegated(["/home/u/kid"])  # a child's area: still private
    assert delegated.private == scope.private
    assert delegated.access("/home/u/.pd/x") is Access.NONE
    assert all(".pd" not in str(item) for item in scope.summary())  # not a rule users see


@given(scopes(), scopes())
def test_write_overlap_symmetric(a: Scope, b: Scope) -> None:
    assert write_overlap(a, b) == write_overlap(b, a)


@settings(max_examples=150)
@given(scopes(), scopes())
def test_write_overlap_sound(a: Scope, b: Scope) -> None:
    found = write_overlap(a, b)
    shared = [p for p in ALL_PATHS if a.access(to_path(p)) == b.access(to_path(p)) == Access.WRITE]
    if shared:
        # Never miss a path both can write.
        assert found is not None
    if found is not None:
        # What it names lies under a write rule of each side.
        for s in (a, b):
            assert any(r.access is Access.WRITE and r.covers(found) for r in s.allow)
        if not a.deny and not b.deny:
            assert a.access(found) == b.access(found) == Access.WRITE


@given(scopes(max_deny=0), scopes(max_deny=0))
def test_read_never_conflicts(a: Scope, b: Scope) -> None:
    read_only = Scope(allow=tuple(Rule(target=r.target, access=Access.READ) for r in a.allow))
    assert write_overlap(read_only, b) is None


@given(scopes(), st.lists(parts_st, max_size=3), parts_st)
def test_with_delegated_takes_write_only_there(
    scope: Scope, targets: list[Parts], path: Parts
) -> None:
    delegated = scope.with_delegated(to_path(t) for t in targets)
    p = to_path(path)
    under = any(path[: len(t)] == t for t in targets)
    if under:
        assert delegated.access(p) == min(scope.access(p), Access.READ)
    else:
        assert delegated.access(p) == scope.access(p)


@given(scopes(), st.lists(st.tuples(parts_st, st.booleans()), max_size=3), parts_st)
def test_a_delegated_rule_takes_write_only_where_it_reaches(
    scope: Scope, areas: list[tuple[Parts, bool]], path: Parts
) -> None:
    rules = [Rule(target=to_path(t), access=Access.WRITE, recursive=r) for t, r in areas]
    delegated = scope.with_delegated(rules)
    p = to_path(path)
    # The reference: a non-recursive area is its target and the target's direct entries.
    reached = any(
        path[: len(t)] == t and (recursive or len(path) - len(t) <= 1) for t, recursive in areas
    )
    if reached:
        assert delegated.access(p) == min(scope.access(p), Access.READ)
    else:
        assert delegated.access(p) == scope.access(p)


def test_write_overlap_examples() -> None:
    def w(target: str, recursive: bool = True) -> Rule:
        return Rule(target=target, access=Access.WRITE, recursive=recursive)

    def sc(*allow: Rule) -> Scope:
        return Scope(allow=allow)

    assert write_overlap(sc(w("/a")), sc(w("/a/b/c"))) == "/a/b/c"  # the deeper target
    assert write_overlap(sc(w("/a/b")), sc(w("/a/bc"))) is None
    assert write_overlap(sc(w("/a", False)), sc(w("/a/b/c"))) is None  # below its reach
    assert write_overlap(sc(w("/a", False)), sc(w("/a/b"))) == "/a/b"
    read = Scope(allow=(Rule(target="/a", access=Access.READ),))
    assert write_overlap(read, sc(w("/a"))) is None


def test_delegation_frees_the_parents_area() -> None:
    parent = Scope.from_config([("/w", "write", True)], cwd="/")
    child = Scope.from_config([("/w/c", "write", True)], cwd="/")
    assert write_overlap(parent, child) == "/w/c"
    freed = parent.with_delegated(["/w/c"])
    assert write_overlap(freed, child) is None
    assert freed.access("/w/c/x") is Access.READ
    assert freed.access("/w/d") is Access.WRITE
    # A write rule wholly denied by its own scope holds nothing.
    assert freed.writable_rules() == parent.writable_rules()
    gone = Scope.from_config([("/w/c", "write", True)], [("/w", "write", True)], cwd="/")
    assert gone.writable_rules() == ()
    assert write_overlap(gone, child) is None


def test_parse_label_and_round_trip() -> None:
    assert Access.parse("read") is Access.READ
    assert Access.parse("write") is Access.WRITE
    with pytest.raises(ValueError, match="'read' or 'write'"):
        Access.parse("execute")
    assert [a.label for a in Access] == ["none", "read", "write"]
    scope = Scope.from_config(
        [("/p", "write", True), ("/q", "read", False)], [("/p/secret", "read", True)], cwd="/"
    )
    assert scope.summary() == [
        {"target": "/p", "permission": "write", "recursive": True},
        {"target": "/q", "permission": "read", "recursive": False},
        {"target": "/p/secret", "permission": "read", "recursive": True, "deny": True},
    ]
    assert Scope.from_dicts(scope.to_dicts()) == scope


# -- the real filesystem ----------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = Path(os.path.realpath(tmp_path))
    (root / "in" / "sub").mkdir(parents=True)
    (root / "out").mkdir()
    (root / "in" / "file.txt").write_text("x")
    (root / "out" / "secret.txt").write_text("s")
    return root


def test_from_config_resolves_relative_targets(tree: Path) -> None:
    scope = Scope.from_config([("in", "write", True)], cwd=str(tree))
    assert scope.allow[0].target == str(tree / "in")


def test_dotdot_escape_is_outside(tree: Path) -> None:
    scope = Scope.from_config([("in", "write", True)], cwd=str(tree))
    cwd = str(tree / "in")
    assert scope.check("sub/../file.txt", Access.WRITE, cwd) == str(tree / "in" / "file.txt")
    with pytest.raises(ScopeDenied) as e:
        scope.check("../out/secret.txt", Access.READ, cwd)
    assert str(e.value) == f"outside scope: {tree}/out/secret.txt (needs read, has none)"


def test_symlink_inside_pointing_outside_is_outside(tree: Path) -> None:
    (tree / "in" / "link").symlink_to(tree / "out")
    scope = Scope.from_config([("in", "write", True)], cwd=str(tree))
    cwd = str(tree / "in")
    assert scope.access(resolve("link/secret.txt", cwd)) is Access.NONE
    with pytest.raises(ScopeDenied, match=r"outside scope: .*/out/secret\.txt"):
        scope.check("link/secret.txt", Access.READ, cwd)
    # A new file through the link is judged where it would really land.
    assert scope.access(resolve("link/new/file", cwd)) is Access.NONE


def test_symlink_outside_pointing_inside_is_inside(tree: Path) -> None:
    (tree / "out" / "door").symlink_to(tree / "in")
    scope = Scope.from_config([("in", "write", True)], cwd=str(tree))
    got = scope.check(str(tree / "out" / "door" / "file.txt"), Access.WRITE, "/")
    assert got == str(tree / "in" / "file.txt")


def test_missing_path_judged_by_nearest_existing_ancestor(tree: Path) -> None:
    scope = Scope.from_config([("in", "write", True)], [("in/sub", "write", True)], cwd=str(tree))
    cwd = str(tree / "in")
    assert scope.check("new/dir/f.txt", Access.WRITE, cwd) == str(tree / "in/new/dir/f.txt")
    assert scope.access(resolve("sub/new/f.txt", cwd)) is Access.READ
    assert scope.access(resolve("nope/../../out/x", cwd)) is Access.NONE


def test_check_error_texts(tree: Path) -> None:
    scope = Scope.from_config([("in", "read", True)], cwd=str(tree))
    cwd = str(tree)
    with pytest.raises(ScopeDenied) as e:
        scope.check("in/file.txt", Access.WRITE, cwd)
    assert str(e.value) == f"outside scope: {tree}/in/file.txt (needs write, has read)"
    assert e.value.has is Access.READ and e.value.want is Access.WRITE
    with pytest.raises(ScopeDenied) as e:
        scope.check("out", Access.READ, cwd)
    assert str(e.value) == f"outside scope: {tree}/out (needs read, has none)"
    assert scope.check("in", Access.READ, cwd) == str(tree / "in")


def test_sibling_with_common_prefix_on_disk(tree: Path) -> None:
    (tree / "in2").mkdir()
    scope = Scope.from_config([("in", "write", True)], cwd=str(tree))
    assert scope.access(resolve("in2/x", str(tree))) is Access.NONE


MOUNTS = [
    ("/", "254:0", "/"),
    ("/srv/alias", "254:0", "/data/real"),  # mount --bind /data/real /srv/alias
    ("/mnt/usb", "8:1", "/"),
    ("/mnt/usb", "8:2", "/"),  # mounted over the first: this one is what the path reaches
]


def writes(*targets: str) -> Scope:
    return Scope(allow=tuple(Rule(target=t, access=Access.WRITE) for t in targets))


def test_on_devices_names_a_bind_mounts_paths_as_the_originals() -> None:
    moved = on_devices(
        writes("/srv/alias/x", "/data/real", "/srv/alias", "/mnt/usb/a", "/"), MOUNTS
    )
    assert [r.target for r in moved.allow][:5] == [
        "/@254:0/data/real/x",
        "/@254:0/data/real",
        "/@254:0/data/real",
        "/@8:2/a",
        "/@254:0/",
    ]
    # "/" reaches the files of every mount under it too (the last ones listed).
    assert [r.target for r in moved.allow][5:] == ["/@254:0/data/real", "/@8:1/", "/@8:2/"]
    assert device_path("/@254:0/data/real/x") == "/data/real/x" and device_path("/a") == "/a"


def test_write_overlap_through_a_bind_mount_is_seen_on_devices_only() -> None:
    alias, real, usb = writes("/srv/alias/x"), writes("/data/real"), writes("/mnt/usb")
    assert write_overlap(alias, real) is None  # by path: no overlap
    found = write_overlap(on_devices(alias, MOUNTS), on_devices(real, MOUNTS))
    assert found is not None and device_path(found) == "/data/real/x"
    assert write_overlap(on_devices(usb, MOUNTS), on_devices(real, MOUNTS)) is None
    assert on_devices(real, []) == real  # no mount table: paths as they are
    # A bind mount under a write target: the target reaches the mounted files too.
    above = on_devices(writes("/srv"), MOUNTS)
    assert write_overlap(above, on_devices(writes("/data/real/x"), MOUNTS)) is not None
    shallow = Scope(allow=(Rule(target="/srv", access=Access.WRITE, recursive=False),))
    assert [r.target for r in on_devices(shallow, MOUNTS).allow] == ["/@254:0/srv"]


def test_aliases_are_the_other_paths_mounts_show_a_directory_at() -> None:
    from poddaemon.scope import aliases

    mounts = [
        ("/", "254:0", "/"),
        ("/proc", "0:22", "/"),
        ("/w/proj/mnt", "254:0", "/home/u/.local/share/poddaemon"),  # the data dir, bound
        ("/w/other/up", "254:0", "/home/u/.local"),  # a directory above it
        ("/w/third/sess", "254:0", "/home/u/.local/share/poddaemon/sessions"),  # one below
        ("/srv/disk", "254:0", "/"),  # the whole device again
        ("/w/unrelated", "254:0", "/home/u/code"),
        ("/tmp", "0:30", "/"),  # another device
    ]
    data = "/home/u/.local/share/poddaemon"
    assert aliases(data, mounts) == [
        "/w/proj/mnt",
        "/w/other/up/share/poddaemon",
        "/w/third/sess",
        "/srv/disk/home/u/.local/share/poddaemon",
    ]
    assert aliases("/tmp/pd/run", mounts) == []  # on its own device, mounted once
    assert aliases("/nowhere", []) == []
