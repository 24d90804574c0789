"""The normalized model interface every wire-format adapter implements."""

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol

import msgspec

from poddaemon.history import AssistantMessage, Item, Usage

StopReason = Literal[
    "end_turn", "tool_use", "max_tokens", "content_filter", "context_overflow", "other"
]
ErrorKind = Literal["transient", "fatal", "auth", "context_overflow", "stalled", "interrupted"]


class ToolSpec(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    description: str
    parameters: dict[str, Any]


class ModelRequest(msgspec.Struct, kw_only=True):
    system: str
    items: list[Item]
    tools: list[ToolSpec]
    max_tokens: int
    temperature: float | None = None


class TextDelta(msgspec.Struct, frozen=True):
    text: str


class ReasoningDelta(msgspec.Struct, frozen=True):
    text: str


class RetryScheduled(msgspec.Struct, kw_only=True, frozen=True):
    attempt: int
    delay: float
    error: str
    answered: bool = False  # the failed attempt had begun its answer: the provider bills it


class ModelResponse(msgspec.Struct, kw_only=True):
    message: AssistantMessage
    stop: StopReason
    usage: Usage
    detail: str = ""


StreamEvent = TextDelta | ReasoningDelta | RetryScheduled | ModelResponse


# What a run's error, an alert and the session log keep of a provider's error message.
MAX_ERROR_CHARS = 2000


class ProviderError(Exception):
    """A model call that failed; `kind` tells the pod whether anything can be retried."""

    def __init__(
        self, kind: ErrorKind, message: str, status: int | None = None, *, answered: bool = False
    ) -> None:
        # A provider's error body may carry a `\ud800` escape, which its JSON decoder turns into
        # a lone surrogate: no alert, event or log line could hold the message (publishing the
        # alert raised and left the run running for ever). Shown as the text `\ud800`.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        if len(message) > MAX_ERROR_CHARS:  # a provider's dump of the request, a stack trace
            message = message[: MAX_ERROR_CHARS - 1] + "…"
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.status = status
        self.message = message
        # The last attempt had begun its answer (a tool call's arguments, say) before it
        # failed: the provider bills it, though nothing reached the caller.
        self.answered = answered


class ModelClient(Protocol):
    def stream(self, req: ModelRequest) -> AsyncIterator[StreamEvent]: ...

    async def warm(self) -> None: ...

    async def aclose(self) -> None: ...
