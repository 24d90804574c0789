"""`poddaemon run`'s argv: the argparse-free fast path gives argparse's answer or steps aside."""

import pytest

from poddaemon import daemon

CASES = [
    ["run", "m.toml"],
    ["run", "/a/m.toml", "--adopt", "--stderr-log", "--callback", "/run/x.sock"],
    ["run", "m.toml", "--set", "worker.max_turns=3", "--set", "pod.name=b"],
    ["run", "m.toml", "--resume"],
    ["run", "m.toml", "--session", "0190-abc", "--adopt"],
]

FALLBACK = [
    ["run", "m.toml", "--resume", "--session", "x"],  # mutually exclusive: argparse's error
    ["run", "m.toml", "--set=a.b=1"],
    ["run", "m.toml", "--adop"],  # an abbreviation argparse accepts
    ["run", "--adopt", "m.toml"],
    ["run", "m.toml", "--callback"],
    ["run", "m.toml", "--adopt", "--adopt"],
    ["run", "m.toml", "-h"],
    ["run"],
    [],
]


def _argparse(argv: list[str]) -> dict[str, object]:
    plain = daemon._parse_plain
    try:
        daemon._parse_plain = lambda argv: None  # type: ignore[assignment]
        return vars(daemon.parse_args(argv))
    finally:
        daemon._parse_plain = plain  # type: ignore[assignment]


@pytest.mark.parametrize("argv", CASES)
def test_plain_parse_equals_argparse(argv: list[str]) -> None:
    plain = daemon._parse_plain(argv)
    assert plain is not None
    assert vars(plain) == _argparse(argv)
    assert vars(daemon.parse_args(argv)) == _argparse(argv)


@pytest.mark.parametrize("argv", FALLBACK)
def test_anything_else_goes_to_argparse(argv: list[str]) -> None:
    assert daemon._parse_plain(argv) is None


def test_argparse_still_rejects_conflicts() -> None:
    with pytest.raises(SystemExit):
        daemon.parse_args(["run", "m.toml", "--resume", "--session", "x"])


def test_version_names_the_program_and_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    import poddaemon

    with pytest.raises(SystemExit) as exited:
        daemon.parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"poddaemon {poddaemon.__version__} (protocol 1)\n"
