"""The pod's executor: it turns the machine's effects into I/O and results back into commands.

Every decision is `machine.py`'s. Here: write entries to the session log and publish their
events, answer requests once what they acknowledge is fsync'd, call the model, run tools (each
through the interceptor chain), keep the timer. Requests enter through `handlers()`.
"""

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec

from poddaemon.acks import DurableReplies, Pending, settle
from poddaemon.config.load import manifest_to_dict
from poddaemon.config.manifest import Manifest
from poddaemon.entries import (
    RunEnd,
    SessionStart,
    events_of,
)
from poddaemon.events import EventBus
from poddaemon.history import ToolCall
from poddaemon.interceptors import Budget, Chain, Interceptor, Refuse
from poddaemon.llm.types import (
    ModelClient,
    ModelRequest,
    ModelResponse,
    ProviderError,
    ReasoningDelta,
    RetryScheduled,
    StreamEvent,
    TextDelta,
)
from poddaemon.machine import (
    CallModel,
    Commit,
    Effect,
    Interrupt,
    Machine,
    MachineConfig,
    OpenSession,
    Publish,
    Reply,
    RunStopHooks,
    RunTool,
    SetTimer,
    Stopped,
    Summarize,
    SwitchSession,
    Sync,
)
from poddaemon.podlog import PodLog
from poddaemon.prompt import Instruction
from poddaemon.registry import PodEntry, Registry
from poddaemon.sandbox.pod import PodSandbox
from poddaemon.scope import Scope
from poddaemon.store.log import new_session_id
from poddaemon.summary import summarize
from poddaemon.tools.base import (
    ToolContext,
    ToolOutcome,
    ToolOutputLimits,
    execute,
    printable_utf8,
)
from poddaemon.toolset import Toolset
from poddaemon.turn import CANCELLED_WHILE_RUNNING, HOOKS_CUT_SHORT, NOT_RUN_CANCELLED
from protocol import errors
from protocol.errors import RpcError

log = logging.getLogger("poddaemon.pod")

# Naming a session in the registry, again after a failure (a stuck lock, no descriptor free).
NAMING_RETRY_INITIAL, NAMING_RETRY_MAX = 0.2, 5.0  # seconds

if TYPE_CHECKING:  # imported when the manifest has hooks (~3 ms of start-up otherwise)
    from poddaemon.hooks import HookRun, Hooks


class Services(msgspec.Struct):
    """What a pod is built from; the daemon wires it, tests can substitute parts."""

    manifest: Manifest
    scope: Scope
    registry: Registry
    entry: PodEntry
    bus: EventBus
    sessions_dir: str
    instruction: Instruction
    tools: Toolset
    model: ModelClient
    interceptors: list[Interceptor] = msgspec.field(default_factory=list)
    callback: str | None = None  # the spawner's socket (a child reports there)
    sandbox: PodSandbox = msgspec.field(default_factory=PodSandbox)
    compaction_model: ModelClient | None = None  # [compaction.provider]; None: `model`


def _utf8_only(event: StreamEvent) -> StreamEvent:
    """`event` with every lone surrogate in the model's output shown as text (`\\ud800`): the
    SDKs decode a `\\ud800` escape in a stream into one, and neither an event frame nor the
    session log can encode it (its publish failed and wedged every subscriber's stream)."""
    if isinstance(event, TextDelta | ReasoningDelta):
        text = printable_utf8(event.text)
        return event if text is event.text else type(event)(text)
    if isinstance(event, ModelResponse):
        m = event.message
        calls = tuple(
            ToolCall(
                id=printable_utf8(c.id),
                name=printable_utf8(c.name),
                arguments=printable_utf8(c.arguments),
            )
            for c in m.tool_calls
        )
        message = msgspec.structs.replace(
            m, text=printable_utf8(m.text), reasoning=printable_utf8(m.reasoning), tool_calls=calls
        )
        return msgspec.structs.replace(event, message=message, detail=printable_utf8(event.detail))
    return event


class Pod:
    def __init__(self, services: Services) -> None:
        self.s = services
        self.m = m = services.manifest
        self.name = m.pod.name
        self.bus = services.bus
        self.started_at = time.time()
        self.scope = services.scope  # read live by the tools: delegation will narrow it
        self._noted_scope = services.scope  # the scope the sandbox's notes were made for
        self.failure: str | None = None  # why the pod stops on its own (exit non-zero)
        cfg = MachineConfig(
            name=self.name,
            model=m.provider.model,
            max_turns=m.worker.max_turns,
            max_pending=m.notify.max_pending,
            max_queued_runs=m.worker.max_queued_runs,
            max_input_bytes=m.worker.max_input_bytes,
            budget_cap=m.budget.max_total_tokens,
            config=manifest_to_dict(m),
            compact_threshold=m.compaction.compact_threshold if m.compaction else None,
            compact_retained_turns=m.compaction.compact_retained_turns if m.compaction else 2,
            provider_kind=m.provider.kind,
            compaction_model=m.compaction_provider.model,
            compaction_kind=m.compaction_provider.kind,
            reports=services.callback is not None,
            stop_hooks=bool(m.hooks.Stop),
        )
        prompt = self.render_prompt()
        self.machine = Machine(
            cfg,
            clock=time.time,
            new_id=new_session_id,
            system_prompt=prompt,
            first_session_id=lambda: self.plog.first_session_id(),
        )
        budget = Budget(lambda: self.machine.budget_message() if self._spent() else None)
        self.chain = Chain([budget, *services.interceptors])
        self.tool_ctx = ToolContext(
            scope=_LiveScope(self),
            pwd=m.pod.pwd,
            limits=ToolOutputLimits(
                default_max_bytes=m.worker.tool_output.default_max_bytes,
                per_tool=dict(m.worker.tool_output.per_tool),
            ),
            env_passthrough=tuple(m.worker.env_passthrough),
            env_hidden=(
                m.provider.api_key_var,
                m.compaction_provider.api_key_var,
                *_mcp_vars(m),
            ),
            sandbox_policy=services.sandbox.policy,
            granted_files=services.sandbox.files,
            policy_for_scope=self._policy_for_scope if services.sandbox.rebuild else None,
            policy_for_hooks=self._policy_for_hooks if services.sandbox.rebuild else None,
        )
        self.hooks: Hooks | None = None
        if m.hooks.any():
            from poddaemon import hooks

            self.hooks = hooks.Hooks(
                m.hooks,
                pod=self.name,
                cwd=m.pod.pwd,
                runner=self.tool_ctx.hook_runner,
                session=self._session_ref,
                record=self._record_hook,
                keep=self._keep_tool_output,
            )
            self.chain.interceptors.append(self.hooks)
        self.plog = PodLog(
            services.sessions_dir,
            fail=self._fail,
            moved=self._session_moved,
            alert=lambda message: self.alert("warning", message),
            fork=lambda: self.machine.fork(),
        )
        self._tokens = itertools.count(1)
        self._replies: dict[int, asyncio.Future[Any] | Pending] = {}
        self._durable = DurableReplies(self.plog.sync_now, lambda: self.failure, self._fail)
        self._inflight: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = asyncio.Event()
        self.mcp: Any = None  # the MCP servers' manager, when the manifest lists any
        # Spawn trees: our children (the pod tools' host) and, in a child, its outbox.
        from poddaemon.outbox import Outbox
        from poddaemon.spawn import Children

        self.children = Children(self)
        self.tool_ctx.host = self.children
        self.observers: list[Callable[[Any], None]] = [self.children.observe]
        self.outbox: Outbox | None = None
        if services.callback is not None:
            self.outbox = Outbox(self, services.callback, self.name)
            self.observers.append(self.outbox.observe)
        self._background: set[asyncio.Task[Any]] = set()
        self._warming: asyncio.Future[None] | None = None
        # The session the registry names (as far as this pod told it), and the one it should.
        self._session_named: str | None = None
        self._session_to_name: str | None = None
        self._naming: asyncio.Task[None] | None = None
        self._after_naming: list[tuple[asyncio.Future[Any] | Pending, Any]] = []
        self._naming_failed = False  # the registry refused: replies no longer wait for it
        self._naming_waiters: list[asyncio.Future[None]] = []  # see _named

    @property
    def pod_state(self) -> str:
        return self.machine.pod_state

    @property
    def state(self) -> Any:
        """The folded session state (read-only for everyone but the machine)."""
        return self.machine.state

    # --- the loop: effects out, commands in -----------------------------------------------------

    def feed(self, effects: list[Effect], in_log: bool = False) -> None:
        # After a fork, the batch's entries are already in the new session; `in_log`: they are
        # from the start (a fork made right after they were folded in: see restore).
        plog, bus = self.plog, self.bus
        forks = -1 if in_log else plog.forks
        for effect in effects:
            # The per-request effects first, by exact type: cheaper than class patterns, which
            # look up __match_args__ and each attribute on every test.
            kind = type(effect)
            if kind is Commit:
                entry = effect.entry  # type: ignore[union-attr]
                if plog.forks == forks and self.failure is None:
                    plog.write(entry)
                    if bus.listened:
                        plog.flush()  # in the file before anything more is said
                if self.failure is not None:
                    continue  # the log does not hold it (it failed): nobody hears of it
                for type_, data, run_id in events_of(entry):
                    bus.publish(type_, data, run_id)
                for observe in self.observers:
                    observe(entry)
                if type(entry) is RunEnd and entry.outcome != "paused":
                    self.spawn_background(self.chain.on_run_end(entry.run_id, entry.outcome))
            elif kind is Reply:
                reply: Reply = effect  # type: ignore[assignment]
                self._answer(reply.token, reply.result, reply.error, reply.durable)
            else:
                self._effect(effect)

    def _effect(self, effect: Effect) -> None:
        """The effects that are not per request."""
        match effect:
            case Publish(type_, data, run_id):
                # The machine's alerts and why a compaction failed reach the log (a unit's
                # journal) too, as the executor's own alerts do: not only subscribers.
                if type_ == "alert":
                    level = logging.ERROR if data["level"] == "error" else logging.WARNING
                    log.log(level, "%s", data["message"])
                elif type_ == "compaction.failed":
                    log.warning("compaction failed: %s", data["error"])
                self.bus.publish(type_, data, run_id)
            case OpenSession(start):
                self.plog.open(start)
            case CallModel():
                self._start(self._call_model(effect), "model", self._model_cancelled)
            case Summarize():
                self._start(self._summarize(effect), "compact", self._compaction_cancelled)
            case SwitchSession(start):
                self._switch(start)
            case RunTool(_, call):
                self._start(self._run_tool(effect), "tool", lambda: self._tool_cancelled(call))
            case RunStopHooks():
                self._start(self._check_stop(effect), "stop", self._stop_check_cancelled)
            case Interrupt():
                if self._inflight is not None:
                    self._inflight.cancel()
            case SetTimer(at):
                self._set_timer(at)
            case Sync():
                self._durable.flush_soon()
            case Stopped():
                self._stopped.set()

    async def request(self, command: Callable[[int], list[Effect]]) -> Any:
        """Run a client command through the machine and await its reply."""
        return await self.request_future(command)

    def request_future(self, command: Callable[[int], list[Effect]]) -> "asyncio.Future[Any]":
        """`request` without a coroutine: the reply's future."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._request(command, future)
        return future

    def request_pending(self, command: Callable[[int], list[Effect]]) -> Pending:
        """The reply as a `Pending` a handler returns as is: the server answers from its
        callback, synchronously from the group commit (no future, no task, no loop pass)."""
        pending = Pending()
        self._request(command, pending)
        return pending

    def _request(self, command: Callable[[int], list[Effect]], reply: Any) -> None:
        token = next(self._tokens)
        self._replies[token] = reply
        self.feed(command(token))

    async def serve(self) -> None:
        """Run until shutdown (or a failure) has settled every run; then persist."""
        await self._stopped.wait()
        await self.children.on_stop()
        if self.outbox is not None:
            await self.outbox.flush(3.0)  # what is not delivered waits in the log
            await self.outbox.aclose()
        await self._close()

    def request_shutdown(self, reason: str = "requested") -> None:
        self.feed(self.machine.shutdown(reason=reason))

    # --- the log --------------------------------------------------------------------------------

    def _switch(self, start: SessionStart) -> None:
        """Compaction: continue in the new session (see PodLog.switch)."""
        if self.plog.switch(start) and self.hooks is not None and self.hooks.wants("SessionStart"):
            # As Claude Code: a session that starts from a compaction has source "compact".
            self.spawn_background(self._session_start_hook("compact"))

    async def _session_start_hook(self, source: str) -> None:
        assert self.hooks is not None
        try:
            context = await self.hooks.session_start(source)
        except Exception:
            log.exception("SessionStart hook failed")
            return
        if context and not self.machine.stopped:
            self.feed(self.machine.add_context(context, "hook:SessionStart", replaces=True))

    def _session_moved(self, session_id: str) -> None:
        """Name the new session in the registry (unless it is named already: the first one is,
        when its file was made ahead), in a thread: its fsyncs and rename (~1-3 ms) then
        overlap the turn's model call instead of preceding it. Replies that wait for
        durability wait for this too, so no client hears of a session before the registry
        says whose it is (a pod asked to restore it is refused)."""
        self._session_to_name = session_id
        if self._naming is None and session_id != self._session_named:
            self._naming = self.spawn_background(self._name_session())  # awaited at close

    def named_session(self) -> str | None:
        """The session the registry was last told this pod holds (None before the first)."""
        return self._session_named or self.s.entry.session

    async def _name_session(self) -> None:
        delay = NAMING_RETRY_INITIAL
        try:
            while (session_id := self._session_to_name) != self._session_named:
                try:
                    await asyncio.to_thread(
                        self.s.registry.update, self.name, self.s.entry.pid, session=session_id
                    )
                except Exception as exc:  # the claim watcher stops a pod whose entry is gone
                    # The replies go (their entries are durable), and the registry is asked
                    # again until it names the session: it is what refuses a second pod asked
                    # to restore this session while we hold it.
                    if delay == NAMING_RETRY_INITIAL:
                        log.warning(
                            "cannot name session %s in the registry (retrying): %s", session_id, exc
                        )
                    self._naming_failed = True
                    self._release_after_naming()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, NAMING_RETRY_MAX)
                    continue
                self._session_named = session_id
                delay = NAMING_RETRY_INITIAL
        finally:
            self._naming = None
            self._naming_failed = False
            self._release_after_naming()

    def _release_after_naming(self) -> None:
        waiting, self._after_naming = self._after_naming, []
        for reply, result in waiting:
            self._answer_durable(reply, result)
        waiters, self._naming_waiters = self._naming_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _named(self) -> None:
        """Return once the registry names the session last handed to `_session_moved`, or
        naming fails for now (it retries; the claim watcher stops a pod whose entry is gone)."""
        if self._naming is None or self._naming_failed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._naming_waiters.append(waiter)
        await waiter

    def _fail(self, message: str) -> None:
        """The log cannot be written: nothing more can be acknowledged, so stop (a supervisor
        restarts the pod from what is on disk) and say why."""
        if self.failure is None:
            self.failure = message
            self.bus.forget()  # events held for replay may speak of entries the log lost
            self.alert("error", f"{message}; the pod stops")
            asyncio.get_running_loop().call_soon(self.request_shutdown, "failed")

    # --- replies ------------------------------------------------------------------------------

    def _answer(self, token: int, result: Any, error: RpcError | None, durable: bool) -> None:
        future = self._replies.pop(token, None)
        if future is None:
            return
        if not durable or error is not None:
            settle(future, error if error is not None else result)
        elif self._naming is not None and not self._naming_failed:
            self._after_naming.append((future, result))  # see _session_moved
        else:
            self._answer_durable(future, result)

    def _answer_durable(self, reply: "asyncio.Future[Any] | Pending", result: Any) -> None:
        plog = self.plog
        if self.failure is None and plog.inputs_durable():
            plog.flush()  # it goes out now: what it speaks of (a run's end) is written first
            if self.failure is None and plog.inputs_durable():  # (the flush may have failed)
                settle(reply, result)
                return
        self._durable.add(reply, result)  # after the fsync (or the log's failure)

    async def synced(self) -> None:
        """Everything committed so far is durable."""
        await self._synced()

    def _policy_for_scope(self) -> bytes | None:
        """The commands' sandbox policy for the live scope (delegation changed it)."""
        rebuild = self.s.sandbox.rebuild
        if rebuild is None:
            return self.s.sandbox.policy
        self._noted_scope = scope = self.scope
        return rebuild(scope, ())

    def _policy_for_hooks(self, transcript: str) -> bytes | None:
        """The hooks' policy: the commands' own, plus reading the session log a hook is given
        (`transcript_path`, which Claude Code's Stop hooks read) and nothing else of the data
        dir: the model's bash never gets it."""
        rebuild = self.s.sandbox.rebuild
        if rebuild is None:
            return self.s.sandbox.policy
        return rebuild(self.scope, (transcript,) if transcript else ())

    def sandbox_notes(self) -> list[str]:
        """What the sandbox does not confine, for `status`: the live scope's notes (an area
        delegated to a child is denied to this pod's commands, but inside its writable tree only
        file contents are), what the command runner could not do where it runs (known once it
        started), and the stdio MCP servers, which run outside it."""
        if self.s.sandbox.rebuild is not None and self.scope is not self._noted_scope:
            self._policy_for_scope()
        mcp = [
            f"MCP server '{server.name}' (stdio) runs outside the sandbox, as in Claude Code and "
            "Codex: its tools reach what this user can"
            for server in self.m.mcp.servers
            if server.command is not None
        ]
        return [*self.s.sandbox.notes, *self.tool_ctx.runner_notes, *mcp, *self._rewritable()]

    def _rewritable(self) -> list[str]:
        """The stdio MCP servers' files this pod may rewrite (the live scope's say): they run
        unconfined at the pod's next start (a restart of the server refuses a changed one)."""
        from poddaemon.mcp.connection import rewritable_files

        commands = "bash" in self.m.worker.tools
        return [
            f"MCP server '{server.name}': {path} lies in the pod's write scope: what the pod "
            "writes there runs outside the sandbox at its next start"
            for server in self.m.mcp.servers
            for path in rewritable_files(server, self.m.pod.pwd, self.scope, commands)
        ]

    async def _synced(self) -> None:
        await self.plog.synced()

    # --- model calls and tools ------------------------------------------------------------------

    async def _call_model(self, call: CallModel) -> None:
        streamed: list[str] = []  # the text deltas so far: kept if the call does not complete
        try:
            request = ModelRequest(
                system=call.system,
                items=call.items,
                tools=self.s.tools.specs,
                max_tokens=self.m.worker.max_tokens,
                temperature=self.m.worker.temperature,
            )
            verdict = await self.chain.before_request(call.run_id, request)
            if isinstance(verdict, Refuse):
                effects = self.machine.model_refused(verdict.reason, verdict.outcome)
            else:
                response = await self._stream(verdict, call.run_id, streamed)
                effects = self.machine.model_returned(response)
        except asyncio.CancelledError:  # an `Interrupt` (cancel, shutdown) of this call
            if self.machine.in_flight != "model":
                raise
            effects = self.machine.model_failed(None, "".join(streamed))
        except ProviderError as exc:
            self.alert("error", exc.message, source="provider")
            effects = self.machine.model_failed(exc, "".join(streamed))
        except Exception as exc:  # a bug must still end the run properly, history valid
            log.exception("model call of run %s failed", call.run_id)
            effects = self.machine.internal_error(str(exc))
        self._inflight = None
        self.feed(effects)

    async def _stream(
        self, request: ModelRequest, run_id: str, streamed: list[str]
    ) -> ModelResponse:
        publish = self.bus.publish
        retrying = False  # the machine knows: a pause ends a call that only waits to retry
        async with contextlib.aclosing(self.s.model.stream(request)) as events:  # type: ignore[type-var]
            if not self.plog.inputs_durable():
                # The request is already on its way (on the model thread) while the input is
                # fsync'd: the model may see an input a crash then loses, as a crash after the
                # fsync would have it answer a run nobody hears of; but nothing it answers is
                # used, published or committed before the input is durable.
                await self._synced()
            async for event in events:
                event = _utf8_only(event)
                if isinstance(event, TextDelta):
                    streamed.append(event.text)
                    publish("text.delta", {"text": event.text}, run_id)
                elif isinstance(event, ReasoningDelta):
                    publish("reasoning.delta", {"text": event.text}, run_id)
                elif isinstance(event, RetryScheduled):
                    data = {"attempt": event.attempt, "delay": event.delay, "error": event.error}
                    publish("llm.retry", data, run_id)
                    if event.answered:
                        self.feed(self.machine.attempt_cut())
                    if not retrying:
                        retrying = True
                        self.feed(self.machine.model_retrying(True))
                    continue
                else:
                    return event
                if retrying:  # output started: from here on a pause waits for the answer
                    retrying = False
                    self.feed(self.machine.model_retrying(False))
        raise ProviderError("interrupted", "the model stream ended without a response")

    def render_prompt(self) -> str:
        """The instruction rendered now (at start, and for each compacted session: `now`),
        with the scope configured (not narrowed by what a child holds for the moment)."""
        m = self.m
        return self.s.instruction.render(
            pwd=m.pod.pwd, scope=self.s.scope, tools=list(m.worker.tools)
        )

    async def _summarize(self, effect: Summarize) -> None:
        try:
            effects = await summarize(self, effect)
        except asyncio.CancelledError:
            if self.machine.in_flight != "compact":
                raise
            effects = self.machine.compaction_failed(None)
        self._inflight = None
        self.feed(effects)

    def _compaction_cancelled(self) -> list[Effect]:
        return self.machine.compaction_failed(None)

    async def _run_tool(self, effect: RunTool) -> None:
        call = effect.call
        ran: ToolOutcome | None = None  # the tool's own outcome, once it has returned
        try:
            self.children.before_tool()  # a child restarted just now holds its area again
            denied = await self.chain.before_tool(effect.run_id, call)
            if denied is not None:
                outcome = ToolOutcome(output=denied.reason, is_error=True, summary="denied")
            else:
                outcome = ran = await execute(
                    call.name, call.arguments, self.tool_ctx, self.s.tools.tools
                )
                outcome = await self.chain.after_tool(effect.run_id, call, outcome)
        except asyncio.CancelledError:  # an `Interrupt` (cancel, shutdown) of this call
            if self.machine.in_flight != "tool":
                raise
            if ran is not None:  # cut short in its PostToolUse hooks: the tool itself finished
                outcome = ran
                outcome.output += f"\n{HOOKS_CUT_SHORT}"
            else:
                outcome = ToolOutcome(
                    output=CANCELLED_WHILE_RUNNING, is_error=True, summary="cancelled"
                )
        except Exception as exc:
            log.exception("tool %s failed", call.name)
            outcome = ToolOutcome(output=f"internal error: {exc}", is_error=True)
        self._inflight = None
        self.feed(
            self.machine.tool_returned(call.id, outcome.output, outcome.is_error, outcome.summary)
        )

    async def _check_stop(self, effect: RunStopHooks) -> None:
        """The Stop hooks on the run's final answer, before it ends (their verdict decides)."""
        assert self.hooks is not None
        block: str | None = None
        try:
            block = await self.hooks.stop(effect.run_id, effect.stop_hook_active, effect.last_round)
        except asyncio.CancelledError:  # an `Interrupt` (cancel, shutdown): the hooks are killed
            if self.machine.in_flight != "stop":
                raise
        except Exception:  # a bug: the run ends as if no hook had blocked
            log.exception("the Stop hooks of run %s failed", effect.run_id)
        self._inflight = None
        self.feed(self.machine.stop_checked(block))

    def _stop_check_cancelled(self) -> list[Effect]:
        return self.machine.stop_checked(None)

    def _start(self, coro: Any, what: str, cancelled: Callable[[], list[Effect]]) -> None:
        """Run a model call or tool as the in-flight task. A task cancelled before it ever ran
        never reaches its own handler, so its result is fed from here instead; so is the end
        of one whose handler itself raised (a bug there left the run "running" for good)."""
        task = self._inflight = asyncio.ensure_future(coro)

        def done(t: "asyncio.Task[None]") -> None:
            if t.cancelled():
                if self.machine.in_flight == what:
                    self._inflight = None
                    self.feed(cancelled())
                return
            exc = t.exception()
            if exc is not None and self._inflight is t and self.machine.in_flight == what:
                log.error("the %s task failed", what, exc_info=exc)
                self._inflight = None
                message = f"{type(exc).__name__}: {exc}"
                if what == "compact":
                    self.feed(self.machine.compaction_failed(f"internal error: {message}"))
                else:
                    self.feed(self.machine.internal_error(message))

        task.add_done_callback(done)

    def _model_cancelled(self) -> list[Effect]:
        return self.machine.model_failed(None)

    def _tool_cancelled(self, call: Any) -> list[Effect]:
        return self.machine.tool_returned(call.id, NOT_RUN_CANCELLED, True, "cancelled")

    def _set_timer(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, at - time.time())
        self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.feed(self.machine.tick())

    def _session_ref(self) -> tuple[str, str]:
        """(session id, its log's path) for a hook's stdin: before the first input (a
        SessionStart hook at start-up), the session that input will start. What is staged is
        written first: a hook reading its transcript (a Stop hook, the last answer) sees all
        said so far (and a fork that write makes is the session it is given)."""
        self.plog.flush()
        reserved = self.plog.reserved
        if self.machine.state.session_id or reserved is None:
            return self.machine.state.session_id, self.plog.path
        return reserved.session_id, str(reserved.path)

    def _keep_tool_output(self, call: ToolCall, outcome: ToolOutcome) -> None:
        self.feed(
            self.machine.tool_finished(call.id, outcome.output, outcome.is_error, outcome.summary)
        )
        self.plog.flush()  # written before the hooks start, not at the end of this loop pass

    def _record_hook(self, run: "HookRun") -> None:
        from poddaemon.hooks import ADVISORY, NOT_RUN

        # A block where nothing can be blocked is a message for the user (Claude Code shows
        # its stderr): recorded alone, no one saw it. So is a guard that could not run (it
        # blocks every call it guards until someone restores its script).
        if (
            run.decision == "warning"
            or (run.decision == "block" and run.event in ADVISORY)
            or run.exit in NOT_RUN
        ):
            self.alert("warning", f"{run.event} hook `{run.command}`: {run.reason}", "hook")
        if run.message:
            self.alert("warning", f"{run.event} hook `{run.command}`: {run.message}", "hook")
        effects = self.machine.hook_ran(
            run.event, run.command, run.exit, run.duration, run.decision, run.reason
        )
        self.feed(effects)

    def warm_up(self) -> None:
        """Right after READY, what the first run would otherwise pay for: load the builtin
        tools (~2.5 ms), import the provider's SDK in the model thread (~0.4-1 s), and, for a
        pod with no session yet, make its session's file and name it in the registry (~1-3 ms
        of fsyncs, see PodLog.reserve). Failures are left for the first real call to report."""

        async def warm() -> None:
            with contextlib.suppress(Exception):
                self.s.tools.specs  # noqa: B018 - loads the builtin tools' modules
            with contextlib.suppress(Exception):
                await self.s.model.warm()

        self._warming = asyncio.ensure_future(warm())  # not awaited at stop: stop stays fast
        if self.plog.log is None and self.plog.reserved is None and self.failure is None:
            self.spawn_background(self.reserve_session())

    async def reserve_session(self) -> None:
        if self.plog.log is not None:  # the first input came first: its session is named
            return
        # Named in the registry before its file is made, so the first input waits for neither
        # (a pod asked to restore this session is refused from here on, as for any session a
        # pod holds), and so that a pod killed before its first input leaves its empty file
        # named by its entry: the transaction that reclaims the entry removes it. Made first,
        # a kill before the naming left the file to nobody, one more per life of a crash loop.
        session_id = new_session_id()
        self._session_moved(session_id)
        await self._named()
        try:
            reservation = await asyncio.to_thread(self.plog.reserve, session_id)
        except OSError as exc:  # the first input creates its file as it would have anyway
            log.debug("cannot make the first session's file ahead: %s", exc)
            return
        if self.plog.offer(reservation):
            log.debug("the first session's file is made: %s", reservation.path)
            # (Named already, unless another reservation was named since: the kept one is.)
            self._session_moved(reservation.session_id)
        else:  # the first input came first, or the pod stops
            with contextlib.suppress(OSError):
                await asyncio.to_thread(reservation.discard)

    def spawn_background(self, coro: Coroutine[Any, Any, Any]) -> "asyncio.Task[Any]":
        """Run work nothing waits on off the path (a hook that decides nothing: Notification,
        SubagentStop, Stop after a run that did not finish; naming a session); the stop gives
        it a moment to finish."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def alert(self, level: str, message: str, source: str = "session") -> None:
        log.log(logging.ERROR if level == "error" else logging.WARNING, "%s", message)
        self.bus.publish("alert", {"level": level, "source": source, "message": message})

    def _spent(self) -> bool:
        return self.machine.budget_exhausted()

    # --- restore and shutdown -------------------------------------------------------------------

    async def restore(self, session_id: str) -> list[str]:
        """Reopen a session: fold its log, close what a crash left open. Returns warnings.

        Another pod's session (`--session`) is continued in a fork of this pod's own, where its
        `--resume` looks, and not where the other pod's `--resume` would run what this one
        acknowledges; so is a session another one continues already (one compacted or forked
        since: no chain end, `--resume` never picks it). The fork is made before anything is
        written: what the restore closes (an interrupted run) goes to it, not to the old one.
        The work it takes up (queued runs, the interrupted run's note) waits for `start_work`."""
        from poddaemon.store.file import continued_by, session_pod

        owner = session_pod(self.s.sessions_dir, session_id)
        why = None
        if owner is not None and owner != self.name:
            why = f"belongs to pod {owner!r}"  # (not "is pod 'a''s")
        elif later := continued_by(self.s.sessions_dir, session_id, self.name):
            why = f"was continued already by session {later[0]}"
        copy = why is not None  # (not for the prompt below: the session is still ours)
        self.machine.hold()
        effects, warnings = self.plog.restore(
            session_id, lambda entries: self.machine.restore(entries, copy)
        )
        # An edited instruction applies at the next start, as the rest of the manifest does.
        if self.machine.take_rendered_prompt() and why is None:
            why = "has another system prompt than this start rendered"
        if why is not None:
            self.plog.fork_now(why)  # its first entry holds the state the effects made
        self.feed(effects, in_log=why is not None)
        await self._synced()
        return warnings

    def start_work(self) -> None:
        """Start-up is done: what `restore` took up starts. Started by the restore, the model
        was called before the SessionStart hooks ("resume") had added their context."""
        self.feed(self.machine.release())

    async def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for future in self._replies.values():
            settle(future, RpcError(errors.SHUTTING_DOWN, "the pod shut down"))
        self._durable.drain()
        if self._naming is not None and self._naming_failed:
            self._naming.cancel()  # retrying: the entry goes with us, the next pod reclaims it
        if self._background:  # Stop/Notification hooks still running: give them a moment
            await asyncio.wait(self._background, timeout=5)
        await self.tool_ctx.aclose()  # kills commands still running, reaps the runner
        await self.plog.close()
        with contextlib.suppress(Exception):
            await self.s.model.aclose()
        if self.s.compaction_model is not None:
            with contextlib.suppress(Exception):
                await self.s.compaction_model.aclose()

    def mcp_status(self) -> list[Any]:
        return self.mcp.status() if self.mcp is not None else []

    def handlers(self) -> dict[str, Callable[[Any, Any], Any]]:
        from poddaemon.handlers import handlers

        return handlers(self)


def _mcp_vars(m: Manifest) -> list[str]:
    """The variables the manifest hands to its MCP servers (`${VAR}` in their `env`): a token
    given to a server is the server's, not every command's."""
    if not m.mcp.servers:
        return []
    from poddaemon.mcp.env import referenced

    return [var for server in m.mcp.servers for var in referenced(server.env)]


class _LiveScope:
    """The pod's scope as the tools see it: read through the pod at every call."""

    def __init__(self, pod: Pod) -> None:
        self._pod = pod

    def check(self, path: str, want: Any, cwd: str) -> str:
        return self._pod.scope.check(path, want, cwd)

    def access(self, path: str) -> Any:
        return self._pod.scope.access(path)

    @property
    def deny(self) -> Any:
        return self._pod.scope.deny
