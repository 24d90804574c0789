"""`podctl spawn` through the fork server: a lone pod is exec'd; from the second live pod on, pods
are forked from one preloaded process, each still the same pod an exec would have made (command
line, environment, working directory), and the server steps aside when the code changes, dies,
idles out, or is turned off."""

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from poddaemon import forkclient, ioprio
from poddaemon.forkserver import WATCH_ENV
from poddaemon.testing.cleanup import alive
from tests.conftest import Env, ppid, wait_until


def server_pid(env: Env) -> int:
    (lock,) = (env.home / "run").glob("forkserver.*.lock")
    return int(lock.read_text())


def pod_pid(env: Env, name: str) -> int:
    return int((env.home / "run" / "pods" / name / "pid").read_text())


def spawn(env: Env, name: str, **extra_env: str) -> int:
    """`podctl spawn` a pod with its own directory; its pid."""
    manifest = env.manifest(name, write=[str(env.work / name)])
    old = dict(env.env)
    env.env.update(extra_env)
    try:
        done = env.podctl("spawn", str(manifest))
    finally:
        env.env = old
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{name}\t")
    return pod_pid(env, name)


def answers(env: Env, name: str) -> bool:
    sent = env.podctl("send", name, "hello")
    return sent.returncode == 0 and sent.stdout == "ok: hello\n"


def test_a_lone_pod_is_execd_and_the_second_starts_the_server(env: Env) -> None:
    lone = spawn(env, "lone")
    assert not list((env.home / "run").glob("forkserver.*"))
    assert alive(lone) and answers(env, "lone")
    second = spawn(env, "two")
    assert ppid(second) == server_pid(env) != ppid(lone)
    assert answers(env, "two")


def test_pods_are_forked_by_one_server_yet_look_execd(env: Env) -> None:
    spawn(env, "lone")  # with another pod alive, the next ones are forked
    first = spawn(env, "one")
    # The second pod's key is only in the second podctl's environment, and its manifest is
    # named relative to the second podctl's working directory: both must reach the pod.
    manifest = env.manifest("two", write=[str(env.work / "two")])
    text = manifest.read_text().replace("FAKE_API_KEY", "SECOND_ONLY_KEY")
    (env.work / "sub").mkdir()
    (env.work / "sub" / "two.toml").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "spawn", "two.toml"],
        env={**env.env, "SECOND_ONLY_KEY": "k2"},
        cwd=env.work / "sub",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    second = pod_pid(env, "two")

    server = server_pid(env)
    assert ppid(first) == ppid(second) == server
    with open(f"/proc/{second}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b" ".join(argv).strip().endswith(b"-m poddaemon run two.toml --stderr-log")
    assert os.readlink(f"/proc/{second}/cwd") == str(env.work / "sub")
    assert answers(env, "one") and answers(env, "two")
    assert env.model.requests[-1]["headers"]["authorization"] == "Bearer k2"
    assert env.podctl("stop", "two").returncode == 0
    wait_until(lambda: not alive(second), what="pod two reaped by the server")
    assert alive(first) and alive(server)


def test_the_second_pod_shares_the_preloaded_sdk(env: Env) -> None:
    spawn(env, "lone")
    spawn(env, "one")
    second = spawn(env, "two")  # the server finishes loading the openai SDK before this fork
    assert answers(env, "two")
    with open(f"/proc/{second}/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in f if "kB" in line}
    # Pages the pod never wrote are still the server's: the imported SDK is not copied.
    assert fields["Shared_Dirty"] > 15 * 1024, fields


def test_failure_before_ready_is_reported_as_before(env: Env) -> None:
    spawn(env, "lone")
    spawn(env, "one")  # a server runs
    bad = env.home / "bad.toml"
    bad.write_text("[pod]\nname = 'bad'\nnonsense = 1\n")
    done = env.podctl("spawn", str(bad))
    assert done.returncode == 1, done.stderr
    assert str(bad) in done.stderr and "nonsense" in done.stderr
    assert not (env.home / "run" / "pods" / "bad").exists()


def test_a_manifest_the_pod_refuses_leaves_the_server_serving(env: Env) -> None:
    # After forking, the server peeks at the manifest's provider kind (to preload its SDK):
    # `provider = 3` killed it with an AttributeError, while the pod refused it in one line.
    spawn(env, "lone")
    spawn(env, "one")  # a server runs
    server = server_pid(env)
    bad = env.home / "bad.toml"
    bad.write_text("provider = 3\n")
    done = env.podctl("spawn", str(bad))
    assert done.returncode == 1
    assert done.stderr == f"poddaemon: {bad}:1: provider: expected table, got int\n"
    # The same server forks the next pod, at once.
    assert ppid(spawn(env, "two")) == server == server_pid(env)
    assert "Traceback" not in next((env.home / "run").glob("forkserver.*.log")).read_text()


def test_a_forked_pod_takes_arguments_that_are_not_utf8(env: Env) -> None:
    """A manifest whose file name is not UTF-8 (Latin-1, say): the exec'd pod took it, the
    forked one died before READY with a UnicodeEncodeError traceback from setproctitle, so
    `podctl spawn` failed only while another pod was running."""
    spawn(env, "lone")
    spawn(env, "one")  # a server runs
    server = server_pid(env)
    manifest = env.manifest("two", write=[str(env.work / "two")])
    latin1 = os.fsencode(env.work) + b"/tw\xe9.toml"  # 'twé.toml' in Latin-1
    os.rename(manifest, latin1)
    done = subprocess.run(
        [sys.executable.encode(), b"-m", b"cli.main", b"spawn", latin1],
        env=env.env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.startswith(b"two\t")
    second = pod_pid(env, "two")
    assert ppid(second) == server
    with open(f"/proc/{second}/cmdline", "rb") as f:
        assert b"poddaemon run " in f.read()
    assert answers(env, "two")


def _spawn_from(
    env: Env, name: str, preexec: Callable[[], object]
) -> "subprocess.CompletedProcess[str]":
    """`podctl spawn` a pod with its own directory, from a shell `preexec` sets up."""
    manifest = env.manifest(name, write=[str(env.work / name)])
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "spawn", str(manifest)],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=preexec,
    )


def _spawn_with(env: Env, name: str, limit: tuple[int, int]) -> "subprocess.CompletedProcess[str]":
    """`podctl spawn` from a shell whose open-file limit is `limit`."""
    return _spawn_from(env, name, lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit))


def test_a_forked_pod_has_its_callers_open_file_limit_not_the_servers(env: Env) -> None:
    spawn(env, "lone")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert _spawn_with(env, "server", (soft, hard)).returncode == 0  # starts the server
    lower = _spawn_with(env, "lower", (100, 1000))
    assert lower.returncode == 0, lower.stderr
    pid = pod_pid(env, "lower")
    assert ppid(pid) == server_pid(env)
    assert resource.prlimit(pid, resource.RLIMIT_NOFILE) == (1000, 1000)  # soft raised to hard


def test_a_server_started_with_a_low_open_file_limit_does_not_hold_later_pods_to_it(
    env: Env,
) -> None:
    """A server started from a shell with `ulimit -n 48` forked every later pod with 48: they
    refused to start, from any shell, until it went idle. It now raises its own limit to the
    caller's, or (not allowed to) leaves the pod to be exec'd."""
    spawn(env, "lone")
    low = _spawn_with(env, "low", (48, 48))  # starts the server, with that limit
    assert low.returncode != 0 and "the open-file limit (ulimit -n) is 48" in low.stderr
    assert resource.prlimit(server_pid(env), resource.RLIMIT_NOFILE)[1] == 48
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    normal = _spawn_with(env, "normal", (soft, hard))
    assert normal.returncode == 0, normal.stderr
    got = resource.prlimit(pod_pid(env, "normal"), resource.RLIMIT_NOFILE)
    assert got == (max(soft, min(hard, 4096)), hard)


# `ulimit -c 0 -u 4000`: limits a shell lowers, and that a server started elsewhere lacks.
_LOWERED = {resource.RLIMIT_CORE: (0, 0), resource.RLIMIT_NPROC: (4000, 4000)}


def _lowered_limits() -> None:
    for res, limit in _LOWERED.items():
        resource.setrlimit(res, limit)


def test_a_forked_pod_has_its_callers_other_limits_not_the_servers(env: Env) -> None:
    """Found by QA: the pod got only its caller's open-file limit; `ulimit -c 0` (no core
    dumps of a pod holding an API key), `ulimit -v`, `-u` of the shell that ran `podctl spawn`
    were dropped for the server's, where an exec'd pod keeps them."""
    spawn(env, "lone")
    spawn(env, "server")  # starts the server, with this process's limits
    lowered = _spawn_from(env, "lowered", _lowered_limits)
    assert lowered.returncode == 0, lowered.stderr
    pid = pod_pid(env, "lowered")
    assert ppid(pid) == server_pid(env)  # forked, not exec'd
    for res, limit in _LOWERED.items():
        assert resource.prlimit(pid, res) == limit, res


def test_a_server_started_with_lowered_limits_does_not_hold_later_pods_to_them(
    env: Env,
) -> None:
    """Found by QA: a server started by `ulimit -c 0; podctl spawn` forked every later pod
    with no core dumps, from any shell, until it went idle. It now raises its own hard limit
    to the caller's, or (not allowed to) leaves the pod to be exec'd: either way the pod has
    its caller's limits."""
    spawn(env, "lone")
    assert _spawn_from(env, "low", _lowered_limits).returncode == 0  # starts the server
    assert resource.prlimit(server_pid(env), resource.RLIMIT_CORE) == (0, 0)
    normal = _spawn_from(env, "normal", lambda: None)
    assert normal.returncode == 0, normal.stderr
    pid = pod_pid(env, "normal")
    for res in _LOWERED:
        assert resource.prlimit(pid, res) == resource.getrlimit(res), res


def test_a_pod_spawned_with_other_python_settings_gets_them(env: Env) -> None:
    """Found by QA: the interpreter reads PYTHONVERBOSE, PYTHONDEVMODE, PYTHONOPTIMIZE,
    PYTHONWARNINGS… once, at its start: `PYTHONVERBOSE=1 podctl spawn` (to see what a pod
    imports) gave an exec'd pod those traces, and a forked one, from a server started without
    them, none, silently. Such a spawn now goes to a server started with the same."""
    spawn(env, "lone")
    plain = spawn(env, "plain")  # starts a server without them
    assert ppid(plain) == server_pid(env)
    spawn(env, "verbose", PYTHONVERBOSE="1")
    assert answers(env, "plain") and answers(env, "verbose")
    log = (env.home / "log" / "verbose.log").read_text()
    assert "# code object from" in log, log  # what it imported after READY, traced
    assert "# code object from" not in (env.home / "log" / "plain.log").read_text()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no narrower set")
def test_a_forked_pod_runs_on_its_callers_cpus_not_the_servers(env: Env) -> None:
    """Found by QA: `taskset -c 0 podctl spawn` gave an exec'd pod CPU 0 only, and a forked
    one the server's CPUs; a server started by such a spawn held every later pod to CPU 0,
    from any shell, until it went idle."""
    spawn(env, "lone")
    every = os.sched_getaffinity(0)
    one = {min(every)}
    assert _spawn_from(env, "pinned", lambda: os.sched_setaffinity(0, one)).returncode == 0
    assert os.sched_getaffinity(server_pid(env)) == one  # the server started pinned
    free = _spawn_from(env, "free", lambda: None)
    assert free.returncode == 0, free.stderr
    assert ppid(pod_pid(env, "free")) == server_pid(env)  # forked, not exec'd
    assert os.sched_getaffinity(pod_pid(env, "free")) == every
    assert _spawn_from(env, "pinned2", lambda: os.sched_setaffinity(0, one)).returncode == 0
    assert os.sched_getaffinity(pod_pid(env, "pinned2")) == one


def _oom(pid: int | str) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def _choom(value: int) -> Callable[[], object]:
    return lambda: Path("/proc/self/oom_score_adj").write_text(str(value))


def test_a_forked_pod_has_its_callers_oom_score_adj_not_the_servers(env: Env) -> None:
    """Found by QA: `choom -n 900 -- podctl spawn` (this pod first, when memory runs out)
    started the server at 900, and every pod it forked later, from any shell, was the OOM
    killer's first pick until the server went idle; a pod spawned at 900 through a server
    at 0 got 0. An exec'd pod has its caller's value."""
    own = _oom("self")
    if own > 800:
        pytest.skip(f"the tests run at oom_score_adj {own}: no higher value to start at")
    spawn(env, "lone")
    assert _spawn_from(env, "high", _choom(900)).returncode == 0  # starts the server at 900
    assert _oom(server_pid(env)) == 900
    for name, value in (("mine", own), ("higher", 950)):
        done = _spawn_from(env, name, _choom(value))
        assert done.returncode == 0, done.stderr
        assert _oom(pod_pid(env, name)) == value, name
    assert _oom(server_pid(env)) == 900  # put back


@contextlib.contextmanager
def _another_cgroup() -> Iterator[Path]:
    """A cgroup (v2) of its own beside ours, removed afterwards; skips where none can be made."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if " - cgroup2 " in line]
    if not mounts:
        pytest.skip("no cgroup2 hierarchy is mounted")
    group = Path(mounts[0]) / f"podtest-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup: {exc}")
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

        def removed() -> bool:  # (busy until its last process is reaped, not only killed)
            try:
                group.rmdir()
            except OSError:
                return False
            return True

        wait_until(removed, what=f"{group} emptied and removed")


def test_a_caller_in_another_cgroup_gets_an_execd_pod_in_its_own(env: Env) -> None:
    """A pod the server forks lives in the server's cgroups, and nobody may move it there who
    may not move the server: `podctl spawn` in a systemd unit (a timer's job, a CI runner's
    service) or another login session, with a server started elsewhere, made a pod outside
    the caller's cgroup, out of its limits and its stop. Such a caller execs the pod now."""
    spawn(env, "lone")
    spawn(env, "one")  # starts the server, here
    with _another_cgroup() as group:

        def join() -> None:  # "0": the process that writes it
            (group / "cgroup.procs").write_text("0")

        done = _spawn_from(env, "there", join)
        assert done.returncode == 0, done.stderr
        there = pod_pid(env, "there")
        assert ppid(there) != server_pid(env)  # exec'd
        assert f"::/{group.name}\n" in Path(f"/proc/{there}/cgroup").read_text()
        assert answers(env, "there")
        assert env.podctl("stop", "there").returncode == 0
    here = _spawn_from(env, "here", lambda: None)
    assert here.returncode == 0, here.stderr
    assert ppid(pod_pid(env, "here")) == server_pid(env)  # the same cgroups: forked


def _spawn_niced(env: Env, name: str, nice: int) -> "subprocess.CompletedProcess[str]":
    """`nice -n NICE podctl spawn` a pod with its own directory."""
    return _spawn_from(env, name, lambda: os.setpriority(os.PRIO_PROCESS, 0, nice))


def test_a_forked_pod_has_its_callers_nice_value_not_the_servers(env: Env) -> None:
    """`nice -n 10 podctl spawn` of the second pod started the server at 10, and every pod it
    forked afterwards ran at 10, from any shell, until it went idle; `nice -n 15 podctl spawn`
    through it gave the server's 10, where an exec'd pod has its caller's nice value."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if own > 17:
        pytest.skip(f"the tests run at nice {own}: no higher value to start the server at")
    spawn(env, "lone")
    server = min(own + 10, 18)
    assert _spawn_niced(env, "server", server).returncode == 0  # starts the server, niced
    assert os.getpriority(os.PRIO_PROCESS, server_pid(env)) == server
    for name, nice in (("higher", server + 1), ("same", own)):
        done = _spawn_niced(env, name, nice)
        assert done.returncode == 0, done.stderr
        pid = pod_pid(env, name)
        assert ppid(pid) == server_pid(env)  # forked, not exec'd
        assert os.getpriority(os.PRIO_PROCESS, pid) == nice, name
    assert os.getpriority(os.PRIO_PROCESS, server_pid(env)) == server  # put back


def _ionice(pid: int) -> str:
    """What `ionice -p PID` says of a process's I/O priority ("idle", "best-effort: prio 7")."""
    done = subprocess.run(["ionice", "-p", str(pid)], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(ioprio.of(0) is None, reason="ioprio_get is not known on this machine")
@pytest.mark.skipif(shutil.which("ionice") is None, reason="no ionice to check it with")
def test_a_forked_pod_has_its_callers_io_priority_not_the_servers(env: Env) -> None:
    """`ionice -c3 podctl spawn` (a nightly job's pod, idle on the disk) started the server in
    the idle class, and every pod it forked later, from any shell, had idle I/O until the
    server went idle; a pod spawned so through a server of the normal class got the normal
    class. An exec'd pod has its caller's I/O priority."""
    own = ioprio.of(0)
    idle, best_effort_7 = 3 << 13 | 7, 2 << 13 | 7  # ionice -c3; ionice -c2 -n7
    spawn(env, "lone")
    assert _spawn_from(env, "idle", lambda: ioprio.set_own(idle)).returncode == 0  # the server
    assert _ionice(server_pid(env)) == "idle"
    for name, value in (("mine", own), ("low", best_effort_7), ("idle2", idle)):
        done = _spawn_from(env, name, lambda value=value: ioprio.set_own(value))
        assert done.returncode == 0, done.stderr
        pid = pod_pid(env, name)
        assert ppid(pid) == server_pid(env)  # forked, not exec'd
        assert ioprio.of(pid) == value, name
    assert _ionice(pod_pid(env, "low")) == "best-effort: prio 7"
    assert _ionice(server_pid(env)) == "idle"  # put back


def test_a_server_out_of_descriptors_fails_that_request_and_serves_on(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accept() failing (EMFILE) ended the server, which every spawn of the user goes through:
    that request's client now execs its pod, and the server serves the next one."""
    spawn(env, "lone")
    spawn(env, "one")  # starts the server
    server = server_pid(env)
    limits = resource.prlimit(server, resource.RLIMIT_NOFILE)
    resource.prlimit(server, resource.RLIMIT_NOFILE, (3, limits[1]))  # no new descriptor
    monkeypatch.setenv("PYTHONPATH", env.env["PYTHONPATH"])  # podctl's key
    monkeypatch.setattr(forkclient, "READY_TIMEOUT", 0.5)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        forked = forkclient.fork_pod(["poddaemon", "run", "x.toml"], (null, null, null))
    finally:
        os.close(null)
        resource.prlimit(server, resource.RLIMIT_NOFILE, limits)
    assert forked is None  # not answered: exec it
    assert ppid(spawn(env, "two")) == server
    log = next((env.home / "run").glob("forkserver.*.log")).read_text()
    assert log.count("poddaemon forkserver: accept: [Errno 24] Too many open files") == 1


def _idle_descriptors(pid: int) -> set[int]:
    """The descriptors `pid` holds once it has settled: the same, and no CPU used, for 0.1 s
    (a server preloads an SDK once idle, opening files as it imports)."""

    def look() -> tuple[set[int], int]:
        with open(f"/proc/{pid}/stat") as f:
            ticks = sum(map(int, f.read().rsplit(")", 1)[1].split()[11:13]))
        return {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}, ticks

    def settled() -> set[int] | None:
        before = look()
        time.sleep(0.1)
        return before[0] if look() == before else None

    return wait_until(settled, 30, "the fork server to settle")


def test_a_server_out_of_descriptors_answers_the_client_at_once(env: Env) -> None:
    """Every descriptor the server may have in use: accept() fails, and the client waited its
    whole reply timeout (30 s) before it exec'd the pod. The server lets go of one it holds in
    reserve to answer that client an error at once (it execs), then serves the next one."""
    spawn(env, "lone")
    spawn(env, "one")  # starts the server
    server = server_pid(env)
    held = _idle_descriptors(server)
    limits = resource.prlimit(server, resource.RLIMIT_NOFILE)
    resource.prlimit(
        server, resource.RLIMIT_NOFILE, (min(set(range(len(held) + 1)) - held), limits[1])
    )
    try:
        lone = env.podctl("spawn", str(env.manifest("two", write=[str(env.work / "two")])))
    finally:
        resource.prlimit(server, resource.RLIMIT_NOFILE, limits)
    assert lone.returncode == 0, lone.stderr
    assert ppid(pod_pid(env, "two")) != server  # exec'd
    log = next((env.home / "run").glob("forkserver.*.log")).read_text()
    assert "a request refused: the fork server is out of file descriptors" in log, log
    assert ppid(spawn(env, "three")) == server


def _watched(env: Env) -> Path:
    """A file this test's server watches as it watches its modules: edited, it makes that
    server stale, and no other (editing a module of the checkout made every server running
    for the tests beside this one stale too, and their pods came from a successor)."""
    watched = env.home / "watched.py"
    watched.write_text("# a module of the server's\n")
    env.env[WATCH_ENV] = str(watched)
    return watched


def test_a_stale_server_is_replaced(env: Env) -> None:
    module = _watched(env)
    spawn(env, "lone")
    spawn(env, "one")
    old = server_pid(env)
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # "edited"
    second = spawn(env, "two")
    new = server_pid(env)
    assert new != old and ppid(second) == new
    wait_until(lambda: not alive(old), what="the stale server exits")
    assert answers(env, "one") and answers(env, "two")


def test_a_server_stepping_aside_leaves_its_successors_socket_alone(env: Env) -> None:
    """Found by QA: `rm run/forkserver.*` while a server ran, and a spawn within the second
    started a new server in its place; the old one, finding its socket file gone, unlinked
    the path on its way out, which was by then the new server's socket: that one stepped
    aside in turn, and the next spawn started a third."""
    spawn(env, "lone")
    spawn(env, "one")
    old = server_pid(env)
    os.kill(old, signal.SIGSTOP)  # it looks at its socket file only once continued
    try:
        for path in (env.home / "run").glob("forkserver.*"):
            if path.suffix in (".sock", ".lock"):
                path.unlink()
        two = spawn(env, "two")  # starts a new server in the old one's place
    finally:
        os.kill(old, signal.SIGCONT)
    new = server_pid(env)
    assert new != old and ppid(two) == new
    wait_until(lambda: not alive(old), what="the unreachable server to leave")
    assert ppid(spawn(env, "three")) == new


def _queue_requests(env: Env, sock: Path, n: int) -> list[socket.socket]:
    """`n` clients connected to the (stopped) server at `sock`, their requests sent with the
    token and the pod's stdio, each waiting for its reply as `podctl spawn` does."""
    token = forkclient._read_token(str(sock))
    assert token is not None
    null = os.open(os.devnull, os.O_RDWR)
    clients = []
    try:
        for i in range(n):
            request = forkclient.Request(
                ["run", str(env.manifest(f"q{i}", write=[str(env.work / f"q{i}")]))],
                dict(env.env),
                str(env.home),
                0o22,
                [],
                token=token,
            )
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            socket.send_fds(s, [forkclient.encode_request(request)], [null] * 3)
            s.settimeout(30)
            clients.append(s)
    finally:
        os.close(null)
    return clients


def _replies(clients: list[socket.socket]) -> list[bytes]:
    replies = []
    for s in clients:
        with s:
            try:
                replies.append(s.recv(4096))
            except ConnectionResetError:
                replies.append(b"reset")
    return replies


def test_clients_queued_on_a_server_that_steps_aside_are_sent_on_not_dropped(
    env: Env,
) -> None:
    """Found by QA: a server whose socket file was removed closed its listener with the
    clients that had connected just before still queued on it: their connections were reset
    after they had sent their requests, and since such a client cannot tell that nothing was
    forked, `podctl spawn` failed ("the fork server went away while starting the pod"). They
    are now told to go to a fresh server, as a stale one tells them."""
    spawn(env, "lone")
    spawn(env, "one")
    old = server_pid(env)
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    os.kill(old, signal.SIGSTOP)  # so that the clients are queued before it sees the removal
    try:
        clients = _queue_requests(env, sock, 1)
        sock.unlink()
    finally:
        os.kill(old, signal.SIGCONT)
    assert _replies(clients) == [b'{"stale": true}\n']
    wait_until(lambda: not alive(old), what="the unreachable server to leave")
    assert not (env.home / "run" / "pods" / "q0").exists()  # nothing was forked


def test_clients_queued_behind_the_one_that_finds_the_server_stale_are_sent_on(
    env: Env,
) -> None:
    """Found by QA: two `podctl spawn` at once after a `git pull`: the first was told the
    server is stale and started a fresh one, the second, queued behind it, had its connection
    reset and failed ("the fork server went away while starting the pod")."""
    module = _watched(env)
    spawn(env, "lone")
    spawn(env, "one")
    old = server_pid(env)
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    stat = module.stat()
    os.kill(old, signal.SIGSTOP)
    try:
        clients = _queue_requests(env, sock, 3)
        os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # "edited"
        os.kill(old, signal.SIGCONT)
        replies = _replies(clients)
    finally:
        os.kill(old, signal.SIGCONT)
    assert replies == [b'{"stale": true}\n'] * 3
    wait_until(lambda: not alive(old), what="the stale server exits")


def test_a_module_replaced_under_its_old_mtime_makes_the_server_stale(env: Env) -> None:
    """Found by QA: staleness was judged by mtime alone, and an upgrade that keeps the files'
    times (`cp -a`, `rsync -a`, an installer keeping its archive's) went unseen: pods were
    forked with the old code, silently. A file replaced (a new inode) counts as changed."""
    module = _watched(env)
    spawn(env, "lone")
    spawn(env, "one")
    old = server_pid(env)
    copy = module.with_name(module.name + ".qa")
    shutil.copy2(module, copy)  # the same bytes and times, another file
    os.replace(copy, module)
    second = spawn(env, "two")
    new = server_pid(env)
    assert new != old and ppid(second) == new
    wait_until(lambda: not alive(old), what="the stale server exits")


def test_a_killed_server_leaves_its_pods_and_is_restarted(env: Env) -> None:
    spawn(env, "lone")
    first = spawn(env, "one")
    old = server_pid(env)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: not alive(old), what="server gone")
    assert answers(env, "one") and alive(first)
    second = spawn(env, "two")
    assert ppid(second) == server_pid(env) != old


def test_a_server_whose_socket_was_removed_steps_aside(env: Env) -> None:
    """No client can reach a server whose socket file is gone, and its lock keeps a new one
    from starting (each spawn would start one in vain, wait for it, and exec): it gives up
    its lock and leaves, and the next spawn starts a fresh server."""
    spawn(env, "lone")
    first = spawn(env, "one")
    old = server_pid(env)
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    sock.unlink()
    wait_until(lambda: not alive(old), what="the unreachable server to leave")
    second = spawn(env, "two")
    assert ppid(second) == server_pid(env) != old
    assert alive(first) and answers(env, "one")


def test_an_idle_server_exits_and_its_pods_live_on(env: Env) -> None:
    spawn(env, "lone")
    first = spawn(env, "one", PODDAEMON_FORKSERVER_IDLE="0.5")
    server = server_pid(env)
    wait_until(lambda: not alive(server), what="the idle server exits")
    assert answers(env, "one") and alive(first)
    assert not list((env.home / "run").glob("forkserver.*.sock"))


def test_it_can_be_turned_off(env: Env) -> None:
    spawn(env, "lone")
    pid = spawn(env, "one", PODDAEMON_FORKSERVER="0")
    assert not list((env.home / "run").glob("forkserver.*"))
    assert answers(env, "one") and alive(pid)


def _raw(path: str, payload: bytes, fds: list[int]) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        socket.send_fds(s, [payload], fds)
        s.shutdown(socket.SHUT_WR)
        reply: dict[str, object] = json.loads(s.makefile("rb").readline() or b"{}")
        return reply


@pytest.mark.parametrize(
    ("payload", "with_fds", "why"),
    [
        (b"garbage", True, "bad request"),
        (struct.pack(">I", 5) + b"nope!", True, "bad request"),
        (
            forkclient.encode_request(forkclient.Request(["run"], {}, "/", 0o22, [])),
            False,
            "3 file",
        ),
        (struct.pack(">I", 3) + b"[1]", True, "bad request"),
        (struct.pack(">I", 100) + b"{}", True, "truncated"),
    ],
)
def test_bad_requests_get_an_error_and_the_server_serves_on(
    env: Env, payload: bytes, with_fds: bool, why: str
) -> None:
    spawn(env, "lone")
    spawn(env, "one")
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    null = os.open(os.devnull, os.O_RDWR)
    try:
        reply = _raw(str(sock), payload, [null, null, null] if with_fds else [])
    finally:
        os.close(null)
    assert why in str(reply.get("error")), reply
    assert ppid(spawn(env, "two")) == server_pid(env)


def test_another_uid_is_refused_even_with_the_socket_open_to_it(env: Env) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second uid")
    spawn(env, "lone")
    spawn(env, "one")
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    # Open the way on purpose (the directories are 0700 and the socket 0600): the server's own
    # peer-credential check must still turn the stranger away.
    for d in (env.home, env.home / "run"):
        os.chmod(d, 0o711)
    os.chmod(sock, 0o777)
    stranger = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os,socket,sys;os.setgid(65534);os.setuid(65534);"
            "s=socket.socket(socket.AF_UNIX);s.settimeout(5);s.connect(sys.argv[1]);"
            "r=os.open('/dev/null',os.O_RDWR)\n"
            "try: socket.send_fds(s,[b'\\0\\0\\0\\2{}'],[r,r,r])\n"
            "except BrokenPipeError: pass\n"  # hung up on before it sent: just as refused
            "try: print(repr(s.recv(100)))\nexcept ConnectionResetError: print(repr(b''))",
            str(sock),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    for d in (env.home, env.home / "run"):
        os.chmod(d, 0o700)
    assert stranger.stdout.strip() == "b''", stranger.stdout + stranger.stderr  # hung up on
    assert ppid(spawn(env, "two")) == server_pid(env)


def test_a_server_that_vanishes_with_the_request_having_forked_nothing_leaves_it_to_exec(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It may have forked the pod already, and exec'ing it as well would start it twice: the
    pod's stderr pipe tells. Nobody holds it (nothing was forked): the pod is exec'd. It was
    an error, and the user had to spawn again (found by QA, with the server killed)."""
    spawn(env, "lone")
    monkeypatch.setenv("PYTHONPATH", env.env["PYTHONPATH"])  # podctl's key
    assert forkclient.server_socket().startswith(str(env.home))
    with _stand_in_server(socket.socket.close):  # reads the whole request, then dies silently
        done = env.podctl("spawn", str(env.manifest("two", write=[str(env.work / "two")])))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("two\t")
    assert answers(env, "two")
    assert env.podctl("stop", "two").returncode == 0


def test_spawn_pod_execs_the_child_a_vanished_server_did_not_fork(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a pod's spawn_pod: the tool failed with "the fork server went away"."""
    monkeypatch.setenv("PYTHONPATH", env.env["PYTHONPATH"])  # the pod's key
    tools = ["read_file", "spawn_pod"]
    parent = env.start("parent", tools=tools, write=[str(env.work)])
    call = {
        "name": "spawn_pod",
        "arguments": {
            "name": "kid",
            "task": "hello",
            "scope": [{"target": str(env.work / "kid"), "permission": "write"}],
        },
    }
    (env.work / "kid").mkdir()
    env.model.script({"tool_calls": [call]}, {"text": "spawned"})
    with _stand_in_server(socket.socket.close), parent.client(timeout=60) as c:
        assert c.run_wait("spawn it").outcome == "finished"
    entries = parent.call("history", limit=1000)["entries"]
    (result,) = [e["item"] for e in entries if e["kind"] == "tool_result"]
    assert not result["is_error"] and '"name":"kid"' in result["output"], result
    assert ppid(pod_pid(env, "kid")) != os.getpid()  # exec'd by the parent, not by us


def test_a_server_that_vanishes_having_forked_the_pod_is_no_error(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forked, then the server died before it told the pid (QA: killed in that window): the
    pod started, yet `podctl spawn` exited 1, and a retry was refused as "already running".
    The pod's READY comes on the pipe it holds: that is the answer."""
    spawn(env, "lone")
    monkeypatch.setenv("PYTHONPATH", env.env["PYTHONPATH"])  # podctl's key
    started: list[subprocess.Popen[bytes]] = []

    def fork_then_die(request: forkclient.Request, fds: list[int]) -> None:
        started.append(
            subprocess.Popen(
                [sys.executable, "-P", "-m", "poddaemon", *request.argv],
                stdin=fds[0],
                stdout=fds[1],
                stderr=fds[2],
                env=request.env,
                cwd=request.cwd,
                start_new_session=True,
            )
        )

    try:
        with _stand_in_server(socket.socket.close, fork=fork_then_die):
            done = env.podctl("spawn", str(env.manifest("two", write=[str(env.work / "two")])))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("two\t")
        (pod,) = started
        assert pod_pid(env, "two") == pod.pid and answers(env, "two")
        assert env.podctl("stop", "two").returncode == 0
        assert pod.wait(10) == 0
    finally:  # ours, in a session of its own: no cleanup of the home's pods would find it
        for proc in started:
            proc.kill()
            proc.wait(10)


def test_a_stopped_server_is_passed_over_at_once(env: Env) -> None:
    """A server that cannot answer (SIGSTOP, a debugger) would hold every spawn for the whole
    reply timeout: the pod is exec'd instead, and the server serves again once continued."""
    spawn(env, "lone")
    spawn(env, "one")
    server = server_pid(env)
    os.kill(server, signal.SIGSTOP)
    try:
        started = time.monotonic()
        two = spawn(env, "two")
        assert time.monotonic() - started < forkclient.READY_TIMEOUT / 2
    finally:
        os.kill(server, signal.SIGCONT)
    assert ppid(two) != server and answers(env, "two")
    assert ppid(spawn(env, "three")) == server


def test_a_request_whose_client_gave_up_is_not_forked(env: Env) -> None:
    """A client that hung up before the server read its request starts the pod itself (see
    forkclient): forking it too would start it twice."""
    spawn(env, "lone")
    spawn(env, "one")
    server = server_pid(env)
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    read_end, write_end = os.pipe()
    request = forkclient.Request(
        ["run", str(env.home / "ghost.toml")], dict(env.env), str(env.home), 0o22, []
    )
    os.kill(server, signal.SIGSTOP)  # it reads the request only once the client is gone
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(sock))
            socket.send_fds(s, [forkclient.encode_request(request)], [write_end] * 3)
    finally:
        os.close(write_end)
        os.kill(server, signal.SIGCONT)
    # End of file once every holder of the write end closed it: the server, and a pod it
    # forked (which would first say that ghost.toml does not exist).
    with os.fdopen(read_end, "rb") as stderr:
        assert stderr.read() == b""
    assert ppid(spawn(env, "two")) == server


def test_a_pod_that_ends_at_once_is_reported_by_its_exit_not_as_a_lost_server(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked pod that ends at once (a dozen spawns at once: each but one finds its name or
    scope taken) has its exit sent right behind its pid, and one read got both lines: the
    client took them for a garbled reply, and `podctl spawn` said "the fork server went away
    while starting the pod" instead of the pod's own error. Here the server sends both at
    once."""
    monkeypatch.setenv("PYTHONPATH", env.env["PYTHONPATH"])  # podctl's key

    def fork_and_see_it_end(conn: socket.socket) -> None:
        conn.sendall(b'{"pid": 4242}\n{"exit": 1}\n')
        conn.close()

    with _stand_in_server(fork_and_see_it_end):
        forked = _fork_pod()
    assert forked is not None
    assert (forked.pid, forked.wait(0.0)) == (4242, 1)


def test_a_server_that_does_not_answer_in_time_is_given_up_for_exec(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the reply timeout the client hangs up (so that the server, should it come to the
    request, does not fork it) and the caller execs the pod."""
    monkeypatch.setenv("PYTHONPATH", env.env["PYTHONPATH"])  # podctl's key
    monkeypatch.setattr(forkclient, "READY_TIMEOUT", 0.5)
    hung_up: list[bool] = []

    def say_nothing(conn: socket.socket) -> None:
        conn.settimeout(10)
        hung_up.append(conn.recv(1) == b"")  # nothing more comes, then the client's hang-up
        conn.close()

    with _stand_in_server(say_nothing):
        forked = _fork_pod()
    assert forked is None  # exec it
    assert hung_up == [True]


@contextlib.contextmanager
def _stand_in_server(
    answer: Callable[[socket.socket], object],
    fork: Callable[[forkclient.Request, list[int]], object] | None = None,
) -> Iterator[None]:
    """A fork server of our own on the real one's path: it takes one request whole (`fork`
    gets it and the descriptors passed with it, which are closed then), then `answer`s on
    that connection."""
    path = forkclient.server_socket()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    token = Path(forkclient.token_path(path))
    token.write_text("t\n")  # as a server writes it
    token.chmod(0o600)
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
        while len(data) < 4 + struct.unpack(">I", data[:4])[0]:
            data += conn.recv(65536)
        if fork is not None:
            fork(forkclient.decode_request(data[4:]), fds)
        for fd in fds:
            os.close(fd)
        answer(conn)

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield
    finally:
        server.join(10)
        listener.close()
    assert not server.is_alive()


def _fork_pod() -> "forkclient.Forked | None":
    null = os.open(os.devnull, os.O_RDWR)
    try:
        return forkclient.fork_pod(["poddaemon", "run", "x.toml"], (null, null, null))
    finally:
        os.close(null)


def test_a_server_whose_backlog_is_full_is_passed_over_not_waited_for(env: Env) -> None:
    """Every client that gave up on a stopped or hung server left its connection queued on the
    listener; once its backlog is full a connect() would block for good: the next spawn must
    exec the pod instead of hanging."""
    spawn(env, "lone")
    spawn(env, "one")
    server = server_pid(env)
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    queued: list[socket.socket] = []
    os.kill(server, signal.SIGSTOP)
    try:
        while True:  # fill the backlog, as 65 given-up spawns would
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.setblocking(False)
            try:
                conn.connect(str(sock))
            except BlockingIOError:
                conn.close()
                break
            queued.append(conn)
        manifest = env.manifest("two", write=[str(env.work / "two")])
        done = env.podctl("spawn", str(manifest), timeout=45)
    finally:
        os.kill(server, signal.SIGCONT)
        for conn in queued:
            conn.close()
    assert done.returncode == 0, done.stderr
    assert ppid(pod_pid(env, "two")) != server and answers(env, "two")


ATTACK = """
import json, os, socket, struct, sys
sock, token_file, manifest, *stolen = sys.argv[1:]
try:
    print("token:", open(token_file).read().strip())
except OSError as exc:
    print("token unreadable:", type(exc).__name__)
req = {"argv": ["run", manifest], "env": dict(os.environ), "cwd": "/", "umask": 18,
       "title": ["poddaemon", "run", manifest], "token": "".join(stolen)}
body = json.dumps(req).encode()
s = socket.socket(socket.AF_UNIX)
s.connect(sock)
null = os.open("/dev/null", os.O_RDWR)
try:
    socket.send_fds(s, [struct.pack(">I", len(body)) + body], [null, null, null])
except BrokenPipeError:  # refused before it was read: the reply waits all the same
    pass
print("reply:", s.makefile().readline().strip())
"""


def test_a_sandboxed_command_cannot_have_the_server_fork_a_pod(env: Env) -> None:
    """Found by QA: bash in a confined pod connected to this socket (Landlock lets a socket be
    connected by its path below ABI 9) and had this unconfined process fork a pod from a
    manifest it had written: sandbox off, scope `/`. A request must now carry the token the
    server keeps in the runtime dir, which the sandbox never grants."""
    from poddaemon.registry import Registry
    from poddaemon.sandbox import available

    if not available():
        pytest.skip("no Landlock here")
    spawn(env, "lone")
    spawn(env, "one")  # the server runs
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    evil = env.manifest("evil", write=["/tmp"], extra='[sandbox]\nmode = "off"\n')
    cell = env.work / "jail"
    cell.mkdir()
    script = cell / "attack.py"
    script.write_text(ATTACK)
    token = forkclient.token_path(str(sock))
    command = f"/usr/bin/python3 {script} {sock} {token} {evil}"
    # Then as if it had the token (a socket of its own put in the server's place, where the
    # write scope covers the runtime dir, is sent one by a client): a pod's command all the same.
    stolen = f"{command} {Path(token).read_text().strip()}"
    # And from 70 shells down: the walk up to the runner gave up after 64 ancestors.
    (cell / "deep.sh").write_text('if [ "$1" -gt 0 ]; then bash "$0" $(($1 - 1)); true; else ')
    with (cell / "deep.sh").open("a") as f:
        f.write(f"{stolen}; fi\n")
    deep = f"bash {cell / 'deep.sh'} 70"
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": c}} for c in (command, stolen)]},
        {"tool_calls": [{"name": "bash", "arguments": {"command": deep}}]},
        {"text": "done"},
    )
    jail = env.start("jail", tools=["bash"], write=[str(cell)])
    with jail.client() as c:
        assert c.run_wait("escape").outcome == "finished"
        entries = c.history(since=0, limit=1000).entries
    without, within, nested = [e["item"]["output"] for e in entries if e["kind"] == "tool_result"]
    assert "token unreadable: PermissionError" in without, without
    # A pod's command is refused before its request is read (a trickled one held the server).
    assert "refused: the request comes from a command a pod started" in without, without
    assert "refused: the request comes from a command a pod started" in within, within
    assert "refused: the request comes from a command a pod started" in nested, nested
    assert Registry(env.home / "run").get("evil") is None
    # Without the token, a request from anyone else is refused too (and nothing forked).
    null = os.open(os.devnull, os.O_RDWR)
    try:
        request = forkclient.Request(["run", str(evil)], dict(os.environ), "/", 0o22, [])
        reply = _raw(str(sock), forkclient.encode_request(request), [null, null, null])
    finally:
        os.close(null)
    assert "refused: the request does not carry this server's token" in str(reply), reply
    assert Registry(env.home / "run").get("evil") is None
    assert ppid(spawn(env, "two")) == server_pid(env)  # podctl has the token: it serves on


def test_the_token_is_never_written_or_read_through_a_planted_symlink(tmp_path: Path) -> None:
    """Found by QA: a command whose write scope covered the runtime dir planted symlinks where
    the server's temp token file would be (named by its pid) and read the token through them.
    The token goes to a file of an unguessable name created O_EXCL, renamed over whatever is
    at the token's path; a client reads only a regular 0600 file of its own."""
    from poddaemon import forkserver

    sock = str(tmp_path / "forkserver.k.sock")
    loot = tmp_path / "loot"
    loot.write_text("")
    path = Path(forkclient.token_path(sock))
    path.symlink_to(loot)
    Path(f"{path}.{os.getpid()}").symlink_to(loot)  # where the temp file was: named by pid
    token = forkserver._write_token(str(path))
    assert loot.read_text() == "" and not path.is_symlink()
    assert (path.stat().st_mode & 0o777) == 0o600 and path.read_text().strip() == token
    assert forkclient._read_token(sock) == token
    path.unlink()
    path.symlink_to(loot)
    loot.write_text(token)
    assert forkclient._read_token(sock) is None  # not through a link
    path.unlink()
    path.write_text(token)
    path.chmod(0o644)
    assert forkclient._read_token(sock) is None  # not one others could have written or read


TRICKLE = """
import os, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
null = os.open("/dev/null", os.O_RDWR)
try:  # the server may refuse (reply and hang up) before this reaches it: EPIPE
    socket.send_fds(s, [struct.pack(">I", 1000)], [null, null, null])  # and no body
except BrokenPipeError:
    pass
s.settimeout(30)
print("reply:", s.makefile().readline().strip())
"""


def test_a_sandboxed_command_is_refused_before_it_sends_its_request(env: Env) -> None:
    """Found by QA: a pod's command was refused only once its whole request was read, so one
    that sent it a byte at a time held this one-at-a-time server, and every spawn, for good."""
    from poddaemon.sandbox import available

    if not available():
        pytest.skip("no Landlock here")
    spawn(env, "lone")
    spawn(env, "one")
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    cell = env.work / "jail"
    cell.mkdir()
    (cell / "trickle.py").write_text(TRICKLE)
    command = f"/usr/bin/python3 {cell / 'trickle.py'} {sock}"
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}, {"text": "done"}
    )
    jail = env.start("jail", tools=["bash"], write=[str(cell)])
    with jail.client() as c:
        assert c.run_wait("stall it").outcome == "finished"
        entries = c.history(since=0, limit=1000).entries
    (output,) = [e["item"]["output"] for e in entries if e["kind"] == "tool_result"]
    assert "refused: the request comes from a command a pod started" in output, output


def test_a_request_sent_a_byte_at_a_time_is_given_up(env: Env) -> None:
    """Found by QA: each read had its timeout, the request none: a client sending a byte now
    and then kept the server (every spawn of the user) busy with it for as long as it liked."""
    spawn(env, "lone")
    spawn(env, "one")
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    null = os.open(os.devnull, os.O_RDWR)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock))
        socket.send_fds(s, [struct.pack(">I", 100_000)], [null, null, null])
        os.close(null)
        s.settimeout(1.0)
        reply = b""
        for _ in range(120):  # a byte a second, far longer than any request needs
            try:
                reply = s.recv(4096)
                break
            except TimeoutError:
                s.send(b" ")
    assert b"not complete within" in reply, reply
    assert ppid(spawn(env, "two")) == server_pid(env)


def test_an_open_file_limit_beyond_any_rlimit_is_a_bad_request_not_the_servers_end(
    env: Env,
) -> None:
    """Found by QA: an open-file limit of [1, 2**70] (with the token) raised OverflowError in
    the server's own setrlimit, which nothing caught: the server died, and every client waiting
    on it."""
    spawn(env, "lone")
    spawn(env, "one")
    server = server_pid(env)
    (sock,) = (env.home / "run").glob("forkserver.*.sock")
    token = Path(forkclient.token_path(str(sock))).read_text().strip()
    huge = (("RLIMIT_NOFILE", 1, 2**70),)
    request = forkclient.Request(["--version"], {}, "/", 0o22, [], token, limits=huge)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        reply = _raw(str(sock), forkclient.encode_request(request), [null, null, null])
    finally:
        os.close(null)
    assert "bad request: limits" in str(reply.get("error")), reply
    assert alive(server) and ppid(spawn(env, "two")) == server


def test_the_servers_files_are_0600_under_a_read_only_umask(env: Env) -> None:
    """A server started under umask 0277 made its lock file 0400, and it stays: every later
    server of that user (any umask, any uid but root) died opening it for writing
    ("Permission denied" traceback in forkserver.log) and each `podctl spawn` fell back to exec
    without the shared preloaded pages. Its lock and log are 0600 whatever the umask."""
    for name in ("lone", "two"):  # the second starts the server
        done = _spawn_from(env, name, lambda: os.umask(0o277))
        assert done.returncode == 0, done.stderr
    server_pid(env)
    run = env.home / "run"
    files = [*run.glob("forkserver.*.lock"), *run.glob("forkserver.*.log")]
    assert len(files) == 2
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in files}
    assert modes == {f.name: "0o600" for f in files}


def test_the_start_rehearsal_reads_nothing_of_the_users_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server loads a throwaway manifest once, so that forked pods inherit that work done:
    the user's defaults.toml (a broken one here) is not read, and no file stays behind."""
    from poddaemon import forkserver

    config = tmp_path / "config"
    config.mkdir()
    (config / "defaults.toml").write_text("this is not TOML [")
    monkeypatch.setenv("PODDAEMON_CONFIG_DIR", str(config))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    forkserver._rehearse_start()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config"]
