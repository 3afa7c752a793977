"""training_cache.py and scripts/build_training_cache.py: content keys, parallel build, atomicity,
superseded caches, CACHE_DIR."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import config
import content_hash
import dataset
import training_cache
import vocabulary
from manifest_schema import tagged_text
from tests.conftest import LANGS, WORDS
from tests.torchrun_jobs import child_pids, is_running


def rows(n: int, *, duration=5.0, seed=0, legacy=False) -> list[dict]:
    """Manifest rows; ``legacy``: the audio named by tar_path + tar_member_name, as manifests written
    before audio_filepath did."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        lang = LANGS[k % 3]
        text = " ".join(rng.choice(WORDS, size=1 + k % 6))
        directory = f"/data/shards/src/{lang}/shard_{k // 7:04d}"
        audio = (
            dict(tar_member_name=f"{k}.flac", tar_path=f"{directory}/audio.tar")
            if legacy
            else dict(audio_filepath=f"{directory}/{k}.flac")
        )
        out.append(
            dict(
                segment_id=f"seg{k}",
                shard_id=f"src/{lang}/shard_{k // 7:04d}",
                text=tagged_text(lang, text),
                duration=float(duration if k % 11 else 0.05),  # every 11th: no encoder frame
                lang=lang,
                **audio,
                source="src",
            )
        )
    return out


def write(path, table_rows, **kwargs):
    pq.write_table(pa.Table.from_pylist(table_rows), path, **kwargs)
    return path


def ensure(path, tokenizer, **kwargs):
    kwargs.setdefault("frame_seconds", 0.08)
    kwargs.setdefault("max_token_len", 512)
    kwargs.setdefault("progress", False)
    return training_cache.ensure(path, tokenizer, **kwargs)


def caches(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".training-cache"))


# ------------------------------------------------------------------------------------------ key


def test_a_cache_is_built_once_then_mapped(tmp_path, tokenizer):
    path = write(tmp_path / "train.parquet", rows(50))
    first = ensure(path, tokenizer)
    second = ensure(path, tokenizer)
    assert first.built and not second.built and second.path == first.path
    assert first.path.parent == tmp_path
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    assert first.summary["rows_read"] == 50 and first.summary["rows_kept"] == 45


def test_other_content_with_the_same_size_and_mtime_gets_a_new_cache(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    plain = dict(compression="none", use_dictionary=False, write_statistics=False)
    write(path, rows(30, duration=5.0), **plain)
    size, mtime = path.stat().st_size, path.stat().st_mtime_ns
    first = ensure(path, tokenizer)
    write(path, rows(30, duration=6.0), **plain)
    os.utime(path, ns=(mtime, mtime))
    assert path.stat().st_size == size and path.stat().st_mtime_ns == mtime
    second = ensure(path, tokenizer)
    assert second.built and second.key != first.key
    assert training_cache.CacheColumns(second.path).durations.max() == 6.0


def test_a_touch_or_a_copy_of_the_same_bytes_reuses_the_cache(tmp_path, tokenizer):
    path = write(tmp_path / "train.parquet", rows(40))
    first = ensure(path, tokenizer)
    os.utime(path, ns=(5, 5))
    assert not ensure(path, tokenizer).built
    copy = tmp_path / "train_copy.parquet"
    shutil.copyfile(path, copy)
    again = ensure(copy, tokenizer)
    assert not again.built and again.path == first.path


def test_the_content_hash_is_the_files_sha256_and_is_remembered(tmp_path, tokenizer, monkeypatch):
    path = write(tmp_path / "train.parquet", rows(20))
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert content_hash.content_sha256(path, tmp_path) == expected
    opened = []
    real_open = open

    def spying_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spying_open)
    assert content_hash.content_sha256(path, tmp_path) == expected
    assert str(path) not in opened  # the memo answered


def test_other_settings_or_tokenizer_get_their_own_cache(tmp_path, tokenizer):
    path = write(tmp_path / "train.parquet", rows(30))
    a = ensure(path, tokenizer, max_token_len=512)
    b = ensure(path, tokenizer, max_token_len=3)
    c = ensure(path, tokenizer, frame_seconds=0.04)
    assert len({a.key, b.key, c.key}) == 3
    assert b.summary["truncated_to_max_token_len"] > 0
    assert any("other tokenizer or frame settings" in why for _, _, why in c.kept_others)
    assert len(caches(tmp_path)) == 3


def test_the_same_tokenizer_trained_in_another_directory_reuses_the_cache(tmp_path, tokenizer):
    from nemo.collections.common.tokenizers import SentencePieceTokenizer
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(tokenizer.tokenizer.serialized_model_proto())
    # What SentencePiece records of a training in another temporary directory: its file paths.
    del proto.trainer_spec.input[:]
    proto.trainer_spec.input.append("/data/.tokenizer.tmp-x1y2z3/sentences.txt")
    proto.trainer_spec.model_prefix = "/data/.tokenizer.tmp-x1y2z3/tokenizer"
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "tokenizer.model").write_bytes(proto.SerializeToString())
    again = SentencePieceTokenizer(str(tmp_path / "again" / "tokenizer.model"))
    path = write(tmp_path / "train.parquet", rows(30))
    first = ensure(path, tokenizer)
    second = ensure(path, again)
    assert not second.built and second.path == first.path


# ------------------------------------------------------------------------------------------ build


def column_bytes(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix == ".bin"}


@pytest.mark.parametrize("row_group_size", [1, 17, 1000])
def test_parallel_build_equals_the_one_process_build(
    tmp_path, tokenizer, monkeypatch, row_group_size
):
    monkeypatch.setattr(training_cache, "_BATCH_ROWS", 5)
    path = write(tmp_path / "m.parquet", rows(120), row_group_size=row_group_size)
    a = ensure(path, tokenizer, workers=1, cache_dir=tmp_path / "one")
    b = ensure(path, tokenizer, workers=2, cache_dir=tmp_path / "two")
    assert a.summary["build_workers"] == 1
    assert b.summary["build_workers"] == min(2, -(-120 // row_group_size))
    assert column_bytes(a.path) == column_bytes(b.path)
    ignore = {"build_seconds": 0, "build_workers": 0, "build_peak_rss_worker": 0}
    assert a.summary | ignore == b.summary | ignore


@pytest.mark.parametrize("legacy", [False, True], ids=["audio_filepath", "tar_path_and_member"])
def test_mapped_items_match_the_manifest_row_by_row(tmp_path, tokenizer, monkeypatch, legacy):
    monkeypatch.setattr(training_cache, "_BATCH_ROWS", 4)
    table = rows(60, legacy=legacy)
    path = write(tmp_path / "m.parquet", table, row_group_size=9)
    info = ensure(path, tokenizer, workers=2)
    cols = training_cache.CacheColumns(info.path, info.key)
    kept = [r for r in table if r["duration"] > 1]
    assert len(cols.durations) == len(kept)
    for i, row in enumerate(kept):
        assert table[int(cols.manifest_row[i])] is row
        assert cols.lang_names[cols.lang_codes[i]] == row["lang"]
        assert cols.shard_names[cols.shard_codes[i]] == row["shard_id"]
        audio = row.get("audio_filepath") or os.path.join(
            os.path.dirname(row["tar_path"]), row["tar_member_name"]
        )
        assert cols.dir_names[cols.dir_codes[i]] == os.path.dirname(audio)
        assert cols.member_name(i) == os.path.basename(audio)
        transcript = row["text"].split(" ", 1)[1]
        assert cols.token_ids_of(i).tolist() == tokenizer.text_to_ids(transcript)


def test_a_bad_row_in_a_later_row_group_names_its_manifest_row(tmp_path, tokenizer):
    table = rows(40)
    table[33]["text"] = tagged_text("en", "hello")
    table[33]["lang"] = "hi"  # the tag disagrees with the row's language
    path = write(tmp_path / "m.parquet", table, row_group_size=10)
    with pytest.raises(training_cache.CacheError, match=r"m.parquet: row 33"):
        ensure(path, tokenizer, workers=2)
    assert caches(tmp_path) == [] and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_worker_that_dies_ends_the_build_with_its_exit_while_another_still_works(
    tmp_path, tokenizer, monkeypatch
):
    import signal
    import time

    real = training_cache._build_part

    def part(task):
        if task.row_group == 1:  # as the OOM killer ends a worker: no answer, no exception
            os.kill(os.getpid(), signal.SIGKILL)
        if task.row_group == 2:
            time.sleep(60)  # the other worker is busy: the builder must not wait for it
        return real(task)

    monkeypatch.setattr(training_cache, "_build_part", part)
    path = write(tmp_path / "m.parquet", rows(40), row_group_size=10)
    before = set(child_pids(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker \(pid \d+\) was killed by signal 9"):
        ensure(path, tokenizer, workers=2)
    assert time.monotonic() - t0 < 30
    assert caches(tmp_path) == [] and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    assert set(child_pids(os.getpid())) <= before  # both workers are gone, none left a zombie


def test_a_null_names_the_column_and_row(tmp_path, tokenizer):
    table = rows(12)
    table[7]["audio_filepath"] = None
    path = write(tmp_path / "m.parquet", table, row_group_size=5)
    with pytest.raises(training_cache.CacheError, match=r"'audio_filepath' is null at row 7"):
        ensure(path, tokenizer)


def test_empty_and_all_dropped_manifests_give_empty_caches(tmp_path, tokenizer):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(rows(3)).slice(0, 0), empty)
    info = ensure(empty, tokenizer)
    assert (
        info.summary["rows_read"] == 0
        and len(training_cache.CacheColumns(info.path).durations) == 0
    )
    dropped = write(tmp_path / "dropped.parquet", rows(5, duration=0.1))
    info = ensure(dropped, tokenizer)
    assert info.summary["rows_kept"] == 0
    assert info.summary["dropped"]["infeasible_tokens_gt_frames"] == 5


# ------------------------------------------------------------------------------------------ the record of drops


def planted_drops(n: int = 30) -> list[dict]:
    """``rows(n)`` (every 11th row too short for one encoder frame) plus a bad duration at row 5
    and, at row 17, a transcript longer than its 0.3 s of audio (3 frames)."""
    table = rows(n)
    table[5]["duration"] = -1.0
    table[17]["text"] = tagged_text(table[17]["lang"], " ".join(WORDS))
    table[17]["duration"] = 0.3
    return table


@pytest.mark.parametrize("workers", [1, 2])
def test_every_dropped_row_is_recorded_with_its_id_tokens_and_frames(tmp_path, tokenizer, workers):
    table = planted_drops()
    path = write(tmp_path / "m.parquet", table, row_group_size=7)
    info = ensure(path, tokenizer, workers=workers)
    record = training_cache.read_dropped_rows(info.path).to_pylist()
    expected = []
    for k, row in enumerate(table):
        frames = int(row["duration"] / 0.08 + 1e-9) if row["duration"] > 0 else 0
        tokens = 1 + len(tokenizer.text_to_ids(row["text"].split(" ", 1)[1]))
        if row["duration"] <= 0 or tokens > frames:
            reason = "bad_duration" if row["duration"] <= 0 else "infeasible_tokens_gt_frames"
            expected.append(
                dict(
                    manifest_row=k,
                    segment_id=row["segment_id"],
                    lang=row["lang"],
                    reason=reason,
                    tokens=tokens,
                    frames=frames,
                    duration=row["duration"],
                )
            )
    assert [r["manifest_row"] for r in expected] == [0, 5, 11, 17, 22]
    assert record == expected
    s = info.summary
    assert s["dropped"] == {"infeasible_tokens_gt_frames": 4, "bad_duration": 1}
    assert s["read_by_lang"] == {"en": 10, "hi": 10, "mr": 10}
    assert s["dropped_rows_file"] == training_cache.DROPPED_FILE


def test_a_cache_without_drops_records_none(tmp_path, tokenizer):
    path = write(tmp_path / "m.parquet", rows(10)[1:])
    info = ensure(path, tokenizer)
    assert training_cache.read_dropped_rows(info.path).num_rows == 0


def test_a_build_dying_while_it_records_its_drops_leaves_no_cache(tmp_path, tokenizer, monkeypatch):
    path = write(tmp_path / "m.parquet", planted_drops())
    real_write = pq.write_table

    def die_on_the_record(table, where, *args, **kwargs):
        if str(where).endswith(training_cache.DROPPED_FILE):
            raise KeyboardInterrupt
        return real_write(table, where, *args, **kwargs)

    monkeypatch.setattr(training_cache.pq, "write_table", die_on_the_record)
    with pytest.raises(KeyboardInterrupt):
        ensure(path, tokenizer)
    assert caches(tmp_path) == [] and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    monkeypatch.setattr(training_cache.pq, "write_table", real_write)
    info = ensure(path, tokenizer)
    assert (
        training_cache.read_dropped_rows(info.path).num_rows
        == info.summary["rows_read"] - (info.summary["rows_kept"])
    )


def test_languages_losing_more_than_a_tenth_are_the_heavy_drops():
    summary = {
        "dropped_by_lang": {"hi": {"infeasible_tokens_gt_frames": 1}, "ml": {"bad_duration": 6}},
        "read_by_lang": {"hi": 10, "ml": 10, "en": 10},
    }
    assert training_cache.heavy_drops(summary) == [
        {"lang": "ml", "dropped": 6, "read": 10, "by_reason": {"bad_duration": 6}}
    ]
    summary["dropped_by_lang"]["hi"]["infeasible_tokens_gt_frames"] = 2
    assert [d["lang"] for d in training_cache.heavy_drops(summary)] == ["ml", "hi"]


# ------------------------------------------------------------------------------------------ atomicity


def test_a_failed_build_leaves_nothing_that_looks_whole(tmp_path, tokenizer, monkeypatch):
    path = write(tmp_path / "m.parquet", rows(30), row_group_size=10)
    calls = []
    real_add = training_cache._Assembler.add

    def add_then_die(self, part_dir, result):
        calls.append(part_dir)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_add(self, part_dir, result)

    monkeypatch.setattr(training_cache._Assembler, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        ensure(path, tokenizer, workers=2)
    assert caches(tmp_path) == [] and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_killed_builds_temporary_directory_is_removed_by_the_next_build(tmp_path, tokenizer):
    path = write(tmp_path / "m.parquet", rows(30))
    key = training_cache.cache_key(
        content_hash.content_sha256(path, tmp_path),
        vocabulary.tokenizer_fingerprint(tokenizer),
        0.08,
        512,
    )
    stale = tmp_path / f".m.{key}.training-cache.tmp-999999"
    (stale / "part-000000").mkdir(parents=True)
    (stale / "duration.bin").write_bytes(b"\0" * 16)
    info = ensure(path, tokenizer)
    assert info.built and info.key == key and not stale.exists()


def test_disk_full_names_the_directory_and_the_knob(tmp_path, tokenizer, monkeypatch):
    path = write(tmp_path / "m.parquet", rows(10))

    def full(self, part_dir, result):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(training_cache._Assembler, "add", full)
    with pytest.raises(training_cache.CacheError, match=r"no space left in .*CACHE_DIR"):
        ensure(path, tokenizer)


def _ensure_in_child(args):
    path, tok = args
    return ensure(path, tok, workers=1).built


def test_processes_racing_build_the_cache_exactly_once(tmp_path, tokenizer):
    path = write(tmp_path / "m.parquet", rows(2000))
    with multiprocessing.get_context("fork").Pool(4) as pool:
        built = pool.map(_ensure_in_child, [(path, tokenizer)] * 4)
    assert sorted(built) == [False, False, False, True]


# ------------------------------------------------------------------------------------------ superseded


def test_a_superseded_cache_is_removed_unless_it_is_mapped(tmp_path, tokenizer):
    path = write(tmp_path / "m.parquet", rows(30, seed=1))
    old = ensure(path, tokenizer)
    write(path, rows(30, seed=2))
    held = training_cache.CacheColumns(ensure(path, tokenizer).path)  # a running job maps this one
    assert not old.path.exists()
    write(path, rows(30, seed=3))
    newest = ensure(path, tokenizer)
    assert [p for p, _ in newest.removed] == []
    assert [(p, why) for p, _, why in newest.kept_others] == [
        (held.path, "superseded, still mapped by a running process")
    ]
    held_path = held.path
    del held  # the job ends: its lock goes with it
    write(path, rows(30, seed=4))
    latest = ensure(path, tokenizer)
    assert sorted(p for p, _ in latest.removed) == sorted([held_path, newest.path])
    assert all(size > 0 for _, size in latest.removed)
    assert caches(tmp_path) == [latest.path.name]


# ------------------------------------------------------------------------------------------ CACHE_DIR


def test_cache_dir_leaves_a_read_only_data_directory_untouched(tmp_path, tokenizer):
    data = tmp_path / "data"
    data.mkdir()
    path = write(data / "train.parquet", rows(30))
    before = sorted(os.listdir(data)), data.stat().st_mtime_ns
    info = ensure(path, tokenizer, cache_dir=tmp_path / "cache")
    assert info.path.parent == tmp_path / "cache"
    assert (sorted(os.listdir(data)), data.stat().st_mtime_ns) == before
    ds = dataset.LocalShardDataset(path, tokenizer, progress=False, cache_dir=tmp_path / "cache")
    assert not ds.load_summary["cache_built"] and len(ds) == 27


def test_an_unwritable_cache_dir_fails_naming_it(tmp_path, tokenizer):
    path = write(tmp_path / "train.parquet", rows(5))
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.raises(training_cache.CacheError, match=r"CACHE_DIR=.*not_a_dir/cache.*writable"):
        ensure(path, tokenizer, cache_dir=blocker / "cache")


def test_an_unwritable_manifest_directory_points_to_cache_dir(tmp_path, tokenizer, monkeypatch):
    path = write(tmp_path / "train.parquet", rows(5))
    real_touch = training_cache.Path.touch

    def read_only(self, *args, **kwargs):
        if self.parent == tmp_path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_touch(self, *args, **kwargs)

    monkeypatch.setattr(training_cache.Path, "touch", read_only)
    with pytest.raises(training_cache.CacheError, match=r"CACHE_DIR is unset.*Permission denied"):
        ensure(path, tokenizer)


# ------------------------------------------------------------------------------------------ the script


def test_build_script_caches_train_and_validation_for_training(
    tmp_path, tokenizer, monkeypatch, capsys
):
    from scripts import build_training_cache

    train = write(tmp_path / "train.parquet", rows(40, seed=5))
    val = write(tmp_path / "val.parquet", rows(12, seed=6))
    monkeypatch.setattr(config, "TRAIN_MANIFEST_PATH", train)
    monkeypatch.setattr(config, "VAL_MANIFEST_PATH", val)
    monkeypatch.setattr(config, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(config, "ENCODER_FRAME_SECONDS", 0.08)
    monkeypatch.setattr(config, "MAX_TOKEN_LEN", 512)
    monkeypatch.setattr(build_training_cache, "load_tokenizer", lambda _: tokenizer)
    assert build_training_cache.main([]) == 0
    out = capsys.readouterr().out
    assert "train.parquet: 40 rows read, 36 kept" in out and "val.parquet: 12 rows read" in out
    assert out.count("built in") == 2
    ds = dataset.LocalShardDataset(train, tokenizer, progress=False)  # what train.py does
    assert not ds.load_summary["cache_built"]
    assert build_training_cache.main([]) == 0
    assert capsys.readouterr().out.count("already built: mapped") == 2


def test_build_script_warns_of_a_validation_language_losing_more_than_a_tenth(
    tmp_path, tokenizer, monkeypatch, capsys
):
    from scripts import build_training_cache

    train = write(tmp_path / "train.parquet", rows(40, seed=5))  # loses a tenth too: no warning
    val_rows = [r for r in rows(30, seed=6) if r["duration"] > 1]
    for row in [r for r in val_rows if r["lang"] == "mr"][:3]:
        row["duration"] = 0.1
    val = write(tmp_path / "val.parquet", val_rows)
    monkeypatch.setattr(config, "TRAIN_MANIFEST_PATH", train)
    monkeypatch.setattr(config, "VAL_MANIFEST_PATH", val)
    monkeypatch.setattr(config, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(build_training_cache, "load_tokenizer", lambda _: tokenizer)
    assert build_training_cache.main([]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    mr_rows = sum(r["lang"] == "mr" for r in val_rows)
    assert len(warnings) == 1, out
    assert f"val.parquet: mr loses 3 of its {mr_rows} rows" in warnings[0]
    assert "3 infeasible_tokens_gt_frames" in warnings[0] and "raise VOCAB_SIZE" in warnings[0]
    assert f"{training_cache.DROPPED_FILE}" in warnings[0]
    assert "dropped per language: mr 3 infeasible_tokens_gt_frames; every dropped row" in out


def test_build_script_without_a_tokenizer_says_what_to_run(tmp_path, monkeypatch, capsys):
    from scripts import build_training_cache

    monkeypatch.setattr(config, "TOKENIZER_DIR", tmp_path / "nope")
    assert build_training_cache.main(["--manifest", str(tmp_path / "x.parquet")]) == 2
    assert "run scripts/train_tokenizer.py" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ orphans

_SLOW_BUILD = """
import sys, time
import training_cache
from nemo.collections.common.tokenizers import SentencePieceTokenizer

real = training_cache._build_part
def slow(task):
    time.sleep(60)  # far longer than the test waits: only the kernel can end it early
    return real(task)
training_cache._build_part = slow
training_cache.ensure(sys.argv[1], SentencePieceTokenizer(sys.argv[2]), frame_seconds=0.08,
                      max_token_len=512, workers=2, progress=False)
"""


def test_workers_die_with_a_killed_builder(tmp_path, tokenizer):
    import signal
    import subprocess
    import sys
    import time

    path = write(tmp_path / "m.parquet", rows(200), row_group_size=10)
    model = tokenizer.tokenizer.serialized_model_proto()
    (tmp_path / "tok.model").write_bytes(model)
    script = tmp_path / "build.py"
    script.write_text(_SLOW_BUILD)
    builder = subprocess.Popen(
        [sys.executable, str(script), str(path), str(tmp_path / "tok.model")]
    )
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while len(workers) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        workers = child_pids(builder.pid)
    assert len(workers) == 2, "the builder never started its workers"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in workers if is_running(p)]
    assert alive == [], "workers outlived their builder"
    assert caches(tmp_path) == []  # only a hidden temporary directory, removed by the next build
    assert ensure(path, tokenizer).built


def _hash_in_child(args):
    path, memo_dir = args
    return content_hash.content_sha256(path, memo_dir)


def test_processes_missing_the_memo_together_read_the_manifest_once(tmp_path, monkeypatch):
    path = write(tmp_path / "m.parquet", rows(300))
    calls = tmp_path / "hash_calls"
    real = content_hash._hash_file

    def counted(*args):
        with open(calls, "a") as fh:
            fh.write("x")
        return real(*args)

    monkeypatch.setattr(content_hash, "_hash_file", counted)  # forked children inherit it
    with multiprocessing.get_context("fork").Pool(4) as pool:
        values = pool.map(_hash_in_child, [(path, tmp_path)] * 4)
    assert len(set(values)) == 1 and values[0] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert calls.read_text() == "x"


def test_a_sentencepiece_proto_without_a_path_field_fingerprints_with_one_warning(
    monkeypatch, caplog, tokenizer
):
    """sentencepiece 0.2.2's TrainerSpec has no seed_sentencepieces_file: the fields it has are
    cleared, the one it lacks is said once, and the tokenizer's fingerprint is taken all the same."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as real

    class OlderTrainerSpec:
        def __init__(self, spec):
            self._spec = spec
            fields = dict(spec.DESCRIPTOR.fields_by_name)
            fields.pop("seed_sentencepieces_file")
            self.DESCRIPTOR = type("Descriptor", (), {"fields_by_name": fields})

        def ClearField(self, name):
            assert name != "seed_sentencepieces_file", "that field does not exist in 0.2.2"
            self._spec.ClearField(name)

    class OlderModelProto:
        def __init__(self):
            self._proto = real.ModelProto()

        def __getattr__(self, name):  # ParseFromString, normalizer_spec, SerializeToString, ...
            return getattr(self._proto, name)

        @property
        def trainer_spec(self):
            return OlderTrainerSpec(self._proto.trainer_spec)

    older = type("pb2", (), {"ModelProto": OlderModelProto})
    monkeypatch.setattr(sentencepiece, "sentencepiece_model_pb2", older)
    vocabulary._warn_missing_field.cache_clear()
    with caplog.at_level("WARNING", logger="vocabulary"):
        first = vocabulary.tokenizer_fingerprint(tokenizer)
        second = vocabulary.tokenizer_fingerprint(tokenizer)
    monkeypatch.undo()
    assert first == second
    warned = [
        r.getMessage() for r in caplog.records if "seed_sentencepieces_file" in r.getMessage()
    ]
    assert len(warned) == 1 and "has no TrainerSpec.seed_sentencepieces_file" in warned[0]
    # The seed file path is empty in a model trained here, so the fingerprint is the same as with
    # a sentencepiece that has the field.
    assert first == vocabulary.tokenizer_fingerprint(tokenizer)
