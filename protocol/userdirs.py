"""platformdirs' answers for an app's user directories, without importing it when they are plain.

Importing platformdirs (pathlib, tempfile, shutil, bz2 and lzma come with it) costs 10-25 ms of
a process's start on these machines: up to a third of a `podctl notify`, and part of every pod's
start. Where the environment is plain, its
rules are too: an absolute XDG_*_HOME, else `~/…` under an absolute HOME; for the runtime
directory, an XDG_RUNTIME_DIR that is plainly private (ours, mode 0700, no symlink, under
directories only root or we own and nobody else may write to). Anything else (a relative or
unset variable, a symlink, an odd spelling, a directory it would warn about and replace) goes to
platformdirs itself, so its fallbacks stay its own. tests/unit/test_userdirs.py holds these
functions to platformdirs' own answers, environment by environment.
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from types import ModuleType


def _platformdirs() -> ModuleType:
    import platformdirs

    return platformdirs


def _xdg(name: str) -> str | None:
    value = os.environ.get(name, "")
    return value if value.startswith("/") else None  # (platformdirs ignores a relative one)


def _under_home(relative: str) -> str | None:
    """`~/relative`, when HOME is absolute (platformdirs asks pwd otherwise, and so do we)."""
    home = os.environ.get("HOME")
    return os.path.expanduser(f"~/{relative}") if home and home.startswith("/") else None


def user_config_dir(app: str) -> str:
    base = _xdg("XDG_CONFIG_HOME") or _under_home(".config")
    return os.path.join(base, app) if base else _platformdirs().user_config_dir(app)


def user_data_dir(app: str) -> str:
    base = _xdg("XDG_DATA_HOME") or _under_home(".local/share")
    return os.path.join(base, app) if base else _platformdirs().user_data_dir(app)


def user_log_dir(app: str) -> str:
    base = _xdg("XDG_STATE_HOME") or _under_home(".local/state")
    return os.path.join(base, app, "log") if base else _platformdirs().user_log_dir(app)


def user_runtime_dir(app: str) -> str:
    base = _xdg("XDG_RUNTIME_DIR")
    if base and _plainly_private(base):
        return os.path.join(base, app)
    # Without a usable XDG_RUNTIME_DIR platformdirs falls back to /run/user/<uid> or
    # /tmp/runtime-<uid>, and warns; check_dir judges whatever it picks.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return str(_platformdirs().user_runtime_dir(app))


def _plainly_private(path: str) -> bool:
    """Whether platformdirs takes XDG_RUNTIME_DIR `path` as it is, beyond doubt: a directory
    (not a symlink) of ours with mode 0700, each directory above it root's or ours, not a
    symlink, and writable by group or others only when sticky. A symlink or a `.`, `..` or
    empty name on the way leaves the judgement to platformdirs."""
    names = path.rstrip("/").split("/")[1:]
    if not names or any(name in ("", ".", "..") for name in names):
        return False
    me, here = os.geteuid(), ""
    try:
        for name in names[:-1]:
            here += "/" + name
            st = os.lstat(here)
            if st.st_uid not in (0, me) or not stat.S_ISDIR(st.st_mode):
                return False
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                return False
        st = os.lstat(f"{here}/{names[-1]}")
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == me and st.st_mode & 0o777 == 0o700
