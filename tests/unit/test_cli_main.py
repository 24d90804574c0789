"""cli/main.py loads only the invoked command's module: its table must match what each module
registers, or a command would be missing (or another module's shadowed) when it runs."""

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
