"""Session log format: one hash-chained JSON entry per line. Pure: no I/O.

An entry is ``{"seq", "ts", "kind", "prev", "hash", ...body}``:

- ``seq`` counts from 1 with no gaps; ``ts`` is unix seconds; ``kind`` names the entry;
- ``prev`` is the previous entry's ``hash`` (64 zeros for the first entry);
- ``hash`` is the hex SHA-256 of ``prev`` (as ASCII hex) followed by the entry's canonical JSON
  without ``hash``: msgspec's encoding with every object's keys sorted.

The line we write is that canonical JSON with ``"hash"`` appended as the last key, then ``\\n``.
A reader must not rely on that layout: verification decodes the line, drops ``hash`` and
re-encodes canonically, so any writer that produces the same JSON values verifies. (A line in
our layout is checked against its own bytes first: they are what was hashed.)
"""

import gc
import hashlib
import os
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from protocol.unreadable import UNREADABLE

__all__ = [
    "GENESIS",
    "RESERVED_KEYS",
    "LogCorrupt",
    "VerifyResult",
    "encode_entry",
    "encode_line",
    "encode_record",
    "new_session_id",
    "verify",
    "verify_line",
]

GENESIS = "0" * 64
RESERVED_KEYS = frozenset({"seq", "ts", "kind", "prev", "hash"})

_canonical = msgspec.json.Encoder(order="sorted")
_decoder = msgspec.json.Decoder()


class LogCorrupt(Exception):
    """The log is damaged somewhere other than a torn last line.

    ``line`` is 1-based, 0 for the last line when its number is not known (a reader that did
    not count the lines before it). The message is ``line N: <reason>`` (``last line:
    <reason>`` for 0), prefixed by ``path: `` when the file is known.
    """

    def __init__(self, line: int, reason: str, path: str | None = None) -> None:
        self.line = line
        self.reason = reason
        self.path = path
        prefix = f"{path}: " if path else ""
        super().__init__(f"{prefix}{f'line {line}' if line else 'last line'}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.line, self.reason, self.path))


class VerifyResult(msgspec.Struct, kw_only=True):
    """What a verified log holds.

    ``end_offset`` is the byte offset just past the last good line (``len(data)`` unless torn);
    ``torn`` says the bytes after it are an incomplete last line (a write cut short);
    ``head`` is the hash of the last good entry (``GENESIS`` when there is none).
    """

    entries: list[dict[str, Any]]
    end_offset: int
    torn: bool
    head: str


_sha256 = hashlib.sha256


def _hash(prev: str, canonical: bytes) -> str:
    return _sha256(prev.encode("ascii") + canonical).hexdigest()


def encode_entry(
    seq: int, ts: float, kind: str, prev: str, body: Mapping[str, Any]
) -> tuple[bytes, dict[str, Any]]:
    """Encode one entry. Returns the line (ending in ``\\n``) and the entry as ``verify`` would
    read it back (plain JSON values, ``hash`` included).

    ``body`` values may be anything msgspec encodes (Structs included). Raises ``ValueError``
    when a body key is reserved and ``TypeError`` when a value cannot be encoded.
    """
    canonical, digest = _encode(seq, ts, kind, prev, body)
    entry: dict[str, Any] = _decoder.decode(canonical)
    entry["hash"] = digest
    return _line(canonical, digest), entry


def encode_line(
    seq: int, ts: float, kind: str, prev: str, body: Mapping[str, Any]
) -> tuple[bytes, str]:
    """`encode_entry` without reading the entry back: the line and its hash (a writer that
    needs neither the entry nor its JSON values, as the pod's log, saves a decode)."""
    canonical, digest = _encode(seq, ts, kind, prev, body)
    return _line(canonical, digest), digest


def encode_record(seq: int, prev: str, record: dict[str, Any]) -> tuple[bytes, str]:
    """`encode_line` for a record that already holds its own ``kind`` and ``ts`` and no
    ``prev``/``hash`` (a typed entry as ``msgspec.to_builtins`` gives it): ``seq`` and ``prev``
    are set in place, without the copy and the key checks a body from outside needs."""
    record["seq"] = seq
    record["prev"] = prev
    canonical = _canonical.encode(record)
    # _hash and _line inline: this runs for every entry the pod writes.
    digest = _sha256(prev.encode("ascii") + canonical).hexdigest()
    return b"".join((canonical[:-1], b',"hash":"', digest.encode("ascii"), b'"}\n')), digest


def _encode(
    seq: int, ts: float, kind: str, prev: str, body: Mapping[str, Any]
) -> tuple[bytes, str]:
    for key in RESERVED_KEYS:
        if key in body:
            clash = sorted(RESERVED_KEYS.intersection(body))
            raise ValueError(f"entry body uses reserved key(s): {', '.join(clash)}")
    obj = dict(body)
    obj["seq"] = seq
    obj["ts"] = ts
    obj["kind"] = kind
    obj["prev"] = prev
    canonical = _canonical.encode(obj)
    return canonical, _hash(prev, canonical)


def _line(canonical: bytes, digest: str) -> bytes:
    return b"".join((canonical[:-1], _HASH_KEY, digest.encode("ascii"), b'"}\n'))


_HASH_KEY = b',"hash":"'
_HASH_KEY_LEN = len(_HASH_KEY)
_HASH_TAIL = _HASH_KEY_LEN + 64 + len(b'"}')  # what _line appends to the canonical JSON but "}"


def _check_entry(obj: Any, expect_seq: int, prev: str) -> str | None:
    """Why ``obj`` is not the entry expected here, or None when it is (hash excluded)."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    seq = obj.get("seq")
    if type(seq) is not int:
        return "missing or non-integer seq"
    if seq != expect_seq:
        return f"seq {seq}, expected {expect_seq}"
    ts = obj.get("ts")
    if type(ts) is not float and type(ts) is not int:
        return "missing or non-numeric ts"
    if type(obj.get("kind")) is not str:
        return "missing or non-string kind"
    if type(obj.get("hash")) is not str:
        return "missing or non-string hash"
    entry_prev = obj.get("prev")
    if type(entry_prev) is not str:
        return "missing or non-string prev"
    if entry_prev != prev:
        return "prev does not match the previous entry's hash (chain broken)"
    return None


def verify(data: bytes) -> VerifyResult:
    """Verify a whole log.

    Only a last line without its ``\\n`` is a torn write (SPEC §8): it is reported
    (``torn=True``) and left out, everything before it is returned. Any other damage, a complete
    last line that fails to parse or to hash included, raises ``LogCorrupt`` naming the line.
    """
    # Every entry is kept, so the cyclic GC would rescan a growing heap again and again while
    # finding nothing to free (about a third of the time on 100k entries). Pause it.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _verify(data)
    finally:
        if gc_was_enabled:
            gc.enable()


def _verify(data: bytes) -> VerifyResult:
    entries: list[dict[str, Any]] = []
    prev = GENESIS
    offset = 0
    size = len(data)
    lineno = 0
    while offset < size:
        lineno += 1
        nl = data.find(b"\n", offset)
        if nl < 0:
            # No newline: an append cut short, even if what is there happens to parse.
            return VerifyResult(entries=entries, end_offset=offset, torn=True, head=prev)
        obj = verify_line(data[offset:nl], lineno, prev)
        entries.append(obj)
        prev = obj["hash"]
        offset = nl + 1
    return VerifyResult(entries=entries, end_offset=offset, torn=False, head=prev)


def verify_line(line: bytes, lineno: int, prev: str) -> dict[str, Any]:
    """A complete line (without its ``\\n``) as entry number ``lineno``, whose predecessor's
    hash is ``prev``; ``LogCorrupt`` naming the line if it is not."""
    try:
        obj = _decoder.decode(line)
    except UNREADABLE as exc:
        # A complete line was written whole (one write, then acknowledged): if it does not
        # parse, the disk or someone damaged it. That is corruption even on the last line.
        if not line.strip():  # (msgspec calls it "truncated": an editor's extra newline)
            raise LogCorrupt(lineno, "an empty line, where an entry belongs") from None
        raise LogCorrupt(lineno, f"not valid JSON ({exc})") from None
    problem = _check_entry(obj, lineno, prev)
    if problem is not None:
        raise LogCorrupt(lineno, problem)
    result: dict[str, Any] = obj
    digest = obj["hash"]
    # Laid out as we write it, the line's bytes before the hash are the canonical JSON that was
    # hashed: no need to encode it again (a fifth of a restore's time). Any other layout of the
    # same values is re-encoded to be checked, as is a line whose bytes changed.
    cut = len(line) - _HASH_TAIL
    if line[cut : cut + _HASH_KEY_LEN] == _HASH_KEY and _hash(prev, line[:cut] + b"}") == digest:
        return result
    del obj["hash"]
    if _hash(prev, _canonical.encode(obj)) != digest:
        raise LogCorrupt(lineno, "hash mismatch (entry altered)")
    obj["hash"] = digest
    return result


# --- session ids ------------------------------------------------------------------------------

_uuid_lock = threading.Lock()
_last_ms = 0
_last_rand = 0  # the 74 random bits of the last id
_RAND_BITS = 74
_head_ms = -1
_head_high = -1
_head = ""  # all but the last 12 hex digits of the id for (_head_ms, _head_high)
_RAND_MAX = (1 << _RAND_BITS) - 1


# The random bits come from a PRNG seeded once per process from the OS (a getrandom per id cost
# a syscall on every acknowledged notification); a forked child reseeds, so parent and child
# never share a sequence. Ids need to be unique and ordered, not secret.
_rng = random.Random(os.urandom(32))


def _pid_reset() -> None:
    global _last_ms, _last_rand, _head_ms
    _last_ms = 0
    _last_rand = 0
    _head_ms = -1
    _rng.seed(os.urandom(32))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pid_reset)


def new_session_id() -> str:
    """A UUIDv7 (RFC 9562) as a lowercase hyphenated string.

    48-bit unix milliseconds, version 7, variant 0b10, 74 random bits. Monotonic within a
    process: ids made in the same millisecond (or while the clock steps back) increase the
    previous id's random part by a random amount (RFC 9562 §6.2 method 2), so string order is
    creation order.
    """
    global _last_ms, _last_rand, _head_ms, _head_high, _head
    # One is made per notification, so it is kept lean: the clock read outside the lock (a
    # thread that read it earlier only takes the same-millisecond branch), the lock without
    # `with`, and all but the last 12 hex digits formatted only when they change (once per
    # millisecond, nearly: an id made in the same one adds less than 2**32 to the last).
    now = time.time_ns() // 1_000_000
    _uuid_lock.acquire()
    try:
        if now > _last_ms:
            _last_ms, rand = now, _rng.getrandbits(_RAND_BITS)
        else:
            rand = _last_rand + 1 + _rng.getrandbits(32)
            if rand > _RAND_MAX:  # the random part ran out this millisecond: borrow the next one
                _last_ms, rand = _last_ms + 1, _rng.getrandbits(_RAND_BITS)
        _last_rand = rand
        high = rand >> 48  # the 26 random bits before the last 48
        if _last_ms != _head_ms or high != _head_high:
            t = f"{_last_ms & 0xFFFF_FFFF_FFFF:012x}"
            # version 7, 12 random bits; the variant (0b10) atop 14 more
            _head = f"{t[:8]}-{t[8:]}-7{high >> 14:03x}-{0x8000 | high & 0x3FFF:04x}-"
            _head_ms, _head_high = _last_ms, high
        head = _head
    finally:
        _uuid_lock.release()
    return head + "%012x" % (rand & 0xFFFF_FFFF_FFFF)
