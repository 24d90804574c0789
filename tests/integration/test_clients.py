"""The clients a user holds (PodClient, AsyncPodClient, podctl) when the pod under them goes away
or stops answering: real pods, stopped and killed for real."""

import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol.aio import WRITE_BUFFER_BYTES, AsyncPodClient
from protocol.errors import ConnectionClosed, RpcError
from tests.conftest import BIG_INPUTS, Env, PodProcess, drained, flood, wait_until


def connected(pid: int) -> bool:
    """Whether process `pid` holds a connected Unix socket (its connect() is done)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    # Num RefCount Protocol Flags Type St Inode [Path]; St 03 is SS_CONNECTED
    return any(f[5] == "03" and f[6] in inodes for f in (line.split() for line in lines))


def finish(proc: "subprocess.Popen[str]") -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def stopped_with_a_request_unread(pod: PodProcess) -> None:
    """SIGSTOP the pod: what a client sends it now stays unread in its socket."""
    os.kill(pod.proc.pid, signal.SIGSTOP)


# --- the library: one typed error for a pod that went, whichever syscall notices --------------


def test_sync_client_raises_connection_closed_for_every_call_after_the_pod_died(env: Env) -> None:
    pod = env.start()
    env.model.script({"gate": "never", "text": "too late"})
    with pod.client() as client:
        client.run("hold on")
        env.model.wait_for_requests(1)
        pod.kill9()
        # Writing to a socket whose pod is gone fails with EPIPE: still the pod's doing.
        with pytest.raises(ConnectionClosed, match="closed the connection"):
            client.status()
        with pytest.raises(ConnectionClosed):
            client.send_notification("status")


def test_sync_client_raises_connection_closed_when_the_pod_dies_with_our_request_unread(
    env: Env,
) -> None:
    pod = env.start()
    with pod.client(timeout=0.5) as client:
        client.subscribe()
        stopped_with_a_request_unread(pod)
        with pytest.raises(TimeoutError):
            client.status()  # sent; it lies unread in the stopped pod's socket
        pod.kill9()  # it died with our bytes unread: ECONNRESET, where EOF would say the same
        with pytest.raises(ConnectionClosed, match="closed the connection"):
            next(client.events())


def test_async_client_raises_connection_closed_when_the_pod_dies_with_our_request_unread(
    env: Env,
) -> None:
    pod = env.start()

    async def go() -> None:
        async with await AsyncPodClient.connect(pod.socket) as client:
            await client.status()
            stopped_with_a_request_unread(pod)
            call = asyncio.ensure_future(client.status())
            await asyncio.sleep(0)  # the request is written, unread by the stopped pod
            pod.kill9()
            with pytest.raises(ConnectionClosed, match="closed the connection"):
                await asyncio.wait_for(call, 10)
            with pytest.raises(ConnectionClosed):
                await client.status()

    asyncio.run(go())


def test_async_client_connect_is_a_context_manager_as_the_sync_one_is(env: Env) -> None:
    """The README calls AsyncPodClient the asyncio twin of `with PodClient.connect(...) as pod`:
    `async with AsyncPodClient.connect(...) as pod` works (no `await` between), and closes the
    connection at the block's end; `await AsyncPodClient.connect(...)` still gives the client."""
    pod = env.start()

    async def go() -> None:
        async with AsyncPodClient.connect(pod.socket) as client:
            assert (await client.status()).name == pod.name
        with pytest.raises(ConnectionClosed):
            await client.status()
        async with await AsyncPodClient.connect(pod.socket) as again:
            assert (await again.status()).name == pod.name
        task = asyncio.create_task(AsyncPodClient.connect(pod.socket))  # a coroutine still
        async with await task as third:
            assert (await third.status()).name == pod.name

    asyncio.run(go())


def test_async_client_calls_to_a_pod_that_reads_nothing_wait_instead_of_piling_up(
    env: Env,
) -> None:
    """Calls made while the pod reads nothing (here: stopped) wait for room once a mebibyte of
    requests is unsent, instead of holding every one in memory; once it reads again, all of
    them are answered."""
    pod = env.start()
    message = "x" * 100_000

    async def go() -> None:
        async with await AsyncPodClient.connect(pod.socket) as client:
            await client.status()
            os.kill(pod.proc.pid, signal.SIGSTOP)
            try:
                calls = [asyncio.ensure_future(client.notify(message)) for _ in range(60)]
                await asyncio.sleep(0)  # each call has written its request, or waits for room
                unsent = client._writer.transport.get_write_buffer_size()
                assert unsent <= WRITE_BUFFER_BYTES + len(message) + 1000, unsent
            finally:
                os.kill(pod.proc.pid, signal.SIGCONT)
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
            assert len({r.notification_id for r in results}) == 60

    asyncio.run(go())


# --- podctl: a pod that goes away under a command is "not running" (exit 3), said in one line ---


def test_send_whose_pod_is_killed_mid_run_exits_3_naming_the_run(env: Env) -> None:
    pod = env.start()
    env.model.script({"gate": "never", "text": "too late"})
    send = env.podctl_popen("send", "pod", "hold on")
    try:
        env.model.wait_for_requests(1)  # send's run is acknowledged and under way
        run_id = pod.call("status")["run_id"]
        pod.kill9()
    finally:
        code, out, err = finish(send)
    assert code == 3, (out, err)
    assert err == f"podctl: pod 'pod' is not running: it went away before run {run_id} finished\n"


@pytest.mark.parametrize("command", [["wait"], ["attach"]])
def test_a_command_following_a_pod_that_is_killed_exits_3(env: Env, command: list[str]) -> None:
    pod = env.start()
    env.model.script({"gate": "never", "text": "too late"})
    pod.call("run", input="keep busy")  # `wait` polls a running pod
    follow = env.podctl_popen(*command, "pod")
    try:
        # `wait` is connected for a moment every 50 ms: looked at with wait_until's own 50 ms
        # steps, those moments could be missed for the whole 10 s (one CI run did).
        deadline = time.monotonic() + 20
        while not connected(follow.pid):
            assert time.monotonic() < deadline, f"podctl {command[0]} never connected"
            time.sleep(0.0005)
        pod.kill9()
    finally:
        code, out, err = finish(follow)
    assert code == 3, (out, err)
    assert err.startswith("podctl: pod 'pod' is not running: ") and err.count("\n") == 1, err


def test_status_of_a_pod_killed_before_it_answers_exits_3(env: Env) -> None:
    pod = env.start()
    stopped_with_a_request_unread(pod)
    status = env.podctl_popen("status", "pod")
    try:
        wait_until(lambda: connected(status.pid), what="podctl status to connect")
        pod.kill9()
    finally:
        code, out, err = finish(status)
    assert code == 3, (out, err)
    assert "is not running" in err and len(err.splitlines()) == 1, err


# --- podctl never hangs on a pod that does not answer --------------------------------------------


def test_wait_with_a_timeout_gives_up_on_a_stopped_pod_in_time(env: Env) -> None:
    pod = env.start()
    os.kill(pod.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    waited = env.podctl("wait", "pod", "--timeout", "1", "--json", timeout=60)
    took = time.monotonic() - started
    assert waited.returncode == 4, waited.stderr
    assert json.loads(waited.stdout) == {"idle": False, "status": None}
    assert waited.stderr == "podctl: pod 'pod' not answering after 1 s\n"
    assert took < 15, took  # the status call's own 30 s did not outlast --timeout


def test_wait_without_a_timeout_on_a_stopped_pod_ends_as_its_help_says(env: Env) -> None:
    """`podctl wait pod` (no --timeout) of a SIGSTOPped pod exits 1 after 30 s, "did not
    answer": its help listed only 0, 4 and 3 (and SPEC §6 "block until idle"), so a script
    took the 1 for a bug or the pod's failure. The help now says what it does."""
    helped = env.podctl("wait", "--help")
    assert "without it, one silent for 30 s is an error (exit 1)" in " ".join(
        helped.stdout.split()
    )
    pod = env.start()
    os.kill(pod.proc.pid, signal.SIGSTOP)
    try:
        waited = env.podctl("wait", "pod", timeout=90)
    finally:
        os.kill(pod.proc.pid, signal.SIGCONT)
    assert (waited.returncode, waited.stdout) == (1, "")
    assert waited.stderr == "podctl: pod 'pod' did not answer within 30 s\n"


def test_status_of_a_stopped_pod_is_an_error_not_a_hang(env: Env) -> None:
    pod = env.start()
    os.kill(pod.proc.pid, signal.SIGSTOP)
    status = env.podctl("status", "pod", timeout=60)
    assert status.returncode == 1, status.stderr
    assert status.stderr == "podctl: pod 'pod' did not answer within 10 s\n"


# --- podctl: input that is not UTF-8 is a usage error, never a traceback -------------------------

NOT_UTF8 = "caf\udce9"  # what Python makes of the shell's Latin-1 b"caf\xe9" (surrogateescape)


@pytest.mark.parametrize(
    ("args", "stdin", "said"),
    [
        (["send", "pod", NOT_UTF8], None, "MESSAGE is not UTF-8 text (byte 0xe9)"),
        (["notify", "pod", NOT_UTF8], None, "MESSAGE is not UTF-8 text (byte 0xe9)"),
        (["send", "pod", "-"], b"caf\xe9\n", "stdin is not UTF-8 text (byte 0xe9 at offset 3)"),
        (["notify", "pod", "hi", "--source", NOT_UTF8], None, "an argument is not UTF-8 text"),
        (["rpc", "pod", "notify", f'{{"message": "{NOT_UTF8}"}}'], None, "an argument is not"),
        (["rpc", "pod", "notify", '{"message": "\\ud83d"}'], None, "an argument is not UTF-8"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_input_that_is_not_utf8_is_a_usage_error(
    env: Env, args: list[str], stdin: bytes | None, said: str
) -> None:
    pod = env.start()
    before = pod.call("history")["entries"]
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env={**env.env, "LANG": "C.UTF-8"},
        input=stdin,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().startswith(f"podctl: {said}"), proc.stderr
    assert proc.stderr.count(b"\n") == 1, proc.stderr
    assert pod.call("history")["entries"] == before  # nothing was sent


# --- followers end when their reader does, even while the pod is quiet ---------------------------


def test_next_event_returns_none_when_the_pod_is_quiet_then_the_next_event(env: Env) -> None:
    pod = env.start()
    with pod.client() as client:
        client.subscribe()
        assert client.next_event(timeout=0.2) is None
        pod.call("notify", message="wake up")
        event = client.next_event(timeout=30)
        assert event is not None and event.seq >= 1


def test_next_event_works_on_a_socket_numbered_past_1023(env: Env) -> None:
    """A program that holds many descriptors (a server embedding PodClient) gets its socket
    numbered past select()'s FD_SETSIZE: next_event must still wait on it."""
    import resource

    pod = env.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with pod.client() as client:
            assert client._sock.fileno() >= 1024
            client.subscribe()
            assert client.next_event(timeout=0.2) is None
            pod.call("notify", message="wake up")
            event = client.next_event(timeout=30)
            assert event is not None and event.seq >= 1
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_attach_piped_into_a_reader_that_goes_ends_while_the_pod_is_quiet(env: Env) -> None:
    env.start()
    attach = env.podctl_popen("attach", "pod")
    assert attach.stdout is not None
    wait_until(lambda: connected(attach.pid), what="podctl attach to connect")
    attach.stdout.close()  # `podctl attach pod | head -0`: the reader is gone; no event comes
    code, _, err = finish(attach)
    assert (code, err) == (1, "")  # quietly, as any podctl whose output has no reader


def test_logs_follow_piped_into_a_reader_that_goes_ends_while_nothing_is_written(
    env: Env,
) -> None:
    log = env.home / "run" / "pods" / "quiet" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("2026-01-01 00:00:00.000 poddaemon[1] INFO ready\n")
    logs = env.podctl_popen("logs", "quiet", "-f")
    assert logs.stdout is not None
    assert "INFO ready" in logs.stdout.readline()
    logs.stdout.close()  # `podctl logs quiet -f | head -1`
    code, _, err = finish(logs)
    assert (code, err) == (1, "")


def test_logs_follow_goes_on_in_the_new_file_once_the_log_is_rotated(env: Env) -> None:
    """A pod past 16 MiB of log keeps it as `<name>.log.1` and writes a new `<name>.log` (at
    its start, and while it runs). `podctl logs -f` went on reading the renamed file, which
    nothing writes any more: no line came again, a restart's included (`tail -f`, where it
    has to be `tail -F`)."""
    import queue
    import threading

    logs = env.home / "log"
    logs.mkdir(mode=0o700)
    log = logs / "turning.log"
    log.write_text("2026-01-01 00:00:00.000 poddaemon[1] INFO ready\n")
    follow = env.podctl_popen("logs", "turning", "-f")
    lines: queue.Queue[str] = queue.Queue()
    out = follow.stdout
    assert out is not None
    threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True).start()
    try:
        assert "INFO ready" in lines.get(timeout=10)
        with open(log, "a") as f:  # written before the rotation, read after it: not lost
            f.write("2026-01-01 00:00:01.000 poddaemon[1] INFO the old file's last line\n")
        os.replace(log, logs / "turning.log.1")  # as the pod rotates it
        time.sleep(0.5)  # (the new file comes a moment later)
        log.write_text("2026-01-01 00:00:02.000 poddaemon[1] INFO the new file's first line\n")
        assert "the old file's last line" in lines.get(timeout=10)
        assert "the new file's first line" in lines.get(timeout=10)
    finally:
        follow.kill()
        follow.wait(10)


def test_logs_since_reads_the_lines_the_rotation_moved_to_the_kept_file(env: Env) -> None:
    """Past 16 MiB a pod keeps its log as `<name>.log.1` and starts a new `<name>.log`. A pod
    that ran for days rotated an hour ago: `podctl logs POD --since 2h` showed only the new
    file's lines, the hour before the rotation silently missing (the lines were on disk)."""
    from datetime import datetime, timedelta

    def line(ago: timedelta, text: str) -> str:
        stamp = (datetime.now() - ago).strftime("%Y-%m-%d %H:%M:%S.000")
        return f"{stamp} poddaemon[1] INFO {text}\n"

    logs = env.home / "log"
    logs.mkdir(mode=0o700)
    (logs / "aged.log.1").write_text(
        line(timedelta(hours=5), "too old") + line(timedelta(minutes=90), "before the rotation")
    )
    (logs / "aged.log").write_text(line(timedelta(minutes=30), "after the rotation"))
    shown = env.podctl("logs", "aged", "--since", "2h")
    assert shown.returncode == 0, shown.stderr
    assert "too old" not in shown.stdout
    assert shown.stdout.index("before the rotation") < shown.stdout.index("after the rotation")
    recent = env.podctl("logs", "aged", "--since", "1h")  # nothing wanted from the kept file
    assert "after the rotation" in recent.stdout and "before" not in recent.stdout


def test_ctrl_c_during_send_stops_waiting_and_the_run_goes_on_as_its_help_says(env: Env) -> None:
    pod = env.start()
    assert "Ctrl-C" in env.podctl("send", "--help").stdout
    env.model.script({"gate": "later", "text": "finished anyway"})
    send = env.podctl_popen("send", "pod", "take your time")
    env.model.wait_for_requests(1)
    run_id = pod.call("status")["run_id"]
    send.send_signal(signal.SIGINT)
    code, out, err = finish(send)
    assert code == 130, (out, err)
    assert err == f"podctl: stopped waiting; run {run_id} goes on (podctl cancel pod)\n"
    env.model.open_gate("later")
    waited = env.podctl("wait", "pod", "--timeout", "30")
    assert waited.returncode == 0, waited.stderr
    ends = [e for e in pod.call("history")["entries"] if e["kind"] == "run_end"]
    assert [(e["run_id"], e["outcome"]) for e in ends] == [(run_id, "finished")]


def test_send_out_of_budget_exits_2_as_a_run_that_reaches_its_limit(env: Env) -> None:
    env.model.script({"text": "spent", "usage": {"input": 100, "output": 10}})
    env.start("broke", extra="[budget]\nmax_total_tokens = 50\n")
    spent = env.podctl("send", "broke", "spend it")
    assert spent.returncode == 0, spent.stderr
    for args in (["send"], ["send", "--no-wait"], ["send", "--steer"]):
        refused = env.podctl(*args, "broke", "and more")
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert refused.stderr.startswith("podctl: ") and "(-32007)" in refused.stderr


def test_send_told_gap_takes_its_outcome_from_the_log_instead_of_waiting_for_ever(env: Env) -> None:
    # Nobody reads send's stdout while its 2 MB reply streams: send blocks writing it and stops
    # reading its socket, so the pod leaves it behind (congested) before its run ends. Then
    # 10,100 notifications publish more events than the 10,000 the pod holds: send is told
    # `gap`, and its run.finished was among the events it missed.
    env.model.chunk_size = 8192
    reply = "".join(f"{i:019d}." for i in range(100_000))
    env.model.script({"text": reply})
    pod = env.start(extra="[notify]\nmax_pending = 100000\n")
    send = env.podctl_popen("send", "pod", "a long one")
    try:
        env.model.wait_for_requests(1)
        wait_until(lambda: pod.call("status")["state"] == "idle", 30, "the run to end")
        flood(pod, 10_100)
        drained(pod)
    finally:
        code, out, err = finish(send)
    assert "some events were missed" in err
    assert code == 0, (out[-200:], err)
    # What it streamed before the gap, then the end of the line: most often a part of the
    # reply, but the whole of it when every delta was read before the pod left it behind (the
    # race this test does not pin down: asking for a strict part failed now and then in CI).
    assert out.endswith("\n") and reply.startswith(out[:-1]), (len(out), out[-100:])


# --- the library never waits for events that cannot come -----------------------------------------


def test_waiting_for_events_without_a_subscription_is_an_error_not_a_hang(env: Env) -> None:
    pod = env.start()
    with pod.client(timeout=5) as client:
        with pytest.raises(RuntimeError, match="subscribe"):
            next(client.events())
        with pytest.raises(RpcError):
            client.subscribe(-1)  # refused (-32602): still not subscribed
        with pytest.raises(RuntimeError, match="subscribe"):
            client.next_event(timeout=1)
        client.call_raw("subscribe")
        pod.call("notify", message="now there is one")
        assert client.next_event(timeout=30) is not None

    async def go() -> None:
        async with await AsyncPodClient.connect(pod.socket) as client:
            with pytest.raises(RuntimeError, match="subscribe"):
                await asyncio.wait_for(anext(aiter(client.events())), 5)

    asyncio.run(go())


# --- replies a client can read, however large the session ---------------------------------------


def test_history_larger_than_a_client_reads_at_once_comes_in_pages(env: Env) -> None:
    pod = env.start("pod", *BIG_INPUTS)
    env.model.script({"gate": "never", "text": "held"})
    big = "x" * (7 << 20)  # one input, under the 8 MiB frame limit
    with pod.client() as client:
        client.run("first")
        env.model.wait_for_requests(1)
        for _ in range(10):  # 70 MiB of queued inputs in the log: more than one reply may hold
            client.run(big)
        page = client.history(limit=10_000)
        assert 0 < len(page.entries) < 13 and page.next == page.entries[-1]["seq"]
    shown = env.podctl("history", "pod", "--all", timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert sum(" user_input " in line for line in shown.stdout.splitlines()) == 11


def test_logs_of_a_running_pod_without_a_log_file_is_an_error_not_not_running(env: Env) -> None:
    env.start()  # `poddaemon run` in the foreground: its stderr is ours, no stderr.log
    logs = env.podctl("logs", "pod")
    assert logs.returncode == 1, logs.stderr
    assert logs.stderr.startswith("podctl: pod 'pod' keeps no log file")
    ghost = env.podctl("logs", "ghost")
    assert ghost.returncode == 3, ghost.stderr
    # where podctl spawn keeps it (README: `<log>/<name>.log`), not the runtime dir's old place
    assert f"({env.home / 'log' / 'ghost.log'})" in ghost.stderr, ghost.stderr
    assert "stderr.log" not in logs.stderr + ghost.stderr


def test_logs_are_kept_in_the_log_dir_when_the_runtime_dir_is_wiped(env: Env) -> None:
    """SPEC §2 puts logs in `H/log`; they lived only in `<runtime>/pods/<name>/stderr.log`,
    and a reboot (which wipes the runtime dir) took the reason a pod died with it. The file
    is `<log>/<name>.log`; §7's stderr.log links to it; a long one is kept once as `.1`."""
    logs = env.home / "log"
    logs.mkdir(mode=0o700)
    with open(logs / "kept.log", "wb") as f:  # from earlier starts: over the 16 MiB kept
        f.truncate((16 << 20) + 1)
    spawned = env.podctl("spawn", str(env.manifest("kept")))
    assert spawned.returncode == 0, spawned.stderr
    link = env.home / "run" / "pods" / "kept" / "stderr.log"
    assert link.is_symlink() and link.resolve() == (logs / "kept.log").resolve()
    assert (logs / "kept.log.1").stat().st_size == (16 << 20) + 1
    assert oct((logs / "kept.log").stat().st_mode & 0o777) == "0o600"
    assert env.podctl("stop", "kept").returncode == 0
    shutil.rmtree(env.home / "run")  # as a reboot does
    shown = env.podctl("logs", "kept")
    assert shown.returncode == 0, shown.stderr
    assert "ready on" in shown.stdout and "\0" not in shown.stdout, shown.stdout[:300]


def test_a_running_pods_log_is_rotated_once_it_grows_past_the_bound(env: Env) -> None:
    """Rotated only at start, the log of a pod that runs for months grew until the disk was
    full. Past 16 MiB it is kept as `.log.1` and started afresh while the pod runs."""
    spawned = env.podctl("spawn", str(env.manifest("long")))
    assert spawned.returncode == 0, spawned.stderr
    logs = env.home / "log"
    with open(logs / "long.log", "ab") as f:  # as 16 MiB of the pod's own lines would
        f.write(b"old line\n" * ((16 << 20) // 9 + 1))
    wait_until(lambda: (logs / "long.log.1").exists(), what="the log rotated")
    assert (logs / "long.log.1").stat().st_size > 16 << 20
    assert env.podctl("stop", "long").returncode == 0
    # `stop` returns once the name is free; the pod's last line comes just after.
    wait_until(lambda: "shut down" in (logs / "long.log").read_text(), what="its last line")
    assert "old line" not in (logs / "long.log").read_text()
    assert oct((logs / "long.log").stat().st_mode & 0o777) == "0o600"


def test_a_running_pods_log_is_rotated_after_a_rotation_failed_once(env: Env) -> None:
    """One failed rotation (a full disk for a minute) ended the pod's rotating for good: the
    log of a pod that runs for weeks then grew without bound. It is tried again."""
    spawned = env.podctl("spawn", str(env.manifest("again")))
    assert spawned.returncode == 0, spawned.stderr
    logs = env.home / "log"
    blocker = logs / "again.log.1"
    blocker.mkdir()  # a non-empty directory: renaming the log over it fails, even as root
    (blocker / "x").write_text("x")
    with open(logs / "again.log", "ab") as f:
        f.write(b"old line\n" * ((16 << 20) // 9 + 1))
    wait_until(
        lambda: "could not rotate" in (logs / "again.log").read_text()[-2000:],
        what="the rotation to fail",
    )
    shutil.rmtree(blocker)
    wait_until(lambda: (logs / "again.log.1").is_file(), what="the log rotated after all")
    assert (logs / "again.log.1").stat().st_size > 16 << 20
    assert env.podctl("stop", "again").returncode == 0
    # `stop` returns once the name is free; the pod's last line comes just after.
    wait_until(lambda: "shut down" in (logs / "again.log").read_text(), what="its last line")
    assert "old line" not in (logs / "again.log").read_text()


def to_a_full_disk(env: Env, unbuffered: bool, *args: str) -> "subprocess.CompletedProcess[str]":
    """podctl ARGS with its stdout on /dev/full; its stdio buffered as users have it (this
    machine exports PYTHONUNBUFFERED, which hid a failure), or not."""
    environ = {k: v for k, v in env.env.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        environ["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "cli.main", *args],
            env=environ,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize(
    ("args", "goes_on"),
    [([], True), (["--json"], False), (["--no-wait"], False), (["--no-wait", "--json"], False)],
    ids=["text", "json", "no-wait", "no-wait-json"],
)
def test_send_whose_output_cannot_be_written_does_not_blame_the_pod(
    env: Env, args: list[str], goes_on: bool, unbuffered: bool
) -> None:
    """`podctl send` to a full disk said "cannot talk to pod 'pod': [Errno 28] …": the run
    was acknowledged and goes on, but a script reading that would send it again. Then, with
    stdout buffered (no PYTHONUNBUFFERED), `fail` flushing it first raised the same error
    again: "podctl: No space left on device", not a word of the run; and --no-wait printed
    inside the connection, so its write (unbuffered) still read "cannot talk to pod"."""
    env.start()
    done = to_a_full_disk(env, unbuffered, "send", "pod", "hello", *args)
    assert done.returncode == 1
    goes = r" and goes on \(podctl cancel pod\)" if goes_on else ""
    assert re.fullmatch(
        rf"podctl: cannot write the output: No space left on device; run \S+ was taken{goes}\n",
        done.stderr,
    ), done.stderr


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
def test_notify_whose_output_cannot_be_written_says_it_was_taken(
    env: Env, unbuffered: bool
) -> None:
    """`podctl notify` to a full disk said "podctl: No space left on device": the pod had
    the notification, and a script reading that would send it again."""
    env.start()
    done = to_a_full_disk(env, unbuffered, "notify", "pod", "build failed")
    assert done.returncode == 1
    assert re.fullmatch(
        r"podctl: cannot write the output: No space left on device; notification \S+ was taken\n",
        done.stderr,
    ), done.stderr


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("as_json", [[], ["--json"]], ids=["text", "json"])
def test_attach_whose_output_cannot_be_written_does_not_blame_the_pod(
    env: Env, unbuffered: bool, as_json: list[str]
) -> None:
    """`podctl attach pod --since 0 >/dev/full` said "cannot talk to pod 'pod': [Errno 28] No
    space left on device": its stdout's error, raised inside the connection, read as the
    pod's, which sends one looking at a pod that is fine."""
    pod = env.start()
    assert pod.call("run", input="hello", wait=True)["outcome"] == "finished"  # events to replay
    done = to_a_full_disk(env, unbuffered, "attach", "pod", "--since", "0", *as_json)
    assert (done.returncode, done.stderr) == (
        1,
        "podctl: cannot write the output: No space left on device\n",
    )


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("as_json", [[], ["--json"]], ids=["text", "json"])
def test_compact_whose_output_cannot_be_written_says_it_compacted(
    env: Env, unbuffered: bool, as_json: list[str]
) -> None:
    """`podctl compact pod >/dev/full` said only "No space left on device", exit 1: the pod
    had compacted, and a script reading a failure would compact again (another summary, paid
    for). It says the session the pod went on in."""
    pod = env.start()
    assert pod.call("run", input="hello", wait=True)["outcome"] == "finished"
    before = pod.call("status")["session_id"]
    done = to_a_full_disk(env, unbuffered, "compact", "pod", *as_json)
    after = pod.call("status")["session_id"]
    assert after != before
    assert (done.returncode, done.stderr) == (
        1,
        f"podctl: cannot write the output: No space left on device; pod 'pod' compacted into "
        f"session {after}\n",
    )


def test_logs_of_a_path_that_does_not_answer_is_not_running(env: Env) -> None:
    """`podctl logs PATH` of a socket path nothing listens on joined PATH under <runtime>/pods
    and read `PATH/stderr.log`: any file named so, through `..` too, and a stopped pod's socket
    path never found its log. Like `restart`, it is a pod that is not running (exit 3)."""
    elsewhere = env.home / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stderr.log").write_text("2026-01-01 00:00:00.000 not a pod's log\n")
    for target in (str(elsewhere), "../../elsewhere", str(env.home / "run/pods/gone/sock")):
        logs = env.podctl("logs", target)
        assert logs.returncode == 3, (target, logs.stderr)
        assert logs.stdout == ""
        assert logs.stderr == f"podctl: pod '{target}' is not running; show its log by name\n"


ANSWER_TIMEOUT = 30.0  # what a pod has to answer podctl (cli.app.ANSWER_TIMEOUT)
# Every command that asks a pod something: none may wait for ever for the answer.
ASKING = [
    ["notify", "pod", "build failed"],
    ["send", "pod", "never sent"],  # (it asks `subscribe` first: that is not answered)
    ["send", "pod", "hi", "--no-wait"],
    ["pause", "pod"],
    ["resume", "pod"],
    ["cancel", "pod"],
    ["history", "pod"],
    ["attach", "pod"],
]


def podctl_while_stopped(
    env: Env, pod: PodProcess, *args: str
) -> "subprocess.CompletedProcess[str]":
    """`podctl ARGS` while the pod is SIGSTOPped (it is woken again afterwards, if still there)."""
    os.kill(pod.proc.pid, signal.SIGSTOP)
    try:
        return env.podctl(*args)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pod.proc.pid, signal.SIGCONT)


def test_stop_of_a_pod_that_cannot_answer_sends_it_sigterm_after_its_timeout(env: Env) -> None:
    """A pod that does not answer on its socket (stopped here; wedged, or out of file
    descriptors) is still the registry's: after the stop's timeout it gets SIGTERM, which a pod
    takes as `shutdown`, and SIGCONT, so a stopped one wakes to take it (as systemd does)."""
    pod = env.start()
    stop = podctl_while_stopped(env, pod, "stop", "pod")
    assert (stop.returncode, stop.stdout) == (0, "stopped pod\n"), stop.stderr
    assert stop.stderr == (
        f"podctl: pod 'pod' did not answer in time; sent SIGTERM to pid {pod.proc.pid}\n"
    )
    assert pod.proc.wait(10) == 0  # a requested shutdown
    assert json.loads(env.podctl("ls", "--json").stdout) == []


def test_restart_of_a_pod_that_cannot_answer_stops_it_by_its_pid_and_starts_it(
    env: Env,
) -> None:
    """It took a pod that does not answer for one not running, and the start failed on the
    name the stopped pod still held."""
    pod = env.start()
    out = podctl_while_stopped(env, pod, "restart", "pod")
    try:
        assert out.returncode == 0, out.stderr
        assert f"sent SIGTERM to pid {pod.proc.pid}" in out.stderr
        assert pod.proc.wait(10) == 0
        again = json.loads(env.podctl("status", "pod", "--json").stdout)
        assert again["pid"] != pod.proc.pid
    finally:
        env.podctl("stop", "pod")


def _starve_of_descriptors(pid: int) -> None:
    """Leave process `pid` no descriptor to take: its limit set to its lowest free descriptor
    number, and set again while it still closes some (right after READY it does: a clean-up's
    scandir, its SDK's warm-up reading files). A limit at the number of descriptors it held
    left it one to accept with once such a file was closed. It can open none meanwhile, so its
    set only shrinks: settled once the lowest free number has stayed put for ten looks."""
    seen: list[int] = []

    def settled() -> bool:
        held = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        free = next(n for n in range(len(held) + 1) if n not in held)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (free, free))
        seen.append(free)
        return len(seen) >= 10 and len(set(seen[-10:])) == 1

    wait_until(settled, 10, "the pod to stop closing descriptors")


def test_stop_of_a_pod_out_of_file_descriptors_sends_it_sigterm(env: Env) -> None:
    """A live pod that cannot take a connection (no file descriptor left for it) is stopped
    by its registered pid, not called 'not running'; named here by a symlink to its socket."""
    pod = env.start()
    _starve_of_descriptors(pod.proc.pid)
    link = env.home / "pod.sock"
    link.symlink_to(pod.socket)
    stop = env.podctl("stop", str(link))
    assert stop.returncode == 0, stop.stderr
    assert f"sent SIGTERM to pid {pod.proc.pid}" in stop.stderr
    assert pod.proc.wait(10) == 0


def test_no_command_hangs_on_a_stopped_pod(env: Env) -> None:
    """notify, send, pause, … waited for ever on a SIGSTOPped pod (status and wait did not):
    `podctl notify` in a cron job or CI step never ended. Each now gives up after 30 s."""
    pod = env.start()
    os.kill(pod.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    procs = [env.podctl_popen(*args) for args in ASKING]  # at once: ANSWER_TIMEOUT once
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=ANSWER_TIMEOUT + 30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        results.append((proc.returncode, out, err))
    took = time.monotonic() - started
    for args, result in zip(ASKING, results, strict=True):
        said = "podctl: pod 'pod' did not answer within 30 s"
        if args[0] == "notify" or args[-1] == "--no-wait":  # not "failed": a retry would
            said += "; it may have taken what was sent, or take it once it runs again"
        elif args[0] == "send":  # it waits for the answer to `subscribe`, asked first
            said += "; the message was not sent"
        assert result == (1, "", said + "\n"), args
    assert took < ANSWER_TIMEOUT + 20, took
    # Nothing sent was lost, only the answers: the pod reads it all once it runs again.
    os.kill(pod.proc.pid, signal.SIGCONT)

    def notified() -> bool:
        with pod.client() as client:
            return any(e.get("text") == "build failed" for e in client.history().entries)

    wait_until(notified, 20, "the notification, read late")

    def inputs() -> list[str]:
        return [e["text"] for e in pod.call("history")["entries"] if e["kind"] == "user_input"]

    # The --no-wait send's input, read late too; not the waiting one's, never sent.
    assert wait_until(inputs, 20, "the input sent with --no-wait") == ["hi"]


def test_ctrl_c_before_a_stopped_pod_answered_input_says_it_may_still_take_it(env: Env) -> None:
    """Ctrl-C while a stopped (or slow) pod has not acknowledged a notification: a silent 130
    read as "not sent", yet the pod takes it once it runs again; sent again, it came twice."""
    pod = env.start()
    os.kill(pod.proc.pid, signal.SIGSTOP)
    try:
        proc = env.podctl_popen("notify", "pod", "build failed")
        wait_until(lambda: proc.poll() is not None or connected(proc.pid), 20, "podctl connected")
        proc.send_signal(signal.SIGINT)
        result = finish(proc)
    finally:
        os.kill(pod.proc.pid, signal.SIGCONT)
    assert result == (
        130,
        "",
        "podctl: interrupted before pod 'pod' answered; "
        "it may have taken what was sent, or take it once it runs again\n",
    )


def test_stop_of_a_pod_whose_backlog_is_full_waits_for_room(env: Env) -> None:
    """Clients that connect faster than the pod accepts (a burst, or one in a tight loop) fill
    its listen backlog. `podctl stop` then failed at once, "[Errno 11] Resource temporarily
    unavailable" with its 30 s timeout untouched, and the pod ran on: a client with a timeout
    connected without waiting. It waits for room, as a blocking connect does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"filling a backlog of up to 4096 takes more descriptors than {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 8192), hard))
    pod = env.start()
    os.kill(pod.proc.pid, signal.SIGSTOP)  # it accepts nothing: its backlog fills up
    held: list[socket.socket] = []
    try:
        while True:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.setblocking(False)
            held.append(client)
            try:
                client.connect(pod.socket)
            except BlockingIOError:
                break
        stop = env.podctl_popen("stop", "pod")

        def waiting() -> bool:
            if stop.poll() is not None:
                return True  # (failed at once: asserted below)
            with contextlib.suppress(OSError):
                return Path(f"/proc/{stop.pid}/wchan").read_text() == "unix_wait_for_peer"
            return False

        wait_until(waiting, 30, "podctl to wait for room in the backlog")
    finally:
        for client in held:
            client.close()
        os.kill(pod.proc.pid, signal.SIGCONT)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out, err = stop.communicate(timeout=60)
    assert (stop.returncode, out, err) == (0, "stopped pod\n", "")
    assert pod.proc.wait(10) == 0
