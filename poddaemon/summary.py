"""The compaction's summary call (the I/O half of compaction; the rules are compaction.py's):
the compaction provider (default: the pod's own) over the history the machine chose, no text
streamed to subscribers (it is not the run's answer). Returns the machine's effects."""

import contextlib
import logging
import re
from typing import TYPE_CHECKING

import msgspec

from poddaemon import compaction
from poddaemon.history import AssistantMessage
from poddaemon.llm.types import (
    ModelClient,
    ModelRequest,
    ModelResponse,
    ProviderError,
    RetryScheduled,
)
from poddaemon.machine import Effect, Summarize
from poddaemon.session import SessionState

if TYPE_CHECKING:
    from poddaemon.pod import Pod

log = logging.getLogger("poddaemon.pod")

CUT_OFF_NOTE = "\n\n[This summary was cut off at the output limit: it may be incomplete.]"
CUT_OFF_ALERT = (
    "the compaction summary hit the output limit (worker.max_tokens = {}) and was kept cut off"
)


async def summarize(pod: "Pod", effect: Summarize) -> list[Effect]:
    machine = pod.machine
    try:
        await pod.synced()
        await pod.chain.before_compact(effect.reason)
        request = ModelRequest(
            system=effect.system,
            items=effect.items,
            tools=pod.s.tools.specs,  # a history with tool calls needs the tools declared
            max_tokens=pod.m.worker.max_tokens,
            temperature=pod.m.worker.temperature,
        )
        client = pod.s.compaction_model or pod.s.model
        response = await _fitted_answer(pod, client, request, effect.run_id)
        summary = response.message.text
        if response.stop in ("content_filter", "context_overflow"):
            # A refusal, or an answer stopped part way, in place of the summary: kept, it would
            # replace the whole context. The old session stays, as for any failed summary.
            reason = response.detail or response.stop.replace("_", " ")
            _alert(pod, f"compaction: the summary was stopped: {reason}")
            return machine.compaction_failed(
                f"the summary was stopped: {reason}", response.usage, response.message
            )
        if response.message.tool_calls:
            # Told not to, it went on working: its text is a preamble ("Let me read the file
            # first"), no summary, and kept it would replace the whole context.
            return machine.compaction_failed(
                "the model called a tool instead of summarizing", response.usage, response.message
            )
        if response.stop == "max_tokens" and summary.strip():
            # Still better than the context it replaces, but the model must know it is partial.
            pod.alert("warning", CUT_OFF_ALERT.format(pod.m.worker.max_tokens), "compaction")
            summary += CUT_OFF_NOTE
        _render_again(pod)
        return machine.compaction_returned(summary, response.usage, live_children(machine.state))
    except ProviderError as exc:
        _alert(pod, f"compaction: {exc.message}")
        # Cut off once the provider had begun its answer: billed, though no usage came.
        cut = exc.answered or exc.kind in ("interrupted", "stalled")
        return machine.compaction_failed(exc.message, answer=AssistantMessage() if cut else None)
    except Exception as exc:  # CancelledError is the caller's
        log.exception("compaction failed")
        return machine.compaction_failed(f"internal error: {exc}")


def _render_again(pod: "Pod") -> None:
    """The new session starts from the instruction rendered now: rendered once at start, a pod
    living for days told the model the day it started on (`{{ now.date() }}`) for good. A
    rendering that fails now (an AGENTS.md made unreadable) keeps the prompt it has."""
    from poddaemon.prompt import PromptError

    try:
        pod.machine.rendered_prompt = pod.render_prompt()
    except (PromptError, OSError) as exc:
        log.warning("compaction keeps the system prompt: %s", exc)


def _alert(pod: "Pod", message: str) -> None:
    """A provider's alert for subscribers; the log has it once, as the compaction's failure."""
    pod.bus.publish("alert", {"level": "warning", "source": "provider", "message": message})


async def _fitted_answer(
    pod: "Pod", client: ModelClient, request: ModelRequest, run_id: str | None
) -> ModelResponse:
    """The summary's answer; a request the provider refuses as too long is sent again without
    its oldest rounds (see `compaction.trimmed_summary_request`) until it fits."""
    while True:
        try:
            return await _answer(pod, client, request, run_id)
        except ProviderError as exc:
            trimmed = None
            if exc.kind == "context_overflow":
                trimmed = compaction.trimmed_summary_request(request.items)
            if trimmed is None:
                raise
            _alert(pod, f"compaction: {exc.message}; retrying without the oldest rounds")
            request = msgspec.structs.replace(request, items=trimmed)


# A setting an error names ("(provider.first_byte_timeout)"), but not "compaction.provider.x".
_SETTING = re.compile(r"(?<![\w.])provider\.(?=\w)")


def own_settings(message: str) -> str:
    """`message` of the [compaction.provider]'s call, the settings it names made its own:
    a timeout named `provider.first_byte_timeout` sent the user to the pod's own provider."""
    return _SETTING.sub("compaction.provider.", message)


async def _answer(
    pod: "Pod", client: ModelClient, request: ModelRequest, run_id: str | None
) -> ModelResponse:
    own = client is pod.s.compaction_model  # (None: the pod's own provider, rightly named)
    try:
        async with contextlib.aclosing(client.stream(request)) as events:  # type: ignore[type-var]
            async for event in events:
                if isinstance(event, RetryScheduled):
                    error = own_settings(event.error) if own else event.error
                    data = {"attempt": event.attempt, "delay": event.delay, "error": error}
                    pod.bus.publish("llm.retry", data, run_id)
                    if event.answered:
                        pod.feed(pod.machine.attempt_cut())
                elif isinstance(event, ModelResponse):
                    return event
    except ProviderError as exc:
        if own:
            exc.message = own_settings(exc.message)
            exc.args = (exc.message,)
        raise
    raise ProviderError("interrupted", "the model stream ended without a response")


def live_children(state: SessionState) -> list[str]:
    """Live child pods, one line each, for the compacted history."""
    lines = []
    for c in state.children.values():
        if c.live:
            rules = ", ".join(f"{r.get('permission')} {r.get('target')}" for r in c.scope)
            lines.append(f"{c.name} (socket {c.socket}; scope: {rules or '-'})")
    return lines
