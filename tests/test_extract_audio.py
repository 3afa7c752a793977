"""scripts/extract_audio.py: extraction, resumability, verification, tar deletion and tar safety."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from scripts import extract_audio as ea
from tests.shard_factory import flac_bytes, write_shard

REPO = Path(__file__).resolve().parents[1]


def shard_with_audio(root: Path, n: int = 3, name: str = "s0", **kwargs) -> Path:
    return write_shard(
        root / "shards",
        "src",
        "hi",
        name,
        [{"segment_id": f"u{i}", "duration_s": 0.5 + i * 0.25} for i in range(n)],
        audio=True,
        **kwargs,
    )


def extract(root: Path, **kwargs) -> dict:
    return ea.extract_all(root / "shards", workers=1, progress=False, **kwargs)


def add_members(shard: Path, *infos: tuple[tarfile.TarInfo, bytes | None]) -> None:
    """Append members (header, payload) to the shard's tar."""
    with tarfile.open(shard / "audio.tar", "a") as tar:
        for info, data in infos:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def tar_info(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", linkname: str = ""
) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, (data if kind == tarfile.REGTYPE else None)


# --- extraction ----------------------------------------------------------------------------------
def test_every_indexed_member_becomes_a_readable_flac_in_the_shard_dir(tmp_path):
    shard = shard_with_audio(tmp_path)
    summary = extract(tmp_path)
    assert summary["by_status"] == {"extracted": 1} and summary["files_extracted"] == 3
    for i in range(3):
        audio, rate = sf.read(shard / f"u{i}.flac")
        assert rate == 16000 and abs(len(audio) / rate - (0.5 + i * 0.25)) < 1e-3
        assert (shard / f"u{i}.flac").stat().st_mode & 0o777 == 0o644


def test_member_names_with_subdirectories_land_under_the_shard_dir(tmp_path):
    shard = write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [
            {"segment_id": "a", "tar_member_name": "clips/a.flac"},
            {"segment_id": "b", "tar_member_name": "./b.flac"},
        ],
        audio=True,
    )
    extract(tmp_path)
    assert (shard / "clips" / "a.flac").is_file() and (shard / "b.flac").is_file()


def test_members_missing_from_the_index_are_not_written(tmp_path):
    shard = shard_with_audio(tmp_path)
    add_members(shard, tar_info("stray.flac", data=flac_bytes(0.5)))
    summary = extract(tmp_path)
    assert not (shard / "stray.flac").exists() and summary["members_not_in_index"] == 1


def test_many_shards_extract_in_parallel_processes(tmp_path):
    shards = [shard_with_audio(tmp_path, n=2, name=f"s{i}") for i in range(4)]
    summary = ea.extract_all(tmp_path / "shards", workers=2, progress=False)
    assert summary["by_status"] == {"extracted": 4}
    assert all((s / "u1.flac").is_file() for s in shards)


def test_a_worker_killed_from_outside_is_one_line_and_the_done_shards_stay_done(
    tmp_path, monkeypatch
):
    """The system kills a worker (out of memory under a busy machine): the pool breaks. The run
    says so in one line with what to do, and the shard finished before keeps its marker."""
    from concurrent.futures.process import BrokenProcessPool

    shards = [shard_with_audio(tmp_path, n=2, name=f"s{i}") for i in range(3)]

    class DyingPool:
        """A pool whose second worker is killed: the first shard's report comes, then the break."""

        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, *iterables, chunksize=1):
            first = next(zip(*iterables))
            yield fn(*first)
            raise BrokenProcessPool("A process in the process pool was terminated abruptly")

    monkeypatch.setattr(ea, "ProcessPoolExecutor", DyingPool)
    with pytest.raises(ea.ExtractError) as died:
        ea.extract_all(tmp_path / "shards", workers=2, progress=False)
    message = str(died.value)
    assert "\n" not in message
    assert "worker process died after 1 of 3 shard(s)" in message and "rerun" in message
    assert (shards[0] / ea.DONE_MARKER).is_file()
    assert not (shards[1] / ea.DONE_MARKER).exists()
    summary = ea.extract_all(tmp_path / "shards", workers=1, progress=False)  # the rerun
    assert summary["by_status"] == {"extracted": 2, "skipped_done": 1}


# --- resumability --------------------------------------------------------------------------------
def test_a_rerun_skips_shards_already_done(tmp_path):
    shard = shard_with_audio(tmp_path)
    extract(tmp_path)
    before = (shard / "u0.flac").stat().st_mtime_ns
    summary = extract(tmp_path)
    assert summary["by_status"] == {"skipped_done": 1} and summary["files_extracted"] == 0
    assert (shard / "u0.flac").stat().st_mtime_ns == before


def test_a_write_interrupted_midway_leaves_no_file_under_the_real_name(tmp_path, monkeypatch):
    shard = shard_with_audio(tmp_path)

    def dies_midway(src, dst, length=0):
        dst.write(src.read(100))
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(ea.shutil, "copyfileobj", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        ea.extract_shard(shard)
    assert not (shard / "u0.flac").exists()
    assert not list(shard.glob(ea.TEMP_PREFIX + "*")) and not (shard / ea.DONE_MARKER).exists()


def test_temp_files_left_by_a_crash_are_removed_and_the_shard_completed(tmp_path):
    shard = shard_with_audio(tmp_path)
    (shard / f"{ea.TEMP_PREFIX}deadbeef").write_bytes(b"half a flac")
    summary = extract(tmp_path)
    assert summary["stale_temps_removed"] == 1 and summary["by_status"] == {"extracted": 1}
    assert not list(shard.glob(ea.TEMP_PREFIX + "*"))


def test_a_shard_without_a_marker_is_extracted_again_over_partial_output(tmp_path):
    shard = shard_with_audio(tmp_path)
    (shard / "u0.flac").write_bytes(b"truncated")
    extract(tmp_path)
    assert sf.info(shard / "u0.flac").frames > 0


# --- verification and tar deletion ----------------------------------------------------------------
def test_index_members_absent_from_the_tar_are_reported_and_the_shard_stays_unmarked(
    tmp_path, capsys
):
    shard = write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}], audio=True)
    pq.write_table(
        pa.table({"segment_id": ["a", "ghost"], "tar_member_name": ["a.flac", "ghost.flac"]}),
        shard / "audio_index.parquet",
    )  # the tar holds a.flac only
    code = ea.main(
        [
            "--shards-dir",
            str(tmp_path / "shards"),
            "--workers",
            "1",
            "--no-progress",
            "--delete-tars",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1 and "ghost.flac" in out and "UNVERIFIED" in out
    assert not (shard / ea.DONE_MARKER).exists()
    assert (shard / "audio.tar").exists(), "an unverified shard keeps its tar"
    summary = json.loads((tmp_path / "shards" / "extract_audio.summary.json").read_text())
    assert summary["members_missing"] == 1


def test_delete_tars_removes_a_tar_only_after_its_shard_verified(tmp_path):
    shard = shard_with_audio(tmp_path)
    summary = extract(tmp_path, delete_tars=True)
    assert summary["tars_deleted"] == 1 and not (shard / "audio.tar").exists()
    assert (shard / ea.DONE_MARKER).exists()


def test_delete_tars_on_a_done_shard_rechecks_the_files_first(tmp_path):
    shard = shard_with_audio(tmp_path)
    extract(tmp_path)
    (shard / "u1.flac").unlink()
    summary = extract(tmp_path, delete_tars=True)
    # The missing file is extracted again from the tar in the same run; only then is the tar deleted.
    assert summary["done_members_found_missing"] == 1 and summary["by_status"] == {"extracted": 1}
    assert (shard / "u1.flac").is_file() and not (shard / "audio.tar").exists()


def test_a_corrupt_tar_fails_only_its_shard(tmp_path):
    good = shard_with_audio(tmp_path, name="good")
    bad = shard_with_audio(tmp_path, name="bad")
    (bad / "audio.tar").write_bytes(b"not a tar at all" * 100)
    summary = extract(tmp_path)
    assert summary["by_status"] == {"extracted": 1, "failed": 1}
    assert (good / "u0.flac").is_file()


# --- security --------------------------------------------------------------------------------------
MALICIOUS = {
    "absolute path": lambda outside: tar_info(str(outside / "abs.flac"), data=b"x"),
    "'..' in path": lambda outside: tar_info("../../../outside/dotdot.flac", data=b"x"),
    "symlink": lambda outside: tar_info(
        "link.flac", tarfile.SYMTYPE, linkname=str(outside / "target")
    ),
    "hardlink": lambda outside: tar_info("hard.flac", tarfile.LNKTYPE, linkname="u0.flac"),
    "device node": lambda outside: tar_info("dev.flac", tarfile.CHRTYPE),
    "block device": lambda outside: tar_info("blk.flac", tarfile.BLKTYPE),
    "fifo": lambda outside: tar_info("fifo.flac", tarfile.FIFOTYPE),
}


@pytest.mark.parametrize("case", list(MALICIOUS))
def test_a_malicious_member_is_refused_and_reported_and_the_rest_extracted(tmp_path, case):
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = shard_with_audio(tmp_path)
    info, data = MALICIOUS[case](outside)
    add_members(shard, (info, data))
    summary = extract(tmp_path)
    problem = summary["problems"][0]
    assert problem["refused_count"] == 1 and problem["refused"][0]["member"] == info.name
    expected = {"block device": "device node"}.get(case, case)
    assert problem["refused"][0]["reason"] == expected
    assert list(outside.iterdir()) == []
    assert not (shard / Path(info.name).name).exists() or Path(info.name).name == "u0.flac"
    assert all((shard / f"u{i}.flac").is_file() for i in range(3))
    assert summary["by_status"] == {"extracted": 1}


def test_a_member_under_a_symlinked_directory_pointing_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [{"segment_id": "a", "tar_member_name": "sub/a.flac"}],
        audio=True,
    )
    (shard / "sub").symlink_to(outside, target_is_directory=True)
    summary = extract(tmp_path)
    assert summary["problems"][0]["refused"][0]["reason"] == "resolves outside the shard directory"
    assert list(outside.iterdir()) == []


def test_a_member_named_like_the_shards_own_files_is_refused(tmp_path):
    shard = shard_with_audio(tmp_path)
    original = (shard / "metadata.parquet").read_bytes()
    add_members(shard, tar_info("metadata.parquet", data=b"evil"))
    summary = extract(tmp_path)
    assert summary["problems"][0]["refused"][0]["reason"] == "would overwrite the shard's own file"
    assert (shard / "metadata.parquet").read_bytes() == original


def test_the_member_checks_need_no_extraction():
    assert ea.member_problem(tar_info("/etc/passwd", data=b"x")[0]) == "absolute path"
    assert ea.member_problem(tar_info("a/../../b", data=b"x")[0]) == "'..' in path"
    assert ea.member_problem(tar_info("ok/fine.flac", data=b"x")[0]) is None


# --- input and cli ---------------------------------------------------------------------------------
def test_a_missing_shards_dir_exits_non_zero(tmp_path, capsys):
    assert ea.main(["--shards-dir", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_tree_without_shards_exits_non_zero(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert ea.main(["--shards-dir", str(tmp_path / "empty")]) == 2
    assert "no shards found" in capsys.readouterr().err


def test_help_shows_a_usage_example():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "extract_audio.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert "example" in result.stdout and "--delete-tars" in result.stdout


def test_a_rerun_checks_done_shards_and_extracts_again_what_went_missing(tmp_path):
    shard = shard_with_audio(tmp_path)
    extract(tmp_path)
    (shard / "u0.flac").unlink()
    with open(shard / "u1.flac", "r+b") as fh:
        fh.truncate(10)
    summary = extract(tmp_path)
    assert summary["done_members_found_missing"] == 2
    assert summary["by_status"] == {"extracted": 1}
    assert (shard / "u0.flac").is_file() and (shard / "u1.flac").stat().st_size > 10
    assert extract(tmp_path)["by_status"] == {"skipped_done": 1}  # and now it is whole again


def test_a_shard_whose_path_is_not_utf8_is_named_by_its_bytes_and_left_whole(tmp_path, capsys):
    shard_with_audio(tmp_path, name="good")
    latin = shard_with_audio(tmp_path, name="latin")
    named = os.fsencode(latin.parent) + b"/caf\xe9"  # a directory named on a Latin-1 system
    os.rename(os.fsencode(latin), named)
    args = ["--shards-dir", str(tmp_path / "shards"), "--workers", "2", "--no-progress"]
    assert ea.main(args) == 1
    out = capsys.readouterr().out
    shown = f"{latin.parent}/caf\\xe9"
    assert f"FAILED {shown}: its path is not UTF-8" in out
    report = json.loads((tmp_path / "shards" / "extract_audio.summary.json").read_text())
    assert report["by_status"] == {"extracted": 1, "failed": 1}
    assert [p["shard_dir"] for p in report["problems"]] == [shown]
    # nothing of it was touched: the tar and the index stay, no audio was written beside them
    assert sorted(os.listdir(named)) == [b"audio.tar", b"audio_index.parquet", b"metadata.parquet"]


def test_a_done_shard_whose_tar_is_gone_reports_the_missing_members(tmp_path, capsys):
    shard = shard_with_audio(tmp_path)
    extract(tmp_path, delete_tars=True)
    (shard / "u0.flac").unlink()
    args = ["--shards-dir", str(tmp_path / "shards"), "--workers", "1", "--no-progress"]
    assert ea.main(args) == 1
    out = capsys.readouterr().out
    assert "missing after extraction: 1" in out
    report = json.loads((tmp_path / "shards" / "extract_audio.summary.json").read_text())
    assert report["problems"][0]["missing"] == ["u0.flac"]
    assert "is gone" in report["problems"][0]["error"]


# --- a tar holding a member twice --------------------------------------------------------------
def test_a_member_held_twice_with_other_content_is_reported_and_the_later_copy_kept(
    tmp_path, capsys
):
    shard = shard_with_audio(tmp_path)
    later = flac_bytes(0.3)
    add_members(shard, tar_info("u0.flac", data=later), tar_info("u1.flac", data=b"x" * 50))
    code = ea.main(["--shards-dir", str(tmp_path / "shards"), "--workers", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "held twice by a tar with different content" in out
    assert "twice with different content 'u0.flac'" in out and "'u1.flac'" in out
    assert (shard / "u0.flac").read_bytes() == later, "the later copy wins, as with tar -x"
    report = json.loads((tmp_path / "shards" / ea.SUMMARY_FILE).read_text())
    assert report["members_conflicting"] == 2 and report["files_extracted"] == 3
    assert [c["member"] for c in report["problems"][0]["conflicting"]] == ["u0.flac", "u1.flac"]


def test_a_member_held_twice_with_the_same_bytes_is_not_reported(tmp_path):
    shard = shard_with_audio(tmp_path)
    with tarfile.open(shard / "audio.tar") as tar:
        same = tar.extractfile("u2.flac").read()
    add_members(shard, tar_info("u2.flac", data=same))
    summary = extract(tmp_path)
    assert summary["members_conflicting"] == 0 and not summary["problems"]
    assert summary["files_extracted"] == 3


# --- a full disk -------------------------------------------------------------------------------
def test_a_full_disk_fails_the_shard_and_the_report_survives_the_summary_write(
    tmp_path, monkeypatch, capsys
):
    first = shard_with_audio(tmp_path, name="s0")
    second = shard_with_audio(tmp_path, name="s1")
    write_member = ea._write_member

    def fills_up(tar, member, target):
        if target.parent == second.resolve():
            raise OSError(errno.ENOSPC, "No space left on device")
        write_member(tar, member, target)

    write_json = ea.write_json_atomically

    def summary_write_fails(data, path):
        if Path(path).name == ea.SUMMARY_FILE:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_json(data, path)  # the done markers

    monkeypatch.setattr(ea, "_write_member", fills_up)
    monkeypatch.setattr(ea, "write_json_atomically", summary_write_fails)
    code = ea.main(["--shards-dir", str(tmp_path / "shards"), "--workers", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"FAILED {second}: disk full writing {second.resolve()}/u0.flac" in out
    assert f"ERROR cannot write {tmp_path / 'shards' / ea.SUMMARY_FILE}: disk full" in out
    assert "shards: 2 (extracted=1, failed=1)" in out
    assert (first / ea.DONE_MARKER).exists() and not (second / ea.DONE_MARKER).exists()
    assert not list(second.glob(ea.TEMP_PREFIX + "*"))


def test_too_little_free_space_for_the_pending_tars_stops_before_any_work(
    tmp_path, monkeypatch, capsys
):
    shard = shard_with_audio(tmp_path, name="s0")
    shard_with_audio(tmp_path, name="s1")
    tar_bytes = (shard / "audio.tar").stat().st_size
    usage = ea.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ea.shutil, "disk_usage", lambda path: usage._replace(free=tar_bytes + 1))
    args = ["--shards-dir", str(tmp_path / "shards"), "--workers", "1", "--no-progress"]
    assert ea.main(args) == 2
    err = capsys.readouterr().err
    assert "the 2 shard(s) to extract need about" in err and "--delete-tars" in err
    assert not list((tmp_path / "shards").rglob("*.flac"))
    # one tar at a time fits when each tar goes once its shard verifies
    assert ea.main([*args, "--delete-tars"]) == 0
    assert len(list((tmp_path / "shards").rglob("*.flac"))) == 6
    assert not list((tmp_path / "shards").rglob("audio.tar"))


def test_no_space_check_starts_whatever_the_estimate(tmp_path, monkeypatch):
    shard_with_audio(tmp_path)
    usage = ea.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ea.shutil, "disk_usage", lambda path: usage._replace(free=0))
    args = ["--shards-dir", str(tmp_path / "shards"), "--workers", "1", "--no-progress"]
    assert ea.main([*args, "--no-space-check"]) == 0


def test_an_unwritable_shards_dir_stops_before_any_work(tmp_path, monkeypatch, capsys):
    shard_with_audio(tmp_path)

    def read_only(directory):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ea, "check_writable", read_only)
    args = ["--shards-dir", str(tmp_path / "shards"), "--workers", "1", "--no-progress"]
    assert ea.main(args) == 2
    assert "cannot write into SHARDS_DIR" in capsys.readouterr().err
