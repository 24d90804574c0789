"""poddaemon/collector.py: the garbage collector paused while the process builds what it keeps,
then everything frozen and the collector on again, once the last of overlapping pauses ends."""

import gc
import threading
from collections.abc import Iterator

import pytest

from poddaemon import collector


@pytest.fixture(autouse=True)
def restore_collector() -> Iterator[None]:
    assert gc.isenabled() and collector._pauses == 0
    yield
    collector._pauses = 0
    gc.unfreeze()  # this test process's objects: leave them to the collector as before
    gc.enable()


def test_the_last_pause_to_end_freezes_everything_and_turns_the_collector_on() -> None:
    kept = [object() for _ in range(10)]  # built while paused, and tracked (a list)
    collector.pause()
    collector.pause()  # e.g. an SDK import in a thread while the pod starts
    assert not gc.isenabled()
    collector.resume()
    assert not gc.isenabled() and gc.get_freeze_count() == 0  # one pause still holds
    collector.resume()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen: no collection walks it


def test_resume_without_a_pause_changes_nothing() -> None:
    """A pod forked by the fork server never paused: READY's resume is a no-op."""
    collector.resume()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and collector._pauses == 0


def test_pauses_from_two_threads_overlap() -> None:
    inside, release = threading.Event(), threading.Event()

    def sdk_import() -> None:
        with collector.paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=sdk_import)
    with collector.paused():  # start-up
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the thread's pause still holds after start-up's ended
    release.set()
    thread.join(10)
    assert gc.isenabled() and gc.get_freeze_count() > 0
