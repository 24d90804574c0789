"""podctl's most used one-call commands, without typer: `notify POD MESSAGE` (what cron, CI and
file watchers run for every event) and `status POD`. Importing typer (and the click it vendors)
and building the command was half of their time: ~35 ms here against ~75 ms through typer.

`parse` takes only the exact, common spellings; anything else (help, `--opt=value`, `--`, an
option given twice or unknown, a value or argument that looks like an option, a pod name that
is none, a missing or extra argument) returns None and goes to the typer app, whose help and
usage errors stay the only ones. The commands' bodies are these functions either way: the typer
commands call them too.
"""

import functools
import sys
from collections.abc import Callable

from cli.common import call, print_json, read_message

STATUS_TIMEOUT = 10.0  # `podctl status POD`: a pod that does not answer is an error, not a hang


def status(pod: str, as_json: bool = False) -> None:
    st = call(pod, "status", timeout=STATUS_TIMEOUT)
    if as_json:
        print_json(st)
        return
    from cli.render import status_text

    sys.stdout.write(status_text(st))


def notify(
    pod: str, message: str, source: str | None = None, client_key: str | None = None
) -> None:
    text = read_message(message)
    params: dict[str, str] = {"message": text}
    if source is not None:
        params["source"] = source
    if client_key is not None:
        params["client_key"] = client_key
    result = call(pod, "notify", params)
    # stdout is the id alone, whatever the pod's state (`nid=$(podctl notify …)`).
    sys.stdout.write(f"{result['notification_id']}\n")
    if result["wakes"]:
        sys.stdout.flush()
        sys.stderr.write("(woke the pod)\n")


# command: (its function, how many arguments, flags, options taking a value): flag and option
# spellings map to the function's keyword arguments.
GRAMMAR: dict[str, tuple[Callable[..., None], int, dict[str, str], dict[str, str]]] = {
    "status": (status, 1, {"--json": "as_json"}, {}),
    "notify": (notify, 2, {}, {"--source": "source", "--client-key": "client_key"}),
}


def parse(argv: list[str]) -> Callable[[], None] | None:
    """The command `podctl ARGV` runs, when typer is not needed to tell (see above)."""
    if not argv or argv[0] not in GRAMMAR:
        return None
    command, arity, flags, options = GRAMMAR[argv[0]]
    arguments: list[str] = []
    named: dict[str, str | bool] = {}
    rest = iter(argv[1:])
    for arg in rest:
        if arg in flags and flags[arg] not in named:
            named[flags[arg]] = True
        elif arg in options and options[arg] not in named:
            value = next(rest, None)
            if value is None or value.startswith("-"):
                return None
            named[options[arg]] = value
        elif arg.startswith("-") and arg != "-":
            return None
        else:
            arguments.append(arg)
    if len(arguments) != arity or not _pod(arguments[0]):
        return None
    return functools.partial(command, *arguments, **named)


def _pod(target: str) -> bool:
    """A pod name or a socket path, as the typer commands' POD argument takes it."""
    from protocol.paths import POD_NAME_RE

    return "/" in target or POD_NAME_RE.fullmatch(target) is not None
