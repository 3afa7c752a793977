"""scripts/make_train_val.py: script-based tag correction, dedup, leak-free split, accounting."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manifest_schema import TAG_PATTERN, ManifestError, tag_prefix, tagged_text
from script_languages import detect_corrections
from scripts import make_train_val as mtv

REPO = Path(__file__).resolve().parents[1]


def row(
    segment_id: str,
    body: str = "नमस्ते दुनिया",
    lang: str = "hi",
    *,
    shard: str = "src/hi/s0",
    duration: float = 2.0,
    quality: float | None = 1.0,
    speaker: str | None = None,
) -> dict:
    return {
        "segment_id": segment_id,
        "shard_id": shard,
        "text": tagged_text(lang, body),
        "duration": duration,
        "lang": lang,
        "audio_filepath": f"/data/{shard}/{segment_id}.flac",
        "source": shard.split("/")[0],
        "tx_quality_score": quality,
        "speaker_id": speaker,
    }


def write_master(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "master_manifest.parquet"
    pl.DataFrame(
        rows,
        schema={
            "segment_id": pl.String,
            "shard_id": pl.String,
            "text": pl.String,
            "duration": pl.Float64,
            "lang": pl.String,
            "audio_filepath": pl.String,
            "source": pl.String,
            "tx_quality_score": pl.Float64,
            "speaker_id": pl.String,
        },
    ).write_parquet(path)
    return path


def run(tmp_path: Path, rows: list[dict], **kwargs) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    master = write_master(tmp_path, rows)
    options = dict(
        val_per_lang=0,
        seed=1,
        languages=(),
        threshold=0.9,
        max_val_fraction=0.5,
        allow_short_val=True,
    )
    options.update(kwargs)
    summary = mtv.make_train_val(
        master, tmp_path / "train.parquet", tmp_path / "val.parquet", **options
    )
    return (
        pl.read_parquet(tmp_path / "train.parquet"),
        pl.read_parquet(tmp_path / "val.parquet"),
        summary,
    )


def corrected(tmp_path: Path, body: str, given_lang: str, **kwargs) -> str:
    train, _, _ = run(tmp_path, [row("a", body, given_lang)], **kwargs)
    return train.item(0, "lang")


# --- language correction -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, given_lang, expected",
    [
        ("வணக்கம் நண்பரே", "hi", "ta"),
        ("నమస్కారం మిత్రమా", "kn", "te"),
        ("ನಮಸ್ಕಾರ ಗೆಳೆಯ", "te", "kn"),
        ("നമസ്കാരം സുഹൃത്തേ", "ta", "ml"),
        ("નમસ્તે મિત્ર", "hi", "gu"),
        ("ਸਤ ਸ੍ਰੀ ਅਕਾਲ", "hi", "pa"),
        ("ନମସ୍କାର ବନ୍ଧୁ", "bn", "or"),
        ("hello my friend", "hi", "en"),
        ("السلام علیکم دوست", "hi", "ur"),
        ("আমার সোনার বাংলা", "hi", "bn"),
    ],
)
def test_a_tag_contradicting_an_unambiguous_script_is_corrected(
    tmp_path, body, given_lang, expected
):
    assert corrected(tmp_path, body, given_lang) == expected


@pytest.mark.parametrize("letter", ["ৰ", "ৱ"])
def test_bengali_script_with_an_assamese_only_letter_becomes_as(tmp_path, letter):
    assert corrected(tmp_path, f"অসম{letter} মানুহ", "bn") == "as"


def test_bengali_script_without_assamese_letters_keeps_an_as_tag(tmp_path):
    assert corrected(tmp_path, "আমি ভাত খাই", "as") == "as"


def test_devanagari_is_left_as_tagged_even_under_a_foreign_tag(tmp_path):
    _, _, summary = run(tmp_path, [row("a", "नमस्ते दुनिया", "mr"), row("b", "नमस्ते दुनिया", "ta")])
    assert summary["lang_corrections"] == {}
    assert summary["unresolved_devanagari_conflicts"] == {"ta": 1}


def test_a_transcript_below_the_script_threshold_keeps_its_tag(tmp_path):
    assert corrected(tmp_path, "hello नमस्ते दुनिया", "hi") == "hi"
    assert corrected(tmp_path, "abcdefghi த", "ta", threshold=0.95) == "ta"


def test_digits_punctuation_dandas_and_joiners_do_not_vote(tmp_path):
    # Tamil letters only; Devanagari digits, a danda and a ZWJ would otherwise outvote them
    assert corrected(tmp_path, "௧௨ १२३४५६ । \u200d தமிழ்", "hi") == "ta"


def test_lang_and_the_text_prefix_change_together(tmp_path):
    train, _, _ = run(tmp_path, [row("a", "வணக்கம்", "hi"), row("b", "hello", "hi"), row("c")])
    for r in train.iter_rows(named=True):
        assert r["text"].startswith(tag_prefix(r["lang"]))
        assert len(re.findall(TAG_PATTERN, r["text"])) == 1
    assert train.filter(pl.col("segment_id") == "a").item(0, "text") == "<|ta|> வணக்கம்"


def test_lang_fixes_file_sets_tags_including_devanagari(tmp_path):
    fixes = tmp_path / "fixes.csv"
    fixes.write_text("segment_id,lang\na,mr\nb,ne\nmissing,hi\n")
    train, _, summary = run(
        tmp_path, [row("a"), row("b", "வணக்கம்", "hi"), row("c")], lang_fixes=fixes
    )
    langs = dict(train.select("segment_id", "lang").rows())
    assert langs == {"a": "mr", "b": "ne", "c": "hi"}
    assert train.filter(pl.col("segment_id") == "a").item(0, "text") == "<|mr|> नमस्ते दुनिया"
    assert summary["lang_fixes"]["unmatched_segment_ids"] == 1
    assert summary["lang_corrections_by_cause"]["lang_fixes"] == {"hi->mr": 1, "hi->ne": 1}


def test_a_lang_fixes_file_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    fixes = tmp_path / "fixes.csv"
    fixes.write_bytes(b"\xef\xbb\xbfsegment_id,lang\na,mr\n")
    train, _, _ = run(tmp_path, [row("a"), row("b")], lang_fixes=fixes)
    assert dict(train.select("segment_id", "lang").rows()) == {"a": "mr", "b": "hi"}
    fixes.write_bytes("segment_id,lang\na,mr\n".encode("utf-16"))
    with pytest.raises(mtv.SplitError, match=rf"--lang-fixes {fixes}: UTF-16 text"):
        run(tmp_path, [row("a")], lang_fixes=fixes)


def test_a_lang_fixes_file_without_the_header_is_rejected(tmp_path):
    fixes = tmp_path / "fixes.csv"
    fixes.write_text("id,language\na,mr\n")
    with pytest.raises(mtv.SplitError, match="segment_id,lang"):
        run(tmp_path, [row("a")], lang_fixes=fixes)


def test_the_confusion_table_is_printed_and_stored_in_the_summary(tmp_path, capsys):
    master = write_master(
        tmp_path,
        [row("a", "வணக்கம்", "hi"), row("b", "வணக்கம்", "hi", duration=3.0), row("c", "hello", "ta")],
    )
    code = mtv.main(
        [
            "--master",
            str(master),
            "--train",
            str(tmp_path / "t.parquet"),
            "--val",
            str(tmp_path / "v.parquet"),
            "--val-per-lang",
            "0",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "given" in out and "hi" in out and "ta" in out
    summary = json.loads((tmp_path / "t.summary.json").read_text())
    assert summary["lang_corrections"] == {"hi->ta": 2, "ta->en": 1}


def test_detection_counts_only_suspect_rows_in_every_script():
    bodies = pl.Series(["நன்றி"] * 3 + ["hello"])
    langs = pl.Series(["ta", "ta", "ta", "ta"])
    new, script = detect_corrections(bodies, langs, 0.9)
    assert new.to_list() == ["ta", "ta", "ta", "en"]
    assert script.to_list() == [None, None, None, "Latin"]


# --- dedup ---------------------------------------------------------------------------------------
def test_one_row_per_segment_id_keeps_the_best_quality(tmp_path):
    train, _, summary = run(
        tmp_path,
        [
            row("a", "पहला", quality=0.5),
            row("a", "दूसरा", quality=0.9),
            row("a", "तीसरा", quality=None),
        ],
    )
    assert train.get_column("text").to_list() == ["<|hi|> दूसरा"]
    assert summary["dropped"] == {"duplicate_segment_id": 2}


def test_exact_duplicates_of_lang_text_and_duration_are_dropped(tmp_path):
    train, _, summary = run(
        tmp_path,
        [row("a", quality=0.5), row("b", quality=0.9), row("c", duration=3.0), row("d", lang="mr")],
    )
    assert sorted(train.get_column("segment_id")) == ["b", "c", "d"]
    assert summary["dropped"] == {"duplicate_text": 1}


def test_rows_naming_one_audio_file_are_one_utterance_even_keeping_duplicate_texts(tmp_path):
    same_audio = row("b", quality=0.9) | {"audio_filepath": row("a")["audio_filepath"]}
    train, _, summary = run(
        tmp_path, [row("a", quality=0.5), same_audio, row("c")], keep_duplicate_texts=True
    )
    assert sorted(train.get_column("segment_id")) == ["b", "c"]
    assert summary["dropped"] == {"duplicate_audio": 1}


def test_keep_duplicate_texts_keeps_them(tmp_path):
    train, _, summary = run(tmp_path, [row("a"), row("b")], keep_duplicate_texts=True)
    assert train.height == 2 and summary["dropped"] == {}


def test_languages_setting_applies_to_corrected_tags(tmp_path):
    train, _, summary = run(tmp_path, [row("a"), row("b", "hello", "hi")], languages=("hi",))
    assert train.get_column("segment_id").to_list() == ["a"]
    assert summary["dropped_by_lang"] == {"en": {"language_not_selected": 1}}


# --- split ---------------------------------------------------------------------------------------
def corpus(
    n_speakers: int = 30, per_speaker: int = 5, langs=("hi", "ta"), speakers_per_shard: int = 4
) -> list[dict]:
    bodies = {"hi": "नमस्ते", "ta": "வணக்கம்"}
    rows = []
    for s in range(n_speakers):
        lang = langs[s % len(langs)]
        for k in range(per_speaker):
            rows.append(
                row(
                    f"{s}-{k}",
                    f"{bodies[lang]} {s} {k}",
                    lang,
                    shard=f"src/{lang}/s{s // speakers_per_shard}",
                    speaker=f"spk{s}",
                )
            )
    return rows


def test_validation_takes_val_per_lang_rows_per_language(tmp_path):
    _, val, summary = run(tmp_path, corpus(), val_per_lang=10)
    assert summary["val_by_lang"] == {"hi": 10, "ta": 10}
    assert val.height == 20


def test_no_speaker_and_no_segment_id_is_in_both_splits(tmp_path):
    train, val, _ = run(tmp_path, corpus(), val_per_lang=12)
    assert set(train.get_column("speaker_id")).isdisjoint(set(val.get_column("speaker_id")))
    assert set(train.get_column("segment_id")).isdisjoint(set(val.get_column("segment_id")))


def test_without_speakers_no_shard_is_in_both_splits(tmp_path):
    rows = [{**r, "speaker_id": None} for r in corpus(speakers_per_shard=2)]
    train, val, summary = run(tmp_path, rows, val_per_lang=10)
    assert set(train.get_column("shard_id")).isdisjoint(set(val.get_column("shard_id")))
    assert val.height > 0 and summary["split"]["grouped_by"] == "shard_id"


def test_a_master_without_a_speaker_column_is_split_by_shard(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "speaker_id"} for r in corpus(speakers_per_shard=2)]
    master = tmp_path / "master_manifest.parquet"
    pl.DataFrame(rows).write_parquet(master)
    assert "speaker_id" not in pl.read_parquet_schema(master)
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    code = mtv.main(["--master", str(master), "--train", str(train), "--val", str(val),
                     "--test", str(tmp_path / "test.parquet"), "--val-per-lang", "10"])  # fmt: skip
    assert code == 0
    train, val = pl.read_parquet(train), pl.read_parquet(val)
    assert train.height + val.height == len(rows) and val.height > 0
    assert set(train.get_column("shard_id")).isdisjoint(set(val.get_column("shard_id")))


def test_a_master_without_a_speaker_column_keeps_its_sources_splits_and_checks_audio_leaks(
    tmp_path,
):
    rows = [{k: v for k, v in r.items() if k != "speaker_id"} for r in released()]
    rows[0]["audio_filepath"] = rows[6]["audio_filepath"]  # train's hi0 is test's hi6
    train, val, test, summary = run_splits(tmp_path, rows)
    assert ids(train) == ["hi1", "hi2", "hi3"] and ids(val) == ["hi4", "hi5"]
    assert ids(test) == ["hi6", "hi7"]
    assert summary["leaks"]["rows"] == {"audio": {"train/test": 1}}
    assert summary["leaks"]["speakers"] == {}


def test_a_language_never_gives_more_than_the_cap_to_validation(tmp_path):
    _, val, summary = run(
        tmp_path, corpus(n_speakers=4, per_speaker=5), val_per_lang=100, max_val_fraction=0.5
    )
    assert summary["val_by_lang"] == {"hi": 5, "ta": 5}
    assert summary["val_shortfall"] == {}


def test_the_same_seed_gives_byte_identical_outputs(tmp_path):
    run(tmp_path, corpus(), val_per_lang=10, seed=7)
    first = [(tmp_path / n).read_bytes() for n in ("train.parquet", "val.parquet")]
    run(tmp_path, corpus(), val_per_lang=10, seed=7)
    assert [(tmp_path / n).read_bytes() for n in ("train.parquet", "val.parquet")] == first


def test_another_seed_picks_other_groups(tmp_path):
    _, val_a, _ = run(tmp_path, corpus(n_speakers=60), val_per_lang=10, seed=1)
    _, val_b, _ = run(tmp_path, corpus(n_speakers=60), val_per_lang=10, seed=2)
    assert set(val_a.get_column("speaker_id")) != set(val_b.get_column("speaker_id"))


def test_group_hash_is_a_fixed_function_of_seed_and_key():
    # a fixed value: Python's salted hash() would differ between processes
    assert int(mtv.group_hash(["speaker:a"], 1234)[0]) == 0x48F4B6CC947F9BFD
    assert mtv.group_hash(["speaker:a"], 1)[0] != mtv.group_hash(["speaker:a"], 2)[0]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["hi", "ta", "en"]),
            st.integers(0, 6),
            st.sampled_from([None, "spk1", "spk2", "spk3", "spk4"]),
            st.integers(0, 3),
            st.integers(0, 2),
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(0, 8),
    st.booleans(),
)
def test_rows_in_equal_train_plus_val_plus_dropped_and_no_leak(
    tmp_path, spec, val_per_lang, keep_dups
):
    bodies = {"hi": "नमस्ते", "ta": "வணக்கம்", "en": "hello"}
    rows = [
        row(
            f"seg{seg}",
            f"{bodies[lang]} {k}",
            lang,
            shard=f"src/{lang}/s{shard}",
            speaker=spk,
            duration=1.0 + k,
        )
        for i, (lang, seg, spk, shard, k) in enumerate(spec)
    ]
    train, val, summary = run(
        tmp_path, rows, val_per_lang=val_per_lang, keep_duplicate_texts=keep_dups
    )
    assert summary["rows_in"] == train.height + val.height + sum(summary["dropped"].values())
    assert train.get_column("segment_id").n_unique() == train.height
    assert set(train.get_column("segment_id")).isdisjoint(set(val.get_column("segment_id")))

    # Languages without any speaker whose every shard exceeds the quota are split per utterance.
    per_utterance = summary["split"]["grouped_by_utterance"]

    def group(f):
        speaker_or_shard = pl.coalesce(
            pl.concat_str(pl.lit("s:"), "speaker_id"), pl.concat_str(pl.lit("h:"), "shard_id")
        )
        return set(
            f.filter(~pl.col("lang").is_in(per_utterance)).select(speaker_or_shard).to_series()
        )

    assert group(train).isdisjoint(group(val))
    over = summary["split"]["groups_spanning_languages_taken"].get("rows_over_quota", {})
    for lang, n in summary["val_by_lang"].items():
        assert n <= val_per_lang + over.get(lang, 0)


# --- input and cli -------------------------------------------------------------------------------
def test_a_missing_master_manifest_exits_non_zero_naming_it(tmp_path, capsys):
    code = mtv.main(
        [
            "--master",
            str(tmp_path / "nope.parquet"),
            "--train",
            str(tmp_path / "t.parquet"),
            "--val",
            str(tmp_path / "v.parquet"),
        ]
    )
    assert code != 0 and "nope.parquet" in capsys.readouterr().err


def test_a_master_manifest_missing_columns_is_rejected(tmp_path):
    pl.DataFrame({"segment_id": ["a"], "text": ["<|hi|> x"]}).write_parquet(tmp_path / "m.parquet")
    with pytest.raises(mtv.SplitError, match="missing column"):
        mtv.make_train_val(tmp_path / "m.parquet", tmp_path / "t.parquet", tmp_path / "v.parquet")


def test_text_without_its_language_tag_is_rejected(tmp_path):
    bad = {**row("a"), "text": "नमस्ते"}
    with pytest.raises(mtv.SplitError, match="segment_id='a'"):
        run(tmp_path, [bad])


def test_help_shows_a_usage_example():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_train_val.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert "example" in result.stdout and "--lang-fixes" in result.stdout


# --- an unusable split is an error ---------------------------------------------------------------
def test_an_empty_master_is_an_error_not_a_traceback(tmp_path):
    with pytest.raises(mtv.SplitError, match="has no rows"):
        run(tmp_path, [])


def test_languages_that_no_row_has_are_an_error_naming_the_languages_of_the_data(tmp_path):
    rows = [row("a", "hello", "en"), row("b", "नमस्ते", "hi")]
    with pytest.raises(ManifestError, match=r"LANGUAGES=hindi,english keeps nothing.*are en, hi"):
        run(tmp_path, rows, languages=("hindi", "english"))


def test_a_language_no_row_has_is_warned_about_and_the_rest_is_kept(tmp_path, capsys):
    train, _, _ = run(
        tmp_path, [row("a", "hello", "en"), row("b", "नमस्ते", "hi")], languages=("hi", "xx")
    )
    assert train.get_column("lang").to_list() == ["hi"]
    assert "LANGUAGES lists xx, which no row" in capsys.readouterr().err


def test_a_language_with_one_speaker_gets_no_validation_and_that_is_an_error(tmp_path):
    rows = [row(f"t{k}", f"வணக்கம் {k}", "ta", speaker="only") for k in range(10)]
    rows += [row(f"h{k}", f"नमस्ते {k}", "hi", speaker=f"s{k}") for k in range(10)]
    with pytest.raises(mtv.SplitError, match=r"no validation rows for ta \(ta: its 10 rows are 1 "):
        run(tmp_path, rows, val_per_lang=2, allow_short_val=False)
    _, val, summary = run(tmp_path, rows, val_per_lang=2, allow_short_val=True)
    assert summary["val_by_lang"] == {"hi": 2} and summary["val_shortfall"] == {"ta": 2}


def test_a_quota_below_the_smallest_speaker_says_how_far_to_raise_it_and_that_value_works(
    tmp_path,
):
    rows = [row(f"t{k}", f"வணக்கம் {k}", "ta", speaker=f"ta{k % 3}") for k in range(9)]
    rows += [row(f"h{k}", f"नमस्ते {k}", "hi", speaker=f"s{k}") for k in range(10)]
    with pytest.raises(mtv.SplitError, match=r"raise --val-per-lang to at least 3 \(the smallest"):
        run(tmp_path, rows, val_per_lang=2, allow_short_val=False)
    _, val, summary = run(tmp_path, rows, val_per_lang=3, allow_short_val=False)
    assert summary["val_by_lang"]["ta"] == 3


def test_speakers_recorded_in_two_languages_still_give_each_language_validation(tmp_path):
    # every ur speaker also speaks English: 2 ur rows beside 20, 8, 5, ... en rows. A speaker group
    # goes whole to one side and en may take only 3, so no ur speaker fits every quota at once:
    # validation takes the one whose English overshoots least, and the summary says so
    rows = []
    for k, n_en in enumerate((20, 8, 5, 12, 9, 30)):
        rows += [row(f"u{k}_{i}", f"اردو متن {k} {i}", "ur", speaker=f"s{k}") for i in range(2)]
        rows += [
            row(f"e{k}_{i}", f"english text {k} {i}", "en", speaker=f"s{k}") for i in range(n_en)
        ]
    for k in range(4):
        rows += [row(f"o{k}_{i}", f"only english {k} {i}", "en", speaker=f"o{k}") for i in range(2)]
    train, val, summary = run(tmp_path, rows, val_per_lang=3, allow_short_val=False)
    taken = summary["split"]["groups_spanning_languages_taken"]
    assert taken == {"groups": 1, "languages": ["ur"], "rows_over_quota": {"en": 4}}
    assert set(val.filter(pl.col("lang") == "ur").get_column("speaker_id")) == {"s2"}  # 5 en rows
    assert summary["val_by_lang"] == {"en": 7, "ur": 2}  # 2 only-English rows + s2's 5
    # no speaker and no row is in both splits
    assert set(val.get_column("speaker_id")).isdisjoint(set(train.get_column("speaker_id")))
    assert val.join(train, on="segment_id", how="semi").is_empty()


def test_a_bilingual_speaker_is_taken_whole_even_past_its_own_languages_quota(tmp_path):
    rows = [row(f"u{i}", f"اردو {i}", "ur", speaker="bi") for i in range(4)]
    rows += [row(f"e{i}", f"english {i}", "en", speaker="bi") for i in range(4)]
    rows += [row(f"o{i}", f"only {i}", "en", speaker=f"o{i}") for i in range(4)]
    train, val, summary = run(tmp_path, rows, val_per_lang=2, allow_short_val=False)
    assert set(val.get_column("speaker_id")) >= {"bi"} and "bi" not in set(train["speaker_id"])
    over = summary["split"]["groups_spanning_languages_taken"]["rows_over_quota"]
    assert over["ur"] == 2 and summary["val_by_lang"]["ur"] == 4


def test_without_speaker_ids_large_shards_are_split_per_utterance_to_meet_the_quota(tmp_path):
    rows = [
        row(f"{lang}{k}", f"{body} {k}", lang, shard=f"src/{lang}/s{k // 40}")
        for lang, body in (("hi", "नमस्ते"), ("en", "hello"))
        for k in range(80)
    ]
    train, val, summary = run(tmp_path, rows, val_per_lang=8, allow_short_val=False)
    assert summary["val_by_lang"] == {"en": 8, "hi": 8}
    assert summary["split"]["grouped_by_utterance"] == ["en", "hi"]
    assert set(train["segment_id"]).isdisjoint(set(val["segment_id"]))


# --- written as one set ---------------------------------------------------------------------------
def test_a_failed_validation_write_leaves_the_previous_split_whole(tmp_path, monkeypatch):
    rows = [row(f"h{k}", f"नमस्ते {k}", "hi", speaker=f"s{k}") for k in range(20)]
    run(tmp_path, rows, val_per_lang=4, seed=1)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*") if p.is_file()}
    real = pl.DataFrame.write_parquet

    def fail_on_val(self, path, *args, **kwargs):
        if ".val.parquet." in str(path):
            raise OSError(122, "Disk quota exceeded", str(path))
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(pl.DataFrame, "write_parquet", fail_on_val)
    with pytest.raises(mtv.SplitError, match="Disk quota exceeded.*previous train, validation"):
        run(tmp_path, rows, val_per_lang=4, seed=2)
    after = {p.name: p.read_bytes() for p in tmp_path.glob("*") if p.is_file()}
    assert after == before  # same files, same bytes, no temporary left


def test_nemo_json_manifests_are_written_beside_each_split_in_the_same_set(tmp_path):
    from manifest_schema import read_nemo_manifest

    rows = [row(f"h{k}", f"नमस्ते {k}", "hi", speaker=f"s{k}") for k in range(10)]
    rows += [row(f"e{k}", f"hello {k}", "en", speaker=f"t{k}") for k in range(10)]
    train, val, summary = run(tmp_path, rows, val_per_lang=2, nemo_json=True)
    lines = (tmp_path / "val.json").read_text(encoding="utf-8").splitlines()
    first = json.loads(lines[0])
    assert set(first) == {"audio_filepath", "duration", "text", "lang"}
    assert len(lines) == val.height and len((tmp_path / "train.json").read_text().splitlines()) == (
        train.height
    )
    expected = val.row(0, named=True)
    assert first == {
        "audio_filepath": f"/data/{expected['shard_id']}/{expected['segment_id']}.flac",
        "duration": expected["duration"],
        "text": expected["text"].split(" ", 1)[1],  # the tag is not part of NeMo's text
        "lang": expected["lang"],
    }
    assert [r.text for r in read_nemo_manifest(tmp_path / "val.json")][0] == first["text"]
    assert summary["nemo_json"] == [str(tmp_path / "train.json"), str(tmp_path / "val.json")]


def test_nemo_json_can_keep_the_language_tag_in_the_text(tmp_path):
    rows = [row(f"h{k}", f"नमस्ते {k}", "hi", speaker=f"s{k}") for k in range(6)]
    train, _, _ = run(tmp_path, rows, val_per_lang=2, nemo_json=True, nemo_json_tags=True)
    texts = [json.loads(x)["text"] for x in (tmp_path / "train.json").read_text().splitlines()]
    assert texts == train.get_column("text").to_list()
    assert all(t.startswith("<|hi|> ") for t in texts)


def test_train_and_validation_of_different_runs_are_refused(tmp_path):
    from manifest_schema import ManifestError, check_same_split, split_id

    rows = [row(f"h{k}", f"नमस्ते {k}", "hi", speaker=f"s{k}") for k in range(20)]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    run(a, rows, val_per_lang=4, seed=1)
    run(b, rows, val_per_lang=4, seed=2)
    assert split_id(a / "train.parquet") == split_id(a / "val.parquet")
    check_same_split(a / "train.parquet", a / "val.parquet")
    with pytest.raises(ManifestError, match="different make_train_val.py runs"):
        check_same_split(a / "train.parquet", b / "val.parquet")


def test_a_master_written_with_tar_path_and_member_columns_still_splits(tmp_path):
    rows = [row(f"s{i}", f"नमस्ते {i}", speaker=f"p{i}") for i in range(4)]
    legacy = pl.DataFrame(rows).with_columns(
        pl.concat_str(pl.lit("/data/"), "shard_id", pl.lit("/audio.tar")).alias("tar_path"),
        (pl.col("segment_id") + ".flac").alias("tar_member_name"),
    )
    master = tmp_path / "legacy.parquet"
    legacy.drop("audio_filepath").write_parquet(master)
    mtv.make_train_val(
        master,
        tmp_path / "train.parquet",
        tmp_path / "val.parquet",
        val_per_lang=1,
        seed=1,
        languages=(),
        threshold=0.9,
        max_val_fraction=0.5,
    )
    both = pl.concat([pl.read_parquet(tmp_path / n) for n in ("train.parquet", "val.parquet")])
    assert "tar_path" not in both.columns
    assert sorted(both.get_column("audio_filepath")) == [
        f"/data/src/hi/s0/s{i}.flac" for i in range(4)
    ]


def test_a_nemo_json_given_as_the_master_is_refused_with_the_import_command(tmp_path):
    master = tmp_path / "train.json"
    master.write_text('{"audio_filepath": "a.wav", "text": "x", "duration": 1.0}\n')
    with pytest.raises(mtv.SplitError, match="build_manifest.py --source nemo:"):
        mtv.load_master(master)


# --- a validation share worth a warning ----------------------------------------------------------
def split_imported_corpus(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """A first-time user's path: 20 utterances each of en, hi and ta (four speakers a language)
    in a NeMo JSON manifest, imported with build_manifest.py, then split with make_train_val.py at
    its defaults plus ``flags``."""
    from tests import byod_factory as byod

    utts = byod.utterances(20, ("en", "hi", "ta"))
    for u in utts:
        u["text"] = f"{u['text']} {u['id'][2:]}"  # no two alike: deduplication keeps all
    manifest = byod.write_nemo_json(tmp_path / "nemo", utts)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MASTER_MANIFEST_PATH": str(tmp_path / "master.parquet"),
        "TRAIN_MANIFEST_PATH": str(tmp_path / "train.parquet"),
        "VAL_MANIFEST_PATH": str(tmp_path / "val.parquet"),
        "IMPORTED_AUDIO_DIR": str(tmp_path / "imported"),
    }
    for name in ("VAL_PER_LANG", "VAL_MAX_FRACTION", "VAL_WARN_FRACTION", "LANGUAGES"):
        env.pop(name, None)
    build = [sys.executable, "build_manifest.py", "--no-progress", "--source", f"nemo:{manifest}"]
    subprocess.run(build, cwd=REPO, env=env, check=True, capture_output=True, timeout=120)
    split = [sys.executable, "scripts/make_train_val.py", *flags]
    result = subprocess.run(split, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def test_a_language_giving_validation_over_a_third_of_its_rows_is_warned_about_with_the_fix(
    tmp_path,
):
    result = split_imported_corpus(tmp_path)
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    summary = json.loads((tmp_path / "train.summary.json").read_text())
    assert summary["split"]["large_val_share"] == {
        lang: {"train": 10, "val": 10} for lang in ("en", "hi", "ta")
    }
    assert warnings == [
        f"make_train_val: warning: {lang}: 10 rows in validation and 10 in train (50% of its rows "
        f"in validation, over VAL_WARN_FRACTION=0.333): to train on more of them pass "
        f"--max-val-fraction 0.33 or --val-per-lang 6 (and --allow-short-val if a language then "
        f"gets no validation row)"
        for lang in ("en", "hi", "ta")
    ]


def test_the_flag_the_warning_names_keeps_validation_within_a_third(tmp_path):
    result = split_imported_corpus(tmp_path, "--max-val-fraction", "0.33")
    summary = json.loads((tmp_path / "train.summary.json").read_text())
    assert "warning" not in result.stderr
    assert summary["split"]["large_val_share"] == {}
    assert summary["val_by_lang"] == {"en": 5, "hi": 5, "ta": 5}


# --- a source's own splits ------------------------------------------------------------------------
def with_split(split: str | None, *args, **kwargs) -> dict:
    """A master row (``row``) that its source put in ``split`` (None: no split of its own)."""
    return row(*args, **kwargs) | {"split": split}


def run_splits(tmp_path: Path, rows: list[dict], **kwargs):
    """make_train_val on a master with a split column: (train, val, test or None, summary)."""
    master = tmp_path / "master_manifest.parquet"
    pl.DataFrame(rows).write_parquet(master)
    options = dict(val_per_lang=2, seed=1, languages=(), threshold=0.9, max_val_fraction=0.5)
    options.update(kwargs)
    test_path = tmp_path / "test.parquet"
    summary = mtv.make_train_val(
        master, tmp_path / "train.parquet", tmp_path / "val.parquet", test_path=test_path, **options
    )
    test = pl.read_parquet(test_path) if test_path.exists() else None
    return (
        pl.read_parquet(tmp_path / "train.parquet"),
        pl.read_parquet(tmp_path / "val.parquet"),
        test,
        summary,
    )


def ids(frame: pl.DataFrame | None) -> list[str]:
    return [] if frame is None else sorted(frame["segment_id"])


def released(lang: str = "hi", body: str = "नमस्ते दुनिया") -> list[dict]:
    """A release of ``lang``: 4 train rows (speakers a, b), 2 dev (c), 2 test (d); texts differ."""
    place = [("train", "a"), ("train", "a"), ("train", "b"), ("train", "b")]
    place += [("dev", "c"), ("dev", "c"), ("test", "d"), ("test", "d")]
    return [
        with_split(split, f"{lang}{i}", f"{body} {i}", lang, speaker=f"{lang}-{spk}")
        for i, (split, spk) in enumerate(place)
    ]


def test_rows_stay_in_the_splits_their_source_gave_them(tmp_path):
    rows = released("hi") + released("en", "hello world")
    train, val, test, summary = run_splits(tmp_path, rows)
    assert ids(train) == ["en0", "en1", "en2", "en3", "hi0", "hi1", "hi2", "hi3"]
    assert ids(val) == ["en4", "en5", "hi4", "hi5"]
    assert ids(test) == ["en6", "en7", "hi6", "hi7"]
    assert summary["settings"]["splits"] == "keep"
    assert summary["test_rows"] == 4 and summary["test_by_lang"] == {"en": 2, "hi": 2}
    assert summary["leaks"]["rows"] == {}
    assert set(test["split"]) == {"test"}  # the source's split travels with the row


def test_the_test_manifest_is_one_set_with_train_and_validation(tmp_path):
    run_splits(tmp_path, released())
    from manifest_schema import split_id

    assert split_id(tmp_path / "test.parquet") == split_id(tmp_path / "train.parquet") is not None


def test_a_split_without_test_rows_sets_an_earlier_splits_test_manifest_aside(tmp_path):
    run_splits(tmp_path, released())
    earlier = pl.read_parquet(tmp_path / "test.parquet")
    without_test = [row for row in released() if row["split"] != "test"]
    _, _, test, summary = run_splits(tmp_path, without_test)
    assert test is None and "test_manifest" not in summary
    assert pl.read_parquet(tmp_path / "test.superseded.parquet").equals(earlier)


def test_a_second_split_without_test_rows_keeps_the_test_set_set_aside_before(tmp_path):
    without_test = [row for row in released() if row["split"] != "test"]
    test_sets = []
    for body in ("पहला", "दूसरा", "तीसरा"):  # three releases, each split, then one without test
        run_splits(tmp_path, released(body=body), nemo_json=True)
        test_sets.append(pl.read_parquet(tmp_path / "test.parquet"))
        run_splits(tmp_path, without_test, nemo_json=True)
    names = ["test.superseded", "test.superseded-2", "test.superseded-3"]
    for name, test_set in zip(names, test_sets):
        assert pl.read_parquet(tmp_path / f"{name}.parquet").equals(test_set)
        assert (tmp_path / f"{name}.json").read_text().count("\n") == test_set.height
    assert not (tmp_path / "test.parquet").exists()


def test_a_split_without_nemo_json_sets_the_earlier_splits_json_manifests_aside(tmp_path, capsys):
    run_splits(tmp_path, released(), nemo_json=True)
    earlier = {name: (tmp_path / f"{name}.json").read_text() for name in ("train", "val", "test")}
    run_splits(tmp_path, released(body="दूसरा"))
    for name, text in earlier.items():
        assert not (tmp_path / f"{name}.json").exists()
        assert (tmp_path / f"{name}.superseded.json").read_text() == text
    assert (tmp_path / "test.parquet").exists()  # this split's own test set stays
    warnings = [line for line in capsys.readouterr().err.splitlines() if "superseded" in line]
    assert len(warnings) == 3 and all("belonged to an earlier split" in w for w in warnings)


def test_duplicates_within_a_split_are_dropped_as_before(tmp_path):
    rows = released()
    rows.append(rows[0] | {"segment_id": "hi0-again", "text": tagged_text("hi", "और कुछ")})
    rows.append(rows[4] | {"segment_id": "hi4-copy", "audio_filepath": "/data/copy.flac"})
    train, val, _, summary = run_splits(tmp_path, rows)
    assert summary["dropped"] == {"duplicate_audio": 1, "duplicate_text": 1}
    assert "hi0-again" not in ids(train) and "hi4-copy" not in ids(val)


def test_a_speaker_in_train_and_test_is_reported_and_removed_from_train(tmp_path, capsys):
    rows = released()
    rows[2]["speaker_id"] = rows[3]["speaker_id"] = "hi-d"  # speaker b is test's speaker d
    train, _, test, summary = run_splits(tmp_path, rows)
    assert ids(train) == ["hi0", "hi1"] and ids(test) == ["hi6", "hi7"]
    assert summary["dropped"] == {"leak_speaker": 2}
    assert summary["leaks"] == {
        "removed": True,
        "rows": {"speaker": {"train/test": 2}},
        "speakers": {"train/test": 1},
    }
    mtv.main(["--master", str(tmp_path / "master_manifest.parquet"), "--train",
              str(tmp_path / "t.parquet"), "--val", str(tmp_path / "v.parquet"), "--test",
              str(tmp_path / "x.parquet"), "--val-per-lang", "2"])  # fmt: skip
    assert (
        "leaks across splits: 2 train rows share their speaker (1 speakers) with test: removed"
        in capsys.readouterr().out
    )


def test_the_same_audio_in_dev_and_train_is_removed_from_train(tmp_path):
    rows = released()
    rows[0]["audio_filepath"] = rows[4]["audio_filepath"]  # train's hi0 is dev's hi4 under a new id
    train, val, _, summary = run_splits(tmp_path, rows)
    assert "hi0" not in ids(train) and "hi4" in ids(val)
    assert summary["dropped"] == {"leak_audio": 1}
    assert summary["leaks"]["rows"] == {"audio": {"train/val": 1}}


def two_corpora(speaker_b: str = "1") -> list[dict]:
    """Corpus A (source ``a``): 8 train rows of speakers "1" and "2" and 2 dev rows of speaker
    "3"; corpus B (source ``b``): 2 test rows of its own speaker ``speaker_b``."""
    rows = [
        with_split("train", f"a{i}", f"पहला {i}", shard="a/hi/s0", speaker=str(1 + i % 2))
        for i in range(8)
    ]
    rows += [
        with_split("dev", f"a-dev{i}", f"दूसरा {i}", shard="a/hi/s0", speaker="3") for i in range(2)
    ]
    rows += [
        with_split("test", f"b{i}", f"तीसरा {i}", shard="b/hi/s0", speaker=speaker_b)
        for i in range(2)
    ]
    return rows


def test_corpora_that_number_their_speakers_alike_hold_different_people(tmp_path, capsys):
    train, val, test, summary = run_splits(tmp_path, two_corpora())
    assert ids(train) == [f"a{i}" for i in range(8)]  # A's speaker "1" is not B's speaker "1"
    assert ids(val) == ["a-dev0", "a-dev1"] and ids(test) == ["b0", "b1"]
    assert summary["dropped"] == {} and summary["leaks"]["rows"] == {}
    assert summary["speaker_ids_in_several_sources"] == {
        "ids": 1,
        "sources": ["a", "b"],
        "example": "1",
    }
    warning = [line for line in capsys.readouterr().err.splitlines() if "speaker id" in line]
    assert warning == [
        "make_train_val: warning: 1 speaker id(s) (e.g. '1') appear in more than one of the sources "
        "a, b: counted as different people in each source; if they are the same people, pass "
        "--same-speakers a,b (hashed ids, such as Common Voice's client_id, are always taken as one "
        "person)"
    ]


def test_a_hashed_speaker_id_in_two_sources_is_one_person_without_being_told(tmp_path, capsys):
    """Common Voice locales read as two sources: a contributor's client_id (a 128-hex-digit hash)
    is one person in both, so their rows never straddle train and test."""
    one, two, three = ("%0128x" % (n * 7919) for n in (1, 2, 3))
    rows = [
        with_split("train", f"a{i}", f"पहला {i}", shard="a/hi/s0", speaker=(one, two)[i % 2])
        for i in range(8)
    ]
    rows += [
        with_split("dev", f"a-dev{i}", f"दूसरा {i}", shard="a/hi/s0", speaker=three)
        for i in range(2)
    ]
    rows += [
        with_split("test", f"b{i}", f"तीसरा {i}", shard="b/hi/s0", speaker=one) for i in range(2)
    ]
    train, _, test, summary = run_splits(tmp_path, rows)
    assert ids(train) == ["a1", "a3", "a5", "a7"]  # the contributor of B's test rows is out
    assert ids(test) == ["b0", "b1"]
    assert summary["dropped"] == {"leak_speaker": 4}
    assert summary["speaker_ids_in_several_sources"] == {}
    assert "speaker id" not in capsys.readouterr().err


def test_sources_said_to_share_speakers_compare_them_as_one(tmp_path, capsys):
    train, _, test, summary = run_splits(tmp_path, two_corpora(), same_speakers=["a,b"])
    assert ids(train) == ["a1", "a3", "a5", "a7"]  # speaker "2"; speaker "1" is in B's test
    assert summary["dropped"] == {"leak_speaker": 4}
    assert summary["leaks"]["speakers"] == {"train/test": 1}
    assert summary["speaker_ids_in_several_sources"] == {}
    assert "speaker id" not in capsys.readouterr().err


def test_same_speakers_takes_patterns_and_names_a_source_the_master_lacks(tmp_path):
    _, _, _, summary = run_splits(tmp_path, two_corpora(), same_speakers=["[ab]"])
    assert summary["dropped"] == {"leak_speaker": 4}
    with pytest.raises(
        mtv.SplitError, match=r"--same-speakers a,c: no source .* named 'c'; its sources are a, b"
    ):
        run_splits(tmp_path, two_corpora(), same_speakers=["a,c"])


def test_the_cli_passes_same_speakers(tmp_path):
    master = tmp_path / "master_manifest.parquet"
    pl.DataFrame(two_corpora()).write_parquet(master)
    out = {name: tmp_path / f"{name}.parquet" for name in ("train", "val", "test")}
    args = ["--master", str(master), "--val-per-lang", "2"]
    args += [a for name, path in out.items() for a in (f"--{name}", str(path))]
    assert mtv.main(args) == 0 and pl.read_parquet(out["train"]).height == 8
    assert mtv.main([*args, "--same-speakers", "a", "--same-speakers", "b,a"]) == 0
    assert pl.read_parquet(out["train"]).height == 4


def test_speakers_are_split_apart_per_source(tmp_path):
    # two corpora numbering their 10 speakers alike, 2 rows each: one speaker id, two people
    rows = [
        row(f"{src}{s}-{k}", f"वाक्य {src} {s} {k}", shard=f"{src}/hi/s{s}", speaker=f"spk{s}")
        for src in ("a", "b")
        for s in range(10)
        for k in range(2)
    ]
    train, val, summary = run(tmp_path, rows, val_per_lang=8)
    people = lambda f: set(zip(f["source"], f["speaker_id"]))  # noqa: E731
    assert people(train).isdisjoint(people(val)) and val.height == 8
    # some speaker id is on both sides, as two different people
    assert set(train["speaker_id"]) & set(val["speaker_id"])
    assert summary["split"]["val_groups"] == 4


def test_a_speaker_of_sources_said_to_share_speakers_stays_on_one_side(tmp_path):
    rows = [
        row(f"{src}{s}-{k}", f"वाक्य {src} {s} {k}", shard=f"{src}/hi/s{s}", speaker=f"spk{s}")
        for src in ("a", "b")
        for s in range(10)
        for k in range(2)
    ]
    train, val, _ = run(tmp_path, rows, val_per_lang=8, same_speakers=["a,b"])
    assert set(train["speaker_id"]).isdisjoint(set(val["speaker_id"])) and val.height == 8


def test_a_source_whose_ids_no_other_source_uses_keeps_its_split_when_another_is_added(tmp_path):
    own = corpus(n_speakers=40)
    _, val_alone, _ = run(tmp_path, own, val_per_lang=10)
    # another corpus, of another language (its own quota), numbering its speakers differently
    other = [
        row(f"o{s}", f"hello {s}", "en", shard="other/en/s0", speaker=f"o{s}") for s in range(6)
    ]
    _, val_both, _ = run(tmp_path, own + other, val_per_lang=10)
    own_val = val_both.filter(pl.col("source") == "src")
    assert set(own_val["segment_id"]) == set(val_alone["segment_id"])


def test_a_speaker_in_dev_and_test_is_removed_from_dev_not_test(tmp_path):
    rows = released()
    rows[4]["speaker_id"] = "hi-d"
    _, val, test, summary = run_splits(tmp_path, rows)
    assert ids(val) == ["hi5"] and ids(test) == ["hi6", "hi7"]
    assert summary["leaks"]["rows"] == {"speaker": {"val/test": 1}}


def test_keep_leaks_keeps_the_leaking_rows_and_still_reports_them(tmp_path):
    rows = released()
    rows[2]["speaker_id"] = "hi-d"
    train, _, _, summary = run_splits(tmp_path, rows, keep_leaks=True)
    assert "hi2" in ids(train) and summary["dropped"] == {}
    assert summary["leaks"]["rows"] == {"speaker": {"train/test": 1}}
    assert summary["leaks"]["removed"] is False


def test_resplit_pools_train_and_dev_by_speaker_and_still_holds_test_out(tmp_path):
    rows = released()
    train, val, test, summary = run_splits(tmp_path, rows, splits="resplit")
    assert ids(test) == ["hi6", "hi7"]
    assert sorted(ids(train) + ids(val)) == ["hi0", "hi1", "hi2", "hi3", "hi4", "hi5"]
    assert summary["split"]["mode"] == "resplit"
    speakers = {side: set(f["speaker_id"]) for side, f in (("train", train), ("val", val))}
    assert not speakers["train"] & speakers["val"]


def test_rows_without_a_split_are_split_by_speaker_where_their_language_has_no_dev(tmp_path):
    rows = released()
    rows += [with_split(None, f"hi-x{i}", f"फिर से {i}", "hi", speaker="hi-x") for i in range(2)]
    rows += [
        with_split(None, f"ta{i}", f"வணக்கம் {i}", "ta", speaker=f"ta-{i % 3}") for i in range(6)
    ]
    train, val, _, summary = run_splits(tmp_path, rows)
    assert {"hi-x0", "hi-x1"} <= set(ids(train))  # hi has its own dev: its other rows train
    ta_val = val.filter(pl.col("lang") == "ta")
    assert ta_val.height == 2 and ta_val["speaker_id"].n_unique() == 1
    assert summary["split"]["resplit_languages"] == ["ta"]


def test_a_language_with_train_rows_and_no_dev_rows_is_an_error_naming_the_fixes(tmp_path):
    rows = [r for r in released() if r["split"] != "dev"]
    with pytest.raises(mtv.SplitError, match=r"no validation rows for hi: .*split=dev.*resplit"):
        run_splits(tmp_path, rows)


def test_a_split_name_keep_does_not_know_is_an_error_naming_it(tmp_path):
    rows = released()
    rows[0]["split"] = "extra"
    with pytest.raises(mtv.SplitError, match=r"split column holds 'extra' \(1 rows\).*resplit"):
        run_splits(tmp_path, rows)
