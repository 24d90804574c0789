"""Newline-delimited JSON framing as a sans-IO buffer: bytes in, complete lines out."""

# Standard library only (nothing at all): podctl's fast path (protocol.oneshot) frames with it.

DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024
# Replies may be larger than requests (history): a client reads up to this much per frame.
MAX_REPLY_BYTES = 64 * 1024 * 1024
HEAD_BYTES = 256  # kept of an oversize line, so the server can still read its id


class Oversize:
    """Marks a line longer than the limit; its bytes were discarded up to the next newline.

    `head` is the line's first HEAD_BYTES bytes.
    """

    __slots__ = ("head", "size")

    def __init__(self, size: int, head: bytes = b"") -> None:
        self.size = size
        self.head = head

    def __repr__(self) -> str:
        return f"Oversize({self.size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Oversize) and other.size == self.size

    def __hash__(self) -> int:
        return hash(self.size)


class LineFramer:
    """Splits a byte stream into lines without the trailing newline.

    A line that grows past `max_frame_bytes` is reported once as `Oversize` and its remaining
    bytes are skipped, so a huge or endless frame costs bounded memory and the stream stays usable.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._discarding = 0  # bytes of an oversize line skipped so far; 0 when not discarding
        self._head = b""  # the first bytes of the line being skipped

    def feed(self, data: bytes) -> list[bytes | Oversize]:
        n = len(data)
        if (  # the common case first: one whole line, nothing held
            not self._buf
            and not self._discarding
            and data.find(b"\n") == n - 1
            and n <= self.max_frame_bytes
        ):
            line = data[:-1]
            return [line] if line.strip() else []
        out: list[bytes | Oversize] = []
        start = 0
        while start < n:
            nl = data.find(b"\n", start)
            if self._discarding:
                if nl < 0:
                    self._discarding += n - start
                    return out
                out.append(Oversize(self._discarding + nl - start, self._head))
                self._discarding = 0
                self._head = b""
                start = nl + 1
                continue
            if nl < 0:
                self._buf += data[start:]
                if len(self._buf) > self.max_frame_bytes and not self._cr_past(self._buf):
                    self._discarding = len(self._buf)
                    self._head = bytes(self._buf[:HEAD_BYTES])
                    self._buf.clear()
                return out
            if self._buf:
                self._buf += data[start:nl]
                line = bytes(self._buf)
                self._buf.clear()
            else:
                line = data[start:nl]
            start = nl + 1
            if len(line) > self.max_frame_bytes and not self._cr_past(line):
                out.append(Oversize(len(line), line[:HEAD_BYTES]))
            elif line.strip():
                out.append(line)
        return out

    def _cr_past(self, line: bytes | bytearray) -> bool:
        """The one byte past the limit is a CRLF line end's CR: the line itself is within it
        (a request of exactly the limit sent with CRLF, as `nc -C` or a Windows file does)."""
        return len(line) == self.max_frame_bytes + 1 and line[-1] == 0x0D

    def close(self) -> list[bytes | Oversize]:
        """At end of stream: the last line, when it had no newline (as `printf '{...}' | socat`)."""
        return self.feed(b"\n") if self.pending else []

    @property
    def pending(self) -> int:
        """Bytes of an incomplete line held (or being skipped)."""
        return len(self._buf) or self._discarding

    @property
    def held(self) -> int:
        """Bytes of memory the incomplete line holds (a skipped line holds none)."""
        return len(self._buf)
