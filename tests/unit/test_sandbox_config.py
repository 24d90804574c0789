"""The [sandbox] manifest section (SPEC §3): defaults, and errors that name the field."""

from pathlib import Path

import pytest

from poddaemon.config import Manifest, ManifestError, load_manifest
from poddaemon.config.manifest import SandboxConfig

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


def load(tmp_path: Path, text: str) -> Manifest:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return load_manifest(path, defaults_path=tmp_path / "none.toml")


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ManifestError) as info:
        load(tmp_path, text)
    return str(info.value).replace(str(tmp_path / "m.toml"), "m.toml")


def test_defaults_enforce_with_network(tmp_path: Path) -> None:
    m = load(tmp_path, MINIMAL)
    assert m.sandbox == SandboxConfig(mode="enforce", network=True)


def test_values_and_round_trip(tmp_path: Path) -> None:
    m = load(tmp_path, MINIMAL + '[sandbox]\nmode = "best_effort"\nnetwork = false\n')
    assert m.sandbox == SandboxConfig(mode="best_effort", network=False)
    again = load(tmp_path, m.to_toml())
    assert again.sandbox == m.sandbox


def test_errors_name_the_field(tmp_path: Path) -> None:
    assert error_of(tmp_path, MINIMAL + '[sandbox]\nmode = "strict"\n') == (
        "m.toml:12: sandbox.mode: invalid value 'strict' "
        "(expected one of 'enforce', 'best_effort', 'off')"
    )
    assert error_of(tmp_path, MINIMAL + '[sandbox]\nnetwork = "no"\n') == (
        "m.toml:12: sandbox.network: expected bool, got str"
    )
    assert error_of(tmp_path, MINIMAL + "[sandbox]\nnet = false\n") == (
        "m.toml:12: sandbox.net: unknown key (did you mean 'network'?)"
    )
