"""cli/main.py loads only the invoked command's module: its table must match what each module
registers, or a command would be missing (or another module's shadowed) when it runs."""

import functools
import os
import subprocess
import sys
from pathlib import Path

from cli.main import COMMANDS, modules_for

REPO = Path(__file__).resolve().parents[2]

# Each module imported alone, in a fresh interpreter: the top-level names it adds to the app.
PROBE = """
import importlib, sys
from cli.app import command_names
importlib.import_module(sys.argv[1])
print(" ".join(command_names()))
"""


def test_the_table_names_every_command_each_module_registers() -> None:
    for module, names in COMMANDS.items():
        out = subprocess.run(
            [sys.executable, "-c", PROBE, module],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert sorted(out) == sorted(names), module


def test_a_known_command_loads_its_module_only() -> None:
    assert modules_for(["status", "x"]) == ("cli.pods",)
    assert modules_for(["notify", "x", "m"]) == ("cli.talk",)
    assert modules_for(["sessions", "list"]) == ("cli.sessions",)
    assert modules_for(["unit", "install", "p.toml"]) == ("cli.service",)


def test_anything_else_loads_every_module_in_help_order() -> None:
    for args in ([], ["--help"], ["-h", "status"], ["--version"], ["statu"], ["x", "status"]):
        assert modules_for(args) == tuple(COMMANDS)


# podctl ends with os._exit (cli.app.exit_now): what it printed must still arrive, and its exit
# status must be the one `sys.exit` would have given. Each case runs in its own interpreter.
EXIT_PROBE = """
import sys
from cli.common import exit_now
sys.stdout.write("printed before exit")
exit_now({code})
"""


def _probe(code: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", EXIT_PROBE.format(code=code)],
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        # Block-buffered, as podctl's stdout is into a pipe: the flush at exit is what writes.
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
    )


def test_exit_now_flushes_stdout_and_keeps_the_status() -> None:
    for code in (0, 1, 3):
        done = _probe(str(code))
        assert (done.returncode, done.stdout, done.stderr) == (code, "printed before exit", "")


def test_exit_now_into_a_closed_pipe_is_a_quiet_failure() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away (`podctl history p | head`)
    try:
        done = _probe("0", stdout=write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert done.stderr == ""  # no "Exception ignored ... BrokenPipeError"


def test_a_full_disk_under_stdout_is_one_line_and_status_1() -> None:
    """Output that cannot be written, whether at the final flush or while the command runs:
    one line saying why, status 1, no traceback."""
    with open("/dev/full", "w") as full:
        at_exit = _probe("0", stdout=full.fileno())
        during = subprocess.run(
            [sys.executable, "-m", "cli.main", "--version"],
            cwd=REPO,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # the write itself fails
        )
    assert (at_exit.returncode, at_exit.stderr) == (
        1,
        "podctl: cannot write the output: No space left on device\n",
    )
    assert (during.returncode, during.stderr) == (1, "podctl: No space left on device\n")


def test_closed_standard_streams_are_dev_null_not_a_traceback() -> None:
    """`podctl --version >&-` (a caller that closed stdout, stdin or stderr): the output is
    dropped and the status is the command's own."""
    for closed in (0, 1, 2):
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", "--version"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            preexec_fn=functools.partial(os.close, closed),
        )
        assert (done.returncode, "Traceback" in done.stderr) == (0, False), (closed, done.stderr)
        if closed != 1:
            assert done.stdout.startswith("podctl ")


def test_podctl_statuses_are_the_ones_sys_exit_gives() -> None:
    """Through the real entry point: typer's usage error (2), a command's own status (3), a
    success with its output; then each kind of SystemExit, a message meaning status 1."""
    cases = [
        (["statu"], 2),
        (["status", "no-such-pod-here"], 3),
        (["--version"], 0),
    ]
    for args, code in cases:
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "XDG_RUNTIME_DIR": "/nonexistent-podctl-test"},
        )
        assert done.returncode == code, (args, done.stderr)
    assert done.stdout.startswith("podctl ")
    from cli.common import _status

    assert _status(SystemExit(None)) == 0
    assert _status(SystemExit(4)) == 4
    assert _status(SystemExit("podctl: gone")) == 1


# Ctrl-C as podctl starts: the signal arrives while `where` (the plain parser, typer's loading
# of the command) runs, before `run` handles it as it does for a command that has started.
CTRL_C_PROBE = """
import os, signal, sys
import cli.app, cli.main, cli.plain
where = {"plain": cli.plain, "typer": cli.app}[sys.argv[1]]
name = {"plain": "parse", "typer": "load"}[sys.argv[1]]
real = getattr(where, name)
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)
setattr(where, name, interrupted)
sys.argv = ["podctl", *sys.argv[2:]]
cli.main.main()
"""


def test_ctrl_c_while_podctl_starts_is_130_not_a_traceback() -> None:
    for where, args in (("plain", ["send", "p", "hi"]), ("typer", ["ls"])):
        done = subprocess.run(
            [sys.executable, "-c", CTRL_C_PROBE, where, *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "XDG_RUNTIME_DIR": "/nonexistent-podctl-test"},
        )
        assert (done.returncode, done.stderr) == (130, ""), (where, done.stderr)
