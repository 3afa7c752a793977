"""build_manifest.py: cleaning rules, filters, schema, error handling and determinism."""

from __future__ import annotations

import errno
import functools
import importlib.util
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import atomic_files
import build_manifest as bm
import transcript_cleaning as tc
from manifest_schema import EXTRA_COLUMNS, OUTPUT_COLUMNS, ManifestError
from tests.shard_factory import write_shard

REPO = Path(__file__).resolve().parents[1]
ZWJ, ZWNJ = "\u200d", "\u200c"


def build(shards_dir: Path, tmp_path: Path, **kwargs) -> tuple[pl.DataFrame, dict]:
    out = tmp_path / "master_manifest.parquet"
    options = dict(
        languages=(), min_duration=0.5, max_duration=20.0, min_quality=0.0, progress=False
    )
    options.update(kwargs)
    summary = bm.build_manifest(shards_dir, out, **options)
    return pl.read_parquet(out), summary


def strict_cli_build(tmp_path: Path) -> int:
    """The exit code of ``build_manifest.py --strict`` over tmp_path/shards into tmp_path/m.parquet."""
    return bm.main(
        [
            "--shards-dir",
            str(tmp_path / "shards"),
            "--output",
            str(tmp_path / "m.parquet"),
            "--strict",
            "--no-progress",
        ]
    )


def one_row_manifest(tmp_path: Path, transcript: str | None, **row) -> pl.DataFrame:
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [{"segment_id": "a", "transcription_native": transcript, **row}],
    )
    manifest, _ = build(tmp_path / "shards", tmp_path)
    return manifest


# --- cleaning rules ----------------------------------------------------------------------------
def test_cleaning_applies_unicode_nfc():
    assert tc.clean_text("cafe\u0301") == "caf\u00e9"
    assert tc.clean_text("\u0995\u09c7\u09be") == "\u0995\u09cb"  # Bengali vowel sign O, composed


@pytest.mark.parametrize("tag", ["[music]", "[laugh]", "[ inaudible 00:12 ]", "<noise>", "<|hi|>"])
def test_bracket_tags_are_removed_with_their_contents(tag):
    assert tc.clean_text(f"hello {tag} world") == "hello world"
    assert tc.clean_text(f"hello{tag}world") == "hello world"


@pytest.mark.parametrize(
    "mark",
    [
        "।",
        "॥",
        "«",
        "»",
        "‘",
        "“",
        "”",
        "„",
        "…",
        "–",
        "—",
        "-",
        "(",
        ")",
        "[",
        "]",
        ".",
        ",",
        "!",
        "?",
        '"',
        "۔",
        "،",
        "؟",
    ],
)
def test_punctuation_becomes_a_space_so_neighbouring_words_stay_apart(mark):
    assert tc.clean_text(f"ek{mark}do") == "ek do"
    assert tc.clean_text(f"ek {mark} do{mark}") == "ek do"


def test_whitespace_is_collapsed_and_trimmed():
    assert tc.clean_text("  a \t b\n\nc\u00a0 d  ") == "a b c d"


def test_apostrophes_inside_words_are_kept_and_straightened():
    assert tc.clean_text("don’t stop rock'n'roll o'clock") == "don't stop rock'n'roll o'clock"


def test_quote_marks_at_word_edges_are_removed():
    assert tc.clean_text("'quoted' ‘also’ ’tis") == "quoted also tis"


def test_zwj_of_a_malayalam_chillu_is_kept():
    chillu_word = "അവന്" + ZWJ  # NA + VIRAMA + ZWJ ends the word
    assert tc.clean_text(f"{chillu_word} പോയി") == f"{chillu_word} പോയി"
    assert tc.clean_text(f"{chillu_word}.") == chillu_word


def test_zwnj_and_zwj_inside_a_word_are_kept():
    for word in ("क्" + ZWNJ + "ष", "क्" + ZWJ + "ष", "র" + ZWJ + "্য"):
        assert tc.clean_text(f"x {word} y") == f"x {word} y"


def test_stray_joiners_alone_or_at_word_starts_or_after_letters_are_removed():
    assert tc.clean_text(f"a {ZWJ} b") == "a b"
    assert tc.clean_text(f"{ZWNJ}word") == "word"
    assert tc.clean_text(f"word{ZWNJ} next") == "word next"
    assert tc.clean_text(f"«{ZWJ}word{ZWJ}»") == "word"
    assert tc.clean_text(ZWJ + ZWNJ) == ""


def test_invisible_format_characters_are_deleted_and_zero_width_space_separates_words():
    assert tc.clean_text("\u200fاردو\u200e \ufeffsoft\u00adware") == "اردو software"
    assert tc.clean_text("one\u200btwo") == "one two"


def test_control_characters_become_spaces():
    assert tc.clean_text("a\x00b\x1fc") == "a b c"


def test_symbols_become_spaces():
    assert tc.clean_text("50% of $5 + 3") == "50 of 5 3"


TRICKY = st.lists(
    st.sampled_from(
        list("ab5 कषन्ािँ ़ക്നൽ অৰৱ্া ো e\u0301\u0323\u00e9 ’'\"«»-–—…।॥.,[]<>|()\t\n\u00a0")
        + [ZWJ, ZWNJ, "\u200b", "\u200f", "\ufeff", "\ue000", "\x00", "[music]", "<noise>"]
    ),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(TRICKY, min_size=1, max_size=8))
def test_fast_cleaning_path_equals_running_every_rule_on_every_row(texts):
    reference = (
        pl.select(tc.clean_text_expr(pl.lit(pl.Series(texts, dtype=pl.String))))
        .to_series()
        .to_list()
    )
    assert tc.clean_texts(texts) == reference


@settings(max_examples=300, deadline=None)
@given(st.lists(TRICKY, min_size=1, max_size=8))
def test_the_cleaning_a_node_without_polars_runs_equals_the_polars_one(texts):
    assert [tc.clean_text_without_polars(text) for text in texts] == tc.clean_texts(texts)


# TRICKY with every sentence mark the punctuated style keeps, next to joiners and tags.
TRICKY_MARKS = st.lists(
    st.sampled_from(
        list("ab कन्ािക്നൽ ’'\"«»-…।॥.,?!;:\u060c\u061f\u06d4[]()\t\u00a0")
        + [ZWJ, ZWNJ, "\u200b", "\u200f", "[music]", "<|en|>", " ?", "? ", "a.b"]
    ),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(TRICKY_MARKS, min_size=1, max_size=8))
def test_the_punctuated_cleaning_a_node_without_polars_runs_equals_the_polars_one(texts):
    without = [tc.clean_text_without_polars(text, "punctuated") for text in texts]
    assert without == tc.clean_texts(texts, "punctuated")


# Text the single-pass path takes (no invisible character, nothing NFC changes) dense with what
# decides an apostrophe: spaces, marks, tags, digits, signs, mid-word joiners, other apostrophes.
APOSTROPHE_HEAVY = st.lists(
    st.sampled_from(
        list("ab5 ि़ ’'.,-[]<>\u0301ক্") + [ZWJ, " '", "' ", "a'b", "''", "’’ ", "[x'y]"]
    ),
    max_size=20,
).map("".join)


@settings(max_examples=500, deadline=None)
@given(st.lists(APOSTROPHE_HEAVY, min_size=1, max_size=6))
def test_single_pass_apostrophes_equal_running_every_rule(texts):
    reference = (
        pl.select(tc.clean_text_expr(pl.lit(pl.Series(texts, dtype=pl.String))))
        .to_series()
        .to_list()
    )
    assert tc.clean_texts(texts) == reference


@settings(max_examples=300, deadline=None)
@given(st.lists(APOSTROPHE_HEAVY, min_size=1, max_size=6))
def test_apostrophes_cleaned_without_polars_equal_the_polars_cleaning(texts):
    assert [tc.clean_text_without_polars(text) for text in texts] == tc.clean_texts(texts)


def test_apostrophes_outside_words_become_spaces_and_in_word_ones_stay():
    assert tc.clean_texts(
        ["'tis a 'test' rock'n'roll", "don’t", "a '' b", "a''b", "9'a", "x' y", "'"]
    ) == ["tis a test rock'n'roll", "don't", "a b", "a b", "9 a", "x y", ""]


def test_fast_cleaning_path_handles_neighbours_made_by_deleting_invisible_characters():
    texts = ["a\u200f'b", "a\u200f\u200d b", "\ufeff\u200dx", "don\u200e’t"]
    reference = pl.select(tc.clean_text_expr(pl.lit(pl.Series(texts)))).to_series().to_list()
    assert tc.clean_texts(texts) == reference == ["a'b", "a b", "x", "don't"]


@settings(max_examples=300, deadline=None)
@given(TRICKY)
def test_cleaned_text_is_nfc_trimmed_single_spaced_and_free_of_punctuation(text):
    cleaned = tc.clean_text(text)
    assert cleaned == unicodedata.normalize("NFC", cleaned)
    assert cleaned == cleaned.strip() and "  " not in cleaned
    for i, ch in enumerate(cleaned):
        category = unicodedata.category(ch)
        if ch == "'":  # only between letters
            assert cleaned[i - 1].isalpha() or unicodedata.category(cleaned[i - 1])[0] == "M"
            assert cleaned[i + 1].isalpha()
        else:
            assert category[0] not in "PS" and category not in ("Cc", "Co")
            assert ch not in "\u200b\u200f\ufeff"


@settings(max_examples=300, deadline=None)
@given(TRICKY)
def test_cleaning_twice_changes_nothing(text):
    once = tc.clean_text(text)
    assert tc.clean_text(once) == once


# --- manifest rows -----------------------------------------------------------------------------
def test_manifest_has_the_contract_columns_in_order_with_their_types(tmp_path):
    manifest = one_row_manifest(tmp_path, "नमस्ते", speaker_id="spk1")
    assert manifest.columns == [*OUTPUT_COLUMNS, *EXTRA_COLUMNS]
    assert manifest.schema["duration"] == pl.Float64
    assert manifest.schema["tx_quality_score"] == pl.Float64
    assert all(
        manifest.schema[c] == pl.String
        for c in manifest.columns
        if c not in ("duration", "tx_quality_score")
    )


def test_text_is_the_language_tag_then_the_cleaned_transcript(tmp_path):
    manifest = one_row_manifest(tmp_path, "नमस्ते।  दुनिया [music]")
    assert manifest.item(0, "text") == "<|hi|> नमस्ते दुनिया"


def test_segment_language_overrides_the_path_language(tmp_path):
    manifest = one_row_manifest(tmp_path, "hello", segment_language=" EN ")
    assert manifest.item(0, "lang") == "en"
    assert manifest.item(0, "text") == "<|en|> hello"


def test_path_language_is_used_when_segment_language_is_null_or_blank(tmp_path):
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [
            {"segment_id": "a", "segment_language": None},
            {"segment_id": "b", "segment_language": ""},
            {"segment_id": "c", "segment_language": " \t"},
            {"segment_id": "d", "segment_language": " Ta"},
        ],
    )
    write_shard(
        tmp_path / "shards",
        "src",
        "en",
        "s1",
        [
            {"segment_id": "e", "segment_language": None},
            {"segment_id": "f", "segment_language": "KN"},
        ],
    )
    manifest, _ = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("lang").to_list() == [
        "en",
        "kn",
        "hi",
        "hi",
        "hi",
        "ta",
    ]  # by shard_id


def test_shard_source_and_audio_path_come_from_the_shard(tmp_path):
    manifest = one_row_manifest(tmp_path, "x", tar_member_name="clips/a.flac")
    row = manifest.row(0, named=True)
    assert row["shard_id"] == "src/hi/s0" and row["source"] == "src"
    assert row["audio_filepath"] == str(
        (tmp_path / "shards" / "src" / "hi" / "s0" / "clips" / "a.flac").absolute()
    )


def test_speaker_id_and_quality_are_carried_through(tmp_path):
    manifest = one_row_manifest(tmp_path, "x", speaker_id="spk7", tx_quality_score=0.75)
    assert manifest.item(0, "speaker_id") == "spk7"
    assert manifest.item(0, "tx_quality_score") == 0.75


def test_speaker_id_is_null_when_the_shard_has_no_speaker_column(tmp_path):
    assert one_row_manifest(tmp_path, "x").item(0, "speaker_id") is None


def test_integer_durations_and_scores_are_accepted(tmp_path):
    shard = write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    pq.write_table(
        pa.table(
            {
                "segment_id": ["a"],
                "transcription_native": ["x"],
                "duration_s": [3],
                "tx_quality_score": [1],
                "segment_language": [None],
            }
        ),
        shard / "metadata.parquet",
    )
    manifest, _ = build(tmp_path / "shards", tmp_path)
    assert manifest.item(0, "duration") == 3.0


# --- filters -------------------------------------------------------------------------------------
def drops_of(summary: dict) -> dict:
    return summary["dropped"]


def test_duration_bounds_are_inclusive_and_outside_rows_are_dropped(tmp_path):
    rows = [
        {"segment_id": s, "duration_s": d}
        for s, d in [
            ("short", 0.49),
            ("min", 0.5),
            ("max", 20.0),
            ("long", 20.01),
            ("nan", float("nan")),
            ("null", None),
        ]
    ]
    write_shard(tmp_path / "shards", "src", "hi", "s0", rows)
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert sorted(manifest.get_column("segment_id")) == ["max", "min"]
    assert drops_of(summary) == {
        "duration_too_short": 1,
        "duration_too_long": 1,
        "duration_missing": 2,
    }


def test_quality_below_min_null_and_non_finite_quality_are_dropped(tmp_path):
    rows = [
        {"segment_id": "low", "tx_quality_score": 0.2},
        {"segment_id": "ok", "tx_quality_score": 0.5},
        {"segment_id": "none", "tx_quality_score": None},
        {"segment_id": "inf", "tx_quality_score": float("inf")},
        {"segment_id": "-inf", "tx_quality_score": float("-inf")},
    ]
    write_shard(tmp_path / "shards", "src", "hi", "s0", rows)
    manifest, summary = build(tmp_path / "shards", tmp_path, min_quality=0.5)
    assert manifest.get_column("segment_id").to_list() == ["ok"]
    assert drops_of(summary) == {
        "quality_below_min": 1,
        "quality_missing": 1,
        "quality_not_finite": 2,
    }


def test_an_unwritable_output_is_refused_before_any_shard_is_read(tmp_path, monkeypatch):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    blocker = tmp_path / "file"
    blocker.write_text("")
    read = []
    monkeypatch.setattr(bm, "discover_shards", lambda *a: read.append(a) or ([], []))
    with pytest.raises(ManifestError, match=r"cannot write the master manifest into .*file/out"):
        bm.build_manifest(tmp_path / "shards", blocker / "out" / "master.parquet", progress=False)
    assert read == []


def test_temporary_files_of_a_killed_run_are_removed_by_the_next(tmp_path, monkeypatch):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    stale = [
        tmp_path / ".master.parquet.k1l2.tmp",
        tmp_path / ".master.summary.json.x9.tmp",
        tmp_path / ".master.parquet.0f3a9c2e.set-tmp",
        tmp_path / ".master.summary.json.0f3a9c2e.set-tmp",
    ]
    for path in stale:
        path.write_bytes(b"PAR1 half")
    removed_before_reading = []
    read_shards = bm.read_shards

    def reading(*args):
        removed_before_reading.append(not any(p.exists() for p in stale))
        return read_shards(*args)

    monkeypatch.setattr(bm, "read_shards", reading)
    bm.build_manifest(tmp_path / "shards", tmp_path / "master.parquet", progress=False)
    assert removed_before_reading == [True]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "master.parquet",
        "master.summary.json",
        "shards",
    ]


def test_tag_only_and_punctuation_only_transcripts_are_dropped_not_kept_as_a_bare_tag(tmp_path):
    rows = [
        {"segment_id": "tags", "transcription_native": "[music] [laugh]"},
        {"segment_id": "dots", "transcription_native": "... ।"},
        {"segment_id": "null", "transcription_native": None},
        {"segment_id": "ok", "transcription_native": "[music] ठीक"},
    ]
    write_shard(tmp_path / "shards", "src", "hi", "s0", rows)
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("text").to_list() == ["<|hi|> ठीक"]
    assert drops_of(summary) == {"empty_after_cleaning": 2, "transcript_missing": 1}


def test_rows_without_an_audio_index_entry_are_dropped_and_counted(tmp_path):
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [{"segment_id": "a"}, {"segment_id": "b", "indexed": False}],
        extra_index_rows=[{"segment_id": "orphan", "tar_member_name": "orphan.flac"}],
    )
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("segment_id").to_list() == ["a"]
    assert drops_of(summary) == {"no_audio_index": 1}
    assert summary["audio_index_without_metadata"] == 1


def test_a_segment_listed_twice_in_the_audio_index_keeps_its_own_text_on_both_rows(tmp_path):
    # The exact-join path (a duplicate index entry) with dropped rows around it: every kept row must
    # still carry the cleaned transcript of its own metadata row.
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [
            {"segment_id": "a", "transcription_native": "one, two", "duration_s": 0.1},
            {"segment_id": "b", "transcription_native": "«three»"},
            {"segment_id": "c", "transcription_native": "four", "indexed": False},
            {"segment_id": "d", "transcription_native": "[music]"},
            {"segment_id": "e", "transcription_native": "five-six"},
        ],
        extra_index_rows=[{"segment_id": "b", "tar_member_name": "b_again.flac"}],
    )
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.select(
        "segment_id", pl.col("audio_filepath").str.replace(".*/", ""), "text"
    ).rows() == [
        ("b", "b.flac", "<|hi|> three"),
        ("b", "b_again.flac", "<|hi|> three"),
        ("e", "e.flac", "<|hi|> five six"),
    ]
    assert drops_of(summary) == {
        "duration_too_short": 1,
        "no_audio_index": 1,
        "empty_after_cleaning": 1,
    }


def test_languages_setting_keeps_only_the_listed_languages(tmp_path):
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [{"segment_id": "a"}, {"segment_id": "b", "segment_language": "en"}],
    )
    manifest, summary = build(tmp_path / "shards", tmp_path, languages=("en",))
    assert manifest.get_column("lang").to_list() == ["en"]
    assert drops_of(summary) == {"language_not_selected": 1}


def test_languages_that_no_row_has_are_an_error_naming_the_languages_seen(tmp_path):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    write_shard(tmp_path / "shards", "src", "en", "s1", [{"segment_id": "b"}])
    with pytest.raises(ManifestError, match=r"LANGUAGES=hindi,english keeps nothing.* are en, hi"):
        build(tmp_path / "shards", tmp_path, languages=("hindi", "english"))
    assert not (tmp_path / "master_manifest.parquet").exists()


def test_a_language_no_row_has_is_named_in_the_summary_and_the_rest_is_built(tmp_path):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    write_shard(tmp_path / "shards", "src", "en", "s1", [{"segment_id": "b"}])
    manifest, summary = build(tmp_path / "shards", tmp_path, languages=("hi", "xx"))
    assert manifest.get_column("lang").to_list() == ["hi"]
    assert summary["languages_without_rows"] == ["xx"]
    text = bm.format_summary(summary, tmp_path / "master_manifest.parquet")
    assert "WARNING: LANGUAGES lists xx, which no row has (the data's languages: en, hi)" in text


def test_languages_from_the_environment_are_matched_in_lower_case(tmp_path):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    write_shard(tmp_path / "shards", "src", "en", "s1", [{"segment_id": "b"}])
    env = {k: v for k, v in os.environ.items() if k not in ("LANGUAGES", "DATA_DIR")}
    env.update(LANGUAGES="hi, EN", DATA_DIR=str(tmp_path), SHARDS_DIR=str(tmp_path / "shards"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "build_manifest.py"), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(pl.read_parquet(tmp_path / "master_manifest.parquet")["lang"]) == ["en", "hi"]


def test_language_codes_that_would_break_the_tag_are_dropped(tmp_path):
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [{"segment_id": "a", "segment_language": "hi|>en"}, {"segment_id": "b"}],
    )
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert drops_of(summary) == {"invalid_language": 1}
    assert manifest.get_column("segment_id").to_list() == ["b"]


def test_summary_accounts_for_every_row_per_reason_and_language(tmp_path):
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [
            {"segment_id": "a"},
            {"segment_id": "b", "duration_s": 99.0},
            {"segment_id": "c", "segment_language": "en", "transcription_native": "[noise]"},
        ],
    )
    write_shard(tmp_path / "shards", "src", "ta", "s1", [{"segment_id": "d"}])
    _, summary = build(tmp_path / "shards", tmp_path)
    written = json.loads((tmp_path / "master_manifest.summary.json").read_text())
    for key in ("rows_in", "rows_out", "dropped", "dropped_by_lang", "kept_by_lang"):
        assert written[key] == summary[key]
    assert summary["rows_in"] == 4 and summary["rows_out"] == 2
    assert summary["kept_by_lang"] == {"hi": 1, "ta": 1}
    assert summary["dropped_by_lang"] == {
        "en": {"empty_after_cleaning": 1},
        "hi": {"duration_too_long": 1},
    }


# --- bad input -----------------------------------------------------------------------------------
def corrupt(shard: Path, how: str) -> None:
    if how == "corrupt parquet":
        (shard / "metadata.parquet").write_bytes(b"PAR1 not really parquet")
    elif how == "truncated parquet":
        data = (shard / "metadata.parquet").read_bytes()
        (shard / "metadata.parquet").write_bytes(data[: len(data) // 2])
    elif how == "missing column":
        pq.write_table(
            pa.table({"segment_id": ["x"], "duration_s": [1.0], "tx_quality_score": [1.0]}),
            shard / "metadata.parquet",
        )
    elif how == "wrong type":
        pq.write_table(
            pa.table(
                {
                    "segment_id": ["x"],
                    "transcription_native": ["t"],
                    "duration_s": ["long"],
                    "tx_quality_score": [1.0],
                }
            ),
            shard / "metadata.parquet",
        )
    elif how == "corrupt data behind a valid footer":
        data = bytearray((shard / "metadata.parquet").read_bytes())
        data[8:200] = b"\xff" * 192
        (shard / "metadata.parquet").write_bytes(bytes(data))
    elif how == "missing index":
        (shard / "audio_index.parquet").unlink()


BREAKAGES = [
    "corrupt parquet",
    "truncated parquet",
    "corrupt data behind a valid footer",
    "missing column",
    "wrong type",
    "missing index",
]


@pytest.mark.parametrize("how", BREAKAGES)
def test_an_unreadable_shard_is_reported_with_path_and_reason_and_the_rest_is_built(tmp_path, how):
    write_shard(tmp_path / "shards", "src", "hi", "good", [{"segment_id": "a"}])
    bad = write_shard(tmp_path / "shards", "src", "hi", "bad", [{"segment_id": "b"}])
    corrupt(bad, how)
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("segment_id").to_list() == ["a"]
    assert [b["path"] for b in summary["bad_shards"]] == [str(bad)]
    reason = summary["bad_shards"][0]["reason"]
    assert str(bad) in reason
    if how == "missing column":
        assert "transcription_native" in reason
    if how == "wrong type":
        assert "duration_s" in reason


@pytest.mark.parametrize("how", BREAKAGES)
def test_strict_turns_an_unreadable_shard_into_an_error_and_writes_nothing(tmp_path, how, capsys):
    write_shard(tmp_path / "shards", "src", "hi", "good", [{"segment_id": "a"}])
    corrupt(write_shard(tmp_path / "shards", "src", "hi", "bad", [{"segment_id": "b"}]), how)
    out = tmp_path / "m.parquet"
    code = bm.main(
        [
            "--shards-dir",
            str(tmp_path / "shards"),
            "--output",
            str(out),
            "--strict",
            "--no-progress",
        ]
    )
    assert code != 0 and not out.exists()
    assert "bad" in capsys.readouterr().err


def test_batches_are_consecutive_shards_sized_by_the_rows_seen_so_far(tmp_path):
    for s in range(40):
        write_shard(
            tmp_path / "shards",
            "src",
            "hi",
            f"s{s:02d}",
            [{"segment_id": f"{s}-{i}"} for i in range(100)],
        )
    shards, _ = bm.discover_shards(tmp_path / "shards")
    batches = list(bm.joined_batches(shards, workers=2, first=4, rows=1600))
    assert [len(batch) for batch, *_ in batches] == [4, 16, 16, 4]  # 1600 rows at 100 a shard
    assert [s for batch, *_ in batches for s in batch] == shards
    for batch, joined, orphans, unreadable in batches:
        assert joined.height == 100 * len(batch) and orphans == 0 and unreadable == []
        # each row's shard position, counted within the batch, points at the shard it came from
        for segment_id, position in joined.select("segment_id", "shard").unique().iter_rows():
            assert batch[position].shard_id == f"src/hi/s{int(segment_id.split('-')[0]):02d}"


def test_building_in_many_small_batches_writes_the_same_manifest_and_summary(tmp_path, monkeypatch):
    langs = ["hi", "ta", "en"]
    for s in range(20):
        rows = [
            {
                "segment_id": f"{s}-{i}",
                "transcription_native": f"w{i}, [x] «w» don't",
                "duration_s": 0.2 + i,
                "indexed": i % 7 != 3,
            }
            for i in range(s % 6)
        ]
        shard = write_shard(
            tmp_path / "shards",
            "src",
            langs[s % 3],
            f"s{s:02d}",
            rows,
            extra_index_rows=[{"segment_id": f"orphan{s}", "tar_member_name": "o.flac"}],
        )
        if s in (5, 13):
            corrupt(shard, "corrupt data behind a valid footer")
    outputs = []
    for batched in (False, True):
        if batched:  # batches of 2, then 8 shards (the fewest a later batch holds)
            monkeypatch.setattr(
                bm, "joined_batches", functools.partial(bm.joined_batches, first=2, rows=1)
            )
        out = tmp_path / f"m{batched}.parquet"
        summary = bm.build_manifest(
            tmp_path / "shards",
            out,
            languages=(),
            min_duration=0.5,
            max_duration=20.0,
            min_quality=0.0,
            progress=False,
        )
        summary.pop("seconds")
        outputs.append((out.read_bytes(), summary))
    assert outputs[0] == outputs[1]
    assert (
        outputs[0][1]["shards_read"] == 18 and outputs[0][1]["audio_index_without_metadata"] == 18
    )


def test_metadata_at_the_wrong_depth_is_reported_and_the_rest_is_built(tmp_path, capsys):
    write_shard(tmp_path / "shards", "src", "hi", "good", [{"segment_id": "a"}])
    too_deep = write_shard(tmp_path / "shards", "src", "hi", "good/extra", [{"segment_id": "b"}])
    too_shallow = write_shard(tmp_path / "shards", "src", "ta", "", [{"segment_id": "c"}])
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("segment_id").to_list() == ["a"]
    assert [(b["path"], b["reason"].split("(")[1]) for b in summary["bad_shards"]] == [
        (str(too_deep), "4 levels deep)"),
        (str(too_shallow), "2 levels deep)"),
    ]
    code = strict_cli_build(tmp_path)
    assert (
        code != 0
        and "levels deep" in capsys.readouterr().err
        and not (tmp_path / "m.parquet").exists()
    )


def test_a_shard_whose_path_is_not_utf8_is_reported_by_its_bytes_and_the_rest_is_built(
    tmp_path, capsys
):
    write_shard(tmp_path / "shards", "src", "hi", "good", [{"segment_id": "a"}])
    latin = write_shard(tmp_path / "shards", "src", "hi", "latin", [{"segment_id": "b"}])
    # a directory named on a Latin-1 system: "caf\xe9" is no UTF-8 name
    named = os.fsencode(latin.parent) + b"/caf\xe9"
    os.rename(os.fsencode(latin), named)
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("segment_id").to_list() == ["a"]
    shown = f"{latin.parent}/caf\\xe9"
    [bad] = summary["bad_shards"]
    assert bad["path"] == shown and "UTF-8" in bad["reason"]
    json.dumps(summary, ensure_ascii=False).encode("utf-8")  # the summary file can be written
    code = strict_cli_build(tmp_path)
    err = capsys.readouterr().err
    assert code != 0 and shown in err and not (tmp_path / "m.parquet").exists()


def test_discovery_does_not_follow_symlinked_directories_so_a_loop_cannot_hang_it(tmp_path):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    (tmp_path / "shards" / "src" / "hi" / "loop").symlink_to(
        tmp_path / "shards", target_is_directory=True
    )
    shards, misplaced = bm.discover_shards(tmp_path / "shards")
    assert [s.shard_id for s in shards] == ["src/hi/s0"] and misplaced == []


def test_missing_shards_dir_exits_non_zero_naming_it(tmp_path, capsys):
    code = bm.main(
        ["--shards-dir", str(tmp_path / "nope"), "--output", str(tmp_path / "m.parquet")]
    )
    assert code != 0 and "nope" in capsys.readouterr().err


def test_a_tree_without_shards_exits_non_zero(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = bm.main(
        ["--shards-dir", str(tmp_path / "empty"), "--output", str(tmp_path / "m.parquet")]
    )
    assert code != 0 and "no shards found" in capsys.readouterr().err


def test_help_shows_a_usage_example():
    result = subprocess.run(
        [sys.executable, str(REPO / "build_manifest.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert "example" in result.stdout and "--strict" in result.stdout


# --- output ----------------------------------------------------------------------------------------
def test_rows_are_sorted_by_shard_id_then_segment_id(tmp_path):
    write_shard(tmp_path / "shards", "b", "hi", "s0", [{"segment_id": "z"}, {"segment_id": "a"}])
    write_shard(tmp_path / "shards", "a", "hi", "s1", [{"segment_id": "y"}])
    write_shard(tmp_path / "shards", "a-b", "hi", "s0", [{"segment_id": "x"}])
    manifest, _ = build(tmp_path / "shards", tmp_path)
    pairs = manifest.select("shard_id", "segment_id").rows()
    assert pairs == sorted(pairs)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2), st.sampled_from(["x", "y", "xy", ""]), st.sampled_from(["p", "q"])
        ),
        max_size=8,
    )
)
def test_the_sort_is_skipped_only_for_rows_already_in_order(rows):
    frame = pl.DataFrame(
        rows,
        schema={"shard": pl.UInt32, "segment_id": pl.String, "tar_member_name": pl.String},
        orient="row",
    )
    columns = ["shard", "segment_id", "tar_member_name"]
    assert bm._is_sorted(frame, columns) == frame.equals(frame.sort(columns, maintain_order=True))


def test_a_shard_listed_in_order_and_one_listed_out_of_order_both_come_out_sorted(tmp_path):
    # "b" is listed twice in the metadata and twice in the index, its second file name first
    write_shard(
        tmp_path / "shards",
        "a",
        "hi",
        "s0",
        [
            {"segment_id": "a"},
            {"segment_id": "b", "tar_member_name": "b2.flac"},
            {"segment_id": "b", "tar_member_name": "b1.flac"},
            {"segment_id": "c"},
        ],
    )
    write_shard(tmp_path / "shards", "a", "hi", "s1", [{"segment_id": s} for s in ["q", "p"]])
    manifest, _ = build(tmp_path / "shards", tmp_path)
    rows = manifest.select(
        "shard_id", "segment_id", pl.col("audio_filepath").str.replace(".*/", "")
    ).rows()
    assert rows == sorted(rows) and len(rows) == 8  # each "b" row pairs with both index entries


def test_rows_keep_their_own_shard_when_a_shard_between_them_is_empty(tmp_path):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}, {"segment_id": "b"}])
    write_shard(tmp_path / "shards", "src", "hi", "s1", [])
    write_shard(
        tmp_path / "shards",
        "src",
        "ta",
        "s2",
        [{"segment_id": "c"}],
        extra_index_rows=[{"segment_id": "orphan", "tar_member_name": "orphan.flac"}],
    )
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.select("segment_id", "shard_id", "lang").rows() == [
        ("a", "src/hi/s0", "hi"),
        ("b", "src/hi/s0", "hi"),
        ("c", "src/ta/s2", "ta"),
    ]
    assert summary["shards_read"] == 3 and summary["audio_index_without_metadata"] == 1


def test_rerunning_gives_byte_identical_outputs(tmp_path):
    for i in range(3):
        write_shard(
            tmp_path / "shards",
            "src",
            ["hi", "ta", "en"][i],
            f"s{i}",
            [
                {"segment_id": f"{i}-{j}", "transcription_native": f"word{j}, [x] «w»"}
                for j in range(50)
            ],
        )
    build(tmp_path / "shards", tmp_path, workers=2)
    first = (tmp_path / "master_manifest.parquet").read_bytes()
    build(tmp_path / "shards", tmp_path, workers=1)
    assert (tmp_path / "master_manifest.parquet").read_bytes() == first


def test_a_failed_write_leaves_the_previous_manifest_and_no_temp_file(tmp_path, monkeypatch):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    build(tmp_path / "shards", tmp_path)
    before = (tmp_path / "master_manifest.parquet").read_bytes()

    def broken_write(self, path, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", broken_write)
    with pytest.raises(
        ManifestError, match=r"cannot write .*master_manifest.parquet: disk full.*Free"
    ):
        build(tmp_path / "shards", tmp_path)
    assert (tmp_path / "master_manifest.parquet").read_bytes() == before

    def refused_write(self, path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(pl.DataFrame, "write_parquet", refused_write)
    with pytest.raises(ManifestError) as raised:
        build(tmp_path / "shards", tmp_path)
    # the advice fits the failure: free space only when space ran out
    assert "Permission denied" in str(raised.value) and "Free space" not in str(raised.value)
    assert (tmp_path / "master_manifest.parquet").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "master_manifest.parquet",
        "master_manifest.summary.json",
        "shards",
    ]


def test_a_full_disk_reported_by_polars_is_named_disk_full_with_the_file(tmp_path, monkeypatch):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    build(tmp_path / "shards", tmp_path)
    summary_before = (tmp_path / "master_manifest.summary.json").read_text()
    write_shard(tmp_path / "shards", "src", "hi", "s1", [{"segment_id": "b"}])

    def full(self, path, **kwargs):
        raise pl.exceptions.ComputeError(
            "parquet: File out of specification: underlying IO error: No space left on device "
            "(os error 28)"
        )

    monkeypatch.setattr(pl.DataFrame, "write_parquet", full)
    code = bm.main(
        [
            "--shards-dir",
            str(tmp_path / "shards"),
            "--output",
            str(tmp_path / "master_manifest.parquet"),
            "--no-progress",
        ]
    )
    assert code == 2
    assert (tmp_path / "master_manifest.summary.json").read_text() == summary_before


def test_a_kill_between_the_renames_leaves_no_master_beside_an_old_summary(tmp_path, monkeypatch):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    build(tmp_path / "shards", tmp_path)
    write_shard(tmp_path / "shards", "src", "hi", "s1", [{"segment_id": "b"}])
    replace = os.replace

    def killed_after_the_master(src, dst):
        replace(src, dst)
        if str(dst).endswith(".parquet"):
            raise KeyboardInterrupt("SIGKILL")

    monkeypatch.setattr(atomic_files.os, "replace", killed_after_the_master)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "shards", tmp_path)
    assert pl.read_parquet(tmp_path / "master_manifest.parquet").height == 2
    assert not (tmp_path / "master_manifest.summary.json").exists()
    monkeypatch.undo()
    _, summary = build(tmp_path / "shards", tmp_path)  # the rerun writes a whole pair again
    assert summary["rows_out"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "master_manifest.parquet",
        "master_manifest.summary.json",
        "shards",
    ]


def test_less_free_space_than_the_shards_take_is_a_warning_before_the_work(
    tmp_path, monkeypatch, capsys
):
    write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    usage = bm.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(bm.shutil, "disk_usage", lambda path: usage._replace(free=10))
    build(tmp_path / "shards", tmp_path)
    err = capsys.readouterr().err
    assert f"warning: {tmp_path} has 0.00 GiB free" in err and "may need about" in err


# --- duplicates --------------------------------------------------------------------------------
def test_a_segment_id_in_several_shards_is_reported_with_its_shards(tmp_path, capsys):
    for shard in ("s0", "s1", "s2"):
        write_shard(
            tmp_path / "shards", "src", "hi", shard, [{"segment_id": "dup"}, {"segment_id": shard}]
        )
    code = bm.main(
        [
            "--shards-dir",
            str(tmp_path / "shards"),
            "--output",
            str(tmp_path / "m.parquet"),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "segment_ids kept more than once: 1 (3 rows, 1 in several shards" in out
    assert "'dup' in src/hi/s0, src/hi/s1, src/hi/s2" in out
    summary = json.loads((tmp_path / "m.summary.json").read_text())
    assert summary["duplicate_segment_ids"]["examples"] == [
        {"segment_id": "dup", "shard_ids": ["src/hi/s0", "src/hi/s1", "src/hi/s2"]}
    ]


def test_an_audio_file_two_ids_name_with_different_transcripts_is_dropped_and_reported(tmp_path):
    write_shard(
        tmp_path / "shards",
        "src",
        "hi",
        "s0",
        [
            {"segment_id": "a", "tar_member_name": "x.flac", "transcription_native": "one"},
            {"segment_id": "b", "tar_member_name": "x.flac", "transcription_native": "two"},
            {"segment_id": "c", "tar_member_name": "y.flac", "transcription_native": "same"},
            {"segment_id": "d", "tar_member_name": "y.flac", "transcription_native": "same!"},
            {"segment_id": "e"},
        ],
    )
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("segment_id").to_list() == ["c", "d", "e"]
    assert drops_of(summary) == {"shared_audio_other_text": 2}
    shared = summary["shared_audio"]
    assert (shared["files"], shared["rows"], shared["files_with_other_text"]) == (2, 4, 1)
    assert shared["examples"][0] == {
        "shard_id": "src/hi/s0",
        "tar_member_name": "x.flac",
        "segment_ids": ["a", "b"],
        "rows": 2,
        "texts_differ": True,
    }
    assert shared["examples"][1]["texts_differ"] is False


def test_the_same_member_name_in_two_shards_is_two_files(tmp_path):
    for shard, text in (("s0", "one"), ("s1", "two")):
        write_shard(
            tmp_path / "shards",
            "src",
            "hi",
            shard,
            [{"segment_id": shard, "tar_member_name": "x.flac", "transcription_native": text}],
        )
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.height == 2 and summary["shared_audio"]["files"] == 0


# --- text that is not UTF-8 ----------------------------------------------------------------------
def test_invalid_utf8_names_the_file_the_column_and_the_first_bad_row(tmp_path):
    good = write_shard(tmp_path / "shards", "src", "hi", "s0", [{"segment_id": "a"}])
    bad = write_shard(tmp_path / "shards", "src", "hi", "s1", [{"segment_id": "b"}])
    texts = pa.array([b"fine", b"also fine", b"bad \xff text", b"\xfe"], type=pa.binary())
    pq.write_table(
        pa.table(
            {
                "segment_id": ["b", "c", "d", "e"],
                "transcription_native": texts.view(pa.string()),
                "duration_s": [2.0] * 4,
                "tx_quality_score": [1.0] * 4,
            }
        ),
        bad / "metadata.parquet",
    )
    manifest, summary = build(tmp_path / "shards", tmp_path)
    assert manifest.get_column("segment_id").to_list() == ["a"] and good.exists()
    (report,) = summary["bad_shards"]
    assert report["path"] == str(bad)
    assert report["reason"].startswith(
        f"{bad / 'metadata.parquet'}: column 'transcription_native' is not valid UTF-8 at row 2 "
    )


# --- the benchmark script ----------------------------------------------------------------------
def test_benchmark_runs_end_to_end_and_finds_the_rows_agree(tmp_path, capsys):
    """A small corpus through benchmarks/bench_build_manifest.py: its comparison must pass, so the
    baseline and build_manifest.py agree row for row except where the new cleaning fixes the old."""
    spec = importlib.util.spec_from_file_location(
        "bench_build_manifest", REPO / "benchmarks" / "bench_build_manifest.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    code = bench.main(
        ["--shards", "10", "--rows-per-shard", "150", "--pool-size", "60", "--keep", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "rows agree except intended fixes: yes" in out and "60 transcripts per language" in out
    assert pl.read_parquet(tmp_path / "master.parquet").height > 0
