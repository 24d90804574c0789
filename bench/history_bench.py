"""18. A warm text turn's cost against history length: 20 turns vs 1,000 turns.

The target: the pod's cost of a turn stays flat as the history grows (the history is rendered
incrementally, not re-rendered whole per model call). Measured as the pod's CPU time per turn
(all its threads, exact: schedstat), from sending `run` wait=True until the turn's last entry is
synced, so the model's time and scheduling noise stay out. It still includes what a longer
history costs by necessity: writing a request body of ~95 KB instead of ~2 KB.

Not "pod − the plain SDK's post() of the same body" (the agent section's own time): on a 95 KB
body the SDK alone spends more CPU than the whole pod, so that difference reads negative. Two
pods, one with 20 turns of history and one with 1,000, take turns (noise on this shared machine
hits both alike).
"""

import time

import msgspec

from bench.agent_bench import Sdk
from bench.harness import Home, Pod, Row, Rpc, Section, median, ratio_le, thread_cpu_ns

SHORT, LONG = 20, 1000  # turns of history before measuring
MEASURED = 20  # text turns measured on each pod
RETRIES = 7  # keyed `podctl send` retries timed on each pod


def _fill(c: Rpc, home: Home, upto: int) -> None:
    assert home.fake is not None
    for done in range(1, upto + 1):
        c.call("run", {"input": f"filler {done}", "wait": True})
        if done % 50 == 0:
            home.fake.reset()  # the fake keeps every body; 1,000 long bodies add up
    home.fake.reset()


def _turn(pod: Pod, c: Rpc, home: Home, sdk: Sdk, i: int) -> tuple[float, float, float, int]:
    """One text turn: the pod's wall time and CPU time (ms), the plain SDK's CPU time sending
    the same body (ms), and the body's size. The pod's CPU is read again only after the SDK's
    replay, by when its end-of-run fsync is long done."""
    fake = home.fake
    assert fake is not None
    fake.reset()
    cpu = thread_cpu_ns(pod.pid)
    t = time.perf_counter()
    c.call("run", {"input": f"say hi {i}", "wait": True})
    wall = time.perf_counter() - t
    bodies = [r["body"] for r in fake.requests()]
    fake.reset()
    sdk_cpu = thread_cpu_ns(sdk.proc.pid)
    sdk.replay(bodies)
    sdk_cpu = thread_cpu_ns(sdk.proc.pid) - sdk_cpu
    cpu = thread_cpu_ns(pod.pid) - cpu
    return wall * 1e3, cpu / 1e6, sdk_cpu / 1e6, len(msgspec.json.encode(bodies[-1]))


def _keyed_retries(home: Home, pods: dict[str, Pod]) -> dict[str, tuple[float, int]]:
    """`podctl send --client-key K POD msg` again after its run ended, answered from the log:
    median wall ms per pod (the pods take turns), and the pod's log length in entries. podctl
    reads the log from its end back to the run's start, so a long log should cost nothing."""
    for name in pods:
        home.podctl("send", "--client-key", "bench", name, "keyed")
    times: dict[str, list[float]] = {name: [] for name in pods}
    for _ in range(RETRIES):
        for name in pods:
            t0 = time.perf_counter()
            home.podctl("send", "--client-key", "bench", name, "keyed")
            times[name].append((time.perf_counter() - t0) * 1e3)
    result = {}
    for name, pod in pods.items():
        with pod.rpc() as c:
            entries = int(c.call("history", {"since": 0, "limit": 1})["last_seq"])
        result[name] = (median(times[name]), entries)
    return result


def run(sec: Section) -> None:
    short: list[tuple[float, float, float, int]] = []
    long: list[tuple[float, float, float, int]] = []
    with Home() as home:
        assert home.fake is not None
        sdk = Sdk(home, home.fake)
        try:
            a = home.start_pod("short", tools=[])
            b = home.start_pod("long", tools=[])
            with a.rpc() as ca, b.rpc() as cb:
                _fill(ca, home, SHORT)
                _fill(cb, home, LONG)
                _turn(a, ca, home, sdk, -1)  # warm the SDK side's connection
                for i in range(MEASURED):
                    short.append(_turn(a, ca, home, sdk, i))
                    long.append(_turn(b, cb, home, sdk, i))
            retried = _keyed_retries(home, {"short": a, "long": b})
        finally:
            sdk.close()

    def col(rows: list[tuple[float, float, float, int]], k: int) -> float:
        return median([r[k] for r in rows])

    sec.add(Row(f"warm text turn, pod CPU, {SHORT} turns", col(short, 1), "ms"))
    sec.add(
        Row(
            f"warm text turn, pod CPU, {LONG} turns",
            col(long, 1),
            "ms",
            col(short, 1),
            f"pod at {SHORT} turns",
            target=ratio_le(1.2),
        )
    )
    sec.add(Row(f"warm text turn, run wait=True, {SHORT} turns", col(short, 0), "ms"))
    sec.add(
        Row(
            f"warm text turn, run wait=True, {LONG} turns",
            col(long, 0),
            "ms",
            col(short, 0),
            f"pod at {SHORT} turns",
        )
    )
    (short_ms, short_entries), (long_ms, long_entries) = retried["short"], retried["long"]
    sec.add(
        Row(
            f"podctl send --client-key, a retry answered from the log, {long_entries:,} entries",
            long_ms,
            "ms",
            short_ms,
            f"the same at {short_entries:,} entries",
        )
    )
    sec.note(
        f"pod CPU: all the pod's threads, from sending run wait=True until its run is synced; "
        f"request body {short[-1][3]:,} B at {SHORT} turns, {long[-1][3]:,} B at {LONG}; the "
        f"plain SDK's post() of the same body alone takes {col(short, 2):.2f} / "
        f"{col(long, 2):.2f} ms of CPU; two pods take turns, medians of {MEASURED} turns each; "
        f"openai kind, no tools"
    )
