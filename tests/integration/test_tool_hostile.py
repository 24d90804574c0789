"""Builtin tools against a real pod, with what a model gone wrong or a hostile local user can put
in front of them: names that are not UTF-8, pathological regexes, huge files, credentials in
the environment."""

import os

from tests.conftest import Env


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
