"""The pod's JSON-RPC methods: each decodes nothing (the server gives typed params) and either
answers from the pod's state or runs a command through the machine."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from poddaemon.store.log import new_session_id
from protocol.types import (
    CancelParams,
    HistoryParams,
    NoParams,
    NotifyParams,
    PodEventParams,
    RunParams,
    SubscribeParams,
)

if TYPE_CHECKING:
    from poddaemon.pod import Pod

Handler = Callable[[Any, Any], Any]


def handlers(pod: "Pod") -> dict[str, Handler]:
    m = pod.machine

    async def run(p: RunParams, conn: Any) -> Any:
        return await pod.request(lambda t: m.run(t, p.input, p.mode, p.client_key, p.wait))

    async def notify(p: NotifyParams, conn: Any) -> Any:
        return await pod.request(lambda t: m.notify(t, p.message, p.source, p.client_key))

    async def pod_event(p: PodEventParams, conn: Any) -> Any:
        event_id = p.event_id or new_session_id()
        return await pod.request(
            lambda t: m.child_report(t, p.pod, p.kind, event_id, p.run_id, p.text)
        )

    async def pause(p: NoParams, conn: Any) -> Any:
        return await pod.request(m.pause)

    async def resume(p: NoParams, conn: Any) -> Any:
        return await pod.request(m.resume)

    async def cancel(p: CancelParams, conn: Any) -> Any:
        return await pod.request(lambda t: m.cancel(t, p.run_id))

    async def shutdown(p: NoParams, conn: Any) -> Any:
        return await pod.request(m.shutdown)

    async def history(p: HistoryParams, conn: Any) -> Any:
        return await pod.history(p)

    return {
        "run": run,
        "notify": notify,
        "pod_event": pod_event,
        "pause": pause,
        "resume": resume,
        "cancel": cancel,
        "shutdown": shutdown,
        "status": lambda p, conn: pod.status(),
        "history": history,
        "usage": lambda p, conn: pod.usage(),
        "subscribe": lambda p, conn: pod.subscribe(p.since, conn),
        "compact": lambda p, conn: pod.compact(),
    }


__all__ = ["SubscribeParams", "handlers"]
