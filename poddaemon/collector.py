"""The cyclic garbage collector, paused while the process builds what it keeps.

Imports make tens of thousands of objects that live as long as the process (modules, classes,
functions). Collections during them walk those objects again and again and free nothing: a
pod's start-up ran 58 of them before READY (~4 ms of 72), and importing the provider SDKs ran
140, a full one among them (~100 ms of 480 for both). So the collector is paused while the pod
starts, while a thread imports an SDK, and while podctl loads typer and its command. When the
last pause ends, everything that exists is frozen (no collection walks it again; the first one
after a pause would otherwise walk all of it) and the collector runs as usual. The few hundred
objects already unreachable then are frozen too: cheaper than the full collection (16-39 ms)
that would free them.

Pauses may overlap (an SDK imported in a thread while the pod starts): the last one to end
resumes. `resume` without a pause does nothing (a pod forked by the fork server starts with
the collector on).
"""

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pauses = 0


def pause() -> None:
    global _pauses
    with _lock:
        _pauses += 1
        gc.disable()


def resume() -> None:
    global _pauses
    with _lock:
        if _pauses == 0:
            return
        _pauses -= 1
        if _pauses == 0:
            gc.freeze()
            gc.enable()


@contextmanager
def paused() -> Iterator[None]:
    pause()
    try:
        yield
    finally:
        resume()
