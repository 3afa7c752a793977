"""Importing NeMo JSON (plain and tarred), Hugging Face audio parquet and Kaldi data directories
with build_manifest.py: rows, languages, audio written once as FLAC, and bad rows dropped and
reported with their file and line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import soundfile as sf

import build_manifest as bm
import source_readers
from manifest_schema import ManifestError, summary_path
from tests import byod_factory as byod

REPO = Path(__file__).resolve().parents[1]


def build(tmp_path, *sources, **kwargs):
    output = tmp_path / "master.parquet"
    kwargs.setdefault("languages", ())
    kwargs.setdefault("min_duration", 0.1)
    kwargs.setdefault("max_duration", 30.0)
    kwargs.setdefault("min_quality", 0.0)
    summary = bm.build_manifest(
        None,
        output,
        sources=list(sources),
        audio_dir=tmp_path / "imported",
        workers=2,
        progress=False,
        **kwargs,
    )
    return pl.read_parquet(output), summary


def dropped_rows(summary) -> list[tuple[str, str]]:
    return [(b["origin"], b["reason"]) for s in summary["sources"] for b in s["dropped_examples"]]


# --- source specs --------------------------------------------------------------------------
def test_a_source_spec_takes_kind_path_and_options(tmp_path):
    (tmp_path / "train.json").write_text("")
    spec = source_readers.parse_source(f"nemo:{tmp_path}/train.json:lang=hi,name=cv_hi")
    assert (spec.kind, spec.path, spec.name) == ("nemo", tmp_path / "train.json", "cv_hi")
    assert spec.options == {"lang": "hi", "name": "cv_hi"}
    assert source_readers.parse_source(f"nemo:{tmp_path}/train.json").name == "train"


@pytest.mark.parametrize(
    "text, message",
    [
        ("csv:/x", "KIND one of"),
        ("nemo:{tmp}/train.json:colour=red", "unknown option"),
        ("nemo:{tmp}/absent.json", "does not exist"),
        ("nemo:{tmp}/train.json:check=everything", "check must be"),
    ],
)
def test_a_bad_source_spec_is_one_clear_error(tmp_path, text, message):
    (tmp_path / "train.json").write_text("")
    with pytest.raises(ManifestError, match=message):
        source_readers.parse_source(text.format(tmp=tmp_path))


def test_two_sources_with_one_name_are_refused(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "train.json").write_text("")
    with pytest.raises(ManifestError, match="name=..."):
        bm.sources_of([f"nemo:{tmp_path}/a/train.json", f"nemo:{tmp_path}/b/train.json"], None)


def test_nemo_tar_patterns_expand_as_nemo_expands_them():
    assert source_readers.expand_tar_pattern("a/audio_{0..2}.tar") == [
        "a/audio_0.tar",
        "a/audio_1.tar",
        "a/audio_2.tar",
    ]
    assert source_readers.expand_tar_pattern("audio__OP_3..4_CL_.tar") == [
        "audio_3.tar",
        "audio_4.tar",
    ]


# --- NeMo JSON -----------------------------------------------------------------------------
def test_a_nemo_manifest_becomes_master_rows_with_resolved_audio_paths(tmp_path):
    utts = byod.utterances(3)
    manifest = byod.write_nemo_json(tmp_path / "cv", utts)
    manifest.write_text(manifest.read_text().replace('"clips/', '"./clips/', 1))
    master, summary = build(tmp_path, f"nemo:{manifest}:name=cv")
    assert master.height == 6 and summary["rows_in"] == 6
    assert set(master.get_column("source")) == {"cv"}
    first = master.filter(pl.col("segment_id") == "cv:1").row(0, named=True)
    assert first["audio_filepath"] == str((tmp_path / "cv" / "clips" / "en000.wav").absolute())
    assert first["text"] == "<|en|> hello world 0" and first["speaker_id"] == "en-spk0"
    assert first["shard_id"] == "cv/clips" and first["tx_quality_score"] is None
    assert os.path.isfile(first["audio_filepath"])


def test_bad_nemo_rows_are_dropped_counted_and_reported_with_file_and_line(tmp_path):
    utts = byod.utterances(4, langs=("en",))
    manifest = byod.write_nemo_json(tmp_path, utts)
    lines = manifest.read_text().splitlines()
    wrong = json.loads(lines[1])
    wrong["duration"] = 9.0  # the audio holds 1.3 s
    lines[1] = json.dumps(wrong)
    lines.insert(2, "{not json")
    lines.append(json.dumps({"text": "no audio path", "duration": 1.0}))
    lines.append(json.dumps({"audio_filepath": "clips/en000.wav", "duration": 1.0}))
    lines.append(json.dumps({"audio_filepath": "clips/absent.wav", "text": "x", "duration": 1.0}))
    manifest.write_text("\n".join(lines) + "\n")
    master, summary = build(tmp_path, f"nemo:{manifest}")
    assert dropped_rows(summary) == [
        (f"{manifest}:2", "duration_mismatch"),
        (f"{manifest}:3", "not_json"),
        (f"{manifest}:6", "audio_path_missing"),
        (f"{manifest}:7", "transcript_missing"),
        (f"{manifest}:8", "audio_not_found"),
    ]
    assert master.height == 3
    assert summary["rows_in"] == 8 and summary["dropped"]["not_json"] == 1
    printed = bm.format_summary(summary, tmp_path / "master.parquet")
    assert f"DROPPED {manifest}:3: not_json" in printed


def test_strict_makes_the_first_bad_row_an_error_and_writes_nothing(tmp_path):
    manifest = byod.write_nemo_json(tmp_path, byod.utterances(2, langs=("en",)))
    manifest.write_text(manifest.read_text() + "{oops\n")
    with pytest.raises(ManifestError, match=rf"{manifest}:3: not_json"):
        build(tmp_path, f"nemo:{manifest}", strict=True)
    assert not (tmp_path / "master.parquet").exists()


def test_durations_come_from_the_audio_header_when_the_manifest_has_none(tmp_path):
    manifest = byod.write_nemo_json(tmp_path, byod.utterances(2, langs=("en",)))
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    for row in rows:
        del row["duration"]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, _ = build(tmp_path, f"nemo:{manifest}")
    assert master.sort("segment_id").get_column("duration").to_list() == pytest.approx([1.0, 1.3])


def test_check_exists_trusts_given_durations_but_still_finds_missing_files(tmp_path):
    manifest = byod.write_nemo_json(tmp_path, byod.utterances(3, langs=("en",)))
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    rows[0]["duration"] = 9.0
    rows[2]["audio_filepath"] = "clips/absent.wav"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}:check=exists")
    assert master.sort("segment_id").get_column("duration").to_list() == [9.0, 1.3]
    assert dropped_rows(summary) == [(f"{manifest}:3", "audio_not_found")]


def test_check_none_trusts_rows_with_durations_and_reads_the_rest(tmp_path):
    manifest = byod.write_nemo_json(tmp_path, byod.utterances(2, langs=("en",)))
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    rows[0]["audio_filepath"] = "clips/absent.wav"  # trusted: kept
    del rows[1]["duration"]  # read from the header
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}:check=none")
    assert master.sort("segment_id").get_column("duration").to_list() == pytest.approx([1.0, 1.3])
    assert not dropped_rows(summary)


def test_language_comes_from_the_option_then_the_field_then_the_script(tmp_path):
    for k in range(3):
        (tmp_path / f"{k}.wav").write_bytes(byod.audio(1.0, k))
    rows = [
        {"audio_filepath": "0.wav", "duration": 1.0, "sentence": "வணக்கம் உலகம்"},
        {"audio_filepath": "1.wav", "duration": 1.0, "sentence": "hello", "locale": "EN"},
        {"audio_filepath": "2.wav", "duration": 1.0, "sentence": "नमस्ते"},  # Devanagari: unknown
    ]
    manifest = tmp_path / "m.json"
    manifest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}")
    assert dict(master.select("segment_id", "lang").iter_rows()) == {"m:1": "ta", "m:2": "en"}
    assert summary["dropped"] == {"language_unknown": 1}
    master, _ = build(tmp_path, f"nemo:{manifest}:lang=hi")
    assert set(master.get_column("lang")) == {"hi"} and master.height == 3


def test_min_quality_applies_only_to_sources_with_a_score(tmp_path):
    manifest = byod.write_nemo_json(tmp_path / "a", byod.utterances(2, langs=("en",)))
    scored = tmp_path / "b" / "scored.json"
    scored.parent.mkdir()
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    for row, score in zip(rows, (0.2, 0.9)):
        row["audio_filepath"] = str(manifest.parent / row["audio_filepath"])
        row["tx_quality_score"] = score
    scored.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}", f"nemo:{scored}", min_quality=0.5)
    assert master.group_by("source").len().sort("source").rows() == [("manifest", 2), ("scored", 1)]
    assert summary["dropped"] == {"quality_below_min": 1}


def test_a_tarred_nemo_manifest_is_written_out_once_as_flac(tmp_path):
    utts = byod.utterances(3)
    manifest, tars = byod.write_nemo_tarred(tmp_path / "tarred", utts)
    master, summary = build(tmp_path, f"nemo:{manifest}:tars={tars},name=t")
    assert master.height == 6 and not summary["sources"][0]["rows_dropped"]
    for row in master.iter_rows(named=True):
        info = sf.info(row["audio_filepath"])
        assert row["audio_filepath"].endswith(".flac") and info.format == "FLAC"
        assert info.frames / info.samplerate == pytest.approx(row["duration"], abs=0.01)
    assert {r["shard_id"] for r in master.iter_rows(named=True)} == {
        "t/00000_audio_0",
        "t/00001_audio_1",
    }
    # a rerun finds every tar done and writes nothing again
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "imported").rglob("*.flac")}
    again, _ = build(tmp_path, f"nemo:{manifest}:tars={tars},name=t")
    assert again.equals(master)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "imported").rglob("*.flac")} == written


def test_a_tarred_row_whose_member_is_in_no_tar_is_a_bad_row(tmp_path):
    manifest, tars = byod.write_nemo_tarred(tmp_path / "tarred", byod.utterances(2, langs=("en",)))
    manifest.write_text(
        manifest.read_text()
        + json.dumps({"audio_filepath": "gone.wav", "text": "x", "duration": 1, "shard_id": 0})
        + "\n"
    )
    master, summary = build(tmp_path, f"nemo:{manifest}:tars={tars}")
    assert master.height == 2
    assert dropped_rows(summary) == [(f"{manifest}:3", "audio_not_found")]


# --- Hugging Face parquet ------------------------------------------------------------------
def test_hf_parquet_audio_is_written_as_flac_with_common_voice_field_names(tmp_path):
    folder = byod.write_hf_parquet(tmp_path / "hf", byod.utterances(3))
    master, summary = build(tmp_path, f"hf:{folder}:name=cv")
    assert master.height == 6 and summary["rows_in"] == 6
    assert set(master.get_column("lang")) == {"en", "hi"}
    assert master.get_column("speaker_id").null_count() == 0
    for row in master.iter_rows(named=True):
        info = sf.info(row["audio_filepath"])
        assert info.format == "FLAC"
        assert info.frames / info.samplerate == pytest.approx(row["duration"], abs=0.01)


def test_an_hf_file_without_audio_is_skipped_and_an_undecodable_row_reported(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "hf"
    folder.mkdir()
    pq.write_table(pa.table({"sentence": ["a"]}), folder / "a-no-audio.parquet")
    pq.write_table(
        pa.table(
            {
                "audio": [
                    {"bytes": byod.audio(1.0, 0), "path": "x.wav"},
                    {"bytes": b"not audio", "path": "y.wav"},
                ],
                "text": ["hello there", "broken"],
            }
        ),
        folder / "b.parquet",
    )
    master, summary = build(tmp_path, f"hf:{folder}:lang=en")
    assert master.height == 1
    assert summary["bad_shards"] == [
        {
            "path": str(folder / "a-no-audio.parquet"),
            "reason": "no audio column (a struct with the encoded bytes)",
        }
    ]
    assert dropped_rows(summary) == [(f"{folder / 'b.parquet'} row 1", "audio_unreadable")]


def test_an_hf_file_whose_name_is_not_utf8_is_skipped_and_named_by_its_bytes(tmp_path):
    import os

    folder = byod.write_hf_parquet(tmp_path / "hf", byod.utterances(3))
    second = folder / "train-00001-of-00002.parquet"
    os.rename(os.fsencode(second), os.fsencode(folder) + b"/train-caf\xe9.parquet")
    master, summary = build(tmp_path, f"hf:{folder}:name=cv")
    assert master.height == 3  # the other file's rows
    assert summary["bad_shards"] == [
        {
            "path": f"{folder}/train-caf\\xe9.parquet",
            "reason": "its name is not UTF-8 (such bytes shown as \\xNN): rename it in UTF-8 "
            "to import its rows",
        }
    ]


# --- Kaldi ---------------------------------------------------------------------------------
def test_kaldi_segments_are_cut_out_of_their_recordings(tmp_path):
    utts = byod.utterances(3)
    directory = byod.write_kaldi(tmp_path / "kaldi", utts)
    master, summary = build(tmp_path, f"kaldi:{directory}")
    assert master.height == 6 and summary["rows_in"] == 6
    seconds = {u["id"]: u["seconds"] for u in utts}
    for row in master.iter_rows(named=True):
        info = sf.info(row["audio_filepath"])
        utt = row["segment_id"].removeprefix("kaldi/")  # <source name>/<Kaldi utterance id>
        assert info.frames / info.samplerate == pytest.approx(
            seconds[utt.split("-", 2)[-1]], abs=0.01
        )
        assert row["speaker_id"] == utt.rsplit("-", 1)[0]
    assert set(master.get_column("lang")) == {"en", "hi"}


def test_kaldi_bad_lines_are_reported_with_file_and_line(tmp_path):
    directory = byod.write_kaldi(tmp_path / "kaldi", byod.utterances(2, langs=("en",)))
    with open(directory / "wav.scp", "a") as f:
        f.write("piped sox x.wav -t wav - |\n")
    with open(directory / "segments", "a") as f:
        f.write("late rec_en-spk0 0.0 99.0\nfrom_pipe piped 0 1\nno_text rec_en-spk0 0 0.5\n")
    with open(directory / "text", "a") as f:
        f.write("late too late\nfrom_pipe piped audio\n")
    master, summary = build(tmp_path, f"kaldi:{directory}:lang=en")
    segments = directory / "segments"
    assert master.height == 2
    assert dropped_rows(summary) == [
        (f"{segments}:3", "segment_past_end"),
        (f"{segments}:4", "audio_command"),
        (f"{segments}:5", "transcript_missing"),
    ]


def test_a_kaldi_directory_without_segments_uses_the_recordings_as_utterances(tmp_path):
    directory = tmp_path / "kaldi"
    directory.mkdir()
    for k in range(2):
        (directory / f"u{k}.wav").write_bytes(byod.audio(1.0 + k, k))
    (directory / "wav.scp").write_text("u0 u0.wav\nu1 u1.wav\n")
    (directory / "text").write_text("u0 hello one\nu1 hello two\n")
    master, _ = build(tmp_path, f"kaldi:{directory}")
    assert master.sort("segment_id").get_column("duration").to_list() == pytest.approx([1.0, 2.0])
    assert master.get_column("audio_filepath").to_list() == [
        str((directory / f"u{k}.wav").absolute()) for k in range(2)
    ]
    assert set(master.get_column("lang")) == {"en"}  # from the script: Latin


# --- several sources -----------------------------------------------------------------------
def test_several_sources_make_one_master_with_their_names_in_the_source_column(tmp_path):
    utts = byod.utterances(2)
    nemo = byod.write_nemo_json(tmp_path / "nemo", utts)
    hf = byod.write_hf_parquet(tmp_path / "hf", utts, files=1)
    kaldi = byod.write_kaldi(tmp_path / "kaldi", utts)
    master, summary = build(tmp_path, f"nemo:{nemo}:name=n", f"hf:{hf}:name=h", f"kaldi:{kaldi}")
    assert master.group_by("source").len().sort("source").rows() == [
        ("h", 4),
        ("kaldi", 4),
        ("n", 4),
    ]
    assert master.get_column("source").to_list() == ["n"] * 4 + ["h"] * 4 + ["kaldi"] * 4
    assert [s["name"] for s in summary["sources"]] == ["n", "h", "kaldi"]
    saved = json.loads(summary_path(tmp_path / "master.parquet").read_text())
    assert saved["settings"]["sources"][0] == f"nemo:{nemo}:name=n"


def test_the_cli_imports_a_source_and_prints_its_bad_rows(tmp_path, capsys):
    manifest = byod.write_nemo_json(tmp_path, byod.utterances(2, langs=("en",)))
    manifest.write_text(manifest.read_text() + "{oops\n")
    code = bm.main(
        ["--source", f"nemo:{manifest}", "--output", str(tmp_path / "m.parquet"), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0 and f"DROPPED {manifest}:3: not_json" in out
    assert pl.read_parquet(tmp_path / "m.parquet").height == 2


def test_files_are_found_by_listing_their_folder_when_many_rows_share_it(tmp_path):
    for k in range(40):
        (tmp_path / f"{k}.wav").touch()
    paths = [str(tmp_path / f"{k}.wav") for k in range(40)] + [str(tmp_path / "absent.wav")]
    paths += [str(tmp_path / "elsewhere" / "x.wav")]
    found = source_readers.standard_rows._exists(paths, workers=2)
    assert found.tolist() == [True] * 40 + [False, False]


def test_a_manifest_read_in_many_batches_gives_the_same_rows_and_lines(tmp_path, monkeypatch):
    manifest = byod.write_nemo_json(tmp_path, byod.utterances(6))
    lines = manifest.read_text().splitlines()
    lines.insert(7, "{oops")
    manifest.write_text("\n".join(lines) + "\n")
    whole, summary = build(tmp_path, f"nemo:{manifest}")
    monkeypatch.setattr(source_readers.nemo_json, "_CHUNK_BYTES", 400)  # a few lines per batch
    batched, batched_summary = build(tmp_path, f"nemo:{manifest}")
    assert batched.sort("segment_id").equals(whole.sort("segment_id")) and whole.height == 12
    assert dropped_rows(batched_summary) == dropped_rows(summary) == [(f"{manifest}:8", "not_json")]


def test_nemo_rows_with_an_offset_are_cut_out_of_their_file(tmp_path):
    long = tmp_path / "long.wav"
    long.write_bytes(byod.audio(5.0, 1))  # 44.1 kHz stereo
    rows = [
        {"audio_filepath": "long.wav", "offset": 0.5, "duration": 1.5, "text": "first part"},
        {"audio_filepath": "long.wav", "offset": 2.0, "duration": 2.0, "text": "second part"},
        {"audio_filepath": "long.wav", "offset": 4.5, "duration": 2.0, "text": "past the end"},
    ]
    manifest = tmp_path / "segments.json"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}:lang=en")
    assert master.sort("segment_id").get_column("duration").to_list() == pytest.approx([1.5, 2.0])
    for row in master.iter_rows(named=True):
        info = sf.info(row["audio_filepath"])
        assert info.format == "FLAC" and info.samplerate == 44100
        assert info.frames / info.samplerate == pytest.approx(row["duration"], abs=0.01)
    assert dropped_rows(summary) == [(f"{manifest}:3", "segment_past_end")]
    # a rerun with one more segment cuts again instead of trusting the old marker
    rows.append({"audio_filepath": "long.wav", "offset": 0.0, "duration": 0.5, "text": "start"})
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, _ = build(tmp_path, f"nemo:{manifest}:lang=en")
    assert master.height == 3


# --- identity of imported rows ---------------------------------------------------------------
def split(tmp_path, **kwargs) -> dict:
    from scripts import make_train_val as mtv

    options = dict(val_per_lang=3, seed=1, languages=(), allow_short_val=True)
    return mtv.make_train_val(
        tmp_path / "master.parquet",
        tmp_path / "train.parquet",
        tmp_path / "val.parquet",
        **(options | kwargs),
    )


def numbered_utterances(lang: str, n: int) -> list[dict]:
    utts = byod.utterances(n, langs=(lang,))
    for i, u in enumerate(utts):
        u["text"] = f"{u['text']} {i}" if lang == "hi" else u["text"]  # no two texts alike
    return utts


def test_two_sources_numbering_their_rows_alike_keep_every_row_through_the_split(tmp_path):
    sources = []
    for lang in ("en", "hi"):
        utts = numbered_utterances(lang, 12)
        folder = byod.write_hf_parquet(tmp_path / lang, utts, files=1, ids=list(range(12)))
        sources.append(f"hf:{folder}:name={lang}")
    master, summary = build(tmp_path, *sources)
    assert master.height == 24 and master.get_column("segment_id").n_unique() == 24
    assert summary["duplicate_segment_ids"]["ids"] == 0
    assert set(master.filter(pl.col("source") == "hi").get_column("segment_id")) == {
        f"hi/{i}" for i in range(12)
    }
    result = split(tmp_path)
    assert result["rows_in"] == 24 and result["dropped"] == {}
    assert result["kept_by_lang"]["hi"] + result["val_by_lang"]["hi"] == 12


def test_segment_ids_of_an_imported_source_are_the_same_on_a_rerun(tmp_path):
    manifest = byod.write_nemo_json(tmp_path / "cv", byod.utterances(3))
    first, _ = build(tmp_path, f"nemo:{manifest}:name=cv")
    again, _ = build(tmp_path, f"nemo:{manifest}:name=cv")
    assert first.get_column("segment_id").to_list() == again.get_column("segment_id").to_list()
    assert first.get_column("segment_id").to_list()[:2] == ["cv:1", "cv:2"]  # line numbers


def test_rows_whose_id_field_is_null_take_their_place_in_the_source_as_id(tmp_path):
    utts = numbered_utterances("en", 4)
    folder = byod.write_hf_parquet(tmp_path / "hf", utts, files=1, ids=["a", None, "", "1"])
    master, _ = build(tmp_path, f"hf:{folder}:name=h")
    assert sorted(master.get_column("segment_id")) == [
        "h/1",
        "h/a",
        "h:train-00000-of-00001:1",
        "h:train-00000-of-00001:2",
    ]


def test_an_own_id_repeated_within_a_source_does_not_merge_two_recordings(tmp_path):
    # FLEURS' id numbers sentences: several speakers read the same one
    utts = numbered_utterances("en", 3)
    manifest = byod.write_nemo_json(tmp_path / "f", utts)
    rows = [json.loads(x) | {"id": 7} for x in manifest.read_text().splitlines()]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}:name=f")
    assert sorted(master.get_column("segment_id")) == ["f/7", "f:2", "f:3"]
    assert summary["duplicate_segment_ids"]["ids"] == 0
    assert split(tmp_path, val_per_lang=0)["dropped"] == {}


def test_a_source_name_with_a_slash_or_colon_is_refused(tmp_path):
    (tmp_path / "a:b.json").write_text("")
    with pytest.raises(ManifestError, match="name 'a:b' must be non-empty without '/' or ':'"):
        source_readers.parse_source(f"nemo:{tmp_path}/a:b.json")


# --- Kaldi tables ----------------------------------------------------------------------------
def test_kaldi_tables_separated_by_tabs_import_every_utterance(tmp_path):
    directory = byod.write_kaldi(tmp_path / "kaldi", byod.utterances(2))
    for name in ("wav.scp", "segments", "text", "utt2spk", "utt2lang"):
        path = directory / name
        path.write_text(
            "".join(line.replace(" ", "\t", 1) + "\n" for line in path.read_text().splitlines())
        )
    master, summary = build(tmp_path, f"kaldi:{directory}")
    assert master.height == 4 and not dropped_rows(summary)
    assert master.get_column("speaker_id").null_count() == 0


def test_a_kaldi_line_that_is_not_utf8_is_a_bad_row_with_file_and_line(tmp_path):
    directory = byod.write_kaldi(tmp_path / "kaldi", byod.utterances(2, langs=("en",)))
    text = directory / "text"
    lines = text.read_bytes().splitlines()
    key = lines[1].split()[0]
    lines[1] = key + " caf\xe9 au lait".encode("latin-1")
    text.write_bytes(b"\n".join(lines) + b"\n")
    master, summary = build(tmp_path, f"kaldi:{directory}:lang=en")
    assert master.height == 1
    assert dropped_rows(summary) == [(f"{text}:2", "not_utf8")]
    assert f"kaldi/{key.decode()}" not in master.get_column("segment_id").to_list()


# --- tar members -----------------------------------------------------------------------------
def test_tar_members_whose_names_flatten_alike_are_each_imported_with_their_own_audio(tmp_path):
    import io
    import tarfile

    members = {"spk1/utt.wav": 1.0, "spk1__utt.wav": 1.3, "x.wav": 1.6, "x.flac": 1.9}
    with tarfile.open(tmp_path / "audio_0.tar", "w") as tar:
        for k, (name, seconds) in enumerate(members.items()):
            data = byod.audio(seconds, k, "FLAC" if name.endswith(".flac") else "WAV")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    manifest = tmp_path / "tarred.json"
    rows = [
        {"audio_filepath": name, "duration": seconds, "text": f"utterance {k}", "shard_id": 0}
        for k, (name, seconds) in enumerate(members.items())
    ]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}:tars={tmp_path}/audio_{{0..0}}.tar")
    assert master.height == 4 and not summary["dropped"]
    assert master.get_column("audio_filepath").n_unique() == 4
    for row in master.iter_rows(named=True):
        info = sf.info(row["audio_filepath"])
        assert info.frames / info.samplerate == pytest.approx(row["duration"], abs=0.01)


# --- offsets ---------------------------------------------------------------------------------
def test_a_negative_nemo_offset_is_a_bad_row_with_its_reason_and_line(tmp_path):
    (tmp_path / "long.wav").write_bytes(byod.audio(3.0, 0))
    rows = [
        {"audio_filepath": "long.wav", "offset": 0.5, "duration": 1.0, "text": "kept"},
        {"audio_filepath": "long.wav", "offset": -0.5, "duration": 0.4, "text": "before start"},
        {"audio_filepath": "long.wav", "offset": "soon", "duration": 0.4, "text": "no number"},
    ]
    manifest = tmp_path / "segments.json"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    master, summary = build(tmp_path, f"nemo:{manifest}:lang=en")
    assert master.get_column("text").to_list() == ["<|en|> kept"]
    assert dropped_rows(summary) == [
        (f"{manifest}:2", "segment_invalid"),
        (f"{manifest}:3", "segment_invalid"),
    ]
    details = [b["detail"] for b in summary["sources"][0]["dropped_examples"]]
    assert "start -0.5 s" in details[0] and "'soon' is not a number" in details[1]


def test_a_kaldi_segment_starting_before_zero_is_a_bad_row(tmp_path):
    directory = byod.write_kaldi(tmp_path / "kaldi", byod.utterances(2, langs=("en",)))
    with open(directory / "segments", "a") as f:
        f.write("early rec_en-spk0 -0.5 0.4\n")
    with open(directory / "text", "a") as f:
        f.write("early too early\n")
    master, summary = build(tmp_path, f"kaldi:{directory}:lang=en")
    assert master.height == 2
    assert dropped_rows(summary) == [(f"{directory / 'segments'}:3", "segment_invalid")]


# --- a source that gives nothing -------------------------------------------------------------
def test_paths_relative_to_the_working_directory_exit_non_zero_naming_the_folder_tried(
    tmp_path, monkeypatch, capsys
):
    data = tmp_path / "corpus"
    manifest = byod.write_nemo_json(data, byod.utterances(2, langs=("en",)))
    (tmp_path / "lists").mkdir()
    moved = manifest.rename(tmp_path / "lists" / "train.json")  # paths stay relative to corpus/
    monkeypatch.chdir(data)
    output = tmp_path / "m.parquet"
    code = bm.main(["--source", f"nemo:{moved}", "--output", str(output), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and not output.exists()
    assert f"resolve against {moved.parent}" in err
    assert f"{moved.parent}/clips/en000.wav" in err and len(err.strip().splitlines()) == 1


def test_a_build_that_keeps_no_row_exits_non_zero_with_the_reason(tmp_path, monkeypatch, capsys):
    manifest = byod.write_nemo_json(tmp_path, byod.utterances(2, langs=("en",)))
    import config

    monkeypatch.setattr(config, "MIN_DURATION", 5.0)  # the clips hold 1.0 and 1.3 s
    output = tmp_path / "m.parquet"
    code = bm.main(["--source", f"nemo:{manifest}", "--output", str(output), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and not output.exists()
    assert "no row is left" in err and "duration_too_short 2" in err
    assert "MIN_DURATION=5 s" in err and len(err.strip().splitlines()) == 1


def test_an_hf_source_without_a_language_column_is_told_to_add_lang(tmp_path):
    hi = byod.write_hf_parquet(tmp_path / "hi", numbered_utterances("hi", 3), locale=False)
    en = byod.write_nemo_json(tmp_path / "en", byod.utterances(2, langs=("en",)))
    master, summary = build(tmp_path, f"hf:{hi}:name=hi", f"nemo:{en}:name=en")
    assert summary["dropped"] == {"language_unknown": 3}
    printed = bm.format_summary(summary, tmp_path / "master.parquet")
    assert f"add :lang=xx to the source, e.g. --source 'hf:{hi}:name=hi,lang=xx'" in printed


# --- the summary of what each source lost ----------------------------------------------------
def run_build(tmp_path, *sources: str, **settings: str) -> tuple[str, dict]:
    """build_manifest.py as a user runs it (config knobs as environment variables): its printed
    summary and its summary JSON."""
    output = tmp_path / "master.parquet"
    args = [sys.executable, "build_manifest.py", "--no-progress", "--output", str(output)]
    args += [arg for source in sources for arg in ("--source", source)]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "IMPORTED_AUDIO_DIR": str(tmp_path / "imported"),
        "LANGUAGES": "",
        "MIN_DURATION": "0.1",
        "MAX_DURATION": "30",
        "MIN_QUALITY": "0",
        **settings,
    }
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout, json.loads(summary_path(output).read_text())


def test_every_row_a_source_loses_is_counted_and_listed_with_its_file_and_line(tmp_path):
    nemo_utts = byod.utterances(3)
    for u in nemo_utts:
        u["seconds"] = 1.3
    manifest = byod.write_nemo_json(tmp_path / "nemo", nemo_utts)
    lines = manifest.read_text().splitlines()
    lines[2] = "{not json"
    empty = json.loads(lines[4])
    empty["text"] = "<noise> ..."
    lines[4] = json.dumps(empty, ensure_ascii=False)
    manifest.write_text("\n".join(lines) + "\n")
    hf_utts = byod.utterances(5)  # the 1.0 s clips: data/train-00000 row 0, train-00001 row 2
    folder = byod.write_hf_parquet(tmp_path / "hf", hf_utts, ids=[u["id"] for u in hf_utts])

    out, summary = run_build(
        tmp_path, f"nemo:{manifest}:name=cv", f"hf:{folder}:name=fl", MIN_DURATION="1.1"
    )

    cv, fl = summary["sources"]
    first, second = (folder / f"train-0000{k}-of-00002.parquet" for k in (0, 1))
    assert [(b["origin"], b["reason"]) for b in cv["dropped_examples"]] == [
        (f"{manifest}:3", "not_json"),
        (f"{manifest}:5", "empty_after_cleaning"),
    ]
    assert [(b["origin"], b["reason"]) for b in fl["dropped_examples"]] == [
        (f"{first} row 0", "duration_too_short"),
        (f"{second} row 2", "duration_too_short"),
    ]
    assert (cv["rows_read"], cv["rows_kept"], cv["rows_dropped"]) == (6, 4, 2)
    assert (fl["rows_read"], fl["rows_kept"], fl["rows_dropped"]) == (10, 8, 2)
    assert cv["dropped"] == {"empty_after_cleaning": 1, "not_json": 1}
    assert summary["rows_in"] - summary["rows_out"] == sum(summary["dropped"].values()) == 4
    assert "source cv: 6 rows read, 4 kept, 2 dropped" in out
    assert f"DROPPED {manifest}:5: empty_after_cleaning (transcript '<noise> ...'" in out
    assert f"DROPPED {second} row 2: duration_too_short (1.0 s, below MIN_DURATION=1.1 s)" in out


def test_a_kaldi_row_a_filter_drops_is_listed_with_its_segments_line(tmp_path):
    directory = byod.write_kaldi(tmp_path / "kaldi", byod.utterances(2))
    out, summary = run_build(tmp_path, f"kaldi:{directory}", LANGUAGES="hi")
    segments = directory / "segments"
    (source,) = summary["sources"]
    assert source["dropped"] == {"language_not_selected": 2}
    assert [b["origin"] for b in source["dropped_examples"]] == [
        f"{segments}:1",
        f"{segments}:2",
    ]
    assert f"DROPPED {segments}:1: language_not_selected (language en is not in LANGUAGES)" in out


def test_a_source_losing_many_rows_prints_a_few_of_each_reason_and_counts_the_rest(tmp_path):
    utts = byod.utterances(10)
    manifest = byod.write_nemo_json(tmp_path, utts)
    out, summary = run_build(tmp_path, f"nemo:{manifest}", MIN_DURATION="1.5")
    (source,) = summary["sources"]
    short = sum(u["seconds"] < 1.5 for u in utts)
    assert source["dropped"] == {"duration_too_short": short} and short > 3
    assert out.count("DROPPED") == 3
    assert f"... and {short - 3} more duration_too_short" in out


# --- text encodings: a byte-order mark, a file that is not UTF-8 ------------------------------
UTF8_BOM = b"\xef\xbb\xbf"


def text_source(tmp_path: Path, kind: str) -> tuple[str, list[Path]]:
    """A source of ``kind`` (nemo, nemo_tarred, kaldi) under ``tmp_path``: its spec and its text
    files."""
    utts = byod.utterances(3)
    if kind == "nemo":
        manifest = byod.write_nemo_json(tmp_path / "nemo", utts)
        return f"nemo:{manifest}", [manifest]
    if kind == "nemo_tarred":
        manifest, tars = byod.write_nemo_tarred(tmp_path / "tarred", utts)
        return f"nemo:{manifest}:tars={tars}", [manifest]
    directory = byod.write_kaldi(tmp_path / "kaldi", utts)
    names = ("wav.scp", "segments", "text", "utt2spk", "utt2lang")
    return f"kaldi:{directory}", [directory / name for name in names]


def master_rows(master: pl.DataFrame) -> list[tuple]:
    columns = ("segment_id", "text", "lang", "speaker_id", "duration")
    return master.sort("segment_id").select(columns).rows()


@pytest.mark.parametrize("kind", ["nemo", "nemo_tarred", "kaldi"])
def test_text_files_saved_with_a_utf8_byte_order_mark_import_as_without(tmp_path, kind):
    spec, files = text_source(tmp_path / "plain", kind)
    expected, _ = build(tmp_path / "plain", spec)
    spec, files = text_source(tmp_path / "marked", kind)
    for path in files:
        path.write_bytes(UTF8_BOM + path.read_bytes())
    master, summary = build(tmp_path / "marked", spec)
    assert master_rows(master) == master_rows(expected) and not dropped_rows(summary)
    assert master.height == 6 and master.get_column("speaker_id").null_count() == 0


@pytest.mark.parametrize("kind", ["nemo", "nemo_tarred", "kaldi"])
def test_a_utf16_text_file_is_one_error_naming_it(tmp_path, kind):
    spec, files = text_source(tmp_path, kind)
    files[0].write_bytes(files[0].read_text(encoding="utf-8").encode("utf-16"))
    with pytest.raises(ManifestError, match=rf"{files[0]}: UTF-16 text .*re-save it as UTF-8"):
        build(tmp_path, spec)


def test_a_nemo_manifest_without_a_text_field_names_the_fields_it_has(tmp_path):
    manifest = byod.write_nemo_json(tmp_path / "nemo", byod.utterances(2))
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    for r in rows:
        r["words"] = r.pop("text")
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(ManifestError, match=rf"{manifest}: no text field .*it has .*words"):
        build(tmp_path, f"nemo:{manifest}")
