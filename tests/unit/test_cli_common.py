"""cli/common.py: a message too large for a pod is a usage error (2) that says what limits it."""

import io
import sys

import pytest

from cli.common import (
    DEFAULT_MAX_INPUT_KIB,
    EXIT_USAGE,
    TOO_LARGE_ADVICE,
    read_message,
    rpc_errors,
)
from poddaemon.config.manifest import WorkerConfig
from protocol.errors import FrameTooLarge
from protocol.framing import DEFAULT_MAX_FRAME_BYTES


def test_the_advice_names_the_default_input_limit_a_pod_has() -> None:
    # podctl says it without importing the daemon's config: it must not drift from it.
    assert WorkerConfig().max_input_bytes == DEFAULT_MAX_INPUT_KIB * 1024
    assert f"({DEFAULT_MAX_INPUT_KIB} KiB unless its manifest says more)" in TOO_LARGE_ADVICE


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_stdin_over_a_frame_is_a_usage_error_that_says_what_a_pod_takes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, b"x" * (DEFAULT_MAX_FRAME_BYTES + 1))
    with pytest.raises(SystemExit) as exited:
        read_message("-")
    assert exited.value.code == EXIT_USAGE
    said = capsys.readouterr().err
    assert said == (
        "podctl: stdin holds more than 8 MiB, more than one request to a pod carries; "
        "a pod takes at most its worker.max_input_bytes of input in one message "
        "(256 KiB unless its manifest says more): save it in a file the pod can read and send "
        "its path\n"
    )
    assert "more than a pod takes" not in said  # untrue: a default pod takes 256 KiB


def test_stdin_of_exactly_a_frame_is_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not refused here: the request it makes is (FrameTooLarge, next test), as usage too.
    _stdin(monkeypatch, b"x" * DEFAULT_MAX_FRAME_BYTES)
    assert len(read_message("-")) == DEFAULT_MAX_FRAME_BYTES


def test_a_request_too_large_to_send_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The client refuses a frame over the limit before sending a byte: the input's fault, not
    the pod's. It exited 1 (an RPC error) where the same input, one byte longer on stdin,
    exited 2."""
    with pytest.raises(SystemExit) as exited, rpc_errors("pod"):
        raise FrameTooLarge(DEFAULT_MAX_FRAME_BYTES + 66, DEFAULT_MAX_FRAME_BYTES)
    assert exited.value.code == EXIT_USAGE
    said = capsys.readouterr().err
    assert said.startswith(
        f"podctl: request of {DEFAULT_MAX_FRAME_BYTES + 66} bytes exceeds the frame limit"
    )
    assert said.endswith(f"nothing was sent; {TOO_LARGE_ADVICE}\n")
