"""What a pod started by `podctl spawn` logged before READY is said again in its log file."""

import io
import logging

import pytest

from poddaemon.daemon import _SaidBeforeReady


def test_a_start_that_logs_too_much_keeps_its_warnings_and_says_what_it_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lines are held in memory until READY: beyond the budget only warnings are kept (a
    server flooding its stderr at start-up), and the log says how many lines it lacks."""
    said = _SaidBeforeReady()
    said.room = said.KEEP_BYTES = 2048
    log = logging.getLogger("poddaemon.test")
    monkeypatch.setattr(log, "level", logging.INFO)
    said.start()
    try:
        log.info("first line")
        log.info("x" * 3000)  # over the budget
        log.warning("a server is missing")
        said.keep_warning("a scope target does not exist")
        log.info("another")
    finally:
        out = io.StringIO()
        monkeypatch.setattr("sys.stderr", out)
        said.replay()
    lines = out.getvalue().splitlines()
    assert [line.rsplit(" ", 1)[-1] for line in lines[:2]] == ["line", "missing"], lines
    assert lines[2].endswith("a scope target does not exist"), lines
    assert lines[3].endswith("2 lines logged while starting are not kept here (over 2 KiB)")
    assert len(lines) == 4
    assert said not in logging.getLogger().handlers
