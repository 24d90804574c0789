"""15. The bash tool and hooks as the pod runs them: sandboxed vs unsandboxed, and a hook's cost.

Each row runs the real tool code (`tools.execute("bash", …)` through the pod's command runner)
in this process, 200 `true` commands per variant, interleaved in blocks so machine noise hits
both alike; at about 60 MB and 300 MB of process RSS (the pod's size must not
matter: commands are started by the small runner, never by forking the pod). Targets: sandboxed
≤ unsandboxed + 1 ms (p50), and a `true` PreToolUse hook's cost per tool call."""

import asyncio
import os
import tempfile
import time
from pathlib import Path

from bench.harness import Row, Section, Target, median, vm_rss_mb

N = 200
BLOCK = 20


def _within(ms: float, base: float) -> Target:
    return Target(f"added ≤ {ms:g} ms", lambda r: r.value - base <= ms)


async def _contexts(root: Path) -> tuple[object, object]:
    from poddaemon.config.manifest import ScopeRule
    from poddaemon.sandbox.pod import pod_sandbox
    from poddaemon.scope import Scope
    from poddaemon.tools.base import ToolContext

    scope = Scope.from_config([ScopeRule(target=str(root), permission="write")], [], cwd=str(root))
    box = pod_sandbox(
        name="bench", mode="enforce", network=True, scope=scope, pwd=str(root),
        protect=[], commands=True,
    )  # fmt: skip
    confined = ToolContext(scope=scope, pwd=str(root), sandbox_policy=box.policy)
    plain = ToolContext(scope=scope, pwd=str(root))
    await confined.command_runner()
    await plain.command_runner()
    return confined, plain


async def _bash_ms(ctx: object, n: int) -> list[float]:
    from poddaemon.tools.base import execute

    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        outcome = await execute("bash", '{"command": "true"}', ctx)  # type: ignore[arg-type]
        out.append((time.perf_counter() - t0) * 1000)
        assert not outcome.is_error, outcome.output
    return out


async def _measure(root: Path) -> tuple[float, float, float, float]:
    confined, plain = await _contexts(root)
    a: list[float] = []
    b: list[float] = []
    for _ in range(N // BLOCK):
        a += await _bash_ms(confined, BLOCK)
        b += await _bash_ms(plain, BLOCK)
    hook_ms, no_hook_ms = await _hook_cost(confined, root)
    for ctx in (confined, plain):
        await ctx.aclose()  # type: ignore[attr-defined]
    return median(a), median(b), hook_ms, no_hook_ms


async def _hook_cost(ctx: object, root: Path) -> tuple[float, float]:
    """A list_dir call through the interceptor chain with a `true` PreToolUse hook vs none."""
    from poddaemon.config.manifest import HookConfig, HooksSection
    from poddaemon.history import ToolCall
    from poddaemon.hooks import Hooks
    from poddaemon.tools.base import execute

    hooks = Hooks(
        HooksSection(PreToolUse=[HookConfig(command="true")]),
        pod="bench", cwd=str(root), runner=ctx.hook_runner,  # type: ignore[attr-defined]
        session=lambda: ("s", ""), record=lambda run: None,
    )  # fmt: skip
    call = ToolCall(id="c", name="list_dir", arguments='{"path": "."}')
    with_hook: list[float] = []
    without: list[float] = []
    for _ in range(N // BLOCK):
        for _ in range(BLOCK):
            t0 = time.perf_counter()
            assert await hooks.before_tool("r", call) is None
            await execute(call.name, call.arguments, ctx)  # type: ignore[arg-type]
            with_hook.append((time.perf_counter() - t0) * 1000)
        for _ in range(BLOCK):
            t0 = time.perf_counter()
            await execute(call.name, call.arguments, ctx)  # type: ignore[arg-type]
            without.append((time.perf_counter() - t0) * 1000)
    return median(with_hook), median(without)


def run(sec: Section) -> None:
    with tempfile.TemporaryDirectory(prefix="pdsb", dir="/tmp") as tmp:
        root = Path(tmp)
        for label, ballast_mb in ((", +35 MB heap", 35), (", +275 MB heap", 275)):
            ballast = bytearray(ballast_mb << 20)
            for i in range(0, len(ballast), 4096):
                ballast[i] = 1  # touch every page: real RSS, as a grown pod has
            rss = vm_rss_mb(os.getpid())
            boxed, plain, hook, no_hook = asyncio.run(_measure(root))
            tag = f"{label} (process RSS {rss:.0f} MB)"
            sec.add(
                Row(f"bash `true`, sandboxed, p50{tag}", boxed, "ms", plain, "unsandboxed",
                    target=_within(1.0, plain))
            )  # fmt: skip
            if ballast_mb == 35:
                sec.add(Row("list_dir with a `true` PreToolUse hook, p50", hook, "ms", no_hook,
                            "no hook"))  # fmt: skip
                sec.add(Row("a `true` hook's cost per tool call", hook - no_hook, "ms"))
            del ballast
    sec.note(
        f"{N} calls per variant, interleaved in blocks of {BLOCK}; the real bash tool and hook "
        "code through the pod's command runner (confined once at its start by Landlock)"
    )
