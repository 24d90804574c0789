"""cli/plain.py's parser against typer's own, in-process: for any arguments the plain parser
takes, typer parses the same command without error and into the same values. (What the plain
parser leaves to typer may be anything: typer decides it.)"""

import inspect
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from typer.main import get_command

from cli.app import app, load
from cli.plain import parse

load(("cli.pods", "cli.talk"))
PODCTL = get_command(app)
TOKENS = [
    "pod", "p-2", "/x/sock", "Bad", "-", "--", "--json", "--source", "--client-key", "--set",
    "a.b=1", "c.d=x y", "--session", "--resume", "--foreground", "-x", "--jso", "--source=ci",
    "msg", "", "m.toml", "-h", "notify", "status", "--no-wait", "--steer",
]  # fmt: skip


def typer_values(argv: list[str]) -> dict[str, Any]:
    """The values typer's command for argv[0] parses argv[1:] into (raises on a usage error)."""
    command = PODCTL.get_command(PODCTL.make_context("podctl", list(argv)), argv[0])  # type: ignore[attr-defined]
    assert command is not None
    values = command.make_context(argv[0], list(argv[1:])).params
    # click holds a repeatable option as a tuple, () when absent: typer hands the command a
    # list, or its default (None)
    return {k: (list(v) or None) if isinstance(v, tuple) else v for k, v in values.items()}


def plain_values(argv: list[str]) -> dict[str, Any] | None:
    command = parse(argv)
    if command is None:
        return None
    bound = inspect.signature(command.func).bind(*command.args, **command.keywords)  # type: ignore[attr-defined]
    bound.apply_defaults()
    return dict(bound.arguments)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["status", "notify", "send", "spawn"]),
    st.lists(st.sampled_from(TOKENS), max_size=6),
)
def test_what_plain_parses_typer_parses_alike(command: str, rest: list[str]) -> None:
    argv = [command, *rest]
    plain = plain_values(argv)
    if plain is not None:
        assert typer_values(argv) == plain, argv


def test_the_values_of_a_full_spelling() -> None:
    argv = ["spawn", "--set", "a.b=1", "m.toml", "--set", "c.d=2", "--resume"]
    assert (
        plain_values(argv)
        == typer_values(argv)
        == {
            "manifest": "m.toml",
            "set_": ["a.b=1", "c.d=2"],
            "session": None,
            "resume": True,
            "foreground": False,
        }
    )
