"""The event bus: numbered events, replay from a cursor, `gap` when the buffer lost what was
asked for, and congested subscribers left behind without blocking anyone, then caught up."""

from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from poddaemon.events import EventBus, Subscription, event_frame
from protocol.core import ClientCore
from protocol.types import Event


@dataclass
class Conn:
    """A subscriber's connection: decodes what it is written, and can be congested."""

    congested: bool = False
    limit: int | None = None  # becomes congested after this many more writes
    events: list[Event] = field(default_factory=list)
    core: ClientCore = field(default_factory=ClientCore)

    def write(self, frame: bytes) -> None:
        assert not self.congested, "written to while congested"
        self.core.feed(frame)  # the client's own decoder must understand the frame
        while self.core.events:
            self.events.append(self.core.events.popleft())
        if self.limit is not None:
            self.limit -= 1
            if self.limit <= 0:
                self.congested = True
                self.limit = None

    def is_congested(self) -> bool:
        return self.congested

    def sub(self, cursor: int) -> Subscription:
        return Subscription(self.write, self.is_congested, cursor)

    @property
    def seqs(self) -> list[int]:
        return [e.seq for e in self.events if e.type != "gap"]

    @property
    def gaps(self) -> list[Event]:
        return [e for e in self.events if e.type == "gap"]


def publish_n(bus: EventBus, n: int) -> None:
    for _ in range(n):
        bus.publish("text.delta", {"text": f"t{bus.seq + 1}"}, run_id="R")


def test_frame_is_a_jsonrpc_event_notification() -> None:
    bus = EventBus()
    ev = bus.publish("state.changed", {"state": "idle"})
    msg = msgspec.json.decode(event_frame(ev))
    assert msg["jsonrpc"] == "2.0" and msg["method"] == "event" and "id" not in msg
    assert msg["params"]["seq"] == 1 and msg["params"]["type"] == "state.changed"
    assert msg["params"]["data"] == {"state": "idle"}
    assert "run_id" not in msg["params"]
    assert event_frame(ev).endswith(b"}\n") and event_frame(ev).count(b"\n") == 1


def test_live_events_arrive_in_order_with_increasing_seq() -> None:
    bus = EventBus()
    a, b = Conn(), Conn()
    bus.subscribe(a.sub(bus.seq))
    bus.subscribe(b.sub(bus.seq))
    publish_n(bus, 5)
    for conn in (a, b):
        assert conn.seqs == [1, 2, 3, 4, 5]
        assert [e.data["text"] for e in conn.events] == ["t1", "t2", "t3", "t4", "t5"]
        assert all(e.run_id == "R" and e.type == "text.delta" for e in conn.events)
        assert conn.gaps == []


def test_subscribing_at_the_head_replays_nothing() -> None:
    bus = EventBus()
    publish_n(bus, 3)
    conn = Conn()
    bus.subscribe(conn.sub(bus.seq))
    assert conn.events == []
    publish_n(bus, 1)
    assert conn.seqs == [4]


def test_replay_from_since_then_live() -> None:
    bus = EventBus()
    publish_n(bus, 5)
    conn = Conn()
    bus.subscribe(conn.sub(2))
    assert conn.seqs == [3, 4, 5]
    publish_n(bus, 2)
    assert conn.seqs == [3, 4, 5, 6, 7]
    other = Conn()
    bus.subscribe(other.sub(0))
    assert other.seqs == [1, 2, 3, 4, 5, 6, 7] and other.gaps == []


def test_gap_when_the_buffer_no_longer_holds_what_was_asked() -> None:
    bus = EventBus(capacity=3)
    publish_n(bus, 10)  # holds 8, 9, 10
    conn = Conn()
    bus.subscribe(conn.sub(2))
    [gap] = conn.gaps
    assert conn.events[0] is gap
    assert gap.data == {"since": 2}
    assert gap.seq == 7  # the last seq the subscriber cannot get
    assert conn.seqs == [8, 9, 10]
    publish_n(bus, 1)
    assert conn.seqs == [8, 9, 10, 11]


def test_no_gap_when_exactly_the_oldest_held_is_next() -> None:
    bus = EventBus(capacity=3)
    publish_n(bus, 10)
    conn = Conn()
    bus.subscribe(conn.sub(7))
    assert conn.gaps == [] and conn.seqs == [8, 9, 10]


def test_the_buffer_holds_at_most_max_bytes_of_frames_the_oldest_dropped_first() -> None:
    """Events carry notification messages, tool arguments and final texts (up to a frame
    each): the replay buffer is bounded in bytes too, not only in events, or a long-lived pod
    holds `capacity` times its largest events. What it dropped is a `gap`, as for the count."""
    bus = EventBus(capacity=10_000, max_bytes=100_000)
    for i in range(1000):
        bus.publish("notification.committed", {"message": "x" * 10_000, "n": i})
    assert sum(len(frame) for _, frame in bus._held) <= 100_000
    assert len(bus._held) >= 9  # as many as fit
    conn = Conn()
    bus.subscribe(conn.sub(bus.first_seq))
    assert len(conn.gaps) == 1
    assert conn.seqs == [seq for seq, _ in bus._held] and conn.seqs[-1] == bus.seq
    big = bus.publish("run.finished", {"text": "y" * 200_000}, "r1")  # the newest is held
    assert conn.seqs[-1] == big.seq and [s for s, _ in bus._held] == [big.seq]
    small = EventBus(capacity=500, max_bytes=100_000)
    for _ in range(5000):  # small events: the count bounds them, as before
        small.publish("text.delta", {"text": "z"})
        bus.publish("text.delta", {"text": "z"})
    assert len(small._held) == 500
    for b in (small, bus):  # the running total stays exact as the deque drops and pops
        assert b._held_bytes == sum(len(frame) for _, frame in b._held) <= 100_000


def test_congested_subscriber_is_skipped_and_catches_up_without_duplicates() -> None:
    bus = EventBus(capacity=100)
    fast, slow = Conn(), Conn()
    s_fast, s_slow = fast.sub(0), slow.sub(0)
    bus.subscribe(s_fast)
    bus.subscribe(s_slow)
    publish_n(bus, 2)
    slow.congested = True
    publish_n(bus, 5)  # publishing never waits for the slow one
    assert fast.seqs == [1, 2, 3, 4, 5, 6, 7]
    assert slow.seqs == [1, 2] and s_slow.cursor == 2
    slow.congested = False
    publish_n(bus, 1)  # still behind: not handed event 8 out of order
    assert slow.seqs == [1, 2]
    bus.catch_up(s_slow)
    assert slow.seqs == [1, 2, 3, 4, 5, 6, 7, 8] and s_slow.cursor == 8
    publish_n(bus, 2)
    bus.catch_up(s_slow)  # nothing more to give: no duplicates
    assert slow.seqs == list(range(1, 11))
    assert fast.seqs == list(range(1, 11))


def test_catch_up_stops_when_the_connection_fills_again_and_resumes_later() -> None:
    bus = EventBus(capacity=100)
    conn = Conn(congested=True)
    sub = conn.sub(0)
    bus.subscribe(sub)
    publish_n(bus, 10)
    assert conn.events == []
    conn.congested = False
    conn.limit = 3
    bus.catch_up(sub)
    assert conn.seqs == [1, 2, 3] and sub.cursor == 3
    conn.congested = False
    conn.limit = 4
    bus.catch_up(sub)
    assert conn.seqs == list(range(1, 8))
    conn.congested = False
    bus.catch_up(sub)
    assert conn.seqs == list(range(1, 11))


def test_congested_past_the_buffer_gets_a_gap_then_what_is_held() -> None:
    bus = EventBus(capacity=4)
    conn = Conn()
    sub = conn.sub(0)
    bus.subscribe(sub)
    publish_n(bus, 2)
    conn.congested = True
    publish_n(bus, 10)  # 3..12 missed; only 9..12 held
    conn.congested = False
    bus.catch_up(sub)
    assert conn.seqs == [1, 2, 9, 10, 11, 12]
    [gap] = conn.gaps
    assert gap.data == {"since": 2} and gap.seq == 8
    assert [e.type for e in conn.events].index("gap") == 2


def test_unsubscribed_connection_gets_nothing_more() -> None:
    bus = EventBus()
    conn = Conn()
    sub = conn.sub(0)
    bus.subscribe(sub)
    publish_n(bus, 2)
    bus.unsubscribe(sub)
    publish_n(bus, 2)
    assert conn.seqs == [1, 2]
    bus.unsubscribe(sub)  # twice is harmless


def test_cursor_ahead_of_the_stream_gets_a_gap_then_new_events() -> None:
    """A client that asks for events after a seq this pod never reached (a cursor from before a
    restart) is told `gap` first: what it missed is not held, and the numbers it sees next are
    below its cursor (a client dropping seqs it has seen would otherwise drop them silently)."""
    bus = EventBus()
    publish_n(bus, 3)
    conn = Conn()
    bus.subscribe(conn.sub(100))
    [gap] = conn.gaps
    assert conn.events == [gap] and gap.data == {"since": 100} and gap.seq == 3
    publish_n(bus, 2)
    assert conn.seqs == [4, 5]


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 8),
    ops=st.lists(
        st.tuples(st.sampled_from(["pub"] * 4 + ["jam", "free", "sub"]), st.integers(0, 2)),
        max_size=100,
    ),
)
def test_random_congestion_never_loses_reorders_or_duplicates(
    capacity: int, ops: list[tuple[str, int]]
) -> None:
    bus = EventBus(capacity=capacity)
    conns = [Conn() for _ in range(3)]
    subs: list[Subscription | None] = [None, None, None]
    # Subscriber 0 is there from the start, so every example exercises at least one.
    subs[0] = conns[0].sub(0)
    bus.subscribe(subs[0])
    start: list[int] = [0, 0, 0]
    for op, i in ops:
        conn = conns[i]
        sub = subs[i]
        if op == "pub":
            publish_n(bus, 1)
        elif op == "jam":
            conn.congested = True
        elif op == "free":
            conn.congested = False
            if sub is not None:
                bus.catch_up(sub)
        elif op == "sub" and sub is None:
            start[i] = bus.seq
            subs[i] = conn.sub(bus.seq)
            bus.subscribe(subs[i])  # type: ignore[arg-type]
    for i, conn in enumerate(conns):
        sub = subs[i]
        if sub is None:
            assert conn.events == []
            continue
        conn.congested = False
        bus.catch_up(sub)
        assert sub.cursor == bus.seq
        event("gap" if conn.gaps else "no gap")
        # Walk the stream: each event follows the previous one, or a gap says what was lost.
        last = start[i]
        for e in conn.events:
            if e.type == "gap":
                assert e.data == {"since": last}
                assert e.seq > last
                last = e.seq
            else:
                assert e.seq == last + 1
                last = e.seq
        assert last == bus.seq
        # Whatever the buffer still holds was delivered.
        held = range(max(start[i], bus.seq - capacity) + 1, bus.seq + 1)
        assert set(held) <= set(conn.seqs)
        if not conn.gaps:
            assert conn.seqs == list(range(start[i] + 1, bus.seq + 1))


def test_an_event_published_while_a_frame_is_written_reaches_the_subscriber_after_it() -> None:
    """Writing a frame may publish (the pod flushes its log before each send; a failed write
    publishes an alert): the subscriber gets both, in order, and stays in step."""
    bus = EventBus()
    conn = Conn()
    nested = []

    def write(frame: bytes) -> None:
        if not nested:
            nested.append(bus.publish("alert", {"level": "error", "message": "log failed"}))
        conn.write(frame)

    bus.subscribe(Subscription(write, conn.is_congested, 0))
    bus.publish("run.finished", {"outcome": "finished"})
    bus.publish("state.changed", {"state": "stopping"})
    assert [(e.seq, e.type) for e in conn.events] == [
        (1, "run.finished"),
        (2, "alert"),
        (3, "state.changed"),
    ]


def test_an_event_published_during_a_catch_up_is_caught_up_too() -> None:
    bus = EventBus()
    conn = Conn(congested=True)
    nested = []

    def write(frame: bytes) -> None:
        if not nested:
            nested.append(bus.publish("alert", {"level": "error", "message": "log failed"}))
        conn.write(frame)

    sub = Subscription(write, conn.is_congested, 0)
    bus.subscribe(sub)
    publish_n(bus, 2)  # held: the connection is congested
    conn.congested = False
    bus.catch_up(sub)  # it drained
    publish_n(bus, 1)
    assert conn.seqs == [1, 2, 3, 4] and not conn.gaps


def test_a_cursor_from_an_earlier_life_of_the_pod_gets_a_gap() -> None:
    """Each pod process numbers from the µs it started: a cursor kept from before a restart is
    below all this one holds (it was read as a position in the new numbering)."""
    bus = EventBus(first_seq=5_000)
    publish_n(bus, 3)
    old = Conn()
    bus.subscribe(old.sub(12))  # from the last life
    [gap] = old.gaps
    assert old.events[0] == gap and gap.data == {"since": 12}
    assert old.seqs == [5_001, 5_002, 5_003]
    fresh = Conn()
    bus.subscribe(fresh.sub(bus.first_seq))  # what `since: 0` asks for: no gap
    assert fresh.gaps == [] and fresh.seqs == [5_001, 5_002, 5_003]
    quiet = EventBus(first_seq=7)
    early = Conn()  # subscribed before anything was published: gets it live, no gap
    quiet.subscribe(early.sub(quiet.first_seq))
    publish_n(quiet, 2)
    assert early.gaps == [] and early.seqs == [8, 9]


def test_an_event_that_cannot_be_encoded_does_not_wedge_the_stream() -> None:
    """A lone surrogate (the model's `\\ud800`) cannot be encoded: its publish raised after the
    seq was taken, and from then on every subscriber's catch-up failed on the missing frame
    (`podctl send` and `attach` waited forever). The seq is taken only once it is encoded."""
    bus = EventBus()
    live = Conn()
    bus.subscribe(live.sub(0))
    bus.publish("text.delta", {"text": "a"})
    with pytest.raises(UnicodeEncodeError):
        bus.publish("text.delta", {"text": "b\ud800"})
    bus.publish("run.finished", {"outcome": "error"})
    late = Conn()
    bus.subscribe(late.sub(0))
    for conn in (live, late):
        assert [(e.seq, e.type) for e in conn.events] == [(1, "text.delta"), (2, "run.finished")]
