"""15. Spawn trees: spawn_pod to a ready child with its task acknowledged, report latency, and
the memory of a parent with 8 idle children.

- `spawn_pod`: the parent's tool call, from its assistant entry (the call is decided) to its
  tool result (the child is READY and acknowledged its task), p50 over 20 spawns; baseline:
  `podctl spawn` of the same (kept) child manifest to READY, in the same run.
- Report latency: the child's `run_end` to the parent's `inputs_delivered` entry that puts the
  report into its next model request (timestamps of the two session logs); baseline: a plain
  `notify` to an idle pod, committed to delivered (both wait the 50 ms notification burst window).
- PSS (/proc/PID/smaps_rollup) of a parent and its 8 idle children, summed, against 9 independent
  pods that each answered one run (SDK loaded in every process alike).
"""

import json
import time
from pathlib import Path
from typing import Any

from bench.harness import Home, Row, Rpc, Section, median, pct, pss_mb
from poddaemon.testing.cleanup import alive

SPAWNS = 20
REPORTS = 20
IDLE_CHILDREN = 8
TOOLS = ["read_file", "list_dir", "spawn_pod", "send_to_pod", "wait_pods", "list_pods", "stop_pod"]


def _entries(sock: str) -> list[dict[str, Any]]:
    with Rpc(sock) as c:
        return list(c.call("history", {"limit": 100000})["entries"])


def _session_entries(home: Home, pod: str) -> list[dict[str, Any]]:
    sessions = home.path / "data" / "sessions"
    for path in sorted(sessions.iterdir()):
        lines = path.read_text().splitlines()
        if lines and json.loads(lines[0]).get("pod") == pod:
            return [json.loads(line) for line in lines]
    return []


def _spawn_call(name: str, task: str, target: Path) -> dict[str, Any]:
    return {
        "name": "spawn_pod",
        "arguments": {
            "name": name,
            "task": task,
            "model": f"m-{name}",
            "scope": [{"target": str(target), "permission": "write"}],
        },
    }


def _wait(pred: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("bench: condition not reached")
        time.sleep(0.01)


def run(sec: Section) -> None:
    with Home() as home:
        fake = home.fake
        assert fake is not None
        parent = home.start_pod("parent", tools=TOOLS, extra="[spawn]\nmax_children = 20\n")
        area = home.work / "parent"
        # --- spawn_pod, one at a time (each stopped before the next) -------------------------
        script: list[dict[str, Any]] = []
        for i in range(SPAWNS):
            (area / f"c{i}").mkdir()
            fake.script_model(f"m-c{i}")
            script.append({"tool_calls": [_spawn_call(f"c{i}", "hi", area / f"c{i}")]})
            script.append({"tool_calls": [{"name": "stop_pod", "arguments": {"pod": f"c{i}"}}]})
        fake.script(*script, {"text": "done"})
        with parent.rpc(timeout=600) as c:
            c.call("run", {"input": "spawn them", "wait": True})
        entries = _entries(parent.socket)
        asked: dict[str, float] = {}
        spawn_ms: list[float] = []
        for e in entries:
            if e["kind"] == "assistant":
                for call in e["item"].get("tool_calls", []):
                    asked[call["id"]] = e["ts"]
            elif e["kind"] == "tool_result" and e["item"]["name"] == "spawn_pod":
                assert not e["item"].get("is_error"), e["item"]["output"]
                spawn_ms.append((e["ts"] - asked[e["item"]["call_id"]]) * 1e3)
        # --- 8 idle children; report latency -------------------------------------------------
        spawns = []
        for i in range(IDLE_CHILDREN):
            (area / f"i{i}").mkdir()
            fake.script_model(f"m-i{i}")
            spawns.append(_spawn_call(f"i{i}", "hi", area / f"i{i}"))
        fake.script({"tool_calls": spawns}, {"text": "spawned"})
        with parent.rpc(timeout=600) as c:
            c.call("run", {"input": "spawn 8", "wait": True})
        _wait(
            lambda: (
                sum(
                    1
                    for e in _entries(parent.socket)
                    if e.get("pod", "").startswith("i") and e["kind"] == "system_item"
                )
                >= IDLE_CHILDREN
            )
        )
        time.sleep(1.0)  # the parent's wake-up turn for those reports
        child_sock = str(home.path / "run" / "pods" / "i0" / "sock")
        report_ms: list[float] = []
        for n in range(REPORTS):
            with Rpc(child_sock) as c:
                res = c.call(
                    "run", {"input": f"again {n}", "client_key": f"spawner:b{n}", "wait": True}
                )
            run_id = res["run_id"]

            def delivered(run_id: str = run_id) -> float | None:
                entries = _entries(parent.socket)
                ids = {
                    e["id"]
                    for e in entries
                    if e["kind"] == "system_item" and e.get("run_id") == run_id
                }
                for e in entries:
                    if e["kind"] == "inputs_delivered" and ids & set(e["ids"]):
                        return float(e["ts"])
                return None

            got = _wait(delivered)
            end = next(
                e["ts"]
                for e in _session_entries(home, "i0")
                if e["kind"] == "run_end" and e["run_id"] == run_id
            )
            report_ms.append((got - end) * 1e3)
            _wait(lambda: _idle(parent.socket))
        solo = home.start_pod("solo")
        notify_ms: list[float] = []
        for n in range(REPORTS):
            with Rpc(solo.socket) as c:
                nid = c.call("notify", {"message": f"n{n}"})["notification_id"]

            def seen(nid: str = nid) -> tuple[float, float] | None:
                entries = _entries(solo.socket)
                at = next((e["ts"] for e in entries if e.get("id") == nid), None)
                for e in entries:
                    if e["kind"] == "inputs_delivered" and nid in e["ids"] and at is not None:
                        return float(at), float(e["ts"])
                return None

            a, b = _wait(seen)
            notify_ms.append((b - a) * 1e3)
            _wait(lambda: _idle(solo.socket))
        sec.add(
            Row(
                "report: child run_end to parent's request, p50",
                median(report_ms),
                "ms",
                median(notify_ms),
                "notify to request (idle pod)",
            )
        )
        sec.add(
            Row("report latency, p90", pct(report_ms, 90), "ms", pct(notify_ms, 90), "notify, p90")
        )

        # --- memory ------------------------------------------------------------------------
        with Rpc(parent.socket) as c:
            children = c.call("status")["children"]
        tree_pids = [parent.pid] + [ch["pid"] for ch in children]
        assert len(tree_pids) == IDLE_CHILDREN + 1, children
        solo_pods = [solo]
        for i in range(IDLE_CHILDREN):
            pod = home.start_pod(f"s{i}")
            solo_pods.append(pod)
        for pod in solo_pods:
            with pod.rpc(timeout=60) as c:
                c.call("run", {"input": "warm", "wait": True})
        time.sleep(1.0)
        # The fork server the children were forked from counts with the tree.
        servers = [int(f.read_text()) for f in (home.path / "run").glob("forkserver.*.lock")]
        tree_pss = sum(pss_mb(p) for p in tree_pids + servers)
        solo_pss = sum(pss_mb(p.pid) for p in solo_pods)
        sec.add(
            Row(
                "PSS: parent + 8 idle children (+ fork server), sum",
                tree_pss,
                "MB",
                solo_pss,
                "9 independent pods, sum",
            )
        )
        with Rpc(parent.socket) as c:
            c.call("shutdown")
        _wait(lambda: not any(Path(f"/proc/{p}").exists() and alive(p) for p in tree_pids), 30)
        # The baseline needs the parent's write area free: after the tree is gone.
        kept = home.path / "data" / "pods" / "c0.toml"
        podctl_ms: list[float] = []
        for _ in range(SPAWNS):
            t = time.perf_counter()
            home.podctl("spawn", str(kept))
            podctl_ms.append((time.perf_counter() - t) * 1e3)
            home.podctl("stop", "c0")
        sec.add(
            Row(
                "spawn_pod to READY + task acked, p50",
                median(spawn_ms),
                "ms",
                median(podctl_ms),
                "podctl spawn to READY (same manifest)",
            )
        )
        sec.add(
            Row("spawn_pod, p90", pct(spawn_ms, 90), "ms", pct(podctl_ms, 90), "podctl spawn, p90")
        )

        sec.note(f"{len(spawn_ms)} spawn_pod calls, {len(report_ms)} reports")


def _idle(sock: str) -> bool:
    with Rpc(sock) as c:
        st = c.call("status")
    return bool(st["state"] == "idle" and not st["queue"]["notifications"])
