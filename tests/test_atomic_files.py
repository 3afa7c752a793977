"""atomic_files: all or nothing under the final name (one file or a set), with the mode open() would give."""

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


# --- write_together ----------------------------------------------------------------------------
def _writer(text: str):
    return lambda tmp: Path(tmp).write_text(text)


def _old_set(tmp_path: Path) -> dict[Path, str]:
    files = {tmp_path / "train.parquet": "old train", tmp_path / "train.summary.json": "old sum"}
    for path, text in files.items():
        path.write_text(text)
    return files


def test_a_set_is_written_whole(tmp_path):
    _old_set(tmp_path)
    atomic_files.write_together(
        {
            tmp_path / "train.parquet": _writer("new train"),
            tmp_path / "train.summary.json": _writer("new sum"),
        },
        "run2",
    )
    assert (tmp_path / "train.parquet").read_text() == "new train"
    assert (tmp_path / "train.summary.json").read_text() == "new sum"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.parquet", "train.summary.json"]


def test_a_failure_writing_any_member_leaves_the_previous_set_and_no_temporary(tmp_path):
    old = _old_set(tmp_path)

    def full(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_files.write_together(
            {tmp_path / "train.parquet": _writer("new"), tmp_path / "train.summary.json": full},
            "run2",
        )
    assert {p: p.read_text() for p in tmp_path.iterdir()} == old


def test_a_crash_between_renames_leaves_the_set_without_its_seal_never_an_old_one(
    tmp_path, monkeypatch
):
    _old_set(tmp_path)
    replace, calls = os.replace, []

    def dies_after_the_first(src, dst):
        if calls:
            raise KeyboardInterrupt("SIGKILL")
        calls.append(dst)
        replace(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", dies_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        atomic_files.write_together(
            {
                tmp_path / "train.parquet": _writer("new train"),
                tmp_path / "train.summary.json": _writer("new sum"),
            },
            "run2",
        )
    assert (tmp_path / "train.parquet").read_text() == "new train"
    assert not (tmp_path / "train.summary.json").exists(), "an old summary would describe new rows"
    monkeypatch.undo()
    # the next run removes the killed run's temporaries and writes a whole set
    atomic_files.write_together(
        {
            tmp_path / "train.parquet": _writer("train 3"),
            tmp_path / "train.summary.json": _writer("sum 3"),
        },
        "run3",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.parquet", "train.summary.json"]
