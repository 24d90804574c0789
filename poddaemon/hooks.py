"""Command hooks (SPEC §10), Claude Code's contract, so hook scripts move between tools unchanged.

A hook is `sh -c COMMAND` run through a command runner of the pod (so inside the sandbox, and
killed with its whole process group at its timeout or with the pod), cwd = the pod's pwd, with
one JSON object on stdin: `{session_id, transcript_path, cwd, hook_event_name, pod, ...}` plus
the event's fields (the sandbox lets it read that transcript: `ToolContext.hook_runner`).
Exit 0: go on (stdout of SessionStart/UserPromptSubmit becomes context);
exit 2: block (stderr is the reason); any other exit or a timeout: a warning, go on. On exit 0
a JSON object on stdout may decide instead: `{"decision": "block", "reason": ...}` or, for
PreToolUse, `{"hookSpecificOutput": {"permissionDecision": "allow"|"deny", ...}}`.

A Stop hook that blocks a run's final answer gives the model its reason and the run another
round (`stop`, asked by the machine before the run ends); Stop hooks of runs that end otherwise,
and Notification, SubagentStop and PreCompact hooks, run as the event happens and decide nothing.

`Hooks` is an interceptor (PreToolUse, PostToolUse, Stop) plus the calls the executor makes for
the other events. Every hook run is recorded through `record` (a `hook_run` log entry)."""

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from poddaemon.config.manifest import HookConfig, HooksSection
from poddaemon.history import ToolCall
from poddaemon.interceptors import Deny, Interceptor, Refuse
from poddaemon.llm.types import ModelRequest
from poddaemon.pipes import read_pipe
from poddaemon.tools.base import ToolOutcome
from poddaemon.tools.runner_client import CommandRunner

Decision = Literal[
    "ok", "block", "allow", "warning", "stop"
]  # stop: "continue": false (a Stop hook's: the run ends now; a tool hook's: it is stopped)
OUTPUT_LIMIT = 1 << 20  # bytes kept of a hook's stdout and of its stderr
# Characters of a hook's context or reason that reach the model (as Claude Code's 10,000): a
# context is sent again with every later request, a reason is a tool result or an RPC error.
TEXT_LIMIT = 10_000


class HookRun(msgspec.Struct, frozen=True):
    event: str
    command: str
    exit: int | None  # None: killed at its timeout (or could not start)
    duration: float
    decision: Decision
    reason: str = ""  # why it blocked, or what went wrong
    context: str = ""  # what it adds to the model's context (SessionStart, UserPromptSubmit,
    # PostToolUse)
    message: str = ""  # what it tells the user (Claude Code's systemMessage): an alert


_NAMES = re.compile(r"[\w|-]+", re.ASCII)  # a matcher of plain names: "write_file|bash"


def matches(hook: HookConfig, tool: str | None) -> bool:
    """Claude Code's matcher: none, "" or "*" match every tool; plain names ("bash",
    "write_file|edit_file") match those names exactly; anything else is a regex searched in
    the tool name, unanchored ("^list", "github__.*", "_file$")."""
    matcher = hook.matcher
    if matcher in (None, "", "*") or tool is None:
        return True
    if _NAMES.fullmatch(matcher):
        return tool in matcher.split("|")
    return re.search(matcher, tool) is not None


def system_message(stdout: str) -> str:
    """Claude Code's `systemMessage` of a JSON answer ("a warning shown to the user", any
    event), at most TEXT_LIMIT; "" if none. Parsed only where the field is named."""
    if '"systemMessage"' not in stdout or not stdout.lstrip().startswith("{"):
        return ""
    try:
        out = json.loads(stdout)
    except (ValueError, RecursionError):
        return ""
    said = out.get("systemMessage") if isinstance(out, dict) else None
    return capped(str(said)) if said else ""


def capped(text: str, unread: int = 0) -> str:
    """`text` cut to TEXT_LIMIT, as UTF-8 can carry it (`utf8`); `unread`: what followed it
    that was never read (bytes past OUTPUT_LIMIT), counted in what the note says was cut."""
    text = utf8(text)
    if len(text) <= TEXT_LIMIT:
        return text
    more = len(text) - TEXT_LIMIT + unread
    return f"{text[:TEXT_LIMIT]}\n[hook output cut: {more} more characters]"


def utf8(text: str) -> str:
    """`text` with each lone surrogate made U+FFFD. A JSON answer's `"\\ud800"` escape
    decodes to one, which no UTF-8 encoder takes: a hook's block reason or context holding one
    failed the session log's write, and the pod stopped (exit 1)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


NO_REASON = "no reason given"  # a block whose hook said nothing (the caller names the hook)


GUARDS = ("PreToolUse", "UserPromptSubmit")  # the events whose "block" stops an action
HALTS = ("Stop", "SubagentStop", "PreToolUse", "PostToolUse")  # "continue": false ends the run
AFTER_THE_FACT = 4  # Stop hooks of runs that did not finish running at once (see Hooks)
NOT_RUN = (126, 127)  # sh: the command is not executable / not found
# Events whose "block" (exit 2) stops nothing: Claude Code "shows stderr to user only".
ADVISORY = ("SessionStart", "Notification", "SubagentStop", "PreCompact")
CONTEXT_EVENTS = ("SessionStart", "UserPromptSubmit")  # plain stdout on exit 0: context


def judge(
    event: str,
    code: int | None,
    stdout: str,
    stderr: str,
    unread: int = 0,
    stdout_cut: bool = False,
) -> tuple[Decision, str, str]:
    """(decision, reason, context) from a finished hook, each text at most TEXT_LIMIT; pure.
    `unread`: bytes of its output past what was kept (see `capped`); `stdout_cut`: its stdout
    was longer than OUTPUT_LIMIT."""
    decision, reason, context = _judge(event, code, stdout, stderr, stdout_cut)
    return decision, capped(reason, unread), capped(context, unread)


def _judge(
    event: str, code: int | None, stdout: str, stderr: str, stdout_cut: bool
) -> tuple[Decision, str, str]:
    if code is None:
        return "warning", "timed out: killed with its process group", ""
    if code == 2:
        return "block", stderr.strip() or NO_REASON, ""
    if code in NOT_RUN and event in GUARDS:
        # sh's "not found" / "cannot execute": the guard never judged the call, so it fails
        # closed, as one the runner could not start. A warning let every call through once
        # the model's own bash removed (or chmod -x'd) a guard script lying in its scope.
        said = stderr.strip()[:500] or "its command could not run"
        return "block", f"the hook could not run (exit {code}): {said}", ""
    if code != 0:
        said = stderr.strip()[:500]
        what = f"exit {code}" if code > 0 else f"killed by signal {-code} ({_signal_name(-code)})"
        return "warning", f"{what}: {said}" if said else what, ""
    if stdout_cut and stdout.lstrip().startswith("{"):
        # A JSON answer cut short cannot be read, and it may have been a block: a guard fails
        # closed (read as "go on", a block over 1 MiB let the tool run), any other a warning.
        why = f"its JSON output is over {OUTPUT_LIMIT} bytes: its decision could not be read"
        return ("block" if event in GUARDS else "warning"), why, ""
    try:
        out = json.loads(stdout) if stdout.lstrip().startswith("{") else None
    except RecursionError:
        # Nested deeper than the parser goes: valid JSON, maybe a block, that cannot be read
        # (uncaught, it failed the tool call, the prompt, or the pod's start-up for good).
        why = "its JSON output is nested too deeply: its decision could not be read"
        return ("block" if event in GUARDS else "warning"), why, ""
    except ValueError as exc:
        if event not in CONTEXT_EVENTS:
            # Meant as a decision, unreadable (Python's `print(dict)`, two objects): it goes
            # on, as plain output does, but the user is told. Read as "ok", a guard that
            # meant to block let every call through without a word.
            return "warning", f"its output is not valid JSON ({exc}): no decision read", ""
        out = None
    if not isinstance(out, dict):
        context = stdout.strip() if event in CONTEXT_EVENTS else ""
        return "ok", "", context
    specific = out.get("hookSpecificOutput") or {}
    permission = specific.get("permissionDecision") if isinstance(specific, dict) else None
    if permission == "deny":
        return "block", str(specific.get("permissionDecisionReason") or "denied by a hook"), ""
    if permission == "ask":  # Claude Code asks its user; a pod has nobody to confirm it
        why = specific.get("permissionDecisionReason") or "the hook asks for confirmation"
        return "block", f"{why} (a pod has nobody to ask: not run)", ""
    if event == "PreToolUse" and isinstance(specific, dict) and "updatedInput" in specific:
        # Claude Code runs the call with the input the hook rewrote (a command made safe, a
        # path moved); a pod cannot, and running the model's own input ran what the hook
        # replaced. As with "ask": not run, and the model is told why.
        why = "the hook rewrites the call's input (updatedInput), which a pod cannot do"
        return "block", f"{why}: not run", ""
    if out.get("continue") is False and event in HALTS:
        # Claude Code: stop now, over any "block". Read as a block it kept the run going,
        # the opposite of what the hook asked (and again each round, to max_turns); a tool
        # hook's refused one call, and the model worked on.
        return "stop", str(out.get("stopReason") or ""), ""
    if out.get("decision") == "block" or out.get("continue") is False:
        reason = out.get("reason") or out.get("stopReason") or NO_REASON
        return "block", str(reason), ""
    context = specific.get("additionalContext", "") if isinstance(specific, dict) else ""
    return ("allow" if permission == "allow" else "ok"), "", str(context or "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


class Hooks(Interceptor):
    def __init__(
        self,
        config: HooksSection,
        *,
        pod: str,
        cwd: str,
        runner: Callable[[str], Awaitable[CommandRunner]],  # given the transcript it reads
        session: Callable[[], tuple[str, str]],  # (session id, its log's path)
        record: Callable[[HookRun], None],
        # Told a tool's own outcome before its PostToolUse hooks run (written to the log).
        keep: Callable[[ToolCall, ToolOutcome], None] | None = None,
    ) -> None:
        self.config = config
        self.keep = keep
        self.pod = pod
        self.cwd = cwd
        self.runner = runner
        self.session = session
        self.record = record
        self._kept_going: set[str] = set()  # runs a Stop hook kept going (stop_hook_active)
        self._halted: dict[str, str] = {}  # runs a tool hook stopped ("continue": false): why
        # Runs whose Stop hooks on the final answer are running, or were killed there by a
        # cancel or a stop: those hooks had their turn, `on_run_end` does not start them again.
        self._checking: set[str] = set()
        # Stop hooks of runs that did not finish, run in the background: a few at a time, as
        # handlers.MAX_BACKGROUND_HOOKS (cancelling 40 queued runs started 40 hooks at once).
        self._after_the_fact = asyncio.Semaphore(AFTER_THE_FACT)

    # --- the interceptor -------------------------------------------------------------------------

    async def before_tool(self, run_id: str, call: ToolCall) -> Deny | None:
        # tool_use_id as in Claude Code: a guard reading it failed (exit 1, a warning) and let
        # the call run; it also pairs a call's PreToolUse and PostToolUse.
        fields = {
            "tool_name": call.name,
            "tool_input": _decoded(call.arguments),
            "tool_use_id": call.id,
        }
        if run_id in self._halted:  # a call after the one a hook stopped the run at
            return Deny(f"not run: {self._halted[run_id]}")
        for run in await self.run("PreToolUse", fields, tool=call.name):
            if run.decision == "stop":
                return Deny(f"not run: {self._halt(run_id, run)}")
            if run.decision == "block":
                return Deny(f"blocked by a PreToolUse hook: {run.reason}")
        return None

    def _halt(self, run_id: str, run: "HookRun") -> str:
        """Claude Code's "continue": false from a tool hook: the run ends before its next
        model call (`before_request`). Returns why, as the run's error will say."""
        why = f"stopped by a {run.event} hook: {run.reason or 'continue: false'}"
        self._halted.setdefault(run_id, why)
        return self._halted[run_id]

    async def before_request(self, run_id: str, request: ModelRequest) -> ModelRequest | Refuse:
        why = self._halted.pop(run_id, None)
        return request if why is None else Refuse(why, outcome="cancelled")

    async def after_tool(self, run_id: str, call: ToolCall, outcome: ToolOutcome) -> ToolOutcome:
        fields = {
            "tool_name": call.name,
            "tool_input": _decoded(call.arguments),
            "tool_use_id": call.id,
            "tool_response": {"output": outcome.output, "is_error": outcome.is_error},
        }
        if self.keep is not None and any(matches(h, call.name) for h in self.config.PostToolUse):
            # A crash while the hooks run must not lose what the tool did (a command that
            # deployed, a file written): the restored result is this, not "interrupted".
            self.keep(call, outcome)
        for run in await self.run("PostToolUse", fields, tool=call.name):
            # The tool already ran: the model is told why a hook blocks, or what it adds
            # (Claude Code's additionalContext: "lint: 2 warnings in the file just written").
            if run.decision == "stop":
                outcome.output += f"\n[PostToolUse hook] {self._halt(run_id, run)}"
                continue
            said = run.reason if run.decision == "block" else run.context
            if said:
                outcome.output += f"\n[PostToolUse hook] {said}"
        return outcome

    async def stop(
        self, run_id: str, stop_hook_active: bool, last_round: bool = False
    ) -> str | None:
        """The Stop hooks on a final answer, before the run ends: the reason the first one
        that blocked gave (the run goes on), or None (it ends `finished`). `last_round`:
        max_turns is spent, so a block ends the run `limit_reached` instead."""
        fields = {"stop_hook_active": stop_hook_active, "run_id": run_id, "outcome": "finished"}
        self._checking.add(run_id)
        runs = await self.run("Stop", fields)  # (cancelled: the mark stays for on_run_end)
        block = None
        if not any(run.decision == "stop" for run in runs):
            block = next((run.reason for run in runs if run.decision == "block"), None)
        # A block at max_turns ends the run `limit_reached`: these hooks were that end's, and
        # the mark keeps `on_run_end` from running each of them a second time.
        if block is None or not last_round:
            self._checking.discard(run_id)
        if block is not None:
            self._kept_going.add(run_id)
        return block

    async def on_run_end(self, run_id: str, outcome: str) -> None:
        """After the fact, for runs that did not finish (cancelled, error, limit_reached): they
        end whatever the hooks say. A finished run had its say in `stop`."""
        kept_going = run_id in self._kept_going  # (a run a Stop hook kept going may run out)
        self._kept_going.discard(run_id)
        self._halted.pop(run_id, None)  # (it ended before its next model call: a cancel)
        if run_id in self._checking:
            # Cancelled (or the pod stopped) while its Stop hooks judged its final answer:
            # they were killed for that end. Started again here, each ran twice for one run,
            # and a stop waited out its 5 s grace on the very hook it had just killed.
            self._checking.discard(run_id)
            return
        if outcome != "finished":
            fields = {"stop_hook_active": kept_going, "run_id": run_id, "outcome": outcome}
            async with self._after_the_fact:
                await self.run("Stop", fields)

    async def before_compact(self, reason: str) -> None:
        await self.run("PreCompact", {"trigger": reason, "custom_instructions": ""})

    # --- the other events -------------------------------------------------------------------------

    async def user_prompt(self, prompt: str) -> tuple[str | None, str]:
        """(the reason it is refused or None, context to add)."""
        runs = await self.run("UserPromptSubmit", {"prompt": prompt})
        for run in runs:
            if run.decision == "block":
                return run.reason, ""
        return None, "\n".join(r.context for r in runs if r.context)

    async def session_start(self, source: str) -> str:
        runs = await self.run("SessionStart", {"source": source})
        return "\n".join(r.context for r in runs if r.context)

    # --- running one event's hooks ---------------------------------------------------------------

    def wants(self, event: str, tool: str | None = None) -> bool:
        return any(matches(h, tool) for h in getattr(self.config, event))

    async def run(
        self, event: str, fields: dict[str, Any], tool: str | None = None
    ) -> list[HookRun]:
        hooks = [h for h in getattr(self.config, event) if matches(h, tool)]
        if not hooks:
            return []
        session_id, transcript = self.session()
        payload = {
            "session_id": session_id,
            "transcript_path": transcript,
            "cwd": self.cwd,
            "hook_event_name": event,
            "pod": self.pod,
            **fields,
        }
        data = json.dumps(payload).encode()
        runs = []
        for hook in hooks:
            run = await self._one(event, hook, data, transcript)
            self.record(run)
            runs.append(run)
            # An allow does not stop the hooks after it: as in Claude Code, where every
            # matching hook runs and a deny beats an allow, one guard cannot wave a call
            # past another's block. Only a guard's block (or halt) ends the event's hooks:
            # the call or prompt is refused, nothing is left for the rest to judge. Any
            # other event's block refuses nothing (a Stop hook's: a later one may say
            # "continue": false, which beats it), and the hooks after it still run (skipped,
            # a SessionStart or PostToolUse hook's context never reached the model).
            if run.decision in ("block", "stop") and event in GUARDS:
                break
        return runs

    async def _one(self, event: str, hook: HookConfig, data: bytes, transcript: str) -> HookRun:
        start = time.monotonic()
        try:
            code, (stdout, out_unread), (stderr, err_unread) = await _run_command(
                await self.runner(transcript), hook.command, self.cwd, data, hook.timeout
            )
        except Exception as exc:  # the runner could not start it
            # A guard that never ran allowed nothing: it fails closed (as a cut JSON answer
            # does). Read as a warning, the model's own bash could switch every guard off,
            # say by moving the pod's pwd (the hooks' cwd) away; any other event warns.
            decision: Decision = "block" if event in GUARDS else "warning"
            return HookRun(event, hook.command, None, time.monotonic() - start, decision, str(exc))
        decision, reason, context = judge(
            event, code, stdout, stderr, out_unread + err_unread, stdout_cut=out_unread > 0
        )
        message = system_message(stdout) if code == 0 and not out_unread else ""
        if decision == "stop" and event in ("Stop", "SubagentStop") and reason and not message:
            message = reason  # Claude Code shows stopReason to the user; the run just ends
        return HookRun(
            event, hook.command, code, time.monotonic() - start, decision, reason, context, message
        )


Captured = tuple[str, int]  # what was kept of a stream (OUTPUT_LIMIT), bytes left unread


async def _run_command(
    runner: CommandRunner, command: str, cwd: str, stdin: bytes, timeout: float
) -> tuple[int | None, Captured, Captured]:
    """Run `sh -c command` with `stdin`; (exit code or None on timeout, stdout, stderr). The
    command and everything it started are gone when this returns."""
    feed = os.memfd_create("poddaemon-hook", os.MFD_CLOEXEC)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        os.write(feed, stdin)
        os.lseek(feed, 0, os.SEEK_SET)
        # Claude Code's CLAUDE_PROJECT_DIR: its documented way to name a project's hook script
        # ("$CLAUDE_PROJECT_DIR"/.claude/hooks/guard.sh); the pod's pwd is its project.
        env = {"CLAUDE_PROJECT_DIR": cwd}
        cmd = await runner.spawn(["/bin/sh", "-c", command], cwd, out_w, (feed, err_w), env)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in (feed, out_w, err_w):
            os.close(fd)
    readers = [asyncio.ensure_future(_read_all(fd)) for fd in (out_r, err_r)]
    code: int | None = None
    try:
        try:
            async with asyncio.timeout(timeout):
                code = await asyncio.shield(cmd.exited)
        except TimeoutError:
            code = None
    finally:
        with contextlib.suppress(Exception):
            await runner.kill(cmd)  # a timeout: the whole group; otherwise leftovers
    stdout, stderr = [await r for r in readers]
    return code, stdout, stderr


async def _read_all(fd: int) -> Captured:
    stream = asyncio.StreamReader(limit=2**16)
    transport = await read_pipe(fd, stream)
    data = bytearray()
    unread = 0
    try:
        while chunk := await stream.read(65536):
            room = OUTPUT_LIMIT - len(data)
            data += chunk[:room]
            unread += max(0, len(chunk) - room)
    finally:
        transport.close()
    return data.decode("utf-8", "replace"), unread


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return {"_raw_arguments": arguments}
