"""The NDJSON framer: bytes in any chunking give back exactly the lines sent, oversize lines are
reported once and skipped in bounded memory, and bytes are passed through undecoded."""

import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.framing import LineFramer, Oversize

# Lines as the framer delivers them: no newline inside, and not blank (blank lines are skipped).
lines_st = (
    st.binary(min_size=1, max_size=60)
    .map(lambda b: b.replace(b"\n", b"x"))
    .filter(lambda b: b.strip() != b"")
)


def feed_chunks(framer: LineFramer, data: bytes, cuts: list[int]) -> list[bytes | Oversize]:
    out: list[bytes | Oversize] = []
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    for a, b in itertools.pairwise(bounds):
        out += framer.feed(data[a:b])
    return out


@given(lines=st.lists(lines_st, max_size=30), cuts=st.lists(st.integers(0, 2000), max_size=40))
def test_random_chunking_gives_back_exactly_the_lines(lines: list[bytes], cuts: list[int]) -> None:
    framer = LineFramer(max_frame_bytes=1000)
    data = b"".join(line + b"\n" for line in lines)
    assert feed_chunks(framer, data, cuts) == lines
    assert framer.pending == 0


@given(lines=st.lists(lines_st, max_size=20))
def test_one_byte_at_a_time(lines: list[bytes]) -> None:
    framer = LineFramer(max_frame_bytes=1000)
    data = b"".join(line + b"\n" for line in lines)
    out: list[bytes | Oversize] = []
    for i in range(len(data)):
        out += framer.feed(data[i : i + 1])
    assert out == lines


def test_many_frames_in_one_read() -> None:
    framer = LineFramer()
    frames = [b'{"id":%d}' % i for i in range(500)]
    assert framer.feed(b"\n".join(frames) + b"\n") == frames


def test_incomplete_tail_is_held_until_its_newline() -> None:
    framer = LineFramer()
    assert framer.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert framer.pending == 4
    assert framer.feed(b":2}") == []
    assert framer.pending == 7
    assert framer.feed(b"\n") == [b'{"b":2}']
    assert framer.pending == 0


def test_blank_and_whitespace_lines_are_skipped() -> None:
    framer = LineFramer()
    assert framer.feed(b"\n\n  \n{}\n\t\n\n[]\n") == [b"{}", b"[]"]
    assert framer.feed(b"\n") == []


def test_empty_feed_is_harmless() -> None:
    framer = LineFramer()
    assert framer.feed(b"") == []
    assert framer.feed(b"ab") == []
    assert framer.feed(b"") == []
    assert framer.feed(b"\n") == [b"ab"]


def test_line_of_exactly_the_limit_is_delivered() -> None:
    framer = LineFramer(max_frame_bytes=10)
    assert framer.feed(b"0123456789\n") == [b"0123456789"]
    assert framer.feed(b"01234") == []
    assert framer.feed(b"56789") == []
    assert framer.pending == 10
    assert framer.feed(b"\n") == [b"0123456789"]


def test_line_of_exactly_the_limit_ended_by_crlf_is_delivered() -> None:
    """CRLF line ends are accepted (README); the CR ends the line, it is not part of it. A
    request of exactly the limit sent with CRLF was refused as oversize: whole, and (worse)
    when its CR arrived before its LF, which switched the framer to discarding."""
    framer = LineFramer(max_frame_bytes=10)
    assert framer.feed(b"0123456789\r\n") == [b"0123456789\r"]
    assert framer.feed(b"0123456789\r") == []
    assert framer.feed(b"\n") == [b"0123456789\r"]
    assert framer.feed(b"0123456789\rx\n") == [Oversize(12)]  # a CR inside is content
    assert _sizes(framer.feed(b"0123456789x\r\n")) == [12]
    assert framer.feed(b"ok\n") == [b"ok"]


def _sizes(out: list[bytes | Oversize]) -> list[int | bytes]:
    return [o.size if isinstance(o, Oversize) else o for o in out]


def test_oversize_line_in_one_chunk_is_reported_once_and_the_rest_delivered() -> None:
    framer = LineFramer(max_frame_bytes=10)
    out = framer.feed(b"before\n" + b"x" * 25 + b"\nafter\nlast\n")
    assert [type(o) for o in out] == [bytes, Oversize, bytes, bytes]
    assert _sizes(out) == [b"before", 25, b"after", b"last"]
    assert framer.pending == 0


def test_oversize_line_across_many_chunks_is_reported_once_with_its_size() -> None:
    framer = LineFramer(max_frame_bytes=10)
    out = framer.feed(b"ok\n" + b"y" * 4)
    for _ in range(20):
        out += framer.feed(b"y" * 3)
    out += framer.feed(b"yy\nnext\n")
    assert _sizes(out) == [b"ok", 4 + 60 + 2, b"next"]
    assert sum(isinstance(o, Oversize) for o in out) == 1
    # The stream is usable afterwards.
    assert framer.feed(b"again\n") == [b"again"]


def test_oversize_crossing_the_limit_in_the_chunk_with_the_newline() -> None:
    framer = LineFramer(max_frame_bytes=10)
    assert framer.feed(b"abcdefgh") == []
    out = framer.feed(b"ijklmnop\nq\n")
    assert _sizes(out) == [16, b"q"]


@given(
    pre=st.lists(lines_st, max_size=5),
    big=st.integers(11, 300),
    post=st.lists(lines_st, max_size=5),
    cuts=st.lists(st.integers(0, 700), max_size=30),
)
def test_oversize_under_random_chunking(
    pre: list[bytes], big: int, post: list[bytes], cuts: list[int]
) -> None:
    framer = LineFramer(max_frame_bytes=10)
    short_pre = [p[:10] for p in pre]
    short_post = [p[:10] for p in post]
    data = b"".join(p + b"\n" for p in short_pre) + b"z" * big + b"\n"
    data += b"".join(p + b"\n" for p in short_post)
    out = feed_chunks(framer, data, cuts)
    assert _sizes(out) == [*short_pre, big, *short_post]


def test_endless_line_holds_bounded_memory() -> None:
    limit = 1024
    framer = LineFramer(max_frame_bytes=limit)
    chunk = b"e" * 4096
    for i in range(1, 200):
        assert framer.feed(chunk) == []
        # What is held in memory never exceeds the limit, however long the line runs...
        assert len(framer._buf) <= limit
        # ...while `pending` counts the bytes being skipped (see its docstring).
        assert framer.pending == i * len(chunk)
    out = framer.feed(b"tail\n{}\n")
    assert _sizes(out) == [199 * 4096 + 4, b"{}"]
    assert framer.pending == 0


def test_endless_line_grown_slowly_is_dropped_as_soon_as_it_passes_the_limit() -> None:
    framer = LineFramer(max_frame_bytes=100)
    for _ in range(1000):
        framer.feed(b"abc")
        assert len(framer._buf) <= 100


def test_invalid_utf8_passes_through_as_bytes_and_the_decoder_rejects_it() -> None:
    framer = LineFramer()
    bad = b'{"jsonrpc":"2.0","method":"\xff\xfe"}'
    assert framer.feed(bad + b"\n" + b'{"ok":1}\n') == [bad, b'{"ok":1}']
    # The decoder, not the framer, rejects it. Note: msgspec 0.22 raises UnicodeDecodeError
    # here, which is a ValueError but NOT a msgspec.DecodeError, so whoever maps decode failures
    # to -32700 must catch ValueError (or UnicodeDecodeError) too.
    with pytest.raises(ValueError) as info:
        msgspec.json.decode(bad)
    assert isinstance(info.value, UnicodeDecodeError | msgspec.DecodeError)
    # Invalid bytes outside a string are a plain DecodeError.
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(b"\xff")
    # Split in the middle of a multi-byte character: bytes are joined back unchanged.
    good = '{"t":"é€😀"}'.encode()
    assert feed_chunks(framer, good + b"\n", [7, 8, 9, 12]) == [good]
    assert msgspec.json.decode(good) == {"t": "é€😀"}
