"""1. Socket: `status` round trip and throughput against a raw uvloop echo server."""

from bench.harness import Home, LoadResult, Row, Section, echo_server, load, ratio_le, request_line

ROUNDS = 3
CALLS = 2000  # per round and target: 6,000 timed calls each
DURATION = 1.5
CLIENTS = 8


def run(sec: Section) -> None:
    line = request_line("status")
    with Home() as home, echo_server() as echo:
        pod = home.start_pod("sock")
        pod_runs: list[LoadResult] = []
        echo_runs: list[LoadResult] = []
        # Interleaved rounds, so drift (other load, CPU frequency) hits both sides alike.
        for _ in range(ROUNDS):
            echo_runs.append(load(echo, line, count=CALLS, warmup=200))
            pod_runs.append(load(pod.socket, line, count=CALLS, warmup=200))
        pod_lat = [x for r in pod_runs for x in r.lat_us]
        echo_lat = [x for r in echo_runs for x in r.lat_us]
        pod_one = LoadResult(1, len(pod_lat), 1.0, pod_lat)
        echo_one = LoadResult(1, len(echo_lat), 1.0, echo_lat)
        sec.add(
            Row(
                "status RTT p50, 1 connection",
                pod_one.p50,
                "µs",
                echo_one.p50,
                "echo RTT p50",
                ratio_le(3),
            )
        )
        sec.add(
            Row("status RTT p99, 1 connection", pod_one.p99, "µs", echo_one.p99, "echo RTT p99")
        )
        echo_tp = load(echo, line, clients=CLIENTS, duration=DURATION)
        pod_tp = load(pod.socket, line, clients=CLIENTS, duration=DURATION)
        sec.add(
            Row(
                f"status req/s, {CLIENTS} client processes",
                pod_tp.rps,
                "req/s",
                echo_tp.rps,
                "echo req/s",
            )
        )
        sec.add(
            Row(f"status p50 under {CLIENTS} clients", pod_tp.p50, "µs", echo_tp.p50, "echo p50")
        )
        sec.note(
            f"{len(pod_lat)} timed calls per side in {ROUNDS} interleaved rounds, "
            f"reply {len(_status_reply(pod.socket, line))} B vs echo {len(line)} B; "
            f"throughput: {CLIENTS} processes, own connection each, NOT pipelined "
            f"(send, wait for the reply line, repeat), {DURATION} s"
        )


def _status_reply(path: str, line: bytes) -> bytes:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(line)
        buf = b""
        while not buf.endswith(b"\n"):
            buf += s.recv(65536)
        return buf
