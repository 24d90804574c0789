"""The spawn-tree tools (SPEC §9): `spawn_pod`, `send_to_pod`, `wait_pods`, `list_pods`,
`stop_pod`. Thin: each checks its arguments and asks the pod's host (poddaemon/spawn.py), whose
ToolErrors are what the model sees. Schemas stay small: they go into every request."""

from typing import Any

import msgspec

from poddaemon.tools.base import PodHost, ToolContext, ToolError, ToolOutcome, schema

_json = msgspec.json.Encoder()


def _host(ctx: ToolContext) -> PodHost:
    if ctx.host is None:
        raise ToolError("this pod cannot manage child pods")
    return ctx.host


def _ok(value: Any, summary: str) -> ToolOutcome:
    return ToolOutcome(output=_json.encode(value).decode(), summary=summary)


_SCOPE = {
    "type": "array",
    "description": "[{target, permission: read|write, recursive?}], inside your own scope",
    "items": {
        "type": "object",
        "properties": {
            "target": {"type": "string"},
            "permission": {"type": "string", "enum": ["read", "write"]},
            "recursive": {"type": "boolean"},
        },
        "required": ["target", "permission"],
    },
}

_SPAWN_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "unique pod name [a-z0-9_-]"},
        "task": {"type": "string", "description": "its first run's input"},
        "instruction": {"type": "string"},
        "tools": {
            "type": "array",
            "items": {"type": "string"},
            "description": "only these of your tools (default: all): builtin names, MCP tools "
            "as <server>__<tool>, <server>__* for all of a server's",
        },
        "scope": _SCOPE,
        "pwd": {"type": "string"},
        "model": {"type": "string"},
        "budget_tokens": {"type": "integer"},
    },
    "required": ["name", "task", "scope"],
}

_WAIT_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "pods": {"type": "array", "items": {"type": "string"}},
        "timeout_s": {"type": "number"},
    },
    "required": [],
}


class SpawnPod:
    name = "spawn_pod"
    description = "Start a child pod on a task with part of your scope; it reports back to you."
    parameters = _SPAWN_PARAMS

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        result = await _host(ctx).spawn(args)
        return _ok(result, f"spawned {result['name']}")


class SendToPod:
    name = "send_to_pod"
    description = "Give a child pod more input (a run; steer: into its active run)."
    parameters = schema(
        {"pod": ("string", "child name"), "message": ("string", "input")},
        {"mode": ("string", "queue (default) or steer")},
    )

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        mode = args.get("mode", "queue")
        if mode not in ("queue", "steer"):
            raise ToolError("mode must be queue or steer")
        result = await _host(ctx).send(args["pod"], args["message"], mode)
        return _ok(result, f"sent to {args['pod']}")


class WaitPods:
    name = "wait_pods"
    description = "Wait until child pods finished the runs you gave; their outcome and text."
    parameters = _WAIT_PARAMS

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        pods = args.get("pods")
        if pods is not None and not all(isinstance(p, str) for p in pods):
            raise ToolError("pods must be a list of names")
        timeout = float(args.get("timeout_s", 600))
        result = await _host(ctx).wait(pods, max(0.0, timeout))
        return _ok(result, f"{len(result)} pods")


class ListPods:
    name = "list_pods"
    description = "Your child pods: name, state, scope, spent tokens."
    parameters = schema({})

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        result = await _host(ctx).list_children()
        return _ok(result, f"{len(result)} children")


class StopPod:
    name = "stop_pod"
    description = "Stop one of your child pods and its own children."
    parameters = schema({"pod": ("string", "child name")})

    async def run(self, ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
        result = await _host(ctx).stop(args["pod"])
        return _ok(result, f"stopped {args['pod']}")
