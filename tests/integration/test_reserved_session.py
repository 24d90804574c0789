"""A pod with no session makes its first session's file right after READY, ahead of its first
input, and names it in the registry. Killed (-9) before any input came, it left that empty
file, one more per life (a crash loop under `Restart=on-failure` with `--resume`), and
`podctl sessions verify` failed on it. Real pods, killed for real: the next start reclaims
the dead pod's entry and removes its empty file; what holds bytes is never removed; an empty
file is a session with no entries to every reader."""

from pathlib import Path

from poddaemon.registry import Registry
from tests.conftest import Env, PodProcess, StartFailed, wait_until


def sessions_dir(env: Env) -> Path:
    return env.home / "data" / "sessions"


def files(env: Env) -> dict[str, int]:
    """Every session file: its id and size."""
    root = sessions_dir(env)
    if not root.is_dir():
        return {}
    return {p.name.removesuffix(".jsonl"): p.stat().st_size for p in root.glob("*.jsonl")}


def reserved(env: Env, pod: PodProcess) -> str:
    """The session whose file `pod` made ahead of its first input, once the registry names
    it and the file is there (the pod makes it in the background after READY)."""

    def named() -> str | None:
        entry = Registry(env.home / "run").get(pod.name)
        sid = entry.session if entry is not None else None
        return sid if sid is not None and files(env).get(sid) == 0 else None

    sid: str = wait_until(named, what=f"{pod.name}'s session file to be made ahead")
    return sid


def test_a_crash_loop_before_any_input_leaves_no_pile_of_empty_session_files(env: Env) -> None:
    pod = env.start("looper", "--resume")
    seen = [reserved(env, pod)]
    for _ in range(3):  # killed, then started again as a unit restarts it: --resume
        pod.kill9()
        pod = env.restart(pod, "--resume")
        sid = reserved(env, pod)
        assert sid not in seen  # a new session: no input came, there is nothing to resume
        seen.append(sid)
        assert files(env) == {sid: 0}  # the earlier lives' empty files are gone
    r = env.podctl("sessions", "list")
    assert (r.returncode, r.stdout) == (0, "")
    assert pod.stop() == 0
    assert files(env) == {}  # a clean stop removes its own, as it did before


def test_a_session_with_input_is_kept_when_its_pod_is_killed_and_reclaimed(env: Env) -> None:
    """The reclaim removes only an empty file: one with an acknowledged input stays, and
    --resume goes on in it."""
    env.model.script({"text": "noted"})
    pod = env.start("keeper", write=[str(env.work / "keeper")])
    with pod.client() as c:
        c.run_wait("remember this")
        sid = c.status().session_id
    assert sid is not None and files(env)[sid] > 0
    pod.kill9()
    other = env.start("other", write=[str(env.work / "other")])  # reclaims keeper's entry
    assert Registry(env.home / "run").entry("keeper") is None
    assert files(env)[sid] > 0
    again = env.restart(pod, "--resume")
    with again.client() as c:
        assert c.status().session_id == sid
    assert again.stop() == 0 and other.stop() == 0
    r = env.podctl("sessions", "verify", sid)
    assert r.returncode == 0 and r.stdout.startswith("ok: "), r.stderr


def test_an_empty_session_file_left_behind_reads_as_a_session_with_no_entries(env: Env) -> None:
    """Nothing reclaimed the dead pod's entry yet (no pod started since): the empty file is
    there. `sessions verify` says it holds no entries and succeeds; `show` shows none;
    `--session` of it is refused with a reason, not reported as a damaged log."""
    pod = env.start("victim")
    sid = reserved(env, pod)
    pod.kill9()
    assert files(env) == {sid: 0}
    r = env.podctl("sessions", "verify", sid)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: 0 entries (an empty file: ")
    assert "nothing in it was acknowledged" in r.stdout
    r = env.podctl("sessions", "show", sid)
    assert (r.returncode, r.stdout) == (0, "")
    assert r.stderr.startswith(f"podctl: {sid}: no entries (an empty file: ")
    r = env.podctl("sessions", "list")
    assert (r.returncode, r.stdout) == (0, "")
    try:
        env.restart(pod, "--session", sid)
    except StartFailed as exc:
        assert exc.code != 0
        assert f"--session: session {sid} has no entries" in exc.stderr
        assert "line 1" not in exc.stderr  # not a damaged log: there is nothing to restore
    else:
        raise AssertionError("--session of an empty session file started a pod")
    assert files(env) == {sid: 0}  # the refused start (its claim failed first) removed nothing
