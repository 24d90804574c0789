"""6. The pod's RSS after 20 and after 100 runs, with the SDK loaded; PSS of one pod after 20
runs and of ten idle pods after one run each: started by `podctl spawn` (forked by the fork
server, which counts in the sum) and, as the reference, each exec'd on its own."""

import time
from pathlib import Path

from bench.harness import Home, Row, Rpc, Section, pss_mb, ratio_le, value_le, vm_rss_mb

PODS = 10


def run(sec: Section) -> None:
    with Home() as home:
        pod = home.start_pod("rss")
        idle = vm_rss_mb(pod.pid)
        rss: dict[int, float] = {}
        pss20 = 0.0
        with pod.rpc() as c:
            for i in range(1, 101):
                c.call("run", {"input": f"run number {i}: say something", "wait": True})
                if i in (1, 20, 100):
                    rss[i] = vm_rss_mb(pod.pid)
                if i == 20:
                    pss20 = pss_mb(pod.pid)
        pod.kill()
        pods = [home.start_pod(f"many{i}") for i in range(PODS)]
        for p in pods:
            with p.rpc() as c:
                c.call("run", {"input": "say something", "wait": True})
        time.sleep(0.3)  # idle: the runs' leftovers settle
        execd = sum(pss_mb(p.pid) for p in pods)
        for p in pods:
            p.kill()
    with Home() as home:  # a clean one: the first pod spawned is alone, hence exec'd
        forked, server = _spawned(home)
        one = pss_mb(home.pod_pid("spawned2"))
    sec.add(Row("VmRSS after 1 run (SDK loaded)", rss[1], "MB", idle, "idle, before any run"))
    sec.add(
        Row("VmRSS after 20 runs", rss[20], "MB", idle, "idle, before any run", value_le(75, "MB"))
    )
    sec.add(Row("VmRSS after 100 runs", rss[100], "MB", rss[20], "after 20 runs", ratio_le(1.10)))
    sec.add(Row("PSS of one pod after 20 runs", pss20, "MB", target=value_le(45, "MB")))
    sec.add(
        Row(
            f"PSS of {PODS} idle pods after one run each + fork server",
            forked + server,
            "MB",
            execd,
            "same, each pod exec'd",
            value_le(300, "MB"),
        )
    )
    sec.add(Row("  of which the fork server", server, "MB"))
    sec.add(Row("  a forked pod (the third)", one, "MB", execd / PODS, "an exec'd pod"))
    sec.note(
        "text runs (run wait=True) against the fake model answering `ok: <input>`, one "
        f"after another on one connection; then {PODS} pods side by side, one run each, "
        "exec'd (`poddaemon run`), then started by `podctl spawn` one after another "
        "(the first, alone, is exec'd; the second starts the fork server)"
    )


def _spawned(home: Home) -> tuple[float, float]:
    """PSS sum of PODS pods started by `podctl spawn`, after one run each; and the server's."""
    for i in range(PODS):
        home.podctl("spawn", str(home.manifest(f"spawned{i}")))
    for i in range(PODS):
        with Rpc(str(home.path / "run" / "pods" / f"spawned{i}" / "sock")) as c:
            c.call("run", {"input": "say something", "wait": True})
    time.sleep(0.3)  # idle: the runs' leftovers settle
    total = sum(pss_mb(home.pod_pid(f"spawned{i}")) for i in range(PODS))
    (lock,) = Path(home.path / "run").glob("forkserver.*.lock")
    return total, pss_mb(int(lock.read_text()))
