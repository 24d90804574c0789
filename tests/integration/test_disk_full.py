"""A full disk: the caller gets the error, subscribers an alert, the pod stops, nothing is lost."""

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import RpcError
from protocol.errors import ConnectionClosed
from tests.conftest import Env, StartFailed


@pytest.fixture
def small_data_dir(env: Env) -> Iterator[Path]:
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    data = env.home / "data"
    data.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(data)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield data
    finally:
        env.cleanup()
        subprocess.run(["umount", "-l", str(data)], check=False)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_disk_full_is_reported_and_nothing_acknowledged_is_lost(
    env: Env, small_data_dir: Path
) -> None:
    pod = env.start("full")
    with pod.client() as c:
        first = c.run_wait("before the disk filled up")
    assert first.outcome == "finished"
    filler = fill(small_data_dir)
    with pod.client() as watcher, pod.client() as c:
        watcher.subscribe()
        with pytest.raises(RpcError) as err:
            c.run("x" * 64 * 1024)  # needs new pages: the append cannot fit
        assert "could not persist" in err.value.message
        assert "No space left on device" in err.value.message
        alert = next(e for e in watcher.events() if e.type == "alert")
    assert alert.data["level"] == "error" and "No space left" in alert.data["message"]
    assert f"session log {small_data_dir}/sessions/" in alert.data["message"]  # which file
    # It stops rather than run without a log, and says so with its exit status (SPEC §7), so a
    # supervisor restarts it.
    assert pod.proc.wait(20) == 1
    assert pod.final_text().count("; the pod stops") == 1  # said once, when it happened
    filler.unlink()
    again = env.restart(pod, "--resume")
    entries = again.call("history")["entries"]
    assert any(e["kind"] == "run_end" and e["run_id"] == first.run_id for e in entries)
    assert not any(e.get("text", "").startswith("xxxx") for e in entries)  # never acknowledged


@pytest.mark.parametrize("watched", [True, False], ids=["subscribed", "alone"])
def test_a_run_whose_end_cannot_be_written_is_never_reported_finished(
    env: Env, small_data_dir: Path, watched: bool
) -> None:
    """What a client hears of is in the log first: when the run's last entries cannot be
    written, no subscriber hears `run.finished` and `run` with `wait` gets an error, so the run
    ends once, when the restored pod closes it as interrupted."""
    pod = env.start("full")
    env.model.script({"text": "z" * 64 * 1024, "gate": "answer"})  # new pages: cannot fit
    waited: list[object] = []

    def run_and_wait() -> None:
        with pod.client() as c:
            try:
                waited.append(c.run_wait("go"))
            except RpcError as exc:
                waited.append(exc)

    heard = []
    with pod.client() as watcher:
        if watched:
            watcher.subscribe()
        runner = threading.Thread(target=run_and_wait)
        runner.start()
        env.model.wait_for_requests(1)  # the input is durable, the model is answering
        filler = fill(small_data_dir)
        env.model.open_gate("answer")
        if watched:
            with pytest.raises(ConnectionClosed):
                for event in watcher.events():  # until the pod, stopping, closes the connection
                    heard.append(event)
        runner.join(20)
    assert [e for e in heard if e.type == "run.finished"] == []
    if watched:
        alerts = [e.data["message"] for e in heard if e.type == "alert"]
        assert any("No space left" in m for m in alerts), [e.type for e in heard]
        assert [e.data for e in heard if e.type == "shutdown"] == [{"reason": "failed"}]
    (result,) = waited
    assert isinstance(result, RpcError) and "could not persist" in result.message, result
    assert pod.proc.wait(20) == 1
    filler.unlink()
    entries = env.restart(pod, "--resume").call("history")["entries"]
    (run_id,) = [e["run_id"] for e in entries if e["kind"] == "user_input" and e["text"] == "go"]
    ends = [e for e in entries if e["kind"] == "run_end" and e["run_id"] == run_id]
    assert [(e["outcome"], e["interrupted"]) for e in ends] == [("error", True)], ends


def test_a_pod_that_cannot_keep_its_config_says_which_file_and_leaves_no_debris(
    env: Env, small_data_dir: Path
) -> None:
    pod = env.start("full")
    assert pod.stop() == 0
    filler = fill(small_data_dir)
    kept = small_data_dir / "pods"
    for _ in range(2):  # as a supervisor restarting it would
        with pytest.raises(StartFailed) as failed:
            env.restart(pod, "--resume")
        assert failed.value.code == 1
        said = f"cannot start pod 'full': {kept / 'full.toml'}: No space left on device"
        assert said in failed.value.stderr, failed.value.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["full.toml"]
    filler.unlink()
    assert env.restart(pod, "--resume").stop() == 0


def test_a_session_that_cannot_be_forked_on_a_full_disk_is_reported_as_such(
    env: Env, small_data_dir: Path
) -> None:
    """Another writer moved the session's head, so the pod must continue in a new session,
    and the disk is full: the caller hears why, the pod stops, no traceback."""
    pod = env.start("full")
    with pod.client() as c:
        c.run_wait("before")
        session = c.status().session_id
    with (small_data_dir / "sessions" / f"{session}.jsonl").open("a") as f:
        f.write('{"someone": "else"}\n')
    fill(small_data_dir)
    with pod.client() as c, pytest.raises(RpcError) as err:
        c.notify("after")
    assert "could not persist" in err.value.message
    assert "No space left on device" in err.value.message, err.value.message
    assert pod.proc.wait(20) == 1
    assert "Traceback" not in pod.final_text(), pod.text()


def test_podctl_send_says_why_the_pod_stopped_before_the_run_ended(
    env: Env, small_data_dir: Path
) -> None:
    pod = env.start("full")
    env.model.script({"text": "z" * 64 * 1024, "gate": "answer"})
    send = env.podctl_popen("send", "full", "go")
    env.model.wait_for_requests(1)
    fill(small_data_dir)
    env.model.open_gate("answer")
    _, err = send.communicate(timeout=60)
    assert send.returncode == 3  # not running (SPEC §6)
    assert err.startswith("podctl: pod 'full' is not running: it went away before run "), err
    assert "No space left on device" in err and len(err.splitlines()) == 1, err
    assert pod.proc.wait(20) == 1


def test_a_compaction_on_a_full_disk_names_the_file_and_keeps_the_old_session(
    env: Env, small_data_dir: Path
) -> None:
    """`podctl compact` (or a run's compaction) whose new session cannot be written: the pod
    stops saying which file, as for any log it cannot write (it said only "cannot write the
    compacted session: [Errno 28] ..."), and `--resume` goes on in the old session, whole."""
    marker = "Your context is about to be compacted"
    pod = env.start("full", extra="[compaction]\ncompact_threshold = 100000\n")
    with pod.client() as c:
        first = c.run_wait("before the disk filled up")
        old = c.status().session_id
    env.model.script_when(marker, {"text": "the summary"})
    filler = fill(small_data_dir)
    out = env.podctl("compact", "full")
    assert out.returncode == 1
    assert f"cannot write the compacted session {small_data_dir}/sessions/" in out.stderr
    assert "No space left on device" in out.stderr and "Errno" not in out.stderr, out.stderr
    assert pod.proc.wait(20) == 1
    filler.unlink()
    assert sorted(p.name for p in (small_data_dir / "sessions").iterdir()) == [f"{old}.jsonl"]
    again = env.restart(pod, "--resume")
    assert again.call("status")["session_id"] == old
    entries = again.call("history")["entries"]
    assert any(e["kind"] == "run_end" and e["run_id"] == first.run_id for e in entries)


def test_a_first_input_on_a_full_disk_names_the_session_file_it_could_not_make(
    env: Env, small_data_dir: Path
) -> None:
    """A pod whose first session cannot be written said "cannot create session log: [Errno
    28] No space left on device": which file, which disk, the caller and the journal could
    not tell."""
    pod = env.start("full")
    filler = fill(small_data_dir)
    with pod.client() as c, pytest.raises(RpcError) as err:
        c.run("x" * 64 * 1024)
    assert f"cannot create session log {small_data_dir}/sessions/" in err.value.message
    assert err.value.message.endswith(".jsonl: No space left on device"), err.value.message
    assert pod.proc.wait(20) == 1
    filler.unlink()
    assert env.restart(pod, "--resume").call("status")["session_id"] is None  # nothing taken
