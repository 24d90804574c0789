"""Shared fixtures: a sandboxed PODDAEMON_HOME, a local fake model, real pod processes."""

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from poddaemon.testing.cleanup import kill_spawned
from poddaemon.testing.fake_model import FakeModel
from protocol import PodClient
from protocol.types import Event

ROOT = Path(__file__).resolve().parent.parent
READY = "PODDAEMON-READY"

# A suite started in the background by a non-interactive shell (`make test &`, a CI step run
# so) inherits SIGINT ignored, and exec keeps an ignored signal: every podctl and demo it
# starts would ignore the Ctrl-C the tests send them (three tests hung so). Handled here
# instead, SIGINT is back to its default in every process the tests start.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
PROVIDER_KINDS = ("openai", "openai_responses", "anthropic")


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class PodProcess:
    """A real `poddaemon run` process with its stderr drained in a thread."""

    def __init__(self, proc: subprocess.Popen[str], name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self.socket = ""
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout: float = 20.0) -> "PodProcess":
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"pod not ready after {timeout}s: {self.text()}") from None
            if line is None:
                raise StartFailed(self.proc.wait(), self.text())
            if line.startswith(READY):
                _, name, sock = line.rstrip("\n").split("\t")
                assert name == self.name
                self.socket = sock
                return self

    def text(self) -> str:
        return "".join(self.stderr)

    def final_text(self, timeout: float = 20.0) -> str:
        """Everything the pod wrote to stderr, once it has exited."""
        self.proc.wait(timeout)
        self._reader.join(timeout)
        return self.text()

    def client(self, timeout: float | None = 30.0) -> PodClient:
        return PodClient.connect(self.socket, timeout=timeout)

    def call(self, method: str, **params: Any) -> Any:
        import msgspec

        with self.client() as c:
            return msgspec.json.decode(c.call_raw(method, params or None))

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception), self.client() as c:
                c.shutdown()
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


# Pod arguments for a test that sends inputs up to a frame's size (8 MiB): over the
# default worker.max_input_bytes.
BIG_INPUTS = ("--set", f"worker.max_input_bytes={8 << 20}")


def drained(pod: PodProcess, timeout: float = 30.0) -> None:
    """Wait until the pod is idle with no run and no notification pending (then nothing starts)."""

    def check() -> bool:
        s = pod.call("status")
        return bool(
            s["state"] == "idle" and s["queue"]["notifications"] == 0 and s["queue"]["runs"] == 0
        )

    wait_until(check, timeout, "the pod to be idle with nothing pending")


def flood(pod: PodProcess, n: int) -> None:
    """`n` notifications sent as JSON-RPC notifications (no replies), waited for as `n`
    `notification.committed` events: more than the 10,000 events a pod holds for replay.
    (Text deltas no longer do: the pod coalesces the deltas of one read into one event.)"""
    with pod.client() as watcher:
        watcher.subscribe()
        with pod.client() as sender:
            for i in range(n):
                sender.send_notification("notify", {"message": f"flood {i}", "source": "flood"})
        seen = 0
        for event in watcher.events():
            seen += event.type == "notification.committed"
            if seen == n:
                return


class StartFailed(AssertionError):
    def __init__(self, code: int, stderr: str) -> None:
        super().__init__(f"pod exited {code}: {stderr}")
        self.code = code
        self.stderr = stderr


class Env:
    """One sandboxed home plus helpers to write manifests and start pods in it."""

    def __init__(self, home: Path, model: FakeModel) -> None:
        self.home = home
        self.model = model
        self.work = home / "work"
        self.work.mkdir()
        self.tmp = home / "tmp"  # the pods' commands' temp dirs: gone with the home
        self.tmp.mkdir()
        self.pods: list[PodProcess] = []
        self.env = {
            **os.environ,
            "PODDAEMON_HOME": str(home),
            "FAKE_API_KEY": "test-key",
            "PYTHONPATH": str(ROOT),
            "TMPDIR": str(self.tmp),
        }
        for var in ("PODDAEMON_CONFIG_DIR", "PODDAEMON_DATA_DIR", "PODDAEMON_RUNTIME_DIR"):
            self.env.pop(var, None)
        # A suite run by a systemd service (a CI runner's) would otherwise have every pod
        # exec'd, as pods in a unit are, and no test of the fork server would fork.
        self.env.pop("INVOCATION_ID", None)

    def manifest(
        self,
        name: str = "pod",
        *,
        kind: str = "openai",
        write: list[str] | None = None,
        read: list[str] | None = None,
        tools: list[str] | None = None,
        extra: str = "",
        provider_extra: str = "",
        pwd: str | None = None,
        instruction: str = "You are a test pod.",
    ) -> Path:
        base_url = self.model.url if kind == "anthropic" else self.model.openai_base_url
        write = [str(self.work)] if write is None else write
        if pwd is None:
            pwd = write[0] if write else str(self.work)
            os.makedirs(pwd, exist_ok=True)
        lines = [
            "[pod]",
            f'name = "{name}"',
            f'pwd = "{pwd}"',
            "[provider]",
            f'kind = "{kind}"',
            'model = "fake-model"',
            f'base_url = "{base_url}"',
            'api_key_env = "FAKE_API_KEY"',
            "max_retries = 3",
            "retry_initial_delay = 0.01",
            "retry_max_delay = 0.05",
            provider_extra,
            "[worker]",
            f"instruction = {json.dumps(instruction)}",
        ]
        if tools is not None:
            lines.append(f"tools = {tools!r}".replace("'", '"'))
        for target in write:
            lines += ["[[scope.allow]]", f'target = "{target}"', 'permission = "write"']
        for target in read or []:
            lines += ["[[scope.allow]]", f'target = "{target}"', 'permission = "read"']
        path = self.home / f"{name}.toml"
        path.write_text("\n".join(lines) + "\n" + extra)
        return path

    def popen_args(self) -> list[str]:
        return [sys.executable, "-m", "poddaemon", "run"]

    def popen(
        self, *args: str, preexec_fn: Callable[[], object] | None = None
    ) -> subprocess.Popen[str]:
        """`poddaemon run ARGS`, its stderr a pipe (`preexec_fn`: say a umask or rlimit)."""
        return subprocess.Popen(
            [*self.popen_args(), *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )

    def start(self, name: str = "pod", *args: str, **manifest: Any) -> PodProcess:
        path = self.manifest(name, **manifest)
        pod = PodProcess(self.popen(str(path), *args), name)
        self.pods.append(pod)
        return pod.wait_ready()

    def restart(self, pod: PodProcess, *args: str) -> PodProcess:
        again = PodProcess(self.popen(str(self.home / f"{pod.name}.toml"), *args), pod.name)
        self.pods.append(again)
        return again.wait_ready()

    def podctl(
        self, *args: str, input: str | None = None, timeout: float = 60
    ) -> "subprocess.CompletedProcess[str]":
        return subprocess.run(
            [sys.executable, "-m", "cli.main", *args],
            env=self.env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def podctl_popen(self, *args: str) -> "subprocess.Popen[str]":
        """podctl started, not waited for: its stdout and stderr are pipes (text)."""
        return subprocess.Popen(
            [sys.executable, "-m", "cli.main", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def cleanup(self) -> None:
        for pod in self.pods:
            # Shown by pytest only when the test failed: the pod's own account of it.
            print(f"--- stderr of pod {pod.name} (pid {pod.proc.pid}) ---\n{pod.text()}")
            if pod.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.proc.pid, signal.SIGKILL)
                pod.proc.wait(10)


@pytest.fixture
def fake_model() -> Iterator[FakeModel]:
    with FakeModel().start() as model:
        yield model


def ppid(pid: int) -> int:
    """The parent of a live process (from /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Short paths: Unix socket addresses must fit in 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="pd", dir="/tmp"))
    monkeypatch.setenv("PODDAEMON_HOME", str(path))
    for var in ("PODDAEMON_CONFIG_DIR", "PODDAEMON_DATA_DIR", "PODDAEMON_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    yield path
    kill_spawned(path / "run")
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def env(home: Path, fake_model: FakeModel) -> Iterator[Env]:
    e = Env(home, fake_model)
    try:
        yield e
    finally:
        e.cleanup()


def events_until(client: PodClient, stop: Any) -> list[Event]:
    """The events up to and with the first one `stop` accepts."""
    out: list[Event] = []
    for event in client.events():
        out.append(event)
        if stop(event):
            return out
    raise AssertionError("event stream ended")


# A first reply to script before `paused_at_a_safe_point`: a tool call held until the pause is in.
PAUSABLE = {"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "pausable"}


def paused_at_a_safe_point(env: Env, pod: PodProcess, text: str = "work") -> str:
    """Start a run of `text` on `pod`, whose first model call the fake answers with PAUSABLE,
    pause it while that call waits, and let it reach its safe point: the run ends `paused`.
    Its run id."""
    with pod.client() as c:
        c.subscribe()
        run = c.run(text)
        env.model.wait_for_requests(1)
        assert c.pause().paused
        env.model.open_gate("pausable")
        assert collect_run(c, run.run_id)[-1].data["outcome"] == "paused"
    return run.run_id


def collect_run(client: PodClient, run_id: str | None = None) -> list[Event]:
    """Events from a subscribed connection up to and including the run's `run.finished`."""
    out: list[Event] = []
    for event in client.events():
        out.append(event)
        if event.type == "run.finished" and (run_id is None or event.run_id == run_id):
            return out
    raise AssertionError("event stream ended")
