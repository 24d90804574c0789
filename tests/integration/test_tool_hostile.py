"""Builtin tools against a real pod, with what a model gone wrong or a hostile local user can put
in front of them: names that are not UTF-8, pathological regexes, huge files, credentials in
the environment."""

import os

from tests.conftest import Env, PodProcess, collect_run


def test_a_file_name_that_is_not_utf8_is_shown_escaped_and_the_pod_lives_on(env: Env) -> None:
    # The OS hands such a name to Python as a lone surrogate, which neither the session log
    # nor the wire can hold: listing it used to fail the log write and stop the pod.
    os.mkdir(env.work / "d")
    with open(os.path.join(os.fsencode(env.work / "d"), b"caf\xe9.txt"), "w") as f:
        f.write("needle\n")
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "d"}}]},
        {"tool_calls": [{"name": "grep", "arguments": {"pattern": "needle", "path": "d"}}]},
        {"tool_calls": [{"name": "glob", "arguments": {"pattern": "d/*.txt"}}]},
        {"text": "done"},
    )
    pod = env.start("nonutf")
    with pod.client() as c:
        result = c.run_wait("go")
        assert (result.outcome, result.text) == ("finished", "done")
        outputs = [e["item"]["output"] for e in c.history().entries if e["kind"] == "tool_result"]
        assert c.status().state == "idle"
    assert outputs == ["caf\\xe9.txt", "d/caf\\xe9.txt:1:needle", "d/caf\\xe9.txt"]


ENV_COMMAND = (
    {"tool_calls": [{"name": "bash", "arguments": {"command": "env; echo END-OF-ENV"}}]},
    {"text": "seen"},
)


def env_a_command_sees(env: Env, pod: PodProcess) -> str:
    """What `env` printed in a bash command of `pod`, as the model got it back (the model was
    scripted with `ENV_COMMAND` before the pod started)."""
    with pod.client() as c:
        assert c.run_wait("show env").outcome == "finished"
    seen = str(env.model.requests[1]["body"])
    assert "END-OF-ENV" in seen and "PODDAEMON_HOME=" in seen  # the whole environment
    return seen


def test_bash_commands_do_not_see_a_provider_key_with_a_name_of_its_own(env: Env) -> None:
    # `MY_LLM_CREDS` matches none of the credential-like patterns commands are spared.
    env.env["MY_LLM_CREDS"] = "the-real-key"
    env.model.script(*ENV_COMMAND)
    path = env.manifest("envy", tools=["bash"])
    text = path.read_text().replace('api_key_env = "FAKE_API_KEY"', 'api_key_env = "MY_LLM_CREDS"')
    path.write_text(text)
    pod = PodProcess(env.popen(str(path)), "envy")
    env.pods.append(pod)
    seen = env_a_command_sees(env, pod.wait_ready())
    assert env.model.requests[0]["headers"].get("authorization") == "Bearer the-real-key"
    assert "MY_LLM_CREDS" not in seen and "the-real-key" not in seen


def test_bash_commands_do_not_see_a_variable_the_manifest_hands_to_an_mcp_server(
    env: Env,
) -> None:
    # `SVC_SETTING` looks like no credential: only where the manifest sends it says it is one.
    env.env["SVC_SETTING"] = "server-only-value"
    env.model.script(*ENV_COMMAND)
    server = '[[mcp.servers]]\nname = "svc"\ncommand = ["true"]\nenv = { S = "${SVC_SETTING}" }\n'
    pod = env.start("mcpenv", tools=["bash"], extra=server)  # the server fails; not required
    seen = env_a_command_sees(env, pod)
    assert "SVC_SETTING" not in seen and "server-only-value" not in seen


def test_a_regex_that_backtracks_for_ever_is_a_tool_error_and_the_pod_keeps_answering(
    env: Env,
) -> None:
    # `re` holds the GIL while it matches: (a|aa)+$ on this line froze the pod's event loop,
    # so no client got an answer (not even status) and the run never ended.
    (env.work / "f.txt").write_text("a" * 60 + "b\n")
    env.model.script(
        {"tool_calls": [{"name": "grep", "arguments": {"pattern": "(a|aa)+$"}}]},
        {"text": "done"},
    )
    pod = env.start("redos")
    with pod.client() as c:
        c.subscribe()
        run = c.run("go")
        next(e for e in c.events() if e.type == "tool.started")
        with pod.client(timeout=2) as other:  # while the regex runs
            assert other.status().state == "running"
        events = collect_run(c, run.run_id)
    finished = next(e for e in events if e.type == "tool.finished")
    assert finished.data["is_error"]
    assert events[-1].data["outcome"] == "finished"
    followup = str(env.model.requests[1]["body"])
    assert "backtracks catastrophically" in followup and "f.txt:1" in followup


def test_a_huge_unknown_tool_name_is_not_echoed_whole(env: Env) -> None:
    # The error repeated the model's name whole, past the output cap: 3 MB of it went into the
    # log and into every later request, and the list of the real names came after it.
    env.model.script(
        {"tool_calls": [{"name": "x" * 3_000_000, "arguments": {}}]},
        {"text": "done"},
    )
    pod = env.start("bigname")
    with pod.client() as c:
        assert c.run_wait("go").text == "done"
        (output,) = [e["item"]["output"] for e in c.history().entries if e["kind"] == "tool_result"]
    assert len(output.encode()) <= 16384
    assert output.startswith("unknown tool: xxx")
    assert output.endswith("(available: edit_file, glob, grep, list_dir, read_file, write_file)")
    assert len(str(env.model.requests[1]["body"])) < 3_100_000  # the call itself, once


def test_a_file_name_with_a_newline_is_one_escaped_line(env: Env) -> None:
    # Shown as it is, a newline split the name into two listed names that are not there; a
    # local user could name a file so that it forged a line of grep's output.
    os.mkdir(env.work / "d")
    (env.work / "d" / "evil\nsecret.txt").write_text("needle\n")
    (env.work / "d" / "tab\there").write_text("")
    env.model.script(
        {"tool_calls": [{"name": "list_dir", "arguments": {"path": "d"}}]},
        {"tool_calls": [{"name": "glob", "arguments": {"pattern": "d/evil*"}}]},
        {"tool_calls": [{"name": "grep", "arguments": {"pattern": "needle", "path": "d"}}]},
        {"text": "done"},
    )
    pod = env.start("ctrl")
    with pod.client() as c:
        assert c.run_wait("go").text == "done"
        outputs = [e["item"]["output"] for e in c.history().entries if e["kind"] == "tool_result"]
    assert outputs == [
        "evil\\nsecret.txt\ntab\\there",
        "d/evil\\nsecret.txt",
        "d/evil\\nsecret.txt:1:needle",
    ]
