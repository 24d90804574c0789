"""The commands' temp dir a killed pod left behind: removed by the next pod of its name, and
nothing else is (the record may name a path that changed hands since)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from poddaemon.sandbox.pod import _make_tmpdir, replace_leftover


def test_the_leftover_goes_and_the_new_dir_is_recorded(tmp_path: Path) -> None:
    old = tmp_path / "poddaemon-kid-abc"
    (old / "deep").mkdir(parents=True)
    (old / "deep" / "f").write_text("x")
    record = tmp_path / "tmpdir"
    record.write_text(f"{old}\n")
    replace_leftover(record, "kid", str(tmp_path / "poddaemon-kid-new"))
    assert not old.exists()
    assert record.read_text() == f"{tmp_path / 'poddaemon-kid-new'}\n"
    assert os.stat(record).st_mode & 0o777 == 0o600


def test_what_is_not_a_leftover_of_this_name_stays(tmp_path: Path) -> None:
    other = tmp_path / "poddaemon-kidney-abc"  # another pod's (its name starts alike)
    other.mkdir()
    mine = tmp_path / "poddaemon-kid-abc"
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    mine.symlink_to(elsewhere)  # a link put in its place: not followed
    record = tmp_path / "tmpdir"
    for named in (other, mine, tmp_path / "project"):
        record.write_text(f"{named}\n")
        replace_leftover(record, "kid", None)
        assert not record.exists()  # no temp dir now (no commands): nothing recorded
    assert other.is_dir() and elsewhere.is_dir() and mine.is_symlink()


def test_no_record_yet_is_fine(tmp_path: Path) -> None:
    record = tmp_path / "tmpdir"
    replace_leftover(record, "kid", None)
    replace_leftover(record, "kid", str(tmp_path / "poddaemon-kid-1"))
    assert record.read_text().strip() == str(tmp_path / "poddaemon-kid-1")


def test_the_new_dir_is_private_fresh_and_under_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    made = {_make_tmpdir("poddaemon-kid-") for _ in range(20)}
    assert len(made) == 20
    for path in made:
        assert os.path.dirname(path) == str(tmp_path)
        assert os.path.basename(path).startswith("poddaemon-kid-")
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 == 0o700
        assert st.st_uid == os.getuid()



@pytest.mark.parametrize("umask", [0o000, 0o277, 0o777])
def test_the_new_dir_is_0700_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask: int
) -> None:
    """Under umask 0277 the commands' temp dir came out 0500: a pod's bash could not make a
    file in its own $TMPDIR (`mktemp` failed) for any uid but root. SPEC §2: directories are
    created 0700 whatever the umask."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    old = os.umask(umask)
    try:
        path = _make_tmpdir("poddaemon-kid-")
    finally:
        os.umask(old)
    assert oct(os.lstat(path).st_mode & 0o777) == "0o700"

def test_the_pod_sandbox_module_imports_neither_tempfile_nor_shutil() -> None:
    """tempfile imports shutil, which imports bz2 and lzma: ~2 ms of every pod's start."""
    code = (
        "import sys\n"
        "from poddaemon.sandbox import pod\n"
        "print(sorted(m for m in ('tempfile', 'shutil', 'bz2', 'lzma') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
