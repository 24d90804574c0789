"""`python -m poddaemon` and the `poddaemon` command (pyproject.toml's script points here)."""

import gc
import sys


def main() -> int:
    # Start-up allocates some 40,000 objects (modules, classes, the manifest) that live as long
    # as the pod: the collector would walk them ~50 times before READY for nothing (~4 ms). It
    # is turned back on at READY, with all of them frozen (daemon.collect_from_now_on).
    gc.disable()
    from poddaemon.daemon import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
