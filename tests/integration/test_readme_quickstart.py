"""The README's quick start runs as written (issue 9 item 19), in a copy of the examples.

Only the first line (`make install && . .venv/bin/activate`) is replaced: the test already runs
in the installed venv, whose bin directory goes first on PATH as activate would put it. The
fake model's fixed port is swapped for a free one so parallel runs cannot collide.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "no sh block in the README's quick start"
    return block.group(1).splitlines()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.skipif(not (BIN / "podctl").exists(), reason="podctl console script not installed")
def test_readme_quick_start_runs_as_written() -> None:
    lines = quick_start()
    assert lines[0].startswith("make install && . .venv/bin/activate")
    script = "\n".join(["set -e", *lines[1:]]).replace("8400", str(free_port()))
    work = Path(tempfile.mkdtemp(prefix="qs", dir="/tmp"))
    try:
        shutil.copytree(ROOT / "examples", work / "examples")
        shutil.rmtree(work / "examples" / "demo" / "workspace", ignore_errors=True)
        env = {
            "PATH": f"{BIN}:/usr/bin:/bin",
            "HOME": str(work),
            "PODDAEMON_HOME": str(work / "h"),
            "LANG": "C.UTF-8",
        }
        proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the fake model shares this group: killed with it below
        )
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == 0, out + err
        assert "ticked off the README review" in out
        assert "(woke the pod)" in err  # stdout: the notification id alone
        assert "stopped demo\n" in out
        todo = (work / "examples" / "demo" / "workspace" / "TODO.md").read_text()
        assert "- [x] review the README" in todo
    finally:
        for pid_file in (work / "h" / "run" / "pods").glob("*/pid"):  # a pod left by a failure
            with contextlib.suppress(ValueError, OSError):
                os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
