"""Wire protocol of poddaemon's control socket, and clients for it.

Imports nothing from `poddaemon` or `cli`: other programs can depend on this package alone.
`AsyncPodClient` lives in `protocol.aio` (importing it pulls in asyncio).
"""

from protocol.client import PodClient
from protocol.errors import ConnectionClosed, PodNotRunning, RpcError
from protocol.types import Event

__all__ = ["ConnectionClosed", "Event", "PodClient", "PodNotRunning", "RpcError"]


def __getattr__(name: str) -> object:
    if name == "AsyncPodClient":
        from protocol.aio import AsyncPodClient

        return AsyncPodClient
    raise AttributeError(name)
