#!/usr/bin/env python3
"""Watch a directory and notify a pod of what changed (stdlib + poddaemon's `protocol` only).

    python examples/watch_and_notify.py DIR POD                       # poll every 2 s, forever
    python examples/watch_and_notify.py DIR POD --interval 0.5 --state .watch.json
    python examples/watch_and_notify.py DIR POD --once --state .watch.json   # one cycle (cron, CI)
    python examples/watch_and_notify.py DIR POD --once --since 1718000000    # changed after then

It polls modification times (no inotify, so it works on any filesystem) and sends one
notification per batch of changes, source `watch:<DIR>`, listing the files added (+),
modified (~) and removed (-). POD is a pod name or the path of its socket.

Baseline: `--state FILE` holds the last snapshot (read at start, rewritten after every notify; a
missing file counts as an empty directory, so everything present is reported as added).
`--since EPOCH` instead treats files modified after EPOCH as modified and nothing as removed.
Without either, the first scan is the baseline. With `--once`, it scans once, notifies if
anything changed, and exits 0, printing "ID<TAB>N change(s)" (the notification id) or "no changes".
Exit codes as podctl's: 2 for a usage error, 3 when the pod is not running, 1 when the notify
failed otherwise.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Run from a checkout without installing: make the repo's `protocol` package importable. Its
# dependencies (msgspec) are in the repo's venv, not in the system's python3 that the shebang
# may find: say so in one line rather than with a traceback.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    from protocol import ConnectionClosed, PodClient, PodNotRunning, RpcError
except ModuleNotFoundError as exc:
    sys.exit(
        f"{sys.argv[0]}: this Python lacks poddaemon's dependencies ({exc}): run it with the "
        "repo's venv, `.venv/bin/python examples/watch_and_notify.py ...` (or after "
        "`. .venv/bin/activate`)"
    )

Snapshot = dict[str, list[int]]  # relative path -> [mtime_ns, size]
MAX_LISTED = 50  # files named in one notification; the rest are counted


def scan(root: Path) -> Snapshot:
    """Every regular file under `root` (hidden directories skipped), with its mtime and size."""
    snap: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:  # removed while we walked
                continue
            snap[os.path.relpath(path, root)] = [st.st_mtime_ns, st.st_size]
    return snap


def diff(old: Snapshot, new: Snapshot) -> list[tuple[str, str]]:
    """[(mark, path)] with mark "+" added, "~" modified, "-" removed; sorted by path."""
    changes = [("+", p) for p in new if p not in old]
    changes += [("~", p) for p in new if p in old and old[p] != new[p]]
    changes += [("-", p) for p in old if p not in new]
    return sorted(changes, key=lambda c: (c[1], c[0]))


def since_baseline(new: Snapshot, since: float) -> Snapshot:
    """A baseline in which every file modified after `since` looks changed."""
    cutoff = int(since * 1e9)
    return {p: v if v[0] <= cutoff else [-1, -1] for p, v in new.items()}


def shown(path: str | Path) -> str:
    """A path as text the pod can take: a name that is not UTF-8 (os.fsdecode keeps its bytes
    as lone surrogates, which no JSON encoder sends) has those bytes shown as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def message(root: Path, changes: list[tuple[str, str]]) -> str:
    lines = [f"{len(changes)} file(s) changed in {shown(root)}:"]
    lines += [f"{mark} {shown(path)}" for mark, path in changes[:MAX_LISTED]]
    if len(changes) > MAX_LISTED:
        lines.append(f"... and {len(changes) - MAX_LISTED} more")
    return "\n".join(lines)


class StateError(Exception):
    """The --state file cannot be read or written: said in one line, never as a notify failure."""


def load_state(path: Path | None) -> Snapshot | None:
    if path is None:
        return None
    if not path.parent.is_dir():
        raise StateError(f"--state {path}: no directory {path.parent} to keep it in")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StateError(f"--state {path}: cannot read it: {exc}") from None
    try:
        return {str(k): [int(v[0]), int(v[1])] for k, v in data.items()}
    except (AttributeError, TypeError, ValueError, IndexError):
        raise StateError(f"--state {path}: not a state file this script wrote") from None


def save_state(path: Path | None, snap: Snapshot) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(snap, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        raise StateError(
            f"notified, but --state {path} could not be saved ({exc}): a run from that state "
            "notifies these changes again"
        ) from None


def notify(pod: str, source: str, text: str) -> str:
    with PodClient.connect(pod, timeout=30) as client:
        return client.notify(text, source=source).notification_id


def cycle(args: argparse.Namespace, root: Path, old: Snapshot) -> Snapshot:
    new = scan(root)
    changes = diff(old, new)
    if changes:
        try:
            nid = notify(args.pod, args.source or f"watch:{shown(root)}", message(root, changes))
        # ConnectionClosed: the pod went (a restart, a crash) before it answered.
        except (OSError, PodNotRunning, RpcError, ConnectionClosed) as exc:
            if args.once:
                raise
            print(f"notify failed, will retry: {exc}", file=sys.stderr, flush=True)
            return old  # report the same changes (and any new ones) next time
        print(f"{nid}\t{len(changes)} change(s)", flush=True)
        try:
            save_state(args.state, new)  # only once the pod acknowledged: nothing is lost
        except StateError as exc:
            if args.once:
                raise
            print(exc, file=sys.stderr, flush=True)  # watching on: this run knows they went
    elif args.once:
        print("no changes", flush=True)
    return new


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="directory to watch")
    ap.add_argument("pod", help="pod name or socket path")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between scans")
    ap.add_argument("--once", action="store_true", help="one scan-and-notify cycle, then exit")
    ap.add_argument("--state", type=Path, help="baseline snapshot file (read and updated)")
    ap.add_argument("--since", type=float, help="baseline: files modified after EPOCH changed")
    ap.add_argument("--source", help="notification source (default watch:<DIR>)")
    args = ap.parse_args(argv)
    root = args.dir.resolve()
    if not root.is_dir():
        ap.error(f"not a directory: {args.dir}")

    try:
        baseline = load_state(args.state)
    except StateError as exc:
        ap.error(str(exc))
    if args.since is not None:
        baseline = since_baseline(scan(root), args.since)
    if baseline is None:
        baseline = scan(root)  # watching from now on
        if args.once:
            print("no baseline (use --state or --since); nothing to compare", file=sys.stderr)
            return 2
    try:
        snap = cycle(args, root, baseline)
        while not args.once:
            time.sleep(args.interval)
            snap = cycle(args, root, snap)
    except KeyboardInterrupt:
        pass
    except StateError as exc:
        print(exc, file=sys.stderr)
        return 1
    except PodNotRunning as exc:  # as podctl says it: exit 3
        print(f"notify failed: {exc}", file=sys.stderr)
        return 3
    except (OSError, RpcError, ConnectionClosed) as exc:
        print(f"notify failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
