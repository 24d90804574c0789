"""Real processes racing on pods.json: one winner per contested area, no torn reads.

The workers are spawned, so each re-imports this module: it deliberately imports neither pytest
nor hypothesis, which would triple every worker's start-up on a small machine.
"""

import multiprocessing as mp
import os
import shutil
import tempfile
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import msgspec

from poddaemon.registry import Registry, RegistryConflict, make_entry
from poddaemon.scope import Scope

N = 6
WAIT = 60.0  # generous bound on barrier/event waits; nothing here sleeps

ctx = mp.get_context("spawn")


def racer(
    runtime: str,
    name: str,
    target: str,
    start: Barrier,
    results: "Queue[tuple[str, str]]",
    done: Event,
) -> None:
    """Register `name` with write on `target` the moment everyone is ready; stay alive (so the
    claim stays live) until the test says done."""
    reg = Registry(Path(runtime))
    entry = make_entry(name, f"{runtime}/pods/{name}/sock", scope_for(target))
    start.wait(WAIT)
    try:
        reg.register(entry)
    except RegistryConflict as e:
        results.put((name, f"conflict: {e}"))
        return
    except Exception as e:
        results.put((name, f"error: {type(e).__name__}: {e}"))
        return
    # Churn: more transactions while others read and register.
    for i in range(5):
        reg.update(name, entry.pid, session=f"s{i}")
    results.put((name, "won"))
    done.wait(WAIT)
    reg.release(name, entry.pid)


def reader(runtime: str, stop: Event, results: "Queue[tuple[str, str]]") -> None:
    """Parse pods.json as fast as possible; any torn read is reported."""
    path = Path(runtime) / "pods.json"
    reads = torn = 0
    while not stop.is_set():
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        reads += 1
        try:
            msgspec.json.decode(data)
        except msgspec.DecodeError:
            torn += 1
        os.sched_yield()  # leave the CPU to the racers on small machines
    results.put(("reader", f"{reads} {torn}"))


def scope_for(target: str) -> Scope:
    return Scope.from_config([(target, "write", True)], cwd="/")


def run_round(runtime: str, targets: dict[str, str]) -> tuple[dict[str, str], Any]:
    """Start one racer per target behind a barrier, plus a reader; return outcomes and a
    function that lets the winners exit."""
    start = ctx.Barrier(len(targets))
    done = ctx.Event()
    results: Queue[tuple[str, str]] = ctx.Queue()
    procs = [
        ctx.Process(target=racer, args=(runtime, name, target, start, results, done))
        for name, target in targets.items()
    ]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=WAIT) for _ in procs)

    def finish() -> None:
        done.set()
        for p in procs:
            p.join(WAIT)
            assert p.exitcode == 0

    return outcomes, finish


def test_overlapping_claims_one_winner_then_disjoint_all_win() -> None:
    home = tempfile.mkdtemp(dir="/tmp", prefix="race-")
    try:
        check_races(home + "/run")
    finally:
        shutil.rmtree(home, ignore_errors=True)


def check_races(runtime: str) -> None:
    Path(runtime).mkdir(parents=True)
    stop = ctx.Event()
    reads: Queue[tuple[str, str]] = ctx.Queue()
    watcher = ctx.Process(target=reader, args=(runtime, stop, reads))
    watcher.start()
    finishers = []
    try:
        # Nested targets: every pair overlaps, so exactly one may hold write.
        nested = {f"n{i}": "/race/area" + "/d" * (i % 3) for i in range(N)}
        outcomes, finish = run_round(runtime, nested)
        finishers.append(finish)
        winners = [n for n, o in outcomes.items() if o == "won"]
        assert len(winners) == 1, outcomes
        for name, outcome in outcomes.items():
            if name not in winners:
                assert outcome.startswith(f"conflict: scope conflict: pod '{winners[0]}'"), outcome
        reg = Registry(Path(runtime))
        assert [e.name for e in reg.live()] == winners

        # Disjoint targets (beside the winner's area): all of them win at once.
        disjoint = {f"d{i}": f"/race/other{i}" for i in range(N)}
        outcomes, finish = run_round(runtime, disjoint)
        finishers.append(finish)
        assert set(outcomes.values()) == {"won"}, outcomes
        assert {e.name for e in reg.live()} == {*winners, *disjoint}
    finally:
        for finish in finishers:
            finish()
        stop.set()
        watcher.join(WAIT)
    count, torn = map(int, reads.get(timeout=WAIT)[1].split())
    assert torn == 0 and count > 0
    assert Registry(Path(runtime)).live() == []  # every winner released its claim
