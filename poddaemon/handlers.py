"""The pod's JSON-RPC methods (one per entry of `protocol.methods`). The server hands each its
typed params; a method either answers from the pod's state or runs a command through the
machine and awaits the machine's reply."""

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

import poddaemon
from poddaemon.session import input_size
from poddaemon.store.file import continued_sessions, read_page
from poddaemon.store.log import LogCorrupt, new_session_id
from protocol import errors
from protocol.errors import RpcError
from protocol.types import (
    BudgetInfo,
    CancelParams,
    ChildInfo,
    HistoryParams,
    HistoryResult,
    McpServerInfo,
    NoParams,
    NotifyParams,
    PodEventParams,
    QueueInfo,
    RunParams,
    ScopeEntry,
    StatusResult,
    SubscribeParams,
    SubscribeResult,
    UsageCall,
    UsageResult,
    UsageTotals,
)

if TYPE_CHECKING:
    from poddaemon.pod import Pod
    from poddaemon.scope import Scope

Handler = Callable[[Any, Any], Any]

# Hooks that decide nothing (Notification, SubagentStop) running at once; the others wait
# their turn. Each started as its event came: a burst of 300 notifications ran 300 hook
# commands at once (600 processes with their shells), and a flood could exhaust the user's.
MAX_BACKGROUND_HOOKS = 4
# Of those, how many may wait their turn: past it, a hook is skipped (with one alert) until the
# backlog drains. Unbounded, a flood of notifications to a pod whose Notification hook takes
# a second queued a task per notification, gigabytes within minutes.
MAX_WAITING_HOOKS = 1000
MAX_HISTORY_PAGE = 10_000  # entries per `history` reply, whatever `limit` asks; `next` pages on
# Bytes of entries per `history` reply (but always one entry): far below what a client reads in
# one frame (protocol.framing.MAX_REPLY_BYTES), however large the entries of a session are.
MAX_HISTORY_PAGE_BYTES = 16 * 1024 * 1024
_encoder = msgspec.json.Encoder()


def _not_blank(text: str, field: str) -> None:
    """Nothing for the model to read would still cost a turn, and fail it with providers
    that refuse blank text (Anthropic): refused here, as `podctl send` refuses it."""
    if not text.strip():
        raise RpcError(errors.INVALID_PARAMS, f"invalid params.{field}: empty or only whitespace")


def _not_too_big(text: str, field: str, limit: int, source: str = "") -> None:
    """An input stays in the context once the model has read it: one larger than its window
    failed every later run (and each compaction's summary). Refused at the door instead.
    A notification's `source` is read with it (and its sender chooses it): it counts too."""
    if (len(text) + len(source)) * 4 <= limit:  # (UTF-8: at most 4 bytes a character)
        return
    size = input_size(text, source)
    if size > limit:
        counted = f"{size:,} bytes with params.source" if source else f"{size:,} bytes"
        raise RpcError(
            errors.INVALID_PARAMS,
            f"invalid params.{field}: {counted}, over worker.max_input_bytes ({limit:,}); "
            "put it in a file the pod can read and send its path",
        )


def handlers(pod: "Pod") -> dict[str, Handler]:
    m = pod.machine
    max_input = m.cfg.max_input_bytes
    hooks = pod.hooks
    scope_entries = ScopeEntries()
    prompts_in_order = asyncio.Lock()
    background_hooks = asyncio.Semaphore(MAX_BACKGROUND_HOOKS)
    backlog = 0  # background hooks running or waiting their turn
    skipping = False  # the backlog was full: one alert until it is not

    def _in_background(event: str, fields: dict[str, Any]) -> None:
        nonlocal backlog, skipping
        if backlog >= MAX_BACKGROUND_HOOKS + MAX_WAITING_HOOKS:
            if not skipping:
                skipping = True
                pod.alert(
                    "warning",
                    f"{event} hooks fall behind ({MAX_WAITING_HOOKS} waiting): further ones "
                    "are skipped until they catch up",
                    source="hooks",
                )
            return
        skipping = False
        backlog += 1  # counted now: a burst read at once starts its tasks only later
        pod.spawn_background(_background_hook(event, fields)).add_done_callback(_one_less)

    def _one_less(task: "asyncio.Task[None]") -> None:
        nonlocal backlog
        backlog -= 1

    async def _background_hook(event: str, fields: dict[str, Any]) -> None:
        assert hooks is not None
        async with background_hooks:
            await hooks.run(event, fields)

    def run(p: RunParams, conn: Any) -> Any:
        _not_blank(p.input, "input")
        # A retried key gets its original result (or -32006) from the machine: that prompt
        # was judged when it was committed (under the bound of then: a pod restarted with a
        # lower one), and a refusal now would say nothing was.
        retried = p.client_key is not None and p.client_key in m.state.run_keys
        if not retried:
            _not_too_big(p.input, "input", max_input)
        if hooks is not None and not retried and hooks.wants("UserPromptSubmit"):
            decided = asyncio.get_running_loop().create_future()
            conn.decide_before_next(decided)  # its later requests wait for the hook
            return _run_hooked(p, decided)
        # The server answers from the Pending: no task per acknowledgement.
        return pod.request_pending(lambda t: m.run(t, p.input, p.mode, p.client_key, p.wait))

    async def _run_hooked(p: RunParams, decided: "asyncio.Future[None]") -> Any:
        assert hooks is not None
        # One prompt at a time, in the order they came (the lock is fair): a second prompt's
        # hook may finish first (from another connection), and its run must not be queued
        # before the first one's.
        try:
            async with prompts_in_order:
                if not m.state.session_id and pod.plog.reserved is None:
                    await pod.reserve_session()  # the hook is told the session this prompt starts
                refused, context = await hooks.user_prompt(p.input)
                if refused is not None and m.stopping:
                    # The pod stopped while the hook ran or started (a guard the closed runner
                    # could not start blocks): what refused the prompt is the shutdown.
                    raise RpcError(errors.SHUTTING_DOWN, "the pod is shutting down")
                if refused is not None:  # nothing is committed
                    raise RpcError(errors.HOOK_REFUSED, refused)
                reply = pod.request_future(
                    lambda t: m.run(t, p.input, p.mode, p.client_key, p.wait, context)
                )
        finally:
            if not decided.done():  # committed (or refused): the connection reads on
                decided.set_result(None)
        return await reply

    def notify(p: NotifyParams, conn: Any) -> Any:
        _not_blank(p.message, "message")
        retried = p.client_key is not None and p.client_key in m.state.notify_keys
        if not retried:  # (as for run: its original result, whatever the bound is now)
            _not_too_big(p.message, "message", max_input, p.source)
        if hooks is not None and not retried and hooks.wants("Notification"):
            reply = pod.request_future(lambda t: m.notify(t, p.message, p.source, p.client_key))
            return _notify_hook(reply, p)
        # The server answers from the Pending: no task per acknowledgement.
        return pod.request_pending(lambda t: m.notify(t, p.message, p.source, p.client_key))

    async def _notify_hook(reply: "asyncio.Future[Any]", p: NotifyParams) -> Any:
        result = await reply
        assert hooks is not None
        fields = {"message": p.message, "source": p.source}
        _in_background("Notification", fields)
        return result

    # Every command reaches the machine as its request is read, never from a task that runs
    # later: requests pipelined on one connection are decided in the order they were sent (a
    # `cancel` then a `run` cancels nothing; a `run` after a `shutdown` is refused). A prompt
    # with a UserPromptSubmit hook is decided after its hook: its connection waits meanwhile.

    def pod_event(p: PodEventParams, conn: Any) -> Any:
        _from_the_child(p.pod, conn.peer_pid)
        if p.event_id not in m.state.report_ids:  # (a redelivery changes nothing)
            _from_the_child_restarted(p.pod, conn.peer_pid)
        event_id = p.event_id or new_session_id()
        tree_spent = (p.usage or {}).get("tree_spent")
        pod.children.heard_from(p.pod)
        redelivered = event_id in m.state.report_ids  # accepted once: its hook ran then

        def report(t: int) -> Any:
            return m.child_report(
                t, p.pod, p.kind, event_id, p.run_id, p.text, p.outcome, tree_spent
            )

        if (
            hooks is not None
            and not redelivered
            and p.kind == "run.finished"
            and hooks.wants("SubagentStop")
        ):
            return _subagent_stop_hook(pod.request_future(report), p)
        return pod.request_pending(report)

    def _from_the_child(name: str, peer_pid: int) -> None:
        """A report naming a live child we watch is taken only from that child's process
        (SO_PEERCRED). Any process of this user reaches our socket, a child's sandboxed bash
        too: a forged `shutdown` made us take a live child for stopped (no `errored` when it
        then died, its grant released), a forged `run.finished` ended `wait_pods` with any
        text. Refused, the child's own report is not lost: its outbox redelivers it."""
        child = pod.children.live.get(name)
        if child is not None and peer_pid > 0 and peer_pid != child.pid:
            raise RpcError(
                errors.INVALID_PARAMS,
                f"pod: {name!r} is a live child of this pod (pid {child.pid}); its reports come "
                f"from its own process, not pid {peer_pid}",
            )

    def _from_the_child_restarted(name: str, peer_pid: int) -> None:
        """A report naming a child of ours that ended counts its spending into our budget
        (the most any report said): taken only from that child restarted, the registered
        process naming us parent. Else one forged `tree_spent` exhausted our budget for
        good. (What the child left in its log when it ended is taken from there.)"""
        record = m.state.children.get(name)
        if record is None or record.live or name in pod.children.live or peer_pid <= 0:
            return
        try:
            entry = pod.s.registry.get(name)
        except Exception:
            entry = None  # unreadable now: a restarted child's outbox asks again
        if entry is None or entry.parent != pod.name or entry.pid != peer_pid:
            raise RpcError(
                errors.INVALID_PARAMS,
                f"pod: child pod {name!r} of this pod has ended; only that child, restarted, "
                f"reports for it (not pid {peer_pid})",
            )

    async def _subagent_stop_hook(reply: "asyncio.Future[Any]", p: PodEventParams) -> Any:
        result = await reply
        assert hooks is not None
        fields = {"stop_hook_active": False, "child": p.pod, "outcome": p.outcome, "text": p.text}
        _in_background("SubagentStop", fields)
        return result

    def pause(p: NoParams, conn: Any) -> Any:
        return pod.request_pending(m.pause)

    def resume(p: NoParams, conn: Any) -> Any:
        return pod.request_pending(m.resume)

    def cancel(p: CancelParams, conn: Any) -> Any:
        return pod.request_pending(lambda t: m.cancel(t, p.run_id))

    def shutdown(p: NoParams, conn: Any) -> Any:
        return pod.request_pending(m.shutdown)

    async def _continued(sid: str) -> bool:
        """The pod's own session, or one it continues, though another pod started it: a pod
        restored (`--session`) from another pod's session writes on in that session."""
        current = m.state.session_id
        if not current or sid == current:
            return sid == current
        return sid in await asyncio.to_thread(continued_sessions, pod.s.sessions_dir, current)

    async def history(p: HistoryParams, conn: Any) -> HistoryResult:
        sid = p.session_id or m.state.session_id
        if not sid:
            return HistoryResult(entries=[], next=p.since)
        limit = min(p.limit, MAX_HISTORY_PAGE)
        async with conn.big_reply_turn():  # pipelined pages: each once the last one is read
            return await _history_page(p, sid, limit)

    async def _history_page(p: HistoryParams, sid: str, limit: int) -> HistoryResult:
        try:
            page = await asyncio.to_thread(
                read_page, pod.s.sessions_dir, sid, p.since, limit, MAX_HISTORY_PAGE_BYTES
            )
        except LogCorrupt as exc:  # damage: the log's fault, not the caller's params
            where = "session_id: " if p.session_id else ""
            raise RpcError(errors.INTERNAL_ERROR, f"{where}session log damaged: {exc}") from None
        except (OSError, ValueError) as exc:  # no such session, a bad id
            if not p.session_id:  # the pod's own session: not a parameter the caller gave
                raise RpcError(errors.INTERNAL_ERROR, f"session log unreadable: {exc}") from None
            raise RpcError(errors.INVALID_PARAMS, f"session_id: {exc}") from None
        start = page.first
        if start.get("pod") != pod.name and not await _continued(sid):
            raise RpcError(errors.INVALID_PARAMS, f"session_id: {sid} is not a session of this pod")
        entries = page.entries
        return HistoryResult(
            entries=entries,
            next=entries[-1]["seq"] if entries else p.since,
            session_id=sid,
            previous=start.get("compacted_from") or start.get("forked_from"),
            last_seq=page.last,
        )

    def subscribe(p: SubscribeParams, conn: Any) -> SubscribeResult:
        # since 0, "everything": all this life of the pod holds (see EventBus)
        cursor = pod.bus.seq if p.since is None else p.since or pod.bus.first_seq
        # Start streaming right after this reply is written (the reply goes out synchronously).
        conn.subscribe_after_reply(cursor)
        return SubscribeResult(cursor=pod.bus.seq)

    def compact(p: NoParams, conn: Any) -> Any:
        return pod.request_pending(m.compact)

    return {
        "run": run,
        "notify": notify,
        "pod_event": pod_event,
        "pause": pause,
        "resume": resume,
        "cancel": cancel,
        "shutdown": shutdown,
        "status": lambda p, conn: status_reply(pod, scope_entries),
        "history": history,
        "usage": lambda p, conn: usage(pod),
        "subscribe": subscribe,
        "compact": compact,
    }


class ScopeEntries:
    """The scope as `status` reports it, converted once per `Scope`: a frozen value the pod
    replaces when its delegations change (converting it costs more than the rest of status)."""

    def __init__(self) -> None:
        self._scope: object = None
        self._entries: list[ScopeEntry] = []

    def __call__(self, scope: "Scope") -> list[ScopeEntry]:
        if scope is not self._scope:
            self._entries = [msgspec.convert(e, ScopeEntry) for e in scope.summary()]
            self._scope = scope
        return list(self._entries)


def status_reply(pod: "Pod", scope_entries: ScopeEntries) -> Any:
    """Inline when the pod has no live children (the common case: no task, no loop pass);
    otherwise a coroutine that asks each child for its state."""
    result = status(pod, scope_entries(pod.scope))
    if not pod.children.live:
        return result
    return _with_children(pod, result)


async def _with_children(pod: "Pod", result: StatusResult) -> StatusResult:
    infos = await pod.children.infos()
    result.children = [
        ChildInfo(name=c["name"], pid=c["pid"], state=c["state"], socket=c["socket"]) for c in infos
    ]
    # What the live children spend now, not as of their last report to us (see _probe).
    records = pod.machine.state.children
    more = sum(max(0, c["spent"] - records[c["name"]].spent) for c in infos if c["name"] in records)
    result.budget.tree_spent += more
    return result


def status(pod: "Pod", scope: list[ScopeEntry]) -> StatusResult:
    st = pod.machine.state
    return StatusResult(
        name=pod.name,
        pid=pod.s.entry.pid,  # (its own: the registry holds it, no syscall per status)
        state=pod.machine.pod_state,
        run_id=st.active_run or st.paused_run,
        session_id=st.session_id or None,
        provider=pod.m.provider.kind,
        model=pod.m.provider.model,
        pwd=pod.m.pod.pwd,
        scope=scope,
        # A hook's context waits for the next input and wakes no run: not queued work.
        queue=QueueInfo(
            runs=len(st.pending_runs),
            notifications=st.pending_notifications - st.pending_context,
        ),
        usage=totals(pod),
        parent=pod.s.entry.parent,
        children=[],
        budget=BudgetInfo(
            limit=pod.m.budget.max_total_tokens,
            spent=st.spent,
            tree_spent=pod.machine.tree_spent(),
            left=pod.machine.budget_remaining(),
        ),
        started_at=pod.started_at,
        version=poddaemon.__version__,
        mcp=[msgspec.convert(msgspec.to_builtins(x), McpServerInfo) for x in pod.mcp_status()],
        sandbox=pod.s.sandbox.status,
        sandbox_notes=pod.sandbox_notes(),
    )


def totals(pod: "Pod") -> UsageTotals:
    st = pod.machine.state
    u = st.usage
    return UsageTotals(
        input=u.input,
        output=u.output,
        cache_read=u.cache_read,
        cache_write=u.cache_write,
        calls=st.call_count,
    )


def usage(pod: "Pod") -> UsageResult:
    calls = [msgspec.convert(c, UsageCall) for c in pod.machine.state.usage_calls]
    return UsageResult(calls=calls, totals=totals(pod))
