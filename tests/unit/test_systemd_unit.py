"""Unit files: the shipped template and what `podctl unit install` writes pass systemd's own
verifier; the pieces around them (quoting, env files, key check, cgroup detection, --since)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cli import service, unit
from poddaemon.config.load import files_problem, load_manifest
from poddaemon.readyline import EXIT_REFUSED

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "systemd" / "poddaemon@.service"
needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


def verify(path: Path, runtime: Path) -> None:
    out = subprocess.run(
        ["systemd-analyze", "verify", "--recursive-errors=yes", "--man=no", "--user", str(path)],
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "", out.stderr  # no warnings either


@needs_analyze
def test_template_verifies(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "poddaemon"
    assert script.exists(), "the poddaemon console script is installed next to python"
    text = TEMPLATE.read_text()
    assert "Type=notify" in text and "--resume" in text and "WatchdogSec=" in text
    assert f"RestartPreventExitStatus={EXIT_REFUSED}\n" in text  # as podctl unit install's
    target = tmp_path / "poddaemon@demo.service"
    target.write_text(text.replace("%h/.local/bin/poddaemon", str(script)))
    verify(target, tmp_path)


@needs_analyze
def test_installed_unit_verifies(tmp_path: Path) -> None:
    manifest = tmp_path / "my pods" / "100% reviewer.toml"  # spaces and a specifier character
    manifest.parent.mkdir()
    manifest.write_text("")
    text = unit.render_unit(
        "reviewer",
        manifest,
        unit.poddaemon_executable(),
        tmp_path / "config",
        {"PODDAEMON_HOME": str(tmp_path / "h")},
    )
    for line in (
        "Type=notify",
        "Restart=on-failure",
        f"RestartPreventExitStatus={EXIT_REFUSED}",  # a refused start is not tried again
        "StartLimitBurst=5",  # nor is one that keeps failing, forever
        f"WatchdogSec={unit.WATCHDOG_SEC}",
        "KillMode=mixed",
        "TimeoutStopSec=",
        f"EnvironmentFile=-{tmp_path}/config/env",
        f"Environment=PODDAEMON_HOME={tmp_path}/h",
        "WantedBy=default.target",
    ):
        assert line in text
    assert f'run "{tmp_path}/my pods/100%% reviewer.toml" --resume' in text
    target = tmp_path / "poddaemon-reviewer.service"
    target.write_text(text)
    verify(target, tmp_path)


def test_executable_is_this_installation() -> None:
    exe = unit.poddaemon_executable()
    assert exe.is_absolute() and exe.parent == Path(sys.executable).parent.absolute()


def test_quote_arg() -> None:
    assert unit.quote_arg("/a/b") == "/a/b"
    assert unit.quote_arg("/a b/c") == '"/a b/c"'
    assert unit.quote_arg("50%") == "50%%"
    assert unit.quote_arg("$HOME") == "$$HOME"
    assert unit.quote_arg('say "hi"') == '"say \\"hi\\""'
    # Environment= expands specifiers, not variables; EnvironmentFile= takes no quotes.
    assert unit.quote_env("H=/a $b/50%") == '"H=/a $b/50%%"'
    assert unit.env_file_arg("/a $b/50%/env") == "-/a $b/50%%/env"


def test_env_file_and_key_check(tmp_path: Path) -> None:
    env_file = tmp_path / "env"
    problem = unit.key_problem("MY_KEY", env_file, {})
    assert problem is not None
    assert "MY_KEY" in problem and str(env_file) in problem and "set-environment" in problem
    env_file.write_text('# comment\nOTHER=1\nMY_KEY = "secret"\n')
    assert unit.read_env_file(env_file) == {"OTHER": "1", "MY_KEY": "secret"}
    assert unit.key_problem("MY_KEY", env_file, {}) is None
    assert unit.key_problem("FROM_MANAGER", env_file, {"FROM_MANAGER": "x"}) is None
    # An empty line in the file is what the unit gets, whatever the manager holds (systemd
    # applies EnvironmentFile= last): it was accepted, and the pod then refused to start.
    env_file.write_text("MY_KEY=\n")
    problem = unit.key_problem("MY_KEY", env_file, {"MY_KEY": "x"})
    assert problem is not None and "is empty in" in problem


def test_key_check_names_an_export_line_systemd_ignores(tmp_path: Path) -> None:
    """`export MY_KEY=...` (a shell's or .env file's line) is no assignment to systemd, which
    ignores it: install said the key was "set neither in" the file that held it."""
    env_file = tmp_path / "env"
    env_file.write_text("export  MY_KEY=secret\n")
    problem = unit.key_problem("MY_KEY", env_file, {})
    assert problem == (
        f"MY_KEY (the provider's API key) is set in {env_file} as `export MY_KEY=...`, a line "
        f"systemd ignores (it takes no `export`), so the pod could not start: write it as "
        f"MY_KEY=... there"
    )
    # Set in the manager's environment, the key reaches the unit all the same.
    assert unit.key_problem("MY_KEY", env_file, {"MY_KEY": "x"}) is None
    assert "set neither" in str(unit.key_problem("OTHER_KEY", env_file, {}))


def test_env_file_others_may_neither_write_nor_read(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir(mode=0o700)
    env_file = config / "env"
    assert unit.env_file_problem(env_file) is None  # none: the manager's environment may do
    env_file.write_text("MY_KEY=secret\n")
    env_file.chmod(0o644)  # what `echo MY_KEY=... >> env` makes under umask 022
    problem = unit.env_file_problem(env_file)
    assert problem == (
        f"environment file {env_file} is readable by group or others (mode 0644) and holds "
        f"API keys: refusing it; run chmod 600 {env_file}"
    )
    env_file.chmod(0o620)
    problem = unit.env_file_problem(env_file)
    assert problem is not None and "writable by group or others (mode 0620)" in problem
    env_file.chmod(0o600)
    assert unit.env_file_problem(env_file) is None
    if os.geteuid() == 0:  # root can hand it to another user, as a careless copy would
        os.chown(env_file, 65534, 65534)
        problem = unit.env_file_problem(env_file)
        assert problem is not None and "owned by uid 65534" in problem


def test_manifest_others_may_not_change(tmp_path: Path) -> None:
    # The unit reads its manifest at every start: another user who can change it picks the
    # pod's scope, sandbox and hooks, run as you (judged as defaults.toml and the env file).
    project = tmp_path / "project"
    project.mkdir(mode=0o755)
    manifest = project / "m.toml"
    manifest.write_text("[pod]\n")
    manifest.chmod(0o644)
    assert unit.manifest_problem(manifest) is None
    manifest.chmod(0o666)
    problem = unit.manifest_problem(manifest)
    assert problem is not None and "writable by group or others (mode 0666)" in problem
    manifest.chmod(0o644)
    project.chmod(0o777)  # a shared directory, not sticky: anyone may swap the file
    problem = unit.manifest_problem(manifest)
    assert problem is not None and f"{project} is writable by group or others" in problem
    project.chmod(0o1777)  # sticky: others cannot swap it, but they can add files beside it
    problem = unit.manifest_problem(manifest)
    assert problem is not None and f"{project} is writable by group or others" in problem
    project.chmod(0o755)
    link = tmp_path / "link.toml"
    link.symlink_to(manifest)
    assert unit.manifest_problem(link) is None
    if os.geteuid() == 0:
        os.chown(manifest, 65534, 65534)
        problem = unit.manifest_problem(manifest)
        assert problem is not None and "owned by uid 65534" in problem


def test_install_refuses_a_manifest_another_user_may_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[pod]\nname = "shared"\npwd = "/tmp"\n[provider]\nkind = "openai"\nmodel = "m"\n'
        '[worker]\ninstruction = "x"\n[[scope.allow]]\ntarget = "/tmp"\npermission = "read"\n'
    )
    manifest.chmod(0o666)
    home = tmp_path / "home"
    monkeypatch.setenv("PODDAEMON_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(
        unit, "manager_environment", lambda: pytest.fail("asked the manager about a bad manifest")
    )
    with pytest.raises(unit.UnitError, match="writable by group or others"):
        unit.install(str(manifest), now=False)
    assert not (tmp_path / "xdg").exists()  # no unit written


def test_install_refuses_a_config_dir_another_user_may_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The unit reads <config>/env at every start (EnvironmentFile=), there or not today: in a
    # config dir others may write in, one of them could create it later with LD_PRELOAD and
    # run code as you. With no env file yet, such a dir was accepted.
    tmp_path.chmod(0o755)
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[pod]\nname = "cfg"\npwd = "/tmp"\n[provider]\nkind = "openai"\nmodel = "m"\n'
        '[worker]\ninstruction = "x"\n[[scope.allow]]\ntarget = "/tmp"\npermission = "read"\n'
    )
    manifest.chmod(0o644)
    config = tmp_path / "config"
    config.mkdir()
    config.chmod(0o777)  # a shared directory: no env file in it (yet)
    monkeypatch.delenv("PODDAEMON_HOME", raising=False)
    monkeypatch.setenv("PODDAEMON_CONFIG_DIR", str(config))
    monkeypatch.setenv("PODDAEMON_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PODDAEMON_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("OPENAI_API_KEY", "x")
    monkeypatch.setattr(unit, "manager_environment", lambda: {"OPENAI_API_KEY": "x"})
    monkeypatch.setattr(unit, "unit_dir", lambda manager_env=None: tmp_path / "units")
    monkeypatch.setattr(unit, "systemctl", lambda *a, **k: pytest.fail("unit installed"))
    with pytest.raises(unit.UnitError, match=f"config directory {config} is writable by group"):
        unit.install(str(manifest), now=False)
    assert not (tmp_path / "units").exists()
    config.chmod(0o700)
    if os.geteuid() == 0:  # another user's directory, as one made first in /tmp would be
        os.chown(config, 65534, 65534)
        with pytest.raises(unit.UnitError, match=f"config directory {config} is owned by uid"):
            unit.install(str(manifest), now=False)
    # A missing one is made 0700, before anyone else can make it.
    config.rmdir()
    assert unit.config_dir_problem(config) is None
    assert config.stat().st_mode & 0o7777 == 0o700


def test_install_refuses_hooks_mcp_servers_and_instructions_others_may_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The unit reads its instruction file and runs its hook scripts and stdio MCP servers at
    # every start, unattended, as you: only the manifest itself was judged, so a hook script
    # in a shared directory was installed, and its writers' code ran as you at the next start.
    tmp_path.chmod(0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may swap what it holds
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    for where in (shared, mine):
        (where / "guard.sh").write_text("#!/bin/sh\n")
        (where / "guard.sh").chmod(0o755)
        (where / "prompt.md").write_text("x\n")
        (where / "prompt.md").chmod(0o644)
    head = '[pod]\nname = "files"\npwd = "/tmp"\n[provider]\nkind = "openai"\nmodel = "m"\n'
    scope = '[[scope.allow]]\ntarget = "/tmp"\npermission = "read"\n'
    monkeypatch.setenv("PODDAEMON_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(unit, "manager_environment", lambda: pytest.fail("a bad file went by"))
    cases = {
        "worker.instruction_file": f'[worker]\ninstruction_file = "{{}}/prompt.md"\n{scope}',
        "hooks.PreToolUse[0].command": f'{scope}[[hooks.PreToolUse]]\ncommand = "{{}}/guard.sh"\n',
        "mcp.servers[0].command": (
            f'{scope}[[mcp.servers]]\nname = "s"\ncommand = ["{{}}/guard.sh"]\n'
        ),
    }
    for what, body in cases.items():
        manifest = mine / "m.toml"
        manifest.write_text(head + body.format(mine))
        manifest.chmod(0o644)
        assert files_problem(load_manifest(manifest)) is None  # ours: fine
        manifest.write_text(head + body.format(shared))
        with pytest.raises(
            unit.UnitError, match=re.escape(what) + f" {shared}/.* is inside {shared}"
        ):
            unit.install(str(manifest), now=False)


def test_an_mcp_server_only_this_shells_path_finds_is_named(tmp_path: Path) -> None:
    """`command = ["mcpsrv"]`, found in ~/.local/bin from the shell (`podctl spawn` worked):
    under the unit the pod gets the user manager's PATH, the server did not start, and the
    pod ran without its tools while `unit install --now` said "enabled and started"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mcpsrv").write_text("#!/bin/sh\n")
    (bin_dir / "mcpsrv").chmod(0o755)
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[pod]\nname = "m"\npwd = "/tmp"\n[provider]\nkind = "openai"\nmodel = "m"\n'
        '[[scope.allow]]\ntarget = "/tmp"\npermission = "read"\n'
        '[[mcp.servers]]\nname = "s"\ncommand = ["mcpsrv", "stdio"]\n'
    )
    m = load_manifest(manifest)
    env_file = tmp_path / "env"
    shell = f"{bin_dir}:/usr/bin:/bin"
    manager = {"PATH": "/usr/bin:/bin"}
    assert unit.command_path_problem(m, env_file, manager, shell) == (
        f"{manifest}: mcp.servers[0].command: 'mcpsrv' is {bin_dir}/mcpsrv in this shell's "
        f"PATH but is not in the PATH the unit's pod gets (/usr/bin:/bin), so the server "
        f"would not start there: give its absolute path, or set PATH in {env_file}"
    )
    # Reached through the manager's PATH, or the env file's (which wins): fine.
    assert unit.command_path_problem(m, env_file, {"PATH": shell}, shell) is None
    env_file.write_text(f"PATH={shell}\n")
    assert unit.command_path_problem(m, env_file, manager, shell) is None
    # Found nowhere, the pod says so wherever it starts: not the unit's problem to name.
    env_file.unlink()
    assert unit.command_path_problem(m, env_file, manager, "/usr/bin:/bin") is None


def test_an_mcp_servers_variable_the_unit_lacks_is_named(tmp_path: Path) -> None:
    """`env = { GITHUB_TOKEN = "${GITHUB_TOKEN}" }`, the token in the shell only: the unit's
    pod refused to start ("${GITHUB_TOKEN} is not set in the pod's environment"), a unit
    `install` without --now had written and enabled all the same."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[pod]\nname = "m"\npwd = "/tmp"\n[provider]\nkind = "openai"\nmodel = "m"\n'
        '[[scope.allow]]\ntarget = "/tmp"\npermission = "read"\n'
        '[[mcp.servers]]\nname = "s"\ncommand = ["/bin/true"]\n'
        'env = { TOKEN = "${GITHUB_TOKEN}", HOME = "/tmp" }\n'
    )
    m = load_manifest(manifest)
    env_file = tmp_path / "env"
    problem = unit.mcp_env_problem(m, env_file, {})
    assert problem is not None
    assert problem.startswith(
        f"{manifest}: mcp.servers[0].env takes ${{GITHUB_TOKEN}}, which is set neither in "
        f"{env_file} nor in the user manager's environment"
    )
    assert "set-environment GITHUB_TOKEN=" in problem
    assert unit.mcp_env_problem(m, env_file, {"GITHUB_TOKEN": "x"}) is None
    env_file.write_text("GITHUB_TOKEN=\n")  # set, if empty: the pod starts the server
    assert unit.mcp_env_problem(m, env_file, {}) is None


def test_an_env_file_that_moves_the_pods_directories_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PODDAEMON_HOME=...` in <config>/env (shell exports copied there) wins over the unit's
    Environment= (systemd applies EnvironmentFile= last): the unit pod kept its socket in
    another home, and `podctl` said "not running" right after "enabled and started"."""
    home = tmp_path / "home"
    monkeypatch.setenv("PODDAEMON_HOME", str(home))
    monkeypatch.delenv("PODDAEMON_DATA_DIR", raising=False)
    env_file = tmp_path / "env"
    pins = {"PODDAEMON_HOME": str(home)}
    env_file.write_text(f"KEY=x\nPODDAEMON_HOME={tmp_path}/other\n")
    assert unit.env_file_dirs_problem(env_file, pins) == (
        f"{env_file} sets PODDAEMON_HOME={tmp_path}/other, which wins over the unit's "
        f"PODDAEMON_HOME={home} (systemd applies EnvironmentFile= last): the pod would keep "
        f"its socket and sessions where podctl does not look. Remove that line; the unit gets "
        f"the directories podctl uses"
    )
    problem = unit.env_file_dirs_problem(env_file, {})  # podctl has none: the unit neither
    assert problem is not None and "the unit's PODDAEMON_HOME (unset)" in problem
    # The directories podctl uses, said again (a trailing slash, one it derives): fine.
    env_file.write_text(f"PODDAEMON_HOME={home}/\nPODDAEMON_DATA_DIR={home}/data\n")
    assert unit.env_file_dirs_problem(env_file, pins) is None
    env_file.write_text("KEY=x\n")
    assert unit.env_file_dirs_problem(env_file, pins) is None


def test_install_without_a_user_manager_says_how(tmp_path: Path) -> None:
    if shutil.which("systemctl") is None:
        pytest.skip("systemctl not installed")
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[pod]\nname = "nomgr"\npwd = "/tmp"\n[provider]\nkind = "openai"\nmodel = "m"\n'
        '[worker]\ninstruction = "x"\n[[scope.allow]]\ntarget = "/tmp"\npermission = "read"\n'
    )
    home = tempfile.mkdtemp(dir="/tmp")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": home,
        "PODDAEMON_HOME": home,
        "XDG_RUNTIME_DIR": home,  # no manager's private socket in there
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "unit", "install", str(manifest)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    shutil.rmtree(home, ignore_errors=True)
    assert out.returncode == 1
    assert "is `systemctl --user` available?" in out.stderr
    assert "loginctl enable-linger" in out.stderr
    assert not (Path(home) / ".config").exists()


def test_unit_of_pid_reads_the_cgroup() -> None:
    assert service.unit_of_pid(os.getpid()) is None or "poddaemon-" in str(
        service.unit_of_pid(os.getpid())
    )
    assert service._UNIT_IN_CGROUP.search(
        "/user.slice/user-1000.slice/user@1000.service/app.slice/poddaemon-rev.service"
    )
    found = service._UNIT_IN_CGROUP.search("/x/user@0.service/poddaemon-a_b-1.service/child")
    assert found is not None and found.group(1) == "poddaemon-a_b-1.service"
    assert service._UNIT_IN_CGROUP.search("/x/poddaemon-a.service.d") is None
    assert service.unit_of_pid(2**22 + 1) is None  # no such process


def test_parse_since() -> None:
    now = 1_000_000.0
    assert service.parse_since("30s", now) == now - 30
    assert service.parse_since("10m", now) == now - 600
    assert service.parse_since("2h", now) == now - 7200
    assert service.parse_since("90", now) == now - 90
    assert service.parse_since("2026-01-02T03:04:05+00:00") == 1767323045.0
    with pytest.raises(ValueError, match="--since"):
        service.parse_since("yesterday-ish")
    assert service._line_time("2026-01-02 03:04:05.123 poddaemon[1] INFO x") is not None
    assert service._line_time("Traceback (most recent call last):") is None


def test_parse_since_a_date_with_no_epoch_time_names_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--since 0001-01-01` said only "year 0 is out of range" (from timestamp())."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        with pytest.raises(ValueError, match="--since: '0001-01-01' is neither"):
            service.parse_since("0001-01-01")
    finally:
        monkeypatch.undo()
        time.tzset()


@needs_analyze
@pytest.mark.parametrize("name", ["reviewer-nightly.timer", "reviewer-inbox.path"])
def test_examples_verify(tmp_path: Path, name: str) -> None:
    podctl = str(Path(sys.executable).parent / "podctl")
    for example in (ROOT / "examples" / "systemd").glob("reviewer-*"):
        text = example.read_text().replace("%h/.local/bin/podctl", podctl)
        (tmp_path / example.name).write_text(text)
    # The pod's own unit, which the examples Want.
    (tmp_path / "poddaemon-reviewer.service").write_text(
        "[Service]\nType=notify\nExecStart=/bin/true\n"
    )
    verify(tmp_path / name, tmp_path)


def test_version() -> None:
    from poddaemon import __version__

    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0
    assert out.stdout == f"podctl {__version__} (protocol 1)\n"


def test_how_a_start_ended_before_ready_in_one_line() -> None:
    """What `install --now` and `restart` say of a pod that ended before READY with no word of
    its own, from the unit's properties, else from systemctl's "Job for ... failed because"."""
    from cli.common import pod_of_unit

    assert pod_of_unit("poddaemon-a_b.service") == "a_b"
    assert pod_of_unit("poddaemon@tmpl.service") == "tmpl"
    assert pod_of_unit("other.service") == ""
    exited = {"Result": "exit-code", "ExecMainPID": "42", "ExecMainCode": "1",
              "ExecMainStatus": "1", "SubState": "failed"}  # fmt: skip
    what, again = unit._how_it_ended("poddaemon-x.service", exited, "")
    assert not again
    assert what == (
        "its pod (pid 42) exited with status 1 before it was ready. Its lines: podctl logs x "
        "(or systemctl --user status poddaemon-x.service)"
    )
    dumped = {**exited, "Result": "core-dump", "ExecMainCode": "3", "ExecMainStatus": "6",
              "SubState": "auto-restart", "RestartUSec": "100ms"}  # fmt: skip
    what, again = unit._how_it_ended("poddaemon@x.service", dumped, "")
    assert again and what.startswith(
        "its pod (pid 42) dumped core on signal 6 (SIGABRT) before it was ready; systemd "
        "starts it again in 100ms (Restart=on-failure). Its lines: podctl logs x"
    )
    said = (
        "systemctl --user restart poddaemon-x.service failed: Job for poddaemon-x.service "
        'failed because a timeout was exceeded.\nSee "systemctl --user status ..."'
    )
    what, again = unit._how_it_ended("poddaemon-x.service", {}, said)  # systemctl could not say
    assert not again
    assert what.startswith("it failed before it was ready (a timeout was exceeded). Its lines")
