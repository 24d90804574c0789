"""What podctl shows of a pod's output before READY (`cli.spawn.shortened`), and which
manifest paths are podctl's own descriptors (`cli.spawn.podctl_descriptor`); pure."""

from pathlib import Path

import pytest

from cli.spawn import EARLY_HEAD, EARLY_TAIL, podctl_descriptor, shortened


def test_a_short_start_up_is_shown_whole() -> None:
    said = b"".join(b"warning %d\n" % i for i in range(EARLY_HEAD + EARLY_TAIL))
    assert shortened(said, "p") == said


def test_a_long_one_keeps_its_first_warnings_and_its_last_words() -> None:
    said = b"".join(b"line %d\n" % i for i in range(1000))
    lines = shortened(said, "p").splitlines()
    assert lines[:EARLY_HEAD] == [b"line %d" % i for i in range(EARLY_HEAD)]
    note = "podctl: … 960 more lines (`podctl logs p` has them all)"
    assert lines[EARLY_HEAD] == note.encode()
    assert lines[EARLY_HEAD + 1 :] == [b"line %d" % i for i in range(1000 - EARLY_TAIL, 1000)]
    assert b"the pod's log" in shortened(said)  # its name not known yet (a failed start)


def test_control_characters_are_shown_not_sent() -> None:
    # A child's kept pwd is the model's choice: `podctl restart kid` after it was removed
    # printed "pod.pwd: /w/k<ESC>]52;c;aGk=<BEL> does not exist" raw to the terminal.
    said = b"poddaemon: kid.toml: pod.pwd: /w/k\x1b]52;c;aGk=\x07 does not exist\n\xff\n"
    assert shortened(said, "kid") == (
        b"poddaemon: kid.toml: pod.pwd: /w/k\\x1b]52;c;aGk=\\x07 does not exist\n\\xff\n"
    )


def test_podctl_s_own_descriptors_are_told_from_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`podctl spawn <(…)` hands podctl `/dev/fd/63`: a detached pod cannot open it."""
    own = ["/dev/fd/63", "/proc/self/fd/0", "/proc/thread-self/fd/9", "/dev/stdin", "//dev/fd/3"]
    paths = ["/dev/fd", "/dev/fd/x", "/dev/null", "/proc/1/fd/3", str(tmp_path / "fd" / "3")]
    assert [podctl_descriptor(p) for p in own] == [True] * len(own)
    assert [podctl_descriptor(p) for p in paths] == [False] * len(paths)
    monkeypatch.chdir("/dev")
    assert podctl_descriptor("fd/63") and podctl_descriptor("./stdin")
