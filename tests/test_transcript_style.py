"""TRANSCRIPT_STYLE: plain or punctuated training targets, the default chosen from the base, the
style recorded with the manifest and checked at train start, and the punctuation and case scores."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import sentencepiece as spm

import build_manifest as bm
import config
import transcript_cleaning as tc
import transcript_style as ts
from punctuation_scoring import punctuation_case_scores, punctuation_metrics, split_marks
from scripts import make_train_val as mtv
from tests.shard_factory import write_shard

ENGLISH = "Is it raining? Yes, it is."
HINDI = "क्या बारिश हो रही है? हाँ, हो रही है।"
SENTENCE_MARKS = ("?", ",", ".", "\u0964")


def build(tmp_path: Path, style: str, name: str = "master") -> tuple[pl.DataFrame, dict, Path]:
    """A master built by build_manifest from a two-language shard tree in ``style``."""
    shards = tmp_path / "shards"
    if not shards.exists():
        for lang, text in (("en", ENGLISH), ("hi", HINDI)):
            rows = [
                {"segment_id": f"{lang}{i}", "transcription_native": text, "speaker_id": f"s{i}"}
                for i in range(4)
            ]
            write_shard(shards, "src", lang, "s0", rows)
    out = tmp_path / f"{name}.parquet"
    summary = bm.build_manifest(
        shards,
        out,
        languages=(),
        min_duration=0.5,
        max_duration=20.0,
        min_quality=0.0,
        style=style,
        progress=False,
    )
    return pl.read_parquet(out), summary, out


def tokenizer_dir(tmp_path: Path, sentences: list[str]) -> Path:
    """A tokenizer directory holding a small SentencePiece model learned from ``sentences``."""
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences * 20),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=40,
        character_coverage=1.0,
        hard_vocab_limit=False,
    )
    return directory


# --- the targets -------------------------------------------------------------------------------
def test_punctuated_targets_keep_question_mark_comma_full_stop_danda_and_case(tmp_path):
    manifest, _, _ = build(tmp_path, "punctuated")
    texts = dict(zip(manifest["lang"], manifest["text"]))
    assert texts["en"] == "<|en|> Is it raining? Yes, it is."
    assert texts["hi"] == "<|hi|> क्या बारिश हो रही है? हाँ, हो रही है।"
    assert all(mark in " ".join(texts.values()) for mark in SENTENCE_MARKS)


def test_plain_targets_keep_none_of_question_mark_comma_full_stop_danda(tmp_path):
    manifest, _, _ = build(tmp_path, "plain")
    texts = " ".join(manifest["text"])
    assert not any(mark in texts for mark in SENTENCE_MARKS)
    assert set(manifest["text"]) == {
        "<|en|> Is it raining Yes it is",
        "<|hi|> क्या बारिश हो रही है हाँ हो रही है",
    }


def test_punctuated_style_attaches_marks_and_still_removes_tags_quotes_and_symbols():
    raw = '[noise] "Well ,  look" — it\u2019s <b>fine</b> … really ?  ॥'
    assert tc.clean_text(raw, "punctuated") == "Well, look it's fine really?॥"


def test_punctuated_style_drops_marks_with_no_word_before_them():
    assert tc.clean_text("?! , hello", "punctuated") == "hello"
    assert tc.clean_text("[music] . ।", "punctuated") == ""


def test_punctuated_style_keeps_decimal_points_and_removes_joiners_at_marks():
    assert tc.clean_text("3.5 km", "punctuated") == "3.5 km"
    assert tc.clean_text("\u0915\u200d, \u200d\u0916", "punctuated") == "\u0915, \u0916"


def test_punctuated_cleaning_twice_changes_nothing():
    for text in (ENGLISH, HINDI, '"A" , b ... c ?', "x \u200c. y"):
        once = tc.clean_text(text, "punctuated")
        assert tc.clean_text(once, "punctuated") == once


def test_an_unknown_style_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="TRANSCRIPT_STYLE='cased'"):
        tc.clean_text("a", "cased")


# --- the record --------------------------------------------------------------------------------
def test_the_master_records_its_style_in_its_metadata_and_summary(tmp_path):
    _, summary, out = build(tmp_path, "punctuated")
    assert ts.manifest_style(out) == "punctuated"
    assert summary["settings"]["transcript_style"] == "punctuated"


def test_make_train_val_carries_the_masters_style_into_train_and_val(tmp_path):
    _, _, master = build(tmp_path, "punctuated")
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    summary = mtv.make_train_val(
        master, train, val, val_per_lang=1, seed=1, languages=(), max_val_fraction=0.5
    )
    assert ts.manifest_style(train) == ts.manifest_style(val) == "punctuated"
    assert summary["settings"]["transcript_style"] == "punctuated"


def test_training_on_a_manifest_of_another_style_is_refused_in_one_line(tmp_path, monkeypatch):
    _, _, master = build(tmp_path, "plain")
    monkeypatch.setattr(config, "TRANSCRIPT_STYLE", "punctuated")
    with pytest.raises(ts.TranscriptStyleError) as error:
        ts.check_manifest_style(master)
    message = str(error.value)
    assert "\n" not in message
    assert f"TRAIN_MANIFEST_PATH={master} holds plain targets" in message
    assert "TRANSCRIPT_STYLE=plain" in message


def test_under_auto_training_takes_the_manifests_style(tmp_path, monkeypatch):
    _, _, master = build(tmp_path, "punctuated")
    monkeypatch.setattr(config, "TRANSCRIPT_STYLE", "auto")
    monkeypatch.setattr(config, "INIT_MODEL", "")
    assert ts.check_manifest_style(master) == "punctuated"


def test_under_auto_training_warns_when_the_base_writes_the_other_style(
    tmp_path, monkeypatch, caplog
):
    _, _, master = build(tmp_path, "plain")
    monkeypatch.setattr(config, "TRANSCRIPT_STYLE", "auto")
    monkeypatch.setattr(config, "INIT_MODEL", str(tokenizer_dir(tmp_path, [ENGLISH, HINDI])))
    with caplog.at_level(logging.WARNING, logger="transcript_style"):
        assert ts.check_manifest_style(master) == "plain"
    assert "the training targets are plain but INIT_MODEL=" in caplog.text
    assert "TRANSCRIPT_STYLE=punctuated" in caplog.text


# --- the default -------------------------------------------------------------------------------
def test_auto_is_punctuated_for_a_base_whose_tokenizer_has_punctuation_pieces(tmp_path):
    base = tokenizer_dir(tmp_path, [ENGLISH, HINDI])
    style, why = ts.resolve_style("auto", str(base))
    assert style == "punctuated"
    assert "tokenizer has punctuation pieces" in why


def test_auto_is_plain_for_a_base_whose_tokenizer_has_none(tmp_path):
    base = tokenizer_dir(tmp_path, [tc.clean_text(ENGLISH), tc.clean_text(HINDI)])
    assert ts.resolve_style("auto", str(base))[0] == "plain"


def test_auto_is_plain_without_a_base():
    assert ts.resolve_style("auto", "")[0] == "plain"


@pytest.mark.parametrize("missing", ["base.nemo", "runs/step_00001000.ckpt"])
def test_a_base_path_that_does_not_exist_is_an_error_not_plain(tmp_path, missing):
    path = tmp_path / missing
    with pytest.raises(ts.TranscriptStyleError, match=f"INIT_MODEL={path} does not exist"):
        ts.resolve_style("auto", str(path))


def test_a_base_whose_tokenizer_cannot_be_read_is_an_error_not_plain(tmp_path):
    # a .nemo cut short by a failed copy: its style cannot be told, and plain would be a guess
    base = tmp_path / "base.nemo"
    base.write_bytes(b"\x1f\x8b\x08\x00 not the rest of a tar")
    with pytest.raises(ts.TranscriptStyleError, match="cannot tell which style the base writes"):
        ts.resolve_style("auto", str(base))
    # with the style set, the same base is only a warning that it is unchecked
    warning = ts.base_mismatch("plain", str(base))
    assert warning.startswith("the plain targets are not checked against the base's style: ")
    assert "tokenizer cannot be read" in warning


def test_a_style_set_with_a_base_that_is_not_there_warns_that_it_is_unchecked(tmp_path):
    path = tmp_path / "base.nemo"
    assert ts.base_mismatch("plain", str(path)) == (
        f"the plain targets are not checked against the base's style: INIT_MODEL={path} does not "
        f"exist; give a .nemo file, a step_*.ckpt or a pretrained name such as "
        f"nvidia/parakeet-tdt-0.6b-v2"
    )


def test_auto_follows_the_style_a_model_of_this_project_records(tmp_path):
    # an unpacked .nemo of a plain run whose tokenizer extended a punctuated base's
    base = tokenizer_dir(tmp_path, [ENGLISH, HINDI])
    (base / "model_config.yaml").write_text("transcript_style: plain\n", encoding="utf-8")
    assert ts.resolve_style("auto", str(base)) == (
        "plain",
        f"TRANSCRIPT_STYLE=auto: INIT_MODEL={base} records plain targets",
    )


def test_a_style_set_against_the_base_warns_in_one_line_at_manifest_build(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(config, "INIT_MODEL", str(tokenizer_dir(tmp_path, [ENGLISH, HINDI])))
    build(tmp_path, "plain")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "the training targets are plain but INIT_MODEL=" in warnings[0]


def test_build_manifest_resolves_auto_against_init_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(config, "INIT_MODEL", str(tokenizer_dir(tmp_path, [ENGLISH, HINDI])))
    manifest, summary, _ = build(tmp_path, "auto")
    assert summary["settings"]["transcript_style"] == "punctuated"
    assert "?" in " ".join(manifest["text"])
    assert "warning" not in capsys.readouterr().err


# --- the scores --------------------------------------------------------------------------------
def test_split_marks_takes_the_marks_ending_each_word():
    assert split_marks("Is it raining? Yes , it is...") == [
        ("Is", ""),
        ("it", ""),
        ("raining", "?"),
        ("Yes", ","),
        ("it", ""),
        ("is", "..."),
    ]


def test_a_perfect_transcript_scores_punctuation_f1_one_and_no_case_errors():
    scores = punctuation_case_scores([ENGLISH, HINDI], [ENGLISH, HINDI], ["en", "hi"])
    assert scores["en"].f1 == scores["hi"].f1 == 1.0
    assert scores["en"].case_error_rate == 0.0
    assert scores["hi"].cased_words == 0  # Devanagari has no case


# References as corpora write them: a mark inside closing quotes or brackets, guillemets around a
# danda, a mark after a closing quote, a tag, a hyphenated word, and the mark count of each.
QUOTED = [
    ('"Stop." she said.', 2),
    ('"Why?" (really?) ok.', 3),
    ("\u00abठीक\u0964\u00bb है\u0964", 2),
    ("He said \u201cno\u201d, then left!", 2),
    ("rock-and-roll. [noise] <|en|> Yes!", 2),
    ("It's \u2018fine.\u2019 Ok", 1),
]


@pytest.mark.parametrize("reference, marks", QUOTED)
def test_a_transcript_equal_to_the_punctuated_target_scores_one_whatever_quotes_surround_marks(
    reference, marks
):
    target = tc.clean_text(reference, "punctuated")  # what a punctuated model is trained to write
    scores = punctuation_case_scores([reference], [target], ["en"])["all"]
    assert scores.marks_reference == marks
    assert scores.f1 == 1.0 and scores.case_errors == 0


@pytest.mark.parametrize("reference, marks", QUOTED)
def test_a_hypothesis_written_with_quotes_has_its_marks_read_as_a_references_are(reference, marks):
    target = tc.clean_text(reference, "punctuated")
    scores = punctuation_case_scores([target], [reference], ["en"])["all"]
    assert scores.marks_hypothesis == marks and scores.f1 == 1.0


def test_punctuation_is_scored_alike_on_a_node_without_polars(monkeypatch):
    references = [reference for reference, _ in QUOTED] + [HINDI]
    hypotheses = ["stop she said!", '"Why" really? OK.', "ठीक है", "he said no. then left", ""]
    hypotheses += ["It's fine Ok.", HINDI]
    languages = ["en"] * 6 + ["hi"]
    with_polars = punctuation_case_scores(references, hypotheses, languages)
    monkeypatch.setitem(sys.modules, "polars", None)  # import polars raises ImportError
    assert punctuation_case_scores(references, hypotheses, languages) == with_polars


def test_punctuation_f1_counts_missing_wrong_and_extra_marks():
    # reference marks: ? , .   hypothesis marks: ? . (after "yes") and ! (wrong)
    scores = punctuation_case_scores([ENGLISH], ["is it raining? yes. it is!"], ["en"])
    en = scores["en"]
    assert (en.marks_correct, en.marks_hypothesis, en.marks_reference) == (1, 3, 3)
    assert en.f1 == pytest.approx(1 / 3)
    assert en.case_error_rate == pytest.approx(2 / 6)  # "Is" and "Yes" of six words


def test_a_misrecognized_word_costs_no_case_error_and_keeps_the_alignment():
    scores = punctuation_case_scores(["Hello there, Bob."], ["Hello where, Bob."], ["en"])
    assert scores["en"].f1 == 1.0
    assert (scores["en"].cased_words, scores["en"].case_errors) == (2, 0)


def test_scores_that_cannot_be_wrong_are_not_shown():
    # lower-case English without a mark on either side, Hindi with a danda on one side only
    scores = punctuation_case_scores(
        ["hello world", "नमस्ते दुनिया।"], ["hello world", "नमस्ते दुनिया"], ["en", "hi"]
    )
    assert math.isnan(scores["en"].f1) and math.isnan(scores["en"].case_error_rate)
    assert scores["hi"].f1 == 0.0 and math.isnan(scores["hi"].case_error_rate)
    metrics = punctuation_metrics(scores)
    assert metrics == {"val/punct_f1/hi": 0.0, "val/punct_f1/all": 0.0}


def test_punctuation_metrics_name_each_language_and_skip_case_where_there_is_none():
    metrics = punctuation_metrics(
        punctuation_case_scores([ENGLISH, HINDI], [ENGLISH, "क्या बारिश"], ["en", "hi"])
    )
    assert metrics["val/punct_f1/en"] == 1.0
    assert metrics["val/punct_f1/hi"] == 0.0
    assert metrics["val/case_err/en"] == 0.0
    assert "val/case_err/hi" not in metrics
    assert not math.isnan(metrics["val/punct_f1/all"])


# --- downstream: the tokenizer step and validation see the punctuated text ----------------------
def test_the_tokenizer_step_learns_pieces_for_the_marks_of_a_punctuated_master(tmp_path):
    from scripts import train_tokenizer

    _, _, master = build(tmp_path, "punctuated")
    out = tmp_path / "tok"
    train_tokenizer.train_tokenizer(
        master, out, vocab_size=60, temperature=1.0, lang_weighting="count", seed=0, mode="new"
    )
    processor = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    pieces = {processor.id_to_piece(i) for i in range(processor.get_piece_size())}
    assert all(any(mark in piece for piece in pieces) for mark in SENTENCE_MARKS)
    assert ts.tokenizer_writes_punctuation((out / "tokenizer.model").read_bytes())


def punctuated_validation_metrics(tmp_path, monkeypatch, style: str | None) -> dict:
    """The metrics one validation pass logs on a tiny manifest whose texts end in '?' (written
    with ``style`` in its metadata), decoded by a model that writes each reference back."""
    import json

    import pyarrow.parquet as pq
    import torch
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    import callbacks
    import evaluation
    import run_logging
    from dataset import LocalShardDataset
    from tests.test_evaluate import EchoModel, fake_trainer, let_echo_models_start_from_a_piece
    from tests.tiny_training_data import make_training_data

    let_echo_models_start_from_a_piece(monkeypatch)
    data = make_training_data(tmp_path, per_lang=3)
    table = pq.read_table(data["manifest"])
    texts = [f"{t}?" for t in table.column("text").to_pylist()]
    table = table.set_column(table.schema.get_field_index("text"), "text", [texts])
    manifest = tmp_path / "val.parquet"
    pq.write_table(
        table.replace_schema_metadata({ts.STYLE_KEY: style} if style else None), manifest
    )
    tokenizer = SentencePieceTokenizer(str(data["tokenizer"] / "tokenizer.model"))
    ds = LocalShardDataset(manifest, tokenizer, progress=False)
    lookup = {
        EchoModel.fingerprint(ds[i]["signal"]): t
        for i, t in enumerate(evaluation.manifest_texts(ds))
    }
    monkeypatch.setattr(callbacks, "all_gather_objects", lambda obj: [obj])
    jsonl = tmp_path / "metrics.jsonl"
    trainer = fake_trainer(0, [run_logging.JsonlMetricsLogger(jsonl)])
    trainer.world_size = 1
    module = SimpleNamespace(model=EchoModel(tokenizer, lookup), device=torch.device("cpu"))
    cb = callbacks.PerLanguageWERCallback(every_n_steps=5, manifest_path=manifest, with_loss=False)
    cb.on_train_start(trainer, module)
    cb.evaluate(trainer, module)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return next(line for line in lines if "val/wer/all" in line)


def test_validation_of_a_punctuated_run_reports_punctuation_f1_and_case_errors(
    tmp_path, monkeypatch
):
    metrics = punctuated_validation_metrics(tmp_path, monkeypatch, "punctuated")
    assert metrics["val/punct_f1/hi"] == metrics["val/punct_f1/all"] == 1.0
    # the tiny corpus writes lower case only: no case to get wrong, so no case error rate shown
    assert not [key for key in metrics if "case_err" in key]


def test_validation_of_a_plain_run_reports_no_punctuation_scores(tmp_path, monkeypatch):
    metrics = punctuated_validation_metrics(tmp_path, monkeypatch, None)
    assert not [key for key in metrics if "punct" in key or "case_err" in key]


def test_train_refuses_a_manifest_of_another_style_before_building_a_model(tmp_path, monkeypatch):
    import train

    _, _, master = build(tmp_path, "plain")
    monkeypatch.setattr(config, "TRAIN_MANIFEST_PATH", master)
    monkeypatch.setattr(config, "EVAL_EVERY_STEPS", 0)
    monkeypatch.setattr(config, "TRANSCRIPT_STYLE", "punctuated")
    with pytest.raises(ts.TranscriptStyleError, match="holds plain targets"):
        train.check_inputs()


def test_a_trained_model_records_its_style_for_a_finetune_of_it(tmp_path):
    from omegaconf import OmegaConf

    model = SimpleNamespace(cfg=OmegaConf.create({"trained_languages": ["hi"]}))
    ts.record_style(model, "punctuated")
    exported = tmp_path / "model"
    exported.mkdir()
    OmegaConf.save(model.cfg, exported / "model_config.yaml")
    assert ts.recorded_style(exported) == "punctuated"
    ts.record_style(model, None)
    assert "transcript_style" not in model.cfg
