"""9. Sandbox: what Landlock costs per command and at start, for the designs the pod could use.

- the launcher (`python -I -m poddaemon.sandbox.exec POLICY -- true`) confined vs mode "off";
- a small helper process that starts commands (what the runner is), driven over a pipe like
  the pod would: unconfined and spawning (baseline); confined once at its start, then spawning
  (the pre-confined helper); unconfined, forking and confining each command before exec (a
  fresh policy per command);
- at start: building the policy, applying it in-process (what confining the pod itself costs),
  and starting a confined helper.

`python -m bench.sandbox_bench helper POLICY_FILE MODE` is the helper (MODE: plain, confined,
per-command); it answers each line on stdin with the command's exit status.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from bench.harness import PY, ROOT, Row, Section, Target, median, pct

N = 200  # commands per variant
STARTS = 21


def _policy(root: Path, *, mode: str = "enforce", pod_layer: bool = False) -> bytes:
    """The policy for a project with a deny rule, as a pod would build it for its commands; with
    `pod_layer`, the wider one the pod process itself would need (its data and runtime dirs
    writable, the network on)."""
    from poddaemon.sandbox import Grant, build_policy, system_grants
    from poddaemon.sandbox.policy import WRITE
    from poddaemon.scope import Scope

    proj = root / "proj"
    for sub in ("src", "docs", "secrets", "build"):
        (proj / sub).mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    scope = Scope.from_config([(".", "write", True)], [("secrets", "read", True)], cwd=str(proj))
    extra = system_grants()
    if pod_layer:
        for d in ("data", "run"):
            (root / d).mkdir(exist_ok=True)
            extra.append(Grant(str(root / d), WRITE))
    policy = build_policy(
        scope,
        pwd=str(proj),
        tmpdir=str(root / "tmp"),
        network=pod_layer,
        mode=mode,  # type: ignore[arg-type]
        extra=extra,
    )
    return policy.encode()


def _time_ms(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
    return (time.perf_counter() - t) * 1e3


class _Helper:
    def __init__(self, policy: str, mode: str) -> None:
        t = time.perf_counter()
        self.proc = subprocess.Popen(
            [PY, "-m", "bench.sandbox_bench", "helper", policy, mode],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        ready = self.stdout.readline()
        self.start_ms = (time.perf_counter() - t) * 1e3
        assert ready.startswith(b"ready"), ready

    def command(self) -> float:
        t = time.perf_counter()
        self.stdin.write(b"true\n")
        self.stdin.flush()
        status = self.stdout.readline()
        elapsed = (time.perf_counter() - t) * 1e3
        assert status == b"0\n", status
        return elapsed

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=10)


def run(sec: Section) -> None:
    from poddaemon.sandbox import available

    abi = available()
    if abi == 0:
        sec.note("this kernel has no Landlock: nothing to measure")
        return
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        root = Path(d)
        enforce, off, pod = root / "enforce.json", root / "off.json", root / "pod.json"
        enforce.write_bytes(_policy(root))
        off.write_bytes(_policy(root, mode="off"))
        pod.write_bytes(_policy(root, pod_layer=True))
        _launcher(sec, str(enforce), str(off))
        _helpers(sec, str(enforce))
        _start(sec, root, str(pod))
        rules = len(msgspec.json.decode(enforce.read_bytes())["rules"])
    sec.note(
        f"Landlock ABI {abi}; {N} `true` commands per variant, interleaved; the policy: a "
        f"project with a deny rule plus the system list ({rules} rules)"
    )


def _launcher(sec: Section, enforce: str, off: str) -> None:
    base = [PY, "-I", "-m", "poddaemon.sandbox.exec"]
    confined: list[float] = []
    plain: list[float] = []
    for cmd in (enforce, off):  # warm the page cache
        _time_ms([*base, cmd, "--", "true"])
    for _ in range(N):
        confined.append(_time_ms([*base, enforce, "--", "true"]))
        plain.append(_time_ms([*base, off, "--", "true"]))
    added = median(confined) - median(plain)
    sec.add(
        Row(
            "launcher: python -I -m poddaemon.sandbox.exec -- true, p50",
            median(confined),
            "ms",
            median(plain),
            "same launcher, mode off",
        )
    )
    # No target here: Python start-up (~100 ms, ±5 ms on a shared machine) swamps the
    # sub-millisecond Landlock share, which `apply_policy at start` below measures directly.
    sec.add(Row("launcher: p50 difference (within noise)", added, "ms"))
    sec.add(Row("launcher: p99 confined / off", pct(confined, 99), "ms", pct(plain, 99)))


def _helpers(sec: Section, enforce: str) -> None:
    helpers = {mode: _Helper(enforce, mode) for mode in ("plain", "confined", "per-command")}
    try:
        times: dict[str, list[float]] = {m: [] for m in helpers}
        for h in helpers.values():
            h.command()
        for _ in range(N):
            for mode, h in helpers.items():
                times[mode].append(h.command())
    finally:
        for h in helpers.values():
            h.close()
    base = median(times["plain"])
    sec.add(
        Row(
            "pre-confined helper: spawn `true`, p50 round trip",
            median(times["confined"]),
            "ms",
            base,
            "unconfined helper, same spawn",
            target=_added_le(base, 1.0),
        )
    )
    sec.add(
        Row(
            "per-command policy: helper forks, confines, execs `true`, p50",
            median(times["per-command"]),
            "ms",
            base,
            "unconfined helper, spawn",
        )
    )


def _added_le(base: float, limit: float) -> Target:
    return Target(f"added ≤ {limit:g} ms", lambda r: r.value - base <= limit)


def _start(sec: Section, root: Path, pod_policy: str) -> None:
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from poddaemon.sandbox import apply_policy\n"
        "raw = open(sys.argv[1], 'rb').read()\n"
        "t1 = time.perf_counter()\n"
        "apply_policy(raw)\n"
        "print((t1 - t) * 1e3, (time.perf_counter() - t1) * 1e3)\n"
    )
    imports: list[float] = []
    applies: list[float] = []
    for _ in range(STARTS):
        out = subprocess.run(
            [PY, "-I", "-c", code, pod_policy], check=True, capture_output=True, text=True
        ).stdout.split()
        imports.append(float(out[0]))
        applies.append(float(out[1]))
    sec.add(Row("confine the pod itself: apply_policy at start", median(applies), "ms"))
    sec.add(Row("  import poddaemon.sandbox (lazy, once)", median(imports), "ms"))
    starts = []
    for _ in range(STARTS):
        h = _Helper(pod_policy, "confined")
        starts.append(h.start_ms)
        h.close()
    plain = []
    for _ in range(STARTS):
        h = _Helper(pod_policy, "plain")
        plain.append(h.start_ms)
        h.close()
    sec.add(
        Row(
            "start a pre-confined helper (to ready)",
            median(starts),
            "ms",
            median(plain),
            "the same helper unconfined",
        )
    )
    from poddaemon.sandbox import build_policy, system_grants
    from poddaemon.scope import Scope

    proj = root / "proj"
    scope = Scope.from_config([(".", "write", True)], [("secrets", "read", True)], cwd=str(proj))
    builds = []
    for _ in range(STARTS):
        t = time.perf_counter()
        build_policy(scope, pwd=str(proj), tmpdir=str(root / "tmp"), extra=system_grants())
        builds.append((time.perf_counter() - t) * 1e3)
    sec.add(Row("build_policy (scope with a deny + system list)", median(builds), "ms"))


# ------------------------------------------------------------------------------ the helper


def helper(policy_file: str, mode: str) -> None:
    """Start `true` for each line on stdin; answer with its exit status."""
    from poddaemon.sandbox import apply_policy

    raw = Path(policy_file).read_bytes()
    if mode == "confined":
        apply_policy(raw)  # once, before any thread: everything started below inherits it
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    true = "/usr/bin/true" if os.path.exists("/usr/bin/true") else "/bin/true"
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        if mode == "per-command":
            pid = os.fork()
            if pid == 0:
                try:
                    apply_policy(raw)
                    os.execv(true, [true])
                finally:
                    os._exit(127)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        else:
            status = subprocess.run([true], close_fds=False).returncode
        out.write(b"%d\n" % status)
        out.flush()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "helper":
        helper(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m bench.sandbox_bench helper POLICY_FILE MODE")
