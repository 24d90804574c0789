"""9. Memory per connection: a client that never reads its replies, and partial frames.

Peak RSS (VmHWM) of a pod while 8 client processes send 100k `status` requests in all, with one
more client that sends requests as fast as it can and never reads a reply, against a second pod
under the same 8 senders without it: the server stops reading a client whose replies pile up
unread (past EVENT_HIGH_WATER) until it reads them; the others are unaffected. Then 40 clients
each holding a partial frame of almost 8 MiB (the default `max_frame_bytes`).
"""

import contextlib
import os
import socket
import threading
import time

from bench.harness import (
    Home,
    LoadResult,
    Row,
    Section,
    load,
    ratio_le,
    request_line,
    value_le,
    vm_rss_mb,
)
from poddaemon.server import EVENT_HIGH_WATER
from protocol import PodClient

SENDERS = 8
REQUESTS = 100_000
PARTIAL_CLIENTS = 40
PARTIAL_BYTES = 8 * 1024 * 1024 - 1024
# What one never-reading client may cost: the replies it may leave unread before the pod stops
# reading it, the requests read meanwhile, the buffers' own overhead. Measured: 1.2 MB (it was
# 18-24 MB when such a client was answered until 16 MiB piled up, then disconnected).
HOG_LIMIT_MB = 4 * EVENT_HIGH_WATER / 1e6


def vm_hwm_mb(pid: int) -> float:
    return vm_rss_mb(pid, "VmHWM")


def _settled_rss_mb(pid: int, within: float = 3.0) -> float:
    """VmRSS once it holds still: the SDK warm-up after READY grows it, and the pod frees a
    gone client's buffers as it sees it go."""
    last = vm_rss_mb(pid)
    end = time.monotonic() + within
    while time.monotonic() < end:
        time.sleep(0.2)
        now = vm_rss_mb(pid)
        if abs(now - last) < 0.5:
            return now
        last = now
    return last


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _wait_fds(pid: int, count: int, within: float = 30.0) -> bool:
    """Whether the pod is back to `count` open files within `within` s: it has seen its
    clients go (a client gone with a partial frame costs it a parse of that frame first)."""
    end = time.monotonic() + within
    while _open_fds(pid) > count:
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


class Hog(threading.Thread):
    """Sends `status` requests without ever reading, until `stop` is set (or the pod drops
    it)."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.sent = 0
        self.dropped = False

    def run(self) -> None:
        chunk = request_line("status") * 1000
        while not self.stop.is_set():
            try:
                self.sock.sendall(chunk)
                self.sent += 1000
            except TimeoutError:
                continue  # the pod is busy with the others: try again
            except OSError:
                self.dropped = True
                return


def _first_alert(watcher: PodClient) -> str:
    try:
        for event in watcher.events():
            if event.type == "alert":
                return str(event.data.get("message"))
    except TimeoutError:
        pass
    return "none seen"


def _senders(path: str) -> LoadResult:
    return load(path, request_line("status"), clients=SENDERS, count=REQUESTS // SENDERS, warmup=0)


def run(sec: Section) -> None:
    line_status = "status requests, not pipelined (bench.worker)"
    with Home() as home:
        plain = home.start_pod("plain")
        hogged = home.start_pod("hogged")
        base_idle = vm_hwm_mb(plain.pid)
        res_plain = _senders(plain.socket)
        base_peak = vm_hwm_mb(plain.pid)

        with PodClient.connect(hogged.socket, timeout=10) as watcher:
            watcher.subscribe()
            hog = Hog(hogged.socket)
            hog.start()
            res_hog = _senders(hogged.socket)
            hog.stop.set()
            hog.join(10)
            peak = vm_hwm_mb(hogged.pid)
            alert = _first_alert(watcher) if hog.dropped else "none"
        sec.add(
            Row(
                f"peak RSS: {SENDERS} senders + 1 client that never reads",
                peak,
                "MB",
                base_peak,
                f"{SENDERS} senders alone (other pod)",
            )
        )
        sec.add(
            Row(
                "  of which the never-reading client",
                peak - base_peak,
                "MB",
                target=value_le(round(HOG_LIMIT_MB, 1), "MB (4x the 1 MiB high-water mark)"),
            )
        )
        sec.add(
            Row(
                f"{SENDERS} senders' req/s beside it",
                res_hog.rps,
                "req/s",
                res_plain.rps,
                "without it (other pod)",
            )
        )
        sec.note(
            f"{REQUESTS} {line_status}; the never-reading client got {hog.sent} requests into "
            f"its socket before the pod stopped reading it"
            f"{f', and was DISCONNECTED (alert: {alert})' if hog.dropped else ''}; "
            f"idle pod {base_idle:.1f} MB"
        )

        pod = home.start_pod("partial")
        idle_rss = _settled_rss_mb(pod.pid)  # its SDK warm-up done: not counted as growth
        idle = vm_hwm_mb(pod.pid)
        idle_fds = _open_fds(pod.pid)
        head = b'{"jsonrpc":"2.0","id":1,"method":"status"'
        part = head + b" " * (PARTIAL_BYTES - len(head))
        socks: list[socket.socket] = []
        dropped = 0
        for _ in range(PARTIAL_CLIENTS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(pod.socket)
            socks.append(s)
            try:
                s.sendall(part)
            except OSError:
                dropped += 1
        with pod.rpc() as c:
            c.call("status")  # the pod still answers others
        peak_partial = vm_hwm_mb(pod.pid)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        # Measured once the pod has closed their connections, not while it is still at work on
        # them: RSS holds still meanwhile (freed pages are given back once they are all gone).
        all_gone = _wait_fds(pod.pid, idle_fds)
        after = _settled_rss_mb(pod.pid)
        sec.add(
            Row(
                f"peak RSS: {PARTIAL_CLIENTS} clients x partial {PARTIAL_BYTES / 2**20:.1f} MiB",
                peak_partial,
                "MB",
                idle,
                "the same pod idle",
            )
        )
        sec.add(Row("  growth", peak_partial - idle, "MB", target=value_le(100, "MB")))
        sec.add(
            Row(
                "RSS once those clients are gone",
                after,
                "MB",
                idle_rss,
                "the same pod before them",
                ratio_le(1.1),
            )
        )
        sec.note(
            f"{dropped} of {PARTIAL_CLIENTS} partial-frame clients disconnected (partial frames of "
            "all connections together are bounded to 64 MiB)"
            + ("" if all_gone else "; the pod had NOT closed all their connections in 30 s")
        )
