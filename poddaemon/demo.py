"""`make demo`: a whole pod session offline, against the bundled fake model server.

Spawns the example pod, follows its event stream, sends it a task that needs two tool calls,
shows status and history, and stops it. Everything lives in a throwaway PODDAEMON_HOME.
"""

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cli.render import bold
from poddaemon.testing.fake_model import FakeModel

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "demo"


def step(title: str) -> None:
    # Bold only on a terminal: `make demo | less` or a CI log must not get escape codes.
    print("\n" + bold(f"== {title}", sys.stdout), flush=True)


def podctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run and show one podctl command. The demo's commands run in sessions of their own (here
    and below): Ctrl-C reaches the demo alone, which ends the command it waits for and stops
    the pod; a podctl hit by it while starting up would print a traceback into the output."""
    print(f"$ podctl {shlex.join(args)}", flush=True)  # pasted, it runs the same
    cmd = [sys.executable, "-m", "cli.main", *args]
    return subprocess.run(cmd, check=check, start_new_session=True)


def _wait_for_text(path: Path, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> int:
    import msgspec

    home = Path(tempfile.mkdtemp(prefix="pd-demo", dir="/tmp"))
    os.environ["PODDAEMON_HOME"] = str(home)
    os.environ.setdefault("OPENAI_API_KEY", "demo-key-not-used")
    demo = home / "demo"
    shutil.copytree(EXAMPLE, demo)
    shutil.rmtree(demo / "workspace", ignore_errors=True)  # a quick-start run's leftovers
    (demo / "workspace").mkdir()
    shutil.copy(EXAMPLE / "TODO.md", demo / "workspace" / "TODO.md")
    replies = msgspec.json.decode((EXAMPLE / "script.json").read_bytes())["replies"]
    status = 0
    try:
        _session(home, demo, replies)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        status = 130
    except subprocess.CalledProcessError as exc:
        failed = " ".join(exc.cmd[3:])
        print(f"\nthe demo failed: podctl {failed} exited {exc.returncode}", file=sys.stderr)
        status = 1
    except BrokenPipeError:  # `make demo | head`: the reader went; say no more there
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 1
    finally:
        # Ctrl-C or a failed step must not leave the pod running in a home nobody knows of.
        _stop_leftover(home)
    print(f"\nSession logs stay in {home / 'data' / 'sessions'}; `rm -rf {home}` when done.")
    return status


def _session(home: Path, demo: Path, replies: list[dict[str, Any]]) -> None:
    with FakeModel().start() as model:
        model.script(*replies)
        print(
            "This demo uses a STAND-IN model: the fake model server bundled with poddaemon\n"
            f"({model.openai_base_url}), speaking the real OpenAI wire format to the real SDK.\n"
            "With OPENAI_API_KEY set, the same manifest runs against the real API\n"
            "(the README's quick start shows both)."
        )
        step("spawn the pod")
        podctl(
            "spawn", str(demo / "pod.toml"), "--set", f"provider.base_url={model.openai_base_url}"
        )
        podctl("ls")
        step("send it a task; the reply streams back (podctl attach records the events)")
        events = home / "attach.log"
        with events.open("w") as out:
            attach = subprocess.Popen(
                # --since 0: every event since the start, none missed while attach connects
                [sys.executable, "-m", "cli.main", "attach", "demo", "--since", "0"],
                stdout=out,
                start_new_session=True,
            )
            try:
                podctl("send", "demo", "Tick off the README review in TODO.md.")
                _wait_for_text(events, "finished: finished")
            finally:
                attach.terminate()
                attach.wait()
        step("what podctl attach showed meanwhile")
        print(events.read_text())
        step("the file it edited")
        print((demo / "workspace" / "TODO.md").read_text())
        step("status and history")
        podctl("status", "demo")
        podctl("history", "demo")
        step("stop")
        podctl("stop", "demo")


def _stop_leftover(home: Path) -> None:
    """Stop the demo pod if it still runs (the demo was interrupted or a step failed)."""
    pid_file = home / "run" / "pods" / "demo" / "pid"
    if not pid_file.exists():
        return  # never started, or stopped: a stopped pod removes its pid file
    stop = [sys.executable, "-m", "cli.main", "stop", "demo"]
    stopped = subprocess.run(stop, stdin=subprocess.DEVNULL, start_new_session=True)
    if stopped.returncode not in (0, 3):  # it does not answer: end it the hard way
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
