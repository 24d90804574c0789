"""poddaemon/collector.py: the garbage collector paused while the process builds what it keeps,
then everything frozen and the collector on again, once the last of overlapping pauses ends."""

import gc
import threading
from collections.abc import Iterator

import pytest

from poddaemon import collector
from tests.conftest import wait_until


@pytest.fixture(autouse=True)
def restore_collector() -> Iterator[None]:
    # An SDK import another test left running in a thread holds a pause until it is done.
    wait_until(lambda: collector._pauses == 0, what="no pause held")
    assert gc.isenabled()
    yield
    collector._pauses = 0
    gc.unfreeze()  # this test process's objects: leave them to the collector as before
    gc.enable()


def test_the_last_pause_to_end_freezes_everything_and_turns_the_collector_on() -> None:
    frozen = gc.get_freeze_count()  # other tests may have loaded an SDK in this process
    kept = [object() for _ in range(10)]  # built while paused, and tracked (a list)
    collector.pause()
    collector.pause()  # e.g. an SDK import in a thread while the pod starts
    assert not gc.isenabled()
    collector.resume()
    assert not gc.isenabled() and gc.get_freeze_count() == frozen  # one pause still holds
    collector.resume()
    assert gc.isenabled() and gc.get_freeze_count() > frozen
    assert not any(o is kept for o in gc.get_objects())  # frozen: no collection walks it


def test_resume_without_a_pause_changes_nothing() -> None:
    """A pod forked by the fork server never paused: READY's resume is a no-op."""
    frozen = gc.get_freeze_count()
    collector.resume()
    assert gc.isenabled() and gc.get_freeze_count() == frozen and collector._pauses == 0


def test_pauses_from_two_threads_overlap() -> None:
    inside, release = threading.Event(), threading.Event()

    def sdk_import() -> None:
        with collector.paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=sdk_import)
    frozen = gc.get_freeze_count()
    with collector.paused():  # start-up
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the thread's pause still holds after start-up's ended
    release.set()
    thread.join(10)
    assert gc.isenabled() and gc.get_freeze_count() > frozen
