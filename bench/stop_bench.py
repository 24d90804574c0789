"""9. Stop: from `shutdown` to the registry entry gone, and to the process gone.

A pod stopped right after its first run started is still importing the model SDK in a thread;
the name and scope must be free at once all the same (`podctl stop p; podctl spawn m.toml`).
Baseline: the same pod stopped while idle, before any run (nothing in flight).
"""

import json
import time
from pathlib import Path

from bench.harness import Home, Pod, Row, Section, median, value_le

STOPS = 5


def _registered(path: Path, name: str) -> bool:
    try:
        return name in json.loads(path.read_text())["pods"]
    except (FileNotFoundError, ValueError, KeyError):
        return False


def _stop(home: Home, name: str, run_first: bool) -> tuple[float, float]:
    """ms from sending `shutdown` to the registry without `name`, and to the process exit."""
    pod: Pod = home.start_pod(name)
    registry = home.path / "run" / "pods.json"
    with pod.rpc() as c:
        if run_first:
            c.call("run", {"input": "hello"})
            while c.call("status")["state"] != "running":  # the SDK import starts now
                time.sleep(0.0005)
        t0 = time.perf_counter()
        c.call("shutdown")
    while _registered(registry, name):
        time.sleep(0.0005)
    free = time.perf_counter() - t0
    while pod.proc.poll() is None:
        time.sleep(0.0005)
    gone = time.perf_counter() - t0
    return free * 1e3, gone * 1e3


def run(sec: Section) -> None:
    with Home() as home:
        idle: list[tuple[float, float]] = []
        busy: list[tuple[float, float]] = []
        for i in range(STOPS):  # interleaved: load on the machine hits both alike
            idle.append(_stop(home, f"idle{i}", run_first=False))
            busy.append(_stop(home, f"busy{i}", run_first=True))
        base_free = median([x[0] for x in idle])
        base_gone = median([x[1] for x in idle])
        sec.add(
            Row(
                "stop right after a run started: registry free, median",
                median([x[0] for x in busy]),
                "ms",
                base_free,
                "same, stopped idle",
                value_le(100, "ms"),
            )
        )
        sec.add(
            Row(
                "stop right after a run started: process gone, median",
                median([x[1] for x in busy]),
                "ms",
                base_gone,
                "same, stopped idle",
            )
        )
        sec.note(
            "busy free/gone ms: "
            + ", ".join(f"{f:.0f}/{g:.0f}" for f, g in busy)
            + "; idle: "
            + ", ".join(f"{f:.0f}/{g:.0f}" for f, g in idle)
        )
