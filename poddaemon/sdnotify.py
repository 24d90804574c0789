"""Living under a supervisor (systemd `Type=notify`, SPEC §7): readiness, watchdog, status.

- `notify("READY=1")` etc.: one datagram to `$NOTIFY_SOCKET`; a no-op without one.
- `supervise(pod)`: a task on the pod's event loop that pings `WATCHDOG=1` at half of
  `$WATCHDOG_USEC` (so a loop that stops turning is killed by systemd and restarted) and sends a
  `STATUS=` line whenever the pod's state changes (idle / running run X / paused).
- `use_journal_prefixes(ident)`: when stderr is the journal (`$JOURNAL_STREAM` names stderr's
  device:inode), log lines start with a syslog priority (`<3>` …) so `journalctl -p err` works.
- Test hook: with `$PODDAEMON_TEST_WEDGE_FILE` set, the supervising task blocks the whole event
  loop (a wedged pod) once that file exists, deleting it first so the restarted pod runs normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

log = logging.getLogger("poddaemon")

STATUS_POLL = 0.25  # seconds between looks at the pod's state for STATUS= lines
WEDGE_ENV = "PODDAEMON_TEST_WEDGE_FILE"
SUPERVISOR_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

_claimed: dict[str, str] | None = None


def claim() -> None:
    """Take the supervisor's variables out of the environment (sd_notify's `unset_environment`):
    child pods and tool processes must not report to our supervisor as if they were us."""
    global _claimed
    _claimed = {k: os.environ.pop(k) for k in SUPERVISOR_VARS if k in os.environ}


def _environ() -> Mapping[str, str]:
    return os.environ if _claimed is None else _claimed


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to the service manager; False when there is none.

    Never raises: a supervisor that went away must not take the pod down with it.
    """
    address = _environ().get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.debug("sd_notify %r failed: %s", state, exc)
        return False
    return True


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half the timeout), or None when not watched.

    `$WATCHDOG_PID`, when set, must be this process (systemd's rule for forked helpers).
    """
    env = _environ() if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2_000_000


def status_line(pod_state: str, active_run: str | None, paused_run: str | None) -> str:
    if pod_state == "running" and active_run:
        return f"running run {active_run}"
    if pod_state == "paused" and paused_run:
        return f"paused (run {paused_run})"
    return pod_state


def _pod_status(pod: Any) -> str:
    state = pod.state
    return status_line(
        str(pod.pod_state),
        getattr(state, "active_run", None),
        getattr(state, "paused_run", None),
    )


async def supervise(pod: Any) -> None:
    """Ping the watchdog and report the pod's state until cancelled.

    Runs on the pod's own event loop on purpose: if that loop wedges, the pings stop.
    """
    interval = watchdog_interval()
    wedge = os.environ.get(WEDGE_ENV) or None
    if interval is None and not _environ().get("NOTIFY_SOCKET") and wedge is None:
        return
    tick = min(STATUS_POLL, interval) if interval is not None else STATUS_POLL
    last_ping = 0.0
    last_status = ""
    while True:
        now = time.monotonic()
        message = []
        if interval is not None and now - last_ping >= interval:
            message.append("WATCHDOG=1")
            last_ping = now
        try:
            current = _pod_status(pod)
        except Exception:  # a status we cannot read must never stop the watchdog pings
            if last_status != "unknown":
                log.warning("cannot read the pod's state for STATUS=", exc_info=True)
            current = "unknown"
        if current != last_status:
            if current == "stopping":
                message.append("STOPPING=1")  # as soon as it begins: children may take a while
            message.append(f"STATUS={current}")
            last_status = current
        if message:
            notify("\n".join(message))
        if wedge is not None and os.path.exists(wedge):
            _wedge(wedge)
        await asyncio.sleep(tick)


def _wedge(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    log.warning("test hook %s: blocking the event loop", WEDGE_ENV)
    while True:  # the loop never turns again; only the watchdog (or a signal) ends this
        time.sleep(3600)


def stopping() -> None:
    notify("STOPPING=1\nSTATUS=stopping")


# --- journal priorities ------------------------------------------------------------------------


def stderr_is_journal(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """True when `$JOURNAL_STREAM` ("dev:inode") is the file behind `fd`."""
    env = os.environ if environ is None else environ
    value = env.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


def syslog_priority(levelno: int) -> int:
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


class JournalFormatter(logging.Formatter):
    """Prefix each line with `<N>` (sd-daemon(3)); the journal turns it into PRIORITY=N."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def use_journal_prefixes(ident: str) -> bool:
    """Format the stderr log handlers for where stderr goes.

    The journal: `<N>`-prefixed lines (it stamps the time and names the process itself: the
    name and pid again made every line `poddaemon[7]: poddaemon[7] INFO …`). Anything else (a
    terminal, `stderr.log`): lines start with an ISO timestamp and `ident`, so `podctl logs`
    can show when, and whose. Returns True for the journal.
    """
    journal = stderr_is_journal()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (
            sys.stderr,
            sys.__stderr__,
        ):
            fmt = handler.formatter._fmt if handler.formatter else None
            if journal:
                handler.setFormatter(JournalFormatter(fmt))
            else:
                stamped = logging.Formatter(f"%(asctime)s {ident} {fmt or '%(message)s'}")
                stamped.default_msec_format = "%s.%03d"
                handler.setFormatter(stamped)
    return journal
