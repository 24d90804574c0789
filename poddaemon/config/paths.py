"""Directory layout (SPEC §2); the single definition lives in `protocol.paths`."""

from protocol.paths import (
    POD_NAME_RE,
    config_dir,
    data_dir,
    defaults_path,
    ensure_dir,
    log_dir,
    pod_dir,
    registry_path,
    runtime_dir,
    sessions_dir,
    socket_path,
    socket_path_problem,
)

__all__ = [
    "POD_NAME_RE",
    "config_dir",
    "data_dir",
    "defaults_path",
    "ensure_dir",
    "log_dir",
    "pod_dir",
    "registry_path",
    "runtime_dir",
    "sessions_dir",
    "socket_path",
    "socket_path_problem",
]
