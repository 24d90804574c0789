"""A hand-written streamable-HTTP MCP server (no SDK) that answers in plain JSON bodies:
`python mcp_raw_http_server.py` prints its URL on stdout. Tools: `echo`, and `huge` whose answer
is one JSON body of `mb` MiB (a server that could fill the pod's memory: a JSON body, unlike an
SSE event, had no size limit), and `deny` whose call is answered 403. `--refuse STATUS`: every
message is answered with that HTTP status (a gateway that wants a token, a server that is down).
Tool `drop`, and with `--drop-first-list` the first tools/list, is answered by closing the
connection without a word; tool `cut` by closing it in the middle of its JSON body; tools
`sse_end` and `sse_cut` with an SSE stream of a notification only, ended, or cut short. Tool
`blank` is answered with neither result nor error (or with its arguments' `result`).
`--batch json|sse`: every answer is a JSON-RPC batch (a log notification, then the reply), in a
JSON body or in one SSE event. `--gzip`: every answer's body is gzip-compressed
(`Content-Encoding: gzip`), as a server behind a compressing proxy sends it."""

import gzip
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOOLS = [
    {"name": "echo", "inputSchema": {"type": "object"}},
    {"name": "huge", "inputSchema": {"type": "object", "properties": {"mb": {"type": "integer"}}}},
    {"name": "deny", "inputSchema": {"type": "object"}},
    {"name": "drop", "inputSchema": {"type": "object"}},
    {"name": "cut", "inputSchema": {"type": "object"}},
    {"name": "sse_end", "inputSchema": {"type": "object"}},
    {"name": "sse_cut", "inputSchema": {"type": "object"}},
    {"name": "blank", "inputSchema": {"type": "object"}},
]
REFUSE = int(sys.argv[sys.argv.index("--refuse") + 1]) if "--refuse" in sys.argv else None
drop_list = "--drop-first-list" in sys.argv
BATCH = sys.argv[sys.argv.index("--batch") + 1] if "--batch" in sys.argv else None
GZIP = "--gzip" in sys.argv


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # no server-initiated stream
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_DELETE(self) -> None:
        self.do_GET()

    def refuse(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", "6")
        self.end_headers()
        self.wfile.write(b"denied")

    def drop(self) -> None:
        self.close_connection = True  # nothing written: the client sees the connection close

    def do_POST(self) -> None:
        global drop_list
        msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if REFUSE is not None:
            self.refuse(REFUSE)
            return
        if "id" not in msg:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        method, id_ = msg.get("method"), msg["id"]
        result: Any = None
        if method == "initialize":
            result = {
                "protocolVersion": msg["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "raw", "version": "1"},
            }
        elif method == "tools/list" and drop_list:
            drop_list = False
            self.drop()
            return
        elif method == "tools/list":
            result = {"tools": TOOLS}
        elif method == "ping":
            result = {}
        elif method == "tools/call" and msg["params"]["name"] == "deny":
            self.refuse(403)
            return
        elif method == "tools/call" and msg["params"]["name"] == "drop":
            self.drop()
            return
        elif method == "tools/call" and msg["params"]["name"] in ("sse_end", "sse_cut"):
            cut = msg["params"]["name"] == "sse_cut"
            note = {"jsonrpc": "2.0", "method": "notifications/message",
                    "params": {"level": "info", "data": "working"}}  # fmt: skip
            event = b"event: message\ndata: " + json.dumps(note).encode() + b"\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if cut:  # chunked, its last chunk never sent: a stream cut short
                self.send_header("Transfer-Encoding", "chunked")
                event = b"%x\r\n%b\r\n" % (len(event), event)
            self.end_headers()  # else the stream ends where the connection does
            self.wfile.write(event)
            self.drop()
            return
        elif method == "tools/call" and msg["params"]["name"] == "cut":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"jsonrpc": "2.0", ')
            self.drop()
            return
        elif method == "tools/call" and msg["params"]["name"] == "blank":
            result = "blank"
        elif method == "tools/call":
            params = msg["params"]
            mb = params.get("arguments", {}).get("mb", 0) if params["name"] == "huge" else 0
            text = "x" * (mb << 20) if mb else "echoed"
            result = {"content": [{"type": "text", "text": text}]}
        if result is None:
            reply: Any = {"jsonrpc": "2.0", "id": id_, "error": {"code": -32601, "message": "no"}}
        elif result == "blank":  # its arguments' `result` if any: one that is not an object
            reply = {"jsonrpc": "2.0", "id": id_, **msg["params"].get("arguments", {})}
        else:
            reply = {"jsonrpc": "2.0", "id": id_, "result": result}
        if BATCH is not None:
            note = {"level": "info", "data": "answering"}
            reply = [{"jsonrpc": "2.0", "method": "notifications/message", "params": note}, reply]
        body = json.dumps(reply).encode()
        content_type = "application/json"
        if BATCH == "sse":
            body = b"event: message\r\ndata: " + body + b"\r\n\r\n"
            content_type = "text/event-stream"
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if GZIP:
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"http://127.0.0.1:{server.server_address[1]}/mcp", flush=True)
server.serve_forever()
