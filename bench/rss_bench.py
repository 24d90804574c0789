"""6. The pod's RSS after 20 and after 100 runs, with the SDK loaded."""

from bench.harness import Home, Row, Section, ratio_le, value_le, vm_rss_mb


def run(sec: Section) -> None:
    with Home() as home:
        pod = home.start_pod("rss")
        idle = vm_rss_mb(pod.pid)
        rss: dict[int, float] = {}
        with pod.rpc() as c:
            for i in range(1, 101):
                c.call("run", {"input": f"run number {i}: say something", "wait": True})
                if i in (1, 20, 100):
                    rss[i] = vm_rss_mb(pod.pid)
    sec.add(Row("VmRSS after 1 run (SDK loaded)", rss[1], "MB", idle, "idle, before any run"))
    sec.add(
        Row("VmRSS after 20 runs", rss[20], "MB", idle, "idle, before any run", value_le(75, "MB"))
    )
    sec.add(Row("VmRSS after 100 runs", rss[100], "MB", rss[20], "after 20 runs", ratio_le(1.10)))
    sec.note(
        "text runs (run wait=True) against the fake model answering `ok: <input>`, one "
        "after another on one connection"
    )
