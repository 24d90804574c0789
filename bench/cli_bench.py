"""2. CLI: `podctl status|notify|send --no-wait` wall time against a one-command typer app that
does nothing.

Issue 15's target: each command within 1.2x of that app (same typer, same interpreter: what typer
itself costs is the floor) and under 70 ms. All three run without typer (cli/plain.py); `status`
through podctl's typer app, as every other command runs, is a row of its own.
"""

import random
import resource
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

from bench.harness import PODCTL, Home, Row, Section, all_of, median, ratio_le, value_lt

RUNS = 21
# podctl with its plain parser off: the command through the typer app.
THROUGH_TYPER = "from cli import main, plain; plain.parse = lambda argv: None; main.main()"
RATIO = 1.2  # podctl's own imports and work on top of typer's start: at most a fifth of it
ABSOLUTE_MS = 70.0
NOOP_APP = '''import typer

app = typer.Typer(add_completion=False)


@app.command()
def status(pod: str) -> None:
    """Do nothing."""


app()
'''


def wall(cmd: list[str], env: dict[str, str]) -> float:
    return measure(cmd, env)[0]


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall time and the child's CPU time (user + sys), in ms."""
    before = _children_cpu()
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    return (time.perf_counter() - t) * 1e3, (_children_cpu() - before) * 1e3


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(sec: Section) -> None:
    with Home() as home:
        assert home.fake is not None
        # A pod that is busy (its first model call waits on a gate that never opens), so the
        # notifications below are only committed, never turned into runs that would compete
        # for the CPU with the next measurement.
        home.fake.script({"gate": "never", "text": "x"})
        pod = home.start_pod("cli", extra="[notify]\nmax_pending = 1000000\n")
        with pod.rpc() as c:
            c.call("run", {"input": "block"})
        home.fake.wait_requests(1)
        app = home.path / "noop_app.py"
        app.write_text(NOOP_APP)
        py = str(Path(PODCTL).parent / "python")
        env = home.env
        # As most users run it: no PODDAEMON_HOME, so the data and runtime directories come
        # from XDG_DATA_HOME and XDG_RUNTIME_DIR (pointing into this home), by platformdirs'
        # rules (protocol/userdirs.py); the pod is named by its socket's path.
        xdg = home.path / "xdg"
        xdg.mkdir(mode=0o700)
        user_env = {k: v for k, v in env.items() if k != "PODDAEMON_HOME"}
        user_env.update(XDG_RUNTIME_DIR=str(xdg), XDG_DATA_HOME=str(xdg), HOME=str(home.path))
        cmds = {
            "noop": [py, str(app), "cli"],
            "status": [PODCTL, "status", "cli"],
            "status, xdg": [PODCTL, "status", pod.socket],
            "notify": [PODCTL, "notify", "cli", "msg"],
            "send": [PODCTL, "send", "--no-wait", "cli", "msg"],
            "status via typer": [py, "-c", THROUGH_TYPER, "status", "cli"],
        }
        times: dict[str, list[float]] = {k: [] for k in cmds}
        cpu: dict[str, list[float]] = {k: [] for k in cmds}
        for key, cmd in cmds.items():  # warm the page cache
            wall(cmd, user_env if "xdg" in key else env)
        order, shuffle = list(cmds), random.Random(15).shuffle
        for _ in range(RUNS):  # interleaved, so drift hits every command alike; in a new order
            shuffle(order)  # each round, so no command always runs right after another
            for key in order:
                took, used = measure(cmds[key], user_env if "xdg" in key else env)
                times[key].append(took)
                cpu[key].append(used)
        base = median(times["noop"])
        for key, label in (
            ("status", "podctl status <pod>"),
            ("notify", "podctl notify <pod> msg"),
            ("send", "podctl send --no-wait <pod> msg"),
        ):
            target = all_of(ratio_le(RATIO), value_lt(ABSOLUTE_MS, "ms"))
            sec.add(
                Row(f"{label}, median", median(times[key]), "ms", base, "no-op typer app", target)
            )
        sec.add(
            Row(
                "podctl status <socket>, no PODDAEMON_HOME (dirs from XDG_*)",
                median(times["status, xdg"]),
                "ms",
                base,
                "no-op typer app",
            )
        )
        sec.add(
            Row(
                "podctl status <pod> through its typer app",
                median(times["status via typer"]),
                "ms",
                base,
                "no-op typer app",
            )
        )
        sec.add(Row("python -c pass (reference)", _python_pass(py, env), "ms"))
        sec.note(
            f"{RUNS} runs each, interleaved; via {PODCTL}; the no-op app is one command with "
            f"one argument on the typer podctl runs on ({version('typer')}), run by the same "
            f"interpreter; the pod is busy (a gated model call), so notify only commits and send "
            f"only queues its run"
        )
        cpu_base = median(cpu["noop"])
        sec.note(
            "CPU time (user+sys) medians, less moved by other load than wall time: "
            + ", ".join(
                f"{k} {median(cpu[k]):.1f} ms ({median(cpu[k]) / cpu_base:.2f}×)" for k in cmds
            )
        )


def _python_pass(py: str, env: dict[str, str]) -> float:
    return median([wall([py, "-c", "pass"], env) for _ in range(11)])
