"""scripts/train_tokenizer.py, TOKENIZER_MODE extend and tags: a base model's tokenizer grows new
pieces for what it does not cover, and every base piece keeps its id and its segmentations."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import yaml

from manifest_schema import lang_tag
from scripts import train_tokenizer as tt
from tests.test_train_tokenizer import EN, HI, TA, write_manifest

WORDS_EN = (
    "the of and to in is you that it he was for on are as with his they at be this have".split()
)


def from_base(corpus: Path, out: Path, base, mode: str = "extend") -> dict:
    """train_tokenizer.py's ``mode`` from ``base`` on ``corpus``: 200 pieces, temperature 0.5 over
    utterance counts, seed 1; its summary."""
    return tt.train_tokenizer(
        corpus,
        out,
        vocab_size=200,
        temperature=0.5,
        lang_weighting="count",
        seed=1,
        mode=mode,
        base=str(base),
    )


def english_rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    return [("en", " ".join(rng.choice(WORDS_EN, size=6))) for _ in range(n)] + [
        ("en", s) for s in EN
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """An English-only base tokenizer (BPE), as a pretrained English model has."""
    root = tmp_path_factory.mktemp("base")
    manifest = write_manifest(root / "en.parquet", english_rows(400))
    tt.train_tokenizer(
        manifest,
        root / "tokenizer",
        vocab_size=90,
        temperature=1.0,
        lang_weighting="count",
        seed=0,
        mode="new",
    )
    return root / "tokenizer"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(1)
    rows = english_rows(100, seed=2)
    rows += [("hi", f"{HI[rng.integers(5)]} {HI[rng.integers(5)]}") for _ in range(150)]
    rows += [("ta", f"{TA[rng.integers(3)]} {TA[rng.integers(3)]}") for _ in range(100)]
    return write_manifest(tmp_path_factory.mktemp("mix") / "train.parquet", rows)


@pytest.fixture(scope="module")
def extended(base, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ext") / "tokenizer"
    summary = from_base(corpus, out, base)
    return out, summary


def pieces(model: Path) -> list[str]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def test_every_base_piece_keeps_its_id(base, extended):
    out, summary = extended
    old, new = pieces(base / "tokenizer.model"), pieces(out / "tokenizer.model")
    assert new[: len(old)] == old
    assert len(new) == summary["vocab_size"] <= 200 and len(new) > len(old)


def test_english_is_segmented_exactly_as_the_base_segments_it(base, extended):
    out, _ = extended
    old = spm.SentencePieceProcessor(model_file=str(base / "tokenizer.model"))
    new = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    texts = [row for _, row in english_rows(300, seed=7)] + ["unseen words like zebra quartz"]
    assert new.encode(texts) == old.encode(texts)
    assert new.encode(texts, out_type=str) == old.encode(texts, out_type=str)


def test_appended_pieces_each_hold_a_character_the_base_cannot_write(base, extended):
    out, summary = extended
    old = pieces(base / "tokenizer.model")
    covered = {c for p in old for c in p if not p.startswith("<")}
    appended = pieces(out / "tokenizer.model")[len(old) :]
    tags = [p for p in appended if p.startswith("<|")]
    assert sorted(tags) == [lang_tag("hi"), lang_tag("ta")]  # <|en|> is the base's already
    words = [p for p in appended if p not in tags]
    assert words and all(any(c not in covered for c in p) for p in words)
    extension = summary["extension"]
    assert extension["base_pieces"] == len(old)
    assert extension["appended_pieces"] == len(words)
    assert extension["appended_tags"] == 2
    assert extension["covered_sentences_checked"] > 50


def test_new_languages_get_no_unknown_pieces_and_the_summary_splits_base_and_new(extended):
    out, summary = extended
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    for text in HI + TA:
        assert sp.unk_id() not in sp.encode(text)
    per_lang = summary["per_language"]
    assert per_lang["en"]["base_piece_share"] == 1.0 and per_lang["en"]["unk_rate"] == 0.0
    assert per_lang["hi"]["appended_piece_share"] > 0.5 and per_lang["hi"]["unk_rate"] == 0.0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["mode"] == "extend" and saved["extension"]["base_pieces"] == 90


def test_bpe_pieces_are_appended_after_every_base_merge_in_learned_order(base, extended):
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((extended[0] / "tokenizer.model").read_bytes())
    n_base = len(pieces(base / "tokenizer.model"))
    base_scores = [p.score for p in proto.pieces[:n_base] if p.type == tt.NORMAL]
    new_scores = [p.score for p in proto.pieces[n_base:] if p.type == tt.NORMAL]
    assert max(new_scores) < min(base_scores)
    assert new_scores == sorted(new_scores, reverse=True)


def test_tags_mode_keeps_the_base_and_adds_only_the_tags(base, corpus, tmp_path):
    summary = from_base(corpus, tmp_path / "tok", base, mode="tags")
    old, new = pieces(base / "tokenizer.model"), pieces(tmp_path / "tok" / "tokenizer.model")
    assert new == old + [lang_tag("hi"), lang_tag("ta")]
    assert summary["extension"]["appended_pieces"] == 0


def test_a_unigram_base_is_extended_with_its_segmentations_kept(corpus, tmp_path):
    from sentencepiece import SentencePieceTrainer

    text = tmp_path / "en.txt"
    text.write_text("\n".join(row for _, row in english_rows(400)), encoding="utf-8")
    SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=50,
        hard_vocab_limit=False,
        model_type="unigram",
        character_coverage=1.0,
        minloglevel=2,
    )
    summary = from_base(corpus, tmp_path / "ext", tmp_path)
    old = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    new = spm.SentencePieceProcessor(model_file=str(tmp_path / "ext" / "tokenizer.model"))
    texts = [row for _, row in english_rows(100, seed=3)]
    assert new.encode(texts) == old.encode(texts)
    assert summary["extension"]["appended_pieces"] > 0


def write_nemo(path: Path, tokenizer: dict, model_file: Path | None) -> Path:
    """A .nemo archive with a model_config.yaml and, when given, a tokenizer model."""
    with tarfile.open(path, "w") as archive:
        data = yaml.safe_dump({"tokenizer": tokenizer}).encode()
        info = tarfile.TarInfo("./model_config.yaml")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
        if model_file is not None:
            archive.add(model_file, arcname="./a1b2_tokenizer.model")
    return path


def test_the_base_is_read_from_a_nemo_archive(base, corpus, tmp_path):
    nemo = write_nemo(
        tmp_path / "base.nemo",
        {"type": "bpe", "model_path": "nemo:a1b2_tokenizer.model"},
        base / "tokenizer.model",
    )
    summary = from_base(corpus, tmp_path / "tok", nemo)
    assert summary["extension"]["base"] == f"the tokenizer of {nemo}"
    assert pieces(tmp_path / "tok" / "tokenizer.model")[:90] == pieces(base / "tokenizer.model")


@pytest.mark.parametrize(
    "tokenizer, message",
    [
        ({"type": "wpe", "dir": "x"}, "a 'wpe' tokenizer, not SentencePiece"),
        ({"type": "agg", "langs": {"en": {}}}, "an aggregate tokenizer"),
    ],
)
def test_a_base_that_cannot_be_extended_is_refused_in_one_line(
    corpus, tmp_path, tokenizer, message
):
    nemo = write_nemo(tmp_path / "base.nemo", tokenizer, None)
    with pytest.raises(tt.TokenizerError, match=message):
        tt.train_tokenizer(corpus, tmp_path / "tok", vocab_size=200, mode="extend", base=str(nemo))
    assert not (tmp_path / "tok").exists()


def test_a_character_model_base_is_refused(corpus, tmp_path):
    from sentencepiece import SentencePieceTrainer

    text = tmp_path / "en.txt"
    text.write_text("\n".join(row for _, row in english_rows(50)), encoding="utf-8")
    SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "tokenizer"),
        model_type="char",
        minloglevel=2,
    )
    with pytest.raises(tt.TokenizerError, match="word or character SentencePiece model"):
        tt.train_tokenizer(
            corpus, tmp_path / "tok", vocab_size=200, mode="extend", base=str(tmp_path)
        )


def test_extend_without_a_base_says_to_set_init_model(corpus, tmp_path):
    with pytest.raises(tt.TokenizerError, match="set INIT_MODEL"):
        tt.train_tokenizer(corpus, tmp_path / "tok", mode="extend", base="")


def test_a_vocabulary_no_larger_than_the_base_is_an_error_naming_both_sizes(base, corpus, tmp_path):
    with pytest.raises(tt.TokenizerError, match="VOCAB_SIZE=80 leaves no room.*base has 90"):
        tt.train_tokenizer(corpus, tmp_path / "tok", vocab_size=80, mode="extend", base=str(base))


def spy_on_learning(monkeypatch) -> list[list[str]]:
    """The sentences of every SentencePiece training train_tokenizer.py runs, as they are run."""
    learned: list[list[str]] = []
    real = tt._train_spm

    def spying(sentence_file, *args, **kwargs):
        learned.append(Path(sentence_file).read_text(encoding="utf-8").splitlines())
        return real(sentence_file, *args, **kwargs)

    monkeypatch.setattr(tt, "_train_spm", spying)
    return learned


def test_appended_pieces_are_learned_only_from_sentences_with_a_new_character(
    base, corpus, tmp_path, monkeypatch
):
    learned = spy_on_learning(monkeypatch)
    summary = from_base(corpus, tmp_path / "tok", base)
    assert learned and all(learned)
    english = [line for lines in learned for line in lines if line.isascii()]
    assert english == []  # English text, spaces included, is the base's
    assert summary["extension"]["learned_from_sentences"] == len(learned[0])


def test_english_text_against_an_english_base_learns_nothing(base, tmp_path, monkeypatch):
    manifest = write_manifest(tmp_path / "en.parquet", english_rows(150, seed=5))
    learned = spy_on_learning(monkeypatch)
    summary = from_base(manifest, tmp_path / "tok", base)
    assert learned == []
    assert summary["extension"]["appended_pieces"] == 0
    assert summary["extension"]["learned_from_sentences"] == 0
