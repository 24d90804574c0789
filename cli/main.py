"""podctl: the user's command line for pods (SPEC §6). This module only assembles it.

The shared parts (the typer app, exit codes, error handling, connect) are in `cli/app.py`; each
command group lives in its own module and registers its commands on `cli.app.app` when imported.
"""

from cli.app import run

# Command modules, in the order `podctl --help` lists them. A new group is one line here.
COMMANDS = (
    "cli.pods",  # spawn, ls, status, stop, rpc
    "cli.talk",  # send, notify, attach, history, pause, resume, cancel
    "cli.sessions",  # sessions list | show | verify
    "cli.dev",  # dev fake-model
    "cli.service",  # unit install|remove, logs, wait, restart, --version
)


def main() -> None:
    run(COMMANDS)


if __name__ == "__main__":
    main()
