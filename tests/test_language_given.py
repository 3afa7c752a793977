"""Decoding with the language given: greedy TDT started from the language's tag, in
asr_model.decode_batch, evaluate.py, transcribe.py and validation (beside auto decoding), and the
forgetting of the base's languages that validation measures against step 0.

The decoding itself is checked on the real tiny TDT model against a plain greedy TDT written
here from its definition; the plumbing with a model that echoes each utterance's text."""

from __future__ import annotations

import csv
import json
import logging
from types import SimpleNamespace

import pytest
import torch

import asr_model
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


def reference_greedy_tdt(model, encoded, encoded_len, first_piece, max_symbols, kept=None):
    """Greedy TDT of one utterance, written from its definition: at frame t the joint of the
    frame and the prediction network's output gives the best of pieces and blank and the best
    duration; a blank moves on by its duration (at least one frame), a piece is emitted, fed to
    the prediction network and moves on by its duration (after ``max_symbols`` pieces on one
    frame, by one). ``first_piece``: the first piece emitted is this one instead of the one the
    search chose (at its frame, with its duration), and the search goes on from there afresh,
    choosing after it only among blank and the pieces ``kept`` marks True (None: all)."""
    blank = int(model.decoder.blank_idx)
    durations = list(model.decoding.decoding.durations)
    frames = encoded.transpose(1, 2)  # [1, T, D]
    out, state = model.decoder.predict(None, None, add_sos=False, batch_size=1)
    ids = []
    t, on_this_frame = 0, 0
    while t < int(encoded_len):
        logits = model.joint.joint(frames[:, t : t + 1], out)[0, 0, 0]
        if kept is not None and ids:
            logits = logits.clone()
            logits[:blank][~kept] = float("-inf")
        piece = int(logits[: blank + 1].argmax())
        duration = durations[int(logits[blank + 1 :].argmax())]
        if piece == blank:
            t, on_this_frame = t + max(1, duration), 0
            continue
        forced = first_piece is not None and not ids
        if forced:
            piece = first_piece
        ids.append(piece)
        out, state = model.decoder.predict(
            torch.tensor([[piece]]), state, add_sos=False, batch_size=1
        )
        on_this_frame = 0 if forced else on_this_frame + 1
        if duration > 0:
            t, on_this_frame = t + duration, 0
        elif on_this_frame >= max_symbols:
            t, on_this_frame = t + 1, 0
    if first_piece is not None and not ids:
        ids.append(first_piece)  # nothing emitted: the tag alone
    return ids


def shaped_model(tiny, shape: str):
    """The tiny model (untrained: the frame alone decides) reshaped so that decoding shows what
    is checked: "prediction" (what the prediction network has read weighs more than the frame,
    so a wrong start state changes the transcripts; blank wins about half of the frames) or
    "blanks first" (blank wins the first frames, each predicting a skip of 2 frames, so the
    first piece comes after a walk)."""
    model = asr_model.load_trained_model(tiny.nemo, "cpu").eval()
    blank = model.decoder.blank_idx
    torch.manual_seed(1)
    signal, lens = torch.randn(4, 32000), torch.tensor([32000, 24000, 16000, 9000])
    with torch.no_grad():
        if shape == "prediction":
            model.joint.pred.weight *= 8
            model.joint.enc.weight *= 0.2
            for weight in model.decoder.prediction.parameters():
                weight *= 4
        encoded, _ = model.forward(input_signal=signal, input_signal_length=lens)
        start, _ = model.decoder.predict(None, None, add_sos=False, batch_size=4)
        logits = model.joint.joint(encoded.transpose(1, 2), start)[:, :, 0, : blank + 1]
        margin = logits[..., :blank].max(-1).values - logits[..., blank]  # piece over blank
        out = model.joint.joint_net[-1]
        if shape == "prediction":
            out.bias[blank] += float(margin.median())
        else:
            out.bias[blank] += max(float(margin[0].median()), float(margin[0, 0]) + 1e-4)
            out.bias[blank + 1 + model.decoding.decoding.durations.index(2)] += 10.0
    return model, signal, lens


@pytest.mark.parametrize("shape", ["prediction", "blanks first"])
def test_decoding_with_the_language_given_is_greedy_tdt_whose_first_piece_is_the_tag(tiny, shape):
    """A batch mixing languages given and not: each utterance given a language decodes as greedy
    TDT whose first emitted piece is the tag, where the search emits its first piece; the others
    as auto decoding does (the reference reproduces NeMo's auto decoding too, so it is the
    definition both are held to). An utterance whose first piece already is its tag decodes
    exactly as auto."""
    model, signal, lens = shaped_model(tiny, shape)
    languages = ["hi", None, "en", "hi"]
    decoded = asr_model.decode_batch(model, signal, lens, languages=languages)
    max_symbols = model.decoding.decoding.max_symbols
    tags = asr_model.language_tag_pieces(model, languages)
    went_on = []
    with torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        firsts = asr_model.family(model).first_emissions(model, encoded, encoded_len)
        for b in range(4):
            auto = reference_greedy_tdt(
                model, encoded[b : b + 1], encoded_len[b], None, max_symbols
            )
            given = reference_greedy_tdt(
                model, encoded[b : b + 1], encoded_len[b], tags[b], max_symbols
            )
            assert decoded.texts[b] == model.tokenizer.ids_to_text(auto)
            assert decoded.given_texts[b] == model.tokenizer.ids_to_text(given)
            if tags[b] is not None:
                assert decoded.given_texts[b].startswith(f"<|{languages[b]}|>")
                went_on.append(len(given) > 1)
    assert decoded.given_texts[1] == decoded.texts[1]  # no language: auto
    if shape == "prediction":
        assert any(went_on)  # decoding went on after the tag
        assert all(len(text) > 1 for text in decoded.texts)  # blanks and pieces both won
    else:
        assert any(f is not None and f[2] > 0 for f in firsts)  # blanks walked before a piece
    # given the language each utterance starts with, the search writes what auto decoding wrote
    named = [model.tokenizer.ids_to_tokens([f[0]])[0] if f else "" for f in firsts]
    same = [n[2:-2] if n.startswith("<|") else None for n in named]
    again = asr_model.decode_batch(model, signal, lens, auto=False, languages=same)
    assert again.given_texts == decoded.texts
    # under bf16 autocast, as a bf16-mixed run validates
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = asr_model.decode_batch(model, signal, lens, languages=languages)
    assert len(bf16.given_texts) == 4 and all(isinstance(t, str) for t in bf16.given_texts)
    # the same through the one-call helper, with every utterance given
    assert asr_model.greedy_texts(model, signal, lens, ["en"] * 4)[2] == decoded.given_texts[2]


def test_with_the_language_given_decoding_writes_only_pieces_of_its_scripts(tiny, monkeypatch):
    """A model that records English written in Latin and Hindi in Devanagari: decoding with the
    language given writes, after the tag, only pieces of that script or of none (the reference
    greedy TDT choosing among those pieces and blank); the same batch decoded from the tag alone
    writes pieces of the other script, so the keeping is what made the difference. Auto decoding
    is unchanged, before and after, and LANGUAGE_GIVEN_SCRIPTS=0 decodes from the tag alone."""
    from omegaconf import open_dict

    from manifest_schema import strip_lang_tag
    from script_languages import scripts_of

    model, signal, lens = shaped_model(tiny, "prediction")
    before = asr_model.decode_batch(model, signal, lens).texts
    languages = ["en", "hi", None, "en"]
    tag_alone = asr_model.decode_batch(model, signal, lens, languages=languages, scripts=False)
    with open_dict(model.cfg):
        model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
    kept = asr_model.language_piece_masks(model, languages)
    pieces = asr_model.model_pieces(model)
    assert kept[2] is None and bool(kept[0][pieces.index("<|en|>")]) is False  # tags are out
    with open_dict(model.cfg):  # a language recorded without letters: any piece, as unrecorded
        model.cfg.language_scripts = {"en": ["Latin"], "hi": []}
    assert asr_model.language_piece_masks(model, ["hi", "ta"]) == [None, None]
    with open_dict(model.cfg):
        model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
    decoded = asr_model.decode_batch(model, signal, lens, languages=languages)
    assert decoded.texts == before
    assert asr_model.decode_batch(model, signal, lens).texts == before  # the rows are cleared
    tags = asr_model.language_tag_pieces(model, languages)
    max_symbols = model.decoding.decoding.max_symbols
    other = {"en": "Devanagari", "hi": "Latin"}
    strayed = 0
    with torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        for b, lang in enumerate(languages):
            ids = reference_greedy_tdt(
                model, encoded[b : b + 1], encoded_len[b], tags[b], max_symbols, kept[b]
            )
            assert decoded.given_texts[b] == model.tokenizer.ids_to_text(ids)
            if lang is None:
                assert decoded.given_texts[b] == decoded.texts[b]
                continue
            assert all(not (scripts_of(pieces[i]) - {kept_script(lang)}) for i in ids[1:])
            unkept = reference_greedy_tdt(
                model, encoded[b : b + 1], encoded_len[b], tags[b], max_symbols
            )
            assert tag_alone.given_texts[b] == model.tokenizer.ids_to_text(unkept)
            strayed += any(other[lang] in scripts_of(pieces[i]) for i in unkept[1:])
    assert strayed  # from the tag alone, some utterance wrote the other script
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as a bf16-mixed run validates
        bf16 = asr_model.decode_batch(model, signal, lens, languages=languages)
    for text, lang in zip(bf16.given_texts, languages):
        assert lang is None or other[lang] not in scripts_of(strip_lang_tag(text))
    monkeypatch.setattr(config, "LANGUAGE_GIVEN_SCRIPTS", "0")
    off = asr_model.decode_batch(model, signal, lens, languages=languages)
    assert off.given_texts == tag_alone.given_texts


def test_kept_pieces_hold_in_the_search_cuda_graphs_run(tiny, monkeypatch):
    """NeMo's CUDA-graph search keeps its state for the largest batch it has seen and runs
    smaller ones padded to it; its stateful implementation (what the graphs capture, run here
    without capture: "no_graphs") writes what the plain loop writes, with pieces kept, for a
    batch as large as the state's and for a smaller one after it, and auto decoding after them
    is unchanged."""
    from omegaconf import open_dict

    languages = ["en", "hi", None, "en"]
    for fresh in range(2):  # the plain loop's texts, then a model that has decoded nothing
        model, signal, lens = shaped_model(tiny, "prediction")
        with open_dict(model.cfg):
            model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
        if not fresh:
            plain = asr_model.decode_batch(model, signal, lens, languages=languages)
    computer = model.decoding.decoding.decoding_computer
    computer.force_cuda_graphs_mode("no_graphs")

    def stateful(self, x, out_len, prev_batched_state=None, multi_biasing_ids=None):
        return self.cuda_graphs_impl(
            encoder_output=x,
            encoder_output_length=out_len,
            prev_batched_state=prev_batched_state,
            multi_biasing_ids=multi_biasing_ids,
        )

    monkeypatch.setattr(type(computer), "__call__", stateful)
    part = asr_model.decode_batch(model, signal[:2], lens[:2], languages=languages[:2])
    assert part.given_texts == plain.given_texts[:2]
    assert asr_model.decode_batch(model, signal, lens).texts == plain.texts  # a state for 4
    part = asr_model.decode_batch(model, signal[:2], lens[:2], languages=languages[:2])
    assert part.given_texts == plain.given_texts[:2]
    whole = asr_model.decode_batch(model, signal, lens, languages=languages)
    assert whole.given_texts == plain.given_texts and whole.texts == plain.texts
    part = asr_model.decode_batch(model, signal[:2], lens[:2], languages=languages[:2])
    assert computer.state.batch_size == 4  # the smaller batch ran padded to the state's
    assert part.given_texts == plain.given_texts[:2]
    assert asr_model.decode_batch(model, signal, lens).texts == plain.texts


def test_reports_say_how_the_language_given_was_decoded(monkeypatch):
    from omegaconf import OmegaConf

    model = SimpleNamespace(cfg=OmegaConf.create({"language_scripts": {"hi": ["Devanagari"]}}))
    assert asr_model.kept_scripts_phrase(model, ["hi", "und", None]) == (
        "then only pieces of its scripts (hi Devanagari)"
    )
    assert asr_model.kept_scripts_phrase(model, ["hi", "ta"]).endswith(
        "; the tag alone for ta (the model records no scripts for it)"
    )
    monkeypatch.setattr(config, "LANGUAGE_GIVEN_SCRIPTS", "0")
    assert (
        asr_model.kept_scripts_phrase(model, ["hi"]) == "the tag alone (LANGUAGE_GIVEN_SCRIPTS=0)"
    )


def kept_script(lang: str) -> str:
    return {"en": "Latin", "hi": "Devanagari"}[lang]


def test_decoding_both_ways_searches_again_only_where_auto_is_not_already_the_given(
    tiny, monkeypatch
):
    """Decoded auto and with the language given from one forward, an utterance whose auto
    decoding wrote its given tag first and then only kept pieces is not searched again (its text
    is auto's); the others are, and every text is what the search alone writes. The model is
    made to write <|en|> first, then Devanagari pieces."""
    from omegaconf import open_dict

    model, signal, lens = shaped_model(tiny, "prediction")
    pieces = asr_model.model_pieces(model)
    with torch.no_grad(), open_dict(model.cfg):
        model.joint.joint_net[-1].bias[pieces.index("<|en|>")] += 1.0
        model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
    kind = asr_model.family(model)
    with torch.no_grad():
        encoded = model.forward(input_signal=signal, input_signal_length=lens)
        auto_texts, auto_ids = kind.auto_decoding(model, *encoded)
    assert all(pieces[ids[0]] == "<|en|>" and len(ids) > 1 for ids in auto_ids)
    searched = []
    real = asr_model.TDT.started_texts

    def spy(self, model, encoded, encoded_len, firsts, kept=None):
        searched.append(len(firsts))
        return real(self, model, encoded, encoded_len, firsts, kept)

    monkeypatch.setattr(asr_model.TDT, "started_texts", spy)
    for languages, scripts, rows in (
        (["en"] * 4, False, []),  # auto already is the given: no search
        (["en"] * 4, True, [4]),  # Devanagari after <|en|> is not kept: all searched
        (["en", "hi", None, "hi"], False, [2]),  # the Hindi rows alone
    ):
        searched.clear()
        both = asr_model.decode_batch(model, signal, lens, languages=languages, scripts=scripts)
        assert searched == rows, (languages, scripts)
        alone = asr_model.decode_batch(
            model, signal, lens, auto=False, languages=languages, scripts=scripts
        )
        assert both.texts == auto_texts and both.given_texts == alone.given_texts
        assert languages[2] == "en" or both.given_texts[2] == auto_texts[2]  # none given


def test_a_language_the_model_has_no_tag_for_is_one_line_naming_it_and_the_tags_it_has(tiny):
    with pytest.raises(asr_model.LanguageNotInModel) as caught:
        asr_model.language_tag_pieces(tiny.model, ["hi", "ta"])
    message = str(caught.value)
    assert "<|ta|>" in message and "its tags: en, hi" in message and "\n" not in message
    assert asr_model.language_tag_pieces(tiny.model, [None, ""]) == [None, None]


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
