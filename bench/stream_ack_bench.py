"""13. Acknowledgements while the pod streams a long model reply, against the same pod idle.

The model's stream is parsed by the SDK on the pod's model thread (llm/threaded.py), so an ack
should not queue behind stream parsing. Target: `notify` and `run` ack p50/p99 while streaming
≤ 1.5× the same ack on an idle pod, measured in the same run."""

from bench.harness import (
    Home,
    LoadResult,
    Row,
    Section,
    load,
    median_pair,
    ratio_le,
    ratio_spread,
    request_line,
)

DURATION = 1.0
FLAT_OUT = "the quick brown fox jumps over the lazy dog. " * 60_000  # ~2.7 MB in 20-char chunks
PACED = "the quick brown fox jumps over the lazy dog. " * 1_500  # 3,400 deltas, 2 ms apart
# Two streams: 500 deltas/s (10,000 characters/s, some 20x what a fast model streams) with the
# target, and the fake model flat out (a stress row: the model thread then competes for both
# cores with the fake server, the client and the pod's loop).
STREAMS = (("at 500 deltas/s", {"text": PACED, "delay": 0.002}), ("flat out", {"text": FLAT_OUT}))
# The target rows alternate (idle, busy) measurements: a p99 of one second moves with the
# disk's fsync times, which drift within seconds here, so one measurement of each side is a
# coin toss near the target. The row is the pair with the median ratio.
PAIRS = 3


def _ack(sock: str, line: bytes) -> LoadResult:
    return load(sock, line, clients=1, duration=DURATION, warmup=20)


def run(sec: Section) -> None:
    spreads = []
    with Home() as home:
        fake = home.fake
        assert fake is not None
        # Every ack queues a notification or a run behind the blocked one: thousands of each,
        # past both queues' default bounds.
        extra = "[notify]\nmax_pending = 1000000\n"
        unbound = ("--set", "worker.max_queued_runs=1000000")
        for method, params in (
            ("notify", {"message": "CI: build 481 failed", "source": "ci"}),
            ("run", {"input": "queued behind the stream"}),
        ):
            line = request_line(method, params)
            # Idle: the first model call waits on a gate never opened, so acks meet a pod that
            # is doing nothing else; it stays so while busy pods come and go beside it. Busy: a
            # pod streams a long reply meanwhile (each pair's own pod, killed after its load).
            asked = len(fake.requests())
            block = f"block ({method})"
            fake.script({"gate": "never", "text": "x"}, when=block)
            idle = home.start_pod(f"idle{method}", *unbound, extra=extra)
            with idle.rpc() as c:
                c.call("run", {"input": block})
            asked = len(fake.wait_requests(asked + 1))

            for what, reply in STREAMS:
                paced = what.startswith("at")
                results: list[tuple[LoadResult, LoadResult]] = []
                ended = False
                for i in range(PAIRS if paced else 1):
                    quiet = _ack(idle.socket, line)
                    stream = f"stream a long answer ({method}, {what}, {i})"
                    fake.script(reply, when=stream)
                    pod = home.start_pod(f"busy{method}", *unbound, extra=extra)
                    with pod.rpc() as c:
                        c.call("run", {"input": stream})
                    asked = len(fake.wait_requests(asked + 1))
                    busy = _ack(pod.socket, line)
                    with pod.rpc() as c:
                        ended |= c.call("status")["state"] != "running"
                    pod.kill()
                    results.append((busy, quiet))
                tag = " (stream ended during the load!)" if ended else ""
                for q in ("p50", "p99"):
                    pairs = [(getattr(b, q), getattr(d, q)) for b, d in results]
                    busy_q, idle_q = median_pair(pairs)
                    metric = f"{method} ack {q} while streaming {what}{tag}"
                    target = ratio_le(1.5) if paced else None
                    sec.add(Row(metric, busy_q, "µs", idle_q, "idle pod", target=target))
                    if paced:
                        spreads.append(f"{method} {q} {ratio_spread(pairs)}x")
            idle.kill()
    sec.note(
        "one client, own connection, not pipelined, 1 s per measurement; busy: the fake model "
        "streams 20-character deltas (OpenAI chat format) during the load, paced or flat out; "
        "idle: a pod that waits on a model call that never answers; the paced rows are the "
        f"median of {PAIRS} alternated (idle, busy) pairs, whose ratios ranged "
        + ", ".join(spreads)
    )
