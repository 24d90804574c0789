"""Issue 13: the scope enforced by the kernel for what a real pod starts (its bash tool).

Each attack runs as the model's bash call in a real pod (default `[sandbox] mode = "enforce"`),
and the same command run by the test itself, unconfined, is the control that must succeed.
"""

import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from poddaemon.readyline import EXIT_REFUSED
from poddaemon.sandbox import available
from tests.conftest import Env, StartFailed, wait_until

pytestmark = pytest.mark.skipif(available() == 0, reason="this kernel has no Landlock")

MARK = "EXIT-STATUS:"


def bash_results(env: Env, name: str, commands: list[str], **manifest: Any) -> list[str]:
    """Run each command as one bash call of one run; return each call's output."""
    calls = [
        {"name": "bash", "arguments": {"command": f"{cmd}; echo {MARK}$?"}} for cmd in commands
    ]
    env.model.script({"tool_calls": calls}, {"text": "done"})
    pod = env.start(name, tools=["bash"], **manifest)
    with pod.client() as c:
        assert c.run_wait("attack").outcome == "finished"
        entries = c.history(since=0, limit=10_000).entries
    outputs = [e["item"]["output"] for e in entries if e["kind"] == "tool_result"]
    assert len(outputs) == len(commands)
    return outputs


def status_of(output: str) -> int:
    return int(output.rsplit(MARK, 1)[1].split()[0])


@pytest.fixture
def layout(env: Env) -> Iterator[dict[str, Path]]:
    outside = env.home / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside secret\n")
    secrets = env.work / "secrets"
    secrets.mkdir()
    (secrets / "key.txt").write_text("denied secret\n")
    project = env.work / "project"  # the pwd: a sibling of the denied dir (see docs/sandbox.md:
    project.mkdir()  # a directory that holds a deny gives new files in it no content access)
    (project / "mine.txt").write_text("in scope\n")
    yield {"outside": outside, "secrets": secrets, "project": project}


DENY = '[[scope.deny]]\ntarget = "{target}"\npermission = "read"\n'


def test_escapes_through_bash_all_fail_and_work_inside_the_scope_does(
    env: Env, layout: dict[str, Path]
) -> None:
    outside, secrets, project = layout["outside"], layout["secrets"], layout["project"]
    sessions = env.home / "data" / "sessions"
    registry = env.home / "run" / "pods.json"
    attacks = [
        f"cat {outside}/secret.txt",
        f"echo x > {outside}/new.txt",
        f"cat {secrets}/key.txt",
        f"cat /proc/self/root{outside}/secret.txt",
        f"ln -s {outside}/secret.txt {project}/link && cat {project}/link",
        f"ln {outside}/secret.txt {project}/hard",
        f"cat {project}/../../outside/secret.txt",
        f"cat {sessions}/*.jsonl",
        f"echo '{{}}' > {registry}",
        f"ls {env.home}/data",
    ]
    inside = [
        f"cat {project}/mine.txt",
        f"echo made > {project}/made.txt && cat {project}/made.txt",
        'echo tmp > "$TMPDIR/t" && cat "$TMPDIR/t"',
        "python3 -c 'print(6 * 7)'",
        "printf 'a\\nb\\n' | sort -r | head -1",
        "git init -q repo && cd repo && git status --short && echo git-ok",
    ]
    extra = DENY.format(target=secrets)
    outputs = bash_results(env, "jail", attacks + inside, extra=extra, pwd=str(project))
    for command, output in zip(attacks, outputs[: len(attacks)], strict=True):
        assert status_of(output) != 0, f"escaped: {command!r}: {output}"
        assert "outside secret" not in output and "denied secret" not in output
    assert not (outside / "new.txt").exists()
    assert json.loads(registry.read_text()) != {}
    for command, output in zip(inside, outputs[len(attacks) :], strict=True):
        assert status_of(output) == 0, f"failed inside the scope: {command!r}: {output}"
    assert "42" in outputs[len(attacks) + 3] and "git-ok" in outputs[-1]
    # The controls: the same reads work unconfined, so the refusals above were the sandbox's.
    assert (outside / "secret.txt").read_text() == "outside secret\n"
    control = subprocess.run(["cat", f"{secrets}/key.txt"], capture_output=True, text=True)
    assert control.returncode == 0
    status = env.podctl("status", "jail")
    assert f"sandbox: landlock-abi-{available()}" in " ".join(status.stdout.split()), status.stdout


def test_commands_cannot_read_poddaemons_own_files_under_a_scope_over_them(env: Env) -> None:
    """A scope of the whole home: the registry, session logs and the keys' env file stay out
    of reach of bash (contents; entries are the documented limit); the control reads them."""
    (env.home / "config").mkdir(exist_ok=True)
    (env.home / "config" / "env").write_text("OPENAI_API_KEY=sk-SECRET-KEY\n")
    targets = [env.home / "config" / "env", env.home / "run" / "pods.json"]
    commands = [f"cat {t}" for t in targets]
    outputs = bash_results(env, "homebody", commands, write=[str(env.home)], pwd=str(env.work))
    for cmd, out in zip(commands, outputs, strict=True):
        assert status_of(out) != 0 and "Permission denied" in out, (cmd, out)
        assert subprocess.run(["sh", "-c", cmd], capture_output=True).returncode == 0
    assert "sk-SECRET-KEY" not in "".join(outputs)
    # What the kernel cannot refuse there is said at start-up.
    (pod,) = env.pods
    assert f"covers poddaemon's own directory {env.home / 'run'}" in pod.text()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can read /etc/shadow at all")
def test_a_root_pods_commands_cannot_read_roots_secrets_in_etc(env: Env) -> None:
    """/etc is granted read for commands to run at all; for root that showed the password
    hashes (and host keys) to a pod whose scope is elsewhere: they read as empty now. The rest
    of /etc stays readable, files put there after the commands' runner started included (a
    Landlock rule per entry of /etc held each file as it was: useradd, DHCP, sed -i replace
    theirs by a rename, and commands lost them)."""
    added = Path("/etc") / f"poddaemon-test-{os.getpid()}"
    ready, go = env.work / "ready", env.work / "go"
    wait = f"touch {ready}; while [ ! -e {go} ]; do sleep 0.01; done"
    commands = ["cat /etc/shadow", "ls -A /etc/ssl/private", wait, f"cat {added}"]
    calls = [{"name": "bash", "arguments": {"command": f"{c}; echo {MARK}$?"}} for c in commands]
    env.model.script({"tool_calls": calls}, {"text": "done"})
    pod = env.start("rooted", tools=["bash"], pwd=str(env.work))
    try:
        with pod.client() as c:
            c.run("look")
            wait_until(ready.exists, what="the commands' runner to be running")
            added.write_text("added later\n")
            go.touch()
            wait_until(lambda: c.status().state == "idle", what="the run to end")
            entries = c.history(since=0, limit=1000).entries
    finally:
        added.unlink(missing_ok=True)
    shadow, private, _, later = [e["item"]["output"] for e in entries if e["kind"] == "tool_result"]
    assert "root:" not in shadow and status_of(shadow) == 0, shadow
    assert private.startswith(MARK), private  # an empty directory
    assert "added later" in later and status_of(later) == 0, later
    assert "root:" in Path("/etc/shadow").read_text()  # the control: root reads it outside
    assert "stay readable" not in " ".join(env.podctl("status", "rooted").stdout.split())


def test_network_false_cuts_commands_off_but_not_the_pods_model_calls(env: Env) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    accepted: list[bool] = []

    def accept() -> None:
        listener.settimeout(10)
        try:
            conn, _ = listener.accept()
            accepted.append(True)
            conn.close()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    probe = (
        'python3 -c \'import socket; s = socket.create_connection(("127.0.0.1", '
        f'{port}), timeout=3); print("CONNECTED")\''
    )
    outputs = bash_results(env, "offline", [probe], extra="[sandbox]\nnetwork = false\n")
    assert status_of(outputs[0]) != 0 and "CONNECTED" not in outputs[0]
    # The model calls went over TCP to the fake model all along (the run finished), and the
    # listener is reachable unconfined: the control.
    with socket.create_connection(("127.0.0.1", port), timeout=3):
        pass
    listener.close()


def test_enforce_without_landlock_fails_start_up_and_best_effort_warns(env: Env) -> None:
    path = env.manifest("strict", tools=["bash"])
    proc = subprocess.run(
        [*env.popen_args(), str(path)],
        env={**env.env, "PODDAEMON_TEST_LANDLOCK_ABI": "0"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == EXIT_REFUSED  # not started again by a unit: nothing would change
    (line,) = proc.stderr.strip().splitlines()
    assert "sandbox.mode = enforce" in line and "no Landlock" in line

    path = env.manifest("lenient", tools=["bash"], extra='[sandbox]\nmode = "best_effort"\n')
    env.env["PODDAEMON_TEST_LANDLOCK_ABI"] = "0"
    try:
        pod = env.start("lenient", tools=["bash"], extra='[sandbox]\nmode = "best_effort"\n')
    finally:
        del env.env["PODDAEMON_TEST_LANDLOCK_ABI"]
    with pod.client() as c:
        assert c.status().sandbox == "none"
        c.subscribe(since=0)
        alert = next(e for e in c.events() if e.type == "alert")
    assert alert.data["source"] == "sandbox" and "no Landlock" in alert.data["message"]
    assert os.path.exists(path)


def test_a_denied_dir_renamed_by_bash_is_still_denied_to_the_file_tools(
    env: Env, layout: dict[str, Path]
) -> None:
    # Landlock cannot stop a command renaming one entry of a directory it may write: the
    # contents must stay denied under the new name (SPEC §3), for the file tools as for bash.
    secrets = layout["secrets"]
    env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": "mv secrets public"}}]},
        {"tool_calls": [{"name": "bash", "arguments": {"command": "cat public/key.txt"}}]},
        {"tool_calls": [{"name": "read_file", "arguments": {"path": "public/key.txt"}}]},
        {"text": "done"},
    )
    pod = env.start(
        "mover", tools=["bash", "read_file"], extra=DENY.format(target=secrets), pwd=str(env.work)
    )
    with pod.client() as c:
        assert c.run_wait("move it").outcome == "finished"
        entries = c.history(since=0, limit=10_000).entries
    moved, cat, read = [e["item"] for e in entries if e["kind"] == "tool_result"]
    assert not moved["is_error"] and (env.work / "public" / "key.txt").exists()  # the control
    assert "denied secret" not in cat["output"] and "Permission denied" in cat["output"]
    assert read["is_error"] and "denied secret" not in read["output"]
    assert "a denied entry moved or linked there" in read["output"]


def test_the_commands_temp_dir_outlives_neither_a_refused_start_nor_a_kill9(env: Env) -> None:
    temp = env.tmp  # the pods' TMPDIR

    def temp_dirs() -> list[str]:
        return sorted(p.name for p in temp.iterdir())

    pod = env.start("temper", tools=["bash"])
    (first,) = temp_dirs()
    assert first.startswith("poddaemon-temper-")
    with pytest.raises(StartFailed):  # the name is taken: this start gives its own dir back
        env.start("temper", tools=["bash"])
    assert temp_dirs() == [first]
    pod.kill9()  # no chance to clean up: the next pod of this name removes what it left
    again = env.restart(pod)
    (second,) = temp_dirs()
    assert second != first
    assert again.stop() == 0
    assert temp_dirs() == []


def test_below_abi_6_status_says_signals_and_abstract_sockets_are_not_confined(env: Env) -> None:
    """Found by QA on a simulated ABI 2: a command killed a process outside its pod, and
    `status` said nothing of it (the notes did not depend on the ABI)."""
    bystander = subprocess.Popen(["sleep", "60"])
    env.env["PODDAEMON_TEST_LANDLOCK_ABI"] = "5"
    try:
        env.model.script(
            {"tool_calls": [{"name": "bash", "arguments": {"command": f"kill {bystander.pid}"}}]},
            {"text": "done"},
        )
        old = env.start("old", tools=["bash"], write=[str(env.work / "old")])
        with old.client() as c:
            assert c.run_wait("kill").outcome == "finished"
            status = c.status()
    finally:
        del env.env["PODDAEMON_TEST_LANDLOCK_ABI"]
        bystander.kill()
    assert bystander.wait(10) == -signal.SIGTERM  # what the note owns up to
    assert status.sandbox == "landlock-abi-5"
    note = "Landlock ABI 5: commands can send signals to any process of this user"
    assert any(n.startswith(note) for n in status.sandbox_notes), status.sandbox_notes
    if available() >= 6:
        current = env.start("current", tools=["bash"], write=[str(env.work / "current")])
        assert not any("send signals" in n for n in current.call("status")["sandbox_notes"])


def test_poddaemons_own_files_stay_refused_through_a_bind_mount_in_the_scope(env: Env) -> None:
    """Found by QA: with the data dir bind-mounted inside its scope, a pod's file tools and its
    bash read another pod's session log, and bash appended to it (its chain then broke).
    The protection went by path only; the mount's path is now one of poddaemon's own too."""
    victim = env.start("victim", write=[str(env.work / "victim")])
    with victim.client() as c:
        assert c.run_wait("hello").outcome == "finished"
    (log,) = (env.home / "data" / "sessions").glob("*.jsonl")
    project = env.work / "proj"
    mnt = project / "mnt"
    mnt.mkdir(parents=True)
    if subprocess.run(["mount", "--bind", str(env.home / "data"), str(mnt)]).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        seen = f"mnt/sessions/{log.name}"
        env.model.script(
            {
                "tool_calls": [
                    {"name": "read_file", "arguments": {"path": seen}},
                    {
                        "name": "bash",
                        "arguments": {"command": f"head -c 40 {seen}; echo x >> {seen}"},
                    },
                ]
            },
            {"text": "done"},
        )
        pod = env.start("bound", tools=["read_file", "bash"], write=[str(project)])
        with pod.client() as c:
            assert c.run_wait("look").outcome == "finished"
            entries = c.history(since=0, limit=1000).entries
        read, bash = [e["item"] for e in entries if e["kind"] == "tool_result"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert read["is_error"] and "poddaemon's own files" in read["output"], read
    assert bash["output"].count("Permission denied") == 2, bash
    assert env.podctl("sessions", "verify", log.stem).returncode == 0
