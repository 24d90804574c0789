"""Spawn trees, the spawner's side (SPEC §9): start children, delegate scope, supervise them.

`Children` is the `PodHost` the pod tools act on. A child is `poddaemon run <manifest> --adopt
--callback <our socket>` in its own process group, started from our fully resolved manifest with
the tool's fields replaced. `spawn` returns once the child is READY and has acknowledged its task
as its first run; on any failure the child is stopped (or killed) and the model gets the child's
own message.

Each live child's process is watched with a pidfd: when it goes, the registry gives its write
areas back (our tools see them again) and the machine charges its tree's spending; a child that
went without a final report is reported `errored` (machine.child_ended). A restored spawner
re-adopts the live children the registry names it parent of.
"""

import asyncio
import contextlib
import functools
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec.structs import replace

from poddaemon.config.manifest import MCP_SEP
from poddaemon.entries import SPAWNER_KEY, Entry, OutboxItem, SystemItem
from poddaemon.machine import FINAL_REPORTS
from poddaemon.pipes import read_pipe
from poddaemon.readyline import parse_ready, parse_starting
from poddaemon.scope import Access, Rule, resolve
from poddaemon.session import KEPT_REPORT_IDS, input_size
from poddaemon.store.log import new_session_id
from poddaemon.tools.base import ToolError
from protocol import paths
from protocol.errors import PodNotRunning, RpcError

if TYPE_CHECKING:
    from poddaemon.config.manifest import Manifest
    from poddaemon.forkclient import Forked
    from poddaemon.pod import Pod
    from poddaemon.registry import PodEntry
    from protocol.aio import AsyncPodClient

log = logging.getLogger("poddaemon.spawn")

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0
UNANSWERED_GRACE = 2.0  # SIGTERM to SIGKILL, for a child that did not answer `shutdown`
STARTING_POLL = 0.05  # how often a call to a child that does not listen yet tries again
STATUS_TIMEOUT = 2.0  # a child slower than this to answer status is `unresponsive`
# A child's answer to `run` (an acknowledgement, not the run), beyond what its
# UserPromptSubmit hooks may take: a stopped or wedged child held the spawner's tool call,
# and with it its run, for good.
CALL_TIMEOUT = 30.0
# ...within our own `status`: well under what `podctl ls` waits for us (2 s), or one stopped
# child made its healthy spawner look unresponsive too.
STATUS_PROBE_TIMEOUT = 0.5


def reports_left(pod: "Pod", name: str) -> list[OutboxItem]:
    """The reports child `name` committed for us and never delivered, from its newest session
    (read-only). Only when its kept callback (`<data>/pods/<name>.callback`) names our
    socket: the name may be another pod's by now."""
    from poddaemon.session import fold
    from poddaemon.store.file import newest_session_for, read_session
    from poddaemon.store.log import LogCorrupt

    callback = paths.kept_callback(name)
    try:
        if os.path.abspath(callback.read_text().strip()) != os.path.abspath(pod.s.entry.socket):
            return []
        sid = newest_session_for(pod.s.sessions_dir, name)
        log_entries = read_session(pod.s.sessions_dir, sid).entries if sid else []
        return list(fold(log_entries).outbox.values())
    except FileNotFoundError:
        return []
    except (OSError, ValueError, LogCorrupt) as exc:
        log.warning("cannot read the reports child pod %r left in its log: %s", name, exc)
        return []


def _drop_kept(name: str, callback: str) -> None:
    """Remove the kept configuration a child that never became ready wrote (`<name>.toml` and
    the `.callback` naming us): spawn_pod failed, so no pod of that name ever was. Left, it
    made the name "another pod's" to every other spawner, and `podctl restart` started the
    configuration that failed. Only when the callback names us: else the files are not its."""
    sidecar = paths.kept_callback(name)
    try:
        if os.path.abspath(sidecar.read_text().strip()) != os.path.abspath(callback):
            return
    except OSError:
        return
    for path in (paths.kept_config(name), sidecar):  # (the configuration first: it is what
        with contextlib.suppress(OSError):  # names a pod; a lone callback names none)
            path.unlink()


def _kept_grant(name: str) -> int | None:
    """The budget a live child our log does not know holds, from its kept configuration
    (`<data>/pods/<name>.toml`: spawn_pod writes the grant there as its cap). Such a child was
    starting when we crashed, before `child_started` was committed; taken back with no grant,
    it was charged nothing while it could spend all of it, and its grant was granted again."""
    import tomllib

    try:
        with open(paths.kept_config(name), "rb") as f:
            budget = tomllib.load(f).get("budget")
    except (OSError, ValueError) as exc:
        log.warning("cannot read the budget of child pod %r: %s", name, exc)
        return None
    cap = budget.get("max_total_tokens") if isinstance(budget, dict) else None
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else None


def _path_arg(path: str, what: str) -> str:
    """`path` as given, or a ToolError: a NUL byte (no path has one) was an "internal error"."""
    if "\0" in path:
        raise ToolError(f"{what}: invalid path {path!r}: it contains a NUL byte")
    return path


def narrow_tools(m: "Manifest", asked: Any, offered: Mapping[str, str]) -> "Manifest":
    """The spawner's configuration `m` with exactly the tools `asked` (`spawn_pod`'s `tools`).

    A builtin name goes to `worker.tools`; `<server>__<tool>` keeps that MCP server with an
    allow-list of the tools so named, `<server>__*` keeps it as the spawner has it; a server
    none of whose tools is named is dropped. `offered` maps each MCP tool the spawner's model is
    offered (its allow-lists applied) to its server's own name for it: a child gets no tool its
    spawner does not have, so any other name is a ToolError naming it.
    """
    if not isinstance(asked, list) or not all(isinstance(t, str) for t in asked):
        raise ToolError("tools must be a list of tool names")
    configured = {s.name for s in m.mcp.servers}
    builtins: list[str] = []
    whole: set[str] = set()  # servers given as `<server>__*`
    allow: dict[str, list[str]] = {}  # server -> its tools named, by the server's own names
    unknown: list[str] = []
    for name in dict.fromkeys(asked):
        server, sep, tool = name.partition(MCP_SEP)
        if not sep:
            (builtins if name in m.worker.tools else unknown).append(name)
        elif tool == "*" and server in configured:
            whole.add(server)
        elif name in offered:
            allow.setdefault(server, []).append(offered[name])
        else:
            unknown.append(name)
    if unknown:
        raise ToolError(f"tools: {', '.join(unknown)} not available to this pod")
    servers = [
        s if s.name in whole else replace(s, tools=allow[s.name])
        for s in m.mcp.servers
        if s.name in whole or s.name in allow
    ]
    kept = {s.name for s in servers}
    caps = m.worker.tool_output
    per_tool = {  # a cap on a dropped server's tool would name a server the child lacks
        tool: limit
        for tool, limit in caps.per_tool.items()
        if MCP_SEP not in tool or tool.partition(MCP_SEP)[0] in kept
    }
    worker = replace(m.worker, tools=builtins, tool_output=replace(caps, per_tool=per_tool))
    return replace(m, worker=worker, mcp=replace(m.mcp, servers=servers))


async def _connect(socket: str) -> "AsyncPodClient":
    """A client on a child pod's socket (its module loads with the first: most pods never
    spawn, and their start-up does not pay for it)."""
    from protocol.aio import AsyncPodClient

    return await AsyncPodClient.connect(socket)


async def _reach(child: "_Live") -> "AsyncPodClient":
    """A client on `child`'s socket. A child restarted from a shell is taken back as it
    registers, before it listens (its SessionStart hooks and MCP servers first, as `podctl
    send` waits for): until it does, while it lives, wait for it. The caller bounds the wait."""
    while True:
        try:
            return await _connect(child.socket)
        except PodNotRunning:
            if child.gone.is_set():
                raise
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STARTING_POLL):
                await child.gone.wait()


class _Live(msgspec.Struct):
    """A live child's process as we watch it."""

    name: str
    pid: int
    socket: str
    proc: "asyncio.subprocess.Process | None" = None  # ours to reap when we started it
    gone: asyncio.Event = msgspec.field(default_factory=asyncio.Event)
    fd: int = -1


class Children:
    def __init__(self, pod: "Pod") -> None:
        self.pod = pod
        self.live: dict[str, _Live] = {}
        self.outstanding: dict[str, set[str]] = {}  # child -> runs we asked for, not reported
        self.changed = asyncio.Event()  # a report arrived or a child went
        self._spawning: set[str] = set()
        # Runs whose run.finished arrived before `_expect` saw them (the report may come
        # before the run's ack reaches us): taken by `_expect`; the newest KEPT_REPORT_IDS
        # (an ordered set: a report of a run nobody expects in this life is never taken).
        self._reported: dict[str, None] = {}
        # Children taken back after our restart: which runs we gave them died with our memory,
        # so `wait_pods` waits for them while they are running.
        self._taken_back: set[str] = set()
        self._registry_seen: tuple[int, int, int] | None = None  # pods.json as we last read it
        self._not_ours: set[str] = set()  # named us parent, scope not inside ours (warned)
        # Children we stop as our model is told (its spawn_pod failed, or stop_pod). One
        # stopped before its first input has no log to report `shutdown` from: it was
        # reported `errored`, "died without a final report", after the model was told.
        self._stopping: set[str] = set()
        self._unfunded: set[str] = set()  # restarted children we stop: no budget left for them

    # --- start-up: re-adopt --------------------------------------------------------------------

    def adopt(self) -> None:
        """Watch the live children the registry names us parent of; a child the log knows as
        live but that is gone ended while we were down."""
        pod = self.pod
        _remove_stale_spawn_files()
        mine = {
            e.name: e
            for e in pod.s.registry.live()
            if e.parent == pod.name and self._within_our_scope(e)
        }
        for name, entry in list(mine.items()):
            if self._refuse_unfunded(entry):
                del mine[name]
                continue
            record = pod.state.children.get(name)
            if record is None or not record.live:
                grant = _kept_grant(name) if record is None else None
                pod.feed(pod.machine.child_started(name, entry.socket, grant, entry.scope, True))
            self._watch(_Live(name, entry.pid, entry.socket))
            self._taken_back.add(name)
        for name, record in list(pod.state.children.items()):
            if record.live and name not in mine:
                self._ended(name, f"child pod {name!r} ended while its spawner was not running")
        if mine or pod.s.entry.delegated:  # (a registry write: only when there is a tree)
            self._refresh_scope()

    # --- observing committed entries -----------------------------------------------------------

    def observe(self, entry: Entry) -> None:
        if isinstance(entry, SystemItem) and entry.pod is not None:
            if entry.event_kind == "run.finished" and entry.run_id is not None:
                self.outstanding.get(entry.pod, set()).discard(entry.run_id)
                self._reported[entry.run_id] = None  # may come before the run's ack reached us
                if len(self._reported) > KEPT_REPORT_IDS:
                    del self._reported[next(iter(self._reported))]
            self.changed.set()

    def heard_from(self, name: str) -> None:
        """A `pod_event` arrived from `name`. If we do not watch it, it is a child restarted
        (podctl restart) after we saw it die: take it back if the registry names us parent."""
        if name not in self.live and name not in self._spawning:
            asyncio.get_running_loop().call_soon(self._readopt, name)

    def registry_changed(self) -> None:
        """pods.json changed: a child restarted (podctl restart) while we live names us parent
        and holds its area again; take it back at once, or our tools would keep writing there
        (it need not report to us soon)."""
        if not self.pod.state.children:
            return
        try:
            entries = self.pod.s.registry.live()
        except Exception as exc:
            log.warning("cannot read the registry: %s", exc)
            return
        for entry in entries:
            if entry.parent != self.pod.name or entry.name in self._spawning:
                continue
            if entry.name not in self.live:  # (one we watch: no second read of the registry)
                self._readopt(entry.name)

    def before_tool(self) -> None:
        """Before each tool call: if pods.json changed since we last looked, a restarted child
        may hold its area again; take it back now rather than at the next registry poll, so no
        tool call starting after the child registered writes there. One stat when unchanged."""
        if not self.pod.state.children:
            return
        try:
            st = os.stat(self.pod.s.registry.path)
        except OSError:
            return
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)  # replaced whole: a new inode each write
        if seen != self._registry_seen:
            self._registry_seen = seen
            self.registry_changed()

    def _readopt(self, name: str) -> None:
        pod = self.pod
        entry = pod.s.registry.get(name)
        if name in self.live or entry is None or entry.parent != pod.name:
            return
        if not self._within_our_scope(entry) or self._refuse_unfunded(entry):
            return
        grant = _kept_grant(name) if name not in pod.state.children else None
        pod.feed(pod.machine.child_started(name, entry.socket, grant, entry.scope, True))
        self._watch(_Live(name, entry.pid, entry.socket))
        self._taken_back.add(name)
        self._refresh_scope()

    def _refuse_unfunded(self, entry: "PodEntry") -> bool:
        """A child that ended (its grant handed back to us) and was started again (`podctl
        restart`) runs on its old grant: taken back, its grant is charged again, and if we
        granted that budget out again since, the tree could spend past our cap (found by QA:
        1,600 tokens under a cap of 1,000). Such a child is stopped, with an alert; True."""
        name = entry.name
        if name in self._unfunded:
            return True  # being stopped already
        machine = self.pod.machine
        cap = machine.cfg.budget_cap
        record = self.pod.state.children.get(name)
        if cap is None or record is None or record.live or record.grant is None:
            return False
        others = machine.budget_charged() - record.charged()
        back = msgspec.structs.replace(record)
        back.come_back(entry.socket, entry.scope)  # as taking it back would make it
        if others + back.charged() <= cap:
            return False
        self._unfunded.add(name)
        self.pod.alert(
            "warning",
            f"child pod {name!r} was started again, but the {record.grant} tokens granted to it "
            f"were given out since it ended ({max(0, cap - others)} of budget.max_total_tokens "
            f"= {cap} left): it is stopped; spawn it anew with a budget that fits",
            "spawn",
        )

        async def stop() -> None:
            try:
                await self._stop_child(_Live(name, entry.pid, entry.socket), watch=True)
            finally:
                self._unfunded.discard(name)

        self.pod.spawn_background(stop())
        return True

    def _within_our_scope(self, entry: "PodEntry") -> bool:
        """A registered pod naming us parent is ours to take back only if its scope lies in
        ours, as spawn_pod checks: a pod started afresh under a gone spawner's name with
        another scope took its detached children back, and its model could then steer pods
        that reach where it cannot (SPEC §9: a child gets no scope its spawner lacks)."""
        granted = self.pod.s.scope
        for rule in entry.scope_obj().allow:
            if granted.access(rule.target) < rule.access or not any(
                r.access >= rule.access and r.contains(rule) for r in granted.allow
            ):
                if entry.name not in self._not_ours:  # once: each registry change asks again
                    self._not_ours.add(entry.name)
                    log.warning(
                        "pod %r names this pod its parent, but its scope (%s) is not inside "
                        "this pod's: not taken as a child",
                        entry.name,
                        rule.target,
                    )
                return False
        return True

    # --- the PodHost methods -------------------------------------------------------------------

    async def spawn(self, args: dict[str, Any]) -> dict[str, Any]:
        pod = self.pod
        name = str(args["name"])
        if not paths.POD_NAME_RE.match(name):
            raise ToolError(f"invalid pod name {name!r}: use [a-z0-9][a-z0-9_-]{{0,47}}")
        spawn_cfg = pod.m.spawn
        if spawn_cfg.max_depth < 1:
            raise ToolError("cannot spawn: spawn.max_depth reached (no levels left below this pod)")
        if len(self.live) + len(self._spawning) >= spawn_cfg.max_children:
            raise ToolError(
                f"cannot spawn: {len(self.live)} live children (spawn.max_children = "
                f"{spawn_cfg.max_children})"
            )
        if name in self._spawning or name in self.live:
            raise ToolError(f"cannot spawn: a child named {name!r} exists already")
        if not str(args["task"]).strip():
            raise ToolError("cannot spawn: the task is empty; say what the child should do")
        self._refuse_anothers_name(name)
        grant = self._grant(args.get("budget_tokens"))
        manifest = self._child_manifest(name, args, grant)
        limit = manifest.worker.max_input_bytes
        if (size := input_size(str(args["task"]))) > limit:  # the child would refuse it
            raise ToolError(
                f"cannot spawn: the task is {size:,} bytes, over the child's "
                f"worker.max_input_bytes ({limit:,}); put it in a file the child can read "
                "and give its path"
            )
        self._spawning.add(name)
        try:
            return await self._start(name, manifest, str(args["task"]), grant)
        finally:
            self._spawning.discard(name)

    async def send(self, pod_name: str, message: str, mode: str) -> dict[str, Any]:
        child = self._child(pod_name)
        key = f"{SPAWNER_KEY}{new_session_id()}"
        result = await self._call(child, "run", {"input": message, "mode": mode, "client_key": key})
        run_id = result.get("run_id")
        if run_id and result.get("state") != "steered":
            self._expect(pod_name, str(run_id))
        return dict(result)

    async def wait(self, pods: list[str] | None, timeout: float) -> dict[str, Any]:
        known = self.pod.state.children
        names = list(pods) if pods is not None else [n for n, c in known.items() if c.live]
        for n in names:
            if n not in known:
                raise ToolError(f"no child pod named {n!r}")
        deadline = time.monotonic() + timeout

        async def waiting_for(n: str) -> bool:
            if n not in self.live:
                return False
            if self.outstanding.get(n):
                return True
            return n in self._taken_back and self._still_at_work(n, await self._state(n))

        async def pending() -> bool:
            return any([await waiting_for(n) for n in names])

        while True:
            self.changed.clear()  # before looking: a report that comes meanwhile wakes us
            if not await pending():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self.changed.wait()
        out: dict[str, Any] = {}
        for n in names:
            record = known[n]
            state = await self._state(n) if n in self.live else "stopped"
            busy = bool(self.outstanding.get(n)) or (
                n in self._taken_back and self._still_at_work(n, state)
            )
            out[n] = {
                "state": state,
                "outcome": record.outcome,
                "text": record.text,
                "waiting": n in self.live and busy,
            }
        return out

    async def list_children(self) -> list[dict[str, Any]]:
        records = list(self.pod.state.children.items())
        # At once, as `infos` does: one after another, each child that does not answer cost
        # the run STATUS_TIMEOUT (8 stopped children: 16 s of one list_pods call).
        probes = await asyncio.gather(*(self._probe(name) for name, _ in records))
        out = []
        for (name, record), (state, spent) in zip(records, probes, strict=True):
            out.append(
                {
                    "name": name,
                    "state": state,
                    "scope": [
                        {k: r[k] for k in ("target", "permission") if k in r}
                        | ({"deny": True} if r.get("deny") else {})
                        for r in record.scope
                    ],
                    "spent_tokens": spent,
                }
            )
        return out

    async def stop(self, pod_name: str) -> dict[str, Any]:
        """The child and its own subtree, deepest first: under on_parent_exit = "detach" a
        stopping child leaves its children running, but stop_pod means the whole subtree."""
        child = self._child(pod_name)
        for entry in self._descendants(pod_name):
            await self._stop_child(_Live(entry.name, entry.pid, entry.socket), watch=True)
        await self._stop_told(child)
        return {"stopped": True}

    # --- status and shutdown -------------------------------------------------------------------

    async def infos(self) -> list[dict[str, Any]]:
        """The live children for `status`, with their trees' spending as they say now."""
        live = list(self.live.values())
        probes = await asyncio.gather(  # at once: bounded
            *(self._probe(c.name, STATUS_PROBE_TIMEOUT) for c in live)
        )
        return [
            {"name": c.name, "pid": c.pid, "state": state, "socket": c.socket, "spent": spent}
            for c, (state, spent) in zip(live, probes, strict=True)
        ]

    async def on_stop(self) -> None:
        """The pod stops: with on_parent_exit = "stop", its children stop first (each stops its
        own before it exits, so the tree goes deepest first)."""
        if self.pod.m.spawn.on_parent_exit != "stop" or not self.live:
            return
        await asyncio.gather(*(self._stop_child(c) for c in list(self.live.values())))

    # --- helpers -------------------------------------------------------------------------------

    def _child(self, name: str) -> _Live:
        child = self.live.get(name)
        if child is None:
            if name in self.pod.state.children:
                raise ToolError(f"child pod {name!r} is not running")
            raise ToolError(f"no child pod named {name!r}")
        return child

    def _expect(self, name: str, run_id: str) -> None:
        """`wait_pods` waits for this run's report (unless it is here already)."""
        if run_id in self._reported:
            del self._reported[run_id]  # its report came first: nothing to wait for
        else:
            self.outstanding.setdefault(name, set()).add(run_id)

    def _refuse_anothers_name(self, name: str) -> None:
        """A stopped pod's name that is not one of our children's: its kept configuration
        (what `podctl restart` starts, SPEC §9) and its sessions are another pod's, and the
        child would replace that configuration with its own. A live pod's name is left to
        the registry (which says which pod runs)."""
        if not paths.kept_config(name).exists() or self.pod.s.registry.get(name) is not None:
            return
        try:
            owner = paths.kept_callback(name).read_text().strip()
        except FileNotFoundError:
            owner = ""
        except OSError as exc:
            raise ToolError(f"cannot spawn {name!r}: {exc}") from None
        if os.path.abspath(owner or "/") != os.path.abspath(self.pod.s.entry.socket):
            raise ToolError(
                f"cannot spawn: {name!r} is the name of another pod (stopped; its configuration "
                "is kept for `podctl restart`); choose another name"
            )

    def _grant(self, asked: Any) -> int | None:
        remaining: int | None = self.pod.machine.budget_remaining()
        if asked is not None:
            asked = int(asked)
            assert isinstance(asked, int)
            if asked <= 0:
                raise ToolError("budget_tokens must be positive")
            if remaining is not None and asked > remaining:
                raise ToolError(
                    f"cannot grant budget_tokens = {asked}: only {remaining} tokens of this "
                    "pod's budget remain"
                )
            return asked
        if remaining is None:
            return None
        if remaining <= 1:
            raise ToolError("cannot spawn: this pod's budget is exhausted")
        return remaining // 2  # no amount given: half of what remains (documented)

    def _child_manifest(self, name: str, args: dict[str, Any], grant: int | None) -> "Manifest":
        from poddaemon.config.manifest import FieldError, Manifest

        pod = self.pod
        m = pod.m
        cwd = m.pod.pwd
        rules = args["scope"]
        if not isinstance(rules, list) or not rules:
            raise ToolError("scope must be a non-empty list of {target, permission, recursive?}")
        allow: list[dict[str, Any]] = []
        for i, rule in enumerate(rules):
            if not isinstance(rule, dict) or not isinstance(rule.get("target"), str):
                raise ToolError(f"scope[{i}]: needs a target")
            unknown = sorted(set(rule) - {"target", "permission", "recursive"})
            if unknown:  # a misspelt field was dropped without a word
                raise ToolError(
                    f"scope[{i}]: unknown field {', '.join(unknown)} "
                    "(expected target, permission, recursive)"
                )
            perm = rule.get("permission", "read")
            if perm not in ("read", "write"):
                raise ToolError(f"scope[{i}].permission must be read or write")
            # Taken for its truth before: "false" (or 0) gave the whole tree, not one level.
            recursive = rule.get("recursive")
            if recursive is None:
                recursive = True
            elif not isinstance(recursive, bool):
                raise ToolError(f"scope[{i}].recursive must be true or false")
            target = resolve(_path_arg(rule["target"], f"scope[{i}].target"), cwd)
            want = Access.WRITE if perm == "write" else Access.READ
            has = pod.scope.access(target)
            if has < want:
                why = "delegated to another child" if self._delegated(target) else "outside"
                raise ToolError(
                    f"scope[{i}]: {perm} {target} is not inside this pod's scope ({why}: it "
                    f"has {has.label})"
                )
            asked = Rule(target=target, access=want, recursive=recursive)
            # What lies below the target too: one of our rules must reach as deep (our denies
            # go to the child with the rest of our configuration).
            if not any(r.access >= want and r.contains(asked) for r in pod.scope.allow):
                reach = "everything below it" if recursive else "what lies directly in it"
                raise ToolError(
                    f"scope[{i}]: {perm} {target} is not inside this pod's scope: it would "
                    f"give {reach}, deeper than this pod's own rules reach there"
                )
            allow.append({"target": target, "permission": perm, "recursive": recursive})
        if args.get("tools") is not None:
            m = narrow_tools(m, args["tools"], self._offered_mcp())
        pwd = resolve(_path_arg(str(args.get("pwd") or allow[0]["target"]), "pwd"), cwd)
        data = m.to_dict()
        data["pod"] = {"name": name, "pwd": pwd}
        data["scope"] = {"allow": allow, "deny": data.get("scope", {}).get("deny", [])}
        worker = data.setdefault("worker", {})
        if args.get("instruction"):
            worker["instruction"] = str(args["instruction"])
            worker.pop("instruction_file", None)
        elif worker.get("instruction_file") and m.source:
            base = os.path.dirname(os.path.abspath(m.source))
            worker["instruction_file"] = os.path.join(base, worker["instruction_file"])
        if args.get("model"):
            data["provider"]["model"] = str(args["model"])
        data["budget"] = {"max_total_tokens": grant} if grant is not None else {}
        data["spawn"] = {**data.get("spawn", {}), "max_depth": m.spawn.max_depth - 1}
        try:
            return msgspec.convert(data, Manifest)
        except (msgspec.ValidationError, FieldError) as exc:
            raise ToolError(f"invalid child configuration: {exc}") from None

    def _offered_mcp(self) -> dict[str, str]:
        """The MCP tools our model is offered: name -> the server's own name for it."""
        from poddaemon.mcp.tool import McpTool

        tools = self.pod.s.tools.tools.values()
        return {t.name: t.remote for t in tools if isinstance(t, McpTool)}

    async def _start(
        self, name: str, manifest: "Manifest", task: str, grant: int | None
    ) -> dict[str, Any]:
        pod = self.pod
        folder = paths.ensure_dir(paths.data_dir() / "pods")
        path = folder / f".spawn-{name}-{os.getpid()}.toml"
        fresh = not paths.kept_config(name).exists()  # no pod had this name yet
        paths.write_private(path, manifest.to_toml())  # the child's scope: ours alone to write
        cmd = [
            sys.executable,
            "-P",
            "-m",
            "poddaemon",
            "run",
            str(path),
            "--adopt",
            "--callback",
            pod.s.entry.socket,
            "--stderr-log",
        ]
        try:
            if self.pod.m.spawn.on_parent_exit == "detach":
                cmd = _own_scope(name) + cmd
            started = await _fork(cmd) or await _exec(cmd)
            try:
                socket = await _await_ready(started, str(path))
            except BaseException:
                await started.kill()
                if fresh:
                    _drop_kept(name, pod.s.entry.socket)
                raise
            finally:
                started.close()
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        child = _Live(name, started.pid, socket, started.proc)
        self._watch(child)
        scope = [dict(r) for r in msgspec.to_builtins(manifest.scope.allow)]
        pod.feed(pod.machine.child_started(name, socket, grant, scope))
        self._refresh_scope()
        try:
            result = await self._call(
                child, "run", {"input": task, "client_key": f"{SPAWNER_KEY}task"}
            )
        except BaseException as exc:
            await self._stop_told(child)
            if isinstance(exc, ToolError):
                # "Refused" only when it said no: one that died or hung did not refuse.
                how = "refused" if isinstance(exc, _Refused) else "did not take"
                raise ToolError(f"child pod {name!r} {how} its task: {exc}") from None
            raise
        self._expect(name, str(result["run_id"]))
        return {"name": name, "socket": socket}

    async def _call(self, child: _Live, method: str, params: dict[str, Any]) -> Any:
        # The child decides a `run` after its hooks (ours: it has our configuration).
        hooks = self.pod.m.hooks.UserPromptSubmit
        limit = CALL_TIMEOUT + sum(h.timeout for h in hooks)
        try:
            async with asyncio.timeout(limit):
                async with await _reach(child) as client:
                    raw = await client.call_raw(method, params)
        except RpcError as exc:  # the child's own refusal (-32007 budget, -32004 stopping, …)
            raise _Refused(str(exc)) from None
        except TimeoutError:
            raise ToolError(f"the child pod did not answer within {limit:g} s") from None
        except Exception as exc:  # no socket, connection lost
            raise ToolError(f"cannot reach the child pod: {exc}") from None
        return msgspec.json.decode(raw)

    def _still_at_work(self, name: str, state: str) -> bool:
        """A child taken back after our restart (the runs we gave it died with our memory),
        in `state`: running, or holding a report it could not deliver while we were down (it
        retries with backoff, so it may come a few seconds after we are back)."""
        if state in ("running", "starting"):  # starting: it may resume a run cut short
            return True
        accepted = self.pod.state.report_ids
        return any(o.event_id not in accepted for o in reports_left(self.pod, name))

    async def _state(self, name: str) -> str:
        return (await self._probe(name))[0]

    async def _probe(self, name: str, timeout: float = STATUS_TIMEOUT) -> tuple[str, int]:
        """A child's state, and its tree's spending as it says now (reports tell only of the
        runs this pod asked for: a run someone else sent it spends too); the last reported
        spending when it cannot say."""
        record = self.pod.state.children.get(name)
        reported = record.spent if record is not None else 0
        child = self.live.get(name)
        if child is None:
            return "stopped", reported
        try:
            async with await _connect(child.socket) as client:
                async with asyncio.timeout(timeout):
                    raw = await client.call_raw("status")
            status = msgspec.json.decode(raw)
            return str(status["state"]), max(reported, int(status["budget"]["tree_spent"]))
        except PodNotRunning:  # taken back as it registered: its hooks and servers at work
            return ("stopped" if child.gone.is_set() else "starting"), reported
        except Exception:
            return "unresponsive", reported

    def _descendants(self, name: str) -> "list[PodEntry]":
        """The live pods below `name` in the registry, deepest first."""
        live = self.pod.s.registry.live()
        out: list[PodEntry] = []
        seen = {name}

        def below(parent: str) -> None:
            for e in live:
                if e.parent == parent and e.name not in seen:
                    seen.add(e.name)
                    below(e.name)
                    out.append(e)

        below(name)
        return out

    def _delegated(self, path: str) -> bool:
        """`path` lies in a write area a live child holds (not merely outside our scope)."""
        return any(
            rule.covers(path)
            for record in self.pod.state.children.values()
            if record.live
            for rule in record.write_areas()
        )

    async def _stop_told(self, child: _Live) -> None:
        """Stop `child` where the model learns of it from its tool call: its end is no news."""
        self._stopping.add(child.name)
        try:
            await self._stop_child(child)
        finally:
            self._stopping.discard(child.name)

    async def _stop_child(self, child: _Live, watch: bool = False) -> None:
        """`shutdown`, then wait for the process; SIGTERM, then SIGKILL its group if it lingers.
        `watch`: a descendant that is not our child, whose exit we learn of here."""
        if watch:
            _exited(child)
        answered = False
        with contextlib.suppress(Exception):
            async with await _connect(child.socket) as client:
                async with asyncio.timeout(5.0):
                    # (-32004, stopping already: an answer too)
                    with contextlib.suppress(RpcError):
                        await client.call_raw("shutdown")
                    answered = True
        # One that did not answer (wedged, SIGSTOPped) is not waited for as one stopping is:
        # 20 s more before SIGTERM made `podctl stop` of its spawner give up (10 s) and fail.
        graces = (STOP_TIMEOUT, 5.0, 5.0) if answered else (0.0, UNANSWERED_GRACE, 5.0)
        for sig, grace in zip((None, signal.SIGTERM, signal.SIGKILL), graces, strict=True):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, sig)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await child.gone.wait()
                return

    def _watch(self, child: _Live) -> None:
        """Learn of the child's exit through a pidfd (readable once the process has ended)."""
        self.live[child.name] = child
        try:
            child.fd = os.pidfd_open(child.pid)
        except ProcessLookupError:
            asyncio.get_running_loop().call_soon(self._gone, child)
            return
        asyncio.get_running_loop().add_reader(child.fd, self._gone, child)

    def _gone(self, child: _Live) -> None:
        if child.gone.is_set():
            return
        loop = asyncio.get_running_loop()
        if child.fd >= 0:
            loop.remove_reader(child.fd)
            os.close(child.fd)
            child.fd = -1
        child.gone.set()
        self.live.pop(child.name, None)
        mid_run = bool(self.outstanding.pop(child.name, None))
        code = child.proc.returncode if child.proc is not None else None
        how = f" (exit status {code})" if code is not None else ""
        reason = f"child pod {child.name!r} (pid {child.pid}) died without a final report{how}"
        self._refresh_scope()
        self._ended(child.name, reason, mid_run)
        self.changed.set()
        if child.proc is not None:  # reap it (asyncio's watcher does; keep the task referenced)
            task = asyncio.ensure_future(child.proc.wait())
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    def _ended(self, name: str, reason: str, mid_run: bool = False) -> None:
        """A child's process is gone. Unless its last delivered report was final, what it
        committed but could not deliver (its spawner was down, or it died first) waits in its
        log: taken from there, no report is lost (SPEC §9). Then its end: `errored` when
        none of its reports was final (`mid_run`: in a run we gave it that has not reported)."""
        pod = self.pod
        record = pod.state.children.get(name)
        final = record is None or not record.live or record.last_kind in FINAL_REPORTS
        # Stopping too: a child stopped with us reports its cut run and its shutdown as it
        # goes, and we refuse delivery then; from our log they reach the restored model.
        if not final and (left := reports_left(pod, name)):
            pod.feed(pod.machine.child_left_reports(name, left))
        pod.feed(pod.machine.child_ended(name, reason, name in self._stopping, mid_run))

    def _refresh_scope(self) -> None:
        """Our tools' scope: the granted one minus what live children hold (a registry
        transaction reclaims a dead child's entry, which hands its areas back). The areas of
        the children we watch stay out too, whatever pods.json says: an older copy put in its
        place names no delegation until they register again, and meanwhile we took write
        access back to their areas, and kept it."""
        pod = self.pod
        try:
            entry = pod.s.registry.update(pod.name, pod.s.entry.pid)
        except Exception as exc:
            log.warning("cannot refresh the delegated scope: %s", exc)
            return
        watched = [
            rule
            for name in self.live
            if (record := pod.state.children.get(name)) is not None
            for rule in record.write_areas()
        ]
        scope = pod.s.scope.with_delegated([*entry.delegated_areas(), *watched])
        if scope != pod.scope:
            pod.scope = scope
            pod.tool_ctx.scope_changed()  # commands too (when the sandbox confines them)


class _Refused(ToolError):
    """The child answered a call with an error: its own refusal."""


def _remove_stale_spawn_files() -> None:
    """Remove the manifests `_start` hands children (`.spawn-<name>-<pid>.toml`) that a
    spawner killed mid-spawn left: a copy of a child's whole configuration, scope included,
    that nothing else ever removes. Ours (from an earlier process with our pid: we spawned
    nothing yet) and those whose spawner is gone."""
    folder = os.path.join(paths.data_dir(), "pods")
    prefix, suffix = ".spawn-", ".toml"  # (matched by hand: a glob compiles its pattern, ~1 ms)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        _, dash, pid = name[len(prefix) : -len(suffix)].rpartition("-")
        if dash and pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exited(child: _Live) -> None:
    """Set `child.gone` when its process ends (a pidfd, closed then)."""
    try:
        fd = os.pidfd_open(child.pid)
    except ProcessLookupError:
        child.gone.set()
        return
    loop = asyncio.get_running_loop()

    def readable() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        child.gone.set()

    loop.add_reader(fd, readable)


class _Started:
    """A child starting up: exec'd by us (`proc`), or forked by the fork server (`forked`, which
    reports its exit status while we listen). `stderr` is its stderr until READY."""

    def __init__(
        self,
        pid: int,
        stderr: asyncio.StreamReader,
        proc: "asyncio.subprocess.Process | None" = None,
        forked: "Forked | None" = None,
        transport: asyncio.BaseTransport | None = None,
    ) -> None:
        self.pid = pid
        self.stderr = stderr
        self.proc = proc
        self.forked = forked
        self.transport = transport

    async def wait(self) -> int | None:
        if self.proc is not None:
            return await self.proc.wait()
        assert self.forked is not None
        try:
            return await asyncio.to_thread(self.forked.wait, 5.0)
        except TimeoutError:
            return None

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await self.wait()

    def close(self) -> None:
        """After READY (or failure): we read its stderr no more; asyncio reaps an exec'd one."""
        if self.transport is not None:
            self.transport.close()
        if self.forked is not None:
            self.forked.close()


async def _await_ready(started: "_Started", manifest: str) -> str:
    """Read the child's stderr until READY; its earlier lines are its error otherwise (less
    the name of its `manifest`, a file gone by the time the model reads the error)."""
    output = bytearray()
    started_at = time.monotonic()
    deadline = started_at + READY_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            waited = deadline - started_at
            raise ToolError(f"child pod did not become ready within {waited:.0f} s")
        try:
            async with asyncio.timeout(left):
                line = await started.stderr.readline()
        except TimeoutError:
            continue
        if not line:
            break
        if (ready := parse_ready(line)) is not None:
            return ready[1]
        if (longer := parse_starting(line)) is not None:  # its MCP servers or hooks may take it
            deadline = max(deadline, time.monotonic() + longer + READY_TIMEOUT)
            continue
        output += line
    code = await started.wait()
    text = output.decode("utf-8", "replace").replace(f"{manifest}: ", "").strip()
    lines = [ln.removeprefix("poddaemon: ") for ln in text.splitlines() if ln.strip()]
    message = "\n".join(lines[-5:]) or f"it exited with status {code}"
    raise ToolError(f"child pod failed to start: {message}")


def _own_scope(name: str) -> list[str]:
    """What to run a detached child under when this pod runs in a systemd unit: a transient
    scope of the child's own (`systemd-run --scope` execs it in place, same pid and fds).
    Left in the unit's cgroup, the child would be SIGKILLed whenever the unit stops or
    restarts (KillMode=mixed), though "detach" means it runs on and is adopted again.
    [] outside a unit, or without systemd-run (then it goes with the unit)."""
    import shutil

    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if "INVOCATION_ID" not in os.environ or not os.path.exists(f"{runtime}/systemd/private"):
        return []  # not run by a (reachable) user manager
    exe = shutil.which("systemd-run")
    if exe is None:
        return []
    unit = f"poddaemon-child-{name}-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"
    return [
        exe,
        "--user",
        "--scope",
        "--quiet",
        "--collect",
        f"--unit={unit}",
        f"--description=poddaemon child pod {name} (on_parent_exit = detach)",
    ]


async def _exec(cmd: list[str]) -> _Started:
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stderr is not None
    return _Started(proc.pid, proc.stderr, proc=proc)


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _forked_for_nobody(read_end: int, thread: "asyncio.Future[Forked | None]") -> None:
    """The fork server's thread returned after its spawn was cancelled: stop what it forked."""
    os.close(read_end)
    if thread.cancelled() or thread.exception() is not None:
        return
    forked = thread.result()
    if forked is not None:
        _stop_forked(forked)


def _stop_forked(forked: "Forked") -> None:
    """A child forked for a spawn cancelled meanwhile: nobody will wait for it, or release
    the scope it is about to claim."""
    log.warning("spawn cancelled while the fork server started it: killing pid %d", forked.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(forked.pid, signal.SIGKILL)
    forked.close()


async def _fork(cmd: list[str]) -> _Started | None:
    """The child forked by the fork server, sharing its preloaded modules with us and our
    siblings; None (then it is exec'd) when the server is off or out of reach, or when this pod
    runs in a systemd unit: its children belong in the unit's cgroup, stopped with it."""
    from poddaemon import forkclient  # (json, hashlib: not on the way to READY)

    if not forkclient.enabled() or "INVOCATION_ID" in os.environ:
        return None
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    # The thread is not cancelled with us (no thread can be): our descriptors are closed only
    # once it is done with them (closed under it, their numbers could be reused and passed to
    # the child as its stdio), and a child it forks for a spawn cancelled meanwhile is stopped.
    thread = asyncio.ensure_future(
        asyncio.to_thread(forkclient.fork_pod, cmd, (null, null, write_end), alone_ok=True)
    )
    thread.add_done_callback(lambda _: _close(null, write_end))
    try:
        forked = await asyncio.shield(thread)
    except asyncio.CancelledError:
        thread.add_done_callback(functools.partial(_forked_for_nobody, read_end))
        raise
    except forkclient.ServerLost as exc:
        # It had the request. The child's stderr pipe tells whether it forked one: nothing on
        # it before its end means no process holds it (our write end is closed by now), so
        # none runs, and the child is exec'd (see cli.spawn._after_server_lost). (The done
        # callback closing it was added before the shield's: it ran before we woke up.)
        try:
            readable: list[int]
            readable, _, _ = await asyncio.to_thread(
                select.select, [read_end], [], [], READY_TIMEOUT
            )
            nothing = bool(readable) and not os.read(read_end, 1)
        finally:
            os.close(read_end)
        if nothing:
            return None
        raise ToolError(f"{exc} (a child it forked may be starting: list_pods)") from None
    except OSError as exc:  # short of descriptors, say, before the server had the request
        os.close(read_end)
        log.warning("cannot have the fork server start the child (%s): exec'ing it", exc)
        return None
    except BaseException:
        os.close(read_end)
        raise
    if forked is None:
        os.close(read_end)
        return None
    reader = asyncio.StreamReader(limit=1 << 20)
    try:
        transport = await read_pipe(read_end, reader)
    except BaseException:  # cancelled in the loop pass connecting takes
        _stop_forked(forked)
        raise
    return _Started(forked.pid, reader, forked=forked, transport=transport)
