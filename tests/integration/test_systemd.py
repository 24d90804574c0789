"""Pods as units of a REAL `systemd --user` manager (with journald), per ../shared/SYSTEMD.md.

Each test gets its own manager in a private mount namespace and its own cgroup; `podctl` and
`systemctl --user` run inside that namespace, the pods' sockets (under PODDAEMON_HOME in /tmp) are
reached from the test directly. API keys reach the unit through `<config>/env`.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol import PodClient, RpcError
from tests.conftest import ROOT, Env, wait_until
from tests.integration.systemd_manager import UserManager, unavailable

pytestmark = pytest.mark.timeout(60)

WATCHDOG = 2  # seconds: short, so the wedged-loop test is quick


class Sd:
    """One manager plus the sandboxed poddaemon home it serves."""

    def __init__(self, env: Env, manager: UserManager) -> None:
        self.env = env
        self.m = manager
        self.config = env.home / "config"
        self.config.mkdir(mode=0o700, exist_ok=True)
        self.env_file = self.config / "env"
        self.podenv = {"PODDAEMON_HOME": str(env.home), "PYTHONPATH": str(ROOT)}

    def podctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.m.run([sys.executable, "-m", "cli.main", *args], self.podenv, timeout)

    def write_env(self, **values: str) -> None:
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        self.env_file.chmod(0o600)

    def install(self, name: str, *extra: str, **manifest: Any) -> Path:
        path = self.env.manifest(name, **manifest)
        out = self.podctl("unit", "install", str(path), "--now", *extra)
        assert out.returncode == 0, out.stderr + self.journal(name)
        return path

    def unit(self, name: str) -> str:
        return f"poddaemon-{name}.service"

    def prop(self, name: str, prop: str) -> str:
        return self.m.prop(self.unit(name), prop)

    def main_pid(self, name: str) -> int:
        return int(self.prop(name, "MainPID"))

    def wait_prop(self, name: str, prop: str, value: str, timeout: float = 20) -> None:
        wait_until(
            lambda: self.prop(name, prop) == value, timeout, f"{self.unit(name)} {prop}={value}"
        )

    def journal(self, name: str) -> str:
        out = self.m.run(["journalctl", f"_SYSTEMD_USER_UNIT={self.unit(name)}", "--no-pager"])
        return out.stdout

    def client(self, name: str) -> PodClient:
        return PodClient.connect(name, timeout=30)


@pytest.fixture
def sd(env: Env) -> Iterator[Sd]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    home = env.home / "h"
    home.mkdir()
    try:
        manager = UserManager.start(home)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot run a systemd user manager here: {exc}")
    s = Sd(env, manager)
    s.write_env(FAKE_API_KEY="test-key")
    try:
        yield s
    finally:
        manager.stop()


def units_dir(sd: Sd) -> Path:
    return sd.m.home / ".config" / "systemd" / "user"


def history(name: str) -> list[dict[str, Any]]:
    with PodClient.connect(name, timeout=30) as c:
        return list(c.history().entries)


def requests_text(sd: Sd, start: int) -> str:
    return "\n".join(str(r["body"]) for r in sd.env.model.requests[start:])


# --- tests ------------------------------------------------------------------------------------


def test_install_now_is_active_only_once_ready_and_serves(sd: Sd) -> None:
    path = sd.env.manifest("unitpod")
    sd.env_file.unlink()
    missing = sd.podctl("unit", "install", str(path), "--now")
    assert missing.returncode == 1
    assert "FAKE_API_KEY" in missing.stderr and "set-environment" in missing.stderr
    assert not (units_dir(sd) / "poddaemon-unitpod.service").exists()

    sd.write_env(FAKE_API_KEY="test-key")
    sd.env_file.chmod(0o644)  # as `echo KEY=... >> env` makes it: others could read the key
    readable = sd.podctl("unit", "install", str(path), "--now")
    assert readable.returncode == 1
    assert f"run chmod 600 {sd.env_file}" in readable.stderr
    assert not (units_dir(sd) / "poddaemon-unitpod.service").exists()

    sd.env_file.chmod(0o600)
    out = sd.podctl("unit", "install", str(path), "--now")
    assert out.returncode == 0, out.stderr
    # Type=notify: `enable --now` returned only after READY=1, so the socket answers at once.
    with sd.client("unitpod") as c:
        status = c.status()
    assert status.pid == sd.main_pid("unitpod")
    assert sd.prop("unitpod", "ActiveState") == "active"
    assert sd.prop("unitpod", "StatusText") == "idle"
    assert sd.prop("unitpod", "NRestarts") == "0"
    unit_text = (units_dir(sd) / "poddaemon-unitpod.service").read_text()
    assert f"ExecStart={Path(sys.executable).parent / 'poddaemon'} run {path} --resume" in unit_text
    assert sd.m.systemctl("is-enabled", sd.unit("unitpod")).stdout.strip() == "enabled"

    sent = sd.podctl("send", "unitpod", "hello through systemd")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.strip() == "ok: hello through systemd"
    listed = sd.podctl("ls")
    assert "unitpod" in listed.stdout

    # Watched from outside: `activating` until READY, and once `active` the socket answers.
    assert sd.m.systemctl("restart", "--no-block", sd.unit("unitpod")).returncode == 0
    states = [sd.prop("unitpod", "ActiveState")]
    deadline = time.monotonic() + 20
    while states[-1] != "active":
        assert time.monotonic() < deadline, states
        states.append(sd.prop("unitpod", "ActiveState"))
    assert "activating" in states
    with sd.client("unitpod") as c:
        assert c.status().pid == sd.main_pid("unitpod")


def test_a_unit_pods_commands_cannot_have_the_user_manager_run_a_command_outside(
    sd: Sd,
) -> None:
    """The manager's sockets are reached by path, which Landlock (below ABI 9) does not judge:
    `systemd-run --user` from the pod's confined bash ran its command as the user, unconfined
    (it wrote outside the scope, where the bash itself got "Read-only file system")."""
    outside = sd.env.home / "outside"
    outside.mkdir()
    escape = f"systemd-run --user --wait --collect sh -c 'echo pwn > {outside}/{{}}'"
    sd.env.model.script(
        {"tool_calls": [{"name": "bash", "arguments": {"command": escape.format("pod")}}]},
        {"text": "done"},
    )
    sd.install("jailed", tools=["bash"])
    with sd.client("jailed") as c:
        assert c.run_wait("escape").outcome == "finished"
        (result,) = [e["item"] for e in c.history().entries if e["kind"] == "tool_result"]
    assert "exit code" in result["output"], result["output"]
    assert not (outside / "pod").exists()
    control = sd.m.run(["sh", "-c", escape.format("control")])  # the manager runs it
    assert control.returncode == 0 and (outside / "control").exists(), control.stderr


def test_install_with_a_relative_home_writes_absolute_paths(sd: Sd) -> None:
    """`PODDAEMON_HOME=rel podctl unit install`: the unit said `EnvironmentFile=-rel/config/env`,
    which systemd ignores (not absolute), and a home relative to a cwd the pod does not have;
    the pod exited 78 without its key."""
    home = sd.env.home
    path = sd.env.manifest("relhome")
    env = {**sd.podenv, "PODDAEMON_HOME": home.name}
    install = [sys.executable, "-m", "cli.main", "unit", "install", str(path), "--now"]
    out = sd.m.run(["env", "-C", str(home.parent), *install], env)  # (nsenter starts in /)
    assert out.returncode == 0, out.stderr + sd.journal("relhome")
    text = (units_dir(sd) / "poddaemon-relhome.service").read_text()
    assert f"EnvironmentFile=-{home}/config/env\n" in text
    assert f"Environment=PODDAEMON_HOME={home}\n" in text
    with sd.client("relhome") as c:
        assert c.status().pid == sd.main_pid("relhome")


def test_install_with_a_home_of_spaces_and_dollars_reaches_its_env_file(sd: Sd) -> None:
    """A PODDAEMON_HOME (or ~) with a space or a `$` in it: the unit quoted EnvironmentFile=,
    which systemd then ignored ("path is not absolute"), and wrote `$$` into Environment=,
    where it stays `$$`. `unit install` found the key in the env file, the pod did not (78)."""
    home = sd.env.home / "my h$me 100%"
    (home / "config").mkdir(mode=0o700, parents=True)
    env_file = home / "config" / "env"
    env_file.write_text("FAKE_API_KEY=test-key\n")
    env_file.chmod(0o600)
    path = sd.env.manifest("oddhome")
    install = [sys.executable, "-m", "cli.main", "unit", "install", str(path), "--now"]
    out = sd.m.run(install, {**sd.podenv, "PODDAEMON_HOME": str(home)})
    assert out.returncode == 0, out.stderr + sd.journal("oddhome")
    env = sd.prop("oddhome", "Environment")
    assert "$$" not in env and "100%" in env, env
    listed = sd.m.run(
        [sys.executable, "-m", "cli.main", "ls"], {**sd.podenv, "PODDAEMON_HOME": str(home)}
    )
    assert "oddhome" in listed.stdout, listed.stdout + listed.stderr  # the same home as podctl's


def test_install_writes_where_the_manager_reads_not_the_shells_xdg_config_home(sd: Sd) -> None:
    """XDG_CONFIG_HOME set in a shell profile, which the user manager never reads: the unit
    went to $XDG_CONFIG_HOME/systemd/user, and `enable --now` said "Unit file ... does not
    exist", leaving it there; `unit remove` and `stop` looked there too."""
    path = sd.env.manifest("xdg")
    shell = {**sd.podenv, "XDG_CONFIG_HOME": str(sd.m.home / "elsewhere")}
    cli = [sys.executable, "-m", "cli.main"]
    out = sd.m.run([*cli, "unit", "install", str(path), "--now"], shell)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{units_dir(sd)}/poddaemon-xdg.service (enabled and started)\n"
    assert sd.prop("xdg", "ActiveState") == "active"
    assert not (sd.m.home / "elsewhere").exists()
    removed = sd.m.run([*cli, "unit", "remove", "xdg"], shell)
    assert removed.returncode == 0, removed.stderr
    assert not (units_dir(sd) / "poddaemon-xdg.service").exists()


def test_install_refuses_a_manifest_path_with_a_newline(sd: Sd) -> None:
    """A newline in the manifest's path (git allows one in a clone's file names) ended the
    unit's lines early and made the rest of the name directives of their own: the unit was
    written and enabled, and `--now` said only "bad unit file setting". (systemd 252 rejects
    the cut ExecStart= line, so the `ExecStart=` smuggled in here never ran; nothing in the
    unit file stopped it.)"""
    marker = sd.env.home / "pwned"
    path = Path(f"{sd.env.home}/p\nExecStart=\nExecStart=/usr/bin/touch {marker}\n#/m.toml")
    path.parent.mkdir(parents=True)
    path.write_text(sd.env.manifest("newline").read_text())
    out = sd.podctl("unit", "install", str(path), "--now")
    assert out.returncode == 1
    assert "contains a control character" in out.stderr, out.stderr
    assert not marker.exists()
    assert not (units_dir(sd) / "poddaemon-newline.service").exists()


def test_a_unit_pod_keeps_its_sessions_where_podctl_looks_with_a_shells_xdg_dirs(
    sd: Sd,
) -> None:
    """No PODDAEMON_HOME, and XDG_DATA_HOME / XDG_CONFIG_HOME set in a shell profile the user
    manager never reads: podctl checked `<its config>/defaults.toml` and looked for sessions
    under its data dir, while the unit pod read and wrote the manager's (~/.config,
    ~/.local/share): `podctl sessions` never showed what the unit pod wrote."""
    shell = {
        "PYTHONPATH": str(ROOT),
        "PODDAEMON_RUNTIME_DIR": str(sd.env.home / "run"),  # short socket paths, as elsewhere
        "XDG_DATA_HOME": str(sd.m.home / "xdata"),
        "XDG_CONFIG_HOME": str(sd.m.home / "xconf"),
    }
    config = sd.m.home / "xconf" / "poddaemon"
    config.mkdir(mode=0o700, parents=True)
    (config / "env").write_text("FAKE_API_KEY=test-key\n")
    (config / "env").chmod(0o600)
    cli = [sys.executable, "-m", "cli.main"]
    path = sd.env.manifest("xdgdirs")
    out = sd.m.run([*cli, "unit", "install", str(path), "--now"], shell)
    assert out.returncode == 0, out.stderr + sd.journal("xdgdirs")
    sent = sd.m.run([*cli, "send", "xdgdirs", "remember this"], shell)
    assert sent.returncode == 0, sent.stderr
    with sd.client("xdgdirs") as c:
        sid = c.status().session_id
    assert sid is not None
    listed = sd.m.run([*cli, "sessions", "list"], shell)
    assert sid in listed.stdout, listed.stdout + listed.stderr
    assert not (sd.m.home / ".local" / "share" / "poddaemon").exists()


def test_install_checks_the_compaction_providers_key_too(sd: Sd) -> None:
    """Only the main provider's key was checked: the unit was installed and enabled, then
    its pod refused to start without the compaction provider's key, with no word on how to
    set it."""
    extra = (
        "[compaction]\ncompact_threshold = 1500\n"
        '[compaction.provider]\nkind = "anthropic"\nmodel = "s"\napi_key_env = "SUMMARY_KEY"\n'
    )
    path = sd.env.manifest("summarized", extra=extra)
    refused = sd.podctl("unit", "install", str(path), "--now")
    assert refused.returncode == 1
    assert "SUMMARY_KEY" in refused.stderr and "set-environment" in refused.stderr
    assert not (units_dir(sd) / "poddaemon-summarized.service").exists()
    sd.write_env(FAKE_API_KEY="test-key", SUMMARY_KEY="other-key")
    installed = sd.podctl("unit", "install", str(path), "--now")
    assert installed.returncode == 0, installed.stderr
    assert sd.prop("summarized", "ActiveState") == "active"


def test_install_now_refuses_a_pod_running_outside_its_unit(sd: Sd) -> None:
    path = sd.env.manifest("twice")
    assert sd.podctl("spawn", str(path)).returncode == 1  # no key in podctl's own env
    spawned = sd.m.run(
        [sys.executable, "-m", "cli.main", "spawn", str(path)],
        {**sd.podenv, "FAKE_API_KEY": "test-key"},
    )
    assert spawned.returncode == 0, spawned.stderr
    try:
        out = sd.podctl("unit", "install", str(path), "--now")
        assert out.returncode == 1 and "already running" in out.stderr, out.stderr
    finally:
        assert sd.podctl("stop", "twice").returncode == 0


def test_a_pod_that_refuses_to_start_is_not_restarted_and_install_says_why(sd: Sd) -> None:
    """Its scope is held by another pod: starting it again changes nothing. The unit fails
    once (it was restarted every 2 s for ever) and `install --now` shows the pod's own error
    (it showed systemd's 'see systemctl status')."""
    holder = sd.env.start("holder", write=[str(sd.env.work)])
    path = sd.env.manifest("taker", write=[str(sd.env.work)])
    out = sd.podctl("unit", "install", str(path), "--now")
    assert out.returncode == 1
    assert "poddaemon-taker.service did not start: cannot start pod 'taker'" in out.stderr
    assert "holder" in out.stderr and "It stays installed, not enabled" in out.stderr
    assert f"`podctl unit install {path} --now` again" in out.stderr
    sd.wait_prop("taker", "ActiveState", "failed")
    assert sd.prop("taker", "NRestarts") == "0"
    # Not enabled: at each login it raced the pod holding the scope, and won some (QA).
    assert sd.m.systemctl("is-enabled", sd.unit("taker")).stdout.strip() == "disabled"
    assert holder.call("status")["state"] == "idle"

    # Why it refused is an error to the journal too (it was logged at info priority). journald
    # stores a unit's stderr stream as it reads it: the line may land after the unit failed.
    def errors() -> str:
        query = ["journalctl", f"_SYSTEMD_USER_UNIT={sd.unit('taker')}", "-p", "err", "-o", "cat"]
        return str(sd.m.run(query).stdout)

    wait_until(lambda: "poddaemon: cannot start pod 'taker'" in errors(), 10, "the error line")


def unreadable_journal(sd: Sd) -> Path:
    """A directory whose `journalctl` answers as the real one does to a user outside group
    systemd-journal where the journal is volatile (one file, root's): put it first in PATH."""
    shim = sd.env.home / "shim"
    shim.mkdir()
    journalctl = shim / "journalctl"
    journalctl.write_text(
        "#!/bin/sh\necho 'No journal files were opened due to insufficient permissions.' >&2\n"
        "exit 1\n"
    )
    journalctl.chmod(0o755)
    return shim


def test_a_refused_start_says_why_where_the_journal_cannot_be_read(sd: Sd) -> None:
    """A user outside `systemd-journal` where the journal is volatile (one file, root's) reads
    none of it: `install --now` said only systemd's "see journalctl --user -xeu", which shows
    nothing either, and `systemctl --user status` had no line on why. The pod puts why it
    refused in its unit's status (STATUS=), and podctl reads it there."""
    shim = unreadable_journal(sd)
    holder = sd.env.start("holder", write=[str(sd.env.work)])
    path = sd.env.manifest("taker", write=[str(sd.env.work)])
    out = sd.m.run(
        [sys.executable, "-m", "cli.main", "unit", "install", str(path), "--now"],
        {**sd.podenv, "PATH": f"{shim}:{sd.m.env['PATH']}"},
    )
    assert out.returncode == 1
    assert "poddaemon-taker.service did not start: cannot start pod 'taker'" in out.stderr, (
        out.stderr
    )
    assert "journalctl --user -xeu" not in out.stderr
    status = sd.prop("taker", "StatusText")
    assert status.startswith("refused: cannot start pod 'taker'") and "holder" in status, status
    assert sd.prop("taker", "NRestarts") == "0"
    assert holder.call("status")["state"] == "idle"


def test_a_restart_the_pod_refuses_says_why_and_a_good_one_prints_name_and_socket(
    sd: Sd,
) -> None:
    """The manifest was edited into one the pod refuses: `podctl restart` said only systemd's
    "see systemctl status" (the cause was in `podctl logs`), and a restart that worked printed
    "restarted NAME (unit …)" where any other restart prints `spawn`'s NAME<TAB>SOCKET.
    A manifest that no longer loads is refused before the unit stops the pod (QA: a typo took
    a healthy unattended pod down for good, as a refused start is not retried)."""
    path = sd.install("edited")
    good = path.read_text()
    restarted = sd.podctl("restart", "edited")
    assert restarted.returncode == 0, restarted.stderr
    name, sock = restarted.stdout.rstrip("\n").split("\t")
    assert name == "edited" and sock.endswith("/pods/edited/sock")
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    pid = sd.main_pid("edited")
    path.write_text(good + "bogus = 1\n")
    kept = sd.podctl("restart", "edited")
    assert kept.returncode == 1
    assert "cannot restart pod 'edited' (it is left running): " in kept.stderr, kept.stderr
    assert "bogus: unknown key" in kept.stderr, kept.stderr
    assert sd.prop("edited", "ActiveState") == "active" and sd.main_pid("edited") == pid
    # One only the pod's start finds (its scope no longer holds its pwd): the unit fails, and
    # everything says why.
    elsewhere = sd.env.work.with_name("elsewhere")
    elsewhere.mkdir()
    path.write_text(good.replace(f'target = "{sd.env.work}"', f'target = "{elsewhere}"'))
    assert f'target = "{elsewhere}"' in path.read_text()
    refused = sd.podctl("restart", "edited")
    assert refused.returncode == 1
    assert "poddaemon-edited.service did not start: " in refused.stderr
    gone = f"pod.pwd: {sd.env.work} is not readable under the pod's scope"
    assert gone in refused.stderr, refused.stderr
    assert "Fix that, then `podctl restart edited`." in refused.stderr
    assert "systemctl --user status" not in refused.stderr
    # What talks to it meanwhile says why too: "not running" alone sent the user to systemctl.
    sd.wait_prop("edited", "ActiveState", "failed")
    for args in (["status", "edited"], ["send", "edited", "hi"], ["wait", "edited"]):
        said = sd.podctl(*args)
        assert said.returncode == 3, (args, said.stderr)
        assert "its unit poddaemon-edited.service failed: refused: " in said.stderr, said.stderr
        assert gone in said.stderr, said.stderr
    path.write_text(good + "bogus = 1\n")  # stopped: said without "left running"
    refused = sd.podctl("restart", "edited")
    assert "cannot restart pod 'edited': " in refused.stderr, refused.stderr
    path.write_text(good)
    again = sd.podctl("restart", "edited")
    assert again.returncode == 0, again.stderr
    assert sd.prop("edited", "ActiveState") == "active"


def test_install_of_another_manifest_naming_the_same_pod_says_it_replaced_the_unit(
    sd: Sd,
) -> None:
    """Two manifests that name the same pod share one unit: installing the second replaced
    the first one's unit without a word. Reinstalling the same manifest says nothing more."""
    sd.write_env(FAKE_API_KEY="test-key")
    first = sd.env.manifest("twin")
    second = first.with_name("twin-copy.toml")
    second.write_text(first.read_text())
    assert sd.podctl("unit", "install", str(first)).returncode == 0
    again = sd.podctl("unit", "install", str(first))
    assert again.returncode == 0 and "replaced" not in again.stderr, again.stderr
    out = sd.podctl("unit", "install", str(second))
    assert out.returncode == 0, out.stderr
    assert out.stderr == f"podctl: warning: replaced the unit of pod 'twin', which ran {first}\n"
    unit = (units_dir(sd) / "poddaemon-twin.service").read_text()
    assert f" run {second} --resume" in unit


def test_install_now_of_a_running_unit_says_it_was_not_restarted(sd: Sd) -> None:
    """`enable --now` starts nothing for a unit that runs: the pod keeps its old unit (here its
    watchdog) and manifest. install --now said "(enabled and started)" all the same."""
    path = sd.install("again")
    pid = sd.main_pid("again")
    assert sd.prop("again", "WatchdogUSec") == "30s"
    out = sd.podctl("unit", "install", str(path), "--now", "--watchdog", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        f"{units_dir(sd) / 'poddaemon-again.service'} (enabled; it was already running and keeps "
        "its old unit and manifest until it restarts: podctl restart again)\n"
    )
    assert sd.main_pid("again") == pid and sd.prop("again", "WatchdogUSec") == "30s"
    restarted = sd.podctl("restart", "again")
    assert restarted.returncode == 0, restarted.stderr
    assert sd.main_pid("again") != pid and sd.prop("again", "WatchdogUSec") == "0"
    plain = sd.podctl("unit", "install", str(path))  # without --now: not "start it"
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.endswith(
        "\nit runs with its old unit and manifest until it restarts: podctl restart again\n"
    )
    sd.podctl("stop", "again")
    again = sd.podctl("unit", "install", str(path), "--now")  # stopped: started, and says so
    assert again.stdout.endswith(" (enabled and started)\n"), again.stdout + again.stderr
    assert sd.prop("again", "ActiveState") == "active"


def test_a_start_that_waits_for_an_mcp_server_outlasts_timeout_start_sec(sd: Sd) -> None:
    """READY waits for MCP servers (start_timeout, 30 s by default), which may be longer than
    TimeoutStartSec (90 s by default; 2 s here): the pod extends it, or systemd kills it."""
    import json

    from tests.integration.test_mcp import SERVER, server_toml

    mute = [sys.executable, "-c", "import time; time.sleep(600)"]  # never answers initialize
    extra = server_toml("mute", start_timeout=3).replace(
        json.dumps([sys.executable, SERVER]), json.dumps(mute)
    )
    path = sd.env.manifest("patient", extra=extra)
    assert sd.podctl("unit", "install", str(path)).returncode == 0
    dropin = units_dir(sd) / "poddaemon-patient.service.d"
    dropin.mkdir()
    (dropin / "short.conf").write_text("[Service]\nTimeoutStartSec=2\n")
    assert sd.m.systemctl("daemon-reload").returncode == 0
    out = sd.m.systemctl("start", "poddaemon-patient.service")
    assert out.returncode == 0, out.stderr + sd.journal("patient")
    assert (sd.prop("patient", "ActiveState"), sd.prop("patient", "NRestarts")) == ("active", "0")
    assert "MCP server 'mute' failed to start: did not start within 3 s" in sd.journal("patient")


def test_kill9_restarts_and_resumes_every_acknowledged_input(sd: Sd) -> None:
    sd.env.model.script({"text": "never delivered", "gate": "hold"})
    sd.install("crashy")
    with sd.client("crashy") as c:
        first = c.run("first input")
        sd.env.model.wait_for_requests(1)
        second = c.run("second input")
        note = c.notify("a notification arrived")
        status = c.status()
    assert second.state == "queued" and status.state == "running"
    sd.wait_prop("crashy", "StatusText", f"running run {first.run_id}")
    pid = sd.main_pid("crashy")
    before = len(sd.env.model.requests)
    os.kill(pid, 9)
    sd.env.model.open_gate("hold")  # let the fake server's stuck handler go
    sd.wait_prop("crashy", "NRestarts", "1")
    sd.wait_prop("crashy", "ActiveState", "active")
    assert sd.main_pid("crashy") != pid
    waited = sd.podctl("wait", "crashy", "--timeout", "30")
    assert waited.returncode == 0, waited.stderr
    with sd.client("crashy") as c:
        assert c.status().session_id == status.session_id  # the same session, resumed
    entries = history("crashy")
    ends = {e["run_id"]: e for e in entries if e["kind"] == "run_end"}
    assert first.run_id in ends and second.run_id in ends
    assert ends[second.run_id]["outcome"] == "finished"
    after = requests_text(sd, before)
    for text in ("first input", "second input", "a notification arrived"):
        assert text in after, f"{text!r} never reached the model after the restart"
    assert note.notification_id


def _made_ahead(sd: Sd, name: str, other_than: str = "") -> str | None:
    """The session `name`'s pod named in the registry and made the file of, still empty, ahead
    of its first input (a session other than `other_than`: an earlier life's)."""
    from poddaemon.registry import Registry

    entry = Registry(sd.env.home / "run").get(name)
    sid = entry.session if entry is not None else None
    path = sd.env.home / "data" / "sessions" / f"{sid}.jsonl"
    if sid is None or sid == other_than or not path.is_file() or path.stat().st_size:
        return None
    return sid


def test_a_crash_loop_before_any_input_leaves_no_pile_of_empty_session_files(sd: Sd) -> None:
    """Killed (-9) before any input, over and over, and restarted by Restart=on-failure with
    --resume: each life made its first session's file ahead, empty, and left it behind, one
    more per restart. Each start now reclaims the last life's entry and removes its file."""
    sd.install("loopy")
    sessions = sd.env.home / "data" / "sessions"
    held: str = wait_until(lambda: _made_ahead(sd, "loopy"), what="the file made ahead")
    for restarts in range(1, 4):
        os.kill(sd.main_pid("loopy"), 9)
        sd.wait_prop("loopy", "NRestarts", str(restarts))
        sd.wait_prop("loopy", "ActiveState", "active")
        held = wait_until(lambda e=held: _made_ahead(sd, "loopy", e), what="the next one")
        assert {p.stem: p.stat().st_size for p in sessions.glob("*.jsonl")} == {held: 0}
    listed = sd.podctl("sessions", "list")
    assert (listed.returncode, listed.stdout) == (0, "")


def test_wedged_loop_is_killed_by_the_watchdog_and_resumed(sd: Sd) -> None:
    wedge = sd.env.home / "wedge"
    sd.write_env(FAKE_API_KEY="test-key", PODDAEMON_TEST_WEDGE_FILE=str(wedge))
    sd.install("wedgy", "--watchdog", str(WATCHDOG))
    assert sd.prop("wedgy", "WatchdogUSec") == f"{WATCHDOG}s"
    with sd.client("wedgy") as c:
        c.run_wait("before the wedge")
        sid = c.status().session_id
    pid = sd.main_pid("wedgy")
    wedge.touch()
    # The pod stops answering: the loop that would ping the watchdog is blocked.
    wait_until(lambda: not wedge.exists(), 10, "the pod to take the wedge")
    with pytest.raises((TimeoutError, OSError)), PodClient.connect("wedgy", timeout=0.5) as c:
        c.status()
    sd.wait_prop("wedgy", "NRestarts", "1", timeout=WATCHDOG * 5)
    sd.wait_prop("wedgy", "ActiveState", "active")
    assert sd.main_pid("wedgy") != pid
    assert "Watchdog timeout" in sd.m.run(["journalctl", "--no-pager"]).stdout
    # Where it hung: the pod's threads at the watchdog's SIGABRT, the loop's in the wedge.
    said = sd.journal("wedgy")
    assert "Fatal Python error: Aborted" in said and " in _wedge" in said, said
    with sd.client("wedgy") as c:
        assert c.status().session_id == sid
    assert any(e.get("text") == "before the wedge" for e in history("wedgy"))


def test_podctl_stop_stops_the_unit_and_logs_show_the_journal(sd: Sd) -> None:
    sd.install("stopme")
    assert sd.podctl("send", "stopme", "say something").returncode == 0
    logs = sd.podctl("logs", "stopme")
    assert logs.returncode == 0, logs.stderr
    ready = [line for line in logs.stdout.splitlines() if "PODDAEMON-READY" in line]
    assert ready, logs.stdout
    assert ready[0][:4].isdigit() and "T" in ready[0][:11]  # short-iso timestamps
    stopped = sd.podctl("stop", "stopme")
    assert stopped.returncode == 0, stopped.stderr
    assert "unit poddaemon-stopme.service" in stopped.stdout
    assert sd.prop("stopme", "ActiveState") == "inactive"
    assert sd.prop("stopme", "SubState") == "dead"  # not auto-restart: nothing will start it
    assert sd.prop("stopme", "Result") == "success"
    assert sd.m.systemctl("list-jobs").stdout.strip().startswith("No jobs")
    # Not running any more, but its unit is installed: logs still come from the journal.
    after = sd.podctl("logs", "stopme").stdout
    assert "PODDAEMON-READY" in after and "Stopped" in after, after
    assert sd.podctl("logs", "stopme", "--since", "10m").stdout == after
    assert "PODDAEMON-READY" not in sd.podctl("logs", "stopme", "--since", "2999-01-01").stdout
    # `podctl restart` of a unit pod goes through systemd too; then remove leaves nothing.
    again = sd.podctl("restart", "stopme")
    assert again.returncode == 0, again.stderr
    assert sd.prop("stopme", "ActiveState") == "active"
    removed = sd.podctl("unit", "remove", "stopme")
    assert removed.returncode == 0, removed.stderr
    assert sd.prop("stopme", "ActiveState") == "inactive"
    leftovers = [str(p) for p in units_dir(sd).rglob("*") if "poddaemon" in p.name]
    assert leftovers == []
    assert sd.podctl("status", "stopme").returncode == 3


def podctl_without_user_bus(sd: Sd, *args: str) -> subprocess.CompletedProcess[str]:
    """podctl as cron, `su` or ssh with no session run it: no XDG_RUNTIME_DIR, so
    `systemctl --user` cannot reach the manager."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")
    }
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env={**env, **sd.podenv},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_podctl_stop_from_a_shell_with_no_user_bus_still_stops_the_unit(sd: Sd) -> None:
    """cron, `su`, ssh with no session: no XDG_RUNTIME_DIR, so `systemctl --user` cannot reach
    the manager. `podctl stop` failed ("Failed to connect to bus") and left the pod running;
    the pod answers, and its exit 0 after `shutdown` is one systemd does not restart."""
    sd.install("nobus")
    stopped = podctl_without_user_bus(sd, "stop", "nobus")
    assert stopped.returncode == 0, stopped.stderr
    assert "no systemd user manager answers" in stopped.stderr
    sd.wait_prop("nobus", "ActiveState", "inactive")
    assert sd.prop("nobus", "SubState") == "dead"  # not auto-restart: nothing will start it
    assert sd.prop("nobus", "Result") == "success"
    assert sd.prop("nobus", "NRestarts") == "0"


def test_podctl_restart_from_a_shell_with_no_user_bus_says_why_it_cannot(sd: Sd) -> None:
    """It printed systemd's "Failed to connect to bus: No medium found" alone."""
    sd.install("nobus2")
    restarted = podctl_without_user_bus(sd, "restart", "nobus2")
    assert restarted.returncode == 1, restarted.stderr
    assert restarted.stderr.startswith("podctl: cannot restart poddaemon-nobus2.service: no ")
    assert "enable-linger" in restarted.stderr and restarted.stderr.count("\n") == 1
    assert sd.prop("nobus2", "NRestarts") == "0"
    assert sd.prop("nobus2", "ActiveState") == "active"  # left as it was


def test_input_sent_while_systemd_restarts_a_crashed_pod_waits_for_it(sd: Sd) -> None:
    """Between a crash and its restart (RestartSec=, then start-up until READY) the socket of
    a unit pod does not listen: `podctl notify` and `send` said "not running" (exit 3) for
    those seconds, to a timer unit or a CI hook as well, where `wait` and `stop` see the same
    pod being restarted. Nothing was sent then, so waiting for the pod delivers it once."""
    import json

    sd.install("bouncing")
    os.kill(sd.main_pid("bouncing"), 9)
    sd.wait_prop("bouncing", "SubState", "auto-restart")
    noted = sd.podctl("notify", "bouncing", "noted during the restart")
    assert noted.returncode == 0, noted.stderr
    assert "being restarted by poddaemon-bouncing.service" in noted.stderr
    os.kill(sd.main_pid("bouncing"), 9)
    sd.wait_prop("bouncing", "SubState", "auto-restart")
    sent = sd.podctl("send", "bouncing", "sent during the restart")
    assert sent.returncode == 0, sent.stderr
    # The model echoes the last user-role text: the input, or, when the second crash cut short
    # the run the notification woke, the restarted pod's notice of it, delivered after it.
    said = ("sent during the restart", "The pod restarted while your previous run")
    assert sent.stdout.startswith("ok: ") and any(x in sent.stdout for x in said), sent.stdout
    os.kill(sd.main_pid("bouncing"), 9)
    sd.wait_prop("bouncing", "SubState", "auto-restart")
    queued = sd.podctl("send", "--no-wait", "bouncing", "submitted during the restart")
    assert queued.returncode == 0, queued.stderr  # (one call, not send's connection)
    assert "being restarted by poddaemon-bouncing.service" in queued.stderr
    logged = json.dumps(history("bouncing"))
    assert logged.count("noted during the restart") >= 1
    assert logged.count("sent during the restart") >= 1
    assert logged.count("submitted during the restart") >= 1
    sd.podctl("stop", "bouncing")
    refused = sd.podctl("notify", "bouncing", "to a stopped unit")  # inactive: not waited for
    assert refused.returncode == 3, refused.stderr


def test_podctl_stop_between_a_crash_and_its_restart_stops_the_unit(sd: Sd) -> None:
    """kill -9, then `podctl stop` while systemd waits RestartSec to start it again: stop said
    "not running" (exit 3) and the pod came back 2 s later; a crash-looping pod could not be
    stopped with podctl."""
    sd.install("crashing")
    os.kill(sd.main_pid("crashing"), 9)
    sd.wait_prop("crashing", "SubState", "auto-restart")
    stopped = sd.podctl("stop", "crashing")
    assert stopped.returncode == 0, stopped.stderr
    assert "unit poddaemon-crashing.service" in stopped.stdout
    assert sd.prop("crashing", "SubState") == "dead"  # not auto-restart: nothing will start it
    assert sd.prop("crashing", "NRestarts") == "0"
    assert sd.m.systemctl("list-jobs").stdout.strip().startswith("No jobs")


def test_restart_after_renaming_the_pod_in_its_manifest_prints_the_new_pod(sd: Sd) -> None:
    """README: after editing the manifest, `podctl restart` applies it. With a new `[pod]
    name` the unit came back as that pod, but restart printed the old name and a socket where
    nothing listens."""
    path = sd.install("oldname")
    path.write_text(path.read_text().replace('name = "oldname"', 'name = "newname"'))
    out = sd.podctl("restart", "oldname")
    assert out.returncode == 0, out.stderr
    with sd.client("newname") as c:
        status = c.status()
    assert status.pid == sd.main_pid("oldname")
    assert out.stdout == f"newname\t{sd.env.home}/run/pods/newname/sock\n", out.stdout


def test_restart_of_a_unit_systemd_gave_up_on_says_so_and_how(sd: Sd) -> None:
    """Started too often, systemd stops trying (start-limit-hit): `podctl restart` passed on
    systemd's "a fatal signal was delivered to the control process", which says neither."""
    sd.install("flaky")
    drop_in = units_dir(sd) / "poddaemon-flaky.service.d"
    drop_in.mkdir()
    (drop_in / "limit.conf").write_text("[Unit]\nStartLimitBurst=1\n[Service]\nRestartSec=0.1\n")
    sd.m.systemctl("daemon-reload")
    os.kill(sd.main_pid("flaky"), 9)  # restarted: the one start the limit allows now
    sd.wait_prop("flaky", "NRestarts", "1")
    sd.wait_prop("flaky", "ActiveState", "active")
    os.kill(sd.main_pid("flaky"), 9)  # one start too many
    sd.wait_prop("flaky", "ActiveState", "failed")
    out = sd.podctl("restart", "flaky")
    assert out.returncode == 1
    assert out.stderr == (
        "podctl: poddaemon-flaky.service was started too often (StartLimitBurst= starts within "
        "StartLimitIntervalSec=) and systemd gave up on it: run `systemctl --user reset-failed "
        "poddaemon-flaky.service`, then start it again\n"
    )
    assert sd.m.systemctl("reset-failed", sd.unit("flaky")).returncode == 0
    again = sd.podctl("restart", "flaky")
    assert again.returncode == 0, again.stderr


def test_restarts_the_user_asks_for_do_not_use_up_the_start_limit(sd: Sd) -> None:
    """StartLimitBurst= is there for a pod that keeps failing, but systemd counts every start:
    after a few `podctl restart`s of a healthy pod within a minute (applying manifest edits),
    the next one stopped it and left it down, failed (start-limit-hit), "started too often"."""
    sd.install("edited")
    drop_in = units_dir(sd) / "poddaemon-edited.service.d"
    drop_in.mkdir()
    (drop_in / "limit.conf").write_text("[Unit]\nStartLimitBurst=2\n")  # 5 by default
    sd.m.systemctl("daemon-reload")
    for _ in range(4):
        out = sd.podctl("restart", "edited")
        assert out.returncode == 0, out.stderr
        assert sd.prop("edited", "ActiveState") == "active"
    sd.podctl("stop", "edited")  # stopped by the user, then restarted: as many times
    for _ in range(3):
        out = sd.podctl("restart", "edited")
        assert out.returncode == 0, out.stderr
    assert sd.prop("edited", "NRestarts") == "0"  # none of them systemd's own


def test_podctl_stop_of_a_wedged_unit_pod_goes_through_systemd(sd: Sd) -> None:
    """A unit pod that does not answer: `podctl stop` sent its pid SIGTERM, which a wedged loop
    never handles, gave up after 10 s (exit 1), and the watchdog then had systemd restart it.
    Stopping the unit makes systemd kill it (TimeoutStopSec, here 2 s) and keep it down."""
    wedge = sd.env.home / "wedge"
    sd.write_env(FAKE_API_KEY="test-key", PODDAEMON_TEST_WEDGE_FILE=str(wedge))
    sd.install("stuck", "--watchdog", "0")
    drop_in = units_dir(sd) / "poddaemon-stuck.service.d"
    drop_in.mkdir()
    (drop_in / "quick-stop.conf").write_text("[Service]\nTimeoutStopSec=2\n")
    sd.m.systemctl("daemon-reload")
    wedge.touch()
    wait_until(lambda: not wedge.exists(), 10, "the pod to take the wedge")
    stopped = sd.podctl("stop", "stuck")
    assert stopped.returncode == 0, stopped.stderr
    assert "unit poddaemon-stuck.service" in stopped.stdout
    assert sd.prop("stuck", "ActiveState") in ("inactive", "failed")
    assert sd.prop("stuck", "Result") == "timeout"  # killed by systemd, not restarted
    assert sd.prop("stuck", "NRestarts") == "0"
    assert sd.m.systemctl("list-jobs").stdout.strip().startswith("No jobs")


SPAWN_TOOLS = ["read_file", "spawn_pod", "send_to_pod", "wait_pods", "list_pods", "stop_pod"]


def spawn_child(sd: Sd, name: str, child: str) -> None:
    """Have the unit pod `name` spawn `child` on a directory of its own."""
    (sd.env.work / child).mkdir()
    call = {
        "name": "spawn_pod",
        "arguments": {
            "name": child,
            "task": "wait here",
            "scope": [{"target": str(sd.env.work / child), "permission": "write"}],
        },
    }
    sd.env.model.script({"tool_calls": [call]}, {"text": "spawned"})
    sent = sd.podctl("send", name, "spawn a child")
    assert sent.returncode == 0, sent.stderr
    with sd.client(name) as c:
        assert [k.name for k in c.status().children] == [child]


def test_stop_tree_of_a_unit_pod_stops_its_children_first(sd: Sd) -> None:
    """`podctl stop --tree` of a unit pod stopped only the unit: systemd then SIGKILLed the
    children it left in the unit's cgroup (on_parent_exit = "detach" leaves them running)."""
    sd.install("boss", tools=SPAWN_TOOLS, extra='[spawn]\non_parent_exit = "detach"\n')
    spawn_child(sd, "boss", "kid")
    stopped = sd.podctl("stop", "--tree", "boss")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "stopped kid\nstopped boss (unit poddaemon-boss.service)\n"
    assert "Killing process" not in sd.m.run(["journalctl", "--no-pager"]).stdout
    assert sd.podctl("status", "kid").returncode == 3


def test_detached_children_of_a_unit_pod_outlive_its_restart_and_stop(sd: Sd) -> None:
    """SPEC §9, on_parent_exit = "detach": children run on and a restored spawner adopts them
    again. Under a unit they were SIGKILLed by every restart or stop of the unit (they were
    in its cgroup); they now get a transient scope of their own."""
    sd.install("boss", tools=SPAWN_TOOLS, extra='[spawn]\non_parent_exit = "detach"\n')
    spawn_child(sd, "boss", "kid")
    with sd.client("kid") as c:
        kid = c.status().pid
    restarted = sd.podctl("restart", "boss")
    assert restarted.returncode == 0, restarted.stderr
    with sd.client("kid") as c:
        assert c.status().pid == kid

    def adopted() -> bool:
        with sd.client("boss") as c:
            return [k.pid for k in c.status().children] == [kid]

    wait_until(adopted, 20, "the restarted spawner to adopt its child")
    assert sd.podctl("stop", "boss").returncode == 0
    with sd.client("kid") as c:
        assert c.status().pid == kid
    assert "Killing process" not in sd.m.run(["journalctl", "--no-pager"]).stdout
    assert sd.podctl("stop", "kid").returncode == 0


def test_log_write_failure_exits_non_zero_and_is_restarted(sd: Sd) -> None:
    data = sd.env.home / "data"
    data.mkdir(mode=0o700)
    mounted = sd.m.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(data)])
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    sd.install("fragile")
    with sd.client("fragile") as c:
        done = c.run_wait("before the disk filled up")
        sid = c.status().session_id
    filler = data / "filler"
    sd.m.run(["sh", "-c", f"cat /dev/zero > {filler}"])
    pid = sd.main_pid("fragile")
    with sd.client("fragile") as c, pytest.raises(RpcError) as err:
        c.run("x" * 64 * 1024)
    assert "could not persist" in err.value.message
    # It exits 1 (a failure), so Restart=on-failure schedules a restart; make room meanwhile.
    wait_until(lambda: sd.main_pid("fragile") != pid, 10, "the pod to exit")
    sd.m.run(["rm", "-f", str(filler)])
    sd.wait_prop("fragile", "NRestarts", "1")
    sd.wait_prop("fragile", "ActiveState", "active")
    assert (
        "status=1/FAILURE" in sd.journal("fragile")
        or "status=1/FAILURE" in sd.m.run(["journalctl", "--no-pager"]).stdout
    )
    # stderr is the journal: the pod's error line carries priority 3 (err), without the prefix.
    errors = sd.m.run(
        ["journalctl", f"_SYSTEMD_USER_UNIT={sd.unit('fragile')}", "-p", "err", "--no-pager"]
    ).stdout
    assert "exiting with status 1" in errors and "<3>" not in errors, errors
    assert "]: poddaemon[" not in errors, errors  # the journal names the process once
    with sd.client("fragile") as c:
        assert c.status().session_id == sid
    assert any(e["kind"] == "run_end" and e["run_id"] == done.run_id for e in history("fragile"))


# --- the same commands for pods that are not units (no manager needed) -----------------------


def test_restart_of_a_plain_pod_resumes_from_its_kept_config(env: Env) -> None:
    path = env.manifest("plain")
    started = env.podctl("spawn", str(path))
    assert started.returncode == 0, started.stderr
    with PodClient.connect("plain", timeout=30) as c:
        c.run_wait("remember me")
        st = c.status()
    path.unlink()  # the kept configuration is what restart uses
    assert (env.home / "data" / "pods" / "plain.toml").exists()
    again = env.podctl("restart", "plain")
    assert again.returncode == 0, again.stderr
    with PodClient.connect("plain", timeout=30) as c:
        now = c.status()
    assert now.session_id == st.session_id and now.pid != st.pid
    # The key only where units read it (QA: a unit pod's child, restarted from a shell).
    env_file = env.home / "config" / "env"
    env_file.parent.mkdir(parents=True, exist_ok=True)
    env_file.write_text(f"FAKE_API_KEY={env.env.pop('FAKE_API_KEY')}\n")
    env_file.chmod(0o600)
    refused = env.podctl("restart", "plain")
    assert refused.returncode == 1
    assert "FAKE_API_KEY is not set in this shell" in refused.stderr, refused.stderr
    assert f"it is set in {env_file}, which only units read: `set -a; . {env_file};" in (
        refused.stderr
    )
    env.env["FAKE_API_KEY"] = "test-key"
    # Its pwd gone: refused before the stop (QA: stopped, then refused to start, left down).
    moved = env.work.with_name("moved")
    env.work.rename(moved)
    refused = env.podctl("restart", "plain")
    assert refused.returncode == 1
    assert "cannot restart pod 'plain' (it is left running): " in refused.stderr
    assert f"pod.pwd: {env.work} does not exist" in refused.stderr, refused.stderr
    with PodClient.connect("plain", timeout=30) as c:
        assert c.status().pid == now.pid
    moved.rename(env.work)
    assert env.podctl("stop", "plain").returncode == 0
    assert env.podctl("restart", "nosuchpod").returncode == 3


def test_wait_and_logs_of_a_plain_pod(env: Env) -> None:
    env.model.script({"text": "slow", "gate": "g"})
    started = env.podctl("spawn", str(env.manifest("waiter")))
    assert started.returncode == 0, started.stderr
    with PodClient.connect("waiter", timeout=30) as c:
        c.run("take your time")
        timed_out = env.podctl("wait", "waiter", "--timeout", "0.3")
        assert timed_out.returncode == 4
        env.model.open_gate("g")
        waited = env.podctl("wait", "waiter", "--json", "--timeout", "20")
        assert waited.returncode == 0, waited.stderr
        assert '"idle": true' in waited.stdout
        follow = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "logs", "waiter", "-f"],
            env=env.env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert follow.stdout is not None
            assert "ready on" in follow.stdout.readline()
            c.call_raw("shutdown")
            assert "shut down" in follow.stdout.readline()  # written after -f started
        finally:
            follow.kill()
            follow.wait(10)
    wait_until(lambda: env.podctl("status", "waiter").returncode == 3, 10, "the pod to stop")
    log = env.podctl("logs", "waiter")
    assert log.returncode == 0, log.stderr
    lines = log.stdout.splitlines()
    assert lines and all(line[:2] == "20" and line[10] == " " for line in lines if line[:1] != " ")
    assert env.podctl("logs", "waiter", "--since", "1h").stdout == log.stdout
    assert env.podctl("logs", "waiter", "--since", "2999-01-01").stdout == ""
    assert env.podctl("wait", "waiter").returncode == 3


def example_install_snippet() -> str:
    """The shell block of examples/systemd/README.md, as printed there."""
    import re

    text = (ROOT / "examples" / "systemd" / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert block, "no sh block in examples/systemd/README.md"
    return block.group(1)


def test_example_timer_and_path_units_notify_the_pod(sd: Sd) -> None:
    """examples/systemd/README.md's install snippet, run as printed: its last line shows the
    path unit's notification arriving (it used to look before the unit had fired)."""
    sd.install("reviewer")
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "podctl").exists(), "podctl console script not installed"
    assert sd.m.systemctl("set-environment", f"PODDAEMON_HOME={sd.env.home}").returncode == 0
    script = "set -e\ncd " + str(ROOT / "examples" / "systemd") + "\n" + example_install_snippet()
    path = f"{bin_dir}:{sd.m.env['PATH']}"
    ran = sd.m.run(["bash", "-c", script], {**sd.podenv, "PATH": path}, timeout=50)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert sd.m.prop("reviewer-nightly.timer", "ActiveState") == "active"
    assert sd.m.prop("reviewer-nightly.timer", "NextElapseUSecRealtime") != ""
    assert "reviewer-nightly.timer" in ran.stdout  # list-timers
    last = ran.stdout.splitlines()[-1]
    assert last.startswith(f"✉ notification from inbox: Files changed in {sd.m.home}/inbox"), last

    def notified(source: str) -> bool:
        return any(e.get("source") == source for e in history("reviewer"))

    assert notified("inbox")
    # What the timer runs, run now (the README's "to try the timer now").
    fired = sd.m.systemctl("start", "reviewer-nightly.service")
    assert fired.returncode == 0, fired.stderr
    wait_until(lambda: notified("timer"), 20, "the timer's notification")
    units = {p.name for p in units_dir(sd).iterdir()}
    assert {p.name for p in (ROOT / "examples" / "systemd").glob("reviewer-*")} <= units


def install_template(sd: Sd, name: str) -> None:
    """systemd/poddaemon@.service installed as its comment says, and ~/.config/poddaemon/pods/
    NAME.toml for it to run (PODDAEMON_HOME and the key: in the manager's environment)."""
    manifest_dir = sd.m.home / ".config" / "poddaemon" / "pods"
    manifest_dir.mkdir(parents=True, exist_ok=True)
    (manifest_dir / f"{name}.toml").write_text(sd.env.manifest(name).read_text())
    poddaemon = str(Path(sys.executable).parent / "poddaemon")
    text = (ROOT / "systemd" / "poddaemon@.service").read_text()
    target = units_dir(sd)
    target.mkdir(parents=True, exist_ok=True)
    (target / "poddaemon@.service").write_text(text.replace("%h/.local/bin/poddaemon", poddaemon))
    home = f"PODDAEMON_HOME={sd.env.home}"
    assert sd.m.systemctl("set-environment", home, "FAKE_API_KEY=test-key").returncode == 0
    assert sd.m.systemctl("daemon-reload").returncode == 0


def test_a_pod_of_the_shipped_template_unit_is_restarted_and_stopped_through_systemd(
    sd: Sd,
) -> None:
    """systemd/poddaemon@.service, used as its comment says: `podctl restart` must restart the
    unit (not stop it and start the pod outside systemd), `stop` stops it, `logs` reads the
    journal."""
    install_template(sd, "tmpl")
    started = sd.m.systemctl("start", "poddaemon@tmpl.service")
    assert started.returncode == 0, started.stderr
    first = int(sd.m.prop("poddaemon@tmpl.service", "MainPID"))

    again = sd.podctl("restart", "tmpl")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("tmpl\t"), again.stdout  # as `spawn` prints it
    assert sd.m.prop("poddaemon@tmpl.service", "ActiveState") == "active"
    pid = int(sd.m.prop("poddaemon@tmpl.service", "MainPID"))
    assert pid != first
    with sd.client("tmpl") as c:
        assert c.status().pid == pid  # the pod is the unit's, not one started outside it
    assert "PODDAEMON-READY" in sd.podctl("logs", "tmpl").stdout
    stopped = sd.podctl("stop", "tmpl")
    assert stopped.returncode == 0 and "unit poddaemon@tmpl.service" in stopped.stdout
    assert sd.m.prop("poddaemon@tmpl.service", "ActiveState") == "inactive"


def test_a_stopped_template_pod_is_restarted_by_its_unit_and_logs_read_the_journal(
    sd: Sd,
) -> None:
    """`systemctl --user enable --now poddaemon@NAME` (the template's own instructions), then
    `podctl stop NAME`: `podctl restart NAME` starts the unit again, not the pod outside
    systemd from its kept configuration (then two supervisors, and the next boot's start of
    the enabled unit refused: name taken); `podctl logs NAME` reads the journal."""
    install_template(sd, "tmpl")
    started = sd.m.systemctl("enable", "--now", "poddaemon@tmpl.service")
    assert started.returncode == 0, started.stderr
    assert sd.podctl("stop", "tmpl").returncode == 0
    assert sd.m.prop("poddaemon@tmpl.service", "ActiveState") == "inactive"

    logs = sd.podctl("logs", "tmpl")
    assert logs.returncode == 0 and "PODDAEMON-READY" in logs.stdout, logs.stderr
    # With the key in podctl's environment too: it could start the pod itself, and must not.
    again = sd.m.run(
        [sys.executable, "-m", "cli.main", "restart", "tmpl"],
        {**sd.podenv, "FAKE_API_KEY": "test-key"},
    )
    assert again.returncode == 0, again.stderr
    assert sd.m.prop("poddaemon@tmpl.service", "ActiveState") == "active"
    with sd.client("tmpl") as c:
        assert c.status().pid == int(sd.m.prop("poddaemon@tmpl.service", "MainPID"))


def test_logs_of_a_unit_pod_say_how_to_read_a_journal_the_user_may_not(sd: Sd) -> None:
    """`podctl logs` handed over to journalctl, whose "No journal files were opened due to
    insufficient permissions" said neither what podctl was reading nor how to make it work."""
    sd.install("nolog")
    shim = unreadable_journal(sd)
    env = {**sd.podenv, "PATH": f"{shim}:{sd.m.env['PATH']}"}
    for follow in ([], ["-f"]):
        logs = sd.m.run([sys.executable, "-m", "cli.main", "logs", "nolog", *follow], env)
        assert logs.returncode == 1
        assert "cannot read the journal" in logs.stderr, logs.stderr
        assert "poddaemon-nolog.service" in logs.stderr and "insufficient permissions" in (
            logs.stderr
        )
        assert "systemd-journal" in logs.stderr and "/var/log/journal" in logs.stderr


def test_wait_outlasts_the_restart_of_a_unit_pod_that_crashed(sd: Sd) -> None:
    """Between a crash and systemd's restart (RestartSec=) the pod is its unit's, and what it
    acknowledged is processed after the restart: `podctl wait` said "not running" (exit 3) to
    a script that only wanted the queue done, and waits for the restarted pod now."""
    sd.install("crashy")
    sd.env.model.script({"text": "first", "gate": "crash"})
    assert sd.podctl("send", "crashy", "--no-wait", "work").returncode == 0
    sd.env.model.wait_for_requests(1)  # the gated reply is this run's, not the restarted pod's
    queued = sd.podctl("send", "crashy", "--no-wait", "acknowledged work")
    assert queued.returncode == 0 and "queued" in queued.stdout, queued.stdout
    first = sd.main_pid("crashy")
    os.kill(first, 9)
    sd.wait_prop("crashy", "ActiveState", "activating")  # auto-restart, RestartSec=2
    waited = sd.podctl("wait", "crashy", "--timeout", "30")
    assert waited.returncode == 0, waited.stderr
    assert "restart" in waited.stderr, waited.stderr  # it says what it waits for
    pid = sd.main_pid("crashy")
    assert pid != first
    with sd.client("crashy") as c:
        assert c.status().pid == pid
    assert "acknowledged work" in requests_text(sd, 0)


def test_logs_of_a_pod_whose_unit_was_removed_still_read_the_journal(sd: Sd) -> None:
    """`podctl unit remove` deletes the unit file, not the journal: `podctl logs` looked for a
    unit file, found none, and said "no log for pod" (exit 3) while the journal held every
    line the pod wrote."""
    path = sd.install("gone")
    assert sd.podctl("send", "gone", "say something").returncode == 0
    removed = sd.podctl("unit", "remove", "gone")
    assert removed.returncode == 0, removed.stderr
    assert not (units_dir(sd) / "poddaemon-gone.service").exists()
    logs = sd.podctl("logs", "gone")
    assert logs.returncode == 0, logs.stderr
    ready = [line for line in logs.stdout.splitlines() if "PODDAEMON-READY" in line]
    assert ready and ready[0][:4].isdigit(), logs.stdout + logs.stderr  # journal, timestamped
    assert "Stopped" in logs.stdout, logs.stdout  # the manager's lines on it too, to its end
    assert "poddaemon-gone.service, which was removed" in logs.stderr, logs.stderr
    assert sd.podctl("logs", "gone", "--since", "10m").stdout == logs.stdout
    assert "PODDAEMON-READY" not in sd.podctl("logs", "gone", "--since", "2999-01-01").stdout
    # A journal this user may not read: where the lines are, and why podctl cannot show them.
    shim = unreadable_journal(sd)
    unread = sd.m.run(
        [sys.executable, "-m", "cli.main", "logs", "gone"],
        {**sd.podenv, "PATH": f"{shim}:{sd.m.env['PATH']}"},
    )
    assert unread.returncode == 3, unread.stderr
    assert "journalctl --user-unit=poddaemon-gone.service" in unread.stderr, unread.stderr
    assert "insufficient permissions" in unread.stderr and unread.stderr.count("\n") == 1

    # Started since by podctl (not as a unit): its log file is newer, and is what logs shows.
    spawned = sd.m.run(
        [sys.executable, "-m", "cli.main", "spawn", str(path)],
        {**sd.podenv, "FAKE_API_KEY": "test-key"},
    )
    assert spawned.returncode == 0, spawned.stderr
    assert sd.podctl("stop", "gone").returncode == 0
    plain = sd.podctl("logs", "gone")
    assert plain.returncode == 0, plain.stderr
    assert "ready on" in plain.stdout and "PODDAEMON-READY" not in plain.stdout, plain.stdout
    assert "removed" not in plain.stderr, plain.stderr


def mute_mcp_manifest(sd: Sd, name: str, start_timeout: int = 30) -> Path:
    """A pod held in start-up (before READY) by an MCP server that never answers `initialize`,
    for `start_timeout` s (then it starts without it): long enough to be killed there."""
    import json

    from tests.integration.test_mcp import SERVER, server_toml

    mute = [sys.executable, "-c", "import time; time.sleep(600)"]
    extra = server_toml("mute", start_timeout=start_timeout).replace(
        json.dumps([sys.executable, SERVER]), json.dumps(mute)
    )
    return sd.env.manifest(name, extra=extra)


@pytest.mark.parametrize(
    ("sig", "what"),
    [
        (9, "was killed by signal 9 (SIGKILL) before it was ready"),
        # SIGTERM while starting: the pod stops, exit 0, and systemd's Result= is `protocol`.
        (15, "exited without telling systemd it was ready"),
    ],
)
def test_install_now_of_a_pod_killed_before_ready_says_what_happened_and_where_to_look(
    sd: Sd, sig: int, what: str
) -> None:
    """The pod is killed while it starts (before READY): `install --now` printed systemctl's
    raw "Job for … failed because a fatal signal was delivered to the control process. See
    "systemctl --user status …" and "journalctl --user -xeu …" for details." over three lines,
    where podctl says in one what became of the pod, what systemd does now and where to look."""
    path = mute_mcp_manifest(sd, "doomed")
    installing = subprocess.Popen(
        sd.m.command(
            [sys.executable, "-m", "cli.main", "unit", "install", str(path), "--now"], sd.podenv
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Killed once it says it is starting (its MCP server holds it there), not before.
        wait_until(lambda: "PODDAEMON-STARTING" in sd.journal("doomed"), 20, "the STARTING line")
        assert sd.prop("doomed", "ActiveState") == "activating"
        # A warning said at start (its `python -c` server loads code from the write scope) is
        # no reason it ended: it was once given as one.
        assert "poddaemon: warning: " in sd.journal("doomed")
        pid = sd.main_pid("doomed")
        os.kill(pid, sig)
        _, err = installing.communicate(timeout=30)
    finally:
        if installing.poll() is None:
            installing.kill()
            installing.communicate()
    assert installing.returncode == 1, err
    assert err == (
        f"podctl: poddaemon-doomed.service did not start: its pod (pid {pid}) {what}; systemd "
        f"starts it again in 2s (Restart=on-failure). Its lines: podctl logs doomed (or "
        f"systemctl --user status poddaemon-doomed.service)\n"
    ), err
    # As it says: systemd starts it again (a new pid), and its lines are where it says.
    wait_until(lambda: sd.main_pid("doomed") not in (0, pid), 20, "the unit's next start")
    logs = sd.podctl("logs", "doomed")
    assert logs.returncode == 0 and "PODDAEMON-STARTING" in logs.stdout, logs.stderr


def test_a_restart_killed_before_ready_says_what_happened_and_where_to_look(sd: Sd) -> None:
    """`podctl restart` of a unit pod goes through the same start: a pod killed before READY
    had it print systemctl's three raw lines too."""
    path = mute_mcp_manifest(sd, "redoomed", start_timeout=2)  # READY after 2 s without it
    assert sd.podctl("unit", "install", str(path), "--now").returncode == 0
    first = sd.main_pid("redoomed")

    def starting_lines() -> int:
        return sd.journal("redoomed").count("PODDAEMON-STARTING")

    assert starting_lines() == 1
    restarting = subprocess.Popen(
        sd.m.command([sys.executable, "-m", "cli.main", "restart", "redoomed"], sd.podenv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: starting_lines() == 2, 20, "the restarted pod's STARTING line")
        pid = sd.main_pid("redoomed")
        assert pid != first
        os.kill(pid, 9)
        out, err = restarting.communicate(timeout=30)
    finally:
        if restarting.poll() is None:
            restarting.kill()
            restarting.communicate()
    assert restarting.returncode == 1 and out == "", out + err
    assert err == (
        f"podctl: poddaemon-redoomed.service did not start: its pod (pid {pid}) was killed by "
        f"signal 9 (SIGKILL) before it was ready; systemd starts it again in 2s "
        f"(Restart=on-failure). Its lines: podctl logs redoomed (or systemctl --user status "
        f"poddaemon-redoomed.service)\n"
    ), err


def test_logs_of_a_pod_run_plain_since_its_unit_stopped_read_its_log_file(sd: Sd) -> None:
    """Its unit installed but stopped, the pod was started by `podctl spawn` (to try a change,
    say) and stopped or crashed: `podctl logs` showed the unit's journal, lines of the run
    before, and none of that run's, which are in its log file."""
    # Installed, never started by its unit (no line in the journal), run plain: its file.
    fresh = sd.env.manifest("fresh")
    assert sd.podctl("unit", "install", str(fresh)).returncode == 0
    assert sd.env.podctl("spawn", str(fresh)).returncode == 0
    assert sd.podctl("stop", "fresh").returncode == 0
    logs = sd.podctl("logs", "fresh")
    assert logs.returncode == 0 and "INFO ready on" in logs.stdout, logs.stdout + logs.stderr
    path = sd.install("both")
    assert sd.podctl("stop", "both").returncode == 0
    spawned = sd.m.run(
        [sys.executable, "-m", "cli.main", "spawn", str(path)],
        {**sd.podenv, "FAKE_API_KEY": "test-key"},
    )
    assert spawned.returncode == 0, spawned.stderr
    with sd.client("both") as c:
        plain_pid = c.status().pid
    assert sd.podctl("stop", "both").returncode == 0
    logs = sd.podctl("logs", "both")
    assert logs.returncode == 0, logs.stderr
    assert f"poddaemon[{plain_pid}] INFO ready on" in logs.stdout, logs.stdout
    assert "systemd[" not in logs.stdout, logs.stdout  # none of the unit's journal
    # Started by its unit again, its lines are the journal's once more, stopped or not.
    assert sd.m.systemctl("start", sd.unit("both")).returncode == 0
    unit_pid = sd.main_pid("both")
    assert sd.podctl("stop", "both").returncode == 0
    again = sd.podctl("logs", "both")
    assert again.returncode == 0, again.stderr
    assert f"poddaemon[{unit_pid}]: INFO shut down" in again.stdout, again.stdout


def test_a_podctl_spawn_in_a_service_starts_no_fork_server_to_die_with_it(sd: Sd) -> None:
    """A timer's job (a oneshot service) ran `podctl spawn` while another pod ran: the fork
    server it started lived in the job's cgroup, a pod spawned from a shell meanwhile was
    forked by it, into that cgroup, and was killed with the job's unit when it stopped."""
    sd.env.start("other", write=[str(sd.env.work / "other")])  # (a second pod: a server pays)
    job = sd.env.manifest("job", write=[str(sd.env.work / "job")])
    started = sd.m.run(
        [
            "systemd-run",
            "--user",
            "--unit=nightly",
            "--property=Type=oneshot",
            "--property=RemainAfterExit=yes",  # its cgroup held until stopped, as a job's is
            *(f"--setenv={k}={v}" for k, v in {**sd.podenv, "FAKE_API_KEY": "test-key"}.items()),
            sys.executable,
            "-m",
            "cli.main",
            "spawn",
            str(job),
        ]
    )
    assert started.returncode == 0, started.stderr + sd.journal("job")
    assert sd.podctl("status", "job").returncode == 0
    shell = sd.env.podctl("spawn", str(sd.env.manifest("shell", write=[str(sd.env.work / "s")])))
    assert shell.returncode == 0, shell.stderr
    with sd.client("shell") as c:
        pid = c.status().pid
    assert sd.m.systemctl("stop", "nightly.service").returncode == 0  # the job is done
    assert sd.podctl("status", "job").returncode == 3  # its own pod went with it, as exec'd
    with sd.client("shell") as c:
        assert c.status().pid == pid


def test_install_names_an_mcp_server_only_the_shells_path_reaches(sd: Sd) -> None:
    """An MCP server named by a bare command that the shell finds in a directory of its own
    PATH (~/.local/bin): the unit's pod, with the manager's PATH, started without it (its
    tools absent, a warning in the journal) while `install --now` said "enabled and started"."""
    from tests.integration.test_mcp import SERVER

    bin_dir = sd.env.home / "bin"
    bin_dir.mkdir()
    (bin_dir / "mcpsrv").write_text(f"#!/bin/sh\nexec {sys.executable} {SERVER}\n")
    (bin_dir / "mcpsrv").chmod(0o755)
    path = sd.env.manifest("pathy", extra='[[mcp.servers]]\nname = "s"\ncommand = ["mcpsrv"]\n')
    install = [sys.executable, "-m", "cli.main", "unit", "install", str(path), "--now"]
    shell = {**sd.podenv, "PATH": f"{bin_dir}:{sd.m.env['PATH']}"}
    out = sd.m.run(install, shell)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"mcp.servers[0].command: 'mcpsrv' is {bin_dir}/mcpsrv in this shell" in out.stderr
    assert not (units_dir(sd) / "poddaemon-pathy.service").exists()
    sd.write_env(FAKE_API_KEY="test-key", PATH=shell["PATH"])  # as it says: the unit's PATH
    out = sd.m.run(install, shell)
    assert out.returncode == 0, out.stderr
    with sd.client("pathy") as c:
        assert [s.state for s in c.status().mcp] == ["ready"]


def test_a_start_that_waits_out_a_stuck_registry_lock_is_tried_again(sd: Sd) -> None:
    """A process stuck holding the registry lock (a podctl suspended with Ctrl-Z, a lock on
    a hung NFS home) as the unit starts: the pod gave up after LOCK_TIMEOUT and exited 78,
    "refused, starting again changes nothing", so systemd left it down after the holder had
    gone. It exits 1 now, and Restart=on-failure starts it once the lock is free."""
    import filelock

    path = sd.env.manifest("busy")
    assert sd.podctl("unit", "install", str(path)).returncode == 0
    run = sd.env.home / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    lock = filelock.FileLock(str(run / "pods.json.lock"), mode=0o600)
    lock.acquire()
    try:
        assert sd.m.systemctl("start", "--no-block", sd.unit("busy")).returncode == 0
        wait_until(lambda: "waiting for the registry lock" in sd.journal("busy"), 30, "timeout")
        wait_until(lambda: sd.prop("busy", "ExecMainStatus") != "0", 10, "the pod's exit")
        assert sd.prop("busy", "ExecMainStatus") == "1"
    finally:
        lock.release()
    sd.wait_prop("busy", "ActiveState", "active", timeout=30)
    with sd.client("busy") as c:
        assert c.status().pid == sd.main_pid("busy")
