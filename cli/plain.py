"""podctl's most used commands, without typer: `notify POD MESSAGE` (what cron, CI and file
watchers run for every event), `send POD MESSAGE`, `status POD` and `spawn MANIFEST`. Importing
typer (and the click it vendors) and building the command was half of their time: `notify`
takes ~35 ms here against ~80 through typer.

`parse` takes only the exact, common spellings; anything else (help, `--opt=value`, `--`, an
option given twice or unknown, a value or argument that looks like an option, a pod name that
is none, a missing or extra argument) returns None and goes to the typer app, whose help and
usage errors stay the only ones. The commands' bodies are these functions either way: the typer
commands call them too.
"""

import functools
import sys
from collections.abc import Callable

from cli.common import (
    EXIT_ERROR,
    EXIT_USAGE,
    call,
    check_client_key,
    fail,
    names_a_pod,
    print_json,
    read_message,
    say_started,
    say_taken,
)
from cli.runs import send

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
    check_client_key(client_key)
    text = read_message(message)
    params: dict[str, str] = {"message": text}
    if source is not None:
        params["source"] = source
    if client_key is not None:
        params["client_key"] = client_key
    result = call(pod, "notify", params)
    nid = result["notification_id"]
    # stdout is the id alone, whatever the pod's state (`nid=$(podctl notify …)`)
    say_taken(lambda: sys.stdout.write(f"{nid}\n"), f"notification {nid}")
    if result["wakes"]:
        sys.stderr.write("(woke the pod)\n")


def spawn(
    manifest: str,
    set_: list[str] | None = None,
    session: str | None = None,
    resume: bool = False,
    foreground: bool = False,
) -> None:
    import os

    from cli.spawn import (
        READY_TIMEOUT,
        SpawnFailed,
        daemon_command,
        is_fifo,
        podctl_descriptor,
        shortened,
        spawn_detached,
    )

    if not manifest:  # (`podctl spawn "$MANIFEST"` with it unset: the pod read "." as a file)
        fail("MANIFEST is empty: give the path of a pod's manifest", EXIT_USAGE)
    if session and resume:
        fail("--session and --resume exclude each other", EXIT_USAGE)
    if not foreground and podctl_descriptor(manifest):
        # It said "manifest not found", of a path that is there (for podctl).
        fail(
            f"{manifest} is podctl's own descriptor (as `<(…)` gives), which the pod cannot "
            "open: write the manifest to a file, or start the pod with --foreground",
            EXIT_USAGE,
        )
    from poddaemon.overrides import split_override

    for text in set_ or []:
        if split_override(text) is None:  # (the manifest loader's rule, but exit 2: usage)
            fail(f"--set {text}: expected section.key=value", EXIT_USAGE)
    cmd = daemon_command(manifest, set_ or [], session, resume)
    if is_fifo(manifest) and not podctl_descriptor(manifest):
        # The pod reads a FIFO as `cat` does, waiting for a writer: said now, as a silent
        # spawn looked hung until "did not become ready within 30 s". (Not of `<(…)`, which
        # its shell writes: a pipe as well.)
        sys.stderr.write(
            f"podctl: {manifest} is a FIFO: the pod reads its manifest from whatever writes"
            f" into it{'' if foreground else f' (waiting up to {READY_TIMEOUT:g} s)'}\n"
        )
        sys.stderr.flush()
    if foreground:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(cmd[0], cmd)
    try:
        name, socket, early = spawn_detached(cmd)
    except SpawnFailed as exc:
        sys.stdout.flush()
        if exc.output.strip():
            said = shortened(exc.output)
            sys.stderr.buffer.write(said if said.endswith(b"\n") else said + b"\n")
            sys.stderr.flush()
            if "ready within" in exc.message:
                fail(exc.message)
            raise SystemExit(EXIT_ERROR) from None
        fail(exc.message)
    if early:
        sys.stderr.buffer.write(shortened(early, name))  # warnings it printed while starting
        sys.stderr.flush()
    say_started(name, socket)


class Grammar:
    """How a command is spelled: how many arguments (the first a pod, or not), and its flags,
    options taking a value and repeatable options, each spelling mapped to the keyword
    argument of the command's function."""

    __slots__ = ("arity", "flags", "lists", "options", "pod_first", "run")

    def __init__(
        self,
        run: Callable[..., None],
        arity: int,
        *,
        pod_first: bool = True,
        flags: dict[str, str] | None = None,
        options: dict[str, str] | None = None,
        lists: dict[str, str] | None = None,
    ) -> None:
        self.run, self.arity, self.pod_first = run, arity, pod_first
        self.flags, self.options, self.lists = flags or {}, options or {}, lists or {}


GRAMMAR = {
    "status": Grammar(status, 1, flags={"--json": "as_json"}),
    "notify": Grammar(notify, 2, options={"--source": "source", "--client-key": "client_key"}),
    "send": Grammar(
        send,
        2,
        flags={"--no-wait": "no_wait", "--steer": "steer", "--json": "as_json"},
        options={"--client-key": "client_key"},
    ),
    "spawn": Grammar(
        spawn,
        1,
        pod_first=False,
        flags={"--resume": "resume", "--foreground": "foreground"},
        options={"--session": "session"},
        lists={"--set": "set_"},
    ),
}


def parse(argv: list[str]) -> Callable[[], None] | None:
    """The command `podctl ARGV` runs, when typer is not needed to tell (see above)."""
    if not argv or argv[0] not in GRAMMAR:
        return None
    grammar = GRAMMAR[argv[0]]
    arguments: list[str] = []
    named: dict[str, str | bool | list[str]] = {}
    rest = iter(argv[1:])
    for arg in rest:
        if arg in grammar.flags and grammar.flags[arg] not in named:
            named[grammar.flags[arg]] = True
        elif (arg in grammar.options and grammar.options[arg] not in named) or arg in grammar.lists:
            value = next(rest, None)
            if value is None or value.startswith("-"):
                return None
            if arg in grammar.lists:
                values = named.setdefault(grammar.lists[arg], [])
                assert isinstance(values, list)
                values.append(value)
            else:
                named[grammar.options[arg]] = value
        elif arg.startswith("-") and arg != "-":
            return None
        else:
            arguments.append(arg)
    if len(arguments) != grammar.arity or (grammar.pod_first and not names_a_pod(arguments[0])):
        return None
    return functools.partial(grammar.run, *arguments, **named)
