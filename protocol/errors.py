"""JSON-RPC error codes (SPEC §5) and the exceptions clients see."""

from typing import Any

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

NOT_PAUSED = -32001
QUEUE_FULL = -32002
NOT_RUNNING = -32003
SHUTTING_DOWN = -32004
SCOPE_DENIED = -32005
CONFLICTING_CLIENT_KEY = -32006
BUDGET_EXHAUSTED = -32007
BUSY = -32008
HOOK_REFUSED = -32009


class RpcError(Exception):
    """An error reply from a pod (or one the server is about to send)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message
        self.data = data


class PodNotRunning(Exception):
    """No pod answers at that name or socket."""

    def __init__(self, target: str, reason: str = "") -> None:
        detail = f": {reason}" if reason else ""
        super().__init__(f"pod {target!r} is not running{detail}")
        self.target = target


class ConnectionClosed(Exception):
    """The pod closed the connection before answering."""
