"""Issue 9, start-up and shutdown: the code that starts, the exit status, `--resume`, the claim.

Each test drives real `poddaemon` / `podctl` processes against the fake model.
"""

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from poddaemon.readyline import EXIT_REFUSED
from poddaemon.registry import Registry, make_entry
from poddaemon.scope import Scope
from tests.conftest import READY, Env, PodProcess, StartFailed, drained, wait_until

BIN = Path(sys.executable).parent


def test_spawn_from_a_dir_with_a_poddaemon_folder_starts_the_installed_pod(env: Env) -> None:
    # A `poddaemon/` package where the user stands must not be what `podctl spawn` runs.
    cwd = env.home / "checkout"
    bogus = cwd / "poddaemon"
    bogus.mkdir(parents=True)
    (bogus / "__init__.py").write_text("")
    (bogus / "__main__.py").write_text(
        "import sys\nprint('BOGUS POD', file=sys.stderr)\nsys.exit(7)\n"
    )
    manifest = env.manifest("real")
    podctl = BIN / "podctl"
    spawned = subprocess.run(
        [str(podctl), "spawn", str(manifest)],
        cwd=cwd,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert spawned.returncode == 0, spawned.stderr
    assert "BOGUS" not in spawned.stderr
    name, sock = spawned.stdout.rstrip("\n").split("\t")
    assert name == "real" and sock == str(env.home / "run" / "pods" / "real" / "sock")
    status = subprocess.run(
        [str(podctl), "status", "real", "--json"],
        cwd=cwd,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert '"name": "real"' in status.stdout
    stopped = subprocess.run(
        [str(podctl), "stop", "real"],
        cwd=cwd,
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stopped.returncode == 0, stopped.stderr


# --- item 8: a damaged complete last line is corruption, not a torn write -------------------------


@pytest.mark.parametrize("warned", [False, True])
def test_a_pod_whose_starter_went_before_ready_runs_on(env: Env, warned: bool) -> None:
    """`podctl spawn` killed before READY (an ssh session dropped, a CI job timed out): the
    pod's stderr is a pipe nobody reads. Writing a start-up warning or READY to it raised
    BrokenPipeError and the pod exited 1 without a trace; it now runs on, and what it says
    goes to its stderr.log."""
    missing = str(env.home / "not-there")  # a scope target that does not exist: a warning
    path = env.manifest("orphan", read=[missing] if warned else [])
    read_end, write_end = os.pipe()
    os.close(read_end)  # the starter is gone
    proc = subprocess.Popen(
        [*env.popen_args(), str(path), "--stderr-log"],
        env=env.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=write_end,
        start_new_session=True,
    )
    os.close(write_end)
    sock = env.home / "run" / "pods" / "orphan" / "sock"
    try:
        wait_until(lambda: proc.poll() is not None or answers(sock), what="the pod or its exit")
        assert proc.poll() is None, f"the pod exited {proc.returncode}"
        log = (sock.parent / "stderr.log").read_text()
        assert "ready on" in log
        if warned:
            assert f"{missing} does not exist" in log  # said again where it can be read
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_start_up_warning_is_stamped_in_the_pods_log_and_shown_since(env: Env) -> None:
    """A warning said before READY is said again at the top of stderr.log: it was the plain
    stderr line, with no time nor pid, so `podctl logs --since` left it out (SPEC §6: the
    pod's lines, with timestamps)."""
    missing = str(env.home / "not-there")
    path = env.manifest("warned", read=[missing])
    spawned = env.podctl("spawn", str(path))
    try:
        assert spawned.returncode == 0, spawned.stderr
        assert f"poddaemon: warning: {path}: " in spawned.stderr  # the terminal's, as it was
        shown = env.podctl("logs", "warned", "--since", "5m")
        assert shown.returncode == 0, shown.stderr
        (line,) = [line for line in shown.stdout.splitlines() if f"{missing} does not" in line]
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} poddaemon\[\d+\] WARNING ", line)
    finally:
        env.podctl("stop", "warned")


def answers(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(sock))
            s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"status"}\n')
            return b'"result"' in s.recv(1 << 16)
    except OSError:
        return False


def test_flipped_byte_in_the_complete_last_line_refuses_to_restore(env: Env) -> None:
    pod = env.start("lastline")
    with pod.client() as c:
        c.run_wait("acknowledged and fsync'd")
        sid = c.status().session_id
    assert pod.stop() == 0
    path = env.home / "data" / "sessions" / f"{sid}.jsonl"
    data = bytearray(path.read_bytes())
    lineno = data.count(b"\n")
    assert data.endswith(b"}\n")
    data[-2] ^= 0x01  # the last line keeps its newline but is no longer JSON
    path.write_bytes(bytes(data))
    with pytest.raises(StartFailed) as failed:
        env.restart(pod, "--session", sid)
    assert failed.value.code != 0
    assert f"line {lineno}" in failed.value.stderr and sid in failed.value.stderr
    assert path.read_bytes() == bytes(data)  # nothing cut
    verify = env.podctl("sessions", "verify", sid)
    assert verify.returncode != 0
    assert f"line {lineno}" in verify.stderr and "ok:" not in verify.stdout


# --- item 9: the exit status says whether the pod was asked to stop ----------------------------


def registry_entries(env: Env) -> dict[str, Any]:
    path = env.home / "run" / "pods.json"
    return json.loads(path.read_text())["pods"] if path.exists() else {}


def test_a_registry_claim_taken_over_stops_the_pod_with_status_1(env: Env) -> None:
    pod = env.start("claimed")
    holder = subprocess.Popen(["sleep", "60"])
    try:
        with pod.client() as watcher:
            watcher.subscribe()
            # Someone else's process holds the pod's name now (pods.json rewritten under it):
            # its name and scope are no longer its own, so it must stop, and say it failed.
            registry = Registry(env.home / "run")
            assert registry.release("claimed", pod.proc.pid)
            registry.register(
                make_entry("claimed", "/nowhere", Scope(allow=(), deny=()), pid=holder.pid)
            )
            alert = next(e for e in watcher.events() if e.type == "alert")
        assert alert.data["level"] == "error" and "lost the registry claim" in alert.data["message"]
        assert pod.proc.wait(20) == 1
        said = pod.final_text()  # (its last lines may still be on their way to our reader)
        assert "exiting with status 1" in said and "Traceback" not in said
        assert registry_entries(env)["claimed"]["pid"] == holder.pid  # theirs: left alone
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("how", ["entry removed", "registry deleted", "registry emptied"])
def test_a_pod_whose_entry_went_registers_again(env: Env, how: str) -> None:
    """pods.json lost the pod's entry (removed by hand, as the message for a corrupt registry
    advises, or emptied), and nobody claimed its name or scope since: the pod registers again,
    its session with it, and a pod wanting the same scope is refused as before."""
    pod = env.start("claimed")
    pod.call("run", input="hello", wait=True)
    before = registry_entries(env)["claimed"]
    assert before["session"] is not None
    path = env.home / "run" / "pods.json"
    if how == "entry removed":
        assert Registry(env.home / "run").release("claimed", pod.proc.pid)
    elif how == "registry deleted":
        path.unlink()
    else:
        path.write_text("")
    again = wait_until(
        lambda: path.exists() and path.read_text() and registry_entries(env).get("claimed"),
        20,
        "the entry back",
    )
    assert (again["pid"], again["session"], again["scope"]) == (
        before["pid"],
        before["session"],
        before["scope"],
    )
    assert pod.call("status")["state"] == "idle" and pod.proc.poll() is None
    # (the harness's stderr thread may read the line after the registry shows the entry)
    wait_until(lambda: "registered it again" in pod.text(), what="the log line")
    with pytest.raises(StartFailed) as refused:
        env.start("rival", write=[str(env.work)])
    assert "claimed" in refused.value.stderr


def test_a_pod_started_before_a_live_one_registers_again_is_refused(env: Env) -> None:
    """pods.json removed by hand, and a pod for the same scope started at once: it took the
    live pod's write scope before that one could register again, and the live one stopped."""
    pod = env.start("claimed")
    (env.home / "run" / "pods.json").unlink()
    with pytest.raises(StartFailed) as refused:
        env.start("rival", write=[str(env.work)])
    assert "claimed" in refused.value.stderr
    wait_until(lambda: registry_entries(env).get("claimed"), 20, "the entry back")
    assert pod.proc.poll() is None and pod.call("status")["state"] == "idle"


def test_a_pod_whose_socket_is_removed_stops_with_status_1(env: Env) -> None:
    # Nobody could reach it any more (not even `podctl stop`), while it kept its name and
    # scope: a failure, so that a supervisor starts it again on a new socket.
    pod = env.start("unreachable")
    os.unlink(pod.socket)
    assert pod.proc.wait(20) == 1
    said = pod.final_text()
    assert "socket" in said and "Traceback" not in said
    assert registry_entries(env) == {}
    assert env.start("unreachable").call("status")["name"] == "unreachable"


def test_a_pod_whose_socket_directory_is_replaced_by_a_file_stops_with_status_1(env: Env) -> None:
    """Its directory removed, the pod stopped (exit 1, and its unit started it again); with a
    file put in the directory's place, looking at the socket failed with ENOTDIR, which it
    took for "cannot look right now": it ran on out of reach, `starting` in `podctl ls`,
    holding its name and scope, and its unit never restarted it."""
    pod = env.start("covered")
    pod_dir = Path(pod.socket).parent
    shutil.rmtree(pod_dir)
    pod_dir.write_text("")
    try:
        assert pod.proc.wait(20) == 1
    finally:
        pod_dir.unlink()
    assert "socket" in pod.text() and "Traceback" not in pod.text()
    assert registry_entries(env) == {}


def test_a_pod_that_stops_leaves_a_socket_bound_at_its_path_by_another_alone(env: Env) -> None:
    """Once its claim is lost, a new pod of the name may bind the same path: the stopping pod
    removed that socket too (it unlinked the path unchecked), and the new pod, finding its
    socket gone, stopped as well."""
    pod = env.start("replaced")
    os.unlink(pod.socket)
    with socket.socket(socket.AF_UNIX) as newcomer:
        newcomer.bind(pod.socket)
        newcomer.listen(1)
        theirs = os.stat(pod.socket).st_ino
        assert pod.proc.wait(20) == 1  # its socket was replaced: it stops
        assert os.stat(pod.socket).st_ino == theirs


def test_requested_stops_exit_0(env: Env) -> None:
    by_call = env.start("asked")
    assert by_call.stop() == 0
    by_signal = env.start("signalled")
    by_signal.proc.send_signal(signal.SIGINT)
    assert by_signal.proc.wait(20) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_while_starting_is_a_requested_shutdown(env: Env, sig: int) -> None:
    # Start-up can take long (MCP servers, SessionStart hooks): SIGTERM (`systemctl stop`),
    # SIGINT (Ctrl-C) and SIGHUP (a closed terminal) then still mean shutdown (SPEC §7): exit 0,
    # the claim given up, no traceback, and nothing the start-up started left running.
    started = env.work / "hook-started"
    hook = f"touch {started}; exec sleep 173"
    extra = f'[[hooks.SessionStart]]\ncommand = "{hook}"\ntimeout = 60\n'
    pod = PodProcess(env.popen(str(env.manifest("slow", extra=extra))), "slow")
    env.pods.append(pod)
    wait_until(started.exists, 20, "the SessionStart hook")
    pod.proc.send_signal(sig)
    assert pod.proc.wait(20) == 0, pod.final_text()
    assert "Traceback" not in pod.final_text()
    assert registry_entries(env) == {}
    assert not (env.home / "run" / "pods" / "slow" / "pid").exists()
    leftovers = subprocess.run(["pgrep", "-f", "sleep 173"], capture_output=True, text=True)
    assert leftovers.stdout == ""


# --- item 10: --resume is the newest session of this pod, or a new one ---------------------------


def test_resume_without_any_session_starts_a_new_one(env: Env) -> None:
    pod = env.start("fresh", "--resume")
    with pod.client() as c:
        c.run_wait("first words")
        sid = c.status().session_id
    assert sid and pod.stop() == 0
    again = env.restart(pod, "--resume")
    with again.client() as c:
        assert c.status().session_id == sid
        texts = [e.get("text") for e in c.history().entries]
    assert "first words" in texts


def test_resume_picks_the_newest_session_of_this_pod_name(env: Env) -> None:
    first = env.start("multi")
    with first.client() as c:
        c.run_wait("old session")
        old = c.status().session_id
    assert first.stop() == 0
    second = env.restart(first)  # no --resume: a new session
    with second.client() as c:
        c.run_wait("new session")
        new = c.status().session_id
    assert second.stop() == 0
    other = env.start("other", write=[str(env.home / "elsewhere")])  # a newer session, other pod
    with other.client() as c:
        c.run_wait("not mine")
    assert other.stop() == 0
    assert old != new
    resumed = env.restart(first, "--resume")
    assert resumed.call("status")["session_id"] == new


def test_resume_continues_the_session_the_pod_wrote_last(env: Env) -> None:
    # A pod restored from an older session (`--session`) and then killed must come back in
    # that session (a unit, `podctl restart` pass --resume): its queued input was
    # acknowledged there and must still be processed.
    env.model.script({"text": "first"}, {"text": "second"}, {"text": "held", "gate": "g"})
    first = env.start("back")
    old = first.call("run", input="old session", wait=True)
    old_sid = first.call("status")["session_id"]
    assert first.stop() == 0
    second = env.restart(first)  # no --resume: a new, newer session
    second.call("run", input="new session", wait=True)
    assert second.call("status")["session_id"] != old_sid and second.stop() == 0
    again = env.restart(first, "--session", old_sid)
    again.call("run", input="held at the model")
    queued = again.call("run", input="acknowledged, then a crash")
    assert queued["state"] == "queued" and old["outcome"] == "finished"
    again.kill9()
    env.model.open_gate("g")
    resumed = env.restart(first, "--resume")
    assert resumed.call("status")["session_id"] == old_sid
    drained(resumed)
    runs = [
        e["run_id"]
        for e in resumed.call("history", limit=1000)["entries"]
        if e["kind"] == "run_end"
    ]
    assert queued["run_id"] in runs


def test_resume_names_the_newer_sessions_that_name_no_pod(env: Env) -> None:
    """Its session's first line damaged, the pod's --resume started afresh in silence, leaving
    what that session acknowledged; now it says which files name no pod."""
    first = env.start("dmg")
    first.call("run", input="remember this", wait=True)
    sid = first.call("status")["session_id"]
    assert first.stop() == 0
    path = env.home / "data" / "sessions" / f"{sid}.jsonl"
    path.write_bytes(b"#" + path.read_bytes()[1:])
    again = env.restart(first, "--resume")
    assert again.call("status")["session_id"] != sid
    said = f"--resume: no session of this pod, and session log(s) {sid} written since name no pod"
    assert said in again.text()
    assert again.stop() == 0


def test_a_damaged_session_is_refused_with_the_ways_on(env: Env) -> None:
    """An edited entry (hash mismatch): the refusal named the file and the line, and nothing
    a user could do about it (found by QA). It says the file is untouched and the ways on;
    the second of them, taken, starts the pod."""
    pod = env.start("edited")
    assert pod.call("run", input="remember the milk", wait=True)["outcome"] == "finished"
    sid = pod.call("status")["session_id"]
    assert pod.stop() == 0
    path = env.home / "data" / "sessions" / f"{sid}.jsonl"
    path.write_bytes(path.read_bytes().replace(b"remember the milk", b"remember the MILK"))
    with pytest.raises(StartFailed) as failed:
        env.restart(pod, "--resume")
    assert failed.value.code == EXIT_REFUSED
    said = failed.value.stderr
    assert f"cannot restore session {sid}: {path}: line 2: hash mismatch" in said, said
    assert "nothing was written to it: repair that line, or move the file out of the " in said
    aside = env.home / f"{sid}.jsonl.aside"
    path.rename(aside)
    again = env.restart(pod, "--resume")  # from the session before it: here none, so afresh
    assert again.call("status")["session_id"] != sid


def test_resume_refuses_to_start_afresh_past_the_damaged_session_the_pod_held(env: Env) -> None:
    """Killed with a run acknowledged, then its only session's first line damaged: --resume
    started a new, empty session (exit 0, a warning) and the run was never processed. The
    entry the dead pod left in pods.json names that session: the start is refused, naming it."""
    env.model.script({"text": "held", "gate": "g"})
    first = env.start("dmgheld")
    first.call("run", input="held at the model")
    queued = first.call("run", input="acknowledged, then a crash")
    assert queued["state"] == "queued"
    sid = first.call("status")["session_id"]
    first.kill9()
    path = env.home / "data" / "sessions" / f"{sid}.jsonl"
    damaged = b"[" + path.read_bytes()[1:]
    path.write_bytes(damaged)
    files = sorted(path.parent.iterdir())
    with pytest.raises(StartFailed) as failed:
        env.restart(first, "--resume")
    assert failed.value.code == EXIT_REFUSED  # starting it again changes nothing
    said = f"--resume: session {sid}, which pod 'dmgheld' held when it stopped"
    assert said in failed.value.stderr
    assert path.read_bytes() == damaged  # nothing written into it, no new session either
    assert sorted(path.parent.iterdir()) == files


def test_resume_refuses_to_continue_a_session_a_damaged_one_continues(env: Env) -> None:
    """The compacted session's first line damaged, --resume took the session it was compacted
    from as the pod's newest again and wrote on in it: what the compacted one acknowledged
    was never processed, and the chain branched."""
    first = env.start("dmgchain")
    first.call("run", input="before the compaction", wait=True)
    old = first.call("status")["session_id"]
    new = first.call("compact")["session_id"]
    first.call("run", input="acknowledged after it", wait=True)
    assert first.stop() == 0
    sessions = env.home / "data" / "sessions"
    path = sessions / f"{new}.jsonl"
    data = path.read_bytes()
    end = data.index(b"\n")
    path.write_bytes(data[: end - 1] + data[end:])  # its first line's closing brace gone
    before = (sessions / f"{old}.jsonl").read_bytes()
    with pytest.raises(StartFailed) as failed:
        env.restart(first, "--resume")
    assert failed.value.code == EXIT_REFUSED  # starting it again changes nothing
    said = f"--resume: session {old} is continued by session {new}, whose first line is damaged"
    assert said in failed.value.stderr
    assert (sessions / f"{old}.jsonl").read_bytes() == before  # nothing written into it


# --- item 21: one clear line for a missing session or pwd ----------------------------------------


def test_missing_session_is_one_clear_line(env: Env) -> None:
    manifest = env.manifest("nosession")
    proc = env.popen(str(manifest), "--session", "0190aaaa-0000-7000-8000-000000000000")
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_REFUSED  # a unit does not start it again
    sessions = env.home / "data" / "sessions"
    assert err == (
        f"poddaemon: --session: no session 0190aaaa-0000-7000-8000-000000000000 under {sessions}\n"
    )
    assert registry_entries(env) == {}


def test_missing_pwd_is_reported_as_missing(env: Env) -> None:
    missing = env.work / "not-there"
    manifest = env.manifest("nopwd", write=[str(env.work)], pwd=str(missing))
    proc = env.popen(str(manifest))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_REFUSED  # a unit does not start it again
    assert err == f"poddaemon: {manifest}: pod.pwd: {missing} does not exist\n"


def test_a_pwd_inside_poddaemons_own_directories_says_so(env: Env) -> None:
    # The scope covers it, yet it is refused: "not readable under the pod's scope (scope.allow
    # resolves to <a dir around it> (write))" left the user nowhere to look.
    data = env.home / "data"
    data.mkdir(exist_ok=True)
    manifest = env.manifest("ownpwd", write=[str(env.home)], pwd=str(data))
    proc = env.popen(str(manifest))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_REFUSED
    assert err.startswith(
        f"poddaemon: {manifest}: pod.pwd: {data} is inside poddaemon's own directories ("
    )
    assert err.endswith("), which no pod may use, whatever its scope says\n")


def test_a_template_error_in_defaults_names_defaults_toml(env: Env) -> None:
    # README: errors name the file, line and field. It named the manifest, which has none.
    defaults = env.home / "config" / "defaults.toml"
    defaults.parent.mkdir(exist_ok=True)
    defaults.write_text('[worker]\ninstruction = "Hello {{ nope }}"\n')
    manifest = env.manifest("fromdefaults")
    manifest.write_text(
        manifest.read_text().replace('instruction = "You are a test pod."', "max_turns = 3")
    )
    proc = env.popen(str(manifest))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_REFUSED
    assert err == (
        f"poddaemon: {defaults}: worker.instruction:1: template error: 'nope' is undefined\n"
    )


def test_missing_instruction_file_names_the_manifest_and_the_field(env: Env) -> None:
    # SPEC §3: every error names the file and field; here the file is the manifest.
    manifest = env.manifest("noprompt")
    text = manifest.read_text().replace(
        'instruction = "You are a test pod."', 'instruction_file = "prompts/gone.md"'
    )
    manifest.write_text(text)
    proc = env.popen(str(manifest))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_REFUSED  # a unit does not start it again
    assert err == (
        f"poddaemon: {manifest}: worker.instruction_file: cannot read "
        f"{env.work}/prompts/gone.md: No such file or directory\n"
    )


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("device", "not a regular file"),
        ("fifo", "not a regular file"),
        ("huge", "larger than 4 MiB"),
        ("latin1", "is not UTF-8 (invalid continuation byte at byte 3)"),
    ],
)
def test_an_instruction_file_that_is_no_prompt_is_one_clear_line(
    env: Env, kind: str, problem: str
) -> None:
    # A device was read to its end (/dev/zero: all memory; /dev/null here, to fail without
    # eating it), a wrong path to a big file became the system prompt, a non-UTF-8 file was
    # a traceback.
    prompt = env.work / "prompt.md"
    if kind == "device":
        prompt.symlink_to("/dev/null")
    elif kind == "fifo":  # where the model writes, `mkfifo` made every later start hang
        os.mkfifo(prompt)
    elif kind == "huge":
        prompt.write_bytes(b"x" * (4 * 1024 * 1024 + 1))
    else:
        prompt.write_bytes("Café".encode("latin-1") + b" au lait")
    manifest = env.manifest("badprompt")
    text = manifest.read_text().replace(
        'instruction = "You are a test pod."', f'instruction_file = "{prompt}"'
    )
    manifest.write_text(text)
    proc = env.popen(str(manifest))
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == EXIT_REFUSED  # a unit does not start it again
    if kind == "latin1":
        assert err == f"poddaemon: {manifest}: worker.instruction_file: {prompt} {problem}\n"
    else:
        assert err == (
            f"poddaemon: {manifest}: worker.instruction_file: cannot read {prompt}: {problem}\n"
        )
    assert registry_entries(env) == {}


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("Today is {{ now.date() }}.\n{{ 1 / 0 }}", "2: template error: division by zero"),
        ("{% include 'other.md' %}", "1: template error: no loader for this environment specified"),
        ("{% for i in range(10**9) %}.{% endfor %}", "1: template error: Range too big."),
        # 100 MB: a session_start entry the history cannot page, sent with every model call
        ('{{ "x" * 10**8 }}', " template error: it renders to 100000000 bytes, more than 4 MiB"),
    ],
)
def test_a_template_that_fails_to_render_is_one_clear_line(
    env: Env, template: str, problem: str
) -> None:
    # Not only an undefined name: whatever an expression raises is the template's error, and
    # refuses the pod (exit 78, no restart by systemd) in one line naming manifest and line.
    manifest = env.manifest("badtemplate", instruction=template)
    proc = env.popen(str(manifest))
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:  # it started
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == EXIT_REFUSED
    assert err.startswith(f"poddaemon: {manifest}: worker.instruction:{problem}")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert registry_entries(env) == {}


# --- item 22: the name is free as soon as the pod stops, whatever is still in flight -------------


def test_stop_frees_the_name_without_waiting_for_a_stuck_sdk_import(env: Env) -> None:
    # A stand-in `openai` package that blocks its importer until the gate file exists: the run's
    # SDK import thread is stuck, as a slow import is for half a second in real life.
    shim = env.home / "shim"
    (shim / "openai").mkdir(parents=True)
    gate = env.home / "gate"
    entered = env.home / "entered"
    (shim / "openai" / "__init__.py").write_text(
        "import os, time\n"
        f"open({str(entered)!r}, 'w').close()\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.01)\n"
        "raise ImportError('stand-in openai released')\n"
    )
    env.env["PYTHONPATH"] = f"{shim}{os.pathsep}{env.env['PYTHONPATH']}"
    try:
        pod = env.start("stuck")
        with pod.client() as c:
            c.run("hello")
            wait_until(lambda: c.status().state == "running", what="the run to start")
            # The package's own code is running: the import is stuck wherever it happens (it
            # once happened on the model thread's loop, which the stop then waited for).
            wait_until(entered.exists, what="the SDK import to get stuck")
            c.shutdown()
        wait_until(lambda: "stuck" not in registry_entries(env), what="the registry entry to go")
        assert not os.path.exists(pod.socket)
        assert pod.proc.wait(20) == 0  # exits with the import thread still stuck in the gate
        # The name is free: the same manifest starts again at once.
        again = env.restart(pod)
        assert again.call("status")["pid"] == again.proc.pid
        assert again.stop() == 0
    finally:
        gate.touch()


def _with_open_files(soft: int, hard: int) -> Any:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_open_file_limit_too_low_to_run_refuses_the_pod_in_one_line(env: Env) -> None:
    """At `ulimit -n 10` the event loop could not even start: three chained tracebacks, and a
    registry entry left behind. Now one line, exit 78, nothing claimed."""
    path = env.manifest("fewfiles")
    proc = subprocess.run(
        [*env.popen_args(), str(path)],
        env=env.env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_with_open_files(10, 10),
    )
    assert proc.returncode == EXIT_REFUSED, proc.stderr
    assert proc.stderr == (
        "poddaemon: the open-file limit (ulimit -n) is 10; a pod needs at least 64\n"
    )
    assert registry_entries(env) == {}


def test_a_pod_raises_its_soft_open_file_limit_toward_the_hard_one(env: Env) -> None:
    proc = env.popen(str(env.manifest("morefiles")), preexec_fn=_with_open_files(64, 20000))
    pod = PodProcess(proc, "morefiles")
    env.pods.append(pod)
    pod.wait_ready()
    assert resource.prlimit(proc.pid, resource.RLIMIT_NOFILE) == (4096, 20000)


def test_a_pod_without_mcp_servers_starts_without_what_it_does_not_use(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15's start-up budget: the MCP client (~3 ms) loads only for a manifest with
    servers, and the commands' temp dir is made without tempfile (which imports shutil, bz2
    and lzma: ~2 ms). Read from the pod's own import profile, up to its READY line."""
    monkeypatch.setitem(env.env, "PYTHONPROFILEIMPORTTIME", "1")
    pod = env.start("lean", tools=["bash", "read_file"])
    ready = next(i for i, line in enumerate(pod.stderr) if line.startswith(READY))
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in pod.stderr[:ready]
        if line.startswith("import time:")
    }
    assert {"asyncio", "poddaemon.sandbox.pod", "poddaemon.mcp"} <= imported  # a real profile
    assert not imported & {"poddaemon.mcp.connection", "tempfile", "shutil", "bz2", "lzma"}
    # bash is listed, so the sandbox made the commands' temp dir (that is what it needs).
    assert pod.call("status")["sandbox"].startswith("landlock-abi-")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_pwd_or_hook_script_through_another_users_symlink_is_refused(env: Env) -> None:
    """The pod checked where its pwd led at start-up, then ran `<pwd>/hooks/guard.sh` through
    the link as written: its owner repointed it at a tree of theirs, and their guard.sh ran
    as the pod's user (sandbox off); under the sandbox it could not run, and the write it
    guarded went ahead."""
    hooks = env.work / "hooks"
    hooks.mkdir(parents=True)
    (hooks / "guard.sh").write_text("#!/bin/sh\nexit 2\n")
    (hooks / "guard.sh").chmod(0o755)
    link = env.home / "current"
    link.symlink_to(env.work)
    os.lchown(link, 65534, 65534)  # another user's link, as in a shared /tmp
    hook = '[[hooks.PreToolUse]]\nmatcher = "write_file"\ncommand = "./hooks/guard.sh"\n'
    with pytest.raises(StartFailed) as refused:
        env.start("linked", pwd=str(link), extra=hook)
    assert (
        f"pod.pwd: {link} is reached through the symlink {link}, owned by uid 65534, who could "
        "repoint it while the pod runs: refusing it"
    ) in refused.value.stderr
    script = f'[[hooks.PreToolUse]]\nmatcher = "write_file"\ncommand = "{link}/hooks/guard.sh"\n'
    with pytest.raises(StartFailed) as refused:
        env.start("linked", extra=script)
    assert f"hooks.PreToolUse[0].command {link}/hooks/guard.sh is reached" in refused.value.stderr
    os.lchown(link, 0, 0)  # ours: fine
    assert env.start("linked", pwd=str(link), extra=hook).stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize(
    "field",
    ["hooks.SessionStart[0].command", "mcp.servers[0].command", "worker.instruction_file"],
)
def test_a_file_another_user_owns_or_could_change_is_refused_at_every_start(
    env: Env, field: str
) -> None:
    """Only `unit install` refused a hook script, stdio MCP server or instruction file another
    user owns or could change; `podctl spawn` (and `podctl restart`) ran another user's hook
    as you, and their MCP server as you outside any sandbox (found by QA)."""
    script = env.home / "theirs.sh"
    script.write_text("#!/bin/sh\ntouch \"$0.ran\"\n")
    extra = {
        "hooks.SessionStart[0].command": f'[[hooks.SessionStart]]\ncommand = "{script}"\n',
        "mcp.servers[0].command": f'[[mcp.servers]]\nname = "m"\ncommand = ["{script}"]\n',
    }.get(field, "")
    manifest = env.manifest("theirs", extra=extra)
    if field == "worker.instruction_file":
        text = manifest.read_text().replace(
            'instruction = "You are a test pod."', f'instruction_file = "{script}"'
        )
        manifest.write_text(text)

    def refused() -> str:
        with pytest.raises(StartFailed) as failed:
            PodProcess(env.popen(str(manifest)), "theirs").wait_ready()
        return failed.value.stderr

    script.chmod(0o755)
    os.chown(script, 65534, 65534)
    assert f"{field} {script} is owned by uid 65534: refusing it" in refused()
    os.chown(script, 0, 0)
    script.chmod(0o757)  # ours, but anyone may rewrite it
    said = refused()
    assert f"{field} {script} is writable by group or others" in said
    assert f"chmod go-w {script}" in said
    assert not (env.home / "theirs.sh.ran").exists()  # refused before anything ran
    assert registry_entries(env) == {}
