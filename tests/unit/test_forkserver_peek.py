"""The fork server's peek at a manifest (which SDK to preload): it runs in the one server every
spawn of the user goes through, after the pod is forked, so it must never block, grow or raise,
whatever the file is (the pod itself says what is wrong with it)."""

import os
import threading
from pathlib import Path

from poddaemon.forkserver import peek_kind

PROVIDER = '[provider]\nkind = "anthropic"\nmodel = "m"\n'


def test_the_kind_is_read_from_the_manifest_or_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text(PROVIDER)
    assert peek_kind(["run", "m.toml"], str(tmp_path)) == "anthropic"
    assert peek_kind(["run", "m.toml", "--set", "provider.kind=openai"], str(tmp_path)) == "openai"


def test_a_fifo_is_not_waited_for(tmp_path: Path) -> None:
    # A plain open() waited for a writer forever: the server hung, every later spawn with it.
    os.mkfifo(tmp_path / "m.toml")
    found: list[str | None] = []
    peek = threading.Thread(
        target=lambda: found.append(peek_kind(["run", "m.toml"], str(tmp_path))), daemon=True
    )
    peek.start()
    peek.join(10)
    assert found == [None]


def test_a_manifest_past_the_size_limit_is_not_read(tmp_path: Path) -> None:
    # (what /dev/zero stands for here: it grew the server to all free memory)
    (tmp_path / "m.toml").write_text(PROVIDER + ("#" * 1023 + "\n") * (4 * 1024 + 1))
    assert peek_kind(["run", "m.toml"], str(tmp_path)) is None


def test_a_provider_that_is_no_table_is_no_kind(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text('provider = "anthropic"\n')
    assert peek_kind(["run", "m.toml"], str(tmp_path)) is None
