"""A new subscription: what the pod has staged is written before anything is replayed, so the
events of entries a failed write lost are never replayed."""

from typing import Any

from poddaemon.events import EventBus
from poddaemon.server import Connection, RpcServer
from protocol.methods import METHODS
from tests.unit.test_server_backlog import Transport


def test_a_subscription_replays_nothing_a_failed_write_lost() -> None:
    bus = EventBus()
    staged = ["run_end"]  # committed while nobody listened, not yet written

    def before_send() -> None:  # as the pod's PodLog.flush, when the write fails
        if staged:
            staged.clear()
            bus.forget()
            bus.publish("alert", {"level": "error", "message": "No space left on device"})

    handlers: dict[str, Any] = {name: (lambda p, conn: {}) for name in METHODS}
    bus.publish("run.finished", {"outcome": "finished"}, "r1")  # held for replay
    conn = Connection(RpcServer(handlers, bus, before_send=before_send))
    transport = Transport()
    conn.transport = transport  # type: ignore[assignment]
    conn.start_events(0)
    told = [f["params"]["type"] for f in transport.frames]
    assert told == ["gap", "alert"], told
