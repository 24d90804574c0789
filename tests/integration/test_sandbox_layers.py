"""Two layers stacked, as docs/sandbox.md recommends: the pod confines itself at start with its
own wider layer (its data and runtime dirs writable, network on), and its commands run under the
command layer on top (Landlock intersects layers: a command can never exceed the pod)."""

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from poddaemon.sandbox import available, build_pod_policy, build_policy
from poddaemon.scope import Scope

pytestmark = pytest.mark.skipif(available() < 4, reason="needs Landlock ABI >= 4")

# Runs as "the pod": confine itself, do pod things, then start a command through the launcher.
POD = r"""
import os, socket, subprocess, sys
from poddaemon.sandbox import apply_policy
base, port = sys.argv[1], int(sys.argv[2])
print(apply_policy(open(f"{base}/pod.json", "rb").read()))
def attempt(what, fn):
    try:
        fn()
        print(what, "ok")
    except OSError as e:
        print(what, "denied", type(e).__name__)
attempt("pod writes its session log", lambda: open(f"{base}/data/s.jsonl", "a").write("x\n"))
attempt("pod writes the registry", lambda: open(f"{base}/run/pods.json", "w").write("{}"))
attempt("pod writes a new file next to a deny",
        lambda: open(f"{base}/work/new.txt", "w").write("x"))
attempt("pod reads outside", lambda: open(f"{base}/outside.txt").read())
attempt("pod connects to its model", lambda: socket.create_connection(("127.0.0.1", port)))
script = sys.argv[3]
launcher = [sys.executable, "-I", "-m", "poddaemon.sandbox.exec", f"{base}/run/cmd.json", "--"]
sys.stdout.flush()
subprocess.run([*launcher, "bash", "-c", script], cwd=base)
"""

# Runs as "the command", through the launcher, inside both layers.
COMMAND = """
t() { if eval "$2" 2>/dev/null; then echo "cmd $1 ok"; else echo "cmd $1 denied"; fi; }
t "reads the pod's new file" "cat work/new.txt >/dev/null"
t "writes the session log" "echo x >> data/s.jsonl"
t "reads the deny" "cat work/secrets/k >/dev/null"
t "writes its scope" "echo x >> work/src/a"
"""


@pytest.fixture
def base() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        root = Path(os.path.realpath(d))
        for rel in ("work/src/a", "work/secrets/k", "data/s.jsonl", "run/pods.json", "outside.txt"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("x\n")
        (root / "tmp").mkdir()
        yield root


def test_pod_layer_and_command_layer(base: Path) -> None:
    scope = Scope.from_config(
        [("work", "write", True)], [("work/secrets", "read", True)], cwd=str(base)
    )
    own = [str(base / "data"), str(base / "run")]
    pod = build_pod_policy(scope, pwd=str(base / "work"), own=own)
    cmd = build_policy(
        scope, pwd=str(base / "work"), tmpdir=str(base / "tmp"), network=False, protect=own
    )
    (base / "pod.json").write_bytes(pod.encode())
    (base / "run" / "cmd.json").write_bytes(cmd.encode())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-c", POD, str(base), str(port), COMMAND],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.splitlines()
    assert out == [
        f"landlock-abi-{available()}",
        "pod writes its session log ok",
        "pod writes the registry ok",
        "pod writes a new file next to a deny ok",
        "pod reads outside denied PermissionError",
        "pod connects to its model ok",
        # The command layer was built before new.txt existed: the kernel limit the notes name.
        "cmd reads the pod's new file denied",
        "cmd writes the session log denied",
        "cmd reads the deny denied",
        "cmd writes its scope ok",
    ]
