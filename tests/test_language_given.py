"""Decoding with the language given in evaluate.py, transcribe.py and validation (beside auto
decoding), and the forgetting of the base's languages that validation measures against step 0,
checked with a model that echoes each utterance's text (the decoding itself: test_decoding.py)."""

from __future__ import annotations

import csv
import json
import logging
from types import SimpleNamespace

import pytest
import torch

import callbacks
import config
import evaluation
import run_logging
from tests.test_evaluate import (
    EchoModel,
    fake_trainer,
    let_echo_models_start_from_a_piece,
    spm_tokenizer,
    tiny_model_files,
    write_nemo_json,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_model_files(tmp_path_factory)


@pytest.fixture(autouse=True)
def echo_models_start_from_a_piece(monkeypatch):
    let_echo_models_start_from_a_piece(monkeypatch)


def test_transcribe_with_the_language_given_writes_that_language_from_its_tag(tiny, capsys):
    from scripts import transcribe

    json_manifest = write_nemo_json(tiny, tiny.root / "given.json")
    out = tiny.root / "given.jsonl"
    assert (
        transcribe.main(
            [str(tiny.nemo), "--manifest", str(json_manifest), "--lang", "hi", "--out", str(out)]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 12
    assert all(r["lang"] == "hi" and r["lang_given"] and r["lang_prob"] is None for r in rows)
    said = "its tag, the tag alone for hi (the model records no scripts for it)"
    assert said in capsys.readouterr().err
    assert all("<|" not in r["text"] for r in rows)
    # each row's own language from the manifest
    assert (
        transcribe.main(
            [str(tiny.nemo), "--manifest", str(json_manifest), "--lang", "manifest"]
            + ["--out", str(out)]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert sorted({r["lang"] for r in rows}) == ["en", "hi"] and all(r["lang_given"] for r in rows)
    # auto: the model's own guess, said so
    assert (
        transcribe.main([str(tiny.nemo), "--manifest", str(json_manifest), "--out", str(out)]) == 0
    )
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert not any(r["lang_given"] for r in rows)
    capsys.readouterr()
    # a language the model has no tag for: one line, nothing written
    out.unlink()
    assert transcribe.main([str(tiny.nemo), "--lang", "ta", "--out", str(out), "a.flac"]) == 2
    err = capsys.readouterr().err
    assert "<|ta|>" in err and not out.exists()
    # from the manifest: the row that names it
    bad = tiny.root / "bad-lang.json"
    rows = json_manifest.read_text(encoding="utf-8").splitlines()
    row = json.loads(rows[1])
    row["lang"] = "HI"
    bad.write_text("\n".join([rows[0], json.dumps(row), *rows[2:]]) + "\n", encoding="utf-8")
    assert transcribe.main([str(tiny.nemo), "--manifest", str(bad), "--lang", "manifest"]) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if f"{bad} row 2: the model has no tag <|HI|>" in x]
    assert len(line) == 1 and "give one of those" in line[0]
    assert transcribe.main([str(tiny.nemo), "--lang", "manifest", "a.flac"]) == 2
    assert "--lang manifest" in capsys.readouterr().err


def test_evaluate_reports_the_error_rates_with_the_language_given_beside_auto(tiny, capsys):
    from scripts import evaluate

    both, given, auto = (tiny.root / f"{k}.csv" for k in ("both", "given", "auto"))
    for decode, out in (("both", both), ("given", given), ("auto", auto)):
        argv = [str(tiny.nemo), "--manifest", str(tiny.manifest), "--out", str(out)]
        assert evaluate.main(argv + ["--decode", decode]) == 0
    printed = capsys.readouterr().out
    assert "WER given" in printed and "from each row's language tag" in printed

    def rows(path):
        with open(path, encoding="utf-8") as f:
            return {r["lang"]: r for r in csv.DictReader(f)}

    b, g, a = rows(both), rows(given), rows(auto)
    assert set(b) == {"hi", "en", "all"}
    for lang in b:
        assert b[lang]["wer_given"] == g[lang]["wer"] and b[lang]["cer_given"] == g[lang]["cer"]
        assert b[lang]["wer"] == a[lang]["wer"] and a[lang]["wer_given"] == "nan"


def language_given_validation(tiny, monkeypatch, tmp_path, *, base=None, base_languages=("en",)):
    """One validation at step 20 by a model that echoes each reference, but decoded auto gets
    every English utterance's words wrong ("x" per word) and starts the first with <|hi|>;
    decoded from the English tag, it gets them right. Returns (metrics logged, warnings, module)."""
    from manifest_schema import strip_lang_tag
    from scripts import evaluate

    tokenizer = spm_tokenizer(tiny)
    dataset, texts, langs, _ = evaluate.scoring_set(tiny.manifest, tokenizer, progress=False)
    auto, given = {}, {}
    first_en = True
    for i, lang in enumerate(langs):
        key = EchoModel.fingerprint(dataset[i]["signal"])
        auto[key] = given[key] = texts[i]
        if lang == "en":
            wrong = " ".join("x" for _ in strip_lang_tag(texts[i]).split())
            auto[key] = f"<|{'hi' if first_en else 'en'}|> {wrong}"
            first_en = False
    monkeypatch.setattr(callbacks, "all_gather_objects", lambda obj: [obj])
    monkeypatch.setattr(config, "INIT_MODEL", str(tmp_path / "base.nemo"))
    monkeypatch.setattr(config, "BASE_LANGUAGES", list(base_languages))
    jsonl = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    module = SimpleNamespace(
        model=EchoModel(tokenizer, auto, given),
        device=torch.device("cpu"),
        last_evaluation=None,
        base_evaluation=base,
    )
    cb = callbacks.PerLanguageWERCallback(
        every_n_steps=5, manifest_path=tiny.manifest, with_loss=False
    )
    trainer = fake_trainer(0, [jsonl])
    trainer.world_size = 1
    cb.on_train_start(trainer, module)
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    handler.setLevel(logging.WARNING)
    logging.getLogger(callbacks.__name__).addHandler(handler)
    try:
        cb.evaluate(trainer, module)
    finally:
        logging.getLogger(callbacks.__name__).removeHandler(handler)
    lines = [json.loads(line) for line in jsonl.path.read_text(encoding="utf-8").splitlines()]
    return next(line for line in lines if "val/wer/all" in line), warned, module


def test_validation_reports_the_wer_with_the_language_given_beside_auto(
    tiny, monkeypatch, tmp_path
):
    metrics, warned, module = language_given_validation(tiny, monkeypatch, tmp_path)
    assert metrics["val/wer/en"] == 1.0 and metrics["val/wer_given/en"] == 0.0
    assert metrics["val/wer/hi"] == metrics["val/wer_given/hi"] == 0.0
    assert metrics["val/wer_given/all"] == 0.0
    assert metrics["val/lid_acc/en"] < 1.0  # the guess was measured on auto decoding
    assert "results_given" in module.last_evaluation
    assert not warned  # no step-0 validation: nothing to compare with
    assert not any(k.startswith("val/forgetting") for k in metrics)


def test_a_base_language_rising_above_the_threshold_warns_once_with_its_numbers(
    tiny, monkeypatch, tmp_path
):
    """Step 0 scored English at WER 0.10 (auto and given): at step 20 auto is 1.0 (90 points
    worse, a warning), given 0.0 (10 points better). Hindi is no base language: no metric."""
    counts = {"words": 100, "word_edits": 10, "chars": 400, "char_edits": 40}
    base = {
        "step": 0,
        "results": {"en": counts, "hi": counts},
        "results_given": {"en": counts, "hi": counts},
    }
    metrics, warned, _ = language_given_validation(tiny, monkeypatch, tmp_path, base=base)
    assert metrics["val/forgetting/en"] == pytest.approx(90.0)
    assert metrics["val/forgetting_given/en"] == pytest.approx(-10.0)
    assert "val/forgetting/hi" not in metrics
    assert len(warned) == 1
    line = warned[0]
    assert "step 20" in line and " en " in line and "90.0 points" in line and "\n" not in line
    assert "10.0 -> 100.0" in line and "language given 10.0 -> 0.0" in line
    assert "BASE_LANGUAGE_SHARE" in line and "--blend-sweep" in line
    # below the threshold, or the warning off: the metric, no warning
    monkeypatch.setattr(config, "FORGETTING_WARN_POINTS", 95.0)
    metrics, warned, _ = language_given_validation(tiny, monkeypatch, tmp_path / "b", base=base)
    assert metrics["val/forgetting/en"] == pytest.approx(90.0) and not warned


def test_validation_without_the_language_given_decodes_once(tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(config, "VAL_LANGUAGE_GIVEN", "0")
    metrics, _, module = language_given_validation(tiny, monkeypatch, tmp_path)
    assert not any(k.startswith("val/wer_given") for k in metrics)
    assert module.model.decoded == metrics["val/utterances"]
    assert "results_given" not in module.last_evaluation


def test_forgetting_needs_a_step_zero_validation_and_the_bases_languages():
    counts = {"words": 10, "word_edits": 1}
    worse = {"words": 10, "word_edits": 3}
    base = {"step": 0, "results": {"en": counts, "te": counts}}
    now = {"step": 600, "results": {"en": worse, "te": counts, "hi": worse}}
    rows = evaluation.forgetting(base, now, ("en", "te"))
    assert rows["en"]["points"] == pytest.approx(20.0) and rows["te"]["points"] == 0.0
    assert rows["en"]["points_given"] is None and "hi" not in rows
    assert evaluation.forgetting(base, now, None) == {}  # the base's languages unknown
    assert evaluation.forgetting({**base, "step": 10}, now, ("en",)) == {}  # no step-0 record
    assert evaluation.forgetting(None, now, ("en",)) == {}


def test_step_zero_validation_of_a_base_that_writes_no_tag_scores_the_language_given_as_auto(
    tiny, monkeypatch, tmp_path
):
    """The real tiny model as a base that never wrote a tag (its frame alone chooses each piece):
    the step-0 validation decodes each utterance with its language given to the tag and then
    what the model writes auto, so every language's WER given is its auto WER (no word lost to
    the tag), and at a later step with the model unchanged nothing has been forgotten, auto or
    given."""
    from tests.test_decoding import model_that_writes_no_tag

    monkeypatch.setattr(callbacks, "all_gather_objects", lambda obj: [obj])
    monkeypatch.setattr(config, "INIT_MODEL", str(tmp_path / "base.nemo"))
    monkeypatch.setattr(config, "BASE_LANGUAGES", ["en", "hi"])
    jsonl = run_logging.JsonlMetricsLogger(tmp_path / "metrics.jsonl")
    module = SimpleNamespace(
        model=model_that_writes_no_tag(tiny),
        device=torch.device("cpu"),
        last_evaluation=None,
        base_evaluation=None,
    )
    cb = callbacks.PerLanguageWERCallback(
        every_n_steps=5, manifest_path=tiny.manifest, with_loss=False, at_start=True
    )
    trainer = fake_trainer(0, [jsonl])
    trainer.world_size, trainer.global_step = 1, 0
    cb.on_train_start(trainer, module)
    base = module.base_evaluation
    assert base["step"] == 0 and set(base["results"]) == {"en", "hi", "all"}
    assert base["results_given"] == base["results"]
    assert all(counts["words"] > 0 for counts in base["results"].values())
    trainer.global_step = 20
    cb.evaluate(trainer, module)
    lines = [json.loads(line) for line in jsonl.path.read_text(encoding="utf-8").splitlines()]
    step0, step20 = (
        next(m for m in lines if m.get("step") == s and "val/wer/all" in m) for s in (0, 20)
    )
    for lang in ("en", "hi", "all"):
        assert step0[f"val/wer_given/{lang}"] == step0[f"val/wer/{lang}"]
    for lang in ("en", "hi"):
        assert step20[f"val/forgetting/{lang}"] == step20[f"val/forgetting_given/{lang}"] == 0.0


def test_rows_of_unknown_language_decode_auto_in_transcribe_as_in_evaluate(tiny, capsys):
    """A NeMo JSON manifest with a row of undetermined language ("und") and a row that names no
    language at all: transcribe.py --lang manifest decodes both auto, as evaluate.py does (their
    rows say lang_given false and carry what transcribing without --lang writes: the model's
    text, guess and its probability), the others from their own tag, and stderr says how many
    were decoded auto; evaluate.py scores the und row auto in both decodings and says so too."""
    from scripts import evaluate, transcribe

    json_manifest = write_nemo_json(tiny, tiny.root / "with-und.json")
    rows = [json.loads(line) for line in json_manifest.read_text(encoding="utf-8").splitlines()]
    rows[0]["lang"] = "und"
    del rows[1]["lang"]
    assert "<|" not in rows[1]["text"]  # and no tag to read one from
    json_manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    auto_out, given_out = tiny.root / "und-auto.jsonl", tiny.root / "und-given.jsonl"
    argv = [str(tiny.nemo), "--manifest", str(json_manifest), "--out"]
    assert transcribe.main(argv + [str(auto_out)]) == 0
    capsys.readouterr()
    assert transcribe.main(argv + [str(given_out), "--lang", "manifest"]) == 0
    err = capsys.readouterr().err
    assert (
        f"2 of {len(rows)} file(s) of no known language (none given, or und): decoded auto" in err
    )
    auto = [json.loads(line) for line in auto_out.read_text(encoding="utf-8").splitlines()]
    given = [json.loads(line) for line in given_out.read_text(encoding="utf-8").splitlines()]
    assert given[:2] == auto[:2] and not any(r["lang_given"] for r in given[:2])
    assert all(r["lang_given"] and r["lang"] == m["lang"] for r, m in zip(given[2:], rows[2:]))
    out = tiny.root / "und.csv"
    assert evaluate.main([str(tiny.nemo), "--manifest", str(json_manifest), "--out", str(out)]) == 0
    assert "und: decoded auto" in capsys.readouterr().out
    with open(out, encoding="utf-8") as f:
        scored = {r["lang"]: r for r in csv.DictReader(f)}
    assert scored["und"]["utterances"] == "2" and scored["und"]["wer_given"] == scored["und"]["wer"]


def test_no_forgetting_warning_for_a_language_the_base_never_knew(monkeypatch):
    import evaluation

    monkeypatch.setattr(config, "FORGETTING_WARN_POINTS", 5.0)
    row = {"points_given": None, "base_given": None, "now_given": None}
    rows = {
        "en": {**row, "base": 0.10, "now": 0.30, "points": 20.0},  # known, then forgotten
        "ta": {**row, "base": 1.00, "now": 1.25, "points": 25.0},  # never known: nothing to lose
    }
    warned = evaluation.forgetting_warnings(20, rows)
    assert len(warned) == 1 and "step 20: the base language en is being forgotten" in warned[0]
    assert "(10.0 -> 30.0; FORGETTING_WARN_POINTS=5)" in warned[0]
    monkeypatch.setattr(config, "FORGETTING_WARN_POINTS", 0.0)  # 0: never warn
    assert evaluation.forgetting_warnings(20, rows) == []
