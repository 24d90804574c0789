"""Incremental rendering equals rendering from scratch, call after call.

A property test: random histories (tool batches with user messages and notes arriving between
their results, empty assistant turns, errors) grow call by call, sometimes replaced (a
compaction) or cut back; after every call the incremental order and each adapter's incremental
body must equal the pure, from-scratch functions' output.
"""

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from poddaemon.history import AssistantMessage, Item, SystemNote, ToolCall, ToolResult, UserMessage
from poddaemon.llm import anthropic, openai_chat, openai_responses, order_items
from poddaemon.llm.incremental import IncrementalOrder
from poddaemon.llm.types import ModelRequest, ToolSpec

_ids = iter(range(10**9))


@st.composite
def _chunk(draw: st.DrawFn) -> list[Item]:
    """A few history items: a user input, or an assistant turn with its tool batch, user
    items interleaved with the results, maybe results missing (a batch still running)."""
    kind = draw(st.sampled_from(["user", "note", "text", "empty", "tools"]))
    if kind == "user":
        return [UserMessage(text=draw(st.text(max_size=5)))]
    if kind == "note":
        return [SystemNote(text=draw(st.text(max_size=5)))]
    if kind == "text":
        return [AssistantMessage(text=draw(st.text(min_size=1, max_size=5)))]
    if kind == "empty":
        return [AssistantMessage(text="")]
    n = draw(st.integers(1, 3))
    calls = tuple(
        ToolCall(id=f"c{next(_ids)}", name="t", arguments=draw(st.sampled_from(["{}", "", "[1]"])))
        for _ in range(n)
    )
    out: list[Item] = [AssistantMessage(text=draw(st.sampled_from(["", "x"])), tool_calls=calls)]
    answered = draw(st.integers(0, n))
    for call in calls[:answered]:
        if draw(st.booleans()):
            out.append(UserMessage(text="between"))
        out.append(
            ToolResult(
                call_id=call.id,
                name="t",
                output=draw(st.text(max_size=3)),
                is_error=draw(st.booleans()),
            )
        )
    return out


# Each step: grow by a chunk (most often), replace the history (a compaction), or cut it back.
_step = st.one_of(
    _chunk().map(lambda c: ("grow", c)),
    _chunk().map(lambda c: ("grow", c)),
    _chunk().map(lambda c: ("replace", c)),
    st.integers(0, 5).map(lambda k: ("cut", k)),
)


def _histories(steps: list[tuple[str, object]]) -> list[list[Item]]:
    """The items of each call: a new list each time, sharing the item objects as the pod's
    `list(state.history)` does."""
    history: list[Item] = []
    out = []
    for op, arg in steps:
        if op == "grow":
            assert isinstance(arg, list)
            history = history + arg
        elif op == "replace":
            assert isinstance(arg, list)
            history = [UserMessage(text="summary"), *arg]
        else:
            assert isinstance(arg, int)
            history = history[: max(0, len(history) - arg)]
        out.append(list(history))
    return out


def _req(items: list[Item]) -> ModelRequest:
    tool = ToolSpec(name="t", description="d", parameters={"type": "object"})
    return ModelRequest(system="sys", items=items, tools=[tool], max_tokens=9, temperature=0.5)


@settings(max_examples=300, deadline=None)
@given(st.lists(_step, min_size=1, max_size=25))
def test_incremental_order_equals_order_items(steps: list[tuple[str, object]]) -> None:
    inc = IncrementalOrder()
    for items in _histories(steps):
        placed_before = list(inc.placed)
        extended = inc.advance(items)
        assert inc.placed + inc.deferred == order_items(items)
        if extended:  # placed items never move
            assert inc.placed[: len(placed_before)] == placed_before


@settings(max_examples=200, deadline=None)
@given(st.lists(_step, min_size=1, max_size=25))
def test_incremental_bodies_equal_full_renders(steps: list[tuple[str, object]]) -> None:
    chat, resp, anth = (
        openai_chat.new_renderer(),
        openai_responses.new_renderer(),
        anthropic.new_renderer(),
    )
    for items in _histories(steps):
        req = _req(items)
        full_chat = openai_chat.render_request(req, "m", max_tokens_field="max_tokens")
        body = openai_chat.encode_request(req, "m", chat, max_tokens_field="max_tokens")
        assert json.loads(body) == full_chat
        full_resp = openai_responses.render_request(req, "m")
        assert json.loads(openai_responses.encode_request(req, "m", resp)) == full_resp
        expected = anthropic.render_request(req, "m")
        assert anthropic.render_request(req, "m", anth) == expected
        # The kept state was not changed by the call: the same items render the same again.
        assert anthropic.render_request(req, "m", anth) == expected


def test_encoded_body_is_the_sdk_json() -> None:
    """Byte for byte what the SDKs send for the same dict (non-ASCII kept as UTF-8)."""
    req = _req([UserMessage(text="héllo ☃"), AssistantMessage(text="ok")])
    body = openai_chat.encode_request(req, "m", openai_chat.new_renderer())
    full = openai_chat.render_request(req, "m")
    assert msgspec.json.decode(body) == full
    assert "héllo ☃".encode() in body
