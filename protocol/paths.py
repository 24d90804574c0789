"""Where poddaemon keeps its files (SPEC §2). Shared by the daemon, podctl and client programs."""

import os
import re
import warnings
from pathlib import Path

APP = "poddaemon"
POD_NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9_-]{0,47}\Z")
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value or None  # empty variables count as unset


def _home(sub: str) -> Path | None:
    home = _env("PODDAEMON_HOME")
    return Path(home) / sub if home else None


def config_dir() -> Path:
    explicit = _env("PODDAEMON_CONFIG_DIR")
    if explicit:
        return Path(explicit)
    home = _home("config")
    if home:
        return home
    import platformdirs

    return Path(platformdirs.user_config_dir(APP))


def data_dir() -> Path:
    explicit = _env("PODDAEMON_DATA_DIR")
    if explicit:
        return Path(explicit)
    home = _home("data")
    if home:
        return home
    import platformdirs

    return Path(platformdirs.user_data_dir(APP))


def runtime_dir() -> Path:
    explicit = _env("PODDAEMON_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    home = _home("run")
    if home:
        return home
    import platformdirs

    # Without XDG_RUNTIME_DIR platformdirs falls back to /tmp/runtime-<uid> and warns; that is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Path(platformdirs.user_runtime_dir(APP))


def log_dir() -> Path:
    home = _home("log")
    if home:
        return home
    import platformdirs

    return Path(platformdirs.user_log_dir(APP))


def ensure_dir(path: Path) -> Path:
    """Create `path` (and parents) with mode 0700; an existing directory is left as it is."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def sessions_dir() -> Path:
    return data_dir() / "sessions"


def registry_path() -> Path:
    return runtime_dir() / "pods.json"


def pod_dir(name: str) -> Path:
    return runtime_dir() / "pods" / name


def socket_path(name: str) -> Path:
    return pod_dir(name) / "sock"


def defaults_path() -> Path:
    return config_dir() / "defaults.toml"


def socket_path_problem(path: Path) -> str | None:
    """Why `path` cannot be a Unix socket address, or None when it can."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        return (
            f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow "
            f"{MAX_SOCKET_PATH}: use a shorter PODDAEMON_RUNTIME_DIR or pod name"
        )
    return None
