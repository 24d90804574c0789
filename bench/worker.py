"""Load worker: `python -m bench.worker SOCK LINE START_AT COUNT DURATION WARMUP`.

One blocking Unix-socket connection; sends the exact request bytes (LINE + newline), reads one
reply line, repeats (not pipelined). Waits until CLOCK_MONOTONIC reaches START_AT, does WARMUP
untimed calls, then COUNT calls (or, with COUNT 0, calls until DURATION seconds have passed).
Prints JSON `{n, end, lat_us}`: timed calls, monotonic end time, per-call latencies in µs.
Deliberately tiny: only the stdlib, so its start-up is fast and its loop cheap.
"""

import json
import socket
import sys
import time


def main() -> None:
    path, line, start_at, count, duration, warmup = sys.argv[1:7]
    data = line.encode() + b"\n"
    n_count, dur, n_warm = int(count), float(duration), int(warmup)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    send, recv, clock = sock.sendall, sock.recv, time.perf_counter

    def call() -> None:
        send(data)
        buf = recv(65536)
        while not buf.endswith(b"\n"):
            more = recv(65536)
            if not more:
                raise ConnectionError("closed")
            buf += more
        if b'"error"' in buf:
            raise RuntimeError(buf[:300].decode())

    delay = float(start_at) - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    for _ in range(n_warm):
        call()
    lat: list[float] = []
    append = lat.append
    if n_count:
        for _ in range(n_count):
            t = clock()
            call()
            append(clock() - t)
    else:
        stop = time.monotonic() + dur
        while time.monotonic() < stop:
            t = clock()
            call()
            append(clock() - t)
    end = time.monotonic()
    sock.close()
    json.dump({"n": len(lat), "end": end, "lat_us": [x * 1e6 for x in lat]}, sys.stdout)


if __name__ == "__main__":
    main()
