"""protocol.paths: directories created 0700 whatever the umask, and refused when another user
could tamper with them (SPEC §2). Ownership cases need root (to chown to a second uid)."""

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import paths
from protocol.paths import UnsafeDirectory, check_dir, check_private_dirs, ensure_dir

OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pdpa", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_ensure_dir_makes_every_missing_level_0700(tmp: Path, umask: int) -> None:
    target = tmp / "a" / "b" / "c"
    old = os.umask(umask)
    try:
        assert ensure_dir(target) == target
    finally:
        os.umask(old)
    for p in (tmp / "a", tmp / "a" / "b", target):
        assert mode(p) == 0o700, p


def test_an_existing_dir_keeps_its_mode(tmp: Path) -> None:
    (tmp / "kept").mkdir(mode=0o755)
    os.chmod(tmp / "kept", 0o755)
    ensure_dir(tmp / "kept")
    assert mode(tmp / "kept") == 0o755  # not writable by others: acceptable as it is


@pytest.mark.parametrize("bits", [0o770, 0o702, 0o777])
def test_a_dir_writable_by_group_or_others_is_refused(tmp: Path, bits: int) -> None:
    d = tmp / "open"
    d.mkdir()
    os.chmod(d, bits)
    with pytest.raises(UnsafeDirectory) as info:
        check_dir(d, "runtime directory")
    message = str(info.value)
    assert message.startswith(f"runtime directory {d} is writable by group or others")
    assert "\n" not in message and isinstance(info.value, PermissionError)


def test_a_file_is_not_a_directory(tmp: Path) -> None:
    (tmp / "f").write_text("")
    with pytest.raises(UnsafeDirectory, match="is not a directory"):
        ensure_dir(tmp / "f", "home directory")


@needs_root
def test_a_dir_owned_by_another_user_is_refused(tmp: Path) -> None:
    d = tmp / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeDirectory) as info:
        ensure_dir(d, "home directory")
    assert str(info.value).startswith(
        f"home directory {d} is owned by uid {OTHER_UID}, not by you (uid 0)"
    )


@needs_root
def test_a_dir_inside_another_users_dir_is_refused(tmp: Path) -> None:
    parent = tmp / "theirs"
    parent.mkdir(mode=0o755)
    (parent / "mine").mkdir(mode=0o700)
    os.chown(parent, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeDirectory) as info:
        check_dir(parent / "mine", "data directory")
    assert f"inside {parent}, owned by uid {OTHER_UID}" in str(info.value)


def test_a_dir_inside_a_world_writable_dir_needs_the_sticky_bit(tmp: Path) -> None:
    shared = tmp / "shared"
    shared.mkdir()
    (shared / "mine").mkdir(mode=0o700)
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeDirectory, match="without the sticky bit"):
        check_dir(shared / "mine")
    os.chmod(shared, 0o1777)  # like /tmp: nobody may rename what another user made
    check_dir(shared / "mine")


def test_a_symlink_is_judged_where_it_points_and_where_it_lies(tmp: Path) -> None:
    (tmp / "real").mkdir(mode=0o700)
    shared = tmp / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "link").symlink_to(tmp / "real")
    with pytest.raises(UnsafeDirectory, match="without the sticky bit"):
        check_dir(shared / "link")  # whoever can write `shared` can repoint the link


@needs_root
def test_a_symlink_another_user_owns_is_refused_even_in_a_sticky_dir(tmp: Path) -> None:
    """Where links are not protected (fs.protected_symlinks = 0, as on these machines), the
    link's owner can repoint it at a tree of theirs while the pod runs: its sessions went
    there, acknowledged, for them to delete."""
    (tmp / "real").mkdir(mode=0o700)
    shared = tmp / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    link = shared / "link"
    link.symlink_to(tmp / "real")
    check_dir(link)  # ours: fine
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeDirectory, match=f"through the symlink {link}, owned by uid"):
        check_dir(link)
    (tmp / "real" / "sub").mkdir(mode=0o700)
    with pytest.raises(UnsafeDirectory, match="through the symlink"):
        check_dir(link / "sub")  # a link on the way counts too


@needs_root
def test_another_users_symlink_in_the_middle_of_a_chain_is_refused(tmp: Path) -> None:
    """A link of ours to a link of theirs: only the path as written and the one it resolves
    to were looked at, so the home (or the manifest a unit runs) was accepted, and its owner
    could repoint their link, while the pod ran, at a tree of their own."""
    (tmp / "real").mkdir(mode=0o700)
    shared = tmp / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    theirs = shared / "theirs"
    theirs.symlink_to(tmp / "real")
    os.lchown(theirs, OTHER_UID, OTHER_UID)
    ours = tmp / "home"
    ours.symlink_to(theirs)
    with pytest.raises(UnsafeDirectory, match=f"through the symlink {theirs}, owned by uid"):
        check_dir(ours)
    manifest = tmp / "real" / "m.toml"
    manifest.write_text("[pod]\n")
    (shared / "m.toml").symlink_to(manifest)
    os.lchown(shared / "m.toml", OTHER_UID, OTHER_UID)
    (tmp / "real" / "link.toml").symlink_to(shared / "m.toml")
    with pytest.raises(UnsafeDirectory, match=f"through the symlink {shared}/m.toml, owned by"):
        paths.check_file(tmp / "real" / "link.toml", "manifest", "they could change it")
    os.lchown(theirs, 0, 0)  # ours after all: the chain is fine
    check_dir(ours)


def test_ensure_private_dirs_and_the_client_check(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp / "home"
    monkeypatch.setenv("PODDAEMON_HOME", str(home))
    for var in ("PODDAEMON_CONFIG_DIR", "PODDAEMON_DATA_DIR", "PODDAEMON_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    check_private_dirs()  # nothing exists yet: nothing to refuse
    old = os.umask(0)
    try:
        data, runtime = paths.ensure_private_dirs()
    finally:
        os.umask(old)
    assert (data, runtime) == (str(home / "data"), str(home / "run"))
    assert mode(home) == mode(data) == mode(runtime) == 0o700
    check_private_dirs()
    os.chmod(runtime, 0o777)
    with pytest.raises(UnsafeDirectory, match=f"runtime directory {runtime} is writable"):
        check_private_dirs()


DIR_VARS = ("PODDAEMON_CONFIG_DIR", "PODDAEMON_DATA_DIR", "PODDAEMON_RUNTIME_DIR")


def test_each_dir_is_its_variable_else_under_home_else_platformdirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SPEC §2's table, and "empty variables count as unset".
    import platformdirs

    monkeypatch.setenv("PODDAEMON_HOME", "/h")
    for var, value in zip(DIR_VARS, ("/c", "/d", "/r"), strict=True):
        monkeypatch.setenv(var, value)
    assert [paths.config_dir(), paths.data_dir(), paths.runtime_dir(), paths.log_dir()] == [
        Path(p) for p in ("/c", "/d", "/r", "/h/log")
    ]
    for var in DIR_VARS:
        monkeypatch.setenv(var, "")
    assert [paths.config_dir(), paths.data_dir(), paths.runtime_dir(), paths.log_dir()] == [
        Path(p) for p in ("/h/config", "/h/data", "/h/run", "/h/log")
    ]
    monkeypatch.setenv("PODDAEMON_HOME", "")
    assert paths.config_dir() == Path(platformdirs.user_config_dir("poddaemon"))
    assert paths.data_dir() == Path(platformdirs.user_data_dir("poddaemon"))
    assert paths.log_dir() == Path(platformdirs.user_log_dir("poddaemon"))
    assert paths.runtime_dir().name == "poddaemon"  # user_runtime_dir (it warns without XDG)
    assert paths.registry_path() == paths.runtime_dir() / "pods.json"
    assert paths.socket_path("a") == paths.runtime_dir() / "pods" / "a" / "sock"
    assert paths.defaults_path() == paths.config_dir() / "defaults.toml"


def test_write_private_makes_a_file_0600_whatever_the_umask(tmp: Path) -> None:
    old = tmp / "old"
    old.write_text("before, and longer")
    os.chmod(old, 0o666)
    mask = os.umask(0)
    try:
        paths.write_private(tmp / "new", "new")
        paths.write_private(old, "after")
    finally:
        os.umask(mask)
    assert (mode(tmp / "new"), mode(old)) == (0o600, 0o600)
    assert old.read_text() == "after"


@needs_root
def test_nothing_is_made_inside_another_users_dir(tmp: Path) -> None:
    """Found by QA: root with PODDAEMON_HOME under another user's directory made the home
    there, chmod-ed it (following a symlink the owner had swapped in meanwhile: any file of
    root's went 0700), and only then refused it. The parents are judged before anything is
    made."""
    theirs = tmp / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    home = theirs / "home" / "run"
    with pytest.raises(UnsafeDirectory, match=f"^home directory {home} is inside {theirs}, owned"):
        ensure_dir(home, "home directory")
    assert os.listdir(theirs) == []


def test_a_symlink_swapped_in_after_mkdir_is_not_chmod_ded(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other race: a name made (or swapped) between our mkdir and our chmod is never
    followed; only the directory we made is given its mode."""
    victim = tmp / "victim"
    victim.write_text("")
    os.chmod(victim, 0o644)
    mkdir = os.mkdir

    def mkdir_then_swap(path: str | os.PathLike[str], mode: int = 0o777) -> None:
        mkdir(path, mode)
        os.rename(path, tmp / "moved")
        os.symlink(victim, path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(UnsafeDirectory):
        ensure_dir(tmp / "made")
    assert mode(victim) == 0o644


# The checks walk paths as strings (pathlib is ~9 ms of every start): they must take a path
# apart exactly as pathlib did, or a check could look at another directory than the kernel.
_path_text = st.lists(
    st.sampled_from(["", ".", "..", "a", "b", "a b", "é", "x.y", "..."]), max_size=8
).map("/".join) | st.text(alphabet="/.ab", max_size=16)


@given(_path_text)
def test_parts_and_tidy_take_a_path_apart_as_pathlib_does(text: str) -> None:
    assert paths._parts(text) == [p for p in PurePosixPath(text).parts if p != "/" and p != "//"]
    assert paths.tidy(text) == str(PurePosixPath(text))


@given(_path_text)
def test_parents_are_pathlibs(text: str) -> None:
    absolute = os.path.abspath("/" + text)
    assert paths._parents(absolute) == [str(p) for p in PurePosixPath(absolute).parents]


def test_links_on_the_way_follow_a_chain_as_the_kernel_does(tmp: Path) -> None:
    (tmp / "real" / "deep").mkdir(parents=True)
    (tmp / "hop").symlink_to("real/./deep/..")  # relative, with "." and ".." in it
    (tmp / "abs").symlink_to(tmp / "hop")  # absolute, to another link
    target = tmp / "abs" / "deep"
    found = [link for link, _ in paths._links_on_the_way(str(target))]
    assert found == [str(tmp / "abs"), str(tmp / "hop")]
    assert os.path.realpath(target) == str(tmp / "real" / "deep")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_file_of_root_read_as_the_overflow_uid_in_a_runner_is_root_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every start now checks its hook scripts as unit install did: in a command runner's user
    namespace (a pod spawned by a command) root's /usr/local/bin/guard.sh reads as 65534, and
    was refused as another user's, where the symlink and parent checks took it for root's."""
    script = tmp_path / "guard.sh"
    script.write_text("exit 0\n")
    script.chmod(0o755)
    os.chown(script, 65534, 65534)
    with pytest.raises(paths.UnsafeDirectory, match="owned by uid 65534"):
        paths.check_unchangeable(script, "hook", "as they could change it")
    monkeypatch.setattr(paths, "_root_unmapped_here", lambda uid: uid == 65534)
    paths.check_unchangeable(script, "hook", "as they could change it")  # accepted
