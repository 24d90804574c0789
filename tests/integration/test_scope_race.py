"""Issue 9 item 13 against a real pod: a process swaps a directory inside the scope with a
symlink to outside (`renameat2(RENAME_EXCHANGE)`, as fast as it can) while the model reads,
lists, greps and writes through it. Nothing outside may be read or written, ever."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import Env, wait_until

RACER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
print("racing", flush=True)
while True:
    if libc.renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
        raise SystemExit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""

ROUNDS = 10
CALLS_PER_ROUND = 30  # 300 calls in all


def calls(round_no: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(CALLS_PER_ROUND):
        n = round_no * CALLS_PER_ROUND + i
        kind = n % 5
        if kind == 0:
            out.append({"name": "read_file", "arguments": {"path": "d/f.txt"}})
        elif kind == 1:
            out.append({"name": "list_dir", "arguments": {"path": "d"}})
        elif kind == 2:
            out.append({"name": "grep", "arguments": {"pattern": "SIDE", "path": "d"}})
        elif kind == 3:
            out.append({"name": "write_file", "arguments": {"path": f"d/w{n}.txt", "content": "w"}})
        else:
            out.append(
                {"name": "write_file", "arguments": {"path": f"d/s{n}/x.txt", "content": "s"}}
            )
    return out


def test_racing_symlink_swaps_never_escape_the_scope(env: Env) -> None:
    outside = env.home / "outside"
    outside.mkdir()
    (outside / "f.txt").write_text("OUTSIDE-SECRET\n")
    (outside / "only-outside.txt").write_text("OUTSIDE-SECRET\n")
    d = env.work / "d"
    d.mkdir()
    (d / "f.txt").write_text("INSIDE\n")
    (env.work / "link").symlink_to(outside)
    env.model.script(*({"tool_calls": calls(r)} for r in range(ROUNDS)), {"text": "done"})
    pod = env.start("racer", tools=["read_file", "write_file", "list_dir", "grep"])
    racer = subprocess.Popen(
        [sys.executable, "-c", RACER, str(d), str(env.work / "link")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert racer.stdout is not None and racer.stdout.readline() == "racing\n"
        with pod.client(timeout=120) as c:
            result = c.run_wait("go")
        assert racer.poll() is None, "the racer stopped early"
    finally:
        racer.kill()
        racer.wait(10)
    assert result.outcome == "finished", result
    wait_until(lambda: len(env.model.requests) == ROUNDS + 1, what="every round's request")
    results = "".join(str(r["body"]) for r in env.model.requests[1:])
    assert "OUTSIDE-SECRET" not in results  # read, grep
    assert "only-outside.txt" not in results  # list_dir
    assert sorted(p.name for p in outside.iterdir()) == ["f.txt", "only-outside.txt"]  # writes
    assert (outside / "f.txt").read_text() == "OUTSIDE-SECRET\n"
    # Not vacuous: the tools did work inside while the race ran.
    assert "INSIDE" in results
    written = [p.name for p in Path(env.work).rglob("*.txt") if p.name.startswith(("w", "x"))]
    assert written  # most writes are refused mid-race (8-60 of 120 land); none outside
