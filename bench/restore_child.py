"""`python -m bench.restore_child MODE SESSIONS_DIR SESSION_ID`, timed in a fresh process.

MODE `restore`: `SessionLog.open` folding the entries (`session.fold`) as it reads and verifies
the hash chain — what a pod does to restore a session. MODE `decode`: read the file and decode
every line with msgspec, nothing else: the floor any restore has to pay. Prints JSON
`{seconds, maxrss_mb, entries}`; `maxrss_mb` is this process's peak RSS (VmHWM), interpreter
included.
"""

import gc
import json
import sys
import time


def main() -> None:
    mode, sessions_dir, session_id = sys.argv[1:4]
    import msgspec

    from poddaemon.session import fold
    from poddaemon.store.file import SessionLog, session_path

    t0 = time.perf_counter()
    if mode == "restore":
        log, state, _ = SessionLog.open(sessions_dir, session_id, fold)
        n = state.last_seq
        log.close()
    else:
        decode = msgspec.json.Decoder().decode
        gc.disable()  # the floor: no collector passes over the growing list of dicts
        with open(session_path(sessions_dir, session_id), "rb") as f:
            data = f.read()
        entries = [decode(line) for line in data.splitlines()]
        n = len(entries)
    seconds = time.perf_counter() - t0
    with open("/proc/self/status") as f:  # VmHWM: peak RSS of this exec'd image only
        peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    json.dump({"seconds": seconds, "maxrss_mb": peak, "entries": n}, sys.stdout)


if __name__ == "__main__":
    main()
