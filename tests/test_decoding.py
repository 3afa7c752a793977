"""Greedy decoding (decoding.py): auto and with the language given, on the real tiny TDT model,
each against a plain greedy TDT written here from its definition: the first piece and its
probability, the search started from the tag, the pieces of a language's scripts kept, NeMo's
CUDA-graph search, and the languages a model has no tag for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import asr_model
import config
import decoding
import vocabulary
from tests.test_evaluate import tiny_model_files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_model_files(tmp_path_factory)


def test_the_first_token_and_its_probability_are_those_greedy_decoding_emits_first(tiny):
    """On the real tiny TDT model, with the blank raised so that greedy decoding skips frames
    (by the durations it predicts) before its first piece: the first piece found from the joint
    of the start state is the first piece NeMo's greedy decoding emits, with its softmax
    probability over pieces and blank."""
    model = asr_model.load_trained_model(tiny.nemo, "cpu").eval()  # its own copy, to change
    blank = model.decoder.blank_idx
    torch.manual_seed(0)
    signal, lens = torch.randn(4, 32000), torch.tensor([32000, 24000, 16000, 9000])
    with torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        start, _ = model.decoder.predict(None, None, add_sos=False, batch_size=4)
        logits = model.joint.joint(encoded.transpose(1, 2), start)[:, :, 0, : blank + 1]
        margin = logits[..., :blank].max(-1).values - logits[..., blank]  # piece over blank
        # blank wins about half of the frames of the first utterance, frame 0 included, and
        # every blank predicts a duration of 2 frames
        raise_by = float(margin[0].median())
        raise_by = max(raise_by, float(margin[0, 0]) + 1e-4)
        out = model.joint.joint_net[-1]
        out.bias[blank] += raise_by
        out.bias[blank + 1 + model.decoding.decoding.durations.index(2)] += 10.0
    texts, firsts = decoding.greedy_texts_and_first_tokens(model, signal, lens)
    with torch.no_grad():
        # NeMo's greedy TDT itself, with the frame of each emitted piece
        hyps = model.decoding.decoding(encoder_output=encoded, encoded_lengths=encoded_len)[0]
        raised = model.joint.joint(encoded.transpose(1, 2), start)[:, :, 0, : blank + 1]
        probs = raised.float().softmax(-1)
    assert len(texts) == len(firsts) == len(hyps) == 4
    frames = []
    for b, (hyp, first) in enumerate(zip(hyps, firsts)):
        if len(hyp.y_sequence) == 0:
            assert first is None
            continue
        frame, piece = int(hyp.timestamp[0]), int(hyp.y_sequence[0])
        frames.append(frame)
        assert first[0] == piece
        assert first[1] == pytest.approx(float(probs[b, frame, piece]), rel=1e-5)
    assert frames and max(frames) > 0  # blanks were skipped before the first piece


def language_tags(model) -> set[int]:
    """The ids of the pieces that are a language tag, <|xx|>."""
    pieces = vocabulary.model_pieces(model)
    return {i for i, p in enumerate(pieces) if p.startswith("<|") and p.endswith("|>")}


def reference_greedy_tdt(model, encoded, encoded_len, given, max_symbols, kept=None):
    """Greedy TDT of one utterance, written from its definition: at frame t the joint of the
    frame and the prediction network's output gives the best of pieces and blank and the best
    duration; a blank moves on by its duration (at least one frame), a piece is emitted, fed to
    the prediction network and moves on by its duration (after ``max_symbols`` pieces on one
    frame, by one).

    ``given``: the tag of the language given (None: auto), written in front of what the model
    writes. The search walks as auto until its first piece, at frame t with duration d. A
    language tag there is the model's tag: the given one is written in its place, the prediction
    network reads it, and the search goes on from t + d. Any other piece is the model's first
    word: the given tag is written before it, the prediction network reads the tag, and the
    search goes on from frame t itself (the tag took no frame), where the model chooses its own
    first piece after the tag. After the tag the search chooses only among blank and the pieces
    ``kept`` marks True (None: all). A search that emits nothing writes the tag alone."""
    blank = int(model.decoder.blank_idx)
    durations = list(model.decoding.decoding.durations)
    tags = language_tags(model)
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
        if given is not None and not ids:
            ids.append(given)
            out, state = model.decoder.predict(
                torch.tensor([[given]]), state, add_sos=False, batch_size=1
            )
            on_this_frame = 0
            if piece in tags:
                t += duration
            continue
        ids.append(piece)
        out, state = model.decoder.predict(
            torch.tensor([[piece]]), state, add_sos=False, batch_size=1
        )
        on_this_frame += 1
        if duration > 0:
            t, on_this_frame = t + duration, 0
        elif on_this_frame >= max_symbols:
            t, on_this_frame = t + 1, 0
    if given is not None and not ids:
        ids.append(given)  # nothing emitted: the tag alone
    return ids


def shaped_model(tiny, shape: str):
    """The tiny model (untrained: the frame alone decides) reshaped so that decoding shows what
    is checked: "prediction" (what the prediction network has read weighs more than the frame,
    so a wrong start state changes the transcripts; blank wins about half of the frames; the
    first piece of each utterance is a word piece, as from a model that writes no tag), "tag
    first" (the same, with <|en|> the first piece of each) or "blanks first" (blank wins the
    first frames, each predicting a skip of 2 frames, so the first piece, a word piece, comes
    after a walk)."""
    model = asr_model.load_trained_model(tiny.nemo, "cpu").eval()
    blank = model.decoder.blank_idx
    torch.manual_seed(1)
    signal, lens = torch.randn(4, 32000), torch.tensor([32000, 24000, 16000, 9000])
    with torch.no_grad():
        if shape in ("prediction", "tag first"):
            model.joint.pred.weight *= 8
            model.joint.enc.weight *= 0.2
            for weight in model.decoder.prediction.parameters():
                weight *= 4
        encoded, _ = model.forward(input_signal=signal, input_signal_length=lens)
        start, _ = model.decoder.predict(None, None, add_sos=False, batch_size=4)
        logits = model.joint.joint(encoded.transpose(1, 2), start)[:, :, 0, : blank + 1]
        margin = logits[..., :blank].max(-1).values - logits[..., blank]  # piece over blank
        out = model.joint.joint_net[-1]
        if shape in ("prediction", "tag first"):
            out.bias[blank] += float(margin.median())
            if shape == "tag first":
                out.bias[vocabulary.model_pieces(model).index("<|en|>")] += 1.0
        else:
            out.bias[blank] += max(float(margin[0].median()), float(margin[0, 0]) + 1e-4)
            out.bias[blank + 1 + model.decoding.decoding.durations.index(2)] += 10.0
    return model, signal, lens


def model_that_writes_no_tag(tiny):
    """The tiny model as a base that never wrote a language tag: every tag's output bias far
    below the rest, so no tag ever wins a step, and the prediction network cut off from the
    joint (its projection zero), so the frame alone chooses each piece and its duration."""
    model = asr_model.load_trained_model(tiny.nemo, "cpu").eval()
    with torch.no_grad():
        model.joint.pred.weight.zero_()
        model.joint.pred.bias.zero_()
        model.joint.joint_net[-1].bias[sorted(language_tags(model))] -= 100.0
    return model


def search_as_cuda_graphs_run(monkeypatch, model) -> None:
    """``model``'s label-looping search runs its stateful implementation, the one NeMo's CUDA
    graphs capture, here without capture ("no_graphs"), as it runs on a GPU."""
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


@pytest.mark.parametrize("search", ["plain", "cuda graphs", "bf16 autocast"])
def test_a_model_that_writes_no_tag_writes_the_tag_then_every_piece_it_writes_auto(
    tiny, monkeypatch, search
):
    """A base that never wrote a tag (whose frame alone chooses each piece): with the language
    given it writes the given tag and then exactly what it writes auto, its first word included,
    in the plain search, in the one CUDA graphs run and under bf16 autocast (as a bf16-mixed
    run validates)."""
    model = model_that_writes_no_tag(tiny)
    if search == "cuda graphs":
        search_as_cuda_graphs_run(monkeypatch, model)
    torch.manual_seed(1)
    signal, lens = torch.randn(4, 32000), torch.tensor([32000, 24000, 16000, 9000])
    languages = ["hi", "en", None, "en"]
    tags = vocabulary.language_tag_pieces(model, languages)
    bf16 = search == "bf16 autocast"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        _, auto_ids = decoding.auto_decoding(model, encoded, encoded_len)
        firsts = decoding.first_emissions(model, encoded, encoded_len)
        decoded = decoding.decode_batch(model, signal, lens, languages=languages)
    assert all(ids and ids[0] not in language_tags(model) for ids in auto_ids)  # words first
    assert any(f[3] > 0 for f in firsts)  # a first piece that moves on (the frame it took)
    for b, tag in enumerate(tags):
        written = auto_ids[b] if tag is None else [tag, *auto_ids[b]]
        assert decoded.given_texts[b] == model.tokenizer.ids_to_text(written)


def test_audio_of_no_frame_or_one_frame_with_the_language_given(tiny):
    """With the language given, an utterance the encoder makes no frame of writes the tag alone,
    and one of a single frame the tag and then what the model writes there auto; beside a long
    one, in one batch (the same base that writes no tag)."""
    model = model_that_writes_no_tag(tiny)
    torch.manual_seed(1)
    signal, lens = torch.randn(4, 32000), torch.tensor([32000, 0, 1, 1280])
    languages = ["hi", "en", "en", "hi"]
    with torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        _, auto_ids = decoding.auto_decoding(model, encoded, encoded_len)
    assert encoded_len.tolist()[1:] == [0, 0, 1] and auto_ids[1:3] == [[], []] and auto_ids[3]
    decoded = decoding.decode_batch(model, signal, lens, languages=languages)
    assert decoded.texts[1:3] == ["", ""]
    assert decoded.given_texts[1:3] == ["<|en|>", "<|en|>"]
    tag = vocabulary.language_tag_pieces(model, ["hi"])[0]
    assert decoded.given_texts[3] == model.tokenizer.ids_to_text([tag, *auto_ids[3]])
    assert decoded.given_texts[0].startswith("<|hi|>") and len(decoded.given_texts[0]) > 6


@pytest.mark.parametrize("shape", ["prediction", "tag first", "blanks first"])
def test_decoding_with_the_language_given_is_greedy_tdt_from_the_given_tag(tiny, shape):
    """A batch mixing languages given and not: each utterance given a language decodes as the
    greedy TDT of the reference, with the given tag in front of what the model writes (in place
    of the model's own tag where it writes one first, before its first word where it does not);
    the others as auto decoding does (the reference reproduces NeMo's auto decoding too, so it
    is the definition both are held to). An utterance whose first piece already is its tag
    decodes exactly as auto."""
    model, signal, lens = shaped_model(tiny, shape)
    languages = ["hi", None, "en", "hi"]
    decoded = decoding.decode_batch(model, signal, lens, languages=languages)
    max_symbols = model.decoding.decoding.max_symbols
    tags = vocabulary.language_tag_pieces(model, languages)
    went_on = []
    with torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        firsts = decoding.first_emissions(model, encoded, encoded_len)
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
    tag_first = [f is not None and f[0] in language_tags(model) for f in firsts]
    assert all(tag_first) if shape == "tag first" else not any(tag_first)
    if shape != "blanks first":
        assert any(went_on)  # decoding went on after the tag
        assert all(len(text) > 1 for text in decoded.texts)  # blanks and pieces both won
    else:
        assert any(f is not None and f[2] > 0 for f in firsts)  # blanks walked before a piece
    # given the language each utterance starts with, the search writes what auto decoding wrote
    named = [model.tokenizer.ids_to_tokens([f[0]])[0] if f else "" for f in firsts]
    same = [n[2:-2] if n.startswith("<|") else None for n in named]
    again = decoding.decode_batch(model, signal, lens, auto=False, languages=same)
    assert again.given_texts == decoded.texts
    # under bf16 autocast, as a bf16-mixed run validates: the reference under autocast too
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        bf16 = decoding.decode_batch(model, signal, lens, languages=languages)
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        for b in range(4):
            one = (model, encoded[b : b + 1], encoded_len[b])
            auto = reference_greedy_tdt(*one, None, max_symbols)
            given = reference_greedy_tdt(*one, tags[b], max_symbols)
            assert bf16.texts[b] == model.tokenizer.ids_to_text(auto)
            assert bf16.given_texts[b] == model.tokenizer.ids_to_text(given)
    # the same through the one-call helper, with every utterance given
    assert decoding.greedy_texts(model, signal, lens, ["en"] * 4)[2] == decoded.given_texts[2]


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
    before = decoding.decode_batch(model, signal, lens).texts
    languages = ["en", "hi", None, "en"]
    tag_alone = decoding.decode_batch(model, signal, lens, languages=languages, scripts=False)
    with open_dict(model.cfg):
        model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
    kept = vocabulary.language_piece_masks(model, languages)
    pieces = vocabulary.model_pieces(model)
    assert kept[2] is None and bool(kept[0][pieces.index("<|en|>")]) is False  # tags are out
    with open_dict(model.cfg):  # a language recorded without letters: any piece, as unrecorded
        model.cfg.language_scripts = {"en": ["Latin"], "hi": []}
    assert vocabulary.language_piece_masks(model, ["hi", "ta"]) == [None, None]
    with open_dict(model.cfg):
        model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
    decoded = decoding.decode_batch(model, signal, lens, languages=languages)
    assert decoded.texts == before
    assert decoding.decode_batch(model, signal, lens).texts == before  # the rows are cleared
    tags = vocabulary.language_tag_pieces(model, languages)
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
        bf16 = decoding.decode_batch(model, signal, lens, languages=languages)
    for text, lang in zip(bf16.given_texts, languages):
        assert lang is None or other[lang] not in scripts_of(strip_lang_tag(text))
    monkeypatch.setattr(config, "LANGUAGE_GIVEN_SCRIPTS", "0")
    off = decoding.decode_batch(model, signal, lens, languages=languages)
    assert off.given_texts == tag_alone.given_texts


@pytest.mark.parametrize("shape", ["prediction", "tag first"])
def test_kept_pieces_hold_in_the_search_cuda_graphs_run(tiny, monkeypatch, shape):
    """NeMo's CUDA-graph search keeps its state for the largest batch it has seen and runs
    smaller ones padded to it; its stateful implementation (what the graphs capture, run here
    without capture: "no_graphs") writes what the plain loop writes, with pieces kept, for a
    batch as large as the state's and for a smaller one after it, and auto decoding after them
    is unchanged; for a model that writes a word first ("prediction") and one that writes its
    tag first."""
    from omegaconf import open_dict

    languages = ["en", "hi", None, "en"]
    for fresh in range(2):  # the plain loop's texts, then a model that has decoded nothing
        model, signal, lens = shaped_model(tiny, shape)
        with open_dict(model.cfg):
            model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
        if not fresh:
            plain = decoding.decode_batch(model, signal, lens, languages=languages)
    computer = model.decoding.decoding.decoding_computer
    search_as_cuda_graphs_run(monkeypatch, model)
    part = decoding.decode_batch(model, signal[:2], lens[:2], languages=languages[:2])
    assert part.given_texts == plain.given_texts[:2]
    assert decoding.decode_batch(model, signal, lens).texts == plain.texts  # a state for 4
    part = decoding.decode_batch(model, signal[:2], lens[:2], languages=languages[:2])
    assert part.given_texts == plain.given_texts[:2]
    whole = decoding.decode_batch(model, signal, lens, languages=languages)
    assert whole.given_texts == plain.given_texts and whole.texts == plain.texts
    part = decoding.decode_batch(model, signal[:2], lens[:2], languages=languages[:2])
    assert computer.state.batch_size == 4  # the smaller batch ran padded to the state's
    assert part.given_texts == plain.given_texts[:2]
    assert decoding.decode_batch(model, signal, lens).texts == plain.texts


def test_reports_say_how_the_language_given_was_decoded(monkeypatch):
    from omegaconf import OmegaConf

    model = SimpleNamespace(cfg=OmegaConf.create({"language_scripts": {"hi": ["Devanagari"]}}))
    assert vocabulary.kept_scripts_phrase(model, ["hi", None]) == (
        "then only pieces of its scripts (hi Devanagari)"
    )
    assert vocabulary.kept_scripts_phrase(model, ["hi", "und", None]) == (
        "then only pieces of its scripts (hi Devanagari); und: decoded auto"
    )
    assert vocabulary.kept_scripts_phrase(model, ["hi", "ta"]).endswith(
        "; the tag alone for ta (the model records no scripts for it)"
    )
    monkeypatch.setattr(config, "LANGUAGE_GIVEN_SCRIPTS", "0")
    assert (
        vocabulary.kept_scripts_phrase(model, ["hi"]) == "the tag alone (LANGUAGE_GIVEN_SCRIPTS=0)"
    )
    assert vocabulary.kept_scripts_phrase(model, ["und"]) == (
        "the tag alone (LANGUAGE_GIVEN_SCRIPTS=0); und: decoded auto"
    )


def test_a_language_not_known_decodes_auto_beside_languages_given(tiny):
    """None, "" and und (undetermined) name no language: no tag, every piece kept, decoded auto
    in a batch whose other rows are given theirs (und is no tag the model lacks)."""
    from omegaconf import open_dict

    model, signal, lens = shaped_model(tiny, "prediction")
    with open_dict(model.cfg):
        model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"], "und": ["Latin"]}
    languages = ["und", "hi", "", None]
    assert vocabulary.language_tag_pieces(model, languages)[::2] == [None, None]
    masks = vocabulary.language_piece_masks(model, languages)
    assert masks[0] is None and masks[1] is not None and masks[2:] == [None, None]
    decoded = decoding.decode_batch(model, signal, lens, languages=languages)
    alone = decoding.decode_batch(model, signal, lens, auto=False, languages=languages)
    for b in (0, 2, 3):
        assert decoded.given_texts[b] == alone.given_texts[b] == decoded.texts[b]
    assert decoded.given_texts[1].startswith("<|hi|>")


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
    pieces = vocabulary.model_pieces(model)
    with torch.no_grad(), open_dict(model.cfg):
        model.joint.joint_net[-1].bias[pieces.index("<|en|>")] += 1.0
        model.cfg.language_scripts = {"en": ["Latin"], "hi": ["Devanagari"]}
    with torch.no_grad():
        encoded = model.forward(input_signal=signal, input_signal_length=lens)
        auto_texts, auto_ids = decoding.auto_decoding(model, *encoded)
    assert all(pieces[ids[0]] == "<|en|>" and len(ids) > 1 for ids in auto_ids)
    searched = []
    real = decoding.started_texts

    def spy(model, encoded, encoded_len, firsts, kept=None, **tags):
        searched.append(len(firsts))
        return real(model, encoded, encoded_len, firsts, kept, **tags)

    monkeypatch.setattr(decoding, "started_texts", spy)
    for languages, scripts, rows in (
        (["en"] * 4, False, []),  # auto already is the given: no search
        (["en"] * 4, True, [4]),  # Devanagari after <|en|> is not kept: all searched
        (["en", "hi", None, "hi"], False, [2]),  # the Hindi rows alone
    ):
        searched.clear()
        both = decoding.decode_batch(model, signal, lens, languages=languages, scripts=scripts)
        assert searched == rows, (languages, scripts)
        alone = decoding.decode_batch(
            model, signal, lens, auto=False, languages=languages, scripts=scripts
        )
        assert both.texts == auto_texts and both.given_texts == alone.given_texts
        assert languages[2] == "en" or both.given_texts[2] == auto_texts[2]  # none given


def test_a_language_the_model_has_no_tag_for_is_one_line_naming_it_and_the_tags_it_has(tiny):
    with pytest.raises(vocabulary.LanguageNotInModel) as caught:
        vocabulary.language_tag_pieces(tiny.model, ["hi", "ta"])
    message = str(caught.value)
    assert "<|ta|>" in message and "its tags: en, hi" in message and "\n" not in message
    assert vocabulary.language_tag_pieces(tiny.model, [None, ""]) == [None, None]


def reference_log_likelihood(model, encoded, encoded_len, ids: list[int]) -> float:
    """log P(ids | one utterance) under the TDT model, from its definition: the prediction
    network reads the start symbol, then each piece; the joint scores every frame against each of
    its outputs; the TDT forward sums over every alignment (reference_tdt_loss, sigma 0)."""
    from tests.reference_tdt_loss import reference_tdt_loss

    out, state = model.decoder.predict(None, None, add_sos=False, batch_size=1)
    outs = [out]
    for piece in ids:
        out, state = model.decoder.predict(
            torch.tensor([[piece]]), state, add_sos=False, batch_size=1
        )
        outs.append(out)
    frames = int(encoded_len)
    acts = model.joint.joint(encoded.transpose(1, 2)[:, :frames], torch.cat(outs, dim=1))
    nll = reference_tdt_loss(
        acts.double(),
        torch.tensor([ids]),
        torch.tensor([frames]),
        torch.tensor([len(ids)]),
        int(model.decoder.blank_idx),
        list(model.decoding.decoding.durations),
    )
    return -float(nll[0])


@pytest.mark.parametrize("scripts", ["1", "0"])
def test_auto_language_score_keeps_the_transcript_of_the_language_the_model_scores_highest(
    tiny, monkeypatch, scripts
):
    """AUTO_LANGUAGE=score, from its definition: each utterance decoded with each of the model's
    languages given (the greedy TDT from that language's tag, keeping that language's pieces
    under LANGUAGE_GIVEN_SCRIPTS=1), each transcript scored by the model's log-likelihood of its
    pieces, the tag included; the utterance's transcript is the best-scored one."""
    monkeypatch.setattr(config, "LANGUAGE_GIVEN_SCRIPTS", scripts)
    model, signal, lens = shaped_model(tiny, "prediction")
    pieces = vocabulary.model_pieces(model)
    languages = sorted(pieces[i][2:-2] for i in language_tags(model))
    assert len(languages) >= 2
    monkeypatch.setattr(config, "AUTO_LANGUAGE", "score")
    scored = decoding.decode_batch(model, signal, lens)
    monkeypatch.setattr(config, "AUTO_LANGUAGE", "first")
    first = decoding.decode_batch(model, signal, lens)
    max_symbols = model.decoding.decoding.max_symbols
    chosen = []
    with torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=lens)
        for b in range(signal.shape[0]):
            one = (model, encoded[b : b + 1], encoded_len[b])
            best = None
            for lang in languages:
                (tag,) = vocabulary.language_tag_pieces(model, [lang])
                (kept,) = vocabulary.language_piece_masks(model, [lang])
                ids = reference_greedy_tdt(*one, tag, max_symbols, kept if scripts == "1" else None)
                score = reference_log_likelihood(*one, ids)
                if best is None or score > best[0]:
                    best = (score, lang, ids)
            assert scored.texts[b] == model.tokenizer.ids_to_text(best[2]), b
            chosen.append(best[1])
    # the model's first piece names no language here (it writes no tag first): the choice is
    # made by the scores alone, and so differs from the first piece's
    assert scored.texts != first.texts
    assert all(text.startswith(f"<|{lang}|>") for text, lang in zip(scored.texts, chosen))
