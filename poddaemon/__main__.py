"""`python -m poddaemon` and the `poddaemon` command (pyproject.toml's script points here)."""

import sys


def main() -> int:
    from poddaemon import collector

    collector.pause()  # until READY: start-up builds what the pod keeps (poddaemon/collector.py)
    from poddaemon.daemon import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
