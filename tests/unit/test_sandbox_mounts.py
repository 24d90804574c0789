"""The read-only view's pure half: /proc/self/mountinfo parsed, the remount flags, which mounts
are made read-only, and which paths the policy keeps writable (no mount syscall here)."""

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poddaemon.sandbox import build_policy
from poddaemon.sandbox.mounts import (
    MS_BIND,
    MS_NOATIME,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_RELATIME,
    MS_REMOUNT,
    Mount,
    minimal,
    parse_mountinfo,
    remount_flags,
    to_remount,
    unescape,
)
from poddaemon.scope import Scope

SAMPLE = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
24 27 0:6 / /dev rw,nosuid,relatime shared:2 - devtmpfs devtmpfs rw,size=12334524k,mode=755
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
28 27 0:25 / /mnt/tools ro,nosuid,nodev,relatime - tmpfs tools ro,size=4k
43 27 0:40 / /media/my\\040disk rw,nosuid,nodev,noexec,noatime shared:7 master:1 - vfat /dev/sdb1 rw
44 27 0:41 / /srv/tab\\011and\\134slash rw - tmpfs x rw
"""


def test_mountinfo_is_parsed_with_optional_fields_and_escapes() -> None:
    mounts = parse_mountinfo(SAMPLE)
    assert [m.path for m in mounts] == [
        "/proc",
        "/dev",
        "/",
        "/mnt/tools",
        "/media/my disk",
        "/srv/tab\tand\\slash",
    ]
    assert mounts[1].options == {"rw", "nosuid", "relatime"}  # per-mount, not the super block's
    assert mounts[4].options == {"rw", "nosuid", "nodev", "noexec", "noatime"}


def test_a_short_or_empty_line_is_skipped() -> None:
    assert parse_mountinfo("\n1 2 3\n") == []


# The kernel's escape set for mount points (fs/proc_namespace.c: " \t\n\\").
# Other line breaks for str.splitlines (\x0b, \x1c, \x85, \u2028) come through as they are.
CHARS = "ab/ \t\n\\é.-\x0b\x1c\x85\u2028"
paths = st.lists(st.text(alphabet=st.sampled_from(CHARS), min_size=1, max_size=12), max_size=5).map(
    lambda parts: "/" + "/".join(parts)
)


def escape(path: str) -> str:
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


@given(st.lists(st.tuples(paths, st.sets(st.sampled_from(["nosuid", "nodev", "relatime"])))))
def test_any_mount_point_round_trips_through_mountinfo(entries: list[tuple[str, set[str]]]) -> None:
    text = "".join(
        f"{i} 1 0:{i} / {escape(p)} {','.join(['rw', *sorted(o)])} - ext4 /dev/x rw\n"
        for i, (p, o) in enumerate(entries)
    )
    mounts = parse_mountinfo(text)
    assert [(m.path, m.options) for m in mounts] == [(p, {"rw", *o}) for p, o in entries]


@given(paths)
def test_unescape_inverts_the_kernels_escaping(path: str) -> None:
    assert unescape(escape(path)) == path


def test_remount_flags_keep_the_locked_per_mount_flags() -> None:
    # In a user namespace a remount that drops nosuid/nodev/noexec/atime fails with EPERM.
    base = MS_REMOUNT | MS_BIND | MS_RDONLY
    assert remount_flags({"rw", "relatime"}) == base | MS_RELATIME
    assert remount_flags({"rw", "nosuid", "nodev", "noexec", "noatime"}) == (
        base | MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME
    )
    assert remount_flags({"rw"}) == base  # strictatime: no atime flag keeps the current one


def test_to_remount_skips_read_only_mounts_and_those_at_or_below_a_grant() -> None:
    mounts = [
        Mount("/", frozenset({"rw"})),
        Mount("/work", frozenset({"rw"})),
        Mount("/work/proj", frozenset({"rw"})),  # the grant's own bind
        Mount("/work/proj/cache", frozenset({"rw"})),  # a mount below it
        Mount("/work/projector", frozenset({"rw"})),  # a sibling that only shares the prefix
        Mount("/mnt/tools", frozenset({"ro", "nosuid"})),
    ]
    got = [m.path for m in to_remount(mounts, ["/work/proj"])]
    assert got == ["/", "/work", "/work/projector"]


def test_to_remount_takes_the_topmost_of_stacked_mounts() -> None:
    mounts = [
        Mount("/data", frozenset({"ro"})),
        Mount("/", frozenset({"rw"})),
        Mount("/data", frozenset({"rw", "nodev"})),  # mounted on top: the one a path reaches
    ]
    assert to_remount(mounts, []) == [Mount("/", frozenset({"rw"})), mounts[2]]


def test_minimal_drops_nested_paths_by_component() -> None:
    assert minimal(["/a/b", "/a", "/a-b", "/c/d", "/c/d"]) == ["/a", "/a-b", "/c/d"]


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        yield Path(os.path.realpath(d))


def test_policy_lists_what_it_grants_write_on_and_nothing_only_readable(root: Path) -> None:
    for d in ("proj/src", "proj/secrets", "docs", "tmp"):
        (root / d).mkdir(parents=True)
    scope = Scope.from_config(
        [("proj", "write", True), ("docs", "read", True)],
        [("proj/secrets", "read", True)],
        cwd=str(root),
    )
    policy = build_policy(scope, pwd=str(root / "proj"), tmpdir=str(root / "tmp"))
    # The tree with a deny carved inside it is one grant (its top keeps entry rights); devices
    # (/dev/null ...) are writable on a read-only mount and need no bind.
    assert policy.writable == (str(root / "proj"), str(root / "tmp"))
