"""Compaction's pure rules: when the context is too big, what the summary request asks, and what
the new session's history keeps. No I/O: the machine decides with these, the executor only
makes the summary call and writes the new session.

The new history (SPEC §3): the summary, then verbatim the current run's input (with the
notifications and context it started with) and its steers, then the list of live children, then
the last `compact_retained_turns` rounds of the run (notifications the model answered before
them are summarized, not repeated). A round starts at an assistant message and carries
its tool results, so a call is never split from its result. Inputs not yet delivered to the model
are not history at all: they stay pending and reach the first request after the compaction.
"""

import msgspec

from poddaemon.history import AssistantMessage, Item, SystemNote, ToolResult, Usage, UserMessage

SHRINK_MIN = 0.05  # a compaction that shrinks the context less is not repeated in that run
BREAKER_FAILURES = 3  # failures in a row that turn automatic compaction off
TRIM_SHARE = 4  # a summary request refused as too long drops at least 1/4 of its history
SUMMARY_TAG = "<compaction-summary>"
# How the error of a run ends when the provider refused its request as too long (compaction on):
# the log's mark that the next run must compact first, restarted or not.
CONTEXT_FULL = "context full: "
CHILDREN_TAG = "<live-children>"

SUMMARY_PROMPT = """\
Your context is about to be compacted: everything above will be replaced by the summary you \
write now. Do not call any tool. Write a structured summary that lets you continue the work \
without the original conversation, with these sections:

## Original task
What was asked, by whom, with every constraint and acceptance criterion (quote exact wording).
## Work done
What you did, step by step, naming every file path, command, function and identifier involved.
## Discoveries
Facts learned, errors met and how they were resolved, decisions taken and why.
## Current state
Where the work stands right now; what the last tool calls did.
## Open items
What is still to do, in order, and any question waiting for an answer.

Be specific and complete; leave out pleasantries."""

TRIMMED_NOTE = (
    "[The oldest part of this conversation was left out here: it did not fit the model's "
    "context window.]"
)


def context_tokens(usage: Usage, provider_kind: str) -> int:
    """The size of the request a call's usage reports. Anthropic's `input` excludes cached
    tokens; the OpenAI formats count them in `input` already."""
    if provider_kind == "anthropic":
        return usage.input + usage.cache_read + usage.cache_write
    return usage.input


_encoder = msgspec.json.Encoder()


def estimate_tokens(system: str, items: list[Item]) -> int:
    """bytes/4 of the request's content: the estimate used before the first real usage."""
    return (len(system.encode()) + len(_encoder.encode(items))) // 4


def estimated_usage(system: str, items: list[Item], answer: Item) -> Usage:
    """What a call that reported no usage cost, by the same bytes/4 rule: its request, and the
    answer it gave."""
    return Usage(input=estimate_tokens(system, items), output=len(_encoder.encode(answer)) // 4)


def summary_request_items(history: list[Item]) -> list[Item]:
    """The summary call's items: the history as it is, then the instruction to summarize."""
    return [*history, UserMessage(text=SUMMARY_PROMPT)]


def trimmed_summary_request(items: list[Item]) -> list[Item] | None:
    """The summary request `items` (see `summary_request_items`) without its oldest rounds,
    for a provider that refused it as too long; None when only one round is left. With the
    pod's own model summarizing, the request is the very context that outgrew the window:
    sent again whole it failed every time, and the breaker turned compaction off for good.
    Each call drops at least 1/TRIM_SHARE of the history's bytes, whole rounds (an assistant
    message with its tool results, and the inputs just before it), so a call never loses its
    result; the note that opens what is left tells the summarizer its start is missing (and
    makes the request start in the user role, as Anthropic's API requires). An earlier
    compaction's summary at the start is kept: it stands for everything before it, in little."""
    note = UserMessage(text=TRIMMED_NOTE)
    history, prompt = items[:-1], items[-1]
    kept = history[:1] if history and _is_summary(history[0]) else []
    history = history[len(kept) :]
    if history and history[0] == note:
        history = history[1:]
    cuts: list[int] = []
    for i, item in enumerate(history):
        if isinstance(item, AssistantMessage):
            start = i
            while start > 0 and not isinstance(history[start - 1], AssistantMessage | ToolResult):
                start -= 1  # the round's input, steers and notes go with it
            if start > 0:
                cuts.append(start)
    if not cuts:
        return None
    sizes = [len(_encoder.encode(item)) for item in history]
    goal = sum(sizes) / TRIM_SHARE
    cut = next((c for c in cuts if sum(sizes[:c]) >= goal), cuts[-1])
    return [*kept, note, *history[cut:], prompt]


def _is_summary(item: Item) -> bool:
    return isinstance(item, UserMessage) and item.text.startswith(SUMMARY_TAG)


def summary_item(summary: str) -> UserMessage:
    return UserMessage(
        text=(
            f"{SUMMARY_TAG}\nThe conversation so far was compacted. Your summary of it:\n\n"
            f"{summary.strip()}\n</compaction-summary>"
        )
    )


def children_item(children: list[str]) -> SystemNote:
    lines = "\n".join(f"- {c}" for c in children)
    return SystemNote(text=f"{CHILDREN_TAG}\nYour live child pods:\n{lines}\n</live-children>")


def _is_children_note(item: Item) -> bool:
    return isinstance(item, SystemNote) and item.text.startswith(CHILDREN_TAG)


def retained_start(items: list[Item], turns: int) -> int:
    """Index in `items` where the last `turns` rounds begin (len(items) for none)."""
    if turns <= 0:
        return len(items)
    starts = [i for i, item in enumerate(items) if isinstance(item, AssistantMessage)]
    if not starts:
        return len(items)
    return starts[-turns] if len(starts) >= turns else starts[0]


def build_history(
    history: list[Item],
    run_from: int | None,
    summary: str,
    retained_turns: int,
    children: list[str],
) -> tuple[list[Item], int | None]:
    """The compacted history and where the active run's items start in it (None when idle).

    `run_from`: index of the active run's first item in `history` (None: no active run, so
    the last rounds of the whole history are kept and no input is carried)."""
    base = 0 if run_from is None else min(run_from, len(history))
    scope = history[base:]
    tail_at = retained_start(scope, retained_turns)
    inputs: list[Item] = []
    if run_from is not None:
        # What the run started from (its input, the notifications that woke it, hook context)
        # and every steer stay verbatim; a notification the model has answered since is the
        # summary's to keep. Kept verbatim, each one also survived every later compaction of
        # the run: a run fed reports (CI, its children) outgrew any threshold, a summary call
        # every round.
        first_round = next(
            (i for i, item in enumerate(scope) if isinstance(item, AssistantMessage)), len(scope)
        )
        inputs = [
            item
            for i, item in enumerate(scope[:tail_at])
            if isinstance(item, UserMessage)
            or (isinstance(item, SystemNote) and i < first_round and not _is_children_note(item))
        ]
    out: list[Item] = [summary_item(summary), *inputs]
    if children:
        out.append(children_item(children))
    out.extend(scope[tail_at:])
    return out, (1 if run_from is not None else None)


def summarizable(history: list[Item], run_from: int | None, retained_turns: int) -> bool:
    """Whether a compaction would replace anything with its summary. Not when every item is
    one it keeps (the rounds `retained_turns` keeps are all there is, and the inputs kept
    verbatim): the summary could only make the context larger, a call paid for nothing."""
    if run_from is not None and min(run_from, len(history)) > 0:
        return True  # what came before the active run
    kept, _ = build_history(history, run_from, "", retained_turns, [])
    return len(kept) - 1 < len(history)  # (the summary's own item aside)


def shrink(before: int, after: int) -> float:
    """How much smaller the context got (0.1 = by 10 %); negative if it grew."""
    return 1.0 - after / before if before > 0 else 0.0
