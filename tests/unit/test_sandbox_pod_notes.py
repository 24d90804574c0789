"""`podctl status` notes of a pod's sandbox (poddaemon/sandbox/pod.py)."""

from pathlib import Path

import pytest

from poddaemon.sandbox import available
from poddaemon.sandbox.pod import pod_sandbox
from poddaemon.scope import Access, Rule, Scope


@pytest.mark.skipif(available() == 0, reason="this kernel has no Landlock")
def test_a_script_two_hooks_run_is_noted_once(tmp_path: Path) -> None:
    """The same script in two hooks (say PreToolUse and Stop) was named twice in `status`."""
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "hooks" / "log.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    scope = Scope(allow=(Rule(target=str(work), access=Access.WRITE),))
    box = pod_sandbox(
        name="p",
        mode="enforce",
        network=True,
        scope=scope,
        pwd=str(work),
        protect=[],
        commands=True,
        scripts=[str(script), str(script)],
    )
    assert [n for n in box.notes if "a hook script" in n] == [
        f"{script}: a hook script: commands may read and run it"
    ]
