"""PodClient: a blocking client for a pod's control socket (no asyncio import: podctl stays fast).

    with PodClient.connect("reviewer") as pod:
        pod.notify("build failed", source="ci")
"""

import socket
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import msgspec

from protocol.core import ClientCore, clean_params, resolve_socket
from protocol.errors import ConnectionClosed, PodNotRunning
from protocol.types import (
    AcceptedResult,
    CancelResult,
    CompactResult,
    Event,
    HistoryResult,
    NotifyResult,
    OkResult,
    PauseResult,
    ResumeResult,
    RunResult,
    RunWaitResult,
    StatusResult,
    SubscribeResult,
    UsageResult,
)

T = TypeVar("T")


class PodClient:
    def __init__(self, sock: socket.socket, target: str) -> None:
        self._sock = sock
        self._core = ClientCore()
        self.target = target

    @classmethod
    def connect(cls, target: str | Path, timeout: float | None = None) -> "PodClient":
        """Connect to a pod by name (looked up under the runtime dir) or by socket path."""
        path = resolve_socket(target)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            sock.close()
            raise PodNotRunning(str(target), f"no socket at {path}") from exc
        except OSError:
            sock.close()
            raise
        return cls(sock, str(target))

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "PodClient":
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- transport -----------------------------------------------------------------------------

    def _receive(self) -> None:
        data = self._sock.recv(1 << 16)
        if not data:
            raise ConnectionClosed(f"pod {self.target!r} closed the connection")
        self._core.feed(data)

    def call(self, method: str, params: dict[str, Any] | None, result_type: type[T]) -> T:
        request_id, data = self._core.request(method, params)
        self._sock.sendall(data)
        while request_id not in self._core.replies:
            self._receive()
        return self._core.take(request_id, result_type)

    def call_raw(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """Any method, untyped result (podctl rpc)."""
        return self.call(method, params, msgspec.Raw)

    def send_notification(self, method: str, params: dict[str, Any] | None = None) -> None:
        """A JSON-RPC notification: executed by the pod, never answered."""
        self._sock.sendall(self._core.notification(method, params))

    def events(self) -> Iterator[Event]:
        """Events on this connection, after `subscribe`; blocks until each arrives."""
        while True:
            while self._core.events:
                yield self._core.events.popleft()
            self._receive()

    # --- one method per RPC --------------------------------------------------------------------

    def run(
        self,
        input: str,
        mode: Literal["queue", "steer"] = "queue",
        client_key: str | None = None,
    ) -> RunResult:
        params = clean_params({"input": input, "mode": mode, "client_key": client_key})
        return self.call("run", params, RunResult)

    def run_wait(
        self,
        input: str,
        mode: Literal["queue", "steer"] = "queue",
        client_key: str | None = None,
    ) -> RunWaitResult:
        params = clean_params({"input": input, "mode": mode, "client_key": client_key})
        return self.call("run", {**params, "wait": True}, RunWaitResult)

    def notify(
        self, message: str, source: str | None = None, client_key: str | None = None
    ) -> NotifyResult:
        params = clean_params({"message": message, "source": source, "client_key": client_key})
        return self.call("notify", params, NotifyResult)

    def resume(self) -> ResumeResult:
        return self.call("resume", None, ResumeResult)

    def pause(self) -> PauseResult:
        return self.call("pause", None, PauseResult)

    def cancel(self, run_id: str | None = None) -> CancelResult:
        return self.call("cancel", clean_params({"run_id": run_id}), CancelResult)

    def status(self) -> StatusResult:
        return self.call("status", None, StatusResult)

    def history(self, since: int = 0, limit: int | None = None) -> HistoryResult:
        return self.call("history", clean_params({"since": since, "limit": limit}), HistoryResult)

    def usage(self) -> UsageResult:
        return self.call("usage", None, UsageResult)

    def subscribe(self, since: int | None = None) -> SubscribeResult:
        return self.call("subscribe", clean_params({"since": since}), SubscribeResult)

    def compact(self) -> CompactResult:
        return self.call("compact", None, CompactResult)

    def pod_event(
        self, pod: str, kind: str, run_id: str | None = None, text: str | None = None
    ) -> AcceptedResult:
        params = clean_params({"pod": pod, "kind": kind, "run_id": run_id, "text": text})
        return self.call("pod_event", params, AcceptedResult)

    def shutdown(self) -> OkResult:
        return self.call("shutdown", None, OkResult)
