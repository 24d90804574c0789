"""Manifest loading: defaults, --set, paths, validation messages and the TOML writer."""

import json
import os
import re
import string
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poddaemon.config import (
    FILE_TOOLS,
    KNOWN_TOOLS,
    CompactionConfig,
    FieldError,
    Manifest,
    ManifestError,
    PodSection,
    ProviderConfig,
    ScopeRule,
    ScopeSection,
    ToolOutputConfig,
    WorkerConfig,
    load_manifest,
    manifest_to_dict,
    manifest_to_toml,
)

MINIMAL = """\
[pod]
name = "reviewer"

[provider]
kind = "anthropic"
model = "claude-sonnet-4-5"

[[scope.allow]]
target = "."
permission = "write"
"""

FULL = """\
[pod]
name = "reviewer"
pwd = "work"

[provider]
kind = "openai"
model = "gpt-4o"
base_url = "http://127.0.0.1:11434/v1"
api_key_env = "MY_KEY"
max_retries = 2
connect_timeout = 1.5
first_byte_timeout = 20
stream_idle_timeout = 30.0
retry_initial_delay = 0.25
retry_max_delay = 8.0
retry_total_timeout = 60.0

[worker]
instruction = \"\"\"You are a careful reviewer.
Today is {{ now.date() }}.\"\"\"
max_tokens = 1000
temperature = 0.2
max_turns = 7
tools = ["read_file", "write_file", "edit_file", "list_dir", "glob", "grep", "bash",
         "spawn_pod", "send_to_pod", "wait_pods", "list_pods", "stop_pod"]
[worker.tool_output]
default_max_bytes = 1024
per_tool = { bash = 32768, grep = 100 }

[[scope.allow]]
target = "."
permission = "write"
recursive = true
[[scope.allow]]
target = "/usr/share/doc"
permission = "read"
recursive = false
[[scope.deny]]
target = "./secrets"
permission = "read"

[compaction]
compact_threshold = 5000
compact_retained_turns = 3
[compaction.provider]
kind = "anthropic"
model = "claude-haiku"

[budget]
max_total_tokens = 2000000

[notify]
max_pending = 10

[spawn]
on_parent_exit = "detach"
"""


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Relative file names in messages, and no user defaults.toml leaking in.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PODDAEMON_CONFIG_DIR", str(tmp_path / "config"))


def write(text: str, name: str = "m.toml") -> str:
    Path(name).parent.mkdir(parents=True, exist_ok=True)
    Path(name).write_text(text)
    return name


def error_of(text: str, *overrides: str, defaults: str | None = None) -> str:
    dpath = Path(write(defaults, "defaults.toml")) if defaults is not None else Path("none.toml")
    with pytest.raises(ManifestError) as info:
        load_manifest(write(text), overrides, defaults_path=dpath)
    return str(info.value)


def unhinted(error: str) -> str:
    """An error without the hint an unknown key gets (see test_an_unknown_key_says_what_…)."""
    return re.sub(r" \((did you mean '[^']*'\?|expected one of: [^)]*)\)", "", error)


def same(a: Manifest, b: Manifest) -> bool:
    return msgspec.structs.replace(a, source="") == msgspec.structs.replace(b, source="")


# --- valid manifests -------------------------------------------------------------------------


def test_full_manifest_loads_every_field(tmp_path: Path) -> None:
    m = load_manifest(write(FULL))
    work = str(tmp_path / "work")
    assert m.source == str(tmp_path / "m.toml")
    assert m.pod == PodSection(name="reviewer", pwd=work)
    assert m.provider == ProviderConfig(
        kind="openai",
        model="gpt-4o",
        base_url="http://127.0.0.1:11434/v1",
        api_key_env="MY_KEY",
        max_retries=2,
        connect_timeout=1.5,
        first_byte_timeout=20.0,
        stream_idle_timeout=30.0,
        retry_initial_delay=0.25,
        retry_max_delay=8.0,
        retry_total_timeout=60.0,
    )
    assert m.provider.api_key_var == "MY_KEY"
    assert m.worker.instruction == "You are a careful reviewer.\nToday is {{ now.date() }}."
    assert (m.worker.max_tokens, m.worker.temperature, m.worker.max_turns) == (1000, 0.2, 7)
    assert set(m.worker.tools) == KNOWN_TOOLS
    assert m.worker.tool_output == ToolOutputConfig(
        default_max_bytes=1024, per_tool={"bash": 32768, "grep": 100}
    )
    assert m.scope == ScopeSection(
        allow=[
            ScopeRule(target=work, permission="write"),
            ScopeRule(target="/usr/share/doc", permission="read", recursive=False),
        ],
        deny=[ScopeRule(target=f"{work}/secrets", permission="read")],
    )
    assert m.compaction == CompactionConfig(
        compact_threshold=5000,
        compact_retained_turns=3,
        provider=ProviderConfig(kind="anthropic", model="claude-haiku"),
    )
    assert m.compaction_provider.model == "claude-haiku"
    assert m.budget.max_total_tokens == 2000000
    assert m.notify.max_pending == 10
    assert m.spawn.on_parent_exit == "detach"


def test_minimal_manifest_gets_the_defaults(tmp_path: Path) -> None:
    m = load_manifest(write(MINIMAL))
    assert m.pod.pwd == str(tmp_path)
    assert m.worker.tools == list(FILE_TOOLS)
    assert m.worker.instruction is None and m.worker.instruction_file is None
    assert m.worker.max_tokens == 4096 and m.worker.max_turns == 50
    assert m.worker.temperature is None
    assert m.worker.tool_output == ToolOutputConfig(default_max_bytes=16384, per_tool={})
    assert m.compaction is None
    assert m.compaction_provider is m.provider
    assert m.budget.max_total_tokens is None
    assert m.notify.max_pending == 1000
    assert m.spawn.on_parent_exit == "stop"
    assert m.provider.max_retries == 4 and m.provider.retry_max_delay == 30.0


@pytest.mark.parametrize(
    ("kind", "var"),
    [("anthropic", "ANTHROPIC_API_KEY"), ("openai", "OPENAI_API_KEY"),
     ("openai_responses", "OPENAI_API_KEY")],
)  # fmt: skip
def test_api_key_var_defaults_per_kind(kind: str, var: str) -> None:
    assert ProviderConfig(kind=kind, model="m").api_key_var == var  # type: ignore[arg-type]


def test_full_manifest_round_trips_through_toml(tmp_path: Path) -> None:
    m = load_manifest(write(FULL))
    text = manifest_to_toml(m)
    # Written elsewhere: every path is absolute, so the new location does not matter.
    again = load_manifest(write(text, "elsewhere/child.toml"))
    assert same(again, m)
    assert again.source == str(tmp_path / "elsewhere/child.toml")
    assert tomllib.loads(text) == manifest_to_dict(m)
    assert "source" not in manifest_to_dict(m)


def test_to_dict_skips_none() -> None:
    d = load_manifest(write(MINIMAL)).to_dict()
    assert "compaction" not in d
    assert "base_url" not in d["provider"]
    assert "instruction" not in d["worker"]
    assert d["budget"] == {}


# --- defaults.toml ---------------------------------------------------------------------------


def test_defaults_merge_under_the_manifest() -> None:
    write(
        """\
[provider]
kind = "anthropic"
model = "default-model"
max_retries = 9
[worker]
instruction = "from defaults"
max_tokens = 100
tools = ["bash"]
[worker.tool_output]
per_tool = { bash = 1, grep = 2 }
""",
        "defaults.toml",
    )
    write(
        MINIMAL + '[worker]\ntools = ["read_file"]\n[worker.tool_output]\nper_tool = {grep = 5}\n'
    )
    m = load_manifest("m.toml", defaults_path=Path("defaults.toml"))
    assert m.provider.model == "claude-sonnet-4-5"  # the manifest wins per key
    assert m.provider.max_retries == 9  # what it leaves out comes from defaults
    assert m.worker.instruction == "from defaults"
    assert m.worker.max_tokens == 100
    assert m.worker.tools == ["read_file"]  # lists are replaced, not merged
    assert m.worker.tool_output.per_tool == {"bash": 1, "grep": 5}  # tables merge deeply


def test_defaults_come_from_the_config_dir_by_default(tmp_path: Path) -> None:
    write("[worker]\nmax_turns = 3\n", "config/defaults.toml")
    assert load_manifest(write(MINIMAL)).worker.max_turns == 3


def test_defaults_another_user_could_change_are_refused(tmp_path: Path) -> None:
    # They go under every manifest (tools, instruction, provider URL), as ssh's config does.
    defaults = Path(write("[worker]\nmax_turns = 3\n", "config/defaults.toml"))
    os.chmod(defaults, 0o666)
    with pytest.raises(ManifestError) as info:
        load_manifest(write(MINIMAL))
    assert str(info.value) == (
        f"defaults file {defaults.resolve()} is writable by group or others (mode 0666): "
        "refusing it, another user could change what your pods run; "
        f"run chmod go-w {defaults.resolve()}"
    )
    os.chmod(defaults, 0o644)
    os.chmod(defaults.parent, 0o777)
    with pytest.raises(ManifestError) as info:
        load_manifest(write(MINIMAL))
    assert str(info.value).startswith(
        f"defaults file's directory {defaults.parent.resolve()} is writable by group or others"
    )
    os.chmod(defaults.parent, 0o755)
    assert load_manifest(write(MINIMAL)).worker.max_turns == 3


def test_defaults_instruction_gives_way_to_the_manifests_instruction_file() -> None:
    defaults = '[worker]\ninstruction = "generic"\n'
    write(defaults, "defaults.toml")
    write(MINIMAL + '[worker]\ninstruction_file = "p.md"\n')
    m = load_manifest("m.toml", defaults_path=Path("defaults.toml"))
    assert m.worker.instruction is None
    assert m.worker.instruction_file is not None


def test_an_instruction_not_from_the_manifest_says_where_it_came_from() -> None:
    # What a template error names: the manifest was named for an instruction it did not have.
    write('[worker]\ninstruction = "{{ nope }}"\n', "defaults.toml")
    m = load_manifest(write(MINIMAL), (), Path("defaults.toml"))
    assert m.instruction_source == "defaults.toml"
    own = MINIMAL + '[worker]\ninstruction_file = "p.md"\n'
    assert load_manifest(write(own), (), Path("defaults.toml")).instruction_source == ""
    m = load_manifest(write(MINIMAL), ["worker.instruction=hi"], Path("defaults.toml"))
    assert m.instruction_source == "m.toml (--set worker.instruction=hi)"
    assert "instruction_source" not in manifest_to_toml(m)
    assert error_of("instruction_source = 'x'\n" + MINIMAL) == (
        "m.toml:1: instruction_source: unknown key"
    )


def test_defaults_for_another_provider_kind_keep_only_generic_settings() -> None:
    write(
        '[provider]\nkind = "openai"\nmodel = "gpt"\nbase_url = "http://x/v1"\nmax_retries = 1\n',
        "defaults.toml",
    )
    m = load_manifest(write(MINIMAL), defaults_path=Path("defaults.toml"))
    assert (m.provider.kind, m.provider.model, m.provider.base_url) == (
        "anthropic",
        "claude-sonnet-4-5",
        None,
    )
    assert m.provider.max_retries == 1


def test_defaults_can_fill_in_the_whole_provider() -> None:
    write('[provider]\nkind = "openai"\nmodel = "gpt"\n', "defaults.toml")
    text = MINIMAL.replace('[provider]\nkind = "anthropic"\nmodel = "claude-sonnet-4-5"\n', "")
    m = load_manifest(write(text), defaults_path=Path("defaults.toml"))
    assert (m.provider.kind, m.provider.model) == ("openai", "gpt")


def test_defaults_cannot_add_scope() -> None:
    defaults = '[worker]\nmax_turns = 3\n\n[[scope.allow]]\ntarget = "/"\npermission = "write"\n'
    assert error_of(MINIMAL, defaults=defaults) == (
        "defaults.toml:4: scope: not allowed in defaults (only [provider] and [worker])"
    )


def test_defaults_cannot_set_other_sections() -> None:
    assert error_of(MINIMAL, defaults='[pod]\npwd = "/"\n') == (
        "defaults.toml:1: pod: not allowed in defaults (only [provider] and [worker])"
    )


def test_errors_in_defaults_name_the_defaults_file() -> None:
    defaults = '[worker]\nmax_turns = 3\nbogus = 1\nmax_tokens = "x"\n'
    assert unhinted(error_of(MINIMAL, defaults=defaults)) == (
        "defaults.toml:3: worker.bogus: unknown key"
    )
    defaults = '[worker]\nmax_tokens = "x"\n'
    assert error_of(MINIMAL, defaults=defaults) == (
        "defaults.toml:2: worker.max_tokens: expected int, got str"
    )
    assert error_of(MINIMAL, defaults="[worker\n").startswith("defaults.toml:1: invalid TOML: ")


# --- --set -----------------------------------------------------------------------------------


def test_set_overrides_scalars_and_nested_keys() -> None:
    m = load_manifest(
        write(MINIMAL),
        [
            "provider.model=gpt-4o",  # not TOML: taken as a plain string
            "provider.kind='openai'",
            "worker.max_tokens=100",
            "worker.temperature=0.5",
            'worker.tools=["bash", "grep"]',
            "worker.tool_output.per_tool.bash=77",
            "compaction.compact_threshold=5",  # creates the table
            "scope.allow.0.permission=read",
            "worker.instruction=Be brief. Very.",
        ],
    )
    assert (m.provider.kind, m.provider.model) == ("openai", "gpt-4o")
    assert m.worker.max_tokens == 100
    assert m.worker.temperature == 0.5
    assert m.worker.tools == ["bash", "grep"]
    assert m.worker.tool_output.per_tool == {"bash": 77}
    assert m.compaction == CompactionConfig(compact_threshold=5)
    assert m.scope.allow[0].permission == "read"
    assert m.worker.instruction == "Be brief. Very."


def test_a_defaults_instruction_file_is_relative_to_defaults_toml(tmp_path: Path) -> None:
    # The same defaults go under every pod: against each pod's pwd the name meant nothing.
    write('[worker]\ninstruction_file = "prompts/common.md"\n', "cfg/defaults.toml")
    text = MINIMAL.replace('name = "reviewer"', 'name = "reviewer"\npwd = "proj"')
    m = load_manifest(write(text, "pods/m.toml"), (), Path("cfg/defaults.toml"))
    assert m.worker.instruction_file == str(tmp_path / "cfg/prompts/common.md")
    assert m.instruction_source == "cfg/defaults.toml"
    # The manifest's own, and a --set one, stay relative to the pod's pwd.
    own = text + '[worker]\ninstruction_file = "p.md"\n'
    m = load_manifest(write(own, "pods/m.toml"), (), Path("cfg/defaults.toml"))
    assert m.worker.instruction_file == str(tmp_path / "pods/proj/p.md")
    m = load_manifest("pods/m.toml", ["worker.instruction_file=q.md"], Path("cfg/defaults.toml"))
    assert m.worker.instruction_file == str(tmp_path / "pods/proj/q.md")
    write('[worker]\ninstruction_file = "/abs/common.md"\n', "cfg/defaults.toml")
    m = load_manifest(write(text, "pods/m.toml"), (), Path("cfg/defaults.toml"))
    assert m.worker.instruction_file == "/abs/common.md"


def test_set_wins_over_defaults_and_replaces_the_other_instruction_form() -> None:
    write('[worker]\nmax_turns = 3\ninstruction_file = "x.md"\n', "defaults.toml")
    m = load_manifest(
        write(MINIMAL), ["worker.max_turns=4", "worker.instruction=hi"], Path("defaults.toml")
    )
    assert m.worker.max_turns == 4
    assert (m.worker.instruction, m.worker.instruction_file) == ("hi", None)


def test_set_value_with_equals_signs_and_empty_value() -> None:
    m = load_manifest(write(MINIMAL), ["worker.instruction=a=b", "provider.base_url="])
    assert m.worker.instruction == "a=b"
    assert m.provider.base_url is None  # empty is unset: the provider's own endpoint


def test_an_empty_base_url_is_the_providers_own_endpoint() -> None:
    # defaults.toml points every pod at a local server; `--set provider.base_url=` (or "" in
    # the manifest) gives one pod the real API back, not a URL of "" that every call fails on.
    defaults = '[provider]\nbase_url = "http://127.0.0.1:8400"\n'
    write(defaults, "defaults.toml")
    m = load_manifest(write(MINIMAL), ["provider.base_url="], Path("defaults.toml"))
    assert m.provider.base_url is None
    empty = MINIMAL.replace('model = "claude-sonnet-4-5"', 'model = "m"\nbase_url = ""')
    assert load_manifest(write(empty), (), Path("defaults.toml")).provider.base_url is None
    assert "\nbase_url = " not in manifest_to_toml(load_manifest(write(empty), (), Path("none")))


@pytest.mark.parametrize("bad", ["novalue", "=3", "worker..x=1", "worker.max tokens=1"])
def test_set_bad_form_names_the_override(bad: str) -> None:
    assert error_of(MINIMAL, bad) == f"m.toml: --set {bad}: expected section.key=value"


def test_set_through_a_scalar_or_past_an_array() -> None:
    assert error_of(MINIMAL, "pod.name.first=x") == (
        "m.toml: --set pod.name.first=x: pod.name is not a table"
    )
    assert error_of(MINIMAL, "scope.allow.5.target=x") == (
        "m.toml: --set scope.allow.5.target=x: scope.allow has no [5]"
    )


def test_set_with_a_wrong_type_names_the_override() -> None:
    assert error_of(MINIMAL, "worker.max_tokens=abc") == (
        "m.toml: worker.max_tokens: expected int, got str (--set worker.max_tokens=abc)"
    )
    assert unhinted(error_of(MINIMAL, "worker.bogus=1")) == (
        "m.toml: worker.bogus: unknown key (--set worker.bogus=1)"
    )
    # A table the override made up (nothing in the manifest has it) is named with it too.
    assert unhinted(error_of(MINIMAL, "a.b.c=1")) == "m.toml: a: unknown key (--set a.b.c=1)"
    assert unhinted(error_of(MINIMAL, "worker.tool_output.x.y=1")) == (
        "m.toml: worker.tool_output.x: unknown key (--set worker.tool_output.x.y=1)"
    )


# --- paths -----------------------------------------------------------------------------------


def test_paths_resolve_from_the_manifest_then_from_pwd(tmp_path: Path) -> None:
    text = MINIMAL.replace('name = "reviewer"', 'name = "reviewer"\npwd = "../proj"') + (
        '[[scope.allow]]\ntarget = "/etc/../usr"\npermission = "read"\n'
        '[[scope.deny]]\ntarget = "sub/./x/"\npermission = "write"\n'
        '[worker]\ninstruction_file = "prompts/p.md"\n'
    )
    m = load_manifest(write(text, "conf/m.toml"))
    proj = str(tmp_path / "proj")
    assert m.source == str(tmp_path / "conf/m.toml")
    assert m.pod.pwd == proj
    assert [r.target for r in m.scope.allow] == [proj, "/usr"]
    assert m.scope.deny[0].target == f"{proj}/sub/x"
    assert m.worker.instruction_file == f"{proj}/prompts/p.md"


def test_paths_are_not_resolved_through_symlinks(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    m = load_manifest(write(MINIMAL.replace('target = "."', 'target = "link"')))
    assert m.scope.allow[0].target == str(tmp_path / "link")


def test_dotdot_after_a_symlink_leaves_the_symlinks_target(tmp_path: Path) -> None:
    # `link/..` is the parent of where `link` points, for the kernel and for `cat`: a manifest
    # reached that way is read from there, so its relative paths start there too (SPEC §3), and
    # a target written so means that place (SPEC §4: resolved, symlinks and `..`).
    (tmp_path / "far/deep").mkdir(parents=True)
    (tmp_path / "near").mkdir()
    (tmp_path / "near/link").symlink_to(tmp_path / "far/deep")
    write(MINIMAL.replace('name = "reviewer"', 'name = "reviewer"\npwd = "ws"'), "far/m.toml")
    write(MINIMAL.replace('target = "."', 'target = "link/../x"'), "near/m.toml")
    far = load_manifest("near/link/../m.toml")
    assert (far.source, far.pod.pwd) == (str(tmp_path / "far/m.toml"), str(tmp_path / "far/ws"))
    near = load_manifest("near/m.toml")
    assert near.scope.allow[0].target == str(tmp_path / "far/x")


def test_home_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    m = load_manifest(write(MINIMAL.replace('target = "."', 'target = "~/notes"')))
    assert m.scope.allow[0].target == str(tmp_path / "home/notes")


# --- error messages --------------------------------------------------------------------------


def test_unknown_key_in_a_section() -> None:
    text = "[worker]\nmax_tokens = 5\nbogus = 1\n" + MINIMAL
    assert unhinted(error_of(text)) == "m.toml:3: worker.bogus: unknown key"


def test_an_unknown_key_says_what_was_meant_or_what_the_table_takes() -> None:
    """A misspelt key, or one guessed from another tool (`path` for `target`), was only
    "unknown key": the user had to find SPEC §3 to learn the table's keys."""
    text = MINIMAL + '[[scope.allow]]\ntarget = "a"\npermision = "read"\n'
    said = "scope.allow[1].permision: unknown key (did you mean 'permission'?)"
    assert error_of(text).endswith(said)
    text = MINIMAL + '[[scope.allow]]\npath = "a"\n'
    assert error_of(text).endswith(
        "scope.allow[1].path: unknown key (expected one of: target, permission, recursive)"
    )
    assert error_of(MINIMAL, "provider.modle=x") == (
        "m.toml: provider.modle: unknown key (did you mean 'model'?) (--set provider.modle=x)"
    )
    assert error_of("[pod]\nname = 'p'\nfoo = 1\n" + MINIMAL.split("\n", 2)[2]) == (
        "m.toml:3: pod.foo: unknown key (expected one of: name, pwd)"
    )
    # The manifest's own tables; never the fields the loader sets (`source`).
    assert error_of("[extras]\n" + MINIMAL).endswith(
        "extras: unknown key (expected one of: pod, provider, worker, scope, compaction, "
        "budget, notify, spawn, sandbox, mcp, hooks)"
    )
    assert error_of(MINIMAL + "[compaction]\nthreshhold = 0.5\n").endswith(
        "compaction.threshhold: unknown key (did you mean 'compact_threshold'?)"  # optional table
    )
    mcp = MINIMAL + '[[mcp.servers]]\nname = "s"\ncomand = ["x"]\n'
    assert error_of(mcp).endswith("mcp.servers[0].comand: unknown key (did you mean 'command'?)")


def test_unknown_top_level_key_and_table() -> None:
    assert unhinted(error_of("color = 1\n" + MINIMAL)) == "m.toml:1: color: unknown key"
    assert unhinted(error_of(MINIMAL + "\n[extras]\nx = 1\n")) == "m.toml:12: extras: unknown key"
    # `source` is a Manifest field, but never one a file may set
    assert error_of('source = "x"\n' + MINIMAL) == "m.toml:1: source: unknown key"
    assert error_of(MINIMAL, "source=x") == "m.toml: source: unknown key (--set source=x)"


def test_unknown_key_in_a_nested_table() -> None:
    text = MINIMAL + "[compaction]\n[compaction.provider]\nkind = 'openai'\nmodel = 'x'\nfoo = 1\n"
    assert unhinted(error_of(text)) == "m.toml:15: compaction.provider.foo: unknown key"


def test_unknown_key_in_an_array_of_tables_entry() -> None:
    text = MINIMAL + '[[scope.allow]]\ntarget = "a"\npermision = "read"\n'
    assert unhinted(error_of(text)) == "m.toml:13: scope.allow[1].permision: unknown key"


def test_dotted_keys_are_found_too() -> None:
    text = "worker.tool_output.max_bytes = 3\n" + MINIMAL
    assert unhinted(error_of(text)) == "m.toml:1: worker.tool_output.max_bytes: unknown key"
    # after [[scope.allow]] the same line belongs to the array's item
    assert unhinted(error_of(MINIMAL + "worker.x = 3\n")) == (
        "m.toml:11: scope.allow[0].worker: unknown key"
    )


def test_quoted_keys_with_escapes_are_found_on_their_own_line() -> None:
    text = '[worker]\nmax_tokens = 5\n"caf\\u00e9" = 1\n' + MINIMAL
    assert unhinted(error_of(text)) == "m.toml:3: worker.café: unknown key"
    text = '[worker]\nmax_tokens = 5\n[worker.tool_output."a\\tb"]\nx = 1\n' + MINIMAL
    assert unhinted(error_of(text)) == "m.toml:3: worker.tool_output.a\tb: unknown key"


def test_keys_inside_multiline_strings_are_not_mistaken_for_keys() -> None:
    text = '[worker]\ninstruction = """\nbogus = 1\n"""\nbogus = 2\n' + MINIMAL
    assert unhinted(error_of(text)) == "m.toml:5: worker.bogus: unknown key"


def test_wrong_types() -> None:
    text = '[pod]\nname = "x"\n\n[worker]\nmax_tokens = "4096"\n' + MINIMAL.split("\n", 3)[3]
    assert error_of(text) == "m.toml:5: worker.max_tokens: expected int, got str"
    assert error_of("pod = 3\n" + MINIMAL.split("\n", 3)[3]) == (
        "m.toml:1: pod: expected table, got int"
    )
    assert error_of(MINIMAL + "[worker]\ntemperature = 'hot'\n") == (
        "m.toml:12: worker.temperature: expected float, got str"
    )
    assert error_of(MINIMAL + "[worker]\ntools = 'bash'\n") == (
        "m.toml:12: worker.tools: expected array, got str"
    )
    assert error_of(MINIMAL.replace('"write"', '"write"\nrecursive = "yes"')) == (
        "m.toml:11: scope.allow[0].recursive: expected bool, got str"
    )


def test_out_of_range_values() -> None:
    assert error_of(MINIMAL + "[worker]\nmax_tokens = 0\n") == (
        "m.toml:12: worker.max_tokens: expected int >= 1, got 0"
    )
    assert error_of(MINIMAL + "[worker]\ntemperature = 3\n") == (
        "m.toml:12: worker.temperature: expected float <= 2.0, got 3"
    )
    assert error_of(MINIMAL + "[notify]\nmax_pending = -1\n") == (
        "m.toml:12: notify.max_pending: expected int >= 1, got -1"
    )
    assert error_of(MINIMAL + "[worker.tool_output]\nper_tool = { bash = 0 }\n") == (
        "m.toml:12: worker.tool_output.per_tool.bash: expected int >= 1, got 0"
    )


def test_a_nul_in_a_path_or_command_names_the_field() -> None:
    # TOML's \u0000 makes a string no system call takes: it was a ValueError traceback at
    # start-up (pwd, scope targets, instruction_file) or at the first tool call (hooks).
    assert error_of(
        MINIMAL.replace('name = "reviewer"', 'name = "reviewer"\npwd = "a\\u0000b"')
    ) == ("m.toml:3: pod.pwd: 'a\\x00b' contains a NUL character")
    assert error_of(MINIMAL.replace('target = "."', 'target = "./x\\u0000"')) == (
        "m.toml:9: scope.allow[0].target: './x\\x00' contains a NUL character"
    )
    assert error_of(MINIMAL + '[worker]\ninstruction_file = "p\\u0000.md"\n') == (
        "m.toml:12: worker.instruction_file: 'p\\x00.md' contains a NUL character"
    )
    assert error_of(MINIMAL + '[[hooks.Stop]]\ncommand = "./g.sh\\u0000"\n') == (
        "m.toml:12: hooks.Stop[0].command: './g.sh\\x00' contains a NUL character"
    )
    assert error_of(MINIMAL, 'pod.pwd="\\u0000"') == (
        "m.toml: pod.pwd: '\\x00' contains a NUL character (--set pod.pwd=\"\\u0000\")"
    )


def test_a_matcher_on_an_event_without_a_tool_is_refused() -> None:
    # It was read as "every time": Claude Code's SessionStart hook with matcher "compact"
    # (after a compaction only) ran at every start of the pod.
    hook = '[[hooks.SessionStart]]\ncommand = "true"\nmatcher = "compact"\n'
    assert error_of(MINIMAL + hook) == (
        "m.toml:13: hooks.SessionStart[0].matcher: only PreToolUse and PostToolUse hooks take "
        "a matcher (a tool name)"
    )
    for fine in ('matcher = "*"\n', 'matcher = ""\n', ""):
        manifest = load_manifest(write(MINIMAL + '[[hooks.Stop]]\ncommand = "true"\n' + fine))
        assert len(manifest.hooks.Stop) == 1


def test_a_matcher_naming_no_tool_is_refused() -> None:
    # Claude Code's "Bash" (this pod's tool is "bash") matched nothing: the guard never ran.
    hook = '[[hooks.PreToolUse]]\ncommand = "true"\nmatcher = "write_file|Bash"\n'
    assert error_of(MINIMAL + hook).startswith(
        "m.toml:13: hooks.PreToolUse[0].matcher: no tool is named 'Bash' (known: bash, "
    )
    # Claude Code's name for an MCP tool passed as one of ours (it has a "__"): never matched.
    hook = '[[hooks.PostToolUse]]\ncommand = "true"\nmatcher = "bash|mcp__github__get_file"\n'
    assert error_of(MINIMAL + hook) == (
        "m.toml:13: hooks.PostToolUse[0].matcher: no tool is named 'mcp__github__get_file': "
        "MCP tools are <server>__<tool> here, without Claude Code's mcp__ prefix "
        "('github__get_file')"
    )
    for fine in ("write_file|bash", "github__create_issue", "mcp__create", "^list", "Bash.*"):
        hook = f'[[hooks.PreToolUse]]\ncommand = "true"\nmatcher = "{fine}"\n'
        assert load_manifest(write(MINIMAL + hook)).hooks.PreToolUse[0].matcher == fine


def test_hook_and_mcp_timeouts_are_finite() -> None:
    # `timeout = inf` (meant as "never") or 1e300 raised OverflowError in the event loop's
    # timers: a traceback ending start-up (a SessionStart hook, an MCP server).
    assert error_of(MINIMAL + '[[hooks.PreToolUse]]\ncommand = "true"\ntimeout = inf\n') == (
        "m.toml:13: hooks.PreToolUse[0].timeout: expected float <= 604800.0, got inf"
    )
    server = '[[mcp.servers]]\nname = "s"\ncommand = ["s"]\n'
    assert error_of(MINIMAL + server + "start_timeout = 1e300\n") == (
        "m.toml:14: mcp.servers[0].start_timeout: expected float <= 604800.0, got 1e+300"
    )
    assert error_of(MINIMAL + server + "timeout = inf\n") == (
        "m.toml:14: mcp.servers[0].timeout: expected float <= 604800.0, got inf"
    )


def test_missing_required_fields() -> None:
    assert error_of(MINIMAL.replace('name = "reviewer"\n', "")) == (
        "m.toml: pod.name: required field is missing"
    )
    assert error_of(MINIMAL.replace('[pod]\nname = "reviewer"\n', "")) == (
        "m.toml: pod: required field is missing"
    )
    assert error_of(MINIMAL.replace('model = "claude-sonnet-4-5"\n', "")) == (
        "m.toml: provider.model: required field is missing"
    )
    assert error_of(MINIMAL.split("[[scope.allow]]")[0]) == (
        "m.toml: scope.allow: at least one [[scope.allow]] rule is required"
    )


def test_bad_pod_name() -> None:
    assert error_of(MINIMAL.replace('"reviewer"', '"Bad Name"')) == (
        "m.toml:2: pod.name: 'Bad Name' is not a valid pod name "
        "(lowercase letters, digits, '-' and '_', at most 48 characters)"
    )
    assert "not a valid pod name" in error_of(MINIMAL.replace("reviewer", "x" * 49))
    assert "not a valid pod name" in error_of(MINIMAL.replace('"reviewer"', '"ab\\n"'))


def test_bad_enum_values() -> None:
    assert error_of(MINIMAL.replace('"anthropic"', '"claude"')) == (
        "m.toml:5: provider.kind: invalid value 'claude' "
        "(expected one of 'anthropic', 'openai', 'openai_responses')"
    )
    assert error_of(MINIMAL.replace('"write"', '"rw"')) == (
        "m.toml:10: scope.allow[0].permission: invalid value 'rw' (expected one of 'read', 'write')"
    )
    assert error_of(MINIMAL + "[spawn]\non_parent_exit = 'kill'\n") == (
        "m.toml:12: spawn.on_parent_exit: invalid value 'kill' (expected one of 'stop', 'detach')"
    )


def test_unknown_tools() -> None:
    assert error_of(MINIMAL + '[worker]\ntools = ["bash", "rm"]\n') == (
        f"m.toml:12: worker.tools[1]: unknown tool 'rm' (known: {', '.join(sorted(KNOWN_TOOLS))})"
    )
    assert error_of(MINIMAL + '[worker]\ntools = ["bash", "bash"]\n') == (
        "m.toml:12: worker.tools[1]: tool 'bash' is listed twice"
    )
    assert error_of(MINIMAL + "[worker.tool_output]\nper_tool = { rm = 5 }\n") == (
        "m.toml:12: worker.tool_output.per_tool.rm: unknown tool 'rm'"
    )


def test_instruction_and_instruction_file_are_exclusive() -> None:
    text = MINIMAL + '[worker]\ninstruction = "a"\ninstruction_file = "b.md"\n'
    assert error_of(text) == (
        "m.toml:13: worker.instruction_file: "
        "instruction and instruction_file are exclusive; set only one"
    )


def test_toml_syntax_error() -> None:
    text = MINIMAL.replace("[[scope.allow]]", "[worker]\nmax_tokens = = 3\n[[scope.allow]]")
    with pytest.raises(tomllib.TOMLDecodeError) as parsed:
        tomllib.loads(text)
    assert "(at line 9," in str(parsed.value)
    assert error_of(text) == f"m.toml:9: invalid TOML: {parsed.value}"


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"^m\.toml: manifest not found$"):
        load_manifest("m.toml")
    (tmp_path / "d.toml").mkdir()
    with pytest.raises(ManifestError, match=r"^d\.toml: cannot read: "):
        load_manifest("d.toml")
    # Path("") is ".": an empty path said ": cannot read: Is a directory"
    with pytest.raises(ManifestError, match=r"^the manifest's path is empty$"):
        load_manifest("")
    (tmp_path / "b.toml").write_bytes(b"[pod]\nname = '\xff'\n")
    with pytest.raises(ManifestError, match=r"^b\.toml: invalid TOML: not UTF-8"):
        load_manifest("b.toml")


def test_a_utf8_byte_order_mark_is_ignored(tmp_path: Path) -> None:
    # What an editor saving "UTF-8 with BOM" writes; tomllib refuses U+FEFF as a statement.
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + MINIMAL.encode())
    assert same(load_manifest("bom.toml"), load_manifest(write(MINIMAL)))
    # Only at the start: elsewhere it is a character like any other, and line numbers hold.
    (tmp_path / "mid.toml").write_bytes(MINIMAL.encode() + b"\xef\xbb\xbfx = 1\n")
    with pytest.raises(ManifestError, match=r"^mid\.toml:11: invalid TOML: "):
        load_manifest("mid.toml")


def test_only_a_regular_file_of_bounded_size_is_read(tmp_path: Path) -> None:
    # A device would be read forever (`/dev/zero`: all memory) and a wrong path to a log
    # would be parsed whole: each is one clear line instead.
    with pytest.raises(ManifestError, match=r"^/dev/null: cannot read: not a regular file$"):
        load_manifest("/dev/null")
    (tmp_path / "big.toml").write_text(MINIMAL + ("#" * 1023 + "\n") * (4 * 1024 + 1))
    with pytest.raises(ManifestError, match=r"^big\.toml: cannot read: larger than 4 MiB$"):
        load_manifest("big.toml")
    with pytest.raises(ManifestError, match=r"^/dev/null: cannot read: not a regular file$"):
        load_manifest(write(MINIMAL), defaults_path="/dev/null")


def test_a_pipe_is_read_as_cat_would(tmp_path: Path) -> None:
    # `poddaemon run <(envsubst < m.toml)`: a FIFO with a writer is a manifest like any other.
    import threading

    os.mkfifo("fifo.toml")

    def feed() -> None:
        with open("fifo.toml", "w") as f:
            f.write(MINIMAL)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        m = load_manifest("fifo.toml", defaults_path="none.toml")
    finally:
        writer.join(10)
    assert m.pod.name == "reviewer"


def test_the_file_is_named_as_given(tmp_path: Path) -> None:
    write(MINIMAL + "bogus = 1\n", "sub/m.toml")
    with pytest.raises(ManifestError, match=r"^sub/m\.toml:"):
        load_manifest("sub/m.toml")
    with pytest.raises(ManifestError, match=rf"^{tmp_path}/sub/m\.toml:"):
        load_manifest(tmp_path / "sub/m.toml")


def test_structs_are_keyword_only() -> None:
    classes: tuple[type[Any], ...] = (PodSection, ProviderConfig, WorkerConfig, ScopeRule, Manifest)
    for cls in classes:
        with pytest.raises(TypeError):
            cls("x")


def test_a_field_missing_from_defaults_provider_is_reported_against_the_manifest() -> None:
    text = MINIMAL.replace('[provider]\nkind = "anthropic"\nmodel = "claude-sonnet-4-5"\n', "")
    assert error_of(text, defaults='[provider]\nkind = "openai"\n') == (
        "m.toml: provider.model: required field is missing"
    )


def test_a_wrong_type_inside_per_tool_names_the_table() -> None:
    assert error_of(MINIMAL + "[worker.tool_output]\nper_tool = { bash = 'big' }\n") == (
        "m.toml:12: worker.tool_output.per_tool: expected int, got str"
    )


def test_api_key_env_must_be_a_variable_name() -> None:
    manifest = MINIMAL.replace(
        'model = "claude-sonnet-4-5"\n', 'model = "m"\napi_key_env = "MY KEY"\n'
    )
    assert error_of(manifest) == (
        "m.toml:7: provider.api_key_env: 'MY KEY' is no environment variable's name "
        "(letters, digits and _, not starting with a digit)"
    )
    for name in ("MY_KEY", "_k2", "key"):
        assert ProviderConfig(kind="openai", model="m", api_key_env=name).api_key_var == name


def test_structs_validate_when_built_in_code() -> None:
    with pytest.raises(FieldError, match="not a valid pod name"):
        PodSection(name="UP")
    with pytest.raises(FieldError, match="exclusive"):
        WorkerConfig(instruction="a", instruction_file="b")
    with pytest.raises(FieldError, match=r"scope\.allow"):
        Manifest(pod=PodSection(name="a"), provider=ProviderConfig(kind="openai", model="m"))


# --- the TOML writer, property-tested --------------------------------------------------------

_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
_segment = st.text(string.ascii_letters + string.digits + " _-.é\"'\\", min_size=1, max_size=8)
_abs_path = st.lists(_segment, min_size=0, max_size=4).map(
    lambda parts: os.path.abspath("/" + "/".join(parts))
)
_provider = st.builds(
    ProviderConfig,
    kind=st.sampled_from(["anthropic", "openai", "openai_responses"]),
    model=_text.filter(bool),
    base_url=st.none() | _text,
    max_retries=st.integers(0, 10),
    connect_timeout=st.floats(0.001, 1e6),
)
_rule = st.builds(
    ScopeRule,
    target=_abs_path,
    permission=st.sampled_from(["read", "write"]),
    recursive=st.booleans(),
)
_worker = st.builds(
    WorkerConfig,
    instruction=st.none() | _text,
    max_tokens=st.integers(1, 2**40),
    temperature=st.none() | st.floats(0, 2),
    tools=st.lists(st.sampled_from(sorted(KNOWN_TOOLS)), unique=True),
    tool_output=st.builds(
        ToolOutputConfig,
        per_tool=st.dictionaries(st.sampled_from(sorted(KNOWN_TOOLS)), st.integers(1, 10**9)),
    ),
)
_manifest = st.builds(
    Manifest,
    pod=st.builds(PodSection, name=st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,47}\Z"), pwd=_abs_path),
    provider=_provider,
    worker=_worker,
    scope=st.builds(
        ScopeSection,
        allow=st.lists(_rule, min_size=1, max_size=3),
        deny=st.lists(_rule, max_size=2),
    ),
    compaction=st.none() | st.builds(CompactionConfig, provider=st.none() | _provider),
)


# tmp_path is shared between examples on purpose: each overwrites the same file.
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_manifest)
def test_to_toml_round_trips(tmp_path: Path, m: Manifest) -> None:
    path = tmp_path / "rt.toml"
    path.write_text(manifest_to_toml(m), encoding="utf-8")
    assert same(load_manifest(path, defaults_path=tmp_path / "none.toml"), m)


@pytest.mark.parametrize(
    ("command", "script"),
    [
        ("./hooks/guard.sh", "./hooks/guard.sh"),
        ("  ./hooks/guard.sh --strict x", "./hooks/guard.sh"),
        ("/opt/hooks/g.sh", "/opt/hooks/g.sh"),
        ("~/hooks/g.sh", "~/hooks/g.sh"),
        ("echo hi", None),  # not a path
        ("python3 hooks/g.py", "hooks/g.py"),  # run by an interpreter
        ("bash ./guard.sh --strict", "./guard.sh"),
        ("python3.11 '/my proj/g.py'", "/my proj/g.py"),
        ("sh -c ./g.sh", None),  # code, not a script: left to the shell
        ("python3 -u hooks/g.py x", "hooks/g.py"),  # options before the script
        ("bash -e --norc ./g.sh", "./g.sh"),
        ("python3 -m hooks/g", None),  # a module
        ("python3 -Bc 'print(1/2)'", None),
        ("node --eval 'a/b'", None),
        ("perl -w -e 'print 1/2'", None),
        ("python3 -W ignore hooks/g.py", None),  # an option's value first: left to the shell
        ("/usr/bin/python3 -u /h/g.py", "/h/g.py"),  # an interpreter named by its path
        ("/opt/py/bin/python3 -c 'print(1/2)'", "/opt/py/bin/python3"),  # no script: itself
        ("/opt/xbash ./g.sh", "/opt/xbash"),  # no interpreter we know: the program itself
        ("./venv/bin/python g.py", "./venv/bin/python"),  # relative: itself, as before
        ("bash", None),
        ("echo ./not/run", None),  # no interpreter
        ("FOO=1 ./g.sh", None),  # an assignment first
        ('"./a b.sh"', None),  # double-quoted: left to the shell
        ("'/my proj/g.sh' --x", "/my proj/g.sh"),  # as a resolved manifest writes it
        ("'./a b.sh'", "./a b.sh"),
        ("'~/g.sh'", None),  # no tilde expansion inside quotes: a file named ~
        ("./g.sh;rm x", None),  # an operator inside the word
        ("hooks/g.sh|cat", None),
    ],
)
def test_a_hook_script_is_the_first_word_when_it_is_a_plain_path(
    command: str, script: str | None
) -> None:
    from poddaemon.config.manifest import HookConfig

    assert HookConfig(command=command).script() == script
    if command.startswith("/usr/bin/python3 "):  # granted and checked with its script
        found = HookConfig(command=command).script_word()
        assert found is not None and found.interpreter == "/usr/bin/python3"


@pytest.mark.parametrize(
    ("command", "script"),
    [
        (["python3", "/srv/mcp.py", "ok"], "/srv/mcp.py"),
        (["/usr/bin/python3.11", "-u", "-B", "mcp.py"], "mcp.py"),  # relative to its cwd
        (["node", "--", "build/index.js"], "build/index.js"),
        (["bash", "-e", "./srv.sh"], "./srv.sh"),
        (["python3", "-m", "srvmod"], None),  # a module
        (["python3", "-Bc", "import srv"], None),
        (["sh", "-c", "exec python3 real.py"], None),  # code
        (["node", "--eval", "require('x')"], None),
        (["/srv/mcp.py", "ok"], None),  # no interpreter: the program itself
        (["python3"], None),
    ],
)
def test_the_script_an_mcp_servers_interpreter_runs(command: list[str], script: str | None) -> None:
    from poddaemon.config.manifest import argv_script

    assert argv_script(command) == script


@pytest.mark.parametrize(
    ("command", "loads"),
    [
        (["python3", "-m", "srvmod", "ok"], True),  # the cwd first on sys.path
        (["/usr/bin/python3.11", "-u", "-Bc", "import srv"], True),
        (["python3", "-P", "-m", "srvmod"], False),  # not with -P or -I
        (["python3", "-Im", "srvmod"], False),
        (["sh", "-c", "exec python3 real.py ok"], True),
        (["bash", "-ec", "./run"], True),
        (["node", "--eval", "require('./x')"], True),
        (["npx", "-y", "@modelcontextprotocol/server-github"], True),
        (["uvx", "mcp-server-fetch"], True),
        (["python3", "-u", "real.py", "ok"], False),  # a script: checked as a file
        (["node", "build/index.js"], False),
        (["/opt/srv/mcp", "-c", "x"], False),  # no interpreter we know
        (["python3"], False),
    ],
)
def test_which_mcp_server_commands_load_code_from_their_cwd(
    command: list[str], loads: bool
) -> None:
    from poddaemon.config.manifest import loads_from_cwd

    assert loads_from_cwd(command) is loads


def test_an_mcp_server_script_others_may_change_is_refused_behind_an_interpreter(
    tmp_path: Path,
) -> None:
    """Found by QA: `command = ["/x/ww.py"]` was refused for a world-writable ww.py, but
    `["python3", "/x/ww.py"]` ran it as you, outside any sandbox (a hook `python3 /x/ww.py`
    was refused)."""
    from poddaemon.config.load import files_problem

    script = tmp_path / "ww.py"
    script.write_text("print()\n")
    script.chmod(0o757)
    for command in ([str(script)], ["python3", "-u", str(script)], ["python3", "ww.py"]):
        server = f'[[mcp.servers]]\nname = "s"\ncommand = {json.dumps(command)}\n'
        m = load_manifest(
            write(MINIMAL.replace("[pod]\n", f'[pod]\npwd = "{tmp_path}"\n') + server)
        )
        problem = files_problem(m)
        assert problem is not None and f"{script} is writable by group or others" in problem
    script.chmod(0o755)
    assert files_problem(m) is None


def test_hook_scripts_are_made_absolute_against_pwd(tmp_path: Path) -> None:
    hooks = (
        '[[hooks.PreToolUse]]\ncommand = "./hooks/guard.sh --strict"\n'
        '[[hooks.Stop]]\ncommand = "echo ./not/a/script"\n'
        '[[hooks.Stop]]\ncommand = "/abs/stop.sh"\n'
        '[[hooks.Stop]]\ncommand = "bash hooks/stop.sh > log/out"\n'
    )
    m = load_manifest(write(MINIMAL.replace("[pod]\n", '[pod]\npwd = "ws"\n', 1) + hooks))
    assert m.hooks.PreToolUse[0].command == f"{tmp_path}/ws/hooks/guard.sh --strict"
    assert [h.command for h in m.hooks.Stop] == [
        "echo ./not/a/script",
        "/abs/stop.sh",
        f"bash {tmp_path}/ws/hooks/stop.sh > log/out",  # the script only: the rest is the shell's
    ]
    # The kept (resolved) configuration loads to the same commands: a child gets them so.
    again = load_manifest(write(manifest_to_toml(m), "kept/m.toml"))
    assert again.hooks == m.hooks


def test_a_hook_script_under_a_pwd_with_a_space_stays_a_script(tmp_path: Path) -> None:
    # The resolved command quotes the path; it must still be seen as the script (the pod
    # checks it at start-up and the sandbox grants it), in the kept configuration too.
    hooks = '[[hooks.PreToolUse]]\ncommand = "./hooks/guard.sh --strict"\n'
    m = load_manifest(write(MINIMAL.replace("[pod]\n", '[pod]\npwd = "my ws"\n', 1) + hooks))
    (hook,) = m.hooks.PreToolUse
    assert hook.command == f"'{tmp_path}/my ws/hooks/guard.sh' --strict"
    assert hook.script() == f"{tmp_path}/my ws/hooks/guard.sh"
    again = load_manifest(write(manifest_to_toml(m), "kept/m.toml"))
    assert again.hooks == m.hooks and again.hooks.PreToolUse[0].script() == hook.script()
    quoted = "[[hooks.Stop]]\ncommand = \"'./my hooks/s.sh' x\"\n"
    m = load_manifest(write(MINIMAL + quoted))
    assert m.hooks.Stop[0].command == f"'{tmp_path}/my hooks/s.sh' x"


def test_values_that_are_not_utf8_are_refused_naming_the_field() -> None:
    """A `--set` value or a directory name that is not UTF-8 (Python holds its bytes as lone
    surrogates) was taken: the pod started, then died with a UnicodeEncodeError traceback
    writing its kept configuration or the registry, leaving a temp file behind."""
    latin1 = "caf" + os.fsdecode(b"\xe9")
    assert error_of(MINIMAL, f"worker.instruction={latin1}") == (
        "m.toml: worker.instruction: 'caf\\udce9' is not UTF-8 text (byte 0xe9)"
    )
    assert error_of(MINIMAL, f'provider.model="{latin1}"') == (
        "m.toml: provider.model: 'caf\\udce9' is not UTF-8 text (byte 0xe9)"
    )
    os.mkdir(os.fsdecode(b"d\xe9"))
    manifest = write(MINIMAL, os.fsdecode(b"d\xe9/m.toml"))
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest, defaults_path=Path("none.toml"))
    assert str(info.value).startswith("d\udce9/m.toml: pod.pwd: '")
    assert str(info.value).endswith("/d\\udce9' is not UTF-8 text (byte 0xe9)")


@pytest.mark.parametrize(
    ("written", "rest"),
    [
        ('\\"$CLAUDE_PROJECT_DIR\\"/.claude/hooks/guard.sh --x', " --x"),
        ('\\"$CLAUDE_PROJECT_DIR/.claude/hooks/guard.sh\\"', ""),
        ("${CLAUDE_PROJECT_DIR}/.claude/hooks/guard.sh", ""),
        ('python3 \\"$CLAUDE_PROJECT_DIR\\"/.claude/hooks/guard.sh', ""),
    ],
)
def test_a_hook_script_named_through_claude_project_dir_is_a_script(
    tmp_path: Path, written: str, rest: str
) -> None:
    """Claude Code's documented `"$CLAUDE_PROJECT_DIR"/.claude/hooks/guard.sh`: the pod's
    pwd is the project. Left to the shell, the script was never checked at start-up (missing:
    exit 127 at each call, a warning, the guarded call went ahead) nor granted, and a child,
    whose pwd is another, ran `<its pwd>/.claude/hooks/guard.sh`: its spawner's guard lost."""
    hooks = f'[[hooks.PreToolUse]]\ncommand = "{written}"\n'
    m = load_manifest(write(MINIMAL.replace("[pod]\n", '[pod]\npwd = "ws"\n', 1) + hooks))
    (hook,) = m.hooks.PreToolUse
    assert hook.script() == f"{tmp_path}/ws/.claude/hooks/guard.sh"
    assert hook.command.endswith(f"{tmp_path}/ws/.claude/hooks/guard.sh{rest}")
