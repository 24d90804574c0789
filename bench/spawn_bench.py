"""3. Spawn: `podctl spawn manifest` until READY (through the fork server), `poddaemon run` until
READY (exec'd, as systemd starts a pod), and the idle forked pod's PSS."""

import subprocess
import time
from pathlib import Path

from bench.cli_bench import NOOP_APP
from bench.harness import PY, Home, Row, Rpc, Section, median, pss_mb, value_le

SPAWNS = 11  # medians of 11: with 5, one slow start (host noise) moved the row by ~15 ms

# The floor under `poddaemon run`: import what a pod must have loaded before it can claim its
# scope and listen (the design card's uvloop, msgspec and filelock, and tomllib for the manifest),
# listen on a Unix socket, say READY. No pod can reach READY sooner with these packages.
READY_FLOOR = """
import asyncio, sys, uvloop, msgspec, filelock, tomllib
async def main():
    await asyncio.start_unix_server(lambda r, w: None, sys.argv[1])
    print("READY", file=sys.stderr, flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


def _python_pass(env: dict[str, str]) -> tuple[float, float]:
    """Wall ms of `python -c pass`, and the VmRSS (MB) of a bare interpreter reading its own
    /proc status (ru_maxrss is no good here: a forked child's counts the parent's pages)."""
    t = time.perf_counter()
    subprocess.run([PY, "-c", "pass"], env=env, check=True)
    ms = (time.perf_counter() - t) * 1e3
    out = subprocess.run(
        [PY, "-c", "print(open('/proc/self/status').read())"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rss = next(int(x.split()[1]) for x in out.splitlines() if x.startswith("VmRSS:"))
    return ms, rss / 1024


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):  # reaped, between any two reads
            return
        time.sleep(0.005)


def _floor_ready(home: Home) -> float:
    """Wall ms from exec to READY of the READY_FLOOR program."""
    sock = home.path / "floor.sock"
    sock.unlink(missing_ok=True)
    t = time.perf_counter()
    proc = subprocess.Popen(
        [PY, "-c", READY_FLOOR, str(sock)], env=home.env, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    ms = (time.perf_counter() - t) * 1e3
    proc.kill()
    proc.communicate()
    if line.strip() != "READY":
        raise RuntimeError(f"the READY floor did not start: {line!r}")
    return ms


def _settle_server(home: Home, timeout: float = 30.0) -> None:
    """Wait until the fork server is idle: its CPU time stops growing (preloading done)."""
    (lock,) = (home.path / "run").glob("forkserver.*.lock")
    stat = f"/proc/{int(lock.read_text())}/stat"
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        with open(stat) as f:
            ticks = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
        if ticks == last:
            return
        last = ticks
        time.sleep(0.2)


def _spawn(home: Home, manifest: Path) -> tuple[float, float]:
    """`podctl spawn` to READY (ms) and the pod's PSS once idle (MB); then shut it down."""
    t = time.perf_counter()
    home.podctl("spawn", str(manifest))
    ms = (time.perf_counter() - t) * 1e3
    pid = home.pod_pid(manifest.stem)
    time.sleep(0.3)  # let it settle into idle (its SDK warm-up)
    pss = pss_mb(pid)
    with Rpc(str(home.path / "run" / "pods" / manifest.stem / "sock")) as c:
        c.call("shutdown")
    _wait_gone(pid)
    return ms, pss


def run(sec: Section) -> None:
    with Home() as home:
        manifest = home.manifest("spawned")
        _python_pass(home.env)
        base = [_python_pass(home.env) for _ in range(11)]
        alone = [_spawn(home, manifest)[0] for _ in range(SPAWNS)]  # exec'd: no pod runs
        companion = home.start_pod("companion")  # from now on pods are forked by the server
        noop_app = home.path / "noop_app.py"
        noop_app.write_text(NOOP_APP)
        walls: list[float] = []  # the first starts the fork server
        pss: list[float] = []
        noop: list[float] = []  # podctl's floor, alternated with the spawns
        for i in range(SPAWNS + 1):
            if i == 1:
                _settle_server(home)  # let it load the SDK the first pod asked for
            t = time.perf_counter()
            subprocess.run([PY, str(noop_app), "x"], env=home.env, check=True)
            noop.append((time.perf_counter() - t) * 1e3)
            ms, mb = _spawn(home, manifest)
            walls.append(ms)
            pss.append(mb)
        companion.kill()
        base_ms = median([b[0] for b in base])
        sec.add(
            Row(
                "podctl spawn to READY, fork server running",
                median(walls[1:]),
                "ms",
                base_ms,
                "python -c pass",
                value_le(100, "ms"),
            )
        )
        sec.add(
            Row(
                "podctl spawn to READY, fork server running, against typer",
                median(walls[1:]),
                "ms",
                median(noop[1:]),
                "no-op typer app",
            )
        )
        sec.add(
            Row(
                "podctl spawn to READY, first forked (starts the server)",
                walls[0],
                "ms",
                base_ms,
                "python -c pass",
            )
        )
        sec.add(
            Row(
                "podctl spawn to READY, alone (exec'd)",
                median(alone),
                "ms",
                base_ms,
                "python -c pass",
            )
        )
        ready: list[float] = []
        floor: list[float] = []
        for i in range(SPAWNS + 1):  # alternated with the floor: both see the same host
            floor_ms = _floor_ready(home)
            t = time.perf_counter()
            pod = home.start_pod("direct")  # as a unit's ExecStart= runs it
            ms = (time.perf_counter() - t) * 1e3
            if i:  # the first start writes the manifest's directories and byte-code
                ready.append(ms)
                floor.append(floor_ms)
            with pod.rpc() as c:
                c.call("shutdown")
            pod.proc.wait(10)
        sec.add(
            Row(
                "poddaemon run to READY, median",
                median(ready),
                "ms",
                median([b[0] for b in base]),
                "python -c pass",
                value_le(100, "ms"),
            )
        )
        sec.add(
            Row(
                "READY floor: import uvloop, msgspec, filelock, tomllib; listen",
                median(floor),
                "ms",
                median([b[0] for b in base]),
                "python -c pass",
            )
        )
        sec.add(
            Row(
                "poddaemon run to READY, against that floor",
                median(ready),
                "ms",
                median(floor),
                "the READY floor",
            )
        )
        sec.add(
            Row(
                "idle forked pod PSS (after its SDK warm-up), median",
                median(pss[1:]),
                "MB",
                median([b[1] for b in base]),
                "bare python VmRSS",
            )
        )
        sec.note(
            f"{SPAWNS + 1} spawns of one manifest (each shut down before the next); "
            f"spawn walls {', '.join(f'{w:.0f}' for w in walls)} ms; "
            f"the no-op typer app (podctl's floor) {', '.join(f'{w:.0f}' for w in noop)} ms; "
            f"poddaemon run to READY {', '.join(f'{w:.0f}' for w in ready)} ms; "
            f"the READY floor {', '.join(f'{w:.0f}' for w in floor)} ms"
        )
