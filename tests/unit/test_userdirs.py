"""protocol.userdirs gives platformdirs' own answer in every environment below, and leaves
platformdirs unimported in the plain ones (what it is for). Ownership cases need root."""

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import platformdirs
import pytest

from protocol import userdirs

APP = "poddaemon"
OTHER_UID = 65534  # nobody
ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]


def make(path: Path, mode: int, uid: int | None = None) -> Path:
    path.mkdir()
    os.chmod(path, mode)  # (whatever the umask)
    if uid is not None:
        os.chown(path, uid, -1)
    return path


@pytest.fixture(scope="module")
def tree() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="pdud", dir="/tmp"))  # 0700, in sticky /tmp
    make(top / "private", 0o700)
    make(top / "loose", 0o755)
    make(top / "setgid", 0o2700)
    (top / "link").symlink_to(top / "private")
    (top / "file").write_text("")
    make(make(top / "shared", 0o777) / "run", 0o700)
    make(make(top / "sticky", 0o1777) / "run", 0o700)
    make(make(top / "groupish", 0o770) / "run", 0o700)
    if ROOT:
        make(top / "foreign", 0o700, OTHER_UID)
        make(make(top / "foreign-parent", 0o755, OTHER_UID) / "run", 0o700)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


RUNTIME = {  # XDG_RUNTIME_DIR, from the tree's top (None: unset); True: platformdirs not needed
    "unset": (None, False),
    "empty": ("", False),
    "relative": ("rel", False),
    "private": ("{top}/private", True),
    "trailing slash": ("{top}/private/", True),
    "doubled slash": ("{top}//private", False),
    "dot": ("{top}/./private", False),
    "dot-dot": ("{top}/loose/../private", False),
    "mode 0755": ("{top}/loose", False),
    "setgid": ("{top}/setgid", True),  # (only the permission bits count)
    "symlink": ("{top}/link", False),
    "through a symlink": ("{top}/link/../private", False),
    "missing": ("{top}/missing", False),
    "a file": ("{top}/file", False),
    "under a writable parent": ("{top}/shared/run", False),
    "under a group-writable parent": ("{top}/groupish/run", False),
    "under a sticky parent": ("{top}/sticky/run", True),
    "another uid's": ("{top}/foreign", False),
    "under another uid's parent": ("{top}/foreign-parent/run", False),
    "root": ("/", False),
}


def answers(
    env: dict[str, str | None], ours: Callable[[], str], theirs: Callable[[], str]
) -> tuple[str, str, bool]:
    """(userdirs' answer, platformdirs' answer, whether userdirs went to platformdirs), under
    `env` (None: unset)."""
    changed = {k: v for k, v in env.items() if v is not None}
    with mock.patch.dict(os.environ, changed):
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = theirs()
        with mock.patch.object(userdirs, "_platformdirs", wraps=userdirs._platformdirs) as asked:
            got = ours()
    return got, expected, asked.called


@pytest.mark.parametrize("case", RUNTIME, ids=str)
def test_runtime_dir_is_platformdirs_answer(tree: Path, case: str) -> None:
    value, plain = RUNTIME[case]
    if "uid" in case and not ROOT:
        pytest.skip("chown to another uid needs root")
    env = {"XDG_RUNTIME_DIR": None if value is None else value.format(top=tree)}
    got, expected, asked = answers(
        env, lambda: userdirs.user_runtime_dir(APP), lambda: platformdirs.user_runtime_dir(APP)
    )
    assert got == expected
    assert asked == (not plain)


XDG = {"unset": None, "empty": "", "relative": "rel", "absolute": "/x/y", "trailing": "/x/y/"}
HOME = {"unset": None, "empty": "", "relative": "h", "root": "/", "absolute": "/h/me/"}
KINDS = {  # its XDG variable, our function, platformdirs'
    "config": ("XDG_CONFIG_HOME", userdirs.user_config_dir, platformdirs.user_config_dir),
    "data": ("XDG_DATA_HOME", userdirs.user_data_dir, platformdirs.user_data_dir),
    "log": ("XDG_STATE_HOME", userdirs.user_log_dir, platformdirs.user_log_dir),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("xdg", XDG)
@pytest.mark.parametrize("home", HOME)
def test_home_dirs_are_platformdirs_answers(kind: str, xdg: str, home: str) -> None:
    var, ours, theirs = KINDS[kind]
    env = {var: XDG[xdg], "HOME": HOME[home]}
    got, expected, asked = answers(env, lambda: ours(APP), lambda: theirs(APP))
    assert got == expected
    # An absolute XDG variable, else an absolute HOME: no platformdirs.
    assert asked == (xdg not in ("absolute", "trailing") and home not in ("root", "absolute"))


def podctl_status_stderr(env: dict[str, str], socket: Path) -> str:
    """What `podctl status SOCKET` (no pod there) says on stderr, with `-X importtime`."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cli.main", "status", str(socket)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert f"no socket at {socket}" in proc.stderr
    return proc.stderr


def test_podctl_leaves_platformdirs_unimported_in_a_plain_environment(tree: Path) -> None:
    # As most users run it: no PODDAEMON_HOME; the data and runtime directories from XDG.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PODDAEMON_", "XDG_"))}
    env.update(XDG_RUNTIME_DIR=str(tree / "private"), XDG_DATA_HOME=str(tree / "private"))
    assert "| platformdirs" not in podctl_status_stderr(env, tree / "nosock")
    del env["XDG_RUNTIME_DIR"]  # (then platformdirs is asked, as ever)
    assert "| platformdirs" in podctl_status_stderr(env, tree / "nosock")
