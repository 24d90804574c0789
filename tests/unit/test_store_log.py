"""The session log format: encoding, the hash chain, torn tails and corruption, UUIDv7 ids."""

import hashlib
import json
import re
import sys
import time
import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poddaemon.history import AssistantMessage, ToolCall
from poddaemon.store.log import (
    GENESIS,
    RESERVED_KEYS,
    LogCorrupt,
    encode_entry,
    encode_record,
    new_session_id,
    verify,
)


def build(bodies: list[tuple[str, dict[str, Any]]]) -> tuple[list[bytes], list[dict[str, Any]]]:
    lines: list[bytes] = []
    entries: list[dict[str, Any]] = []
    prev = GENESIS
    for i, (kind, body) in enumerate(bodies, start=1):
        line, entry = encode_entry(i, 1_700_000_000.0 + i, kind, prev, body)
        lines.append(line)
        entries.append(entry)
        prev = entry["hash"]
    return lines, entries


SAMPLE: list[tuple[str, dict[str, Any]]] = [
    ("session_start", {"pod": "p", "system_prompt": "be nice", "config": {"a": [1, 2]}}),
    ("user_input", {"run_id": "r1", "text": 'héllo "quoted"\n', "mode": "queue"}),
    ("run_start", {"run_id": "r1"}),
    ("assistant", {"item": {"type": "assistant", "text": "hi", "tool_calls": []}}),
    ("llm_usage", {"input": 10, "output": 2, "cache_read": 0, "cache_write": 0}),
    ("run_end", {"run_id": "r1", "outcome": "finished", "text": "hi"}),
]


def test_round_trip() -> None:
    lines, entries = build(SAMPLE)
    result = verify(b"".join(lines))
    assert result.entries == entries
    assert not result.torn
    assert result.end_offset == sum(map(len, lines))
    assert result.head == entries[-1]["hash"]
    for (kind, body), entry in zip(SAMPLE, entries, strict=True):
        assert entry["kind"] == kind
        assert {k: entry[k] for k in body} == body


def test_line_shape_and_hash_definition() -> None:
    line, entry = encode_entry(1, 12.5, "user_input", GENESIS, {"text": "x", "b": {"z": 1, "a": 2}})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    obj = json.loads(line)
    assert obj == entry
    assert obj["seq"] == 1 and obj["ts"] == 12.5 and obj["prev"] == GENESIS
    without = {k: v for k, v in obj.items() if k != "hash"}
    canonical = msgspec.json.encode(without, order="sorted")
    assert obj["hash"] == hashlib.sha256(GENESIS.encode() + canonical).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", obj["hash"])


def test_structs_in_bodies_come_back_as_plain_json() -> None:
    msg = AssistantMessage(text="t", tool_calls=(ToolCall(id="c", name="bash", arguments="{}"),))
    line, entry = encode_entry(1, 1.0, "assistant", GENESIS, {"item": msg})
    assert entry["item"] == msgspec.json.decode(msgspec.json.encode(msg))
    assert entry["item"]["tool_calls"][0]["name"] == "bash"
    assert verify(line).entries == [entry]


def test_key_order_in_the_file_does_not_matter() -> None:
    # Another writer may lay the keys out differently: the hash is over canonical JSON.
    _, entry = encode_entry(1, 1.0, "k", GENESIS, {"zz": 1, "aa": [3, {"y": 1, "x": 2}]})
    shuffled = json.dumps(dict(reversed(list(entry.items())))).encode() + b"\n"
    assert verify(shuffled).entries == [entry]


def test_our_layout_with_other_whitespace_still_verifies() -> None:
    # The hash last, as we write it, but the bytes before it not canonical: the check against
    # the line's own bytes fails, and the canonical re-encoding decides.
    line, entry = encode_entry(1, 1.0, "k", GENESIS, {"zz": 1, "aa": [3, {"y": 1}]})
    spaced = line.replace(b'"kind":', b'"kind": ').replace(b",", b", ", 1)
    assert spaced != line and spaced.endswith(b'"}\n')
    assert verify(spaced).entries == [entry]
    with pytest.raises(LogCorrupt, match="hash mismatch"):  # a value changed: neither check passes
        verify(line.replace(b'"zz":1', b'"zz":2'))


@pytest.mark.parametrize("key", ["seq", "ts", "kind", "prev", "hash"])
def test_reserved_body_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        encode_entry(1, 1.0, "k", GENESIS, {key: 1})


def test_typed_entries_hold_no_key_the_log_sets() -> None:
    """encode_record skips the reserved-key check for typed entries: none may declare one
    (kind, seq and ts are the Entry's own, set by the machine; prev and hash are the log's)."""
    from poddaemon import entries
    from poddaemon.entries import Entry

    kinds = [t for t in vars(entries).values() if isinstance(t, type) and issubclass(t, Entry)]
    assert len(kinds) > 10
    for t in kinds:
        names = {f.encode_name for f in msgspec.structs.fields(t)}
        assert not names & (RESERVED_KEYS - {"seq", "ts"}), t
        assert t is Entry or t.__struct_config__.tag_field == "kind"


def test_a_record_encodes_as_the_same_body_would() -> None:
    body = {"run_id": "r1", "text": "héllo", "mode": "queue"}
    line, entry = encode_entry(7, 1.5, "user_input", GENESIS, body)
    record = {**body, "kind": "user_input", "ts": 1.5}
    assert encode_record(7, GENESIS, record) == (line, entry["hash"])


def test_empty_log() -> None:
    result = verify(b"")
    assert result.entries == [] and not result.torn
    assert result.end_offset == 0 and result.head == GENESIS


def corrupt_at(data: bytes, line_index: int) -> bytes:
    """Flip one character inside a string value of the given (0-based) line."""
    lines = data.splitlines(keepends=True)
    target = lines[line_index]
    pos = target.index(b'"kind":"') + len(b'"kind":"')
    lines[line_index] = target[:pos] + bytes([target[pos] ^ 0x01]) + target[pos + 1 :]
    return b"".join(lines)


@pytest.mark.parametrize("index", [0, 2, 4])
def test_flipped_byte_names_the_line(index: int) -> None:
    lines, _ = build(SAMPLE)
    with pytest.raises(LogCorrupt) as info:
        verify(corrupt_at(b"".join(lines), index))
    assert info.value.line == index + 1
    assert str(info.value).startswith(f"line {index + 1}: ")
    assert "hash" in info.value.reason


def test_bad_json_in_the_middle_names_the_line() -> None:
    lines, _ = build(SAMPLE)
    lines[2] = lines[2][:10] + b"\n"
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join(lines))
    assert info.value.line == 3
    assert "JSON" in info.value.reason


def test_blank_line_in_the_middle_is_corruption() -> None:
    lines, _ = build(SAMPLE)
    lines.insert(3, b"\n")
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join(lines))
    assert info.value.line == 4


def test_reordered_lines() -> None:
    lines, _ = build(SAMPLE)
    lines[2], lines[3] = lines[3], lines[2]
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join(lines))
    assert info.value.line == 3
    assert "seq" in info.value.reason


def test_duplicated_line() -> None:
    lines, _ = build(SAMPLE)
    lines.insert(3, lines[2])
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join(lines))
    assert info.value.line == 4


def test_missing_line() -> None:
    lines, _ = build(SAMPLE)
    del lines[1]
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join(lines))
    assert info.value.line == 2


def test_broken_chain_with_consistent_hashes() -> None:
    # Each entry hashes correctly on its own, but line 3 does not point at line 2.
    lines, _ = build(SAMPLE[:2])
    line3, _ = encode_entry(3, 1.0, "x", "f" * 64, {})
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join([*lines, line3]))
    assert info.value.line == 3
    assert "prev" in info.value.reason


@pytest.mark.parametrize(
    "bad",
    [
        b"[1, 2]",
        b'{"seq": true}',
        b'{"seq": 1, "ts": "x", "kind": "k", "prev": "", "hash": ""}',
    ],
)
def test_malformed_entries_followed_by_more(bad: bytes) -> None:
    lines, _ = build(SAMPLE[:2])
    with pytest.raises(LogCorrupt) as info:
        verify(lines[0] + bad + b"\n" + lines[1])
    assert info.value.line == 2


def test_complete_last_line_with_bad_hash_is_corruption_not_torn() -> None:
    lines, _ = build(SAMPLE)
    with pytest.raises(LogCorrupt) as info:
        verify(corrupt_at(b"".join(lines), len(lines) - 1))
    assert info.value.line == len(lines)


def test_torn_last_line_at_every_offset() -> None:
    lines, entries = build(SAMPLE)
    full = b"".join(lines)
    start = len(full) - len(lines[-1])
    for cut in range(start + 1, len(full)):  # every proper prefix of the last line, incl. no \n
        result = verify(full[:cut])
        assert result.torn, cut
        assert result.entries == entries[:-1]
        assert result.end_offset == start
        assert result.head == entries[-2]["hash"]
    assert not verify(full[:start]).torn
    assert verify(full[:start]).entries == entries[:-1]


def test_unparsable_last_line_with_newline_is_corruption() -> None:
    # SPEC §8: only a line without its newline is torn; a complete one was written whole.
    lines, _ = build(SAMPLE)
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join(lines) + b"\x00\x00\x00\n")
    assert info.value.line == len(lines) + 1 and "JSON" in info.value.reason


@pytest.mark.parametrize("where", ["first", "brace", "middle"])
def test_flipped_byte_of_the_complete_last_line_is_corruption(where: str) -> None:
    lines, _ = build(SAMPLE)
    last = bytearray(lines[-1])
    pos = {"first": 0, "brace": len(last) - 2, "middle": len(last) // 2}[where]
    last[pos] ^= 0x01
    lines[-1] = bytes(last)
    with pytest.raises(LogCorrupt) as info:
        verify(b"".join(lines))
    assert info.value.line == len(lines)


def test_garbage_tail_of_zeros_is_torn() -> None:
    lines, entries = build(SAMPLE)
    result = verify(b"".join(lines) + b"\x00" * 300)
    assert result.torn and result.entries == entries


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.dictionaries(
    st.text(max_size=10).filter(lambda k: k not in {"seq", "ts", "kind", "prev", "hash"}),
    json_values,
    max_size=5,
)
kinds = st.sampled_from(["session_start", "user_input", "assistant", "tool_result", "x"]) | st.text(
    min_size=1, max_size=12
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(kinds, bodies), min_size=1, max_size=12),
    st.floats(min_value=0, max_value=1),
)
def test_truncation_keeps_exactly_the_complete_prefix(
    items: list[tuple[str, dict[str, Any]]], where: float
) -> None:
    lines, entries = build(items)
    data = b"".join(lines)
    cut = int(where * len(data))
    result = verify(data[:cut])
    # Complete lines are those whose newline lies inside the kept bytes.
    ends = [sum(map(len, lines[: i + 1])) for i in range(len(lines))]
    complete = sum(1 for e in ends if e <= cut)
    assert result.entries == entries[:complete]
    assert result.end_offset == (ends[complete - 1] if complete else 0)
    assert result.torn == (cut != result.end_offset)
    assert result.head == (entries[complete - 1]["hash"] if complete else GENESIS)


def test_verify_is_fast_enough() -> None:
    # Not a benchmark, a sanity bound: 100k entries must verify well under 2 s. CPU time, so
    # that other processes on a busy machine do not make it flaky; ~0.5 s on the reference box.
    body = {"item": {"type": "assistant", "text": "hello " * 20, "tool_calls": []}}
    lines, _ = build([("assistant", body)] * 100_000)
    data = b"".join(lines)
    t = time.process_time()
    result = verify(data)
    elapsed = time.process_time() - t
    assert len(result.entries) == 100_000
    assert elapsed < 4.0, elapsed


UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def test_uuid7_format_version_variant_time() -> None:
    before = time.time_ns() // 1_000_000
    sid = new_session_id()
    after = time.time_ns() // 1_000_000
    assert UUID_RE.fullmatch(sid)
    u = uuid.UUID(sid)
    assert u.version == 7
    assert u.variant == uuid.RFC_4122
    ms = u.int >> 80
    assert before <= ms <= after + 1


def test_uuid7_monotonic_and_unique() -> None:
    ids = [new_session_id() for _ in range(20_000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    for sid in ids[:50]:
        assert UUID_RE.fullmatch(sid)


def test_uuid7_from_several_threads_are_unique_and_each_thread_s_ordered() -> None:
    """The clock is read before the lock: a thread that read it earlier must still make an id
    after the last one made."""
    import threading

    made: list[list[str]] = [[] for _ in range(4)]

    def make(out: list[str]) -> None:
        for _ in range(20_000):
            out.append(new_session_id())

    threads = [threading.Thread(target=make, args=(out,)) for out in made]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert all(out == sorted(out) for out in made)
    every = [sid for out in made for sid in out]
    assert len(set(every)) == len(every) == 80_000
    assert all(UUID_RE.fullmatch(sid) for sid in every[::97])


def test_uuid7_digits_are_its_time_and_random_bits() -> None:
    from poddaemon.store import log

    sid = new_session_id()
    u = uuid.UUID(sid)
    rand = ((u.int >> 64) & 0xFFF) << 62 | u.int & ((1 << 62) - 1)
    assert (u.int >> 80, rand) == (log._last_ms, log._last_rand)


def test_uuid7_orders_across_milliseconds() -> None:
    a = new_session_id()
    deadline = time.monotonic() + 1
    while time.time_ns() // 1_000_000 <= uuid.UUID(a).int >> 80 and time.monotonic() < deadline:
        pass
    b = new_session_id()
    assert a < b
    assert uuid.UUID(b).int >> 80 > uuid.UUID(a).int >> 80
