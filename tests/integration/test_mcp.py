"""Issue 14: pods use MCP servers' tools. A real MCP server (tests/integration/mcp_test_server.py,
written with the `mcp` SDK) over stdio and streamable HTTP; the fake model calls its tools through
a real pod; results, errors and timeouts come back as tool results; the server's processes die
with the pod however it ends."""

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from poddaemon.readyline import EXIT_REFUSED
from poddaemon.testing.cleanup import alive
from tests.conftest import Env, PodProcess, StartFailed, ppid, wait_until

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
LEGACY = str(Path(__file__).with_name("mcp_legacy_server.py"))  # hand-written, 2025-era
RAW_HTTP = str(Path(__file__).with_name("mcp_raw_http_server.py"))  # hand-written, JSON bodies
# Not worth a model request: the tool names every test's server offers.
ALL_TOOLS = {"add", "fail", "slow", "hang", "env", "big", "pid", "crash"}


def server_toml(name: str = "t", *, url: str | None = None, args: tuple[str, ...] = (),
                script: str = SERVER, **keys: Any) -> str:  # fmt: skip
    lines = ["", "[[mcp.servers]]", f'name = "{name}"']
    if url is None:
        lines.append(f"command = {json.dumps([sys.executable, script, *args])}")
    else:
        lines.append(f'url = "{url}"')
    for key, value in keys.items():
        if isinstance(value, dict):
            inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{key} = {{ {inline} }}")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def tool_results(pod: Any) -> list[dict[str, Any]]:
    return [e["item"] for e in pod.call("history")["entries"] if e["kind"] == "tool_result"]


def advertised_tools(body: dict[str, Any]) -> dict[str, Any]:
    """name -> JSON schema of the tools in one model request (OpenAI or Anthropic shape)."""
    out = {}
    for tool in body.get("tools", []):
        if "function" in tool:
            out[tool["function"]["name"]] = tool["function"]["parameters"]
        else:
            out[tool["name"]] = tool["input_schema"]
    return out


def alerts(pod: Any) -> list[str]:
    with pod.client(timeout=10) as c:
        c.subscribe(since=0)
        c.run("(collect alerts)")  # an event after the held ones, to know when to stop
        out = []
        for event in c.events():
            if event.type == "alert":
                out.append(event.data["message"])
            if event.type == "run.finished":
                return out
    return out


def assert_the_same_server_serves(pod: PodProcess) -> None:
    """The pod's one MCP server is up and was never restarted: what went wrong cost a call,
    not the server."""
    (server,) = pod.call("status")["mcp"]
    assert (server["state"], server["restarts"]) == ("ready", 0)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_stdio_tools_answer_fail_and_time_out_as_tool_results(env: Env, kind: str) -> None:
    env.model.script(
        {
            "tool_calls": [
                {"name": "t__add", "arguments": {"a": 2, "b": 40}},
                {"name": "t__fail", "arguments": {"message": "boom from the server"}},
                {"name": "t__slow", "arguments": {"seconds": 30}},
                {"name": "t__add", "arguments": {"a": "not a number", "b": 1}},
            ]
        },
        {"text": "all done"},
    )
    pod = env.start("mcpuser", kind=kind, extra=server_toml(timeout=1))
    with pod.client() as c:
        result = c.run_wait("use the tools")
    assert (result.outcome, result.text) == ("finished", "all done")

    tools = advertised_tools(env.model.requests[0]["body"])
    assert {f"t__{t}" for t in ALL_TOOLS} <= set(tools)
    assert {"read_file", "list_dir"} <= set(tools)  # worker.tools are still there
    assert tools["t__add"]["properties"]["a"]["type"] == "integer"
    assert tools["t__add"]["required"] == ["a", "b"]

    add, fail, slow, bad = tool_results(pod)
    assert (add["name"], add["output"], add["is_error"]) == ("t__add", "42", False)
    assert fail["is_error"] and "boom from the server" in fail["output"]
    assert slow["is_error"] and "timed out after 1 s" in slow["output"]
    # Not known to have failed: a model told only "timed out" may call it again.
    assert "the call may or may not have taken effect" in slow["output"]
    assert bad["is_error"] and "valid integer" in bad["output"]  # the server's own validation
    # The model saw them as tool results, in its next request.
    assert "boom from the server" in str(env.model.requests[1]["body"])


def test_env_allow_list_and_output_caps(env: Env) -> None:
    env.env["MCP_SECRET_FOR_TEST"] = "s3cret"
    env.model.script(
        {
            "tool_calls": [
                {"name": "t__env", "arguments": {"name": "GREETING"}},
                {"name": "t__env", "arguments": {"name": "FAKE_API_KEY"}},
                {"name": "t__env", "arguments": {"name": "PODDAEMON_HOME"}},
                {"name": "t__env", "arguments": {"name": "PATH"}},
                {"name": "t__big", "arguments": {"n": 5000}},
                {"name": "t__pid", "arguments": {}},
            ]
        },
        {"text": "ok"},
    )
    extra = server_toml(
        env={"GREETING": "hello ${MCP_SECRET_FOR_TEST}!"},
        tools=["env", "big", "nosuch"],
    )
    extra = extra.replace("[[mcp.servers]]", "[worker.tool_output]\nper_tool = { t__big = 100 }\n"
                          "\n[[mcp.servers]]")  # fmt: skip
    pod = env.start("envpod", extra=extra)
    with pod.client() as c:
        assert c.run_wait("go").outcome == "finished"
    tools = advertised_tools(env.model.requests[0]["body"])
    assert {t for t in tools if t.startswith("t__")} == {"t__env", "t__big"}
    greeting, api_key, home, path, big, pid = tool_results(pod)
    assert greeting["output"] == "hello s3cret!"
    assert api_key["output"] == "<unset>"  # nothing of the pod's environment but what env names
    assert home["output"] == "<unset>"
    assert path["output"] == os.environ["PATH"]  # the SDK's few basics
    assert big["output"].startswith("x" * 100 + "\n[output truncated: 5000 bytes")
    assert pid["is_error"] and "unknown tool: t__pid" in pid["output"]  # not in the allow-list
    assert any("has no tool nosuch" in a for a in alerts(pod))


def test_unset_env_variable_is_a_start_up_error_naming_it(env: Env) -> None:
    """Exit 78 (refused), as for an unset provider key: a unit restarts exit 1, and it looped
    (found by QA) on an error no restart changes."""
    with pytest.raises(StartFailed) as failed:
        env.start("unset", extra=server_toml(env={"TOKEN": "${MCP_TEST_NOT_SET_ANYWHERE}"}))
    assert failed.value.code == EXIT_REFUSED
    expected = "mcp.servers[0].env.TOKEN: ${MCP_TEST_NOT_SET_ANYWHERE} is not set"
    assert expected in failed.value.stderr


def test_a_server_that_fails_to_start_is_an_alert_and_its_tools_are_absent(env: Env) -> None:
    env.model.script({"text": "fine"})
    extra = server_toml() + server_toml("broken", args=()).replace(
        json.dumps([sys.executable, SERVER]), json.dumps(["/nonexistent/mcp-server"])
    )
    pod = env.start("halfmcp", extra=extra)
    messages = alerts(pod)
    assert any(
        "MCP server 'broken' failed to start" in m and "/nonexistent/mcp-server" in m
        for m in messages
    ), messages
    tools = advertised_tools(env.model.requests[0]["body"])
    assert "t__add" in tools and not [t for t in tools if t.startswith("broken__")]


def _pids_of(marker: str) -> list[int]:
    """Live processes whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(int(pid)):
                found.append(int(pid))
    return found


def test_a_server_that_never_starts_is_stopped_not_left_running_with_the_pod(env: Env) -> None:
    """A server that never answers `initialize` and ignores EOF (it does not read stdin): the
    pod gave up on it at `start_timeout` and said so, but the server and its guard ran on until
    the pod stopped. Its holder's cleanup, running in a cancelled task, waited with
    asyncio.timeout, which on Python 3.11 raises CancelledError there instead of TimeoutError:
    the kill after it never ran."""
    marker = f"never-starts-{os.getpid()}"
    hang = f"import time; time.sleep(600)  # {marker}"
    pod = env.start(
        "stuckmcp", extra=server_toml("hang", script="-c", args=(hang,), start_timeout=1)
    )
    assert any("MCP server 'hang' failed to start" in m for m in alerts(pod)), alerts(pod)
    # GIVE_UP (5 s) past start_timeout is the bound the pod gives a server it gave up on.
    wait_until(lambda: not _pids_of(marker), 15, "the server that never started to be stopped")
    assert pod.call("status")["state"] == "idle"  # the pod runs on without it


def test_a_server_that_answers_initialize_with_lines_not_json_says_so(env: Env) -> None:
    """A server whose replies are not JSON lines (a logger on stdout, another framing) fails
    its start by the timeout; the alert said only "did not start within …" and the guard's
    last words, not what the server had printed instead."""
    chatty = "import sys\nfor _ in sys.stdin: print('Listening on port 8080', flush=True)"
    extra = server_toml("chatty", script="-c", args=(chatty,), start_timeout=1)
    pod = env.start("chattymcp", extra=extra)
    (said,) = [m for m in alerts(pod) if "MCP server 'chatty'" in m]
    assert "did not start within 1 s; its stdout held 1 line(s) not JSON" in said, said
    assert "(the first: 'Listening on port 8080')" in said, said


def test_a_server_whose_tool_list_is_not_a_list_fails_to_start_and_says_so(env: Env) -> None:
    """Found by QA: `{"tools": "nope"}` was read as no tools, with no alert and status
    saying `ready (0 tools)`."""
    env.model.script({"text": "fine"})
    pod = env.start("odd", extra=server_toml("odd", script=LEGACY, args=("--tools-not-a-list",)))
    messages = alerts(pod)
    assert any(
        "MCP server 'odd' failed to start" in m and "no list of tools" in m for m in messages
    ), messages


def test_a_required_server_that_fails_fails_the_start_up(env: Env) -> None:
    extra = server_toml("needed", required=True, start_timeout=2, args=("--hang-at-start",))
    with pytest.raises(StartFailed) as failed:
        env.start("required", extra=extra)
    assert "required MCP server 'needed' failed to start" in failed.value.stderr
    assert failed.value.code == 1  # it may come up next time: a unit tries again
    assert "did not start within 2 s" in failed.value.stderr


def test_a_server_that_dies_is_restarted_once_then_its_calls_fail(env: Env) -> None:
    env.model.script(
        {"tool_calls": [{"name": "t__crash", "arguments": {}}]},
        {"tool_calls": [{"name": "t__add", "arguments": {"a": 1, "b": 2}}]},
        {"tool_calls": [{"name": "t__crash", "arguments": {}}]},
        {"tool_calls": [{"name": "t__add", "arguments": {"a": 1, "b": 2}}]},
        {"text": "survived"},
    )
    pod = env.start("phoenix", extra=server_toml())
    with pod.client() as c:
        assert c.run_wait("crash it twice").outcome == "finished"
    crash1, add1, crash2, add2 = tool_results(pod)
    assert crash1["is_error"] and "lost the connection during crash" in crash1["output"]
    assert (add1["output"], add1["is_error"]) == ("3", False)  # restarted
    assert crash2["is_error"]
    assert add2["is_error"] and "MCP server 't' is not available" in add2["output"]
    messages = alerts(pod)
    assert any("restarting it" in m for m in messages)
    assert any("died again" in m for m in messages)
    (server,) = pod.call("status")["mcp"]
    assert (server["state"], server["restarts"]) == ("dead", 1)


def test_a_server_script_the_pod_rewrote_is_not_restarted_outside_the_sandbox(env: Env) -> None:
    """The server runs unconfined; its script lies in the pod's write scope. The model's bash
    (confined: it cannot write outside) prepended code to it, then crashed the server: the
    restart ran that code with the user's full rights and wrote outside the scope."""
    outside = env.home / "outside"
    outside.mkdir()
    pwned = outside / "pwned"
    script = env.work / "server.py"
    script.write_text(Path(SERVER).read_text())
    payload = f'open("{pwned}", "w").write("escaped")'
    rewrite = f"{{ echo '{payload}'; cat server.py; }} > new.py && mv new.py server.py"
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": rewrite}}]},
        {"tool_calls": [{"name": "t__crash", "arguments": {}}]},
        {"tool_calls": [{"name": "t__add", "arguments": {"a": 1, "b": 2}}]},
        {"text": "done"},
    )
    pod = env.start("rewriter", tools=["bash"], extra=server_toml(script=str(script)))
    with pod.client() as c:
        assert c.run_wait("rewrite and crash").outcome == "finished"
    rewritten, crash, add = tool_results(pod)
    assert not rewritten["is_error"] and script.read_text().startswith("open(")
    assert crash["is_error"]
    assert add["is_error"] and "MCP server 't' is not available" in add["output"]
    assert not pwned.exists()
    assert any(f"{script} changed since the pod started the server" in m for m in alerts(pod))
    assert not any("restarting it" in m for m in alerts(pod)), alerts(pod)  # (it was said)
    # Found by QA: status said "restarted 1x: … not restarted" (the refused attempt counted).
    status = " ".join(env.podctl("status", "rewriter").stdout.split())
    assert "t dead (8 tools): " in status and "not restarted" in status, status
    assert "restarted 1x" not in status, status


def test_a_server_loading_code_from_a_writable_cwd_is_warned_of_and_not_restarted(
    env: Env,
) -> None:
    """Found by QA: `python3 -m` puts the server's cwd (the pod's pwd) first on sys.path. The
    server lives outside the scope, so nothing was said at start; the model's bash put a
    module of that name in its pwd and crashed the server, whose restart imported it and ran
    it with the user's full rights. Now start-up and status warn, and it is not restarted."""
    outside = env.home / "outside"
    outside.mkdir()
    pwned = outside / "pwned"
    payload = f'open("{pwned}", "w").write("escaped")'
    plant = f"echo '{payload}' > mcp_test_server.py"  # imported in place of the server's
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": plant}}]},
        {"tool_calls": [{"name": "t__crash", "arguments": {}}]},
        {"tool_calls": [{"name": "t__add", "arguments": {"a": 1, "b": 2}}]},
        {"text": "done"},
    )
    module = server_toml(
        script="-m", args=("mcp_test_server",), env={"PYTHONPATH": str(Path(SERVER).parent)}
    )
    pod = env.start("planter", tools=["bash"], pwd=str(env.work), extra=module)
    said = f"{env.work} (its working directory, which its command loads code from) lies in"
    assert f"mcp.servers[0].command: {said}" in pod.text()
    status = " ".join(env.podctl("status", "planter").stdout.split())
    assert f"MCP server 't': {said} the pod's write scope" in status, status
    with pod.client() as c:
        assert c.run_wait("plant and crash").outcome == "finished"
    planted, crash, add = tool_results(pod)
    assert not planted["is_error"] and (env.work / "mcp_test_server.py").exists()
    assert crash["is_error"]
    assert add["is_error"] and "MCP server 't' is not available" in add["output"]
    assert not pwned.exists()
    why = f"its command loads code from its working directory {env.work}, which lies in"
    assert any(why in m and "not restarted" in m for m in alerts(pod)), alerts(pod)
    assert not any("restarting it" in m for m in alerts(pod)), alerts(pod)


def test_start_up_and_status_say_when_the_pod_may_rewrite_its_manifest_or_server(
    env: Env,
) -> None:
    """What the pod writes into its own manifest or an MCP server's script is what its next
    start runs, the server outside the sandbox: said at start-up and by `podctl status`; a
    server outside the write scope is not named."""
    script = env.work / "server.py"
    script.write_text(Path(SERVER).read_text())
    extra = server_toml("mine", script=str(script)) + server_toml("theirs")
    pod = env.start("selfwriter", tools=["bash"], write=[str(env.home)], pwd=str(env.work),
                    extra=extra)  # fmt: skip
    manifest = env.home / "selfwriter.toml"
    said = pod.text()
    assert f"{manifest}: the pod may rewrite its own manifest" in said
    assert f"mcp.servers[0].command: {script} lies in the pod's write scope" in said
    assert "mcp.servers[1]" not in said and SERVER not in said
    status = " ".join(env.podctl("status", "selfwriter").stdout.split())
    assert f"MCP server 'mine': {script} lies in the pod's write scope" in status
    assert "MCP server 'theirs':" not in status


def test_a_hung_server_is_taken_for_lost_and_restarted(env: Env) -> None:
    # A slow tool on a live server only times out (the `slow` case above); a server that does
    # not answer a ping either is hung: restarted, so the next call works at once.
    env.model.script(
        {"tool_calls": [{"name": "t__hang", "arguments": {"seconds": 60}}]},
        {"tool_calls": [{"name": "t__add", "arguments": {"a": 1, "b": 2}}]},
        {"text": "recovered"},
    )
    pod = env.start("stuck", extra=server_toml(timeout=1))
    with pod.client(timeout=60) as c:
        assert c.run_wait("hang it").outcome == "finished"
    hang, add = tool_results(pod)
    assert hang["is_error"] and "timed out after 1 s, and a ping got no answer" in hang["output"]
    assert (add["output"], add["is_error"]) == ("3", False)  # the restarted server answered
    assert any("restarting it" in m for m in alerts(pod))


# --- processes die with the pod --------------------------------------------------------------


@pytest.mark.parametrize("how", ["shutdown", "sigterm", "kill -9"])
def test_the_server_and_its_children_die_with_the_pod(env: Env, tmp_path: Path, how: str) -> None:
    """Even a server that ignores EOF on stdin and SIGTERM, with a child that ignores SIGTERM
    and one it detached in a session of its own (that one outlived the pod: found by QA)."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env.env["MCP_TEST_PIDDIR"] = str(piddir)
    args = ("--ignore-eof", "--child", "--escapee")
    extra = server_toml(args=args, env={"MCP_TEST_PIDDIR": str(piddir)})
    pod = env.start("mortal", extra=extra)
    files = wait_until(lambda: len(list(piddir.iterdir())) == 3 and list(piddir.iterdir()),
                       what="the pid files of the server and its children")  # fmt: skip
    pids = {f.name.split(".")[0]: int(f.name.split(".")[1]) for f in files}
    guard = ppid(pids["server"])
    everyone = [pids["server"], pids["child"], pids["escapee"], guard]
    assert all(alive(p) for p in everyone), everyone
    if how == "shutdown":
        assert pod.stop() == 0
    elif how == "sigterm":
        pod.proc.send_signal(signal.SIGTERM)
        assert pod.proc.wait(20) == 0
    else:
        pod.kill9()
    wait_until(lambda: not any(alive(p) for p in everyone), timeout=15, what="no server process")


# --- streamable HTTP ---------------------------------------------------------------------------


class HttpServer:
    """The same test server over streamable HTTP on a free port."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, "--http", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        found: list[str] = []

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                if m := re.search(r"running on (http://127\.0\.0\.1:\d+)", line):
                    found.append(m[1])

        threading.Thread(target=read, daemon=True).start()
        base = wait_until(lambda: found and found[0], timeout=30, what="the HTTP MCP server")
        self.url = f"{base}/mcp"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def http_server() -> Iterator[HttpServer]:
    server = HttpServer()
    try:
        yield server
    finally:
        server.kill()


def test_streamable_http_tools_answer_fail_and_time_out(env: Env, http_server: HttpServer) -> None:
    env.model.script(
        {
            "tool_calls": [
                {"name": "web__add", "arguments": {"a": 20, "b": 22}},
                {"name": "web__fail", "arguments": {"message": "http boom"}},
                {"name": "web__slow", "arguments": {"seconds": 30}},
            ]
        },
        {"text": "http done"},
    )
    pod = env.start("httpuser", extra=server_toml("web", url=http_server.url, timeout=1))
    with pod.client() as c:
        assert c.run_wait("use the web tools").text == "http done"
    assert "web__add" in advertised_tools(env.model.requests[0]["body"])
    add, fail, slow = tool_results(pod)
    assert (add["output"], add["is_error"]) == ("42", False)
    assert fail["is_error"] and "http boom" in fail["output"]
    assert slow["is_error"] and "timed out after 1 s" in slow["output"]
    # Found by QA: the SDK's deprecation warning for the ping after the timeout went raw into
    # the pod's stderr (its stderr.log), out of the log's format.
    assert "Warning" not in "".join(pod.stderr), pod.stderr


def test_an_http_server_that_goes_away_fails_its_calls_and_is_retried_once(
    env: Env, http_server: HttpServer
) -> None:
    add = {"tool_calls": [{"name": "web__add", "arguments": {"a": 1, "b": 2}}]}
    env.model.script(add, {**add, "gate": "killed"}, add, {"text": "carried on"})
    pod = env.start("httplost", extra=server_toml("web", url=http_server.url, start_timeout=10))
    with pod.client() as c:
        run = c.run("call it while it dies")
        env.model.wait_for_requests(2)
        http_server.kill()
        env.model.open_gate("killed")
        c.subscribe(since=0)
        for event in c.events():
            if event.type == "run.finished" and event.run_id == run.run_id:
                assert event.data["outcome"] == "finished"
                break
    first, lost, after = tool_results(pod)
    assert (first["output"], first["is_error"]) == ("3", False)
    assert lost["is_error"] and "lost the connection during add" in lost["output"]
    assert after["is_error"] and "MCP server 'web' is not available" in after["output"]
    assert any("could not be restarted" in m for m in alerts(pod))


def test_cancelling_a_run_interrupts_an_mcp_call_and_the_server_stays_usable(env: Env) -> None:
    env.model.script(
        {"tool_calls": [{"name": "t__slow", "arguments": {"seconds": 60}}]},
        {"tool_calls": [{"name": "t__add", "arguments": {"a": 5, "b": 5}}]},
        {"text": "after the cancel"},
    )
    pod = env.start("canceller", extra=server_toml())
    with pod.client() as c:
        c.subscribe()
        run = c.run("start something slow")
        for event in c.events():
            if event.type == "tool.started":
                assert c.cancel(run.run_id).cancelled
            if event.type == "run.finished":
                assert event.data["outcome"] == "cancelled"
                break
        again = c.run_wait("now something quick")
    assert (again.outcome, again.text) == ("finished", "after the cancel")
    slow, add = tool_results(pod)
    assert slow["is_error"]
    assert (add["output"], add["is_error"]) == ("10", False)


@pytest.mark.parametrize(
    "args",
    [(), ("--refuse-first-initialize",), ("--banner",)],
    ids=["plain", "refuses-first-initialize", "banner-not-utf8"],
)
def test_a_hand_written_2025_era_server_works_too(env: Env, args: tuple[str, ...]) -> None:
    """Also one that refuses the pod's own `initialize` (the SDK negotiates on the same pipes),
    and one that prints a banner, not even UTF-8, on stdout first (the start-up handshake
    failed on it, where it skips other stray lines)."""
    env.model.script(
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "quiet please"}}]},
        {"text": "heard"},
    )
    extra = server_toml("old", script=LEGACY, args=args)
    pod = env.start("legacyuser", extra=extra)
    with pod.client() as c:
        assert c.run_wait("shout").text == "heard"
    [shout] = tool_results(pod)
    assert (shout["output"], shout["is_error"]) == ("QUIET PLEASE", False)


def test_tools_with_schemas_a_provider_refuses_are_left_out_and_the_others_work(
    env: Env,
) -> None:
    """Offered, such a tool would make the provider refuse every request of the pod; and the
    server's other tools must still answer (the SDK re-lists strictly on a first call)."""
    env.model.script(
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "still usable"}}]},
        {"text": "done"},
    )
    extra = server_toml("old", script=LEGACY, args=("--bad-schemas",))
    pod = env.start("picky", extra=extra)
    with pod.client() as c:
        assert c.run_wait("shout").outcome == "finished"
    offered = set(advertised_tools(env.model.requests[0]["body"]))
    assert {"old__shout", "old__nap"} <= offered
    assert not {"old__listy", "old__typo", "old__loose"} & offered
    [shout] = tool_results(pod)
    assert (shout["output"], shout["is_error"]) == ("STILL USABLE", False)
    warned = [a for a in alerts(pod) if "cannot be offered" in a]
    assert len(warned) == 3
    assert "'listy' cannot be offered to the model (its inputSchema has type 'array'" in warned[0]
    assert "inputSchema.properties.n.type 'int' is not a JSON type" in warned[1]
    assert "inputSchema.properties is not an object" in warned[2]


@pytest.mark.parametrize("kind", ["openai", "openai_responses"])
def test_a_tool_with_arrays_that_do_not_say_their_items_works_with_openai(
    env: Env, kind: str
) -> None:
    """OpenAI refuses an array schema without `items`, and the whole request with it (the fake
    model does as it does): found by QA, such a tool was offered as listed and every call of
    the pod failed. Its arrays are offered with `items: {}` (anything)."""
    env.model.script(
        {"tool_calls": [{"name": "old__tagger", "arguments": {"tags": ["a", "b"]}}]},
        {"text": "tagged"},
    )
    extra = server_toml("old", script=LEGACY, args=("--bare-arrays",))
    pod = env.start("tags", kind=kind, extra=extra)
    with pod.client() as c:
        assert c.run_wait("tag").outcome == "finished"
    [tagged] = tool_results(pod)
    assert (tagged["output"], tagged["is_error"]) == ("a,b", False)


def test_a_tool_listed_twice_and_a_name_clash_say_which_they_are(env: Env) -> None:
    """Both were 'its name is too long, or clashes once made safe'."""
    env.model.script({"text": "fine"})
    pod = env.start("twins", extra=server_toml("old", script=LEGACY, args=("--twins",)))
    warned = [a for a in alerts(pod) if "cannot be offered" in a]
    assert any("'shout' cannot be offered" in a and "lists it twice" in a for a in warned), warned
    clash = "'a_b' cannot be offered to the model (made safe, its name is that of 'a.b'"
    assert any(a.startswith(f"MCP server 'old': tool {clash}") for a in warned), warned
    assert "old__a_b" in advertised_tools(env.model.requests[0]["body"])  # the first one listed


@pytest.mark.parametrize("args", [(), ("--refuse-first-initialize",)], ids=["pod", "sdk"])
def test_a_server_that_ignores_the_list_cursor_is_listed_once(
    env: Env, args: tuple[str, ...]
) -> None:
    """Found by QA: a server that always sends a nextCursor but ignores it was listed 100
    times (MAX_PAGES), and each of its tools was a "listed twice" alert 99 times. Listed by
    the pod's handshake, or by the SDK when the server refuses it."""
    env.model.script(
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "once"}}]}, {"text": "ok"}
    )
    extra = server_toml("old", script=LEGACY, args=("--same-cursor", *args))
    pod = env.start("cursor", extra=extra)
    with pod.client() as c:
        assert c.run_wait("shout").outcome == "finished"
    assert [a for a in alerts(pod) if a.startswith("MCP server")] == []
    assert "old__nap" in advertised_tools(env.model.requests[0]["body"])
    (shout,) = tool_results(pod)
    assert (shout["output"], shout["is_error"]) == ("ONCE", False)


def test_more_tools_than_openai_takes_is_a_startup_warning_naming_the_fix(env: Env) -> None:
    """OpenAI refuses every request offering more than 128 tools, and one MCP server wrapping a
    whole API lists more: say so at start, where the user sees it, not at each failed run."""
    extra = server_toml("api", script=LEGACY, args=("--many", "130"))
    pod = env.start("crowded", extra=extra)
    (warning,) = [line for line in pod.text().splitlines() if "tools are offered" in line]
    assert warning.startswith("poddaemon: warning: ")
    assert "OpenAI's API refuses a request with more than 128" in warning
    assert "tools = [...] allow-list" in warning
    assert [a for a in alerts(pod) if "tools are offered" in a] == [warning.split(": ", 2)[2]]


def test_a_server_flooding_its_stderr_does_not_flood_the_pods_log(env: Env) -> None:
    """Its lines are logged up to a rate: a chatty server must not fill the disk the pod's
    session log is on. The pod and the server's tools carry on."""
    env.model.script(
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "heard"}}]},
        {"text": "done"},
    )
    extra = server_toml("old", script=LEGACY, args=("--stderr-flood", "8"))
    pod = env.start("flooded", extra=extra)
    with pod.client() as c:
        assert c.run_wait("shout").outcome == "finished"
    [shout] = tool_results(pod)
    assert (shout["output"], shout["is_error"]) == ("HEARD", False)
    said = "mcp[old] writes to stderr faster than it is logged: lines dropped"
    wait_until(lambda: said in pod.text(), what="the dropped-lines warning")  # (read by a thread)
    assert len(pod.text()) < 1024 * 1024


def test_podctl_spawn_shows_the_head_and_tail_of_a_flooding_servers_start_up(env: Env) -> None:
    """Found by QA: a successful spawn copied 256 KiB of a server's stderr to the terminal."""
    extra = server_toml("old", script=LEGACY, args=("--stderr-flood", "8"))
    spawned = env.podctl("spawn", str(env.manifest("floody", extra=extra)))
    try:
        assert spawned.returncode == 0, spawned.stderr[-2000:]
        lines = spawned.stderr.splitlines()
        assert len(lines) <= 41, len(lines)
        assert any("more lines (`podctl logs floody` has them all)" in x for x in lines), lines
    finally:
        env.podctl("stop", "floody")


def test_what_a_server_said_while_the_pod_started_is_in_the_pods_log(env: Env) -> None:
    """Found by QA: spawn showed the head and tail of a server's start-up stderr and said
    "`podctl logs` has them all", but only warnings said before READY reached the log: none
    of the server's lines, what one needs when it misbehaved at start."""
    said = 'for i in $(seq 60); do echo "early line $i" >&2; done; exec "$0" "$1"'
    extra = server_toml("talky").replace(
        json.dumps([sys.executable, SERVER]), json.dumps(["sh", "-c", said, sys.executable, SERVER])
    )
    spawned = env.podctl("spawn", str(env.manifest("talky", extra=extra)))
    try:
        assert spawned.returncode == 0, spawned.stderr[-2000:]
        assert "more lines (`podctl logs talky` has them all)" in spawned.stderr, spawned.stderr
        logs = env.podctl("logs", "talky").stdout
        early = [line for line in logs.splitlines() if "INFO mcp[talky] early line" in line]
        assert [line.rsplit(" ", 1)[1] for line in early] == [str(i) for i in range(1, 61)], logs
        assert logs.index("early line 60") < logs.index("ready on")  # said before READY
    finally:
        env.podctl("stop", "talky")


# How long podctl or a spawner waits for READY in the two tests below: more than a pod takes to
# say it is starting on a loaded machine (1 s was not, with the suite in two workers beside
# other work), less than the mute server's start_timeout, which they must wait out.
READY_WAIT = 4.0
MUTE_START_TIMEOUT = 6


def mute_server_manifest(env: Env, name: str) -> Path:
    """A pod whose one MCP server never answers `initialize`: READY waits its start_timeout
    (MUTE_START_TIMEOUT), then the pod starts without it."""
    mute = [sys.executable, "-c", "import time; time.sleep(600)"]
    extra = server_toml("mute", start_timeout=MUTE_START_TIMEOUT).replace(
        json.dumps([sys.executable, SERVER]), json.dumps(mute)
    )
    return env.manifest(name, extra=extra)


def test_podctl_spawn_waits_as_long_as_the_pods_mcp_servers_may_take(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """podctl gives a pod 30 s to be READY, and start_timeout is 30 s by default: it killed a
    pod whose server never answered, which would have started without it. Here 4 s and 6 s."""
    from cli.spawn import daemon_command, spawn_detached
    from protocol import PodClient

    monkeypatch.setenv("FAKE_API_KEY", "test-key")
    monkeypatch.setenv("PODDAEMON_FORKSERVER", "0")
    cmd = daemon_command(str(mute_server_manifest(env, "patient")), [], None, False)
    name, socket, early = spawn_detached(cmd, timeout=READY_WAIT)
    assert name == "patient"
    said = f"MCP server 'mute' failed to start: did not start within {MUTE_START_TIMEOUT} s"
    assert said.encode() in early
    assert b"PODDAEMON-STARTING" not in early  # podctl's own business, not a warning
    with PodClient.connect(socket, timeout=10) as c:
        assert c.status().state == "idle"
        c.shutdown()


async def test_a_spawner_waits_as_long_as_its_childs_mcp_servers_may_take(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a child of spawn_pod (it inherits its spawner's servers)."""
    from poddaemon import spawn

    monkeypatch.setattr(spawn, "READY_TIMEOUT", READY_WAIT)
    monkeypatch.setenv("FAKE_API_KEY", "test-key")
    manifest = str(mute_server_manifest(env, "kid"))
    started = await spawn._exec([*env.popen_args(), manifest])
    try:
        socket = await spawn._await_ready(started, manifest)
    finally:
        await started.kill()
    assert socket.endswith("/pods/kid/sock")


def test_a_server_that_closes_its_output_is_lost_at_once_not_at_the_timeout(env: Env) -> None:
    """Alive, but no answer can come: the call fails now (not after `timeout`, 60 s by
    default, as while the server and its guard kept leaked copies of their stdout) and the
    server is restarted."""
    env.model.script(
        {"tool_calls": [{"name": "old__hangup", "arguments": {}}]},
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "back"}}]},
        {"text": "done"},
    )
    extra = server_toml("old", script=LEGACY, timeout=20)
    pod = env.start("hungup", extra=extra)
    with pod.client(timeout=60) as c:
        assert c.run_wait("hang up").outcome == "finished"
    hangup, shout = tool_results(pod)
    assert hangup["is_error"] and "lost the connection during hangup" in hangup["output"]
    assert "timed out" not in hangup["output"]
    assert (shout["output"], shout["is_error"]) == ("BACK", False)  # restarted


def test_a_server_error_with_the_codes_the_sdk_uses_itself_is_the_servers_answer(
    env: Env,
) -> None:
    """-32000 (the usual "server error") and -32001 are also the codes the SDK raises for a
    gone or silent server: a server that sent them was taken for lost (restarted, then dead
    at the second) or for timed out (its words lost). It answered: the model gets its words."""
    codes = (-32000, -32000, -32001)
    calls = [{"name": "old__oops", "arguments": {"code": code}} for code in codes]
    env.model.script(
        *({"tool_calls": [call]} for call in calls),
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "fine"}}]},
        {"text": "done"},
    )
    pod = env.start("erred", extra=server_toml("old", script=LEGACY, timeout=30))
    with pod.client(timeout=60) as c:
        assert c.run_wait("err").outcome == "finished"
    *errors, shout = tool_results(pod)
    for result, code in zip(errors, codes, strict=True):
        assert result["is_error"], result
        assert f"refused oops: backend down ({code}) ({code})" in result["output"], result
    assert (shout["output"], shout["is_error"]) == ("FINE", False)
    status = pod.call("status")
    (server,) = status["mcp"]
    assert (server["state"], server["restarts"]) == ("ready", 0)
    outside = "MCP server 'old' (stdio) runs outside the sandbox"  # said, as SPEC §3 asks
    assert any(n.startswith(outside) for n in status["sandbox_notes"]), status["sandbox_notes"]


def test_a_reply_over_the_line_limit_fails_its_call_and_the_server_stays(env: Env) -> None:
    """Found by QA: a 70 MiB reply was taken for a lost connection ('Connection closed'): the
    server was restarted, and left dead at the second. The line is skipped and its call fails
    with the reason; the same server answers the next call."""
    env.model.script(
        {"tool_calls": [{"name": "old__heap", "arguments": {"mb": 70}}]},
        {"tool_calls": [{"name": "old__heap", "arguments": {"mb": 1}}]},
        {"text": "done"},
    )
    pod = env.start("heaped", extra=server_toml("old", script=LEGACY, timeout=60))
    with pod.client(timeout=120) as c:
        assert c.run_wait("heap").outcome == "finished"
    big, small = tool_results(pod)
    assert big["is_error"] and "over the 64 MiB limit; it was discarded" in big["output"], big
    assert not small["is_error"] and small["output"].startswith("xxxx"), small["output"][:200]
    assert_the_same_server_serves(pod)


def test_a_slow_tool_on_a_server_without_ping_only_times_out(env: Env) -> None:
    # The ping after a timeout is answered -32601 (method not found): an answer, so the
    # server is alive, not hung; it keeps its state and later calls go to it as before.
    env.model.script(
        {"tool_calls": [{"name": "old__nap", "arguments": {"seconds": 2}}]},
        {"tool_calls": [{"name": "old__nap", "arguments": {"seconds": 2}}]},
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "still here"}}]},
        {"text": "done"},
    )
    extra = server_toml("old", script=LEGACY, timeout=1)
    pod = env.start("napper", extra=extra)
    with pod.client(timeout=60) as c:
        assert c.run_wait("nap").outcome == "finished"
    nap1, nap2, shout = tool_results(pod)
    for nap in (nap1, nap2):
        assert nap["is_error"] and "timed out after 1 s (MCP server 'old'" in nap["output"], nap
    assert (shout["output"], shout["is_error"]) == ("STILL HERE", False)
    assert_the_same_server_serves(pod)


def test_a_hook_matcher_on_the_prefixed_name_blocks_an_mcp_tool(env: Env) -> None:
    env.model.script(
        {
            "tool_calls": [
                {"name": "srv__add", "arguments": {"a": 1, "b": 2}},
                {"name": "list_dir", "arguments": {"path": "."}},
            ]
        },
        {"text": "done"},
    )
    hook = (
        '\n[[hooks.PreToolUse]]\nmatcher = "srv__.*"\n'
        'command = "echo no MCP tools today >&2; exit 2"\n'
    )
    pod = env.start("hooked", tools=["list_dir"], extra=server_toml("srv") + hook)
    with pod.client() as c:
        assert c.run_wait("try both").outcome == "finished"
    add, listing = tool_results(pod)
    assert add["is_error"] and "no MCP tools today" in add["output"]
    assert not listing["is_error"]  # the matcher left the builtin tool alone


def test_a_server_starts_with_the_default_signal_dispositions(env: Env, tmp_path: Path) -> None:
    """The guard is Python, which ignores SIGPIPE and SIGXFSZ; a server it started inherited
    that (found by QA: `yes | head -1` in a shell server printed "Broken pipe" and its writer
    went on, where under Claude Code or a terminal SIGPIPE ends it). Commands get the defaults
    too (tools/runner_client.py)."""
    seen = tmp_path / "sigign"
    script = f"grep SigIgn /proc/self/status > {seen}; exec {sys.executable} {SERVER}"
    extra = f'\n[[mcp.servers]]\nname = "t"\ncommand = {json.dumps(["sh", "-c", script])}\n'
    env.start("sigdefault", extra=extra)
    ignored = int(seen.read_text().split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), seen.read_text()
    assert not ignored & (1 << (signal.SIGXFSZ - 1)), seen.read_text()


def test_a_reply_the_sdk_cannot_parse_fails_its_call_at_once(env: Env) -> None:
    """Found by QA: a result nested deeper than the SDK's JSON parser goes (~200 levels: a
    syntax tree, say) was dropped by the SDK; its call waited out the whole timeout and said
    it had timed out, though the server had answered at once. The call fails with the reason
    and the server stays."""
    env.model.script(
        {"tool_calls": [{"name": "old__tree", "arguments": {"depth": 400}}]},
        {"tool_calls": [{"name": "old__tree", "arguments": {"depth": 3}}]},
        {"text": "done"},
    )
    pod = env.start("treed", extra=server_toml("old", script=LEGACY, timeout=20))
    with pod.client(timeout=60) as c:
        assert c.run_wait("trees").outcome == "finished"
    deep, shallow = tool_results(pod)
    assert deep["is_error"] and "the server's reply cannot be read" in deep["output"], deep
    assert "timed out" not in deep["output"]
    assert (shallow["output"], shallow["is_error"]) == ("a tree", False)
    assert_the_same_server_serves(pod)


def test_a_tool_list_too_deep_to_read_fails_the_start_at_once_saying_why(env: Env) -> None:
    """Found by QA: a tools/list reply nested deeper than the pod's JSON decoder goes was
    skipped as a stray line; the start waited out `start_timeout` (READY with it) and then
    said the server 'did not start within 30 s', though it had answered at once."""
    extra = server_toml("old", script=LEGACY, args=("--deep-schema", "2000"), start_timeout=10)
    pod = env.start("deeplist", extra=extra)
    (warned,) = [a for a in alerts(pod) if "failed to start" in a]
    assert "tools/list: the server's reply cannot be read" in warned, warned
    assert "did not start within" not in warned


def test_a_server_whose_guard_was_killed_still_dies_with_the_pod(env: Env, tmp_path: Path) -> None:
    """Found by QA: with its guard killed (kill -9, the OOM killer), a server that ignores EOF
    on stdin outlived the pod's stop: only the guard's group kill would have ended it, and the
    pod skipped its own once the guard was reaped."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    extra = server_toml(args=("--ignore-eof",), env={"MCP_TEST_PIDDIR": str(piddir)})
    pod = env.start("orphaned", extra=extra)
    (file,) = wait_until(lambda: list(piddir.iterdir()), what="the server's pid file")
    server = int(file.name.split(".")[1])
    try:
        guard = ppid(server)
        os.kill(guard, signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{guard}"), what="the guard reaped")
        assert pod.stop() == 0
        wait_until(lambda: not alive(server), timeout=15, what="the server gone with the pod")
    finally:
        if alive(server):
            os.kill(server, signal.SIGKILL)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--no-server-info",), "initialize: serverInfo is not an object with a name"),
        (("--unknown-version",), "initialize: the server answers with protocol version '1999"),
    ],
)
def test_an_initialize_answer_the_sdk_cannot_take_on_fails_the_start(
    env: Env, args: tuple[str, ...], why: str
) -> None:
    """Found by QA: the handshake took any result; the server was listed as ready and its
    tools offered, then every call failed ('version must be a known protocol version') while
    status still said ready, or the server 'died' twice and its first call waited 35 s."""
    env.model.script({"text": "fine"})
    pod = env.start("badinit", extra=server_toml("old", script=LEGACY, args=args))
    (warned,) = [a for a in alerts(pod) if "failed to start" in a]
    assert why in warned, warned
    assert not any(t.startswith("old__") for t in advertised_tools(env.model.requests[0]["body"]))
    (server,) = pod.call("status")["mcp"]
    assert server["state"] == "failed"


async def test_a_call_waiting_for_the_sdk_session_ends_when_the_server_dies_first() -> None:
    """Found by QA: a call made between READY and the SDK's session (the SDK is imported
    meanwhile) waited for that session alone; a server that died before it had one (here:
    the SDK refuses its capabilities) left the call waiting start_timeout + 5 s, though the
    server was restarted, and dead, within moments."""
    from poddaemon.config.manifest import McpServerConfig
    from poddaemon.mcp.connection import McpConnection
    from poddaemon.mcp.env import server_env

    sdk: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    cfg = McpServerConfig(
        name="old", command=[sys.executable, LEGACY, "--bad-capabilities"], start_timeout=60
    )
    conn = McpConnection(cfg, server_env({}, os.environ), "/", lambda: sdk, lambda *a: None)
    await conn.start()
    try:
        assert (conn.state, "old__shout" in conn.tools) == ("ready", True)
        call = asyncio.ensure_future(conn.call("shout", {"text": "hi"}))
        await asyncio.sleep(0)  # the call waits for the session, which waits for the SDK
        assert not call.done()
        sdk.set_result(None)
        async with asyncio.timeout(30):  # a hang guard: it was 65 s
            result = await call
        assert result.is_error and "MCP server 'old' is not available" in result.output
        assert conn.state == "dead"
    finally:
        await conn.aclose()


async def test_a_server_that_misses_its_start_timeout_is_killed_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by QA: a server that did not start within start_timeout was given the 2 s a
    closing server gets to exit after EOF (this one does not read stdin): READY came 2 s
    after the timeout the warning named. With that grace (and the wait for its clean-up) made
    an hour, the server still goes at once: it is killed, not waited for."""
    from poddaemon.config.manifest import McpServerConfig
    from poddaemon.mcp import connection
    from poddaemon.mcp.connection import McpConnection, StartFailed
    from poddaemon.mcp.env import server_env
    from poddaemon.mcp.stdio import StdioProcess

    monkeypatch.setattr(StdioProcess.stop, "__defaults__", (3600.0,))
    monkeypatch.setattr(connection, "GIVE_UP", 3600.0)
    pid_file = tmp_path / "pid"
    code = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(9999)"
    )
    cfg = McpServerConfig(name="late", command=[sys.executable, "-c", code], start_timeout=1)
    sdk: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    conn = McpConnection(cfg, server_env({}, os.environ), "/", lambda: sdk, lambda *a: None)
    start = asyncio.create_task(conn.start())
    try:
        for _ in range(3000):  # up to 30 s: the old code left it running for the hour
            if pid_file.exists() and _process_state(int(pid_file.read_text())) in (None, "Z"):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the server that missed its start_timeout is still running")
        with pytest.raises(StartFailed, match="did not start within 1 s"):
            await start
    finally:
        start.cancel()
        monkeypatch.undo()
        await conn.aclose()


def _process_state(pid: int) -> str | None:
    """The state letter of process `pid` (None when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


def test_an_http_answer_over_the_size_limit_fails_its_call_and_the_server_stays(
    env: Env,
) -> None:
    """Found by QA: the SDK reads a JSON body whole, however long; a server streaming one
    without end took the pod ~280 MiB of memory a second until the call's timeout. A body is
    held to the stdio limit (64 MiB): its call fails saying so, the server stays."""
    proc = subprocess.Popen(
        [sys.executable, RAW_HTTP], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        env.model.script(
            {"tool_calls": [{"name": "raw__huge", "arguments": {"mb": 70}}]},
            {"tool_calls": [{"name": "raw__echo", "arguments": {}}]},
            {"text": "done"},
        )
        pod = env.start("rawhttp", extra=server_toml("raw", url=url, timeout=60))
        with pod.client(timeout=120) as c:
            assert c.run_wait("huge").outcome == "finished"
        huge, echo = tool_results(pod)
        assert huge["is_error"] and "over the 64 MiB limit; it was discarded" in huge["output"]
        assert (echo["output"], echo["is_error"]) == ("echoed", False)
        assert_the_same_server_serves(pod)
    finally:
        proc.kill()
        proc.wait()


def test_a_busy_server_that_keeps_talking_is_not_taken_for_hung(env: Env) -> None:
    """Found by QA: a single-threaded server logging progress while it works cannot answer the
    ping sent after a call's timeout; it was taken for hung and restarted (its one restart
    spent) though it was talking all along. What it sent during the ping says it is alive:
    the call only times out, and the same server answers the next call."""
    env.model.script(
        {"tool_calls": [{"name": "old__chat", "arguments": {"seconds": 6}}]},
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "still here"}}]},
        {"text": "done"},
    )
    pod = env.start("chatter", extra=server_toml("old", script=LEGACY, timeout=3))
    with pod.client(timeout=60) as c:
        assert c.run_wait("chat").outcome == "finished"
    chat, shout = tool_results(pod)
    assert chat["is_error"] and "timed out after 3 s (MCP server 'old'" in chat["output"], chat
    assert (shout["output"], shout["is_error"]) == ("STILL HERE", False)
    assert_the_same_server_serves(pod)


@contextlib.contextmanager
def raw_http_server(*args: str) -> Iterator[str]:
    """mcp_raw_http_server.py with `args`, running: its URL."""
    proc = subprocess.Popen(
        [sys.executable, RAW_HTTP, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def test_an_http_server_that_refuses_says_its_http_status(env: Env) -> None:
    """Found by QA: the SDK turns any HTTP error status but 404 into "Server returned an error
    response", so a required server that wanted a token failed the pod's start saying only
    that (no 401, nothing to go on), and so did a call the server refused (403, 500)."""
    with raw_http_server("--refuse", "401") as url, pytest.raises(StartFailed) as failed:
        env.start("refused", extra=server_toml("gate", url=url, required=True))
    assert "required MCP server 'gate' failed to start" in failed.value.stderr
    assert "the server answered HTTP 401 Unauthorized" in failed.value.stderr

    env.model.script(
        {"tool_calls": [{"name": "raw__deny", "arguments": {}}]},
        {"tool_calls": [{"name": "raw__echo", "arguments": {}}]},
        {"text": "done"},
    )
    with raw_http_server() as url:
        pod = env.start("denied", extra=server_toml("raw", url=url))
        with pod.client(timeout=60) as c:
            assert c.run_wait("deny").outcome == "finished"
        deny, echo = tool_results(pod)
        assert_the_same_server_serves(pod)
    assert deny["is_error"] and "the server answered HTTP 403 Forbidden" in deny["output"], deny
    assert (echo["output"], echo["is_error"]) == ("echoed", False)
    assert "answered HTTP" not in echo["output"]


def shout_once(env: Env, name: str, args: tuple[str, ...], timeout: float) -> PodProcess:
    """A pod whose legacy server runs with `args` answers one `shout` call rightly."""
    env.model.script(
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "heard"}}]}, {"text": "ok"}
    )
    pod = env.start(name, extra=server_toml("old", script=LEGACY, args=args, timeout=timeout))
    with pod.client(timeout=120) as c:
        assert c.run_wait("shout").outcome == "finished"
    (shout,) = tool_results(pod)
    assert (shout["output"], shout["is_error"]) == ("HEARD", False)
    return pod


def test_a_flood_of_notifications_the_sdk_cannot_read_does_not_flood_the_log(env: Env) -> None:
    """Found by QA: the SDK logs a warning with a ~17-line traceback for each notification it
    cannot validate; a server sending 3,000 put 51,000 lines (4 MB) in the pod's log, past
    the limit its stderr has. The SDK's records are rate-limited: the call still answers."""
    pod = shout_once(env, "badnotes", ("--bad-notes", "2000"), timeout=60)
    logged = "".join(pod.stderr)
    assert logged.count("Failed to validate notification") <= 25, len(pod.stderr)
    assert "the MCP SDK logs faster than it is logged: records dropped" in logged
    assert len(pod.stderr) < 1000, len(pod.stderr)


def test_a_server_printing_debug_lines_on_stdout_does_not_keep_the_pod_busy(env: Env) -> None:
    """Found by QA: each line on stdout that is no JSON-RPC (a logger writing to stdout) cost
    the pod ~0.2 ms: the SDK parsed it, failed, and spawned a task to drop it. 100,000 such
    lines in one call kept the pod busy ~18 s, past this call's timeout; skipped, ~2 s."""
    pod = shout_once(env, "junk", ("--stdout-junk", "100000"), timeout=10)
    assert_the_same_server_serves(pod)


@contextlib.contextmanager
def batch_server(kind: str) -> Iterator[tuple[str, str]]:
    """A server answering every message in JSON-RPC batches, over `kind`: its
    [[mcp.servers]] entry (named "b") and the name of its tool that echoes `text`."""
    if kind in ("pod", "sdk"):  # stdio, its start listed by the pod's handshake or the SDK
        args = ("--batch-replies", *(("--refuse-first-initialize",) if kind == "sdk" else ()))
        yield server_toml("b", script=LEGACY, args=args, timeout=20), "shout"
        return
    with raw_http_server("--batch", kind) as url:
        yield server_toml("b", url=url, timeout=20), "echo"


@pytest.mark.parametrize("kind", ["pod", "sdk", "json", "sse"])
def test_a_server_answering_in_json_rpc_batches_is_understood(env: Env, kind: str) -> None:
    """Found by QA: a batch (an array of messages, legal in JSON-RPC 2.0 and in MCP
    2025-03-26) was unreadable to the pod. Over stdio the start waited out start_timeout (the
    handshake skipped it) or failed (the SDK's negotiation), and a call answered in one
    failed; over HTTP, in a JSON body or an SSE event, the start failed ("Failed to parse").
    Its messages are taken one by one."""
    with batch_server(kind) as (extra, tool):
        env.model.script(
            {"tool_calls": [{"name": f"b__{tool}", "arguments": {"text": "echoed"}}]},
            {"text": "done"},
        )
        pod = env.start("batched", extra=extra)
        with pod.client(timeout=60) as c:
            assert c.run_wait("echo").outcome == "finished"
        (echo,) = tool_results(pod)
        assert_the_same_server_serves(pod)
    assert (echo["output"].lower(), echo["is_error"]) == ("echoed", False), echo


def test_a_reply_with_neither_result_nor_error_fails_its_call_only(env: Env) -> None:
    """A message with the call's id but neither `result` nor `error` is the server breaking
    the protocol on that call: the call fails saying so, the server stays."""
    env.model.script(
        {"tool_calls": [{"name": "old__blank", "arguments": {}}]},
        {"tool_calls": [{"name": "old__shout", "arguments": {"text": "still here"}}]},
        {"text": "done"},
    )
    pod = env.start("blanked", extra=server_toml("old", script=LEGACY, timeout=20))
    with pod.client(timeout=60) as c:
        assert c.run_wait("blank").outcome == "finished"
    blank, shout = tool_results(pod)
    assert blank["is_error"], blank
    said = "MCP server 'old' broke the protocol on blank: its reply has neither a result nor an"
    assert blank["output"].startswith(said), blank["output"]
    assert (shout["output"], shout["is_error"]) == ("STILL HERE", False)
    assert_the_same_server_serves(pod)


def test_a_tool_list_with_neither_result_nor_error_fails_the_start_at_once(env: Env) -> None:
    """It was skipped as a stray line: the start waited out start_timeout, and said the
    server 'did not start' though it had answered."""
    extra = server_toml("old", script=LEGACY, args=("--blank-list",), start_timeout=20)
    pod = env.start("blanklist", extra=extra)
    (warned,) = [a for a in alerts(pod) if "failed to start" in a]
    assert "tools/list: the server's reply has neither a result nor an error" in warned, warned


@pytest.mark.parametrize(
    ("tool", "why"),
    [
        ("drop", "the connection closed (RemoteProtocolError"),
        ("cut", "the connection closed (RemoteProtocolError"),
        ("sse_end", "its event stream ended without it"),
        ("sse_cut", "the connection closed (RemoteProtocolError"),
    ],
)
def test_an_http_call_whose_connection_drops_unanswered_fails_alone(
    env: Env, tool: str, why: str
) -> None:
    """Found by QA: one POST the server closed without an answer (a proxy's idle timeout, a
    worker recycled), or in the middle of it, broke the SDK's whole transport: the server was
    taken for dead and its one restart spent. It costs that call; the server, still
    answering, is kept. (An SSE answer that ended without the reply cost only the call, but
    said the server had "refused" it.)"""
    env.model.script(
        {"tool_calls": [{"name": f"raw__{tool}", "arguments": {}}]},
        {"tool_calls": [{"name": "raw__echo", "arguments": {}}]},
        {"text": "done"},
    )
    with raw_http_server() as url:
        pod = env.start("dropped", extra=server_toml("raw", url=url, timeout=20))
        with pod.client(timeout=60) as c:
            assert c.run_wait("drop").outcome == "finished"
        drop, echo = tool_results(pod)
        assert_the_same_server_serves(pod)
    assert drop["is_error"], drop
    said = f"MCP server 'raw' gave no answer to {tool}: {why}"
    assert drop["output"].startswith(said), drop["output"]
    assert "may or may not have taken effect" in drop["output"]
    assert (echo["output"], echo["is_error"]) == ("echoed", False)


def test_an_http_tool_list_whose_connection_drops_is_asked_again(env: Env) -> None:
    """tools/list changes nothing: one whose connection dropped unanswered is sent again,
    once, and the server starts (it failed to start)."""
    env.model.script(
        {"tool_calls": [{"name": "raw__echo", "arguments": {}}]},
        {"text": "done"},
    )
    with raw_http_server("--drop-first-list") as url:
        pod = env.start("relisted", extra=server_toml("raw", url=url, timeout=20))
        with pod.client(timeout=60) as c:
            assert c.run_wait("echo").outcome == "finished"
        (echo,) = tool_results(pod)
        assert_the_same_server_serves(pod)
    assert (echo["output"], echo["is_error"]) == ("echoed", False)


@pytest.mark.parametrize("args", [(), ("--batch", "json"), ("--batch", "sse"),
                                  ("--batch", "json", "--gzip"), ("--batch", "sse", "--gzip")],
                         ids=["json", "json-batch", "sse-batch", "gzip-json-batch",
                              "gzip-sse-batch"])  # fmt: skip
def test_an_http_reply_with_neither_result_nor_error_fails_its_call_only(
    env: Env, args: tuple[str, ...]
) -> None:
    """As over stdio: it failed as "refused", with the SDK's four validation errors (and
    their traceback in the pod's log)."""
    env.model.script(
        {"tool_calls": [{"name": "raw__blank", "arguments": {}}]},
        {"tool_calls": [{"name": "raw__echo", "arguments": {}}]},
        {"text": "done"},
    )
    with raw_http_server(*args) as url:
        pod = env.start("httpblank", extra=server_toml("raw", url=url, timeout=20))
        with pod.client(timeout=60) as c:
            assert c.run_wait("blank").outcome == "finished"
        blank, echo = tool_results(pod)
        assert_the_same_server_serves(pod)
    assert blank["is_error"], blank
    said = "MCP server 'raw' broke the protocol on blank: its reply has neither a result nor an"
    assert blank["output"].startswith(said), blank["output"]
    assert (echo["output"], echo["is_error"]) == ("echoed", False)
    assert "Traceback" not in pod.text()


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_result_that_is_not_an_object_fails_its_call_saying_so(env: Env, transport: str) -> None:
    """A tools/call answered `"result": null` (or a list, a string, a number): the call
    failed with the SDK's validation errors for every shape a message may take, as if the
    server could not be read. It is the server breaking the protocol on that call: said so,
    with what the result was; the server stays."""
    shapes = [None, [], "done", 5]
    good, answer = ("s__echo", "echoed") if transport == "http" else ("s__shout", "STILL HERE")
    env.model.script(
        *({"tool_calls": [{"name": "s__blank", "arguments": {"result": r}}]} for r in shapes),
        {"tool_calls": [{"name": good, "arguments": {"text": "still here"}}]},
        {"text": "done"},
    )
    with contextlib.ExitStack() as stack:
        if transport == "http":
            extra = server_toml("s", url=stack.enter_context(raw_http_server()), timeout=20)
        else:
            extra = server_toml("s", script=LEGACY, timeout=20)
        pod = env.start(f"nulled{transport}", extra=extra)
        with pod.client(timeout=60) as c:
            assert c.run_wait("null results").outcome == "finished"
        *nulled, last = tool_results(pod)
        assert_the_same_server_serves(pod)
    said = "MCP server 's' broke the protocol on blank: its result is "
    for item, what in zip(nulled, ["null", "an array", "a string", "a number"], strict=True):
        assert item["is_error"], item
        assert item["output"].startswith(f"{said}{what}, not an object"), item["output"]
    assert (last["output"], last["is_error"]) == (answer, False), last
    assert "Traceback" not in pod.text()


def test_a_server_whose_replies_are_not_json_rpc_2_fails_the_start(env: Env) -> None:
    """Found by QA: replies without `"jsonrpc": "2.0"` were taken by the start-up handshake,
    the server listed and its tools offered, status "ready"; then the SDK refused each reply
    and every call failed ("cannot be read (7 validation errors...)")."""
    env.model.script({"text": "fine"})
    pod = env.start("nojsonrpc", extra=server_toml("old", script=LEGACY, args=("--no-jsonrpc",)))
    (warned,) = [a for a in alerts(pod) if "failed to start" in a]
    assert "initialize: the server's reply is not JSON-RPC 2.0" in warned, warned
    assert not any(t.startswith("old__") for t in advertised_tools(env.model.requests[0]["body"]))
    (server,) = pod.call("status")["mcp"]
    assert server["state"] == "failed"
