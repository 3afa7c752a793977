"""Importing a Common Voice release (``cv:`` sources) with build_manifest.py: every valid row kept
with its release split, speaker and language; every bad row named with its file and line; the
filters on what Common Voice marks; TSVs read as Common Voice writes them."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

import build_manifest as bm
import dataset
import source_readers
from manifest_schema import ManifestError
from source_readers.common_voice import project_language
from tests import common_voice_factory as cv

QUOTED = 'उसने कहा "चलो" और गया'
TABBED = "hello\tthere friend"


def build(tmp_path: Path, *sources: str):
    output = tmp_path / "master.parquet"
    summary = bm.build_manifest(
        None,
        output,
        sources=list(sources),
        audio_dir=tmp_path / "imported",
        languages=(),
        min_duration=0.1,
        max_duration=30.0,
        min_quality=0.0,
        workers=2,
        progress=False,
    )
    return pl.read_parquet(output), summary


def dropped(summary) -> list[tuple[str, str]]:
    return [(b["origin"], b["reason"]) for s in summary["sources"] for b in s["dropped_examples"]]


def rows_of(spec: str, tmp_path: Path) -> pl.DataFrame:
    """The reader's rows (transcripts as written, before cleaning)."""
    batches = source_readers.read_source(
        source_readers.parse_source(spec), tmp_path / "imported", workers=2, progress=False
    )
    return pl.concat([b.rows for b in batches])


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """Hindi and English, 30 clips each (train 20, dev 5, test 5), with planted defects:
    Hindi: an empty sentence (train.tsv:3), a missing clip (train.tsv:4), a line that does not
    parse (train.tsv:22), a sentence with quotes (dev.tsv:2), a clip listed in dev and train
    (train.tsv:23, kept in dev); English (locale en): a sentence in quotes holding a tab
    (test.tsv:2)."""
    root = tmp_path_factory.mktemp("cv")
    hi = cv.clip_rows("hi", 20, "train") + cv.clip_rows("hi", 5, "dev", 20)
    hi += cv.clip_rows("hi", 5, "test", 25)
    hi[1]["sentence"] = "   "
    hi[20]["sentence"] = QUOTED
    moved = hi[22] | {"split": "train"}
    extra = {"train": ["x\tnot a row", cv.tsv_line(moved)]}
    hi_folder = cv.write_release(root, "hi", hi, extra)
    (hi_folder / "clips" / hi[2]["path"]).unlink()
    en = cv.clip_rows("en", 20, "train") + cv.clip_rows("en", 5, "dev", 20)
    en += cv.clip_rows("en", 5, "test", 25)
    en[25]["sentence"] = f'"{TABBED}"'
    en_folder = cv.write_release(root, "en", en)
    return {"hi": (hi_folder, hi), "en": (en_folder, en)}


def test_every_valid_row_is_kept_with_its_split_speaker_and_language(release, tmp_path):
    (hi_folder, hi), (en_folder, en) = release["hi"], release["en"]
    every = "splits=train+dev+test"
    master, _ = build(tmp_path, f"cv:{hi_folder}:{every}", f"cv:{en_folder}:{every}")
    valid = [r for r in hi if r["path"] not in (hi[1]["path"], hi[2]["path"])] + en
    expected = {(r["path"].removesuffix(".mp3"), r["split"], r["client_id"]) for r in valid}
    got = master.select(
        pl.col("segment_id").str.replace(r"^[^/]*/", ""), "split", "speaker_id"
    ).rows()
    assert sorted(got) == sorted(expected) and master.height == 58
    by_source = dict(master.group_by("source").agg(pl.col("lang").unique()).rows())
    assert by_source == {"hi": ["hi"], "en": ["en"]}
    assert master.filter(pl.col("split") == "test").height == 10


def test_every_bad_row_is_named_with_its_file_and_line(release, tmp_path):
    hi_folder, _ = release["hi"]
    _, summary = build(tmp_path, f"cv:{hi_folder}")
    train = hi_folder / "train.tsv"
    assert dropped(summary) == [
        (f"{train}:3", "transcript_missing"),
        (f"{train}:4", "audio_not_found"),
        (f"{train}:22", "not_tsv"),
        (f"{train}:23", "clip_listed_twice"),
    ]
    examples = {b["reason"]: b["detail"] for b in summary["sources"][0]["dropped_examples"]}
    assert (
        examples["clip_listed_twice"]
        == "common_voice_hi_00022.mp3 is also dev.tsv:4, where it is kept"
    )
    assert examples["not_tsv"] == "2 tab-separated fields, the header has 13"


def test_a_sentence_with_quotes_keeps_them_and_its_other_fields(release, tmp_path):
    hi_folder, hi = release["hi"]
    rows = rows_of(f"cv:{hi_folder}", tmp_path)
    row = rows.filter(pl.col("segment_id") == "hi/common_voice_hi_00020").row(0, named=True)
    assert row["transcription_native"] == QUOTED
    assert (row["speaker_id"], row["split"]) == (hi[20]["client_id"], "dev")


def test_a_field_in_quotes_holding_a_tab_is_one_field(release, tmp_path):
    en_folder, en = release["en"]
    rows = rows_of(f"cv:{en_folder / 'test.tsv'}", tmp_path)
    row = rows.filter(pl.col("segment_id") == "test/common_voice_en_00025").row(0, named=True)
    assert row["transcription_native"] == TABBED
    assert (row["speaker_id"], row["segment_language"]) == (en[25]["client_id"], "en")


def test_a_folder_gives_train_dev_and_test(release, tmp_path):
    en_folder, _ = release["en"]
    master, summary = build(tmp_path, f"cv:{en_folder}")
    assert master["split"].value_counts().sort("split").rows() == [
        ("dev", 5),
        ("test", 5),
        ("train", 20),
    ]
    assert summary["sources"][0]["rows_read"] == 30


def test_a_release_becomes_train_validation_and_test_manifests_with_its_own_splits(tmp_path):
    """Speakers as a release has them (none in two splits) but one: a train speaker who also
    recorded a test clip, whose train rows leave train."""
    from scripts import make_train_val as mtv

    rows = cv.clip_rows("hi", 8, "train") + cv.clip_rows("hi", 3, "dev", 8)
    rows += cv.clip_rows("hi", 3, "test", 11)
    for i, r in enumerate(rows):
        r["client_id"] = {"train": f"t{i % 2}", "dev": "d", "test": "x"}[r["split"]]
    rows[0]["client_id"] = "x"
    folder = cv.write_release(tmp_path / "cv", "hi", rows)
    master, _ = build(tmp_path, f"cv:{folder}")
    summary = mtv.make_train_val(
        tmp_path / "master.parquet",
        tmp_path / "train.parquet",
        tmp_path / "val.parquet",
        test_path=tmp_path / "test.parquet",
        languages=(),
    )
    clip = pl.col("segment_id").str.replace(r"^hi/", "") + ".mp3"
    sides = {
        s: set(pl.read_parquet(tmp_path / f"{s}.parquet").select(clip).to_series())
        for s in ("train", "val", "test")
    }
    by_split = {s: {r["path"] for r in rows if r["split"] == s} for s in ("train", "dev", "test")}
    assert sides["test"] == by_split["test"] and sides["val"] == by_split["dev"]
    assert sides["train"] == by_split["train"] - {rows[0]["path"]}
    assert summary["leaks"]["rows"] == {"speaker": {"train/test": 1}}


def test_one_source_per_split_names_its_split_with_the_split_option(tmp_path):
    from tests import byod_factory

    utts = byod_factory.utterances(2, langs=("hi",))
    manifest = byod_factory.write_nemo_json(tmp_path / "nemo", utts)
    master, _ = build(tmp_path, f"nemo:{manifest}:name=hi_dev,split=dev")
    assert set(master["split"]) == {"dev"} and master.height == 2


def test_a_split_option_outside_train_dev_test_or_on_a_cv_folder_is_refused(release, tmp_path):
    hi_folder, _ = release["hi"]
    with pytest.raises(ManifestError, match="split=holdout is not one of train, dev, test"):
        source_readers.parse_source(f"cv:{hi_folder / 'test.tsv'}:split=holdout")
    with pytest.raises(ManifestError, match="keeps each TSV's own split"):
        source_readers.parse_source(f"cv:{hi_folder}:split=train")


def test_one_tsv_imports_as_its_split(release, tmp_path):
    hi_folder, _ = release["hi"]
    master, _ = build(tmp_path, f"cv:{hi_folder / 'test.tsv'}:name=cv_hi_test")
    assert master.height == 5 and set(master["split"]) == {"test"} and set(master["lang"]) == {"hi"}


def test_validated_adds_only_the_clips_the_release_splits_leave_out(tmp_path):
    rows = cv.clip_rows("hi", 6, "train")
    folder = cv.write_release(tmp_path / "cv", "hi", rows)
    unsplit = cv.clip_rows("hi", 2, "train", 6)
    with (folder / "validated.tsv").open("a", encoding="utf-8") as f:
        f.writelines(cv.tsv_line(r) + "\n" for r in unsplit)
    for k, r in enumerate(unsplit):
        (folder / "clips" / r["path"]).write_bytes(cv.mp3(r["seconds"], 100 + k))
    master, summary = build(tmp_path, f"cv:{folder}:splits=train+validated")
    assert master["split"].value_counts().sort("split").rows() == [("train", 6), ("validated", 2)]
    assert summary["sources"][0]["left_out"] == {"in_train_dev_or_test": 6}
    assert dropped(summary) == []


def test_filters_on_votes_segment_and_gender_keep_the_rows_asked_for(release, tmp_path):
    en_folder, en = release["en"]
    spec = f"cv:{en_folder}:splits=train+dev+test,min_up_votes=3,max_down_votes=0,gender=male_masculine+other"
    master, summary = build(tmp_path, spec)
    expected = {
        r["path"].removesuffix(".mp3")
        for r in en
        if int(r["up_votes"]) >= 3 and int(r["down_votes"]) == 0 and r["gender"] == "male_masculine"
    }
    assert set(master["segment_id"].str.replace("^en/", "")) == expected and expected
    left_out = summary["sources"][0]["left_out"]
    assert sum(left_out.values()) == 30 - len(expected)
    assert set(left_out) <= {"min_up_votes=3", "max_down_votes=0", "gender=male_masculine+other"}
    benchmark, _ = build(tmp_path, f"cv:{en_folder}:splits=train+dev+test,segment=Benchmark")
    assert benchmark.height == 6  # clips 0, 5, ..., 25


def test_a_filter_on_a_field_the_release_lacks_names_it(tmp_path):
    folder = tmp_path / "cv" / "hi"
    (folder / "clips").mkdir(parents=True)
    (folder / "train.tsv").write_text("client_id\tpath\tsentence\nc\ta.mp3\tनमस्ते\n")
    with pytest.raises(ManifestError, match="variant=central needs the TSV field variant"):
        build(tmp_path, f"cv:{folder}:variant=central")
    with pytest.raises(
        ManifestError, match="splits=train\\+devel: devel is not a Common Voice TSV"
    ):
        build(tmp_path, f"cv:{folder}:splits=train+devel")


def test_an_option_of_another_kind_is_refused(tmp_path):
    (tmp_path / "m.json").write_text("")
    with pytest.raises(ManifestError, match="unknown option 'min_up_votes=2'"):
        source_readers.parse_source(f"nemo:{tmp_path / 'm.json'}:min_up_votes=2")


def test_locales_become_the_project_language_codes():
    locales = pl.Series(["hi", "pa-IN", "gu-IN", "ne-NP", "en", "or", "as", "ta", " mr ", "zh-CN"])
    codes = pl.select(project_language(pl.lit(locales))).to_series().to_list()
    assert codes == ["hi", "pa", "gu", "ne", "en", "or", "as", "ta", "mr", "zh-cn"]


def test_a_clip_kept_decodes_through_the_training_loader_at_16_khz(release, tmp_path):
    hi_folder, _ = release["hi"]
    master, _ = build(tmp_path, f"cv:{hi_folder}")
    row = master.row(0, named=True)
    assert row["audio_filepath"].endswith(".mp3")
    signal = dataset.load_audio(
        row["audio_filepath"], expected_duration=row["duration"], sample_rate=16_000
    )
    assert abs(len(signal) / 16_000 - row["duration"]) < 0.1


def test_the_benchmark_runs_end_to_end_and_every_build_keeps_the_same_rows(tmp_path, capsys):
    from benchmarks import bench_common_voice

    code = bench_common_voice.main(["--rows", "300", "--repeat", "1", "--keep", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "same rows kept by every build: yes" in out, out
    assert "cv-none" in out and "vs nemo-none" in out


def test_a_sentence_broken_by_a_newline_makes_two_bad_lines(tmp_path):
    rows = cv.clip_rows("hi", 4, "train")
    broken = rows[1] | {"sentence": "पहली पंक्ति\nदूसरी"}
    folder = cv.write_release(tmp_path / "cv", "hi", [rows[0], rows[2], rows[3]])
    train = folder / "train.tsv"
    lines = train.read_text(encoding="utf-8").splitlines()
    lines.insert(2, cv.tsv_line(broken))  # lines 3 and 4 of the file
    train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "clips" / broken["path"]).write_bytes(cv.mp3(1.0, 9))
    master, summary = build(tmp_path, f"cv:{folder}")
    assert dropped(summary) == [(f"{train}:3", "not_tsv"), (f"{train}:4", "not_tsv")]
    assert master.height == 3


def test_durations_come_from_clip_durations_when_the_clips_are_trusted(release, tmp_path):
    hi_folder, hi = release["hi"]
    master, _ = build(tmp_path, f"cv:{hi_folder / 'dev.tsv'}:check=none")
    given = {r["path"].removesuffix(".mp3"): r["seconds"] for r in hi}
    for segment_id, seconds in master.select("segment_id", "duration").rows():
        assert seconds == pytest.approx(given[segment_id.removeprefix("dev/")], abs=1e-9)


def test_tsvs_saved_with_a_byte_order_mark_keep_their_speakers_and_durations(tmp_path):
    rows = cv.clip_rows("hi", 6, "train") + cv.clip_rows("hi", 2, "dev", 6)
    folder = cv.write_release(tmp_path / "cv", "hi", rows)
    for name in ("train.tsv", "dev.tsv", "clip_durations.tsv"):  # as a spreadsheet saves them
        (folder / name).write_bytes(b"\xef\xbb\xbf" + (folder / name).read_bytes())
    master, summary = build(tmp_path, f"cv:{folder}:check=none")
    assert master.height == 8 and dropped(summary) == []
    assert dict(
        master.select(pl.col("segment_id").str.strip_prefix("hi/"), "speaker_id").rows()
    ) == {r["path"].removesuffix(".mp3"): r["client_id"] for r in rows}
    seconds = {r["path"].removesuffix(".mp3"): r["seconds"] for r in rows}
    for segment_id, duration in master.select("segment_id", "duration").rows():
        assert duration == pytest.approx(seconds[segment_id.removeprefix("hi/")], abs=1e-9)


def test_a_tsv_without_a_sentence_column_names_its_file_and_its_columns(tmp_path):
    tsv = tmp_path / "train.tsv"
    tsv.write_text("client_id\tpath\ttext\nc1\ta.mp3\thello\n", encoding="utf-8")
    with pytest.raises(
        ManifestError, match=rf"{tsv}:1: no sentence column: .* has 'client_id', 'path', 'text'"
    ):
        build(tmp_path, f"cv:{tsv}")


def test_a_utf16_tsv_is_one_error_naming_it(tmp_path):
    folder = cv.write_release(tmp_path / "cv", "hi", cv.clip_rows("hi", 2, "train"))
    tsv = folder / "train.tsv"
    tsv.write_bytes(tsv.read_text(encoding="utf-8").encode("utf-16"))
    with pytest.raises(ManifestError, match=rf"{tsv}: UTF-16 text .*re-save it as UTF-8"):
        build(tmp_path, f"cv:{tsv}")


def test_validated_alone_still_holds_the_release_test_clips_and_speakers_out_of_train(tmp_path):
    """splits=validated: every validated clip, the release's own test and dev clips kept in their
    splits; a validated clip outside the release splits by a test speaker leaves train."""
    from scripts import make_train_val as mtv

    rows = cv.clip_rows("hi", 8, "train") + cv.clip_rows("hi", 3, "dev", 8)
    rows += cv.clip_rows("hi", 3, "test", 11)
    for i, r in enumerate(rows):
        r["client_id"] = {"train": f"t{i % 2}", "dev": "d", "test": "x"}[r["split"]]
    folder = cv.write_release(tmp_path / "cv", "hi", rows)
    extra = cv.clip_rows("hi", 2, "train", 14)  # validated, in no release split
    extra[0]["client_id"] = "x"  # recorded by the test speaker
    with (folder / "validated.tsv").open("a", encoding="utf-8") as f:
        f.writelines(cv.tsv_line(r) + "\n" for r in extra)
    for k, r in enumerate(extra):
        (folder / "clips" / r["path"]).write_bytes(cv.mp3(r["seconds"], 100 + k))
    master, summary = build(tmp_path, f"cv:{folder}:splits=validated")
    assert master.height == len(rows) + len(extra)
    assert summary["sources"][0]["left_out"] == {"in_train_dev_or_test": 6}  # dev + test again
    mtv.make_train_val(
        tmp_path / "master.parquet",
        tmp_path / "train.parquet",
        tmp_path / "val.parquet",
        test_path=tmp_path / "test.parquet",
        languages=(),
    )
    clip = pl.col("segment_id").str.replace(r"^hi/", "") + ".mp3"
    sides = {
        s: set(pl.read_parquet(tmp_path / f"{s}.parquet").select(clip).to_series())
        for s in ("train", "val", "test")
    }
    by_split = {s: {r["path"] for r in rows if r["split"] == s} for s in ("train", "dev", "test")}
    assert sides["test"] == by_split["test"] and sides["val"] == by_split["dev"]
    assert sides["train"] == by_split["train"] | {extra[1]["path"]}


def strip_length_frame(clip: Path) -> None:
    """Leave out an MP3's first frame, the Xing header libsndfile writes its length in: the file
    an encoder writing to a pipe leaves."""
    data = clip.read_bytes()
    kbps = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)[data[2] >> 4]
    length = 144_000 * kbps // cv.RATE + (data[2] >> 1 & 1)  # MPEG-1 layer III at 48 kHz
    assert b"Xing" in data[:length] or b"Info" in data[:length]
    clip.write_bytes(data[length:])


def test_clip_durations_counting_the_encoders_delay_and_padding_frames_are_kept(tmp_path):
    # measured: a duration counted from an MP3's frames exceeds its length by 24-48 ms at 48 kHz
    # and 37-71 ms at 32 kHz (the encoder's delay and padding, which a Xing header trims)
    rows = cv.clip_rows("hi", 4, "train")
    folder = cv.write_release(tmp_path / "cv", "hi", rows)
    padded = [f"{r['path']}\t{round(r['seconds'] * 1000) + 71}" for r in rows]
    (folder / "clip_durations.tsv").write_text("\n".join(["clip\tduration[ms]", *padded]) + "\n")
    master, summary = build(tmp_path, f"cv:{folder}:check=header")
    assert master.height == 4 and dropped(summary) == []


def test_a_vbr_mp3_without_its_length_header_is_dropped_naming_why(tmp_path):
    rows = cv.clip_rows("hi", 3, "train")
    for r in rows:
        r["seconds"] = 4.0
    folder = cv.write_release(tmp_path / "cv", "hi", rows)
    strip_length_frame(folder / "clips" / rows[1]["path"])
    master, summary = build(tmp_path, f"cv:{folder}")
    assert master.height == 2
    assert dropped(summary) == [(f"{folder / 'train.tsv'}:3", "duration_mismatch")]
    detail = summary["sources"][0]["dropped_examples"][0]["detail"]
    assert "duration 4 s, the audio holds" in detail
    assert "an MP3 without a Xing/Info header" in detail and "decodes a variable-bitrate" in detail
