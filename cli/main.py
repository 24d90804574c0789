"""podctl: the user's command line for pods (SPEC §6). This module only assembles it.

The shared parts (the typer app, exit codes, error handling, connect) are in `cli/app.py`; each
command group lives in its own module and registers its commands on `cli.app.app` when imported.
"""

import gc
import sys

# Command modules, in the order `podctl --help` lists them, with the top-level commands each
# registers (tests/unit/test_cli_main.py checks both). A new group is one line here.
COMMANDS: dict[str, tuple[str, ...]] = {
    "cli.pods": ("spawn", "ls", "status", "stop", "rpc", "mcp-serve"),
    "cli.talk": ("send", "notify", "attach", "history", "pause", "resume", "cancel", "compact"),
    "cli.sessions": ("sessions",),
    "cli.dev": ("dev",),
    "cli.service": ("unit", "logs", "wait", "restart"),
}


def modules_for(args: list[str]) -> tuple[str, ...]:
    """The command modules to load for `podctl ARGS`: only the one defining the command being
    run (importing the others and letting typer build all their commands is a quarter of
    podctl's own start-up), every one for anything else (help, --version, a typo)."""
    if args:
        for module, names in COMMANDS.items():
            if args[0] in names:
                return (module,)
    return tuple(COMMANDS)


def main() -> None:
    # Importing typer and a command module allocates tens of thousands of objects that live as
    # long as podctl: the collector would walk them ~50 times for nothing (~4 ms). It runs again
    # once they are loaded and frozen, for the commands that stream for hours.
    gc.disable()
    from cli.app import exit_now, invoke, load

    modules = modules_for(sys.argv[1:])
    load(modules, only=sys.argv[1] if len(modules) == 1 else None)
    gc.freeze()
    gc.enable()
    exit_now(invoke())


if __name__ == "__main__":
    main()
