"""Newline-delimited JSON framing as a sans-IO buffer: bytes in, complete lines out."""

DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024


class Oversize:
    """Marks a line longer than the limit; its bytes were discarded up to the next newline."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"Oversize({self.size})"


class LineFramer:
    """Splits a byte stream into lines without the trailing newline.

    A line that grows past `max_frame_bytes` is reported once as `Oversize` and its remaining
    bytes are skipped, so a huge or endless frame costs bounded memory and the stream stays usable.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._discarding = 0  # bytes of an oversize line skipped so far; 0 when not discarding

    def feed(self, data: bytes) -> list[bytes | Oversize]:
        out: list[bytes | Oversize] = []
        start = 0
        n = len(data)
        while start < n:
            nl = data.find(b"\n", start)
            if self._discarding:
                if nl < 0:
                    self._discarding += n - start
                    return out
                out.append(Oversize(self._discarding + nl - start))
                self._discarding = 0
                start = nl + 1
                continue
            if nl < 0:
                self._buf += data[start:]
                if len(self._buf) > self.max_frame_bytes:
                    self._discarding = len(self._buf)
                    self._buf.clear()
                return out
            if self._buf:
                self._buf += data[start:nl]
                line = bytes(self._buf)
                self._buf.clear()
            else:
                line = data[start:nl]
            start = nl + 1
            if len(line) > self.max_frame_bytes:
                out.append(Oversize(len(line)))
            elif line.strip():
                out.append(line)
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete line held (or being skipped)."""
        return len(self._buf) or self._discarding
