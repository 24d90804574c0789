"""Issue 3: the agent loop through each wire format: real SDK <-> fake server <-> real pod."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from poddaemon.machine import CANCEL_NOTE
from poddaemon.testing.cleanup import alive
from protocol import RpcError
from tests.conftest import (
    PROVIDER_KINDS,
    Env,
    PodProcess,
    collect_run,
    events_until,
    wait_until,
)


def last_request_text(env: Env) -> str:
    return str(env.model.requests[-1]["body"])


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_text_answer_streams_and_finishes(env: Env, kind: str) -> None:
    env.model.script(
        {
            "text": "Hello from the fake model, streamed in pieces.",
            "usage": {"input": 11, "output": 7},
            # Deltas that arrive together become one event; spaced out, each is its own.
            "delay": 0.01,
        }
    )
    pod = env.start("talker", kind=kind)
    with pod.client() as c:
        c.subscribe()
        run = c.run("hi there")
        assert run.state == "started"
        events = collect_run(c, run.run_id)
    deltas = [e.data["text"] for e in events if e.type == "text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "Hello from the fake model, streamed in pieces."
    finished = [e for e in events if e.type == "run.finished"]
    assert len(finished) == 1
    assert finished[0].data["outcome"] == "finished"
    assert finished[0].data["text"] == "Hello from the fake model, streamed in pieces."
    usage = [e.data for e in events if e.type == "llm.usage"]
    assert usage == [{"input": 11, "output": 7, "cache_read": 0, "cache_write": 0}]
    body = env.model.requests[0]["body"]
    assert "hi there" in str(body) and "You are a test pod." in str(body)


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_a_cancel_mid_stream_keeps_the_text_streamed_so_far(env: Env, kind: str) -> None:
    """What the client saw stream stays: the cancelled run's text, the session's history, and
    the model's next request (which the provider accepts after a cut-off message), which also
    tells the model its run was cancelled."""
    env.model.script({"text": "word " * 400, "delay": 0.05}, {"text": "picking up"})
    pod = env.start("cutoff", kind=kind)
    with pod.client() as c, pod.client() as control:
        c.subscribe()
        run = c.run("write at length")
        seen = events_until(c, lambda e: e.type == "text.delta")
        assert control.cancel().cancelled
        seen += collect_run(c, run.run_id)
        streamed = "".join(e.data["text"] for e in seen if e.type == "text.delta")
        (finished,) = [e.data for e in seen if e.type == "run.finished"]
        assert (finished["outcome"], finished["text"]) == ("cancelled", streamed)
        assert streamed and len(streamed) < len("word " * 400)
        nxt = c.run_wait("go on")
        entries = c.history().entries
    assert (nxt.outcome, nxt.text) == ("finished", "picking up")
    assistant = [e["item"]["text"] for e in entries if e["kind"] == "assistant"]
    assert assistant == [streamed, "picking up"]
    body = str(env.model.requests[1]["body"])
    # The cut text, the note that the run before was cancelled, then the new input.
    assert body.index(streamed.strip()) < body.index(CANCEL_NOTE) < body.index("go on")


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_two_calls_sharing_an_id_each_get_their_own_result(env: Env, kind: str) -> None:
    """A model that gives two calls of one response the same id: the second is renamed, so
    each result answers one call, in the log and in the next request."""
    (env.work / "a.txt").write_text("alpha")
    (env.work / "b.txt").write_text("beta")
    env.model.script(
        {
            "tool_calls": [
                {"name": "read_file", "arguments": {"path": "a.txt"}, "id": "dup"},
                {"name": "read_file", "arguments": {"path": "b.txt"}, "id": "dup"},
            ]
        },
        {"text": "read both"},
    )
    pod = env.start("twins", kind=kind)
    with pod.client() as c:
        assert c.run_wait("read them").outcome == "finished"
        entries = c.history().entries
    results = {
        e["item"]["call_id"]: e["item"]["output"] for e in entries if e["kind"] == "tool_result"
    }
    assert results.keys() == {"dup", "dup_2"}
    assert "alpha" in results["dup"] and "beta" in results["dup_2"]
    body = str(env.model.requests[1]["body"])
    assert "'dup_2'" in body and "beta" in body


@pytest.mark.parametrize("kind", ["openai", "openai_responses"])
def test_malformed_tool_arguments_go_back_as_a_json_object(env: Env, kind: str) -> None:
    """A model that emits arguments that are not JSON gets its tool's error, and the next
    request carries its call's arguments as a JSON object (servers that parse them refuse
    anything else), the malformed text visible in it."""
    env.model.script(
        {"tool_calls": [{"name": "read_file", "arguments": '{"path": "notes.txt"'}]},
        {"text": "I will fix my call."},
    )
    pod = env.start("sloppy", kind=kind)
    with pod.client() as c:
        result = c.run_wait("read the note")
    assert (result.outcome, result.text) == ("finished", "I will fix my call.")
    body = env.model.requests[1]["body"]
    if kind == "openai":
        (call,) = next(m for m in body["messages"] if m.get("tool_calls"))["tool_calls"]
        arguments = call["function"]["arguments"]
    else:
        (call,) = [i for i in body["input"] if i.get("type") == "function_call"]
        arguments = call["arguments"]
    assert json.loads(arguments) == {"_raw_arguments": '{"path": "notes.txt"'}


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_tool_loop_edits_a_file_in_scope(env: Env, kind: str) -> None:
    target = env.work / "notes.txt"
    target.write_text("status: draft\n")
    env.model.script(
        {"tool_calls": [{"name": "read_file", "arguments": {"path": "notes.txt"}}]},
        {
            "tool_calls": [
                {
                    "name": "edit_file",
                    "arguments": {
                        "path": "notes.txt",
                        "old_string": "draft",
                        "new_string": "final",
                    },
                }
            ]
        },
        {"text": "Done: the note is final."},
    )
    pod = env.start("editor", kind=kind)
    with pod.client() as c:
        result = c.run_wait("finalize the note")
    assert (result.outcome, result.text) == ("finished", "Done: the note is final.")
    assert target.read_text() == "status: final\n"
    requests = env.model.requests
    assert len(requests) == 3
    assert "1\\tstatus: draft" in str(requests[1]["body"])  # the numbered file, tab escaped by repr


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_reads_outside_scope_are_tool_errors(env: Env, kind: str) -> None:
    secret = env.home / "outside.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    os.symlink(secret, env.work / "link.txt")
    env.model.script(
        {
            "tool_calls": [
                {"name": "read_file", "arguments": {"path": "/etc/passwd"}},
                {"name": "read_file", "arguments": {"path": "../outside.txt"}},
                {"name": "read_file", "arguments": {"path": "link.txt"}},
            ]
        },
        {"text": "I could not read those."},
    )
    pod = env.start("prisoner", kind=kind)
    with pod.client() as c:
        c.subscribe()
        run = c.run("read the secrets")
        events = collect_run(c, run.run_id)
    finished_tools = [e.data for e in events if e.type == "tool.finished"]
    assert [t["is_error"] for t in finished_tools] == [True, True, True]
    followup = str(env.model.requests[1]["body"])
    assert followup.count("outside scope") == 3
    assert "TOP-SECRET-CONTENT" not in followup and "root:x:0:0" not in followup
    assert events[-1].data["outcome"] == "finished"


def test_a_scope_over_poddaemons_own_directories_does_not_reach_them(env: Env) -> None:
    """A scope of the whole home (as `~` would be) covers the registry, the session logs and
    the keys' env file: the file tools refuse them (write_file on pods.json stopped every pod
    of the user)."""
    (env.home / "config").mkdir(exist_ok=True)
    (env.home / "config" / "env").write_text("OPENAI_API_KEY=sk-SECRET-KEY\n")
    calls = [
        {"name": "write_file", "arguments": {"path": "../run/pods.json", "content": "{}"}},
        {"name": "read_file", "arguments": {"path": f"{env.home}/config/env"}},
        {"name": "list_dir", "arguments": {"path": "../data"}},
        {"name": "write_file", "arguments": {"path": "mine.txt", "content": "fine"}},
    ]
    env.model.script({"tool_calls": calls}, {"text": "done"})
    tools = ["write_file", "read_file", "list_dir"]
    pod = env.start("homebody", write=[str(env.home)], pwd=str(env.work), tools=tools)
    with pod.client() as c:
        assert c.run_wait("look around").outcome == "finished"
        results = [e["item"] for e in c.history().entries if e["kind"] == "tool_result"]
        assert c.status().state == "idle"
    assert [r["is_error"] for r in results] == [True, True, True, False]
    assert all("poddaemon's own files" in r["output"] for r in results[:3]), results
    assert "sk-SECRET-KEY" not in str(env.model.requests[1]["body"])
    assert "homebody" in json.loads((env.home / "run" / "pods.json").read_text())["pods"]
    assert (env.work / "mine.txt").read_text() == "fine"


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_429_then_success_retries_with_an_event(env: Env, kind: str) -> None:
    env.model.script(
        {"fault": {"kind": "status", "status": 429, "retry_after": 0.01}},
        {"text": "after the retry"},
    )
    pod = env.start("patient", kind=kind)
    with pod.client() as c:
        c.subscribe()
        run = c.run("go")
        events = collect_run(c, run.run_id)
    assert [e.type for e in events].count("llm.retry") == 1
    assert events[-1].data["outcome"] == "finished" and events[-1].data["text"] == "after the retry"


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_500_until_the_cap_is_an_error(env: Env, kind: str) -> None:
    env.model.script(*[{"fault": {"kind": "status", "status": 500}}] * 4)
    pod = env.start("doomed", kind=kind)
    with pod.client() as c:
        result = c.run_wait("go")
    assert result.outcome == "error"
    assert "4 attempts" in (result.error or "")
    assert len(env.model.requests) == 4  # max_retries = 3 in the test manifests
    assert pod.call("status")["state"] == "idle"


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_cut_stream_is_an_error_without_duplicate_output(env: Env, kind: str) -> None:
    env.model.script(
        {
            "text": "partial output that will be cut off midway through",
            "fault": {"kind": "cut", "after_chunks": 2},
        }
    )
    pod = env.start("cut", kind=kind)
    with pod.client() as c:
        c.subscribe()
        run = c.run("go")
        events = collect_run(c, run.run_id)
    text = "".join(e.data["text"] for e in events if e.type == "text.delta")
    assert text and "partial output that will be cut off midway through".startswith(text)
    assert (events[-1].data["outcome"], events[-1].data["text"]) == ("error", text)
    assert len(env.model.requests) == 1  # no silent retry after output started
    history = pod.call("history")["entries"]  # what streamed is kept, once
    assert [e["item"]["text"] for e in history if e["kind"] == "assistant"] == [text]


def test_run_while_busy_is_queued_then_runs(env: Env) -> None:
    env.model.script({"text": "first answer", "gate": "first"}, {"text": "second answer"})
    pod = env.start("busy")
    with pod.client() as c:
        c.subscribe()
        first = c.run("one")
        env.model.wait_for_requests(1)
        second = c.run("two")
        assert (second.state, second.position) == ("queued", 1)
        assert pod.call("status")["queue"]["runs"] == 1
        env.model.open_gate("first")
        events = collect_run(c, second.run_id)
    finished = [e for e in events if e.type == "run.finished"]
    assert [(e.run_id, e.data["text"]) for e in finished] == [
        (first.run_id, "first answer"),
        (second.run_id, "second answer"),
    ]
    assert "one" in str(env.model.requests[1]["body"]) and "two" in str(
        env.model.requests[1]["body"]
    )


def start_held_in_a_tool_call(env: Env, name: str, answer: str) -> PodProcess:
    """A pod whose model first asks for list_dir, held until gate "g" opens (so the run stays
    active, ready for a steer), then gives `answer`."""
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "g"}, {"text": answer}
    )
    return env.start(name)


def test_steer_reaches_the_model_inside_the_active_run(env: Env) -> None:
    pod = start_held_in_a_tool_call(env, "steered", "took the steer into account")
    with pod.client() as c:
        c.subscribe()
        run = c.run("list things")
        env.model.wait_for_requests(1)
        steer = c.run("also: be brief", mode="steer")
        assert (steer.state, steer.run_id) == ("steered", run.run_id)
        env.model.open_gate("g")
        events = collect_run(c, run.run_id)
    assert len([e for e in events if e.type == "run.finished"]) == 1
    assert "also: be brief" in str(env.model.requests[1]["body"])


def test_steer_with_wait_answers_when_the_run_it_joined_ends(env: Env) -> None:
    """`run {mode: steer, wait: true}` answers as any `wait` does (SPEC §5): `{run_id,
    outcome, text, usage}` once the run it was steered into ends, not `{state: steered}`."""
    pod = start_held_in_a_tool_call(env, "steerwait", "done, briefly")
    with pod.client() as c, ThreadPoolExecutor(1) as pool:
        run = c.run("list things")
        env.model.wait_for_requests(1)
        with pod.client() as other:
            waiting = pool.submit(other.run_wait, "also: be brief", mode="steer")
            wait_until(lambda: c.status().queue.runs == 0 and "brief" in str(pod.call("history")))
            env.model.open_gate("g")
            result = waiting.result(timeout=30)
    assert (result.run_id, result.outcome, result.text) == (run.run_id, "finished", "done, briefly")
    assert result.usage.calls == 2


def test_a_keyed_steer_retried_answers_its_original_result(env: Env) -> None:
    """Same client_key and input: the original result (SPEC §5), `steered` into the same run,
    and with `wait` that run's end, not a run that does not exist."""
    pod = start_held_in_a_tool_call(env, "steerkey", "steered answer")
    with pod.client() as c, ThreadPoolExecutor(1) as pool:
        run = c.run("list things")
        env.model.wait_for_requests(1)
        first = c.run("also this", mode="steer", client_key="s1")
        again = c.run("also this", mode="steer", client_key="s1")
        assert (first.run_id, first.state) == (run.run_id, "steered")
        assert (again.run_id, again.state, again.position) == (run.run_id, "steered", None)
        with pod.client() as other:
            waiting = pool.submit(other.run_wait, "also this", mode="steer", client_key="s1")
            env.model.open_gate("g")
            result = waiting.result(timeout=30)
    assert (result.run_id, result.outcome, result.text) == (
        run.run_id,
        "finished",
        "steered answer",
    )
    assert len(env.model.requests) == 2


def test_cancel_kills_a_hanging_bash_group(env: Env) -> None:
    pidfile = env.work / "pids"
    env.model.script(
        {
            "tool_calls": [
                {
                    "name": "bash",
                    "arguments": {
                        "command": f"sleep 300 & echo $! > {pidfile}; echo $$ >> {pidfile}; wait"
                    },
                }
            ]
        },
    )
    pod = env.start("basher", tools=["bash", "read_file"])
    with pod.client() as c:
        c.subscribe()
        run = c.run("hang")
        pids = wait_until(
            lambda: (
                pidfile.exists()
                and len(pidfile.read_text().split()) == 2
                and pidfile.read_text().split()
            ),
            what="bash to start",
        )
        assert c.cancel().cancelled
        events = collect_run(c, run.run_id)
    assert events[-1].data["outcome"] == "cancelled"
    for pid in map(int, pids):
        wait_until(lambda pid=pid: not alive(pid), what=f"process {pid} to be killed")
    results = [e for e in pod.call("history")["entries"] if e["kind"] == "tool_result"]
    assert len(results) == 1 and results[0]["item"]["is_error"]


def test_max_turns_reached(env: Env) -> None:
    env.model.script(*[{"tool_calls": [{"name": "list_dir", "arguments": {}}]}] * 3)
    pod = env.start("looper", "--set", "worker.max_turns=2")
    with pod.client() as c:
        result = c.run_wait("loop")
    assert result.outcome == "limit_reached" and "max_turns (2)" in (result.error or "")
    assert len(env.model.requests) == 2
    entries = pod.call("history")["entries"]
    calls = [c["id"] for e in entries if e["kind"] == "assistant" for c in e["item"]["tool_calls"]]
    results = [e["item"]["call_id"] for e in entries if e["kind"] == "tool_result"]
    assert calls == results and len(calls) == 2


def test_client_key_is_idempotent(env: Env) -> None:
    pod = env.start("keyed")
    with pod.client() as c:
        first = c.run_wait("same input", client_key="k1")
        again = c.run_wait("same input", client_key="k1")
        assert again.run_id == first.run_id and again.text == first.text
        with pytest.raises(RpcError) as err:
            c.run("different input", client_key="k1")
    assert err.value.code == -32006
    assert len(env.model.requests) == 1


def test_pause_then_resume(env: Env) -> None:
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {}}], "gate": "p"},
        {"text": "resumed and done"},
    )
    pod = env.start("pauser")
    with pod.client() as c:
        c.subscribe()
        run = c.run("work")
        env.model.wait_for_requests(1)
        assert c.pause().paused
        env.model.open_gate("p")
        events = collect_run(c, run.run_id)
        assert events[-1].data["outcome"] == "paused"
        assert c.status().state == "paused"
        assert c.resume().run_id == run.run_id
        events = collect_run(c, run.run_id)
    assert (
        events[-1].data["outcome"] == "finished" and events[-1].data["text"] == "resumed and done"
    )
    with pytest.raises(RpcError) as err, pod.client() as c:
        c.resume()
    assert err.value.code == -32001


def test_system_prompt_template_is_rendered_once_with_context(env: Env) -> None:
    (env.work / "AGENTS.md").write_text("Always answer in haiku.")
    template = "pwd={{ pwd }}; tools={{ tools | join(',') }}; year={{ now.year }}\n{{ agents_md }}"
    pod = env.start("templated", instruction=template, tools=["read_file", "grep"])
    with pod.client() as c:
        c.run_wait("one")
        c.run_wait("two")
    first, second = (str(r["body"]) for r in env.model.requests)
    expected = f"pwd={env.work}; tools=read_file,grep; year="
    assert expected in first and "Always answer in haiku." in first
    system = first[first.index(expected) :][:200]
    assert system.split("\\n")[0] in second  # rendered once: the same prompt both times


def test_an_agents_md_that_is_a_fifo_does_not_hold_up_start_up(env: Env) -> None:
    # The pwd is the model's to write: `mkfifo AGENTS.md` there made every later start of the
    # pod (a restart, a unit's) block in open() for a writer, deaf to SIGTERM.
    os.mkfifo(env.work / "AGENTS.md")
    pod = env.start("fifo", instruction="[{{ agents_md }}] in {{ pwd }}")
    with pod.client() as c:
        c.run_wait("one")
    assert f"[] in {env.work}" in str(env.model.requests[0]["body"])


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("line one\n{% endfor %}\nline three", "endfor"),  # a syntax error, found on loading
        ("line one\nhello {{ nope }}", "'nope' is undefined"),  # found on rendering
    ],
)
def test_template_error_fails_start_up_with_one_line_naming_it(
    env: Env, template: str, says: str
) -> None:
    path = env.manifest("broken", instruction=template)
    proc = env.popen(str(path))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0
    (line,) = err.strip().splitlines()  # no traceback
    assert line.startswith(f"poddaemon: {path}: worker.instruction:2: template error")
    assert says in line


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_output_limit_ends_the_run_without_running_its_tools(env: Env, kind: str) -> None:
    marker = env.work / "should-not-exist.txt"
    env.model.script(
        {
            "text": "cut",
            "tool_calls": [
                {"name": "write_file", "arguments": {"path": str(marker), "content": "x"}}
            ],
            "stop": "max_tokens",
        }
    )
    pod = env.start("limited", kind=kind)
    with pod.client() as c:
        result = c.run_wait("write it")
    assert result.outcome == "error" and (result.error or "").startswith("incomplete")
    assert not marker.exists()
    entries = pod.call("history")["entries"]
    results = [e["item"] for e in entries if e["kind"] == "tool_result"]
    assert len(results) == 1 and results[0]["is_error"] and "output limit" in results[0]["output"]


@pytest.mark.parametrize("kind", PROVIDER_KINDS)
def test_content_filter_is_an_error_with_the_reason(env: Env, kind: str) -> None:
    env.model.script({"text": "", "stop": "content_filter"})
    pod = env.start("filtered", kind=kind)
    with pod.client() as c:
        result = c.run_wait("something")
    assert result.outcome == "error" and "content_filter" in (result.error or "")
