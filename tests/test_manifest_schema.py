"""manifest_schema.py: the tag format and its round trip, tag stripping, summaries and shared writers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import manifest_schema as ms

LANG = st.from_regex(ms.LANG_CODE_PATTERN, fullmatch=True)
# Transcripts as build_manifest writes them: words of anything but whitespace and "|", one space
# apart, no leading or trailing space.
WORD = st.text(
    st.characters(blacklist_categories=("Zs", "Zl", "Zp", "Cc", "Cs"), blacklist_characters="|"),
    min_size=1,
)
TRANSCRIPT = st.lists(WORD, max_size=6).map(" ".join)


# --- the tag format --------------------------------------------------------------------------
def test_tag_prefix_and_tagged_text_spell_the_format():
    assert ms.lang_tag("hi") == "<|hi|>"
    assert ms.tag_prefix("en-in") == "<|en-in|> "
    assert ms.tagged_text("ta", "வணக்கம் நன்றி") == "<|ta|> வணக்கம் நன்றி"


# No deadline: the first call compiles pyarrow's (or polars') regex and can take longer than
# hypothesis' 200 ms on a busy 2-core machine, which hypothesis then reports as a flaky failure.
@settings(deadline=None)
@given(LANG, TRANSCRIPT)
def test_split_lang_tags_recovers_the_language_and_transcript_of_tagged_text(lang, transcript):
    langs, transcripts = ms.split_lang_tags(pa.array([ms.tagged_text(lang, transcript)]))
    assert langs.to_pylist() == [lang]
    assert transcripts.to_pylist() == [transcript]


def test_split_lang_tags_gives_null_where_no_tag_leads_and_keeps_that_text():
    texts = ["no tag", "x <|hi|> later", "<|hi|>glued", "<|a b|> space in tag", None]
    langs, transcripts = ms.split_lang_tags(pa.array(texts))
    assert langs.to_pylist() == [None] * len(texts)
    assert transcripts.to_pylist() == texts


def test_split_lang_tags_takes_one_space_after_the_tag_and_accepts_the_bare_tag():
    langs, transcripts = ms.split_lang_tags(pa.chunked_array([["<|hi|>  two spaces", "<|en|>"]]))
    assert langs.to_pylist() == ["hi", "en"]
    assert transcripts.to_pylist() == [" two spaces", ""]


@settings(deadline=None)  # see above
@given(st.lists(st.tuples(LANG, TRANSCRIPT), max_size=8))
def test_polars_expressions_equal_the_python_functions(rows):
    frame = pl.DataFrame(
        {"language": [r[0] for r in rows], "body": [r[1] for r in rows]},
        schema={"language": pl.String, "body": pl.String},
    )
    out = frame.select(
        prefix=ms.tag_prefix_expr("language"), text=ms.tagged_text_expr("body", "language")
    )
    assert out.get_column("prefix").to_list() == [ms.tag_prefix(lang) for lang, _ in rows]
    assert out.get_column("text").to_list() == [ms.tagged_text(lang, body) for lang, body in rows]


def test_polars_expressions_are_null_where_the_language_is_null():
    frame = pl.DataFrame(
        {"lang": [None, "hi"], "body": ["x", "y"]}, schema={"lang": pl.String, "body": pl.String}
    )
    out = frame.select(ms.tag_prefix_expr(), ms.tagged_text_expr(pl.col("body")).alias("text"))
    assert out.rows() == [(None, None), ("<|hi|> ", "<|hi|> y")]


# --- stripping tags --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, stripped",
    [
        ("<|hi|> नमस्ते दुनिया", "नमस्ते दुनिया"),
        ("<|hi|>  नमस्ते   दुनिया ", "नमस्ते दुनिया"),
        ("hello <|en|> world", "hello world"),
        ("<|en|><|hi|>a<|ta|>b <||>", "a b"),
        ("no tag at all", "no tag at all"),
        ("  spaced\tout\nline  ", "spaced out line"),
        ("<|hi|>", ""),
        ("", ""),
    ],
)
def test_strip_lang_tag_removes_every_tag_and_collapses_whitespace(text, stripped):
    assert ms.strip_lang_tag(text) == stripped


@pytest.mark.parametrize("text", ["a <b> c|", "<|a b|> x", "<|x<y|> z", "| > <|", "<|hi|"])
def test_strip_lang_tag_leaves_what_is_not_a_tag(text):
    assert ms.strip_lang_tag(text) == " ".join(text.split())


@given(LANG, TRANSCRIPT)
def test_strip_lang_tag_of_tagged_text_is_its_transcript(lang, transcript):
    assert ms.strip_lang_tag(ms.tagged_text(lang, transcript)) == " ".join(transcript.split())


def test_tag_pattern_matches_a_whole_tag_of_any_language():
    assert re.fullmatch(ms.TAG_PATTERN, ms.lang_tag("en-in"))
    assert re.findall(ms.TAG_PATTERN, "<|hi|> a <|en|>") == ["<|hi|>", "<|en|>"]


# --- summaries, writers, counts ----------------------------------------------------------------
@pytest.mark.parametrize(
    "manifest, summary",
    [
        ("/d/master_manifest.parquet", "/d/master_manifest.summary.json"),
        ("/d/train.v2.parquet", "/d/train.v2.summary.json"),
        ("/d/manifest", "/d/manifest.summary.json"),
    ],
)
def test_summary_sits_beside_the_manifest_without_the_parquet_suffix(manifest, summary):
    assert ms.summary_path(manifest) == Path(summary)


def test_write_json_atomically_writes_sorted_utf8_json_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "s.summary.json"
    ms.write_json_atomically({"b": 1, "a": {"lang": "हिन्दी"}}, path)
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == {"a": {"lang": "हिन्दी"}, "b": 1}
    assert "हिन्दी" in text and text.index('"a"') < text.index('"b"') and text.endswith("\n")
    assert [p.name for p in path.parent.iterdir()] == ["s.summary.json"]


def test_write_manifest_round_trips_the_frame(tmp_path):
    frame = pl.DataFrame({"segment_id": ["a", "b"], "duration": [1.5, 2.0]})
    ms.write_manifest(frame, tmp_path / "m.parquet")
    assert pl.read_parquet(tmp_path / "m.parquet").equals(frame)
    assert [p.name for p in tmp_path.iterdir()] == ["m.parquet"]


def test_counts_by_nests_keys_sorted_and_names_enum_values():
    reason = pl.Enum(["z_first", "a_second"])
    frame = pl.DataFrame(
        {"lang": ["hi", "en", "hi", "hi"], "reason": ["a_second", "z_first", "z_first", "z_first"]},
        schema={"lang": pl.String, "reason": reason},
    )
    assert ms.counts_by(frame, "lang") == {"en": 1, "hi": 3}
    nested = ms.counts_by(frame, "lang", "reason")
    assert nested == {"en": {"z_first": 1}, "hi": {"a_second": 1, "z_first": 2}}
    assert list(nested) == ["en", "hi"] and list(nested["hi"]) == ["a_second", "z_first"]


# --- imports ---------------------------------------------------------------------------------
def test_importing_the_module_loads_neither_polars_nor_pyarrow():
    code = "import sys, manifest_schema; print(sorted({'polars', 'pyarrow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_leading_lang_reads_the_tag_a_hypothesis_starts_with():
    from manifest_schema import leading_lang

    assert leading_lang("<|hi|> नमस्ते") == "hi" and leading_lang("  <|en|>") == "en"
    assert leading_lang("hello <|hi|>") is None and leading_lang("") is None


def test_a_nemo_json_manifest_resolves_relative_audio_and_reads_a_leading_tag_as_the_language(
    tmp_path,
):
    from manifest_schema import ManifestError, read_nemo_manifest

    path = tmp_path / "sub" / "m.json"
    path.parent.mkdir()
    path.write_text(
        '{"audio_filepath": "a/x.flac", "duration": 1.5, "text": "<|hi|> नमस्ते"}\n\n'
        '{"audio_filepath": "/abs/y.wav", "text": "hello", "lang": "en"}\n',
        encoding="utf-8",
    )
    a, b = read_nemo_manifest(path)
    assert (a.audio_filepath, a.duration, a.text, a.lang) == (
        str(path.parent / "a" / "x.flac"),
        1.5,
        "नमस्ते",
        "hi",
    )
    assert (b.audio_filepath, b.duration, b.lang) == ("/abs/y.wav", None, "en")
    path.write_text('{"audio_filepath": "x.flac", "duration": "long"}\n', encoding="utf-8")
    with pytest.raises(ManifestError, match=r"m.json:1: duration 'long' is not a number"):
        read_nemo_manifest(path)


def test_a_nemo_json_manifest_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    from manifest_schema import read_nemo_manifest

    path = tmp_path / "m.json"
    lines = '{"audio_filepath": "/a.flac", "text": "hi there", "lang": "en"}\n' * 2
    path.write_bytes(b"\xef\xbb\xbf" + lines.encode("utf-8"))
    rows = read_nemo_manifest(path)
    assert [(r.audio_filepath, r.text, r.lang) for r in rows] == [("/a.flac", "hi there", "en")] * 2


@pytest.mark.parametrize(
    "data, message",
    [
        ('{"audio_filepath": "/a.flac"}\n'.encode("utf-16"), r"m.json: UTF-16 text"),
        (
            b'{"audio_filepath": "/a.flac"}\n{"audio_filepath": "/b\xe9.flac"}\n',
            r"m.json:2: not UTF-8",
        ),
    ],
    ids=["utf16", "latin1"],
)
def test_a_nemo_json_manifest_that_is_not_utf8_is_one_error_naming_it(tmp_path, data, message):
    from manifest_schema import ManifestError, read_nemo_manifest

    path = tmp_path / "m.json"
    path.write_bytes(data)
    with pytest.raises(ManifestError, match=message):
        read_nemo_manifest(path)
