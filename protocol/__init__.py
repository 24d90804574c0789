"""Wire protocol of poddaemon's control socket, and clients for it.

Imports nothing from `poddaemon` or `cli`: other programs can depend on this package alone.
`AsyncPodClient` lives in `protocol.aio` (importing it pulls in asyncio).
"""

from __future__ import annotations

from protocol.errors import (
    BudgetExhausted,
    Busy,
    ConflictingClientKey,
    ConnectionClosed,
    FrameTooLarge,
    HookRefused,
    NotPaused,
    NotRunning,
    PodNotRunning,
    QueueFull,
    RpcError,
    ScopeDenied,
    ShuttingDown,
    UnsafeSocket,
)

PROTOCOL_VERSION = 1  # of the wire format SPEC §5 describes; `--version` says it

TYPE_CHECKING = False  # True for type checkers only: typing costs podctl ~5 ms to import
if TYPE_CHECKING:
    from protocol.aio import AsyncPodClient
    from protocol.client import PodClient
    from protocol.types import Event

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncPodClient",
    "BudgetExhausted",
    "Busy",
    "ConflictingClientKey",
    "ConnectionClosed",
    "Event",
    "FrameTooLarge",
    "HookRefused",
    "NotPaused",
    "NotRunning",
    "PodClient",
    "PodNotRunning",
    "QueueFull",
    "RpcError",
    "ScopeDenied",
    "ShuttingDown",
    "UnsafeSocket",
]


def __getattr__(name: str) -> object:
    # Loaded on first use: `protocol.paths` alone must not pay for msgspec (podctl ls is fast).
    if name == "PodClient":
        from protocol.client import PodClient

        return PodClient
    if name == "AsyncPodClient":
        from protocol.aio import AsyncPodClient

        return AsyncPodClient
    if name == "Event":
        from protocol.types import Event

        return Event
    raise AttributeError(name)
