"""The pure parts of MCP support: `[[mcp.servers]]` validation, env expansion, tool names and
results. (The servers themselves are exercised in tests/integration/test_mcp.py.)"""

import collections
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poddaemon.config import ManifestError, load_manifest
from poddaemon.mcp.env import EnvError, server_env
from poddaemon.mcp.tool import McpTool, input_schema, offered_name, outcome, schema_problem
from poddaemon.tools.base import ToolContext, ToolOutcome, execute
from tests.unit.cancelling import cancelled_while_connecting

BASE = """\
[pod]
name = "p"

[provider]
kind = "openai"
model = "m"

[[scope.allow]]
target = "."
permission = "write"
"""


def load(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "m.toml"
    path.write_text(BASE + text)
    return load_manifest(path, defaults_path=tmp_path / "none.toml")


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ManifestError) as e:
        load(tmp_path, text)
    return str(e.value).replace(str(tmp_path) + "/", "")


def test_servers_load_with_defaults_and_round_trip(tmp_path: Path) -> None:
    m = load(
        tmp_path,
        '[[mcp.servers]]\nname = "gh"\ncommand = ["gh-mcp", "stdio"]\n'
        'env = { TOKEN = "${GH_TOKEN}" }\ntools = ["get_file"]\n'
        '[[mcp.servers]]\nname = "web"\nurl = "http://127.0.0.1:8931/mcp"\ntimeout = 5\n'
        "required = true\n",
    )
    gh, web = m.mcp.servers
    assert (gh.command, gh.env, gh.tools) == (
        ["gh-mcp", "stdio"],
        {"TOKEN": "${GH_TOKEN}"},
        ["get_file"],
    )
    assert (gh.timeout, gh.start_timeout, gh.required) == (60.0, 30.0, False)
    assert (web.url, web.timeout, web.required) == ("http://127.0.0.1:8931/mcp", 5.0, True)
    again = tmp_path / "again.toml"
    again.write_text(m.to_toml())
    assert load_manifest(again, defaults_path=tmp_path / "none.toml").mcp == m.mcp
    assert "${GH_TOKEN}" in m.to_toml()  # never expanded into the resolved config on disk


def test_no_servers_by_default(tmp_path: Path) -> None:
    assert load(tmp_path, "").mcp.servers == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "a__b"\ncommand = ["x"]', "m.toml:12: mcp.servers[0].name: 'a__b' is not a valid"),
        ('name = "a"', "mcp.servers[0].command: set exactly one of command (stdio) and url"),
        ('name = "a"\ncommand = ["x"]\nurl = "http://h/mcp"', "set exactly one of command"),
        ('name = "a"\ncommand = []', "m.toml:13: mcp.servers[0].command: must not be empty"),
        ('name = "a"\nurl = "ftp://h"', "mcp.servers[0].url: 'ftp://h' is not an http://"),
        ('name = "a"\nurl = "http://h"\nenv = { A = "1" }', "mcp.servers[0].env: only a stdio"),
        ('name = "a"\ncommand = ["x"]\nenv = { "A-B" = "1" }', "env.A-B: 'A-B' is not a valid"),
        ('name = "a"\ncommand = ["x"]\ntools = ["t", "t"]', "mcp.servers[0].tools[1]: tool 't'"),
        ('name = "a"\ncommand = ["x"]\ntimeout = 0', "mcp.servers[0].timeout: expected float > 0"),
        (
            'name = "a"\ncommand = ["x"]\nretries = 1',
            "m.toml:14: mcp.servers[0].retries: unknown key",
        ),
    ],
)
def test_bad_server_entries_name_file_line_and_field(
    tmp_path: Path, text: str, message: str
) -> None:
    assert message in error_of(tmp_path, "[[mcp.servers]]\n" + text + "\n")


def test_duplicate_server_names_are_refused(tmp_path: Path) -> None:
    text = '[[mcp.servers]]\nname = "a"\ncommand = ["x"]\n' * 2
    assert "mcp.servers[1].name: server 'a' is listed twice" in error_of(tmp_path, text)


def test_per_tool_caps_take_prefixed_mcp_names_of_configured_servers(tmp_path: Path) -> None:
    server = '[[mcp.servers]]\nname = "gh"\ncommand = ["x"]\n'
    caps = "[worker.tool_output]\nper_tool = { gh__get_file = 100 }\n"
    assert load(tmp_path, caps + server).worker.tool_output.per_tool == {"gh__get_file": 100}
    assert "worker.tool_output.per_tool.gh__get_file: no [[mcp.servers]] is named 'gh'" in (
        error_of(tmp_path, caps)
    )


def test_server_env_is_the_basics_plus_expanded_env() -> None:
    environ = {"PATH": "/bin", "HOME": "/h", "SECRET": "s", "OPENAI_API_KEY": "k", "F": "() {"}
    env = server_env({"TOKEN": "${SECRET}-x", "LIT": "a$b ${SECRET}"}, environ)
    assert env == {"PATH": "/bin", "HOME": "/h", "TOKEN": "s-x", "LIT": "a$b s"}
    with pytest.raises(EnvError, match=r"env.TOKEN: \$\{NOPE\} is not set"):
        server_env({"TOKEN": "${NOPE}"}, environ)


def test_offered_names_are_prefixed_and_provider_safe() -> None:
    assert offered_name("gh", "get_file") == "gh__get_file"
    assert offered_name("gh", "repo.get/file") == "gh__repo_get_file"
    assert offered_name("gh", "x" * 61) is None  # over 64 characters
    assert offered_name("gh", "") is None


def test_results_become_text_and_is_error_a_tool_error() -> None:
    text = SimpleNamespace(type="text", text="hello")
    image = SimpleNamespace(type="image", data="AAAA", mime_type="image/png")
    link = SimpleNamespace(type="resource_link", uri="file:///a")
    res = SimpleNamespace(type="resource", resource=SimpleNamespace(uri="u", text="inline"))
    ok = outcome(SimpleNamespace(content=[text, image, link, res], is_error=False))
    assert ok == ToolOutcome(
        output="hello\n[image: image/png, about 3 bytes, not shown]\n[resource: file:///a]\ninline"
    )
    bad = outcome(SimpleNamespace(content=[text], is_error=True))
    assert (bad.output, bad.is_error, bad.summary) == ("hello", True, "hello")
    structured = outcome(SimpleNamespace(content=[], structured_content={"n": 1}, is_error=False))
    assert structured.output == '{"n":1}'


def test_input_schema_is_always_an_object_schema() -> None:
    assert input_schema({}) == {"type": "object", "properties": {}}
    assert input_schema(None) == {"type": "object", "properties": {}}
    nested = {
        "type": "object",
        "properties": {"q": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
    }
    assert input_schema(nested) == nested


def test_schemas_a_provider_would_refuse_are_named() -> None:
    fine = [
        None,  # no parameters
        {},
        {"type": "object", "properties": {"q": {"anyOf": [{"type": "integer"}, True]}}},
        {"properties": {"tags": {"type": ["array", "null"], "items": [{"type": "string"}]}}},
        {"type": "object", "$defs": {"p": {"type": "string"}}, "additionalProperties": False},
    ]
    assert [schema_problem(s) for s in fine] == [None] * len(fine)
    refused = {
        "its inputSchema has type 'array', not 'object'": {"type": "array"},
        "its inputSchema is not an object but str 'text'": "text",
        "inputSchema.properties is not an object": {"properties": ["a"]},
        "inputSchema.properties.a.type 'int' is not a JSON type": {
            "properties": {"a": {"type": "int"}}
        },
        "inputSchema.properties.a.type [] is not a JSON type": {"properties": {"a": {"type": []}}},
        "inputSchema.required is not a list of names": {"required": "a"},
        "inputSchema.anyOf[1] is not a schema: 3": {"anyOf": [{}, 3]},
        "inputSchema.properties.a.items.type {'x': 1} is not a JSON type": {
            "properties": {"a": {"items": {"type": {"x": 1}}}}
        },
    }
    assert {schema_problem(s): s for s in refused.values()} == refused


async def test_execute_passes_mcp_arguments_unchecked_and_caps_by_prefixed_name() -> None:
    seen: list[dict[str, Any]] = []

    async def call(remote: str, args: dict[str, Any]) -> ToolOutcome:
        seen.append({"remote": remote, **args})
        return ToolOutcome(output="y" * 50)

    schema = {"type": "object", "properties": {"q": {"anyOf": [{"type": "integer"}]}}}
    tool = McpTool(name="s__find", remote="find", description="", parameters=schema, call=call)
    ctx = ToolContext(scope=None, pwd="/")  # type: ignore[arg-type]
    ctx.limits.per_tool["s__find"] = 10
    result = await execute("s__find", '{"q": 3, "nested": {"a": [1]}}', ctx, {"s__find": tool})
    assert seen == [{"remote": "find", "q": 3, "nested": {"a": [1]}}]
    assert result.output.startswith("y" * 10 + "\n[output truncated: 50 bytes")


def test_importing_the_package_does_not_import_the_sdk() -> None:
    code = (
        "import sys, poddaemon.mcp\n"
        "print(any(m.split('.')[0] in ('mcp', 'mcp_types') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_pod_without_servers_never_loads_the_client(tmp_path: Path) -> None:
    """The client's modules cost ~3 ms of every pod's start: only a manifest with servers
    loads them."""
    load(tmp_path, "")  # the manifest is valid
    code = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from poddaemon.config import load_manifest\n"
        "from poddaemon.mcp import start_mcp\n"
        f"m = load_manifest(Path({str(tmp_path / 'm.toml')!r}), defaults_path=Path('/none'))\n"
        "manager = asyncio.run(start_mcp(m, print))\n"
        "loaded = 'poddaemon.mcp.connection' in sys.modules\n"
        "print(manager.tools, manager.status(), loaded)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["{}", "[]", "False"]


def _guarded(*command: str) -> tuple["subprocess.Popen[bytes]", int]:
    """The guard over `command`, its stderr a pipe whose only reader is the returned fd."""
    from poddaemon.mcp.stdio import GUARD

    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-I", GUARD, "--", *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=write_fd,
        start_new_session=True,
    )
    os.close(write_fd)
    return proc, read_fd


def test_guard_passes_the_server_only_its_three_pipes() -> None:
    """Not a stray copy of one (uvloop's spawn leaks them): the pod must see the server's
    stdout end when the server closes it."""
    from poddaemon.mcp.stdio import GUARD

    stray = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(stray, True)
    try:
        read_fd, write_fd = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-I", GUARD, "--", "ls", "/proc/self/fd"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=write_fd,
            pass_fds=(stray,),
            start_new_session=True,
        )
        os.close(write_fd)
        out, _ = proc.communicate(timeout=30)
        os.close(read_fd)
    finally:
        os.close(stray)
    assert sorted(int(fd) for fd in out.split()) == [0, 1, 2, 3]  # 3: the directory ls reads


def test_guard_kills_the_server_group_when_its_reader_goes() -> None:
    # A server that ignores SIGTERM and EOF: only the group kill ends it.
    proc, read_fd = _guarded(sys.executable, "-c", SLEEPER)
    os.close(read_fd)  # what the pod's death does
    assert proc.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _live_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _live_members(proc.pid)


def _live_members(pgid: int) -> list[int]:
    """Processes of group `pgid` that are not zombies (killed children wait for a reaper)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def test_guard_reports_the_server_exit_on_stderr() -> None:
    proc, read_fd = _guarded(sys.executable, "-c", "raise SystemExit(7)")
    with os.fdopen(read_fd, "rb") as err:
        assert b"mcp guard: server exited with status 7" in err.read()
    proc.wait(10)
    missing, read_fd = _guarded("/nonexistent/server")
    with os.fdopen(read_fd, "rb") as err:
        assert b"cannot start /nonexistent/server" in err.read()
    assert missing.wait(10) == 127


SLEEPER = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"


def test_a_stderr_flood_is_logged_at_the_rate_with_a_few_reports_of_what_was_dropped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server writing 200-character lines to stderr 500 times a second for 20 s: what is
    logged stays within the burst and the rate, and the drops are reported every
    DROPS_REPORT_EVERY seconds, not twice per line let through (which logged more than the
    flood's own lines), and once more when the server is gone."""
    from poddaemon.mcp import stdio

    clock = [1000.0]
    monkeypatch.setattr(stdio.time, "monotonic", lambda: clock[0])
    server = object.__new__(stdio.StdioProcess)
    server.name = "flood"
    server.tail = collections.deque(maxlen=stdio.STDERR_TAIL)
    server._allowance, server._refilled = float(stdio.LOG_BURST), clock[0]
    server._dropped, server._flooding, server._reported = 0, False, 0.0
    line, sent = b"x" * 200, 10_000
    with caplog.at_level(logging.INFO, logger=stdio.log.name):
        for _ in range(sent):
            clock[0] += 0.002
            server._line(line)
        server._report_drops()  # as at the server's EOF
    logged = [r.getMessage() for r in caplog.records if r.getMessage().endswith("x" * 200)]
    reports = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert 200 * len(logged) <= stdio.LOG_BURST + 20 * stdio.LOG_RATE
    assert len(reports) <= 2 + 20 / stdio.DROPS_REPORT_EVERY, reports
    dropped = sum(int(m.split()[1]) for m in reports if "were not logged" in m)
    assert dropped + len(logged) == sent  # every line is either logged or counted


def test_an_unreadable_reply_is_answered_with_an_error_for_its_id() -> None:
    from mcp_types import JSONRPCError

    from poddaemon.mcp.stdio import _unreadable

    deep = b'{"a": ' * 300 + b"1" + b"}" * 300
    line = b'{"jsonrpc": "2.0", "id": 7, "result": ' + deep + b"}"
    answer = _unreadable(line, ValueError("recursion limit exceeded"))
    assert isinstance(answer.message, JSONRPCError), answer
    assert answer.message.id == 7
    assert "cannot be read (recursion limit exceeded)" in answer.message.error.message
    # A request of the server's, and an id no JSON can carry, are not answered: the exception
    # goes to the SDK, which drops it (it raised in the transport's reader, which lost the
    # connection).
    for line in (b'{"id": 3, "method": "x", "params": ' + deep + b"}", b'{"id": "a\\q"}'):
        error = ValueError("unreadable")
        assert _unreadable(line, error) is error


def test_a_reply_with_neither_result_nor_error_is_an_error_saying_so() -> None:
    from mcp_types import JSONRPCError

    from poddaemon.mcp.stdio import PROTOCOL_BROKEN, _unreadable, batch_items

    answer = _unreadable(b'{"jsonrpc": "2.0", "id": "c1"}', ValueError("4 validation errors"))
    assert isinstance(answer.message, JSONRPCError), answer
    assert answer.message.id == "c1"
    error = answer.message.error
    assert error.message == "its reply has neither a result nor an error"
    assert error.data == PROTOCOL_BROKEN
    assert batch_items(b'[{"jsonrpc": "2.0", "id": 2}]') == [
        b'{"jsonrpc":"2.0","id":2,"error":{"code":-32603,"message":"its reply has neither a '
        b'result nor an error","data":"poddaemon: the server broke the protocol"}}'
    ]
    # Without an id there is no call to fail: the SDK is told the line cannot be read.
    error = ValueError("unreadable")
    assert _unreadable(b'{"jsonrpc": "2.0", "id": null}', error) is error


def test_a_reply_whose_result_is_not_an_object_is_an_error_saying_what_it_is() -> None:
    from poddaemon.mcp.http import messages
    from poddaemon.mcp.stdio import PROTOCOL_BROKEN, batch_items, broken_reply

    def why(reply: bytes | None) -> str:
        assert reply is not None
        error = json.loads(reply)["error"]
        assert error["data"] == PROTOCOL_BROKEN
        return str(error["message"])

    for result, what in [("null", "null"), ("[]", "an array"), ('"ok"', "a string"),
                         ("0.5", "a number"), ("true", "a boolean")]:  # fmt: skip
        text = b'{"jsonrpc": "2.0", "id": 4, "result": %b}' % result.encode()
        said = f"its result is {what}, not an object"
        assert why(broken_reply(json.loads(text))) == said
        (over_http,) = messages(text) or [None]
        assert why(over_http) == said
        (in_batch,) = batch_items(b"[" + text + b"]") or [None]
        assert why(in_batch) == said
    # A good reply, an error, a request: passed on as they are (over HTTP, not even decoded).
    for text in (b'{"jsonrpc": "2.0", "id": 4, "result" : {"content": []}}',
                 b'{"jsonrpc": "2.0", "id": 4, "error": {"code": 1, "message": "no"}}',
                 b'{"jsonrpc": "2.0", "id": 4, "method": "ping", "result": 1}'):  # fmt: skip
        assert broken_reply(json.loads(text)) is None
        assert messages(text) is None


def test_a_batch_line_is_split_into_its_messages() -> None:
    from poddaemon.mcp.stdio import batch_items

    line = b' [{"jsonrpc": "2.0", "method": "n"}, {"jsonrpc": "2.0", "id": 1, "result": {}}, 7]\n'
    assert batch_items(line) == [
        b'{"jsonrpc":"2.0","method":"n"}',
        b'{"jsonrpc":"2.0","id":1,"result":{}}',
        b"7",  # no message: the SDK is told it cannot be read, as for such a line
    ]
    assert batch_items(b"[]") == []
    # No batch, or none the decoder can read: the line is read whole, as before.
    for other in (b'{"id": 1, "result": []}', b"[" * 10_000 + b"]" * 10_000, b"[1,"):
        assert batch_items(other) is None


def test_the_handshake_speaks_the_revisions_the_sdk_session_adopts() -> None:
    """handshake.py cannot import the SDK (it runs before the import): its copies must agree."""
    from mcp_types import version

    from poddaemon.mcp import handshake

    assert handshake.HANDSHAKE_VERSIONS == version.HANDSHAKE_PROTOCOL_VERSIONS
    assert handshake.PROTOCOL_VERSION == version.LATEST_HANDSHAKE_VERSION


def test_a_tool_listed_many_times_is_one_alert() -> None:
    """Found by QA: a tool listed N times was N-1 alerts, and one left out for its schema was
    an alert about that schema at each listing."""
    from poddaemon.config.manifest import McpServerConfig
    from poddaemon.mcp.connection import McpConnection

    said: list[str] = []
    conn = McpConnection(
        McpServerConfig(name="s", url="http://127.0.0.1:1/mcp"),
        None,
        "/",
        lambda: None,  # the SDK: never asked for
        lambda level, source, message: said.append(message),
    )
    good = {"name": "echo", "inputSchema": {"type": "object"}}
    bad = {"name": "listy", "inputSchema": {"type": "array"}}
    tools = conn._make_tools([good] * 5 + [bad] * 3 + [{"name": "a.b"}, {"name": "a_b"}] * 2)
    assert set(tools) == {"s__echo", "s__a_b"}
    assert tools["s__a_b"].remote == "a.b"
    assert [m.split(": ", 1)[1] for m in said] == [
        "tool 'echo' cannot be offered to the model (the server lists it 5 times)",
        "tool 'listy' cannot be offered to the model (its inputSchema has type 'array', not "
        "'object')",
        "tool 'listy' cannot be offered to the model (the server lists it 3 times)",
        "tool 'a_b' cannot be offered to the model (made safe, its name is that of 'a.b', "
        "listed before it)",
        "tool 'a.b' cannot be offered to the model (the server lists it twice)",
        "tool 'a_b' cannot be offered to the model (the server lists it twice)",
    ]


def test_thousands_of_tools_that_cannot_be_offered_are_not_an_alert_each() -> None:
    """Found by QA: a server listing 3,000 over-long names was 3,000 warnings in the log and
    on `podctl spawn`'s terminal. Ten are said one by one, the rest in one more."""
    from poddaemon.config.manifest import McpServerConfig
    from poddaemon.mcp.connection import SAID_ONE_BY_ONE, McpConnection

    said: list[str] = []
    conn = McpConnection(
        McpServerConfig(name="s", url="http://127.0.0.1:1/mcp"),
        None,
        "/",
        lambda: None,
        lambda level, source, message: said.append(message),
    )
    long_names = [
        {"name": f"t{i}" + "x" * 80, "inputSchema": {"type": "object"}} for i in range(3000)
    ]
    tools = conn._make_tools([{"name": "ok", "inputSchema": {"type": "object"}}, *long_names])
    assert set(tools) == {"s__ok"}
    assert len(said) == SAID_ONE_BY_ONE + 1
    assert all("too long for the providers" in m for m in said[:SAID_ONE_BY_ONE])
    assert said[-1].startswith(
        f"MCP server 's': {3000 - SAID_ONE_BY_ONE} more of its tools cannot be offered to the "
        "model either ('t10xxxx"
    ), said[-1]


def test_an_sse_batch_is_an_event_per_message_whatever_the_chunks() -> None:
    from poddaemon.mcp.http import SseRewriter

    note = b'{"jsonrpc":"2.0","method":"notifications/message","params":{}}'
    reply = b'{"jsonrpc":"2.0","id":1,"result":{}}'
    stream = (
        b": a comment\r\nevent: message\r\nid: 7\r\nretry: 50\r\ndata: [" + note + b",\r\n"
        b"data: " + reply + b"]\r\n\r\n"
        b"data: " + reply + b"\r\n\r\n"  # no batch: as it came (with LF ends)
        b"event: other\ndata: [1]\n\n"  # not a message: as it came
        b"id: 8\ndata: []\n\n"  # nothing in it but its id
        b'data: {"jsonrpc": "2.0", "id": 2}\n\n'
        b"data: cut short"
    )
    split = (
        b"event: message\nretry: 50\ndata: " + note + b"\n\n"
        b"event: message\nretry: 50\ndata: " + reply + b"\nid: 7\n\n"
        b"data: " + reply + b"\n\n"
        b"event: other\ndata: [1]\n\n"
        b"id: 8\n\n"
        b'data: {"jsonrpc":"2.0","id":2,"error":{"code":-32603,"message":"its reply has '
        b'neither a result nor an error","data":"poddaemon: the server broke the protocol"}}\n\n'
        b"data: cut short"
    )
    for size in (1, 2, 7, len(stream)):  # a CRLF split across chunks is one line end
        rewriter = SseRewriter(limit=1 << 20)
        out = b"".join(rewriter.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert out + rewriter.end() == split, size
    # An event over the limit: the stream is passed on as it comes from there.
    rewriter = SseRewriter(limit=100)
    big = b"data: [" + b"1," * 100 + b"1]\n\n"
    assert rewriter.feed(big[:150]) + rewriter.feed(big[150:]) + rewriter.end() == big


_MESSAGES = st.one_of(
    st.builds(lambda i: {"jsonrpc": "2.0", "id": i, "result": {"n": i}}, st.integers(0, 99)),
    st.just({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"p": 1}}),
)
_EVENTS = st.lists(
    st.tuples(
        st.one_of(_MESSAGES, st.lists(_MESSAGES, max_size=4)),  # one message, or a batch
        st.sampled_from([b"", b"id: 9\n", b": ping\n", b"event: message\n", b"retry: 5\n"]),
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(_EVENTS, st.sampled_from([b"\n", b"\r\n", b"\r"]), st.lists(st.integers(1, 40)))
def test_an_sse_stream_gives_every_message_in_order_however_it_is_cut(
    events: list[tuple[Any, bytes]], eol: bytes, cuts: list[int]
) -> None:
    """Any stream of message events, any line ends, cut into chunks anywhere (a CRLF across
    two chunks too): the same events out as when fed whole, with every message of a batch as
    an event of its own, in order."""
    import json

    from poddaemon.mcp.http import SseRewriter

    stream = b"".join(
        (extra + b"data: " + json.dumps(body).encode() + b"\n\n").replace(b"\n", eol)
        for body, extra in events
    )
    whole = SseRewriter(limit=1 << 20)
    expected = whole.feed(stream) + whole.end()
    rewriter, out, at = SseRewriter(limit=1 << 20), [], 0
    for size in cuts:
        out.append(rewriter.feed(stream[at : at + size]))
        at += size
    out += [rewriter.feed(stream[at:]), rewriter.end()]
    assert b"".join(out) == expected
    sent = [m for body, _ in events for m in (body if isinstance(body, list) else [body])]
    got = [json.loads(line[6:]) for line in expected.split(b"\n") if line.startswith(b"data: ")]
    assert got == sent


def open_pipes() -> set[str]:
    """What this process's descriptors that are pipes point to."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor, gone)
            if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith("pipe:"):
                found.add(f"{fd} {target}")
    return found


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_server_start_cancelled_while_its_stderr_is_connected_stays_a_cancellation(
    loop: str,
) -> None:
    """Cancelled in the loop pass that connects the guard's stderr pipe (a pod stopping as
    its MCP servers start), the read end was closed a second time: under uvloop, EBADF, an
    OSError that replaced the cancellation and read as "cannot start the guard" (under
    asyncio, later, whatever had taken its number by then). Nothing is started."""
    import asyncio

    import uvloop

    from poddaemon.mcp import stdio

    async def main() -> None:
        before = open_pipes()
        with cancelled_while_connecting(asyncio.get_running_loop()):
            spawning = asyncio.ensure_future(
                stdio.StdioProcess.spawn("s", ["sleep", "1000"], dict(os.environ), "/")
            )
            with pytest.raises(asyncio.CancelledError):
                await spawning
        assert open_pipes() == before  # both ends of the guard's stderr pipe closed

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


async def test_a_compressed_event_stream_is_read_decoded_or_fails_saying_why() -> None:
    """An SSE body sent gzip-compressed is rewritten as any other (a batch split into its
    messages); one that does not decode fails as a connection cut short, saying why."""
    import gzip

    import httpx2

    from poddaemon.mcp.http import _CappedTransport

    note = b'{"jsonrpc":"2.0","method":"notifications/message","params":{}}'
    reply = b'{"jsonrpc":"2.0","id":1,"result":{}}'
    event = b"event: message\ndata: [" + note + b"," + reply + b"]\n\n"
    transport = _CappedTransport("s", 1 << 20, lambda refused: None)
    request = httpx2.Request("GET", "http://127.0.0.1:1/mcp")
    for body, said in ((gzip.compress(event), None), (b"not gzip", "cannot be decoded")):
        response = httpx2.Response(
            200,
            headers={"content-type": "text/event-stream", "content-encoding": "gzip"},
            stream=httpx2.ByteStream(body),
            request=request,
        )
        capped = transport._capped(response, request)
        assert "content-encoding" not in capped.headers
        if said is None:
            text = b"".join([chunk async for chunk in capped.aiter_bytes()])
            assert text == b"".join(b"event: message\ndata: %b\n\n" % m for m in (note, reply))
        else:
            with pytest.raises(httpx2.ReadError, match=said):
                await capped.aread()
