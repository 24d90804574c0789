"""Issue 2: a pod process from manifest to shutdown, the registry, and the socket's robustness."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poddaemon.registry import Registry
from protocol import PodClient, PodNotRunning
from tests.conftest import Env, StartFailed, wait_until


def registry(env: Env) -> dict:
    path = env.home / "run" / "pods.json"
    return json.loads(path.read_text())["pods"] if path.exists() else {}


def test_start_status_stop(env: Env) -> None:
    pod = env.start("alpha")
    assert pod.socket == str(env.home / "run" / "pods" / "alpha" / "sock")
    assert oct(os.stat(pod.socket).st_mode & 0o777) == "0o600"
    assert oct(os.stat(env.home / "run").st_mode & 0o777) == "0o700"
    with pod.client() as c:
        status = c.status()
    assert (status.name, status.pid, status.state) == ("alpha", pod.proc.pid, "idle")
    assert status.scope[0].target == str(env.work) and status.scope[0].permission == "write"
    assert registry(env)["alpha"]["pid"] == pod.proc.pid
    assert pod.stop() == 0
    assert not os.path.exists(pod.socket)
    assert not (env.home / "run" / "pods" / "alpha" / "pid").exists()
    assert registry(env) == {}
    with pytest.raises(PodNotRunning):
        PodClient.connect(pod.socket)


def test_the_collector_is_back_on_after_ready(env: Env) -> None:
    """`python -m poddaemon` starts with the garbage collector paused (for start-up time), and
    the SDK's import after READY pauses it again: a pod that stayed that way would grow with
    every cycle it makes. Once a run has used the SDK, `kill -USR1` must report it on."""
    pod = env.start("gamma")
    with pod.client() as c:
        assert c.run_wait("hello").outcome == "finished"
    pod.proc.send_signal(signal.SIGUSR1)
    line = wait_until(
        lambda: next((x for x in pod.stderr if x.startswith("collector ")), None),
        what="the collector line of the USR1 dump",
    )
    # One log record, stamped as every line is (its lines were bare prints: `podctl logs
    # --since` hid them).
    heads = [x for x in pod.stderr if "WARNING kill -USR1: where the pod's tasks" in x]
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert len(heads) == 1 and re.match(stamp, heads[0]), pod.stderr
    match = re.fullmatch(r"collector (on|OFF), (\d+) objects frozen\n", line)
    assert match is not None, line
    assert match[1] == "on"
    assert int(match[2]) > 10_000  # start-up's objects: no collection walks them again


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # SIGHUP: a terminal closed
def test_a_stop_signal_is_a_graceful_shutdown(env: Env, sig: int) -> None:
    pod = env.start("beta")
    pod.proc.send_signal(sig)
    assert pod.proc.wait(20) == 0
    assert registry(env) == {}
    assert not os.path.exists(pod.socket)


def test_overlapping_write_scope_is_refused_naming_the_holder(env: Env) -> None:
    first = env.start("first")
    (env.work / "sub").mkdir()
    with pytest.raises(StartFailed) as failed:
        env.start("second", write=[str(env.work / "sub")])
    assert failed.value.code != 0
    assert "'first'" in failed.value.stderr and str(env.work / "sub") in failed.value.stderr
    # Reading the same tree never conflicts.
    reader = env.start("reader", write=[str(env.home / "other")], read=[str(env.work)])
    assert reader.call("status")["state"] == "idle"
    assert first.call("status")["state"] == "idle"


def test_a_write_scope_reaching_the_same_files_through_a_bind_mount_is_refused(
    env: Env,
) -> None:
    """Paths are not files: a bind mount of the first pod's tree gave the second pod write
    access to the same files under another path, and both wrote them."""
    real, alias = env.work / "real", env.home / "alias"
    (real / "sub").mkdir(parents=True)
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(real), str(alias)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        env.start("original", write=[str(real / "sub")])
        with pytest.raises(StartFailed) as failed:
            env.start("aliased", write=[str(alias)])
        assert "pod 'original' (pid " in failed.value.stderr
        assert f"write access to files that {alias} reaches (the same files, through a bind" in (
            failed.value.stderr
        )
        elsewhere = env.home / "elsewhere"
        elsewhere.mkdir()
        assert env.start("apart", write=[str(elsewhere)]).call("status")["state"] == "idle"
    finally:
        try:
            env.cleanup()
        finally:  # (never leave it: removing the test's home would go through it)
            subprocess.run(["umount", str(alias)], check=True)


def test_a_write_scope_with_another_pods_files_bind_mounted_under_it_is_refused(
    env: Env,
) -> None:
    """The other way round: the second pod's tree is mounted inside the first one's."""
    theirs, mine = env.work / "theirs", env.home / "mine"
    theirs.mkdir()
    (mine / "sub").mkdir(parents=True)
    inside = mine / "sub"
    if subprocess.run(
        ["mount", "--bind", str(theirs), str(inside)], capture_output=True
    ).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        env.start("owner", write=[str(theirs)])
        with pytest.raises(StartFailed) as failed:
            env.start("container", write=[str(mine)])
        assert "pod 'owner' (pid " in failed.value.stderr
        assert f"files that {mine} reaches (the same files, through a bind mount)" in (
            failed.value.stderr
        )
    finally:
        try:
            env.cleanup()
        finally:  # (never leave it: removing the test's home would go through it)
            subprocess.run(["umount", str(inside)], check=True)


def test_duplicate_name_is_refused(env: Env) -> None:
    env.start("twin")
    (env.home / "elsewhere").mkdir()
    with pytest.raises(StartFailed) as failed:
        env.start("twin", write=[str(env.home / "elsewhere")])
    assert "a pod named 'twin' is already running" in failed.value.stderr


def test_kill9_then_the_next_start_reclaims_entry_and_socket(env: Env) -> None:
    pod = env.start("phoenix")
    pod.kill9()
    assert "phoenix" in registry(env)  # nobody cleaned up ...
    assert os.path.exists(pod.socket)  # ... a stale socket file is left behind
    again = env.restart(pod)
    assert again.call("status")["pid"] == again.proc.pid
    assert registry(env)["phoenix"]["pid"] == again.proc.pid


def test_start_up_errors_name_the_problem(env: Env) -> None:
    bad = env.manifest("bad", extra="[bogus]\nx = 1\n")
    proc = env.popen(str(bad))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0
    assert f"{bad}:" in err and "bogus: unknown key" in err
    outside = env.manifest("outside", pwd="/")
    proc = env.popen(str(outside))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0 and "pod.pwd: / is not readable under the pod's scope" in err
    # The error shows what the allow rules resolved to: a relative target is under pod.pwd.
    assert f"scope.allow resolves to {env.work} (write)" in err
    env.env.pop("FAKE_API_KEY")
    nokey = env.manifest("nokey")
    proc = env.popen(str(nokey))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0 and "FAKE_API_KEY" in err
    assert registry(env) == {}


def test_an_allow_target_that_does_not_exist_is_named_at_start(env: Env) -> None:
    missing = env.home / "typo" / "dir"
    pod = env.start("typo", read=[str(missing)])
    warning = next(line for line in pod.stderr if "does not exist" in line)
    assert f"scope.allow[1].target: {missing} does not exist" in warning
    assert pod.call("status")["state"] == "idle"  # a warning: it may be made later


def test_ready_is_sent_to_notify_socket(env: Env, tmp_path_factory: pytest.TempPathFactory) -> None:
    addr = str(env.home / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(addr)
        listener.settimeout(20)
        env.env["NOTIFY_SOCKET"] = addr
        pod = env.start("sdpod")
        assert listener.recv(100) == b"READY=1"
        assert listener.recv(100) == b"STATUS=idle"
        pod.stop()
        # STATUS lines may come in between; STOPPING=1 must come before the pod exits.
        messages = []
        while not any(b"STOPPING=1" in m for m in messages):
            messages.append(listener.recv(100))


def test_other_uid_is_refused(env: Env) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another uid")
    pod = env.start("guarded")
    # Open the path up so the connection reaches the server: SO_PEERCRED must refuse it.
    for p in (env.home, env.home / "run", env.home / "run" / "pods", os.path.dirname(pod.socket)):
        os.chmod(p, 0o755)
    os.chmod(pod.socket, 0o777)
    probe = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "data=b''\n"
        "while chunk := s.recv(4096): data += chunk\n"
        "print(data.decode())\n"
    )
    # The probe needs an interpreter that uid 65534 may execute (pyenv's lives under /root).
    python = next(
        (p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None
    )
    if python is None:
        pytest.skip("no system python3 that another uid can run")
    out = subprocess.run(
        [python, "-c", probe, pod.socket],
        user=65534,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["error"]["message"] == "permission denied"
    assert "result" not in reply
    assert pod.call("status")["state"] == "idle"


# --- protocol robustness against a live pod ---------------------------------------------------

SAFE_METHODS = ["status", "history", "usage", "pause", "cancel", "resume", "nosuch", ""]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "jsonrpc": st.sampled_from(["2.0", "1.0", 2]),
        "id": st.integers() | st.text(max_size=5) | st.none() | st.lists(st.integers(), max_size=2),
        "method": st.sampled_from(SAFE_METHODS) | st.integers(),
        "params": json_values,
    },
)
garbage_frames = st.one_of(
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" ")),
    json_values.map(lambda v: msgspec.json.encode(v)),
    request_like.map(lambda v: msgspec.json.encode(v)),
    st.lists(request_like, max_size=4).map(lambda v: msgspec.json.encode(v)),
    request_like.map(lambda v: msgspec.json.encode(v)[: max(1, len(msgspec.json.encode(v)) // 2)]),
)


@pytest.fixture
def fuzz_pod(env: Env):  # type: ignore[no-untyped-def]
    pod = env.start("fuzz")
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(pod.socket)
    sock.settimeout(20)
    # One read buffer for the connection, kept across examples: a reply may come after the
    # probes that follow it (`history` is answered from a task) and span the next recv.
    yield pod, sock, bytearray()
    sock.close()


def read_until_ids(sock: socket.socket, wanted: set[str], buf: bytearray) -> dict[str, dict]:
    found: dict[str, dict] = {}
    while wanted - found.keys():
        chunk = sock.recv(1 << 16)
        assert chunk, "pod closed the connection"
        buf += chunk
        *lines, rest = bytes(buf).split(b"\n")
        buf[:] = rest
        for line in lines:
            msg = json.loads(line)  # every reply line is valid JSON
            for reply in msg if isinstance(msg, list) else [msg]:
                assert reply["jsonrpc"] == "2.0"
                if isinstance(reply.get("id"), str) and reply["id"].startswith("probe-"):
                    found[reply["id"]] = reply
    return found


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=st.lists(garbage_frames, min_size=100, max_size=100))
def test_fuzzed_frames_never_break_the_connection(fuzz_pod, frames: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    """20 examples x 100 garbled frames, each followed by a well-formed request."""
    pod, sock, buf = fuzz_pod
    payload = bytearray()
    wanted = set()
    for i, frame in enumerate(frames):
        rid = f"probe-{i}"
        wanted.add(rid)
        payload += frame + b"\n"
        payload += msgspec.json.encode({"jsonrpc": "2.0", "id": rid, "method": "status"}) + b"\n"
    sock.sendall(payload)
    replies = read_until_ids(sock, wanted, buf)
    assert all(r["result"]["name"] == "fuzz" for r in replies.values())
    assert pod.proc.poll() is None


def test_error_codes_and_the_connection_survives(env: Env) -> None:
    pod = env.start("codes", extra="")
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(pod.socket)
    sock.settimeout(20)
    big = (
        b'{"jsonrpc":"2.0","id":9,"method":"status","params":{"x":"'
        + b"a" * (9 * 1024 * 1024)
        + b'"}}'
    )
    frames = [
        b"{not json",
        b'{"jsonrpc":"2.0","id":1}',
        b'{"jsonrpc":"2.0","id":2,"method":"bogus"}',
        b'{"jsonrpc":"2.0","id":3,"method":"run","params":{"input":5}}',
        b'{"jsonrpc":"2.0","id":4,"method":"run","params":{"inputx":"a"}}',
        big,
        b"\xff\xfe\xfd",
        b"[]",
        b'[{"jsonrpc":"2.0","id":5,"method":"status"},{"jsonrpc":"2.0","method":"status"},{"id":6}]',
        b'{"jsonrpc":"2.0","method":"status"}',
        b'{"jsonrpc":"2.0","id":"last","method":"status"}',
    ]
    sock.sendall(b"\n".join(frames) + b"\n")
    buf = b""
    replies: list = []
    while not any(isinstance(r, dict) and r.get("id") == "last" for r in replies):
        chunk = sock.recv(1 << 16)
        assert chunk
        buf += chunk
        *lines, buf = buf.split(b"\n")
        replies += [json.loads(line) for line in lines]
    codes = [r["error"]["code"] if isinstance(r, dict) and "error" in r else r for r in replies]
    assert codes[:4] == [-32700, -32600, -32601, -32602]
    assert "params.input" in replies[3]["error"]["message"]
    assert codes[4] == -32602 and "inputx" in replies[4]["error"]["message"]
    assert codes[5] == -32600 and "max_frame_bytes" in replies[5]["error"]["message"]
    assert codes[6] == -32700
    assert codes[7] == -32600
    batch = replies[8]
    assert isinstance(batch, list) and len(batch) == 2  # the notification gets no reply
    assert batch[0]["result"]["name"] == "codes" and batch[1]["error"]["code"] == -32600
    assert batch[1]["id"] == 6
    assert replies[9]["id"] == "last"  # the notification produced nothing
    assert len(replies) == 10


def test_invalid_utf8_inside_a_string_is_a_parse_error(env: Env) -> None:
    pod = env.start("utf")
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(pod.socket)
    sock.settimeout(20)
    sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"st\xff\xfeatus"}\n')
    sock.sendall(b'{"jsonrpc":"2.0","id":2,"method":"status"}\n')
    buf = b""
    while buf.count(b"\n") < 2:
        chunk = sock.recv(4096)
        assert chunk, "connection closed"
        buf += chunk
    first, second = (json.loads(line) for line in buf.split(b"\n")[:2])
    assert first["error"]["code"] == -32700
    assert second["result"]["name"] == "utf"


@contextlib.contextmanager
def registry_lock_held(env: Env) -> Iterator[None]:
    """Another process holds pods.json's lock (flock) and does not let go until the end."""
    lock = env.home / "run" / "pods.json.lock"
    holder = subprocess.Popen(
        ["flock", str(lock), "-c", "echo held; exec sleep 60"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def test_a_session_the_registry_could_not_name_is_named_once_it_can(env: Env) -> None:
    """Someone holds pods.json's lock while a compaction starts a new session: the registry
    cannot name it (the lock times out). The reply still comes, and the pod asks again until
    the registry names the session, which is what refuses a second pod restoring it (the
    failure was logged and the session marked named, so it never was)."""
    pod = env.start("naming")
    assert pod.call("run", input="hello", wait=True)["outcome"] == "finished"
    registry = Registry(env.home / "run")
    with registry_lock_held(env):
        session = pod.call("compact")["session_id"]  # after the first try timed out
        # Written before the reply went, read by the harness's stderr thread maybe after it
        wait_until(lambda: "cannot name session" in pod.text(), what="the warning")
    entry = wait_until(
        lambda: (e := registry.get("naming")) is not None and e.session == session and e,
        timeout=20,
        what="the new session named in the registry",
    )
    assert entry.pid == pod.proc.pid


def test_a_stuck_registry_lock_does_not_hold_a_stop(env: Env) -> None:
    """Someone holds pods.json's lock and does not let go: a stopping pod gives up its entry
    after a short wait (left stale: its process is gone, so the next transaction reclaims it),
    and `podctl stop` says it stopped (it said 'did not stop within 10 s' as the pod exited)."""
    pod = env.start("locked")
    with registry_lock_held(env):
        stop = env.podctl("stop", "locked")
        assert (stop.returncode, stop.stdout) == (0, "stopped locked\n"), stop.stderr
        assert pod.proc.wait(5) == 0
        assert "could not release the registry entry (left stale)" in pod.final_text()
    assert env.start("locked").call("status")["name"] == "locked"  # the stale entry reclaimed


def test_a_write_scope_of_the_whole_filesystem_is_named_at_start(env: Env) -> None:
    """A write rule for / (a relative target with one `..` too many, say) took every other
    pod's write scope without a word: the next pod's refusal was the first anyone heard of it."""
    pod = env.start("everything", write=["/"])
    warning = next(line for line in pod.stderr if "whole filesystem" in line)
    assert "scope.allow[0]: write access to / (the whole filesystem)" in warning, warning
    proc = env.popen(str(env.manifest("next", write=[str(env.work)])))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0 and "scope conflict: pod 'everything'" in err, err
    assert pod.stop() == 0
    narrow = env.start("narrow", write=[str(env.home / "narrow")])
    assert not any("whole filesystem" in line for line in narrow.stderr)
