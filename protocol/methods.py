"""The one method table of the control socket (SPEC §5): name -> (params Struct, result Struct).

The server decodes params with it and checks at start-up that it has a handler for every method
and a method for every handler; both clients build their typed methods from it (`protocol.core`).
"""

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from protocol.types import (
    DEFAULT_HISTORY_LIMIT,
    DEFAULT_SOURCE,
    AcceptedResult,
    CancelParams,
    CancelResult,
    CompactResult,
    HistoryParams,
    HistoryResult,
    NoParams,
    NotifyParams,
    NotifyResult,
    OkResult,
    Params,
    PauseResult,
    PodEventParams,
    ResumeResult,
    RunParams,
    RunResult,
    RunWaitResult,
    StatusResult,
    SubscribeParams,
    SubscribeResult,
    UsageResult,
)

P_co = TypeVar("P_co", bound=Params, covariant=True)
R_co = TypeVar("R_co", covariant=True)


@dataclass(frozen=True)
class Method(Generic[P_co, R_co]):
    name: str
    params: type[P_co]
    result: type[R_co]


RUN = Method("run", RunParams, RunResult)
# `run` with `wait: true` answers when the run ends: same method and params, another result.
RUN_WAIT = Method("run", RunParams, RunWaitResult)
NOTIFY = Method("notify", NotifyParams, NotifyResult)
RESUME = Method("resume", NoParams, ResumeResult)
PAUSE = Method("pause", NoParams, PauseResult)
CANCEL = Method("cancel", CancelParams, CancelResult)
STATUS = Method("status", NoParams, StatusResult)
HISTORY = Method("history", HistoryParams, HistoryResult)
USAGE = Method("usage", NoParams, UsageResult)
SUBSCRIBE = Method("subscribe", SubscribeParams, SubscribeResult)
COMPACT = Method("compact", NoParams, CompactResult)
POD_EVENT = Method("pod_event", PodEventParams, AcceptedResult)
SHUTDOWN = Method("shutdown", NoParams, OkResult)

METHODS: dict[str, Method[Params, object]] = {
    m.name: m
    for m in (
        RUN,
        NOTIFY,
        RESUME,
        PAUSE,
        CANCEL,
        STATUS,
        HISTORY,
        USAGE,
        SUBSCRIBE,
        COMPACT,
        POD_EVENT,
        SHUTDOWN,
    )
}

# --- client-side params builders --------------------------------------------------------------
# Where a client method's signature differs from its Struct (run has no `wait`, None means "the
# pod's default"), these give it; elsewhere the Struct itself is the builder.


def run_params(
    input: str, mode: Literal["queue", "steer"] = "queue", client_key: str | None = None
) -> RunParams:
    return RunParams(input, mode, client_key)


def run_wait_params(
    input: str, mode: Literal["queue", "steer"] = "queue", client_key: str | None = None
) -> RunParams:
    return RunParams(input, mode, client_key, wait=True)


def notify_params(
    message: str, source: str | None = None, client_key: str | None = None
) -> NotifyParams:
    return NotifyParams(message, DEFAULT_SOURCE if source is None else source, client_key)


def history_params(
    since: int = 0, limit: int | None = None, session_id: str | None = None
) -> HistoryParams:
    return HistoryParams(since, DEFAULT_HISTORY_LIMIT if limit is None else limit, session_id)
