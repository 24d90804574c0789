"""MCP tools as pod tools: naming (`<server>__<tool>`), schemas, and results as tool outcomes."""

import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from poddaemon.config.manifest import MCP_SEP
from poddaemon.tools.base import ToolContext, ToolOutcome

MAX_NAME = 64  # what OpenAI and Anthropic accept for a tool name
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")

Caller = Callable[[str, dict[str, Any]], Awaitable[ToolOutcome]]


def offered_name(server: str, tool: str) -> str | None:
    """The name the model sees for `tool` of `server`, or None when no provider would take it.

    MCP allows dots and more in tool names; providers take `[A-Za-z0-9_-]{1,64}`.
    """
    name = f"{server}{MCP_SEP}{_UNSAFE.sub('_', tool)}"
    return name if tool and len(name) <= MAX_NAME else None


class McpTool:
    """One tool of one MCP server, with the pod's builtin tool interface (`poddaemon.tools`)."""

    # The server validates its own arguments against its full JSON Schema; the pod's flat
    # checker (tools.base.check_args) would refuse valid nested or union-typed arguments.
    validates_own_args = True

    def __init__(
        self, name: str, remote: str, description: str, parameters: dict[str, Any], call: Caller
    ) -> None:
        self.name = name
        self.remote = remote  # the server's own name for it
        self.description = description
        self.parameters = parameters
        self._call = call

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        return await self._call(self.remote, args)

    def __repr__(self) -> str:
        return f"McpTool({self.name!r})"


_JSON_TYPES = frozenset(("object", "array", "string", "number", "integer", "boolean", "null"))


def schema_problem(schema: Any) -> str | None:
    """Why a provider would refuse `schema` as a tool's parameters, or None. Such a tool must
    not be offered: the provider refuses the whole request, so every run of the pod would fail.
    Not the whole metaschema: the shapes servers get wrong (absent is fine: no parameters)."""
    if schema is None:
        return None
    if not isinstance(schema, dict):
        return f"its inputSchema is not an object but {type(schema).__name__} {schema!r:.40}"
    if schema.get("type", "object") != "object":
        return f"its inputSchema has type {schema['type']!r:.40}, not 'object'"
    return _subschema_problem(schema, "inputSchema")


# Where a schema holds subschemas (JSON Schema's keywords): by name, in a list, one; and `items`,
# a schema or (the older tuple form) a list of them.
_NAMED_SUBSCHEMAS = ("properties", "$defs", "definitions", "patternProperties")
_LISTED_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE_SUBSCHEMA = ("additionalProperties", "not")


def _is_type(name: Any) -> bool:
    return isinstance(name, str) and name in _JSON_TYPES


def _subschema_problem(schema: Any, where: str) -> str | None:
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} is not a schema: {schema!r:.40}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not (kinds and all(_is_type(k) for k in kinds)):
        return f"{where}.type {kind!r:.40} is not a JSON type"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{where}.required is not a list of names"
    subs: list[tuple[str, Any]] = []
    for key in _NAMED_SUBSCHEMAS:
        if not isinstance(value := schema.get(key, {}), dict):
            return f"{where}.{key} is not an object"
        subs += [(f"{where}.{key}.{name}", sub) for name, sub in value.items()]
    for key in _LISTED_SUBSCHEMAS:
        if not isinstance(value := schema.get(key, []), list):
            return f"{where}.{key} is not a list"
        subs += [(f"{where}.{key}[{i}]", sub) for i, sub in enumerate(value)]
    if isinstance(items := schema.get("items"), list):  # the older tuple form
        subs += [(f"{where}.items[{i}]", sub) for i, sub in enumerate(items)]
    elif items is not None:
        subs.append((f"{where}.items", items))
    for key in _ONE_SUBSCHEMA:
        if key in schema:
            subs.append((f"{where}.{key}", schema[key]))
    for path, sub in subs:
        if problem := _subschema_problem(sub, path):
            return problem
    return None


def input_schema(schema: Any) -> dict[str, Any]:
    """The tool's input schema as the providers want it: always an object schema, and every
    array with an `items` schema (`{}`, any, where it had none: valid JSON Schema that OpenAI
    refuses, the whole request with it, and that servers list often)."""
    out = _with_items(schema) if isinstance(schema, dict) else {}
    out.setdefault("type", "object")
    out.setdefault("properties", {})
    return out


def _with_items(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose arrays, at every depth, all say what their items are."""
    out = dict(schema)
    kind = out.get("type")
    if (kind == "array" or (isinstance(kind, list) and "array" in kind)) and not (
        "items" in out or "prefixItems" in out
    ):
        out["items"] = {}
    for key in _NAMED_SUBSCHEMAS:
        if isinstance(value := out.get(key), dict):
            out[key] = {k: _with_items(v) if isinstance(v, dict) else v for k, v in value.items()}
    for key in (*_LISTED_SUBSCHEMAS, "items"):
        if isinstance(value := out.get(key), list):
            out[key] = [_with_items(v) if isinstance(v, dict) else v for v in value]
    for key in ("items", *_ONE_SUBSCHEMA):
        if isinstance(value := out.get(key), dict):
            out[key] = _with_items(value)
    return out


def outcome(result: Any) -> ToolOutcome:
    """A `CallToolResult` as the text the model reads; `isError` makes it a tool error."""
    parts = [_block_text(block) for block in getattr(result, "content", None) or ()]
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(msgspec.json.encode(structured).decode())
    text = "\n".join(parts)
    if getattr(result, "is_error", False):
        return error(text or "the tool failed without a message")
    return ToolOutcome(output=text)


def error(text: str) -> ToolOutcome:
    first = text.split("\n", 1)[0]
    return ToolOutcome(output=text, is_error=True, summary=first[:100])


def _block_text(block: Any) -> str:
    kind = getattr(block, "type", "")
    if kind == "text":
        return str(block.text)
    if kind in ("image", "audio"):
        size = len(getattr(block, "data", "")) * 3 // 4  # base64
        return f"[{kind}: {getattr(block, 'mime_type', '?')}, about {size} bytes, not shown]"
    if kind == "resource_link":
        return f"[resource: {block.uri}]"
    if kind == "resource":
        res = block.resource
        text = getattr(res, "text", None)
        if text is not None:
            return str(text)
        size = len(getattr(res, "blob", "")) * 3 // 4
        return f"[resource {res.uri}: {getattr(res, 'mime_type', None) or '?'}, about {size} bytes]"
    return f"[{kind or 'unknown'} content, not shown]"
