"""Session logs: the entry format and hash chain (``log``, pure) and the file store (``file``)."""

from poddaemon.store.file import (
    HeadMoved,
    SessionInfo,
    SessionLog,
    list_sessions,
    newest_session_for,
    read_session,
    session_path,
)
from poddaemon.store.log import (
    GENESIS,
    RESERVED_KEYS,
    LogCorrupt,
    VerifyResult,
    encode_entry,
    new_session_id,
    verify,
)

__all__ = [
    "GENESIS",
    "RESERVED_KEYS",
    "HeadMoved",
    "LogCorrupt",
    "SessionInfo",
    "SessionLog",
    "VerifyResult",
    "encode_entry",
    "list_sessions",
    "new_session_id",
    "newest_session_for",
    "read_session",
    "session_path",
    "verify",
]
