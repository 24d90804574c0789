"""9. File tools: per-call cost of the race-free open (issue 9 item 13) against the tools as they
were (`bench.legacy_file_tools`: check, then open again by name), same run, calls interleaved.
Also the bash tool's per-command cost through the command runner, and the runner's start."""

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench import legacy_file_tools as legacy
from bench.harness import Row, Section, median, ratio_le
from poddaemon.scope import Scope
from poddaemon.tools import BUILTIN, Tool, ToolContext, execute, fsopen
from poddaemon.tools.base import in_thread

LEGACY: dict[str, Tool] = {
    t.name: t
    for t in (
        legacy.ReadFile(),
        legacy.WriteFile(),
        legacy.EditFile(),
        legacy.ListDir(),
        legacy.Grep(),
    )
}
MODULE = "def handler(request):\n    return respond(request.body)\n" * 30


def make_tree(root: Path) -> None:
    """A small project: src/pkg/ with 40 modules of ~1.7 KB, five levels below /tmp."""
    pkg = root / "src" / "pkg"
    pkg.mkdir(parents=True)
    for i in range(40):
        (pkg / f"mod_{i:02}.py").write_text(f"# module {i}\n" + MODULE)
    (root / "notes.txt").write_text("status: draft\n")


def _nothing(stop: object) -> None:
    pass


async def per_call_us(
    ctx: ToolContext, calls: Callable[[int], tuple[str, dict[str, Any]]], n: int
) -> tuple[float, float]:
    """Median µs per call of the new tools and the legacy ones, taking turns call by call."""
    new: list[float] = []
    old: list[float] = []
    for i in range(n):
        name, args = calls(i)
        raw = msgspec.json.encode(args).decode()
        pair: list[tuple[list[float], dict[str, Tool]]] = [(new, BUILTIN), (old, LEGACY)]
        if i % 2:
            pair.reverse()
        for times, tools in pair:
            t0 = time.perf_counter()
            out = await execute(name, raw, ctx, tools)
            times.append((time.perf_counter() - t0) * 1e6)
            if out.is_error:
                raise RuntimeError(f"{name}: {out.output}")
    return median(new), median(old)


async def bash_us(ctx: ToolContext, n: int) -> tuple[float, float]:
    """Median µs of the bash tool running `true`, and of what the tool did before the runner:
    `bash -c true` spawned from this process in its own session, output piped, waited for."""
    tool: list[float] = []
    direct: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        await execute("bash", '{"command": "true"}', ctx)
        tool.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash",
            "-c",
            "true",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        await proc.communicate()
        direct.append((time.perf_counter() - t0) * 1e6)
    return median(tool), median(direct)


async def measure(root: Path) -> dict[str, Any]:
    ctx = ToolContext(scope=Scope.from_config([(str(root), "write", True)]), pwd=str(root))
    res: dict[str, Any] = {}

    def fixed(name: str, args: dict[str, Any]) -> Callable[[int], tuple[str, dict[str, Any]]]:
        return lambda i: (name, args)

    async def run(label: str, calls: Callable[[int], tuple[str, dict[str, Any]]], n: int) -> None:
        res[label] = await per_call_us(ctx, calls, n)

    steps: list[tuple[str, Callable[[int], tuple[str, dict[str, Any]]], int]] = [
        ("read_file src/pkg/mod_07.py", fixed("read_file", {"path": "src/pkg/mod_07.py"}), 400),
        ("list_dir src/pkg (40 entries)", fixed("list_dir", {"path": "src/pkg"}), 400),
        ("grep over 40 files", fixed("grep", {"pattern": "module 3", "path": "src"}), 100),
    ]
    for label, calls, n in steps:
        await run(label, calls, n)
    works = fsopen._openat2().works
    fsopen._openat2().works = False  # as on a kernel without openat2 (< 5.6) or under seccomp
    try:
        await run("read_file, O_NOFOLLOW walk (no openat2)", steps[0][1], 400)
    finally:
        fsopen._openat2().works = works
    await execute("read_file", '{"path": "notes.txt"}', ctx)

    # write_file and edit_file do their work (and fsync) in a tool worker thread, off the event
    # loop; the old tools did it on the loop. Their baseline adds one round trip to that thread,
    # measured alongside, so the ratio says what the tools cost beyond the hand-off itself.
    hops: list[float] = []

    async def hop() -> None:
        t0 = time.perf_counter()
        await in_thread(_nothing)
        hops.append((time.perf_counter() - t0) * 1e6)

    # edit_file: each call flips the word back, so every call finds its text
    edit_new: list[float] = []
    edit_old: list[float] = []
    words = ["draft", "final"]
    for i in range(60):
        await hop()
        for times, tools in [(edit_new, BUILTIN), (edit_old, LEGACY)][:: 1 if i % 2 else -1]:
            old_word, new_word = words
            raw = msgspec.json.encode(
                {"path": "notes.txt", "old_string": old_word, "new_string": new_word}
            ).decode()
            t0 = time.perf_counter()
            out = await execute("edit_file", raw, ctx, tools)
            times.append((time.perf_counter() - t0) * 1e6)
            if out.is_error:
                raise RuntimeError(out.output)
            words.reverse()
    res["edit_file (fsync'd)"] = (median(edit_new), median(edit_old), hops)

    write_new: list[float] = []
    write_old: list[float] = []
    for i in range(60):
        await hop()
        for times, tools, tag in [(write_new, BUILTIN, "n"), (write_old, LEGACY, "o")]:
            raw = msgspec.json.encode({"path": f"out/{tag}{i}.txt", "content": "x\n"}).decode()
            t0 = time.perf_counter()
            out = await execute("write_file", raw, ctx, tools)
            times.append((time.perf_counter() - t0) * 1e6)
            if out.is_error:
                raise RuntimeError(out.output)
    res["write_file new file (fsync'd)"] = (median(write_new), median(write_old), hops)

    t0 = time.perf_counter()
    runner = await ctx.command_runner()
    res["runner start"] = (time.perf_counter() - t0) * 1e3
    with open(f"/proc/{runner.pid}/status") as f:
        res["runner rss"] = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024
    res["bash"] = await bash_us(ctx, 100)
    await ctx.aclose()
    return res


def run(sec: Section) -> None:
    root = Path(tempfile.mkdtemp(prefix="pdft", dir="/tmp"))
    try:
        make_tree(root)
        res = asyncio.run(measure(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for label, value in res.items():
        if isinstance(value, tuple) and label != "bash":
            new, old, *hops = value
            what = "the same call, old check-then-open tools"
            if hops:
                hop_us = median(hops[0])
                old += hop_us
                what += f" (on the loop) + a tool-thread round trip ({hop_us:.0f} µs)"
            sec.add(Row(label, new, "µs/call", old, what, ratio_le(1.3)))
    sec.add(Row("command runner start (first bash call)", res["runner start"], "ms"))
    sec.add(Row("command runner VmRSS", res["runner rss"], "MB"))
    tool, direct = res["bash"]
    sec.add(
        Row(
            "bash tool `true` via the runner, median",
            tool,
            "µs",
            direct,
            "bash -c true spawned by the caller (the old way)",
        )
    )
    sec.note(
        f"opener: {'openat2 RESOLVE_NO_SYMLINKS' if fsopen.uses_openat2() else 'O_NOFOLLOW walk'}"
    )
