"""`podctl notify`, `send`, `status POD` and `spawn` run without typer (cli/plain.py): for
every spelling the plain parser takes, podctl must say and exit exactly as its typer app does,
and every spelling it leaves to typer must still get typer's help and usage errors."""

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import pytest

from cli.plain import notify, parse, spawn, status
from cli.runs import send
from tests.conftest import Env, wait_until
from tests.integration.test_clients import connected

# podctl run through its typer app whatever the arguments: the plain parser turned off.
THROUGH_TYPER = (
    "import sys; from cli import main, plain; plain.parse = lambda argv: None; main.main()"
)
ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def test_the_common_spellings_are_taken_without_typer() -> None:
    taken = {
        ("status", "pod"): ("pod",),
        ("status", "pod", "--json"): ("pod",),
        ("status", "/run/x/sock"): ("/run/x/sock",),
        ("notify", "pod", "hi"): ("pod", "hi"),
        ("notify", "pod", "-"): ("pod", "-"),
        ("notify", "--source", "ci", "pod", "hi", "--client-key", "k"): ("pod", "hi"),
        ("send", "pod", "hi"): ("pod", "hi"),
        ("send", "--no-wait", "pod", "-", "--json", "--steer", "--client-key", "k"): ("pod", "-"),
        ("spawn", "m.toml"): ("m.toml",),
        ("spawn", "--set", "a.b=1", "Pod.toml", "--set", "c.d=2", "--resume"): ("Pod.toml",),
    }
    for argv, arguments in taken.items():
        command = parse(list(argv))
        assert command is not None, argv
        assert command.func in (notify, send, spawn, status) and command.args == arguments  # type: ignore[attr-defined]
    assert parse(["status", "pod", "--json"]).keywords == {"as_json": True}  # type: ignore[union-attr]
    assert parse(["notify", "p", "m", "--source", "ci"]).keywords == {"source": "ci"}  # type: ignore[union-attr]
    assert parse(["send", "p", "m", "--no-wait", "--json"]).keywords == {  # type: ignore[union-attr]
        "no_wait": True,
        "as_json": True,
    }
    assert parse(["spawn", "--set", "a.b=1", "m", "--set", "c.d=2", "--resume"]).keywords == {  # type: ignore[union-attr]
        "set_": ["a.b=1", "c.d=2"],
        "resume": True,
    }


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["status"],  # (the table of live pods)
        ["status", "--json"],
        ["status", "Pod"],  # no pod name: typer's usage error
        ["status", "pod", "extra"],
        ["status", "pod", "--json", "--json"],
        ["status", "pod", "-h"],
        ["status", "--help"],
        ["status", "pod", "--jso"],
        ["notify", "pod"],
        ["notify", "pod", "hi", "--source"],
        ["notify", "pod", "hi", "--source", "-x"],
        ["notify", "pod", "hi", "--source=ci"],
        ["notify", "pod", "hi", "--source", "a", "--source", "b"],
        ["notify", "pod", "--", "-x"],
        ["notify", "pod", "-x"],
        ["notify", "-", "hi"],
        ["spawn"],
        ["spawn", "m.toml", "--resume", "--resume"],
        ["spawn", "m.toml", "--session"],
        ["spawn", "m.toml", "--set", "--x"],
        ["spawn", "-m.toml"],
        ["spawn", "a.toml", "b.toml"],
        ["send", "pod"],
        ["send", "pod", "hi", "--no-wait", "--no-wait"],
        ["send", "pod", "hi", "--client-key"],
        ["send", "pod", "hi", "--source", "ci"],
        ["send", "pod", "hi", "-w"],
        ["statu", "pod"],
    ],
    ids=" ".join,
)
def test_anything_else_is_left_to_typer(argv: list[str]) -> None:
    assert parse(argv) is None


def both_ways(env: Env, *args: str, input: str = "", stop: str = "") -> list[tuple[int, str, str]]:
    """podctl ARGS as users run it (plain, when it takes them), then through typer; `stop`:
    the pod a spawn may have started, stopped after each."""
    outcomes = []
    for cmd in (["-m", "cli.main"], ["-c", THROUGH_TYPER]):
        done = subprocess.run(
            [sys.executable, *cmd, *args],
            env=env.env,
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        outcomes.append((done.returncode, ID.sub("<id>", done.stdout), ID.sub("<id>", done.stderr)))
        if stop and done.returncode == 0:
            assert env.podctl("stop", stop).returncode == 0
    return outcomes


def test_plain_and_typer_say_and_exit_the_same(env: Env) -> None:
    env.model.script({"gate": "never", "text": "held"})  # busy: status stays as it is
    pod = env.start("pod")
    pod.call("run", input="work")
    env.model.wait_for_requests(1)
    socket = str(pod.socket)
    cases: list[tuple[list[str], str]] = [
        (["status", "pod"], ""),
        (["status", "pod", "--json"], ""),
        (["status", socket], ""),
        (["status", "ghost"], ""),
        (["status", "/nowhere/sock"], ""),
        (["notify", "pod", "the build is green"], ""),
        (["notify", "--source", "ci", "pod", "hi", "--client-key", "k1"], ""),
        (["notify", "pod", "-"], "from stdin\n"),
        (["notify", "pod", ""], ""),
        (["notify", "pod", "-"], ""),
        (["notify", "pod", "\udcff"], ""),
        (["notify", "ghost", "hi"], ""),
        (["notify", socket, "hi", "--source", ""], ""),
    ]
    for args, stdin in cases:
        plain, typer = both_ways(env, *args, input=stdin)
        assert plain == typer, args
        assert plain[0] in (0, 2, 3), (args, plain)
    notes = [e["text"] for e in pod.call("history")["entries"] if e["kind"] == "system_item"]
    assert notes.count("the build is green") == 2 and notes.count("from stdin") == 2
    assert notes.count("hi") == 3  # keyed k1: taken once of two; by its socket: both


# What podctl's plain commands must not import: each costs them milliseconds of their ~65
# (typer ~90, msgspec ~10, typing ~5, asyncio ~60).
HEAVY = {"typer", "click", "msgspec", "typing", "asyncio", "poddaemon"}


def test_plain_commands_import_nothing_heavy(env: Env) -> None:
    env.model.script({"gate": "never", "text": "held"})  # busy: send only queues its run
    pod = env.start("pod")
    pod.call("run", input="work")
    env.model.wait_for_requests(1)
    for args in (["status", "pod"], ["notify", "pod", "hi"], ["send", "--no-wait", "pod", "go"]):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "cli.main", *args],
            env=env.env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, (args, out.stderr[-2000:])
        imported = [
            line.rpartition("|")[2].strip()
            for line in out.stderr.splitlines()
            if line.startswith("import time:")
        ]
        assert "cli.plain" in imported, args  # (the plain path was taken)
        assert [m for m in imported if m.split(".")[0] in HEAVY] == [], args


def test_plain_and_typer_send_alike(env: Env) -> None:
    """`podctl send` both ways, each case with the model's replies for its two runs: an answer
    (as text, as --json, from stdin), a provider's refusal (exit 1), a limit (exit 2), keyed
    retries (the second is answered from the first run, its end read from the log), and what
    fails before any run."""
    pod = env.start("pod", "--set", "worker.max_turns=1")
    answer = {"text": "hello there", "usage": {"input": 7, "output": 3}}
    tool = {"text": "looking", "tool_calls": [{"name": "list_dir", "arguments": "{}"}]}
    refusal = {"fault": {"kind": "status", "status": 400, "message": "no such model"}}
    cases: list[tuple[list[str], str, list[dict[str, Any]]]] = [
        (["send", "pod", "hi"], "", [answer, answer]),
        (["send", "pod", "hi", "--json"], "", [answer, answer]),
        (["send", "pod", "-"], "from stdin\n", [answer, answer]),
        (["send", "pod", "fail"], "", [refusal, refusal]),
        (["send", "pod", "look"], "", [tool, tool]),
        (["send", "--client-key", "k1", "pod", "once"], "", [answer]),
        (["send", "--no-wait", "--client-key", "k2", "pod", "later", "--json"], "", [answer]),
        (["send", "ghost", "hi"], "", []),
        (["send", "pod", ""], "", []),
    ]
    said = []
    for args, stdin, replies in cases:
        env.model.script(*replies)
        plain, typer = both_ways(env, *args, input=stdin)
        assert plain == typer, args
        said.append(plain)
        wait_until(lambda: pod.call("status")["state"] == "idle", what="the runs to end")
        assert env.model.pending == 0, args
    assert [code for code, _, _ in said] == [0, 0, 0, 1, 2, 0, 0, 3, 2]
    assert said[0] == said[2] == said[5] == (0, "hello there\n", "")
    assert json.loads(said[1][1])["usage"]["output"] == 3
    assert json.loads(said[6][1]) == {"run_id": "<id>", "state": "started"}


def test_a_message_too_large_for_a_request_is_a_usage_error_both_ways(env: Env) -> None:
    """A message on stdin of exactly 8 MiB (or a little less, or one JSON escapes make larger)
    passed podctl's stdin check, and the client then refused its request before sending it:
    exit 1, as if the pod had failed, where one byte more exited 2. Now 2 for all, plain and
    through typer alike, and the pod is sent nothing. (Over its worker.max_input_bytes but
    within a request, the pod's own refusal stays an error: 1.)"""
    big = ("--set", f"worker.max_input_bytes={8 << 20}")
    pod = env.start("pod", *big, write=[str(env.work / "pod")])
    frame = 8 << 20
    sizes = {"a frame": "x" * frame, "under a frame": "x" * (frame - 10)}
    sizes["escaped"] = "\x01" * (2 << 20)  # 2 MiB, 12 MiB as JSON (\u0001)
    for command in ("notify", "send"):
        for what, text in sizes.items():
            plain, typer = both_ways(env, command, "pod", "-", input=text)
            assert plain == typer, (command, what)
            code, out, err = plain
            assert (code, out) == (2, ""), (command, what, err)
            assert err.startswith("podctl: request of ") and "nothing was sent; " in err
            assert "worker.max_input_bytes" in err and err.count("\n") == 1
        plain, typer = both_ways(env, command, "pod", "-", input="x" * (frame + 1))
        assert plain == typer and plain[0] == 2 and "more than 8 MiB" in plain[2]
    assert pod.call("status")["session_id"] is None  # no input ever reached it
    small = env.start("small", write=[str(env.work / "small")])  # 256 KiB, the default
    plain, typer = both_ways(env, "notify", "small", "-", input="x" * 300_000)
    assert plain == typer and plain[0] == 1 and "over worker.max_input_bytes (262,144)" in plain[2]
    assert small.call("status")["session_id"] is None


def test_plain_and_typer_spawn_alike(env: Env) -> None:
    manifest = str(env.manifest("sp"))
    cases = [
        ["spawn", "/nowhere/m.toml"],
        ["spawn", "/dev/fd/0"],
        ["spawn", manifest, "--session", "x", "--resume"],
        ["spawn", manifest, "--set", "no-equals"],
        ["spawn", manifest, "--set", "pod.nosuchkey=1"],
        ["spawn", manifest, "--set", "worker.max_turns=3", "--resume"],
    ]
    said = []
    for args in cases:
        plain, typer = both_ways(env, *args, stop="sp")
        assert plain == typer, args
        said.append(plain)
    assert plain[0] == 0 and plain[1].startswith("sp\t"), plain  # (the last one started)
    # `spawn <(…)`: the pod said "manifest not found" of a path podctl has
    assert said[1][0] == 2 and "podctl's own descriptor" in said[1][2], said[1]


def interrupted(env: Env, *cmd: str) -> tuple[int, str, str]:
    """podctl status of a pod that never answers, sent SIGINT (Ctrl-C) once connected."""
    proc = subprocess.Popen(
        [sys.executable, *cmd, "status", "pod"],
        env=env.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: connected(proc.pid), what="podctl status to connect")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def test_ctrl_c_ends_a_plain_command_as_it_ends_a_typer_one(env: Env) -> None:
    """typer ends a command on Ctrl-C with status 130, quietly; a plain one left a traceback."""
    pod = env.start()
    os.kill(pod.proc.pid, signal.SIGSTOP)  # connections are taken, never answered
    try:
        plain = interrupted(env, "-m", "cli.main")
        typer = interrupted(env, "-c", THROUGH_TYPER)
    finally:
        os.kill(pod.proc.pid, signal.SIGCONT)
    assert plain == typer == (130, "", ""), (plain, typer)
