"""`podctl mcp-serve` driven by the `mcp` SDK's own client, as Claude Code or any MCP client
would: list its tools, send work to a real pod and get the answer, notify it, read it."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from poddaemon import __version__
from tests.conftest import (
    PAUSABLE,
    ROOT,
    Env,
    PodProcess,
    paused_at_a_safe_point,
    wait_until,
)

TOOLS = {"list_pods", "send_to_pod", "notify_pod", "pod_status", "pod_history"}


def result_data(result: Any) -> Any:
    """A tool result's value: structured content when the server sent it, else its text."""
    if result.structured_content is not None:
        data = result.structured_content
        return data.get("result", data) if set(data) == {"result"} else data
    return json.loads(result.content[0].text)


def serve(env: Env, *args: str) -> Any:
    """`podctl mcp-serve` as an MCP client starts it: a stdio server in this test's home."""
    from mcp import StdioServerParameters

    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "cli.main", "mcp-serve", *args],
        env=env.env,
        cwd=str(ROOT),
    )


async def test_an_mcp_client_drives_pods_through_mcp_serve(env: Env) -> None:
    from mcp import Client

    env.model.script({"text": "the answer is 42"})
    pod = env.start("worker")
    async with Client(serve(env)) as client:
        assert client.server_info is not None
        assert (client.server_info.name, client.server_info.version) == ("poddaemon", __version__)
        listed = await client.list_tools()
        assert {t.name for t in listed.tools} == TOOLS
        send = next(t for t in listed.tools if t.name == "send_to_pod")
        assert {"pod", "message", "wait"} <= set(send.input_schema["properties"])
        # Descriptions as written, not with the docstrings' indentation (found by QA).
        assert send.description is not None and "\n        " not in send.description
        assert "\n(finished, limit_reached" in send.description, send.description

        pods = result_data(await client.call_tool("list_pods", {}))
        assert [(p["name"], p["state"]) for p in pods] == [("worker", "idle")]

        answer = await client.call_tool("send_to_pod", {"pod": "worker", "message": "question?"})
        assert not answer.is_error
        assert result_data(answer)["outcome"] == "finished"
        assert result_data(answer)["text"] == "the answer is 42"

        queued = result_data(
            await client.call_tool(
                "send_to_pod", {"pod": "worker", "message": "later", "wait": False}
            )
        )
        assert queued["run_id"] and queued["state"] in ("started", "queued")

        note = await client.call_tool(
            "notify_pod", {"pod": "worker", "message": "the build is green", "source": "ci"}
        )
        assert not note.is_error and result_data(note)["notification_id"]

        def notified() -> bool:
            entries = pod.call("history")["entries"]
            return any("the build is green" in json.dumps(e) for e in entries)

        wait_until(notified, what="the notification in the pod's history")

        status = result_data(await client.call_tool("pod_status", {"pod": "worker"}))
        assert status["name"] == "worker" and status["model"] == "fake-model"

        history = result_data(await client.call_tool("pod_history", {"pod": "worker", "limit": 5}))
        assert history["entries"][0]["kind"] == "session_start" and history["next"] >= 5
        assert any(e.get("text") == "question?" for e in pod.call("history")["entries"])

        missing = await client.call_tool("send_to_pod", {"pod": "ghost", "message": "hi"})
        assert missing.is_error and "pod 'ghost' is not running" in missing.content[0].text


def test_podctl_start_up_does_not_import_the_mcp_sdk(env: Env) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cli.main", "--help"],
        cwd=ROOT,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "mcp-serve" in proc.stdout
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "typer" in imported
    assert not {m for m in imported if m.split(".")[0] in ("mcp", "mcp_types", "pydantic")}


async def test_a_pod_is_named_never_given_as_a_socket_path(env: Env) -> None:
    """The client's model picks `pod`: a path would let it make mcp-serve write to any socket
    of this user's (another home's pod, an agent, a fork server)."""
    from mcp import Client

    pod = env.start("worker")
    async with Client(serve(env)) as client:
        for target in (pod.socket, "../worker", "worker/"):
            for tool, args in (
                ("send_to_pod", {"message": "through a path", "wait": False}),
                ("notify_pod", {"message": "through a path"}),
                ("pod_status", {}),
            ):
                result = await client.call_tool(tool, {"pod": target, **args})
                assert result.is_error, (tool, target)
                assert f"{target!r} is not a pod name" in result.content[0].text
    assert "through a path" not in json.dumps(pod.call("history")["entries"])


async def test_a_stopped_pod_is_a_tool_error_after_the_timeout_not_a_hang(env: Env) -> None:
    from mcp import Client

    pod = env.start("frozen")
    os.kill(pod.proc.pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(30), Client(serve(env, "--timeout", "1")) as client:
            for tool, args in (
                ("pod_status", {}),
                ("pod_history", {}),
                ("notify_pod", {"message": "anyone there?"}),
                ("send_to_pod", {"message": "anyone there?", "wait": False}),
            ):
                result = await client.call_tool(tool, {"pod": "frozen", **args})
                assert result.is_error, tool
                text = result.content[0].text
                assert "pod 'frozen' did not answer within 1 s: it is stopped or stuck" in text
                assert ("may still reach it when it resumes" in text) == ("message" in args)
            # A waited send is not bounded once the pod has the message (a run takes hours),
            # but it hung on a stopped pod that never got it (found by QA).
            result = await client.call_tool("send_to_pod", {"pod": "frozen", "message": "hi"})
            assert result.is_error
            assert result.content[0].text.endswith(
                "pod 'frozen' did not answer within 1 s: it is stopped or stuck "
                "(podctl logs frozen); nothing was sent"
            )
            listed = result_data(await client.call_tool("list_pods", {}))
            assert listed == [{"name": "frozen", "state": "unresponsive"}]
    finally:
        os.kill(pod.proc.pid, signal.SIGCONT)
    assert "hi" not in [e.get("text") for e in pod.call("history")["entries"]]


async def test_a_send_to_a_pod_still_starting_waits_until_it_listens(env: Env) -> None:
    """Found by QA: list_pods said "starting", and notify_pod and send_to_pod said "not
    running" at once, where `podctl notify` waited and got through. They wait for it now, as
    podctl does, within --timeout; other tools say it is starting, as podctl does."""
    from mcp import Client

    hang = json.dumps([sys.executable, "-c", "import time; time.sleep(600)"])
    extra = f'[[mcp.servers]]\nname = "slow"\ncommand = {hang}\nstart_timeout = 8\n'
    pod = PodProcess(env.popen(str(env.manifest("slowmcp", extra=extra))), "slowmcp")
    env.pods.append(pod)
    pid_file = env.home / "run" / "pods" / "slowmcp" / "pid"
    await asyncio.to_thread(wait_until, pid_file.exists, 20, "the pod's claim")
    async with asyncio.timeout(60):
        async with Client(serve(env, "--timeout", "1")) as client:
            listed = result_data(await client.call_tool("list_pods", {}))
            assert listed == [{"name": "slowmcp", "state": "starting"}]
            status = await client.call_tool("pod_status", {"pod": "slowmcp"})
            assert status.is_error and status.content[0].text.endswith(
                "pod 'slowmcp' is starting: its socket does not listen yet (podctl wait slowmcp)"
            )
            early = await client.call_tool("notify_pod", {"pod": "slowmcp", "message": "early"})
            assert early.is_error and early.content[0].text.endswith(
                "pod 'slowmcp' is still starting after 1 s: its socket does not listen yet "
                "(podctl wait slowmcp); nothing was sent"
            )
        async with Client(serve(env, "--timeout", "30")) as client:
            note = await client.call_tool("notify_pod", {"pod": "slowmcp", "message": "build 7"})
            assert not note.is_error, note.content[0].text
            sent = await client.call_tool(
                "send_to_pod", {"pod": "slowmcp", "message": "a task", "wait": False}
            )
            assert not sent.is_error, sent.content[0].text
    await asyncio.to_thread(pod.wait_ready)  # (READY is long said: this reads its socket)
    texts = [e.get("text") for e in pod.call("history")["entries"]]
    assert "build 7" in texts and "a task" in texts and "early" not in texts


async def test_list_pods_lists_live_pods_not_the_sockets_killed_ones_left(env: Env) -> None:
    """A pod killed with -9 leaves its socket file: list_pods showed it as "not running",
    where `podctl ls` (and the tool's own description) list live pods only."""
    from mcp import Client

    for name in ("alive", "dead"):
        (env.work / name).mkdir()
    env.start("alive", write=[str(env.work / "alive")])
    dead = env.start("dead", write=[str(env.work / "dead")])
    dead.kill9()
    assert os.path.exists(dead.socket)
    async with Client(serve(env)) as client:
        listed = result_data(await client.call_tool("list_pods", {}))
    assert [(p["name"], p["state"]) for p in listed] == [("alive", "idle")]


async def test_a_pod_that_dies_during_send_to_pod_is_a_tool_error(env: Env) -> None:
    from mcp import Client

    env.model.script({"text": "never sent", "gate": "never"})
    pod = env.start("doomed")
    async with Client(serve(env)) as client:
        call = asyncio.ensure_future(
            client.call_tool("send_to_pod", {"pod": "doomed", "message": "work"})
        )
        await asyncio.to_thread(env.model.wait_for_requests, 1)  # the run is under way
        pod.kill9()
        result = await asyncio.wait_for(call, 30)
        assert result.is_error
        assert result.content[0].text.endswith(
            "pod 'doomed' closed the connection before answering: it stopped, or crashed"
        )
        gone = await client.call_tool("pod_status", {"pod": "doomed"})
        assert gone.is_error and "pod 'doomed' is not running" in gone.content[0].text


async def test_a_waited_send_to_a_paused_pod_is_refused_saying_so(env: Env) -> None:
    """Found by QA: the call hung until someone resumed the pod, its MCP client's model with
    it, not knowing why (`podctl send` says so). Nothing is sent; wait=false still queues."""
    from mcp import Client

    env.model.script(PAUSABLE, {"text": "resumed"})
    pod = env.start("napper")
    paused_at_a_safe_point(env, pod)
    async with Client(serve(env)) as client:
        refused = await asyncio.wait_for(
            client.call_tool("send_to_pod", {"pod": "napper", "message": "more work"}), 30
        )
        assert refused.is_error
        assert refused.content[0].text.endswith(
            "pod 'napper' is paused: a run sent now waits until `podctl resume napper`; nothing "
            "was sent (send it with wait=false to queue it)"
        )
        queued = await client.call_tool(
            "send_to_pod", {"pod": "napper", "message": "later", "wait": False}
        )
        assert not queued.is_error and result_data(queued)["state"] == "queued"
    assert pod.call("status")["queue"]["runs"] == 1  # the queued one, not the refused one


async def test_a_home_others_can_write_in_is_refused_as_podctl_refuses_it(env: Env) -> None:
    from mcp import Client

    env.start("worker")
    os.chmod(env.home, 0o777)
    try:
        async with Client(serve(env)) as client:
            for tool, args in (("list_pods", {}), ("pod_status", {"pod": "worker"})):
                result = await client.call_tool(tool, args)
                assert result.is_error, tool
                assert f"home directory {env.home} is writable by group or others" in (
                    result.content[0].text
                )
    finally:
        os.chmod(env.home, 0o700)


async def test_pod_history_pages_the_session_a_compaction_continued(env: Env) -> None:
    """After a compaction, `pod_history` named the `previous` session but had no way to read
    it: the client's model lost everything before the compaction (podctl has `--session`)."""
    from mcp import Client

    pod = env.start("worker")
    with pod.client() as c:
        c.run_wait("said before the compaction")
        old = c.status().session_id
    env.model.script_when("Your context is about to be compacted", {"text": "SUMMARY"})
    assert env.podctl("compact", "worker").returncode == 0
    async with Client(serve(env)) as client:
        now = result_data(await client.call_tool("pod_history", {"pod": "worker"}))
        assert now["previous"] == old and now["session_id"] != old
        back = await client.call_tool("pod_history", {"pod": "worker", "session_id": old})
        assert not back.is_error, back.content[0].text
        entries = result_data(back)["entries"]
        assert any(e.get("text") == "said before the compaction" for e in entries)
        other = await client.call_tool("pod_history", {"pod": "worker", "session_id": "nope"})
        assert other.is_error and "no session nope" in other.content[0].text


async def test_pod_history_replies_are_cut_to_a_size_and_page_on(env: Env) -> None:
    """Found by QA: `pod_history limit=1000` of 45 notifications of 200 KB was one 18 MB MCP
    message. A reply holds about 64 KiB of entries; `cut` says so, `next` pages on, and
    paging reads every entry once. One entry bigger than that comes alone: paging goes on."""
    from mcp import Client

    pod = env.start("talker")
    notes = [f"{i} " + "x" * 30_000 for i in range(8)] + ["big " + "y" * 100_000, "last"]
    with pod.client() as c:
        for note in notes:
            c.notify(note)
    read: list[str] = []
    pages: list[tuple[int, int]] = []  # each reply's size and entries
    since = 0
    async with Client(serve(env)) as client:
        for _ in range(20):
            result = await client.call_tool(
                "pod_history", {"pod": "talker", "since": since, "limit": 1000}
            )
            page = result_data(result)
            pages.append((len(result.content[0].text), len(page["entries"])))
            read += [e["text"] for e in page["entries"] if e["kind"] == "system_item"]
            assert page["entries"][-1]["seq"] == page["next"]
            if "cut" not in page:
                break
            assert page["cut"].endswith(f"call again with since={page['next']}")
            since = page["next"]
    assert read == notes
    assert page["next"] == page["last_seq"]
    # (a reply's text is the entries' JSON, indented)
    assert all(size < 100_000 or entries == 1 for size, entries in pages), pages
    assert len(pages) >= 5, pages


def test_a_line_the_sdk_cannot_read_is_answered_and_the_server_stays(env: Env) -> None:
    """Found by QA: the SDK's stdio transport dropped a line it could not read without a word,
    so a client whose request had one bad field (`"params": []`, `"jsonrpc": "1.0"`), or was
    no JSON, waited for its answer for ever. Each gets its JSON-RPC error, under its id when
    it has one; notifications and responses stay unanswered; the next request is served."""
    client = {"name": "t", "version": "1"}
    init = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": client}
    lines = [
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init}),
        json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        "not json at all",
        json.dumps({"jsonrpc": "2.0", "id": 2, "method": "ping", "params": []}),
        json.dumps({"jsonrpc": "1.0", "id": "three", "method": "ping"}),
        json.dumps({"id": 4}),
        json.dumps([{"jsonrpc": "2.0", "id": 5, "method": "ping"}]),
        json.dumps({"jsonrpc": "2.0", "method": "notifications/x", "params": []}),
        json.dumps({"jsonrpc": "2.0", "id": 6, "result": [], "extra": 1, "error": 1}),
        "",
        json.dumps({"jsonrpc": "2.0", "id": 7, "method": "ping"}),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "mcp-serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env.env,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    watchdog = threading.Timer(60, proc.kill)  # a reply that never comes ends the reads below
    watchdog.start()
    try:
        proc.stdin.write("\n".join(lines) + "\n")
        proc.stdin.flush()
        # stdin stays open until the last request is answered, as an MCP client keeps it: at
        # EOF the SDK's session ends and may drop a request still in hand.
        replies = []
        while not replies or replies[-1].get("id") != 7:
            line = proc.stdout.readline()
            assert line, f"mcp-serve ended after {replies}"
            replies.append(json.loads(line))
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    errors = [(r["id"], r["error"]["code"]) for r in replies if "error" in r]
    assert errors == [(None, -32700), (2, -32600), ("three", -32600), (4, -32600), (None, -32600)]
    assert [r["id"] for r in replies if "result" in r] == [1, 7]
