"""atomic_files.atomic_write: all or nothing under the final name, with the mode open() would give."""

import os
from pathlib import Path

import pytest

import atomic_files
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


def test_remove_stale_temporaries_finds_what_a_killed_atomic_write_leaves(tmp_path, monkeypatch):
    target = tmp_path / "master.parquet"
    target.write_bytes(b"the previous file")
    monkeypatch.setattr(atomic_files.os, "unlink", lambda p: None)  # as if SIGKILLed mid-write

    def dies(tmp):
        Path(tmp).write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_files.atomic_write(target, dies)
    monkeypatch.undo()
    assert len(list(tmp_path.glob(".master.parquet.*"))) == 1
    assert atomic_files.remove_stale_temporaries(target) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["master.parquet"]
    assert target.read_bytes() == b"the previous file"
