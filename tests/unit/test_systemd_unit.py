"""The shipped unit file passes systemd's own verifier (with ExecStart pointed at our script)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "poddaemon@.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "poddaemon"
    assert script.exists(), "the poddaemon console script is installed next to python"
    text = UNIT.read_text().replace("%h/.local/bin/poddaemon", str(script))
    unit = tmp_path / "poddaemon@demo.service"
    unit.write_text(text)
    out = subprocess.run(
        ["systemd-analyze", "verify", "--recursive-errors=yes", "--man=no", "--user", str(unit)],
        env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Type=notify" in text and "poddaemon run %E/poddaemon/pods/%i.toml" in text
