"""scripts/train_tokenizer.py: a NeMo tokenizer directory with one piece per language tag."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from manifest_schema import lang_tag, tagged_text
from scripts import train_tokenizer as tt

REPO = Path(__file__).resolve().parents[1]
HI = ["नमस्ते दुनिया", "मेरा नाम राम है", "यह एक परीक्षण है", "भारत एक बड़ा देश है", "आज मौसम अच्छा है"]
TA = ["வணக்கம் உலகம்", "என் பெயர் ராம்", "இது ஒரு சோதனை"]
EN = [
    "hello world",
    "my name is ram",
    "this is a test",
    "india is a large country",
    "the weather is nice today",
]


def write_manifest(path: Path, rows: list[tuple[str, str]], duration: float = 2.0) -> Path:
    table = pa.table(
        {
            "segment_id": [str(i) for i in range(len(rows))],
            "text": [tagged_text(lang, text) for lang, text in rows],
            "duration": [duration] * len(rows),
            "lang": [lang for lang, _ in rows],
        }
    )
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    rows = [("en", f"{EN[rng.integers(5)]} {EN[rng.integers(5)]}") for _ in range(300)]
    rows += [("hi", HI[rng.integers(5)]) for _ in range(100)]
    rows += [("ta", TA[rng.integers(3)]) for _ in range(10)]
    rows.append(("hi", "ॐ शांति"))  # a character seen once: coverage 1.0 must keep it
    return write_manifest(tmp_path_factory.mktemp("tok") / "train.parquet", rows)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokdir") / "tokenizer"
    summary = tt.train_tokenizer(
        corpus, out, vocab_size=120, temperature=0.3, lang_weighting="count", seed=1
    )
    return out, summary


def test_writes_the_nemo_tokenizer_files(trained):
    out, _ = trained
    assert {p.name for p in out.iterdir()} == {
        "tokenizer.model",
        "tokenizer.vocab",
        "vocab.txt",
        "summary.json",
        "piece_counts.json",
        "language_scripts.json",
    }


def test_language_scripts_count_each_languages_letters_by_script(trained):
    """Per language, the letters of each script in its texts: Hindi in Devanagari, English in
    Latin, Tamil in Tamil; the tags' letters are not counted (the texts are read without them)."""
    import vocabulary

    out, summary = trained
    letters = vocabulary.read_language_scripts(out)
    assert set(letters) == {"en", "hi", "ta"}
    assert set(letters["hi"]) == {"Devanagari"} and set(letters["ta"]) == {"Tamil"}
    assert letters["en"] == {"Latin": sum(letters["en"].values())} and letters["en"]["Latin"] > 0
    assert summary["per_language"]["hi"]["scripts"] == ["Devanagari"]


def test_piece_counts_are_the_sampled_texts_pieces_with_their_tags(trained):
    import vocabulary

    out, summary = trained
    counts = vocabulary.read_piece_counts(out)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert len(counts) == sp.get_piece_size()
    record = json.loads((out / "piece_counts.json").read_text())
    assert record["sentences"] == summary["sampled_sentences"]
    tags = [sp.piece_to_id(lang_tag(lang)) for lang in ("en", "hi", "ta")]
    # every sampled sentence starts with its tag, as dataset.py emits it
    assert sum(counts[t] for t in tags) == summary["sampled_sentences"]
    # the temperature-sampled mix: Tamil, 10 of 411 rows, is sampled far above its natural share
    assert counts[tags[2]] / summary["sampled_sentences"] > 3 * 10 / 411
    text_pieces = sum(counts) - summary["sampled_sentences"]
    assert text_pieces > summary["sampled_sentences"]  # pieces of the texts themselves


def test_piece_counts_beside_another_tokenizer_model_are_not_read(trained, tmp_path):
    import shutil

    import vocabulary

    out, _ = trained
    copy = tmp_path / "tok"
    shutil.copytree(out, copy)
    (copy / "tokenizer.model").write_bytes((copy / "tokenizer.model").read_bytes() + b"\0")
    assert vocabulary.read_piece_counts(copy) is None


def test_vocab_txt_follows_nemo_rules(trained):
    out, _ = trained
    pieces = [
        line.split("\t")[0]
        for line in (out / "tokenizer.vocab").read_text(encoding="utf-8").splitlines()
    ]
    skipped = {"<unk>", "<|en|>", "<|hi|>", "<|ta|>"}
    expected = [p[1:] if p.startswith("\u2581") else f"##{p}" for p in pieces if p not in skipped]
    expected = [e if e else "\u2581" for e in expected]
    assert (out / "vocab.txt").read_text(encoding="utf-8").splitlines() == expected


def test_every_language_tag_is_one_piece_and_encodes_to_its_id(trained):
    out, _ = trained
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    for lang in ("en", "hi", "ta"):
        tag_id = sp.piece_to_id(lang_tag(lang))
        assert tag_id != sp.unk_id()
        assert tag_id in sp.encode(tagged_text(lang, "नमस्ते"))


def test_nemo_tokenizer_loads_the_directory_and_finds_the_tags(trained):
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    out, summary = trained
    tok = SentencePieceTokenizer(model_path=str(out / "tokenizer.model"))
    assert tok.vocab_size == summary["vocab_size"]
    hi_id = tok.token_to_id("<|hi|>")
    assert hi_id == tok.text_to_ids("<|hi|>")[-1]
    assert hi_id in tok.text_to_ids("<|hi|> नमस्ते दुनिया")


def test_character_coverage_keeps_a_character_seen_once(trained):
    out, _ = trained
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sp.unk_id() not in sp.encode("ॐ")


def test_report_has_unknown_rate_and_tokens_per_second_for_every_language(trained):
    out, summary = trained
    on_disk = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert on_disk["per_language"] == summary["per_language"]
    for lang in ("en", "hi", "ta"):
        row = summary["per_language"][lang]
        assert row["unk_rate"] == 0.0
        assert row["tokens_per_second"] > 0


def test_temperature_shares_follow_counts_to_the_power_t():
    shares = tt.language_shares({"a": 900.0, "b": 100.0}, 0.5)
    assert shares["a"] == pytest.approx(30 / 40) and shares["b"] == pytest.approx(10 / 40)
    assert tt.language_shares({"a": 900.0, "b": 100.0}, 0.0) == {"a": 0.5, "b": 0.5}
    assert tt.language_shares({"a": 900.0, "b": 100.0}, 1.0)["a"] == pytest.approx(0.9)


def test_sampling_gives_small_languages_their_temperature_share():
    tags = np.array(["en"] * 900 + ["ta"] * 100, dtype=object)
    chosen = tt.sample_indices(
        tags, {"en": 900.0, "ta": 100.0}, 0.0, 1000, np.random.default_rng(0)
    )
    assert (tags[chosen] == "ta").sum() == 500  # uniform at T=0: ta rows repeat to fill their half


def test_summary_reports_target_shares(trained):
    _, summary = trained
    assert sum(summary["target_share"].values()) == pytest.approx(1.0)
    assert summary["target_share"]["ta"] > 10 / 411  # more than its natural share


@contextlib.contextmanager
def warnings_logged_by(logger: logging.Logger):
    """The WARNING records ``logger`` emits inside the block, taken at the logger itself, so what
    earlier tests did to the root logger's handlers or levels cannot hide them."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # also clears every logger's cached level checks
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_vocabulary_larger_than_the_corpus_allows_is_capped_with_a_warning(corpus, tmp_path):
    with warnings_logged_by(tt.log) as warned:
        summary = tt.train_tokenizer(
            corpus, tmp_path / "tok", vocab_size=12000, seed=1, mode="new", base=""
        )
    assert summary["mode"] == "new"
    assert summary["vocab_size"] < 12000
    assert (
        spm.SentencePieceProcessor(
            model_file=str(tmp_path / "tok" / "tokenizer.model")
        ).get_piece_size()
        == summary["vocab_size"]
    )
    capped = [r.getMessage() for r in warned if "more than this corpus can fill" in r.getMessage()]
    assert len(capped) == 1 and f"training {summary['vocab_size']} pieces" in capped[0]


def test_sentencepiece_is_given_no_option_it_has_deprecated(corpus, tmp_path, monkeypatch):
    """SentencePiece prints a line to stderr for a deprecated option it is given."""
    from sentencepiece import sentencepiece_model_pb2

    given = {}
    train = spm.SentencePieceTrainer.train

    def recording_train(**options):
        given.update(options)
        return train(**options)

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", recording_train)
    tt.train_tokenizer(corpus, tmp_path / "tok", vocab_size=100, seed=1)
    fields = sentencepiece_model_pb2.TrainerSpec.DESCRIPTOR.fields_by_name
    assert [k for k in given if k in fields and fields[k].GetOptions().deprecated] == []


def test_vocabulary_below_the_corpus_characters_fails_with_the_minimum_to_set(corpus, tmp_path):
    out = tmp_path / "tok"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train_tokenizer.py"),
            "--manifest",
            str(corpus),
            "--output",
            str(out),
            "--vocab-size",
            "20",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert (
        "VOCAB_SIZE=20 is below the" in proc.stderr and "set VOCAB_SIZE to at least" in proc.stderr
    )
    assert not out.exists()


def test_output_replaces_an_existing_directory_whole(corpus, tmp_path):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    tt.train_tokenizer(corpus, out, vocab_size=100, seed=1)
    assert not (out / "stale.txt").exists() and (out / "tokenizer.model").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temporary directory left behind


def test_failure_leaves_the_old_tokenizer_untouched_and_names_the_row(tmp_path):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.model").write_text("old")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["<|en|> fine", "no tag here"], "duration": [1.0, 1.0]}), bad)
    with pytest.raises(ValueError, match="row 1"):
        tt.train_tokenizer(bad, out, vocab_size=50)
    assert (out / "tokenizer.model").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.parquet", "tok"]


def test_help_shows_usage():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_tokenizer.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "python scripts/train_tokenizer.py" in out and "--vocab-size" in out


def test_training_the_same_tokenizer_twice_writes_the_same_bytes(corpus, trained, tmp_path):
    out, _ = trained
    again = tmp_path / "elsewhere" / "tokenizer"
    tt.train_tokenizer(
        corpus, again, vocab_size=120, temperature=0.3, lang_weighting="count", seed=1
    )
    for name in ("tokenizer.model", "tokenizer.vocab", "vocab.txt"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
