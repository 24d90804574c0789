"""Shared machinery: result tables with same-run baselines, pods and the fake model as real
subprocesses, a tiny blocking JSON-RPC client and the multi-process socket load driver."""

import contextlib
import json
import math
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poddaemon.testing.cleanup import kill_spawned

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PODCTL = str(ROOT / ".venv" / "bin" / "podctl")
PODDAEMON = str(ROOT / ".venv" / "bin" / "poddaemon")  # the command a unit's ExecStart= runs
READY = "PODDAEMON-READY"

# ------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class Target:
    """A pass/fail rule on a row: `desc` is what the table prints."""

    desc: str
    ok: Callable[["Row"], bool]


def ratio_le(limit: float) -> Target:
    return Target(f"ratio ≤ {limit:g}", lambda r: r.ratio is not None and r.ratio <= limit)


def ratio_ge(limit: float) -> Target:
    return Target(f"ratio ≥ {limit:g}", lambda r: r.ratio is not None and r.ratio >= limit)


def value_le(limit: float, unit: str = "") -> Target:
    return Target(f"≤ {limit:g} {unit}".rstrip(), lambda r: r.value <= limit)


def value_lt(limit: float, unit: str = "") -> Target:
    return Target(f"< {limit:g} {unit}".rstrip(), lambda r: r.value < limit)


def all_of(*targets: Target) -> Target:
    return Target(" & ".join(t.desc for t in targets), lambda r: all(t.ok(r) for t in targets))


@dataclass
class Row:
    metric: str
    value: float
    unit: str = ""
    baseline: float | None = None
    baseline_name: str = ""
    target: Target | None = None
    # ratio = value / baseline unless given (e.g. a difference row sets its own)
    ratio_override: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.ratio_override is not None:
            return self.ratio_override
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        return "PASS" if self.target.ok(self) else "MISS"


@dataclass
class Section:
    key: str
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def label(self) -> str:
        return f"{self.title.split('.')[0]}. {self.key}"

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    right = {1, 2, 3}

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def render_section(sec: Section) -> str:
    headers = ("metric", "value", "baseline", "ratio", "baseline is", "target", "result")
    cells = []
    for r in sec.rows:
        value = f"{fmt(r.value)} {r.unit}".rstrip()
        base = f"{fmt(r.baseline)} {r.unit}".rstrip() if r.baseline is not None else "-"
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "-"
        cells.append(
            (
                r.metric,
                value,
                base,
                ratio,
                r.baseline_name or "-",
                r.target.desc if r.target else "-",
                r.verdict,
            )
        )
    out = [f"\n== {sec.title} ==", _table(headers, cells)]
    out += [f"  note: {n}" for n in sec.notes]
    if sec.error:
        out.append(f"  ERROR: {sec.error}")
    return "\n".join(out)


def render_summary(sections: Sequence[Section]) -> str:
    cells = []
    for sec in sections:
        if sec.error:
            cells.append((sec.label, "(section failed)", "-", "-", "-", "ERROR"))
        for r in sec.rows:
            if r.target is None:
                continue
            value = f"{fmt(r.value)} {r.unit}".rstrip()
            ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "-"
            cells.append((sec.label, r.metric, value, ratio, r.target.desc, r.verdict))
    headers = ("section", "metric", "value", "ratio", "target", "result")
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    for c in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
    passed = sum(1 for c in cells if c[-1] == "PASS")
    lines.append(f"{passed}/{len(cells)} targets met")
    return "\n== Summary: every target ==\n" + "\n".join(lines)


# ------------------------------------------------------------------------------------ stats


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of `values`."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def median_pair(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Of alternated (ours, baseline) measurements, the pair whose ratio is the median."""
    ranked = sorted(pairs, key=lambda p: p[0] / p[1])
    return ranked[len(ranked) // 2]


def ratio_spread(pairs: Sequence[tuple[float, float]]) -> str:
    """The range of the pairs' ratios, as "0.70-0.94" (a note next to `median_pair`'s row)."""
    ratios = sorted(ours / base for ours, base in pairs)
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}"


def vm_rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory line of /proc/PID/status in MB (VmHWM: the peak RSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds a process has used so far (/proc/PID/stat, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name in () may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def thread_cpu_ns(pid: int) -> int:
    """CPU time of a process's live threads, in ns (/proc/PID/task/*/schedstat: exact, where
    /proc/PID/stat counts clock ticks of 10 ms). A thread that exits takes its time with it."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


@contextlib.contextmanager
def pinned(pid: int, cpu: int) -> Iterator[None]:
    """Every thread of `pid` on `cpu` only, for the block; then free on every CPU again.

    For one client's round trips: on these 2-vCPU VMs a wake-up that crosses CPUs costs
    60-90 µs (an IPI to an idle vCPU), 3-5x a whole echo round trip, and where the scheduler
    puts a server relative to its client changes from one connection to the next. A server
    and its client pinned to one CPU measure the software, not that draw."""
    tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    every = os.sched_getaffinity(0)
    for task in tasks:
        os.sched_setaffinity(task, {cpu})
    try:
        yield
    finally:
        for task in tasks:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(task, every)


def peer_pid(path: str) -> int:
    """The pid of the process listening on a Unix socket (SO_PEERCRED of a connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    return int.from_bytes(creds[:4], sys.byteorder)


def pss_mb(pid: int) -> float:
    """Proportional set size: shared pages (the interpreter, libraries) split between users."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def fsync_us(n: int = 200, dir: str = "/tmp") -> list[float]:
    """Latency of append-100-bytes + fsync on a small file, in µs (the durability floor)."""
    fd, path = tempfile.mkstemp(dir=dir)
    try:
        out = []
        for _ in range(n):
            os.write(fd, b"x" * 100 + b"\n")
            t = time.perf_counter()
            os.fsync(fd)
            out.append((time.perf_counter() - t) * 1e6)
        return out
    finally:
        os.close(fd)
        os.unlink(path)


# ------------------------------------------------------------------------------------ processes


def compile_sources() -> None:
    subprocess.run(
        [PY, "-m", "compileall", "-q", "poddaemon", "cli", "protocol", "bench"],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def base_env(home: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "PODDAEMON_HOME": str(home),
        "FAKE_API_KEY": "bench-key",
        "OPENAI_API_KEY": "bench-key",
        "PYTHONPATH": str(ROOT),
    }
    for var in ("PODDAEMON_CONFIG_DIR", "PODDAEMON_DATA_DIR", "PODDAEMON_RUNTIME_DIR"):
        env.pop(var, None)
    return env


class FakeServer:
    """`python -m poddaemon.testing.fake_model` in its own process, driven over HTTP, so neither
    the pod nor the baseline SDK script shares a GIL with it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [PY, "-m", "poddaemon.testing.fake_model"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("FAKE-MODEL-READY"):
            raise RuntimeError(f"fake model did not start: {line!r}")
        self.url = line.rstrip("\n").split("\t")[1]
        self.openai_base_url = self.url + "/v1"

    def _post(self, path: str, payload: Any = None) -> Any:
        data = json.dumps(payload or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def script(self, *replies: dict[str, Any], when: str | None = None) -> None:
        payload: dict[str, Any] = {"replies": list(replies)}
        if when is not None:  # for requests whose last user text contains `when`
            payload["when"] = when
        self._post("/_fake/script", payload)

    def script_model(self, model: str, *replies: dict[str, Any]) -> None:
        """Replies (none: the echo answer) for requests naming `model` only."""
        self._post("/_fake/script", {"model": model, "replies": list(replies)})

    def reset(self) -> None:
        self._post("/_fake/reset")

    def open_gate(self, name: str) -> None:
        self._post(f"/_fake/gate/{name}")

    def requests(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/_fake/requests", timeout=30) as resp:
            result: list[dict[str, Any]] = json.loads(resp.read())
            return result

    def wait_requests(self, n: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.requests()
            if len(got) >= n:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake model got {len(got)} requests, wanted {n}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Pod:
    """A real `poddaemon run manifest` process (the console script a unit runs); stderr drained
    in a thread."""

    def __init__(self, proc: "subprocess.Popen[str]", name: str) -> None:
        self.proc = proc
        self.name = name
        self.socket = ""
        self.stderr: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = 30.0) -> "Pod":
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"pod {self.name} not ready: {''.join(self.stderr)}") from None
            if line is None:
                raise RuntimeError(f"pod {self.name} exited: {''.join(self.stderr)}")
            if line.startswith(READY):
                self.socket = line.rstrip("\n").split("\t")[2]
                return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rpc(self, timeout: float | None = 60.0) -> "Rpc":
        return Rpc(self.socket, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Home:
    """A throwaway PODDAEMON_HOME (short path: socket addresses must fit in 108 bytes) with a
    fake model process and the pods started in it. Use as a context manager."""

    def __init__(self, fake: bool = True) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="pdb", dir="/tmp"))
        self.env = base_env(self.path)
        self.work = self.path / "work"
        self.work.mkdir()
        self.pods: list[Pod] = []
        self.fake = FakeServer(self.env) if fake else None

    def __enter__(self) -> "Home":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pod in self.pods:
            pod.kill()
        kill_spawned(self.path / "run")
        if self.fake is not None:
            self.fake.stop()
        shutil.rmtree(self.path, ignore_errors=True)

    def manifest(self, name: str, *, tools: list[str] | None = None, extra: str = "") -> Path:
        assert self.fake is not None
        pwd = self.work / name
        pwd.mkdir(exist_ok=True)
        lines = [
            "[pod]",
            f'name = "{name}"',
            f'pwd = "{pwd}"',
            "[provider]",
            'kind = "openai"',
            'model = "fake-model"',
            f'base_url = "{self.fake.openai_base_url}"',
            'api_key_env = "FAKE_API_KEY"',
            "max_retries = 0",
            "[worker]",
            'instruction = "You are a benchmark pod."',
            "max_turns = 200",
        ]
        if tools is not None:
            lines.append("tools = [" + ", ".join(f'"{t}"' for t in tools) + "]")
        lines += ["[[scope.allow]]", f'target = "{pwd}"', 'permission = "write"']
        path = self.path / f"{name}.toml"
        path.write_text("\n".join(lines) + "\n" + extra)
        return path

    def podctl(self, *args: str) -> None:
        """Run `podctl ARGS` in this home (it fails the bench if podctl fails)."""
        subprocess.run(
            [PODCTL, *args],
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )

    def pod_pid(self, name: str) -> int:
        """The pid of a pod `podctl spawn` started (from its pid file)."""
        return int((self.path / "run" / "pods" / name / "pid").read_text())

    def start_pod(self, name: str, *args: str, manifest: Path | None = None, **kw: Any) -> Pod:
        path = manifest or self.manifest(name, **kw)
        proc = subprocess.Popen(
            [PODDAEMON, "run", str(path), *args],
            env=self.env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        pod = Pod(proc, name)
        self.pods.append(pod)
        return pod.wait_ready()


class Rpc:
    """A minimal blocking JSON-RPC client: one request, one reply line (no subscriptions)."""

    def __init__(self, path: str, timeout: float | None = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""
        self.next_id = 0

    def send(self, method: str, params: dict[str, Any] | None = None) -> None:
        self.next_id += 1
        req: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            req["params"] = params
        self.sock.sendall(json.dumps(req).encode() + b"\n")

    def recv(self) -> Any:
        while b"\n" not in self.buf:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("pod closed the connection")
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"rpc error: {reply['error']}")
        return reply["result"]

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        self.send(method, params)
        return self.recv()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Rpc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request_line(method: str, params: dict[str, Any] | None = None) -> bytes:
    req: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": method}
    if params is not None:
        req["params"] = params
    return json.dumps(req, separators=(",", ":")).encode() + b"\n"


@dataclass
class LoadResult:
    clients: int
    count: int
    elapsed: float
    lat_us: list[float]

    @property
    def rps(self) -> float:
        return self.count / self.elapsed

    @property
    def p50(self) -> float:
        return pct(self.lat_us, 50)

    @property
    def p99(self) -> float:
        return pct(self.lat_us, 99)


def load(
    sock: str,
    line: bytes,
    *,
    clients: int = 1,
    count: int = 0,
    duration: float = 0.0,
    warmup: int = 100,
    env: dict[str, str] | None = None,
    cpu: int | None = None,
) -> LoadResult:
    """Drive `sock` with `clients` processes of `bench.worker`, each on its own connection,
    sending `line` and waiting for one reply line before the next (not pipelined).

    Either `count` calls per client, or as many as fit in `duration` seconds; all clients start
    together at an agreed CLOCK_MONOTONIC instant (system-wide on Linux). With `cpu`, the
    clients run on that CPU only (see `pinned`)."""
    start_at = time.monotonic() + 0.3 + 0.08 * clients
    cmd = [
        PY,
        "-m",
        "bench.worker",
        sock,
        line.decode().rstrip("\n"),
        str(start_at),
        str(count),
        str(duration),
        str(warmup),
    ]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env or {**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(clients)
    ]
    if cpu is not None:  # before their agreed start, well after they exist
        for p in procs:
            os.sched_setaffinity(p.pid, {cpu})
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}): {out}")
        results.append(json.loads(out))
    lat = [x for r in results for x in r["lat_us"]]
    n = sum(r["n"] for r in results)
    # Throughput over the common window: from the agreed start to the last client's finish.
    elapsed = max(r["end"] for r in results) - start_at
    return LoadResult(clients, n, elapsed, lat)


@contextlib.contextmanager
def _baseline_server(module: str, *args: str) -> Iterator[str]:
    """Run `python -m <module> <socket path> <args>` until it prints READY; yield its socket."""
    path = tempfile.mktemp(prefix="pdbase", dir="/tmp")
    proc = subprocess.Popen(
        [PY, "-m", module, path, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError(f"{module} did not start")
        yield path
    finally:
        proc.terminate()
        proc.wait(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def fsync_server(file: str, size: int = 0) -> contextlib.AbstractContextManager[str]:
    """The durable-ack floor: `bench.fsync_server` (append each line, one inline fsync per
    loop iteration, then answer the batch); `size`: each line padded to that many bytes."""
    return _baseline_server("bench.fsync_server", file, *([str(size)] if size else []))


def echo_server() -> contextlib.AbstractContextManager[str]:
    """The raw baseline: `bench.echo_server` (asyncio + uvloop Protocol echoing each line)."""
    return _baseline_server("bench.echo_server")
