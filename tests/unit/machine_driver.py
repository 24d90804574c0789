"""An in-memory executor for the pod machine: it carries out effects the way `pod.py` does, but
writes entries to a byte buffer in the real log format, answers model calls and tools from the
test, and lets a test "sync" (fsync) and "crash" (keep any prefix of what was written, at least
what was synced) at will. Tests drive the real `Machine` through it."""

from dataclasses import dataclass, field
from typing import Any

from poddaemon.entries import (
    SessionStart,
    SystemItem,
    UserInput,
    body_of,
    events_of,
    record_of,
)
from poddaemon.history import AssistantMessage, ToolCall, Usage
from poddaemon.llm.types import ModelResponse, ProviderError, StopReason
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
from poddaemon.store.log import GENESIS, encode_entry, encode_record
from protocol.errors import RpcError

T0 = 1_700_000_000.0


@dataclass
class Answer:
    token: int
    result: Any = None
    error: RpcError | None = None


@dataclass
class Driver:
    cfg: MachineConfig = field(
        default_factory=lambda: MachineConfig(name="p", model="m", max_turns=4, max_pending=50)
    )
    now: float = T0
    n: int = 0
    lines: list[bytes] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    prev: str = GENESIS
    durable: int = 0  # lines covered by the last sync
    answers: dict[int, Answer] = field(default_factory=dict)  # replies the client received
    waiting: list[tuple[int, Answer]] = field(default_factory=list)  # (lines needed, reply)
    events: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)
    inflight: CallModel | RunTool | RunStopHooks | Summarize | None = None
    old_sessions: list[list[dict[str, Any]]] = field(default_factory=list)  # before compactions
    interrupted: bool = False
    timer: float | None = None
    stopped: bool = False
    acked: list[dict[str, Any]] = field(default_factory=list)  # inputs whose ack was received
    tokens: int = 0
    effects: list[Effect] = field(default_factory=list)  # of the last command
    machine: Machine = field(init=False)

    def __post_init__(self) -> None:
        self.machine = Machine(self.cfg, clock=lambda: self.now, new_id=self.new_id)

    def new_id(self) -> str:
        self.n += 1
        return f"id{self.n:04d}"

    def token(self) -> int:
        self.tokens += 1
        return self.tokens

    # --- carrying out effects -------------------------------------------------------------------

    def feed(self, effects: list[Effect]) -> list[Effect]:
        self.effects = effects
        for e in effects:
            match e:
                case OpenSession(start):
                    assert not self.lines, "a second session in one driver"
                    self._write(start)
                case Commit(entry):
                    assert self.lines, "an entry before the session started"
                    self._write(entry)
                    self.events.extend(events_of(entry))
                case Reply(token, result, error, durable):
                    answer = Answer(token, result, error)
                    if durable:
                        self.waiting.append((len(self.lines), answer))
                    else:
                        self._deliver(answer)
                case Publish(type_, data, run_id):
                    self.events.append((type_, data, run_id))
                case SwitchSession(start):
                    # Compaction: the new session is durable at once; the old one is kept.
                    self.sync()
                    self.old_sessions.append(self.entries)
                    self.lines, self.entries, self.prev = [], [], GENESIS
                    self._write(start)
                    self.durable = 1
                case CallModel() | RunTool() | RunStopHooks() | Summarize():
                    assert self.inflight is None, "two things in flight"
                    self.inflight = e
                    self.interrupted = False
                case Interrupt():
                    self.interrupted = True
                case SetTimer(at):
                    self.timer = at
                case Sync():
                    pass
                case Stopped():
                    self.stopped = True
        return effects

    def _write(self, entry: Any) -> None:
        assert entry.seq == len(self.lines) + 1, (entry.seq, len(self.lines))
        line, stored = encode_entry(entry.seq, entry.ts, entry.kind, self.prev, body_of(entry))
        # The pod writes typed entries without body_of's copy (PodLog.write): the same bytes.
        # (A session_start only ever goes through body_of: PodLog.open, _fork and switch.)
        if not isinstance(entry, SessionStart):
            record = record_of(entry)
            assert encode_record(entry.seq, self.prev, record) == (line, stored["hash"])
        self.prev = stored["hash"]
        self.lines.append(line)
        self.entries.append(stored)

    def _deliver(self, answer: Answer) -> None:
        assert answer.token not in self.answers, "answered twice"
        self.answers[answer.token] = answer

    def sync(self) -> None:
        """fsync: everything written so far is durable; release the replies waiting for it."""
        self.durable = len(self.lines)
        still = []
        for needed, answer in self.waiting:
            if needed <= self.durable:
                self._deliver(answer)
                self._note_ack(answer)
            else:
                still.append((needed, answer))
        self.waiting = still

    def _note_ack(self, answer: Answer) -> None:
        """Remember the input entry a successful run/notify acknowledgement stands for."""
        result = answer.result
        ident = getattr(result, "notification_id", None)
        if ident is None and getattr(result, "state", None) in ("started", "queued"):
            ident = result.run_id
        if ident is None:
            return
        for e in self.entries:
            if (e.get("run_id") == ident and e["kind"] == "user_input") or (
                e.get("id") == ident and e["kind"] == "system_item"
            ):
                self.acked.append(e)

    # --- commands ---------------------------------------------------------------------------------

    def call(self, name: str, *args: Any, **kwargs: Any) -> int:
        token = self.token()
        self.feed(getattr(self.machine, name)(token, *args, **kwargs))
        return token

    def answer(self, token: int) -> Answer:
        self.sync()
        return self.answers[token]

    def model(
        self,
        text: str = "answer",
        calls: int = 0,
        stop: StopReason | None = None,
        usage: int = 10,
    ) -> list[Effect]:
        assert isinstance(self.inflight, CallModel), self.inflight
        self.inflight = None
        tool_calls = tuple(
            ToolCall(id=self.new_id(), name="read_file", arguments='{"path": "x"}')
            for _ in range(calls)
        )
        response = ModelResponse(
            message=AssistantMessage(text=text, tool_calls=tool_calls),
            stop=stop or ("tool_use" if calls else "end_turn"),
            usage=Usage(input=usage, output=1),
        )
        return self.feed(self.machine.model_returned(response))

    def summarize(self, text: str = "summary", usage: int = 5) -> list[Effect]:
        assert isinstance(self.inflight, Summarize), self.inflight
        self.inflight = None
        result = self.machine.compaction_returned(text, Usage(input=usage, output=1))
        return self.feed(result)

    def summarize_fails(self, error: str | None = "boom") -> list[Effect]:
        assert isinstance(self.inflight, Summarize), self.inflight
        self.inflight = None
        return self.feed(self.machine.compaction_failed(error))

    def model_fails(self, error: ProviderError | None = None, partial: str = "") -> list[Effect]:
        assert isinstance(self.inflight, CallModel)
        self.inflight = None
        return self.feed(self.machine.model_failed(error, partial))

    def tool(self, output: str = "tool output", is_error: bool = False) -> list[Effect]:
        assert isinstance(self.inflight, RunTool), self.inflight
        call = self.inflight.call
        self.inflight = None
        return self.feed(self.machine.tool_returned(call.id, output, is_error))

    def stop_hooks(self, block: str | None = None) -> list[Effect]:
        """The Stop hooks' verdict: `block` is the reason one gave, None lets the run end (or
        the check was interrupted)."""
        assert isinstance(self.inflight, RunStopHooks), self.inflight
        self.inflight = None
        return self.feed(self.machine.stop_checked(block))

    def tick(self, seconds: float = 2.0) -> list[Effect]:
        self.now += seconds
        self.timer = None
        return self.feed(self.machine.tick())

    # --- views ------------------------------------------------------------------------------------

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.entries]

    def event_types(self) -> list[str]:
        return [t for t, _, _ in self.events]

    def inputs(self) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["kind"] in ("user_input", "system_item")]


def is_input(entry: object) -> bool:
    return isinstance(entry, UserInput | SystemItem)


__all__ = ["T0", "Answer", "Driver", "SessionStart", "is_input"]
