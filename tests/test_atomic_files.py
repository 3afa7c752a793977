"""atomic_files.atomic_write: all or nothing under the final name, with the mode open() would give."""

import os

import pytest

from atomic_files import atomic_write


def test_written_file_gets_the_mode_a_plain_open_would_give(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "manifest.parquet", lambda tmp: open(tmp, "wb").write(b"data"))
    finally:
        os.umask(umask)
    assert (tmp_path / "manifest.parquet").stat().st_mode & 0o777 == 0o644  # readable by teammates


def test_a_failing_write_leaves_neither_the_file_nor_its_temporary(tmp_path):
    def crash(tmp):
        open(tmp, "wb").write(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "out.json", crash)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_replaced_whole(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    atomic_write(target, lambda tmp: open(tmp, "w").write("new"))
    assert target.read_text() == "new" and list(tmp_path.iterdir()) == [target]
