"""The pod's event stream: numbered events, a bounded replay buffer, and non-blocking fan-out.

Each event is encoded once into its wire frame and shared by every subscriber. A subscriber whose
connection cannot take more is simply left behind (its cursor stops); when it drains it catches
up from the buffer, or is told `gap` if the buffer no longer holds what it missed. Publishing
never waits for anyone.
"""

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from protocol.types import Event

_FRAME_HEAD = b'{"jsonrpc":"2.0","method":"event","params":'
_encoder = msgspec.json.Encoder()


def event_frame(event: Event) -> bytes:
    return _FRAME_HEAD + _encoder.encode(event) + b"}\n"


class Subscription:
    """One connection's view of the stream: where it is, and how to hand it a frame."""

    def __init__(
        self, write: Callable[[bytes], None], congested: Callable[[], bool], cursor: int
    ) -> None:
        self.write = write
        self.congested = congested
        self.cursor = cursor  # seq of the last event this subscriber has been given


# What the replay buffer may hold in frames' bytes, whatever `capacity` says: an event carries
# a notification's message, a tool call's arguments or a run's final text, each up to a frame
# (8 MiB), so 10,000 of them could hold gigabytes in a long-lived pod. The oldest go first
# (a subscriber that asks for them is told `gap`); the newest is always held.
MAX_HELD_BYTES = 32 * 1024 * 1024


class EventBus:
    def __init__(
        self, capacity: int = 10_000, first_seq: int = 0, max_bytes: int = MAX_HELD_BYTES
    ) -> None:
        # Events are numbered from first_seq + 1. A pod numbers from the µs it started: a
        # cursor a client kept from an earlier life of the pod is then below everything this
        # one holds, so it is told `gap` (numbered from 1 each time, an old cursor read as a
        # position in the new numbering and skipped what the client never saw).
        self.first_seq = self.seq = first_seq
        self._held: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self._capacity = capacity
        self._held_bytes = 0  # the frames' bytes in _held
        self._max_bytes = max_bytes
        self._subs: set[Subscription] = set()

    def publish(self, type: str, data: dict[str, Any], run_id: str | None = None) -> Event:
        # (Lean: one runs per notification, subscribed to or not.)
        seq = self.seq + 1
        event = Event(seq=seq, ts=time.time(), type=type, data=data, run_id=run_id)
        # Numbered only once encoded: a value that cannot be (a lone surrogate) left a seq that
        # no frame held, and every subscriber's catch-up then failed on it for good.
        frame = _FRAME_HEAD + _encoder.encode(event) + b"}\n"  # (event_frame, inline)
        self.seq = seq
        held = self._held
        if len(held) == self._capacity:
            self._held_bytes -= len(held[0][1])  # append drops it
        held.append((seq, frame))
        self._held_bytes += len(frame)
        if self._held_bytes > self._max_bytes:
            while self._held_bytes > self._max_bytes and len(held) > 1:
                self._held_bytes -= len(held.popleft()[1])
        if not self._subs:
            return event
        for sub in self._subs:
            if sub.cursor == seq - 1 and not sub.congested():
                sub.write(frame)
                sub.cursor = seq
                if self.seq != seq:  # writing it published more (a failed log's alert)
                    self.catch_up(sub)
        return event

    @property
    def listened(self) -> bool:
        """Someone subscribed: what is published now may go out at once."""
        return bool(self._subs)

    def forget(self) -> None:
        """Hold nothing published so far: a subscriber that asks for it is told `gap`."""
        self._held.clear()
        self._held_bytes = 0

    def subscribe(self, sub: Subscription) -> None:
        if sub.cursor > self.seq:
            # A cursor past the head is from before the pod restarted (with a clock that went
            # back since): what it missed is not held, and the numbers it will see are lower
            # than its own. Say so, as for any loss (SPEC §5), then go on from the head.
            _tell_gap(sub, self.seq)
        self._subs.add(sub)
        self.catch_up(sub)

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def catch_up(self, sub: Subscription) -> None:
        """Give `sub` what it missed, as far as its connection takes it. (A write may publish,
        or forget: each step looks at the buffer afresh.)"""
        while sub.cursor < self.seq:
            oldest = self._held[0][0] if self._held else self.seq + 1
            if sub.cursor < oldest - 1:
                _tell_gap(sub, oldest - 1)
                continue
            if sub.congested():
                return
            seq, frame = self._held[sub.cursor - oldest + 1]
            sub.write(frame)
            sub.cursor = seq


def _tell_gap(sub: Subscription, seq: int) -> None:
    """`gap {since}`: what `sub` asked for after its cursor is not held; it goes on from `seq`."""
    gap = Event(seq=seq, ts=time.time(), type="gap", data={"since": sub.cursor})
    sub.write(event_frame(gap))
    sub.cursor = seq
