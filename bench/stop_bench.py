"""11. Stop: from `shutdown` to the registry entry gone, and to the process gone.

A pod stopped right after its first run started is still importing the model SDK in a thread;
the name and scope must be free at once all the same (`podctl stop p; podctl spawn m.toml`).
Baseline: the same pod stopped while idle, right after READY, before any run.

A pod that has made a model call holds the whole SDK; CPython tearing its modules down at exit
once cost 528 ms with anthropic. Baseline: a bare interpreter that imported the same SDK and
built its client, exiting normally (`sys.exit`) when told to on a pipe: what that teardown costs.
Target (the issue's): shutdown to exit ≤ 50 ms.
"""

import json
import subprocess
import time
from pathlib import Path

from bench.first_turn_bench import manifest_for, wait_warm
from bench.harness import PY, ROOT, Home, Pod, Row, Section, median, value_le

STOPS = 5
KINDS = ("openai", "anthropic")

# Imports the SDK, builds its client, says READY, exits normally at the first line on stdin.
_BARE_EXIT = """
import sys
if sys.argv[1] == "anthropic":
    import anthropic
    anthropic.AsyncAnthropic(api_key="x", base_url="http://127.0.0.1:1", max_retries=0)
else:
    import openai
    openai.AsyncOpenAI(api_key="x", base_url="http://127.0.0.1:1/v1", max_retries=0)
print("READY", flush=True)
sys.stdin.readline()
sys.exit(0)
"""


def _registered(path: Path, name: str) -> bool:
    try:
        return name in json.loads(path.read_text())["pods"]
    except (FileNotFoundError, ValueError, KeyError):
        return False


def _stop(
    home: Home, name: str, run_first: bool, kind: str = "openai", called: bool = False
) -> tuple[float, float]:
    """ms from sending `shutdown` to the registry without `name`, and to the process exit.
    `run_first`: a run has just started; `called`: the pod has answered one run (SDK loaded)."""
    pod: Pod = home.start_pod(name, manifest=manifest_for(home, name, kind))
    registry = home.path / "run" / "pods.json"
    with pod.rpc() as c:
        if run_first:
            c.call("run", {"input": "hello"})
            while c.call("status")["state"] != "running":  # the SDK import starts now
                time.sleep(0.0005)
        if called:
            c.call("run", {"input": "hello", "wait": True})
            wait_warm(pod)  # nothing left in flight
        t0 = time.perf_counter()
        c.call("shutdown")
    while _registered(registry, name):
        time.sleep(0.0005)
    free = time.perf_counter() - t0
    while pod.proc.poll() is None:
        time.sleep(0.0005)
    gone = time.perf_counter() - t0
    return free * 1e3, gone * 1e3


def _bare_exit(home: Home, kind: str) -> float:
    """ms from telling a bare interpreter holding the SDK to exit to its process gone."""
    proc = subprocess.Popen(
        [PY, "-c", _BARE_EXIT, kind],
        cwd=ROOT,
        env=home.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline().strip() != "READY":
        raise RuntimeError("bare SDK process did not start")
    t0 = time.perf_counter()
    proc.stdin.write("\n")
    proc.stdin.flush()
    while proc.poll() is None:
        time.sleep(0.0005)
    return (time.perf_counter() - t0) * 1e3


def run(sec: Section) -> None:
    with Home() as home:
        idle: list[tuple[float, float]] = []
        busy: list[tuple[float, float]] = []
        called: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
        bare: dict[str, list[float]] = {k: [] for k in KINDS}
        for i in range(STOPS):  # interleaved: load on the machine hits every case alike
            idle.append(_stop(home, f"idle{i}", run_first=False))
            busy.append(_stop(home, f"busy{i}", run_first=True))
            for kind in KINDS:
                called[kind].append(_stop(home, f"{kind[:4]}{i}", False, kind, called=True))
                bare[kind].append(_bare_exit(home, kind))
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
                value_le(50, "ms"),
            )
        )
        for kind in KINDS:
            sec.add(
                Row(
                    f"stop a pod after one {kind} call: process gone, median",
                    median([x[1] for x in called[kind]]),
                    "ms",
                    median(bare[kind]),
                    f"bare {kind} process: sys.exit",
                    value_le(50, "ms"),
                )
            )
        sec.note(
            "busy free/gone ms: "
            + ", ".join(f"{f:.0f}/{g:.0f}" for f, g in busy)
            + "; idle: "
            + ", ".join(f"{f:.0f}/{g:.0f}" for f, g in idle)
        )
        for kind in KINDS:
            sec.note(
                f"after one {kind} call free/gone ms: "
                + ", ".join(f"{f:.0f}/{g:.0f}" for f, g in called[kind])
                + f"; bare {kind} sys.exit ms: "
                + ", ".join(f"{b:.0f}" for b in bare[kind])
            )
