"""What msgspec raises for input that is not JSON: a nesting deeper than its limit is a
RecursionError, invalid UTF-8 inside a string a UnicodeDecodeError (not a DecodeError), and a
str holding a lone surrogate a UnicodeEncodeError.

Its own module, not `protocol.framing`'s: framing is podctl's fast path too (protocol.oneshot),
which must not import msgspec (~10 ms of every `podctl status`)."""

import msgspec

UNREADABLE = (msgspec.DecodeError, UnicodeError, RecursionError)
