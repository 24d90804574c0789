"""18. A warm text turn's own cost against history length: 20 turns vs 1,000 turns.

The pod's own time of a turn is the pod's `run` wait=True minus the plain SDK sending the very
body the pod sent (so the bytes both sides move, and the server's parsing, cancel out). Two pods,
one with 20 turns of history and one with 1,000, take turns (noise on this shared machine hits
both alike); the target is that the own time stays flat (the history is rendered incrementally,
not re-rendered whole per model call).
"""

import time

from bench.agent_bench import Sdk
from bench.harness import Home, Row, Rpc, Section, median, ratio_le

SHORT, LONG = 20, 1000  # turns of history before measuring
MEASURED = 20  # text turns measured on each pod


def _fill(c: Rpc, home: Home, upto: int) -> None:
    assert home.fake is not None
    for done in range(1, upto + 1):
        c.call("run", {"input": f"filler {done}", "wait": True})
        if done % 50 == 0:
            home.fake.reset()  # the fake keeps every body; 1,000 long bodies add up
    home.fake.reset()


def _own_time(c: Rpc, home: Home, sdk: Sdk, i: int) -> float:
    fake = home.fake
    assert fake is not None
    fake.reset()
    t = time.perf_counter()
    c.call("run", {"input": f"say hi {i}", "wait": True})
    pod = time.perf_counter() - t
    bodies = [r["body"] for r in fake.requests()]
    fake.reset()
    return (pod - sum(sdk.replay(bodies))) * 1e3


def run(sec: Section) -> None:
    short: list[float] = []
    long: list[float] = []
    with Home() as home:
        assert home.fake is not None
        sdk = Sdk(home, home.fake)
        try:
            a = home.start_pod("short", tools=[])
            b = home.start_pod("long", tools=[])
            with a.rpc() as ca, b.rpc() as cb:
                _fill(ca, home, SHORT)
                _fill(cb, home, LONG)
                _own_time(ca, home, sdk, -1)  # warm the SDK side's connection
                for i in range(MEASURED):
                    short.append(_own_time(ca, home, sdk, i))
                    long.append(_own_time(cb, home, sdk, i))
        finally:
            sdk.close()
    s, lg = median(short), median(long)
    sec.add(Row(f"warm text turn, pod's own time, {SHORT} turns", s, "ms"))
    sec.add(
        Row(
            f"warm text turn, pod's own time, {LONG} turns",
            lg,
            "ms",
            s,
            f"pod at {SHORT} turns",
            target=ratio_le(1.2),
        )
    )
    sec.note(
        f"own time = run wait=True − the plain SDK's post() of the same body; two pods "
        f"({SHORT} and {LONG} turns of history) take turns, medians of {MEASURED} turns each; "
        f"openai kind, no tools"
    )
