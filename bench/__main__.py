"""`python -m bench [section ...]`: run every section (or the named ones), print each table and
a summary of every target. The sections are listed in SECTIONS below (and by `--help`)."""

import argparse
import sys
import time
import traceback
from collections.abc import Callable

from bench import harness
from bench.harness import Section

SECTIONS: list[tuple[str, str, str]] = [
    # key, title, module
    ("socket", "1. Socket: status round trip vs raw echo", "bench.socket_bench"),
    ("cli", "2. CLI: podctl wall time vs a do-nothing typer app", "bench.cli_bench"),
    ("spawn", "3. Spawn: podctl spawn to READY (exec, fork server), idle PSS", "bench.spawn_bench"),
    ("agent", "4. Agent overhead per model call vs the plain SDK", "bench.agent_bench"),
    ("request", "5. First model request size (demo manifest)", "bench.request_bench"),
    ("rss", "6. RSS over many runs (SDK loaded)", "bench.rss_bench"),
    ("store", "7. Session store: append, restore", "bench.store_bench"),
    ("ack", "8. Acknowledged run/notify: latency and throughput", "bench.notify_bench"),
    ("stream", "9. Acks while the pod streams a long reply", "bench.stream_ack_bench"),
    ("conn", "10. Memory per connection: a client that never reads", "bench.conn_bench"),
    ("stop", "11. Stop: shutdown to registry free and to exit", "bench.stop_bench"),
    ("files", "12. File tools: race-free open; bash runner", "bench.file_tools_bench"),
    ("sandbox", "13. Sandbox: Landlock per command and at start", "bench.sandbox_bench"),
    ("podbox", "15. Pod's bash and hooks: sandboxed vs not, hook cost", "bench.pod_sandbox_bench"),
    ("systemd", "14. systemd unit: start, restart after kill -9", "bench.systemd_bench"),
    ("mcp", "20. MCP: READY with a stdio server, tool call cost", "bench.mcp_bench"),
    ("compaction", "16. Compaction: request size, its cost, restore", "bench.compaction_bench"),
    ("tree", "17. Spawn trees: spawn_pod, report latency, PSS", "bench.tree_bench"),
    ("history", "18. Warm text turn vs history length", "bench.history_bench"),
    ("first", "19. First turn of a fresh pod vs a warm turn", "bench.first_turn_bench"),
]


def main(argv: list[str] | None = None) -> int:
    keys = [k for k, _, _ in SECTIONS]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "sections",
        nargs="*",
        choices=[[], *keys],
        metavar="SECTION",
        help=f"any of: {' '.join(keys)} (default: all)",
    )
    args = parser.parse_args(argv)
    wanted = args.sections or keys
    harness.compile_sources()
    # Which interpreter measured: start-up rows differ by tens of ms between builds (Makefile).
    print(f"python {sys.version.split()[0]} from {sys.base_prefix} ({sys.executable})")
    done: list[Section] = []
    t0 = time.monotonic()
    for key, title, module in SECTIONS:
        if key not in wanted:
            continue
        sec = Section(key, title)
        started = time.monotonic()
        try:
            mod = __import__(module, fromlist=["run"])
            runner: Callable[[Section], None] = mod.run
            runner(sec)
        except Exception as exc:
            traceback.print_exc()
            sec.error = f"{type(exc).__name__}: {exc}"
        sec.note(f"section took {time.monotonic() - started:.1f} s")
        print(harness.render_section(sec), flush=True)
        done.append(sec)
    print(harness.render_summary(done))
    print(f"total {time.monotonic() - t0:.1f} s")
    return 1 if any(s.error for s in done) else 0


if __name__ == "__main__":
    sys.exit(main())
