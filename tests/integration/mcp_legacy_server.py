"""A hand-written stdio MCP server of the 2025-06-18 era (no SDK): `initialize`, `tools/list`,
`tools/call`, and -32601 for anything else, as the servers users already run answer. Checks that
pods talk to servers that predate the SDK's newer protocol revisions."""

import json
import os
import sys
import time

TOOLS = [
    {
        "name": "shout",
        "description": "Upper-case the text.",
        "inputSchema": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
    {
        "name": "nap",
        "description": "Sleep, then answer (one request at a time, as this server reads them).",
        "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}}},
    },
    {
        "name": "chat",
        "description": "Work `seconds`, logging progress every 0.1 s, reading nothing meanwhile.",
        "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}}},
    },
    {
        "name": "hangup",
        "description": "Close stdout and live on: no answer ever comes.",
        "inputSchema": {"type": "object"},
    },
    {
        "name": "heap",
        "description": "Answer with a text of `mb` MiB.",
        "inputSchema": {"type": "object", "properties": {"mb": {"type": "integer"}}},
    },
    {
        "name": "tree",
        "description": "Answer with a result whose structuredContent nests `depth` objects.",
        "inputSchema": {"type": "object", "properties": {"depth": {"type": "integer"}}},
    },
    {
        "name": "blank",
        "description": "Answer with a message of the call's id with neither result nor error "
        "(or with the arguments' `result`).",
        "inputSchema": {"type": "object"},
    },
    {
        "name": "oops",
        "description": "Answer with a JSON-RPC error of the given code, at once.",
        "inputSchema": {"type": "object", "properties": {"code": {"type": "integer"}}},
    },
]


# `--bad-schemas`: tools whose input schemas a provider refuses (and the SDK's strict parse
# of a tools/list with them fails), as servers in the wild list them.
if "--bad-schemas" in sys.argv[1:]:
    TOOLS += [
        {"name": "listy", "inputSchema": {"type": "array", "items": {"type": "string"}}},
        {"name": "typo", "inputSchema": {"type": "object", "properties": {"n": {"type": "int"}}}},
        {"name": "loose", "inputSchema": {"type": "object", "properties": ["text"]}},
    ]


# `--bare-arrays`: a tool whose arrays do not say what their items are (valid JSON Schema that
# OpenAI refuses, and servers in the wild list).
if "--bare-arrays" in sys.argv[1:]:
    TOOLS.append({
        "name": "tagger",
        "inputSchema": {
            "type": "object",
            "properties": {
                "tags": {"type": "array"},
                "more": {"type": "object", "properties": {"ids": {"type": ["array", "null"]}}},
            },
        },
    })  # fmt: skip


# `--twins`: a tool listed twice, and two whose names are the same once made safe.
if "--twins" in sys.argv[1:]:
    TOOLS += [dict(TOOLS[0]), {"name": "a.b"}, {"name": "a_b"}]


# `--many N`: N more tools (echo_0 ... echo_<N-1>), as servers that wrap a whole API list them.
if "--many" in sys.argv[1:]:
    count = int(sys.argv[sys.argv.index("--many") + 1])
    TOOLS += [{"name": f"echo_{i}", "inputSchema": {"type": "object"}} for i in range(count)]


# `--stderr-flood MB`: that many megabytes of 1 KiB lines on stderr before anything else.
if "--stderr-flood" in sys.argv[1:]:
    megabytes = int(sys.argv[sys.argv.index("--stderr-flood") + 1])
    for _ in range(megabytes * 1024):
        sys.stderr.write("chatter " * 127 + "\n")
    sys.stderr.flush()


# `--deep-schema N`: one more tool whose input schema nests N objects (a listing deeper than
# JSON parsers go; written by hand, as json.dumps would recurse too).
deep_schema = 0
if "--deep-schema" in sys.argv[1:]:
    deep_schema = int(sys.argv[sys.argv.index("--deep-schema") + 1])


# `--batch-replies`: every reply is sent in a JSON-RPC batch (an array, legal in JSON-RPC 2.0
# and in MCP 2025-03-26), after a log notification in the same batch.
batch_replies = "--batch-replies" in sys.argv[1:]


def reply(id_: object, result: object = None, error: object = None) -> None:
    msg = {"jsonrpc": "2.0", "id": id_}
    if "--no-jsonrpc" in sys.argv:  # replies without `"jsonrpc": "2.0"`, as some servers send
        del msg["jsonrpc"]
    msg.update({"error": error} if error is not None else {"result": result})
    if batch_replies:
        note = {"level": "info", "data": "answering"}
        log = {"jsonrpc": "2.0", "method": "notifications/message", "params": note}
        sys.stdout.write(json.dumps([log, msg]) + "\n")
    else:
        sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


# `--refuse-first-initialize`: the first `initialize` gets an error, as a server of a newer
# revision would answer it; a client must then negotiate on the same pipes.
refuse = "--refuse-first-initialize" in sys.argv[1:]

# `--banner`: lines on stdout that are no JSON-RPC, one of them not even UTF-8, before any
# reply (servers print banners and progress there); a client skips them.
if "--banner" in sys.argv[1:]:
    sys.stdout.buffer.write(b'legacy server 1.0\n{"log": "\xa9 ACME"}\nready.\n')
    sys.stdout.buffer.flush()

for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue  # notifications/initialized and the like
    method, params = msg.get("method"), msg.get("params") or {}
    if method == "initialize" and refuse:
        refuse = False
        reply(msg["id"], error={"code": -32600, "message": "initialize refused (test)"})
    elif method == "initialize":
        result = {
            "protocolVersion": "2025-06-18",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "legacy", "version": "1"},
        }
        # `--no-server-info`, `--unknown-version`: answers no client's session can take on.
        if "--no-server-info" in sys.argv[1:]:
            del result["serverInfo"]
        if "--unknown-version" in sys.argv[1:]:
            result["protocolVersion"] = "1999-01-01"
        # `--bad-capabilities`: well-formed at a glance, refused by the SDK's session.
        if "--bad-capabilities" in sys.argv[1:]:
            result["capabilities"] = {"tools": "yes"}
        reply(msg["id"], result)
    elif method == "tools/list" and deep_schema:
        nested = '{"type": "object", "properties": {"x": ' * deep_schema + "{}" + "}}" * deep_schema
        listed = json.dumps(TOOLS)[:-1] + f', {{"name": "deep", "inputSchema": {nested}}}]'
        rid = json.dumps(msg["id"])
        sys.stdout.write(f'{{"jsonrpc": "2.0", "id": {rid}, "result": {{"tools": {listed}}}}}\n')
        sys.stdout.flush()
    elif method == "tools/list" and "--blank-list" in sys.argv:  # neither result nor error
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg["id"]}) + "\n")
        sys.stdout.flush()
    elif method == "tools/list":  # `--tools-not-a-list`: a listing no client can read
        listing = {"tools": "nope" if "--tools-not-a-list" in sys.argv else TOOLS}
        if "--same-cursor" in sys.argv:  # ignores the cursor, and always says more follow
            listing["nextCursor"] = "more"
        reply(msg["id"], listing)
    elif method == "tools/call" and params.get("name") == "shout":
        # `--bad-notes N`: first N progress notifications no client can validate.
        if "--bad-notes" in sys.argv:
            for k in range(int(sys.argv[sys.argv.index("--bad-notes") + 1])):
                bad = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"n": k}}
                sys.stdout.write(json.dumps(bad) + "\n")
            sys.stdout.flush()
        # `--stdout-junk N`: first N lines of debug output on stdout, each flushed, as a
        # misconfigured logger writes them.
        if "--stdout-junk" in sys.argv:
            for k in range(int(sys.argv[sys.argv.index("--stdout-junk") + 1])):
                sys.stdout.write(f"DEBUG shout: step {k}\n")
                sys.stdout.flush()
        text = str(params.get("arguments", {}).get("text", ""))
        reply(msg["id"], {"content": [{"type": "text", "text": text.upper()}], "isError": False})
    elif method == "tools/call" and params.get("name") == "hangup":
        os.close(1)  # no answer can come any more, though the server lives on
        time.sleep(600)
    elif method == "tools/call" and params.get("name") == "tagger":
        tags = ",".join(map(str, params.get("arguments", {}).get("tags", [])))
        reply(msg["id"], {"content": [{"type": "text", "text": tags}], "isError": False})
    elif method == "tools/call" and params.get("name") == "heap":
        text = "x" * (int(params.get("arguments", {}).get("mb", 1)) << 20)
        reply(msg["id"], {"content": [{"type": "text", "text": text}], "isError": False})
    elif method == "tools/call" and params.get("name") == "tree":
        depth = int(params.get("arguments", {}).get("depth", 1))
        nested = '{"child": ' * depth + "null" + "}" * depth  # json.dumps would recurse
        content = json.dumps([{"type": "text", "text": "a tree"}])
        result = f'{{"content": {content}, "structuredContent": {nested}}}'
        rid = json.dumps(msg["id"])
        sys.stdout.write(f'{{"jsonrpc": "2.0", "id": {rid}, "result": {result}}}\n')
        sys.stdout.flush()
    elif method == "tools/call" and params.get("name") == "blank":
        answer = {"jsonrpc": "2.0", "id": msg["id"]}
        answer.update(params.get("arguments", {}))  # {"result": null}: a result not an object
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    elif method == "tools/call" and params.get("name") == "oops":
        code = int(params.get("arguments", {}).get("code", -32000))
        reply(msg["id"], error={"code": code, "message": f"backend down ({code})"})
    elif method == "tools/call" and params.get("name") == "nap":
        time.sleep(float(params.get("arguments", {}).get("seconds", 0)))
        reply(msg["id"], {"content": [{"type": "text", "text": "rested"}], "isError": False})
    elif method == "tools/call" and params.get("name") == "chat":
        end = time.monotonic() + float(params.get("arguments", {}).get("seconds", 0))
        while time.monotonic() < end:
            note = {"level": "info", "data": "working"}
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "method": "notifications/message",
                                         "params": note}) + "\n")  # fmt: skip
            sys.stdout.flush()
            time.sleep(0.1)
        reply(msg["id"], {"content": [{"type": "text", "text": "worked"}], "isError": False})
    else:  # `ping` too: a server of that era need not know it
        reply(msg["id"], error={"code": -32601, "message": f"method not found: {method}"})
