"""The process's umask: new files' modes depend on it (a pod's files, a forked pod's)."""

import os


def current_umask() -> int:
    """The process's umask, read without changing it (os.umask would, for a moment, under the
    feet of other threads: a pod calls this from a worker thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
