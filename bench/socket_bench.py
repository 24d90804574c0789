"""1. Socket: `status` round trip and throughput against a raw uvloop echo server."""

import os

from bench.harness import (
    Home,
    LoadResult,
    Row,
    Section,
    echo_server,
    load,
    peer_pid,
    pinned,
    ratio_le,
    request_line,
)

ROUNDS = 3
CALLS = 2000  # per round and target: 6,000 timed calls each
DURATION = 1.5
CLIENTS = 8


def run(sec: Section) -> None:
    line = request_line("status")
    with Home() as home, echo_server() as echo:
        pod = home.start_pod("sock")
        # One client's round trips, each server and its client on one CPU (see `pinned`: a
        # wake-up across CPUs costs more than the whole echo here, and which side of that
        # draw a connection lands on changes from run to run), then free, for comparison.
        cpu = min(os.sched_getaffinity(0))
        pod_one, echo_one = _round_trips(pod.socket, echo, line, cpu, pod.pid)
        pod_free, echo_free = _round_trips(pod.socket, echo, line)
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
        sec.add(
            Row(
                "status RTT p50, 1 connection, unpinned",
                pod_free.p50,
                "µs",
                echo_free.p50,
                "echo RTT p50",
            )
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
            f"{len(pod_one.lat_us)} timed calls per side in {ROUNDS} interleaved rounds, "
            f"server and client on CPU {cpu} (unpinned: the same, on any CPU); "
            f"reply {len(_status_reply(pod.socket, line))} B vs echo {len(line)} B; "
            f"throughput: {CLIENTS} processes, own connection each, NOT pipelined "
            f"(send, wait for the reply line, repeat), {DURATION} s"
        )


def _round_trips(
    pod: str, echo: str, line: bytes, cpu: int | None = None, pod_pid: int = 0
) -> tuple[LoadResult, LoadResult]:
    """One client's round trips to the pod and to the echo server, in interleaved rounds (so
    drift, other load and CPU frequency, hits both alike); with `cpu`, each server and its
    client run on that CPU."""
    pod_lat: list[float] = []
    echo_lat: list[float] = []
    for _ in range(ROUNDS):
        for path, lat, pid in ((echo, echo_lat, peer_pid(echo)), (pod, pod_lat, pod_pid)):
            if cpu is None:
                lat += load(path, line, count=CALLS, warmup=200).lat_us
                continue
            with pinned(pid, cpu):
                lat += load(path, line, count=CALLS, warmup=200, cpu=cpu).lat_us
    return LoadResult(1, len(pod_lat), 1.0, pod_lat), LoadResult(1, len(echo_lat), 1.0, echo_lat)


def _status_reply(path: str, line: bytes) -> bytes:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(line)
        buf = b""
        while not buf.endswith(b"\n"):
            buf += s.recv(65536)
        return buf
