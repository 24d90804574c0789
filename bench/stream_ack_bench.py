"""13. Acknowledgements while the pod streams a long model reply, against the same pod idle.

The model's stream is parsed by the SDK on the pod's model thread (llm/threaded.py), so an ack
should not queue behind stream parsing. Target: `notify` and `run` ack p50/p99 while streaming
≤ 1.5× the same ack on an idle pod, measured in the same run."""

from bench.harness import Home, Row, Section, load, ratio_le, request_line

DURATION = 1.0
FLAT_OUT = "the quick brown fox jumps over the lazy dog. " * 60_000  # ~2.7 MB in 20-char chunks
PACED = "the quick brown fox jumps over the lazy dog. " * 1_500  # 3,400 deltas, 2 ms apart
# Two streams: 500 deltas/s (10,000 characters/s, some 20x what a fast model streams) with the
# target, and the fake model flat out (a stress row: the model thread then competes for both
# cores with the fake server, the client and the pod's loop).
STREAMS = (("at 500 deltas/s", {"text": PACED, "delay": 0.002}), ("flat out", {"text": FLAT_OUT}))


def _ack(sock: str, line: bytes) -> tuple[float, float]:
    res = load(sock, line, clients=1, duration=DURATION, warmup=20)
    return res.p50, res.p99


def run(sec: Section) -> None:
    with Home() as home:
        fake = home.fake
        assert fake is not None
        extra = "[notify]\nmax_pending = 1000000\n"
        for method, params in (
            ("notify", {"message": "CI: build 481 failed", "source": "ci"}),
            ("run", {"input": "queued behind the stream"}),
        ):
            fake.reset()
            # Idle: the first model call waits on a gate never opened, so acks meet a pod that
            # is doing nothing else. Busy: the same pod streams a long reply meanwhile.
            fake.script({"gate": "never", "text": "x"})
            pod = home.start_pod(f"idle{method}", extra=extra)
            with pod.rpc() as c:
                c.call("run", {"input": "block"})
            fake.wait_requests(1)
            idle50, idle99 = _ack(pod.socket, request_line(method, params))
            pod.kill()

            for what, reply in STREAMS:
                fake.reset()
                fake.script(reply)
                pod = home.start_pod(f"busy{method}", extra=extra)
                with pod.rpc() as c:
                    c.call("run", {"input": "stream a long answer"})
                fake.wait_requests(1)
                busy50, busy99 = _ack(pod.socket, request_line(method, params))
                with pod.rpc() as c:
                    still = c.call("status")["state"] == "running"
                pod.kill()
                tag = "" if still else " (stream ended during the load!)"
                for q, busy, idle in (("p50", busy50, idle50), ("p99", busy99, idle99)):
                    metric = f"{method} ack {q} while streaming {what}{tag}"
                    target = ratio_le(1.5) if what.startswith("at") else None
                    sec.add(Row(metric, busy, "µs", idle, "idle pod", target=target))
    sec.note(
        "one client, own connection, not pipelined, 1 s per measurement; busy: the fake model "
        "streams 20-character deltas (OpenAI chat format) during the load, paced or flat out; "
        "idle: the pod waits on a model call that never answers"
    )
