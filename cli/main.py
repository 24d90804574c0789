"""podctl: the user's command line for pods (SPEC §6). This module only assembles it.

`podctl notify`, `send`, `status POD` and `spawn`, spelled as scripts spell them, run without typer
(`cli/plain.py`); everything else goes through the typer app (`cli/app.py`), on which each
command group registers its commands when its module is imported. What they share without typer
(exit codes, error handling, one call to a pod) is in `cli/common.py`.
"""

import contextlib
import os
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


def _closed_stdio_on_devnull() -> None:
    """A standard stream closed by the caller (`podctl ls >&-`, a bare cron or exec) becomes
    /dev/null, as git does: output is dropped, where Python would leave `sys.stdout` None and
    every command would end in a traceback."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is None:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (kept open)


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt:
        # Ctrl-C while podctl starts (its imports, typer building the command: the first
        # ~100 ms, before `run` handles it) ended in a traceback of whatever was importing.
        os._exit(130)  # cli.common.EXIT_INTERRUPTED, which may be half imported right now


def _main() -> None:
    _closed_stdio_on_devnull()
    from protocol.paths import absolute_env

    absolute_env()
    # What a terminal's encoding cannot hold (a pod's Chinese answer under LANG=en_US.ISO-8859-1)
    # shown as \\uXXXX: it raised mid-answer, read as a bad argument (exit 2). UTF-8 is as is.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    from cli import plain

    command = plain.parse(sys.argv[1:])
    if command is not None:  # `notify`, `send`, `status POD`, `spawn` as scripts run them
        from cli.common import exit_now, run

        exit_now(run(command))
    with_typer()


def with_typer() -> None:
    """podctl through its typer app: every command, help and usage error."""
    from poddaemon import collector  # (the standard library only)

    # typer and the command's module live as long as podctl: the collector would walk them ~50
    # times while they load, for nothing (~4 ms). It runs as usual for the command itself.
    with collector.paused():
        from cli.app import invoke, load
        from cli.common import exit_now

        modules = modules_for(sys.argv[1:])
        load(modules, only=sys.argv[1] if len(modules) == 1 else None)
    exit_now(invoke())


if __name__ == "__main__":
    main()
