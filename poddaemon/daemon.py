"""`poddaemon run MANIFEST`: validate, claim the scope, listen, serve, release.

Start-up fails fast, with one clear line on stderr and a non-zero exit, on anything a user can
fix: a bad manifest, a missing API key, a pwd outside the scope, a template error, a registry
conflict, a session that cannot be restored.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from protocol import paths

log = logging.getLogger("poddaemon")

READY_PREFIX = "PODDAEMON-READY"


class StartupError(Exception):
    pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="poddaemon", description="Run one pod.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pod in the foreground")
    run.add_argument("manifest")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--session", metavar="ID", help="restore this session")
    group.add_argument("--resume", action="store_true", help="restore this pod's newest session")
    run.add_argument("--adopt", action="store_true", help="started by a parent pod")
    run.add_argument("--callback", metavar="SOCKET", help="the spawner's socket")
    run.add_argument(
        "--stderr-log",
        action="store_true",
        help="after READY, move stderr to <runtime>/pods/<name>/stderr.log (used by podctl spawn)",
    )
    return parser.parse_args(argv)


def sd_notify(state: str) -> None:
    """systemd's readiness protocol: one datagram to $NOTIFY_SOCKET, if there is one."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("PODDAEMON_LOG_LEVEL", "INFO").upper(),
        format="poddaemon[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpx2", "openai", "anthropic"):  # one INFO line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return run_pod(args)
    except StartupError as exc:
        print(f"poddaemon: {exc}", file=sys.stderr, flush=True)
        return 2


def run_pod(args: argparse.Namespace) -> int:
    from poddaemon.config.load import ManifestError, load_manifest
    from poddaemon.llm import CredentialsError, check_credentials
    from poddaemon.prompt import PromptError, load_instruction
    from poddaemon.registry import Registry, RegistryConflict, RegistryError, make_entry
    from poddaemon.scope import Access, Scope, resolve
    from poddaemon.tools import BUILTIN

    try:
        manifest = load_manifest(args.manifest, args.set, paths.defaults_path())
    except ManifestError as exc:
        raise StartupError(str(exc)) from None
    from poddaemon.mcp import preload_sdk

    preload_sdk(manifest)  # the SDK import overlaps the rest of start-up
    name = manifest.pod.name
    try:
        check_credentials(manifest.provider)
        instruction = load_instruction(
            manifest.worker.instruction, manifest.worker.instruction_file, manifest.source
        )
    except CredentialsError as exc:
        raise StartupError(f"{manifest.source}: {exc}") from None
    except PromptError as exc:  # already names the manifest or the instruction file
        raise StartupError(str(exc)) from None
    missing = [t for t in manifest.worker.tools if t not in BUILTIN]
    if missing:
        raise StartupError(
            f"{manifest.source}: worker.tools: {', '.join(missing)} not available in this version"
        )
    scope = Scope.from_config(manifest.scope.allow, manifest.scope.deny, cwd=manifest.pod.pwd)
    pwd = resolve(manifest.pod.pwd, "/")
    if scope.access(pwd) < Access.READ:
        raise StartupError(
            f"{manifest.source}: pod.pwd: {pwd} is not readable under the pod's scope"
        )
    if not os.path.isdir(pwd):
        raise StartupError(f"{manifest.source}: pod.pwd: {pwd} is not a directory")

    runtime = paths.ensure_dir(paths.runtime_dir())
    pod_dir = paths.pod_dir(name)
    sock_path = pod_dir / "sock"
    problem = paths.socket_path_problem(sock_path)
    if problem:
        raise StartupError(problem)
    registry = Registry(runtime)
    session_id = _session_to_restore(args, name)
    # The session is claimed with the name, in one locked transaction: no two pods restore it.
    entry = make_entry(name, str(sock_path), scope, parent=None, session=session_id)
    try:
        registry.register(entry)
    except (RegistryConflict, RegistryError) as exc:
        raise StartupError(f"cannot start pod {name!r}: {exc}") from None
    try:
        paths.ensure_dir(pod_dir)
        (pod_dir / "pid").write_text(f"{os.getpid()}\n")
        return _serve(args, manifest, scope, registry, entry, instruction, session_id, sock_path)
    finally:
        registry.release(name, entry.pid)
        with contextlib.suppress(OSError):
            (pod_dir / "pid").unlink()
        with contextlib.suppress(OSError):
            sock_path.unlink()


def _session_to_restore(args: argparse.Namespace, name: str) -> str | None:
    if args.session:
        return str(args.session)
    if args.resume:
        from poddaemon.store.file import newest_session_for

        found = newest_session_for(paths.sessions_dir(), name)
        if found is None:
            raise StartupError(f"--resume: no session of pod {name!r} in {paths.sessions_dir()}")
        return found
    return None


def _serve(
    args: argparse.Namespace,
    manifest: object,
    scope: object,
    registry: object,
    entry: object,
    instruction: object,
    session_id: str | None,
    sock_path: Path,
) -> int:
    from poddaemon.config.manifest import Manifest
    from poddaemon.events import EventBus
    from poddaemon.llm import make_client
    from poddaemon.pod import Pod, Services
    from poddaemon.prompt import Instruction
    from poddaemon.registry import PodEntry, Registry
    from poddaemon.scope import Scope
    from poddaemon.server import RpcServer
    from poddaemon.store.log import LogCorrupt
    from poddaemon.tools import BUILTIN

    assert isinstance(manifest, Manifest) and isinstance(scope, Scope)
    assert isinstance(registry, Registry) and isinstance(entry, PodEntry)
    assert isinstance(instruction, Instruction)
    bus = EventBus()
    services = Services(
        manifest=manifest,
        scope=scope,
        registry=registry,
        entry=entry,
        bus=bus,
        sessions_dir=str(paths.ensure_dir(paths.sessions_dir())),
        instruction=instruction,
        tools=dict(BUILTIN),
        model=make_client(manifest.provider),
    )

    async def amain() -> int:
        from poddaemon.mcp import McpStartupError, start_mcp

        def alert(level: str, source: str, message: str) -> None:
            log.warning("%s", message)
            bus.publish("alert", {"level": level, "source": source, "message": message})

        # Servers start while the pod restores and binds; READY waits for them.
        mcp_start = asyncio.ensure_future(start_mcp(manifest, alert))
        pod = Pod(services)
        if session_id is not None:
            try:
                warnings = await pod.restore(session_id)
            except (LogCorrupt, FileNotFoundError, ValueError) as exc:
                raise StartupError(f"cannot restore session {session_id}: {exc}") from None
            for warning in warnings:
                pod._alert("warning", "session", warning)
        try:
            mcp = await mcp_start
        except McpStartupError as exc:
            raise StartupError(str(exc)) from None
        services.tools.update(mcp.tools)
        server = RpcServer(pod.handlers(), bus)
        await server.listen(sock_path)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, pod.request_shutdown)
        print(f"{READY_PREFIX}\t{manifest.pod.name}\t{sock_path}", file=sys.stderr, flush=True)
        if args.stderr_log:
            _move_stderr(sock_path.parent / "stderr.log")
        sd_notify("READY=1")
        try:
            await pod.serve()
        finally:
            sd_notify("STOPPING=1")
            await server.close()
            await mcp.aclose()
        return 0

    return _run_loop(amain())


def _run_loop(coro: "asyncio.Future[int] | object") -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return int(asyncio.run(coro))  # type: ignore[arg-type]
    return int(uvloop.run(coro))  # type: ignore[arg-type]


def _move_stderr(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
