"""The pod: owns the session, the run queue and the notifications; drives the turn machine.

Everything that changes what the model will see goes through `_commit`: append to the session
log, fold into `SessionState`, publish to subscribers. Inputs are acknowledged only after
`await self._log.sync()` (acknowledged means durable).
"""

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

import poddaemon
from poddaemon.config.load import manifest_to_dict
from poddaemon.config.manifest import Manifest
from poddaemon.events import EventBus
from poddaemon.history import ToolCall
from poddaemon.llm.types import (
    ModelClient,
    ModelRequest,
    ModelResponse,
    ProviderError,
    ReasoningDelta,
    RetryScheduled,
    StreamEvent,
    TextDelta,
    ToolSpec,
)
from poddaemon.prompt import Instruction
from poddaemon.registry import PodEntry, Registry
from poddaemon.scope import Scope
from poddaemon.session import SessionState, fold
from poddaemon.store.file import HeadMoved, SessionLog, read_session
from poddaemon.store.log import new_session_id
from poddaemon.tools import Tool
from poddaemon.tools.base import ToolContext, ToolOutcome, ToolOutputLimits, execute
from poddaemon.turn import NOT_RUN_CANCELLED, CallModel, Finished, Record, Turn, interrupted_results
from protocol import errors
from protocol.errors import RpcError
from protocol.types import (
    AcceptedResult,
    CancelParams,
    CancelResult,
    HistoryParams,
    HistoryResult,
    NoParams,
    NotifyParams,
    NotifyResult,
    OkResult,
    PauseResult,
    PodEventParams,
    QueueInfo,
    ResumeResult,
    RunParams,
    RunResult,
    RunWaitResult,
    ScopeEntry,
    StatusResult,
    SubscribeParams,
    SubscribeResult,
    UsageCall,
    UsageResult,
    UsageTotals,
)

log = logging.getLogger("poddaemon.pod")
T = TypeVar("T")

# A burst of notifications to an idle pod is handled in one turn: the turn starts once no new
# notification has arrived for NOTIFY_QUIET seconds (but never later than NOTIFY_MAX_DELAY).
NOTIFY_QUIET = 0.05
NOTIFY_MAX_DELAY = 1.0
RESTART_NOTE = (
    "The pod restarted while your previous run was in progress; it was interrupted. "
    "Check the state of your work and continue where you left off."
)


class _Interrupted(Exception):
    """The in-flight step was cancelled by a `cancel` request (not by pod shutdown)."""


@dataclass
class Services:
    """What a pod is built from; the daemon wires it, tests can substitute parts."""

    manifest: Manifest
    scope: Scope
    registry: Registry
    entry: PodEntry
    bus: EventBus
    sessions_dir: str
    instruction: Instruction
    tools: dict[str, Tool]
    model: ModelClient


class Pod:
    def __init__(self, services: Services) -> None:
        self.s = services
        self.m = services.manifest
        self.name = self.m.pod.name
        self.bus = services.bus
        self.started_at = time.time()
        self.state = SessionState()
        self.system_prompt = ""
        self._log: SessionLog | None = None
        self._turn: Turn | None = None
        self._inflight: asyncio.Task[Any] | None = None
        self._wake = asyncio.Event()
        self._resume_requested = False
        self._stopping = False
        self._waiters: dict[str, list[asyncio.Future[RunWaitResult]]] = {}
        self._last_notify = 0.0
        self._tool_specs: list[ToolSpec] = []
        self._tool_ctx = ToolContext(
            scope=services.scope,
            pwd=self.m.pod.pwd,
            limits=ToolOutputLimits(
                default_max_bytes=self.m.worker.tool_output.default_max_bytes,
                per_tool=dict(self.m.worker.tool_output.per_tool),
            ),
        )

    # --- session ----------------------------------------------------------------------------

    async def restore(self, session_id: str) -> list[str]:
        """Reopen a session: fold its log, close what a crash left open. Returns warnings."""
        log_, entries, warnings = SessionLog.open(self.s.sessions_dir, session_id)
        self._log = log_
        self.system_prompt = entries[0].get("system_prompt", "")
        self.state = fold(entries)
        del entries  # the folded state is all we keep; a long session's entries are large
        self.state.session_id = session_id
        if self.state.active_run is not None:
            run_id = self.state.active_run
            for rec in interrupted_results(self.state.open_calls, run_id):
                self._commit(rec.kind, rec.body)
            self._commit(
                "run_end",
                {
                    "run_id": run_id,
                    "outcome": "error",
                    "text": "",
                    "error": "interrupted: the pod stopped during this run",
                    "interrupted": True,
                },
            )
            self._commit_notification(
                f"restart-{run_id}", "poddaemon", RESTART_NOTE, client_key=None
            )
        await self._sync()
        return warnings

    def _ensure_log(self) -> SessionLog:
        if self._log is None:
            session_id = new_session_id()
            self.system_prompt = self.s.instruction.render(
                pwd=self.m.pod.pwd, scope=self.s.scope, tools=list(self.m.worker.tools)
            )
            body = {
                "session_id": session_id,
                "pod": self.name,
                "system_prompt": self.system_prompt,
                "config": manifest_to_dict(self.m),
                "history": [],
            }
            self._log = SessionLog.create(self.s.sessions_dir, session_id, body)
            self.state.session_id = session_id
            self.state.last_seq = 1
            self.s.registry.update(self.name, self.s.entry.pid, session=session_id)
        return self._log

    def _commit(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """Append to the log (not yet fsync'd) and fold it into the state."""
        try:
            try:
                entry = self._ensure_log().append(kind, body)
            except HeadMoved:
                self._fork()
                entry = self._ensure_log().append(kind, body)
        except OSError as exc:
            raise self._log_failed(exc) from exc
        self.state.apply(entry)
        return entry

    def _log_failed(self, exc: OSError) -> RpcError:
        """The session log cannot be written: nothing more can be acknowledged, so stop
        (a supervisor restarts the pod from what is on disk) and tell everyone why."""
        self._alert("error", "session", f"session log write failed: {exc}; the pod stops")
        self.request_shutdown()
        return RpcError(errors.INTERNAL_ERROR, f"could not persist: {exc}")

    def _fork(self) -> None:
        """Another writer appended to our session: carry on in a new session linked to it."""
        old = self._ensure_log()
        body = {
            "session_id": new_session_id(),
            "pod": self.name,
            "system_prompt": self.system_prompt,
            "config": manifest_to_dict(self.m),
            **self.state.snapshot(),
            "forked_from": old.session_id,
        }
        self._log = old.fork(start_body=body, new_id=body["session_id"])
        old.close()
        self.state = fold([self._log_start_entry(body)])
        self.s.registry.update(self.name, self.s.entry.pid, session=body["session_id"])
        self._alert(
            "warning",
            "session",
            f"session {old.session_id} was written by someone else; "
            f"continuing in session {body['session_id']} (forked_from links them)",
        )

    @staticmethod
    def _log_start_entry(body: dict[str, Any]) -> dict[str, Any]:
        return {"seq": 1, "ts": time.time(), "kind": "session_start", **body}

    def _commit_records(self, records: Iterable[Record]) -> None:
        for rec in records:
            self._commit(rec.kind, rec.body)

    async def _sync(self) -> None:
        try:
            await self._ensure_log().sync()
        except OSError as exc:
            raise self._log_failed(exc) from exc

    def _alert(self, level: str, source: str, message: str) -> None:
        log.log(logging.ERROR if level == "error" else logging.WARNING, "%s", message)
        self.bus.publish("alert", {"level": level, "source": source, "message": message})

    # --- state --------------------------------------------------------------------------------

    @property
    def pod_state(self) -> str:
        if self._stopping:
            return "stopping"
        if self.state.active_run is not None:
            return "running"
        if self.state.paused_run is not None:
            return "paused"
        return "idle"

    def _state_changed(self) -> None:
        self.bus.publish("state.changed", {"state": self.pod_state})

    def _check_open(self) -> None:
        if self._stopping:
            raise RpcError(errors.SHUTTING_DOWN, "the pod is shutting down")

    def _budget_left(self) -> bool:
        cap = self.m.budget.max_total_tokens
        return cap is None or self.state.usage.total < cap

    # --- RPC handlers -------------------------------------------------------------------------

    def handlers(self) -> dict[str, Callable[[Any, Any], Any]]:
        return {
            "run": self.rpc_run,
            "notify": self.rpc_notify,
            "resume": self.rpc_resume,
            "pause": self.rpc_pause,
            "cancel": self.rpc_cancel,
            "status": self.rpc_status,
            "history": self.rpc_history,
            "usage": self.rpc_usage,
            "subscribe": self.rpc_subscribe,
            "pod_event": self.rpc_pod_event,
            "shutdown": self.rpc_shutdown,
        }

    async def rpc_run(self, p: RunParams, conn: Any) -> RunResult | RunWaitResult:
        self._check_open()
        run_id = await self._replayed(p.client_key, p.input)
        if run_id is not None:
            if p.wait:
                return await self._wait_for(run_id)
            return RunResult(
                run_id=run_id, state="queued" if run_id in self.state.pending_runs else "started"
            )
        if not self._budget_left():
            raise RpcError(errors.BUDGET_EXHAUSTED, self._budget_message())
        active = self.state.active_run
        if p.mode == "steer" and active is not None:
            body = {"id": new_session_id(), "run_id": active, "text": p.input, "mode": "steer"}
            self._commit("user_input", {**body, **_key(p.client_key)})
            await self._sync()
            return RunResult(run_id=active, state="steered")
        run_id = new_session_id()
        # Decide the answer before awaiting the fsync: by then the run may already have started.
        position = len(self.state.pending_runs) + 1 if active or self.state.pending_runs else 0
        self._commit(
            "user_input",
            {"run_id": run_id, "text": p.input, "mode": "queue", **_key(p.client_key)},
        )
        await self._sync()
        self._wake.set()  # only now: nothing runs on input that is not yet durable
        if position:
            self.bus.publish("run.queued", {"position": position}, run_id)
            result = RunResult(run_id=run_id, state="queued", position=position)
        else:
            result = RunResult(run_id=run_id, state="started")
        if p.wait:
            return await self._wait_for(run_id)
        return result

    async def _replayed(self, client_key: str | None, text: str) -> str | None:
        """The id an earlier request with this key got (an idempotent retry), or None.

        Same key with different text is -32006. The answer waits for the sync, because the
        original may still be on its way to disk."""
        if client_key is None or client_key not in self.state.client_keys:
            return None
        original, input_id = self.state.client_keys[client_key]
        if original != text:
            raise RpcError(
                errors.CONFLICTING_CLIENT_KEY,
                f"client_key {client_key!r} was used for a different input",
            )
        await self._sync()
        return input_id

    async def rpc_notify(self, p: NotifyParams, conn: Any) -> NotifyResult:
        return await self._notify(p.message, p.source, p.client_key)

    async def rpc_pod_event(self, p: PodEventParams, conn: Any) -> AcceptedResult:
        text = f"[{p.kind}] {p.text}" if p.text else f"[{p.kind}]"
        await self._notify(text, f"pod:{p.pod}", None)
        data = {"pod": p.pod, "kind": p.kind, "text": p.text}
        self.bus.publish("child.event", data, p.run_id)  # only once it is accepted
        return AcceptedResult()

    async def _notify(self, message: str, source: str, client_key: str | None) -> NotifyResult:
        self._check_open()
        replayed = await self._replayed(client_key, message)
        if replayed is not None:
            return NotifyResult(notification_id=replayed, wakes=False)
        pending = self.state.pending_notifications
        if pending >= self.m.notify.max_pending:
            raise RpcError(
                errors.QUEUE_FULL,
                f"queue full: {pending} notifications pending (notify.max_pending = "
                f"{self.m.notify.max_pending})",
            )
        nid = new_session_id()
        self._commit_notification(nid, source, message, client_key)
        await self._sync()
        wakes = self.pod_state == "idle" and self._budget_left()
        self._last_notify = time.monotonic()
        self._wake.set()
        return NotifyResult(notification_id=nid, wakes=wakes)

    def _commit_notification(
        self, nid: str, source: str, message: str, client_key: str | None
    ) -> None:
        self._commit(
            "system_item",
            {
                "id": nid,
                "source": source,
                "text": message,
                **_key(client_key),
            },
        )
        self.bus.publish(
            "notification.committed",
            {"notification_id": nid, "source": source, "message": message},
        )

    def rpc_resume(self, p: NoParams, conn: Any) -> ResumeResult:
        self._check_open()
        run_id = self.state.paused_run
        if run_id is None or self.state.active_run is not None:
            raise RpcError(errors.NOT_PAUSED, "the pod is not paused")
        self._resume_requested = True
        self._wake.set()
        return ResumeResult(run_id=run_id)

    def rpc_pause(self, p: NoParams, conn: Any) -> PauseResult:
        if self._turn is None or self._turn.done:
            return PauseResult(paused=False)
        self._turn.request_pause()
        return PauseResult(paused=True)

    def rpc_cancel(self, p: CancelParams, conn: Any) -> CancelResult:
        active = self.state.active_run
        if p.run_id is not None and p.run_id != active:
            return CancelResult(cancelled=self._cancel_queued(p.run_id))
        if self._turn is None or self._turn.done:
            return CancelResult(cancelled=False)
        self._turn.request_cancel()
        if self._inflight is not None:
            self._inflight.cancel()
        return CancelResult(cancelled=True)

    def _cancel_queued(self, run_id: str) -> bool:
        if run_id not in self.state.pending_runs:
            return False
        self._finish_run(run_id, Finished("cancelled", ""), started=False)
        return True

    def rpc_status(self, p: NoParams, conn: Any) -> StatusResult:
        return StatusResult(
            name=self.name,
            pid=os.getpid(),
            state=self.pod_state,
            run_id=self.state.active_run or self.state.paused_run,
            session_id=self.state.session_id or None,
            provider=self.m.provider.kind,
            model=self.m.provider.model,
            pwd=self.m.pod.pwd,
            scope=[msgspec.convert(e, ScopeEntry) for e in self.s.scope.summary()],
            queue=QueueInfo(
                runs=len(self.state.pending_runs),
                notifications=self.state.pending_notifications,
            ),
            usage=self._totals(),
            parent=self.s.entry.parent,
            children=[],
            started_at=self.started_at,
            version=poddaemon.__version__,
        )

    def _totals(self) -> UsageTotals:
        u = self.state.usage
        return UsageTotals(
            input=u.input,
            output=u.output,
            cache_read=u.cache_read,
            cache_write=u.cache_write,
            calls=len(self.state.usage_calls),
        )

    async def rpc_history(self, p: HistoryParams, conn: Any) -> HistoryResult:
        if not self.state.session_id:
            return HistoryResult(entries=[], next=p.since)
        limit = max(1, min(p.limit, 10_000))
        result = await asyncio.to_thread(read_session, self.s.sessions_dir, self.state.session_id)
        entries = [e for e in result.entries if e["seq"] > p.since][:limit]
        return HistoryResult(entries=entries, next=entries[-1]["seq"] if entries else p.since)

    def rpc_usage(self, p: NoParams, conn: Any) -> UsageResult:
        calls = [msgspec.convert(c, UsageCall) for c in self.state.usage_calls]
        return UsageResult(calls=calls, totals=self._totals())

    def rpc_subscribe(self, p: SubscribeParams, conn: Any) -> SubscribeResult:
        cursor = self.bus.seq if p.since is None else max(0, p.since)
        # Start streaming right after this reply is written (the reply goes out synchronously).
        asyncio.get_running_loop().call_soon(conn.start_events, cursor)
        return SubscribeResult(cursor=self.bus.seq)

    def rpc_shutdown(self, p: NoParams, conn: Any) -> OkResult:
        self.request_shutdown()
        return OkResult()

    # --- the driver -----------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._turn is not None and not self._turn.done:
            self._turn.request_cancel()
            if self._inflight is not None:
                self._inflight.cancel()
        self._state_changed()
        self._wake.set()

    async def serve(self) -> None:
        """Run work as it comes until shutdown; then persist and return."""
        try:
            while not self._stopping:
                work = self._next_work()
                if work is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if work == "notifications":
                    await self._let_burst_settle()
                    if self._stopping:
                        break
                await self._run(work)
        finally:
            await self._close()

    def _next_work(self) -> str | None:
        s = self.state
        if self._resume_requested and s.paused_run is not None:
            self._resume_requested = False
            return s.paused_run
        self._resume_requested = False
        if s.pending_runs:
            return next(iter(s.pending_runs))
        if s.pending_notifications and s.paused_run is None and self._budget_left():
            return "notifications"
        return None

    async def _let_burst_settle(self) -> None:
        deadline = time.monotonic() + NOTIFY_MAX_DELAY
        while not self._stopping:
            quiet_until = self._last_notify + NOTIFY_QUIET
            now = time.monotonic()
            if now >= quiet_until or now >= deadline:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(quiet_until, deadline) - now)

    async def _run(self, work: str) -> None:
        if self._log is not None and not self._log.head_is_mine():
            self._fork()
        run_id = new_session_id() if work == "notifications" else work
        self._commit(
            "run_start", {"run_id": run_id, "trigger": work if work == "notifications" else "input"}
        )
        self.bus.publish("run.started", {}, run_id)
        self._state_changed()
        turn = self._turn = Turn(run_id, self.m.worker.max_turns, rounds=self.state.rounds)
        try:
            while not isinstance(step := turn.next_step(), Finished):
                assert isinstance(step, CallModel)
                self._commit_records(await self._model_round(turn))
                while turn.in_tools and (tool := turn.next_tool()) is not None:
                    self._commit_records(await self._tool_round(turn, tool.call))
        except Exception as exc:  # a bug must still end the run properly, history valid
            log.exception("run %s failed", run_id)
            with contextlib.suppress(RpcError):
                self._commit_records(interrupted_results(self.state.open_calls, run_id))
            step = Finished("error", "", f"internal error: {exc}")
        finally:
            self._turn = None
        self._finish_run(run_id, step, started=True)
        with contextlib.suppress(RpcError):
            await self._sync()

    def _finish_run(self, run_id: str, end: Finished, started: bool) -> None:
        interrupted = self._stopping and end.outcome == "cancelled" and started
        body: dict[str, Any] = {"run_id": run_id, "outcome": end.outcome, "text": end.text}
        if interrupted:
            body.update(outcome="error", error="interrupted: the pod shut down", interrupted=True)
        elif end.error:
            body["error"] = end.error
        with contextlib.suppress(RpcError):  # the log failed; the pod is stopping anyway
            self._commit("run_end", body)
        usage = self._totals()
        data = {k: v for k, v in body.items() if k in ("outcome", "text", "error")}
        data["usage"] = msgspec.to_builtins(usage)
        self.bus.publish("run.finished", data, run_id)
        self._state_changed()
        result = RunWaitResult(
            run_id=run_id,
            outcome=body["outcome"],
            text=end.text,
            usage=usage,
            error=body.get("error"),
        )
        for fut in self._waiters.pop(run_id, []):
            if not fut.done():
                fut.set_result(result)

    async def _wait_for(self, run_id: str) -> RunWaitResult:
        done = self.state.run_outcomes.get(run_id)
        if done is not None:
            return RunWaitResult(
                run_id=run_id,
                outcome=done["outcome"],
                text=done["text"],
                usage=self._totals(),
                error=done["error"],
            )
        fut: asyncio.Future[RunWaitResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(run_id, []).append(fut)
        return await fut

    # --- one model round ------------------------------------------------------------------------

    async def _model_round(self, turn: Turn) -> list[Record]:
        self._deliver_pending()
        if not self._budget_left():
            return turn.model_failed(ProviderError("fatal", self._budget_message()))
        request = ModelRequest(
            system=self.system_prompt,
            items=self.state.history,
            tools=self._specs(),
            max_tokens=self.m.worker.max_tokens,
            temperature=self.m.worker.temperature,
        )
        try:
            response = await self._interruptible(self._stream(request, turn.run_id))
        except _Interrupted:
            return turn.model_failed(None)
        except ProviderError as exc:
            self._alert("error", "provider", exc.message)
            return turn.model_failed(exc)
        self._record_usage(response, turn.run_id)
        more = self.state.pending_steers > 0
        return turn.model_returned(response, more_input=more)

    def _deliver_pending(self) -> None:
        ids, _items = self.state.deliverable()
        if ids:
            left = self.state.pending_notifications - sum(
                1 for i in ids if self.state.pending_inputs[i].kind == "notification"
            )
            self._commit("inputs_delivered", {"ids": ids, "more": left})

    async def _stream(self, request: ModelRequest, run_id: str) -> ModelResponse:
        stream = self.s.model.stream(request)
        try:
            return await self._consume(stream, run_id)
        finally:
            # Release the HTTP stream now, also when a cancel interrupted us mid-way.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _consume(self, stream: AsyncIterator[StreamEvent], run_id: str) -> ModelResponse:
        publish = self.bus.publish
        async for event in stream:
            if isinstance(event, TextDelta):
                publish("text.delta", {"text": event.text}, run_id)
            elif isinstance(event, ReasoningDelta):
                publish("reasoning.delta", {"text": event.text}, run_id)
            elif isinstance(event, RetryScheduled):
                publish(
                    "llm.retry",
                    {"attempt": event.attempt, "delay": event.delay, "error": event.error},
                    run_id,
                )
            else:
                return event
        raise ProviderError("interrupted", "the model stream ended without a response")

    def _record_usage(self, response: ModelResponse, run_id: str) -> None:
        u = response.usage
        usage = {
            "input": u.input,
            "output": u.output,
            "cache_read": u.cache_read,
            "cache_write": u.cache_write,
        }
        self._commit("llm_usage", {"run_id": run_id, "model": self.m.provider.model, **usage})
        self.bus.publish("llm.usage", usage, run_id)

    def _specs(self) -> list[ToolSpec]:
        if not self._tool_specs:
            from poddaemon.tools import tool_specs

            # TEMP wiring for mcp: MCP tools (<server>__<tool>) are offered besides worker.tools.
            mcp = [n for n in self.s.tools if "__" in n]
            self._tool_specs = tool_specs([*self.m.worker.tools, *mcp], self.s.tools)
        return self._tool_specs

    def _budget_message(self) -> str:
        return (
            f"budget exhausted: {self.state.usage.total} tokens used of "
            f"budget.max_total_tokens = {self.m.budget.max_total_tokens}"
        )

    # --- one tool -------------------------------------------------------------------------------

    async def _tool_round(self, turn: Turn, call: ToolCall) -> list[Record]:
        self.bus.publish(
            "tool.started",
            {"call_id": call.id, "name": call.name, "args": _args_preview(call.arguments)},
            turn.run_id,
        )
        try:
            outcome = await self._interruptible(
                execute(call.name, call.arguments, self._tool_ctx, self.s.tools)
            )
        except _Interrupted:
            outcome = ToolOutcome(
                output=NOT_RUN_CANCELLED + " while it ran", is_error=True, summary="cancelled"
            )
        self.bus.publish(
            "tool.finished",
            {
                "call_id": call.id,
                "name": call.name,
                "is_error": outcome.is_error,
                "summary": outcome.summary or _first_line(outcome.output),
            },
            turn.run_id,
        )
        return turn.tool_returned(call.id, outcome.output, outcome.is_error)

    async def _interruptible(self, coro: Awaitable[T]) -> T:
        """Await `coro` as a task that `cancel` may interrupt without cancelling the pod."""
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._inflight = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the pod itself is being cancelled
            raise _Interrupted() from None
        finally:
            self._inflight = None

    # --- shutdown -------------------------------------------------------------------------------

    async def _close(self) -> None:
        for futs in self._waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(RpcError(errors.SHUTTING_DOWN, "the pod shut down"))
        self.bus.publish("shutdown", {})
        if self._log is not None:
            with contextlib.suppress(OSError):
                await self._log.sync()
            self._log.close()
        with contextlib.suppress(Exception):
            await self.s.model.aclose()


def _key(client_key: str | None) -> dict[str, str]:
    return {"client_key": client_key} if client_key is not None else {}


def _args_preview(arguments: str) -> Any:
    try:
        return msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments


def _first_line(text: str) -> str:
    return text.split("\n", 1)[0][:200]
