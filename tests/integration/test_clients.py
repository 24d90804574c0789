"""The clients a user holds (PodClient, AsyncPodClient, podctl) when the pod under them goes away
or stops answering: real pods, stopped and killed for real."""

import asyncio
import os
import signal

import pytest

from protocol.aio import AsyncPodClient
from protocol.errors import ConnectionClosed
from tests.conftest import Env, PodProcess


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
