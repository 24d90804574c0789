"""The typer app every podctl command group registers on: its root `--version` option, the
common options and arguments, and loading only the invoked command's module.

Start-up time matters (`podctl status` runs in scripts and prompts), so this module and the
command modules import only typer and the standard library at the top, and cli/main.py loads only
the invoked command's module (or none: see cli/plain.py). What the commands share without typer
(exit codes, errors, one call to a pod) is in cli/common.py. `poddaemon.*` and `cli.render` are
imported inside the commands that use them; podctl never imports openai, anthropic or asyncio.
"""

import sys
from typing import Annotated, Any

import typer

from cli.common import run

app = typer.Typer(
    name="podctl",
    help="Control poddaemon pods: LLM agents running as supervised processes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help and usage errors: rich's formatting would import ~60 ms of modules.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from cli.service import version_text

        sys.stdout.write(version_text())
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the podctl and protocol versions.",
            callback=_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Control poddaemon pods: LLM agents running as supervised processes."""


def sub_app(help: str, **kwargs: Any) -> typer.Typer:
    """A command group (`podctl sessions …`) with the same plain settings as the main app."""
    return typer.Typer(help=help, rich_markup_mode=None, pretty_exceptions_enable=False, **kwargs)


def pod_name(value: str | None) -> str | None:
    """A name spawn refuses names no pod: a usage error, not 'not running' (a typo in the case
    of a letter would otherwise read as a pod that stopped)."""
    from cli.common import names_a_pod

    if value is not None and not names_a_pod(value):
        raise typer.BadParameter(
            f"{value!r} is not a valid pod name "
            "(lowercase letters, digits, '-' and '_', at most 48 characters)"
        )
    return value


def seconds(value: float | None) -> float | None:
    """A number of seconds: click's range checks let NaN through (every comparison with it is
    false), and `--timeout nan` then ended in a ValueError traceback from settimeout()."""
    if value is not None and value != value:
        raise typer.BadParameter("nan is not a number of seconds")
    return value


PodArg = Annotated[
    str,
    typer.Argument(metavar="POD", help="Pod name, or the path of its socket.", callback=pod_name),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _command_name(info: "typer.models.CommandInfo") -> str | None:
    """A registered command's name as users type it (typer's own rule for unnamed ones)."""
    if info.name or info.callback is None:
        return info.name
    return info.callback.__name__.lower().replace("_", "-")


def command_names() -> list[str]:
    """The top-level commands and groups registered on `app`."""
    names = [_command_name(c) for c in app.registered_commands]
    return [n for n in names + [g.name for g in app.registered_groups] if n]


def load(commands: tuple[str, ...], only: str | None = None) -> None:
    """Import the command modules (each registers itself on `app`).

    `only`: the command being run. typer builds every registered command's parameters before it
    parses anything; the others are dropped first (its help and usage errors are its own).
    """
    import importlib

    for module in commands:
        importlib.import_module(module)
    if only is not None:
        app.registered_commands = [c for c in app.registered_commands if _command_name(c) == only]
        app.registered_groups = [g for g in app.registered_groups if g.name == only]


def invoke() -> int:
    """Run podctl on `sys.argv`; its exit status."""
    return run(lambda: app(prog_name="podctl"))
