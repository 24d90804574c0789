"""JSON-RPC error codes (SPEC §5) and the exceptions clients see.

Every application error code has its own `RpcError` subclass, so callers can write
`except QueueFull:`; each is still an `RpcError` with `.code`, `.message` and `.data`.
"""

from __future__ import annotations

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from typing import Any, ClassVar

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


class ApplicationError(RpcError):
    """Base of the per-code errors: constructed from a message alone."""

    CODE: ClassVar[int]

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(self.CODE, message, data)


class NotPaused(ApplicationError):
    CODE = NOT_PAUSED


class QueueFull(ApplicationError):
    CODE = QUEUE_FULL


class NotRunning(ApplicationError):
    CODE = NOT_RUNNING


class ShuttingDown(ApplicationError):
    CODE = SHUTTING_DOWN


class ScopeDenied(ApplicationError):
    CODE = SCOPE_DENIED


class ConflictingClientKey(ApplicationError):
    CODE = CONFLICTING_CLIENT_KEY


class BudgetExhausted(ApplicationError):
    CODE = BUDGET_EXHAUSTED


class Busy(ApplicationError):
    CODE = BUSY


class HookRefused(ApplicationError):
    CODE = HOOK_REFUSED


class FrameTooLarge(RpcError):
    """A request the client refused to send: its frame is over the pod's `max_frame_bytes`."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            INVALID_REQUEST,
            f"request of {size} bytes exceeds the frame limit of {limit} bytes "
            f"({limit / 2**20:g} MiB, the pod's max_frame_bytes); nothing was sent",
        )
        self.size = size
        self.limit = limit


_BY_CODE = {cls.CODE: cls for cls in ApplicationError.__subclasses__()}


def error_for(code: int, message: str, data: Any = None) -> RpcError:
    """The exception for an error reply: the code's own subclass when it has one."""
    cls = _BY_CODE.get(code)
    return cls(message, data) if cls is not None else RpcError(code, message, data)


class PodNotRunning(Exception):
    """No pod answers at that name or socket."""

    def __init__(self, target: str, reason: str = "") -> None:
        detail = f": {reason}" if reason else ""
        super().__init__(f"pod {target!r} is not running{detail}")
        self.target = target


class ConnectionClosed(Exception):
    """The pod closed the connection before answering (it went, or dropped this client)."""


# What the socket raises when the pod's end is gone: the clients raise ConnectionClosed for it,
# so a caller never mistakes it for a broken pipe of its own (stdout into `head`).
LOST = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class UnsafeSocket(PermissionError):
    """The socket (or the process behind it) belongs to another user: nothing was sent to it."""


def os_error_line(exc: OSError) -> str:
    """One line for an OSError, for the pod's and podctl's messages: its own words when it was
    raised with them (an unsafe directory), else its reason, after its file when it has one."""
    if exc.strerror is None:
        return str(exc)
    return f"{exc.filename}: {exc.strerror}" if exc.filename is not None else exc.strerror
