"""Wire types of the control socket (SPEC §5): the JSON-RPC envelope, params, results, events.

Params are decoded with `forbid_unknown_fields`, so a typo in a field name is a -32602 that names
it instead of a silently ignored option. Which method takes which params and answers which result
is `protocol.methods.METHODS`.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Raw, Struct, UnsetType

from protocol.paths import POD_NAME_RE

JSONRPC = "2.0"
# JSON-RPC 2.0: a string, a number (a fraction is allowed, if discouraged) or null.
RequestId = int | float | str | None


class Request(Struct, kw_only=True, omit_defaults=True):
    jsonrpc: Literal["2.0"]
    method: str
    params: Raw | UnsetType = UNSET
    id: int | float | str | UnsetType | None = UNSET

    @property
    def is_notification(self) -> bool:
        return self.id is UNSET


class ErrorObject(Struct, kw_only=True, omit_defaults=True):
    code: int
    message: str
    data: Any = None


class Response(Struct, kw_only=True, omit_defaults=True):
    """A reply as a client decodes it: exactly one of `result` / `error` is set."""

    jsonrpc: str = JSONRPC
    id: int | str | None = None
    result: Raw | UnsetType = UNSET
    error: ErrorObject | UnsetType = UNSET
    method: str | UnsetType = UNSET  # set on server-initiated notifications (events)
    params: Raw | UnsetType = UNSET


# --- params -----------------------------------------------------------------------------------


DEFAULT_SOURCE = "user"
DEFAULT_HISTORY_LIMIT = 200


# Positional fields (no kw_only): the clients' methods take their arguments in field order.
class Params(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class NoParams(Params):
    pass


# Empty, a key ("$BUILD_ID" unset in a cron line) made no retry idempotent, without a word.
ClientKey = Annotated[str, msgspec.Meta(min_length=1)]


class RunParams(Params):
    input: str
    mode: Literal["queue", "steer"] = "queue"
    client_key: ClientKey | None = None
    wait: bool = False


class NotifyParams(Params):
    message: str
    source: str = DEFAULT_SOURCE
    client_key: ClientKey | None = None


class CancelParams(Params):
    run_id: str | None = None


# A seq to start after, and a page size: -32602 for a negative one or an empty page, as for any
# wrong param (a page larger than the pod's cap is cut to it; `next` goes on from there).
PodName = Annotated[str, msgspec.Meta(pattern=POD_NAME_RE.pattern)]
RunOutcome = Literal["finished", "paused", "limit_reached", "cancelled", "error"]
Seq = Annotated[int, msgspec.Meta(ge=0)]
PageSize = Annotated[int, msgspec.Meta(ge=1)]


class HistoryParams(Params):
    since: Seq = 0
    limit: PageSize = DEFAULT_HISTORY_LIMIT
    session_id: str | None = None  # an earlier session of this pod (walk back a chain)


class SubscribeParams(Params):
    since: Seq | None = None


class PodEventParams(Params):
    pod: PodName
    kind: Literal["run.finished", "errored", "shutdown"]  # SPEC §9's reports
    event_id: str | None = None  # the same id twice is accepted once
    run_id: str | None = None
    text: str | None = None
    outcome: RunOutcome | None = None
    usage: dict[str, int] | None = None


# --- results ----------------------------------------------------------------------------------


class Result(Struct, kw_only=True):
    pass


class UsageTotals(Result):
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    calls: int = 0


class RunResult(Result, omit_defaults=True):
    run_id: str
    state: Literal["started", "queued", "steered"]
    position: int | None = None  # `position?`: only for a queued run


class RunWaitResult(Result):
    run_id: str
    outcome: str
    text: str
    usage: UsageTotals
    error: str | None = None


class NotifyResult(Result):
    notification_id: str
    wakes: bool


class ResumeResult(Result):
    run_id: str


class PauseResult(Result):
    paused: bool


class CancelResult(Result):
    cancelled: bool


class ScopeEntry(Result):
    target: str
    permission: str
    recursive: bool = True
    deny: bool = False


class QueueInfo(Result):
    runs: int = 0
    notifications: int = 0


class McpServerInfo(Result):
    name: str
    transport: str  # "stdio" | "http"
    state: str  # starting | ready | restarting | failed | dead | stopped
    tools: int = 0
    restarts: int = 0
    error: str | None = None


class ChildInfo(Result):
    """A live child of the pod (spawn trees)."""

    name: str
    pid: int
    state: str
    socket: str


class BudgetInfo(Result):
    limit: int | None = None  # budget.max_total_tokens
    spent: int = 0  # this pod's own model calls
    tree_spent: int = 0  # this pod and its descendants, as their reports tell
    # What it may still spend or grant (None without a limit): live children's grants count as
    # spent. At 0 no run starts, so queued inputs wait (an addition to SPEC §5).
    left: int | None = None


class StatusResult(Result):
    name: str
    pid: int
    state: str
    session_id: str | None
    provider: str
    model: str
    pwd: str
    scope: list[ScopeEntry]
    queue: QueueInfo
    usage: UsageTotals
    children: list[ChildInfo]
    started_at: float
    version: str
    run_id: str | None = None
    parent: str | None = None
    mcp: list[McpServerInfo] = []
    budget: BudgetInfo = msgspec.field(default_factory=BudgetInfo)
    sandbox: str = "none"  # "landlock-abi-N" | "none": what confines the commands it starts
    sandbox_notes: list[str] = []  # what the kernel cannot express of the scope


class HistoryResult(Result):
    entries: list[dict[str, Any]]
    next: int
    session_id: str | None = None  # the session these entries are from
    # The session it continues (compaction or fork): page it next to walk back the chain.
    previous: str | None = None
    # The seq of the session's newest entry: where its newest N begin, without paging to it.
    last_seq: int | None = None


class UsageCall(Result):
    seq: int
    ts: float
    model: str
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    run_id: str | None = None


class UsageResult(Result):
    calls: list[UsageCall]
    totals: UsageTotals


class SubscribeResult(Result):
    cursor: int


class CompactResult(Result):
    session_id: str | None  # None: no session yet, nothing to compact (as in status)


class AcceptedResult(Result):
    accepted: bool = True


class OkResult(Result):
    ok: bool = True


class Event(Struct, kw_only=True, omit_defaults=True):
    """One item of a pod's event stream; `seq` increases by one per event."""

    seq: int
    ts: float
    type: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)
    run_id: str | None = None


EVENT_TYPES = frozenset(
    {
        "run.queued",
        "run.started",
        "text.delta",
        "reasoning.delta",
        "tool.started",
        "tool.finished",
        "llm.usage",
        "llm.retry",
        "notification.committed",
        "compaction.started",
        "compaction.finished",
        "compaction.failed",
        "child.event",
        "alert",
        "state.changed",
        "run.finished",
        "shutdown",
        "gap",
    }
)
