"""Greedy decoding of a model of ``asr_model.FAMILIES``: auto (the model names the language) or
with the language given (decoding starts from the language's tag and, after it, writes only the
pieces of that language's scripts).

``decode_batch`` (``decode_encoded`` from the encoder's output) is every decoding a caller asks
for of one padded batch from one encoder forward: auto, with the language given, the first piece
of auto decoding and the batch's loss; ``greedy_texts``, ``greedy_texts_and_first_tokens`` and
``greedy_texts_and_loss`` are its one-call forms. A language becomes its tag's piece
(``vocabulary.language_tag_pieces``) and the pieces it may write (``vocabulary.language_piece_masks``). The greedy TDT
search is NeMo's label-looping greedy decoding: ``auto_decoding`` runs it as it comes,
``started_texts`` continues it from the state after the tag (``started_state``, at the frame
``first_emissions`` finds), with the pieces left out masked in its joint (``_KeptPieces``).
``decoding_graphs`` holds NeMo's CUDA graphs of that search for a validation or an evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import asr_model
import base_adapters
import config
import vocabulary
from manifest_schema import leading_lang

# ---- the language given: its tag and the pieces written after it ------------------------------


# ---- decoding a batch ------------------------------------------------------------------------


def greedy_texts(
    model, signal: torch.Tensor, signal_len: torch.Tensor, languages=None
) -> list[str]:
    """Greedy transcripts (tags included, as the model emits them) of a padded batch of audio.
    ``languages``, one per utterance: decode starting from that language's tag (the language
    given); None (for all or for one) decodes as the model guesses."""
    if languages is None:
        return decode_batch(model, signal, signal_len).texts
    return decode_batch(model, signal, signal_len, auto=False, languages=languages).given_texts


def greedy_texts_and_first_tokens(
    model, signal: torch.Tensor, signal_len: torch.Tensor
) -> tuple[list[str], list[tuple[int, float] | None]]:
    """Greedy transcripts of a padded batch of audio (as ``greedy_texts``) and, per utterance,
    (piece id, probability) of the first piece the decoding emits (the language tag of a model of
    this project), None when it emits none; from one encoder forward."""
    decoded = decode_batch(model, signal, signal_len, first_tokens=True)
    return decoded.texts, decoded.first_tokens


def greedy_texts_and_loss(model, batch) -> tuple[list[str], float]:
    """Greedy transcripts of a non-empty AsrBatch and its loss (the training loss's reduction),
    from one encoder forward."""
    decoded = decode_batch(model, batch.signal, batch.signal_len, loss_batch=batch)
    return decoded.texts, decoded.loss


@dataclasses.dataclass
class BatchDecoding:
    """What ``decode_batch`` returns, one entry per utterance where a list: ``texts``, greedy
    transcripts decoded auto (the model names the language); ``given_texts``, decoded from the
    given language's tag (decoded auto where no language was given for that utterance);
    ``first_tokens``,
    (piece id, probability) of the first piece auto decoding emits, None where it emits none;
    ``loss``, the batch's loss (the training loss's reduction); ``auto_ids``, the piece ids of
    each auto transcript (asked by ``keep_auto_ids``). A part not asked for is None."""

    texts: list[str] | None = None
    given_texts: list[str | None] | None = None
    first_tokens: list[tuple[int, float] | None] | None = None
    loss: float | None = None
    auto_ids: list[list[int]] | None = None


@torch.no_grad()
def decode_batch(model, signal: torch.Tensor, signal_len: torch.Tensor, **asked) -> BatchDecoding:
    """``decode_encoded`` of one padded batch of audio, from one encoder forward; ``asked``: its
    keywords (what to decode). A frozen-base model (``base_adapters``) writes each utterance of a
    base language, given or named by auto decoding, as the base does (``base_decoding``: a second
    encoder forward, with the adapters off, for those utterances; under AUTO_LANGUAGE=score the
    base also scores its languages, ``_held_scored``); the first pieces and the loss stay the
    adapted model's."""
    encoded, encoded_len = model.forward(input_signal=signal, input_signal_length=signal_len)
    held = base_adapters.record_of(model)
    if held is None:
        return decode_encoded(model, encoded, encoded_len, **asked)
    if asked.get("auto", True) and config.AUTO_LANGUAGE == "score":
        return _held_scored(model, signal, signal_len, encoded, encoded_len, held, asked)
    languages = asked.get("languages")
    base_langs = set(held["languages"])
    if languages is not None:
        # Utterances of the base's languages are written by the base below: no adapted search.
        asked = {**asked, "languages": [None if lang in base_langs else lang for lang in languages]}
    out = decode_encoded(model, encoded, encoded_len, keep_auto_ids=True, **asked)
    rows: dict[int, str] = {}  # utterance -> the base language it is written in
    for b, lang in enumerate(languages or ()):
        if lang in base_langs:
            rows[b] = lang
    named = {b: _named_language(model, ids) for b, ids in enumerate(out.auto_ids or ())}
    auto_rows = {b: lang for b, lang in named.items() if lang in base_langs}
    out.auto_ids = None
    wanted = sorted(set(rows) | set(auto_rows))
    if not wanted:
        return out
    at = torch.tensor(wanted, device=signal.device)
    with base_adapters.adapters_off(model):
        base_encoded, base_len = model.forward(
            input_signal=signal[at], input_signal_length=signal_len[at]
        )
        # An utterance both given and named as base languages may need two: one search per
        # (utterance, language), each from the base's own encoder output.
        jobs = [(k, b, rows[b]) for k, b in enumerate(wanted) if b in rows] + [
            (k, b, auto_rows[b])
            for k, b in enumerate(wanted)
            if b in auto_rows and rows.get(b) != auto_rows[b]
        ]
        where = torch.tensor([k for k, _, _ in jobs], device=signal.device)
        texts = base_decoding(
            model,
            base_encoded[where],
            base_len[where],
            [lang for _, _, lang in jobs],
            held,
            scripts=asked.get("scripts"),
        )
    by_job = {(b, lang): text for (_, b, lang), text in zip(jobs, texts)}
    for b, lang in rows.items():
        out.given_texts[b] = by_job[(b, lang)]
    for b, lang in auto_rows.items():
        out.texts[b] = by_job[(b, lang)]
    return out


def _held_scored(model, signal, signal_len, encoded, encoded_len, held, asked) -> BatchDecoding:
    """``decode_batch`` of a frozen-base model under AUTO_LANGUAGE=score: each utterance is
    decoded in each of the model's languages, a base language by the base (the adapters off,
    ``base_decoding``) and scored by the base, a new one with the adapters on and scored by the
    adapted model, and auto keeps the most likely; so the base's evidence speaks for its own
    languages. An utterance given a base language gets the base's transcript of it."""
    base_langs = held["languages"]
    languages = asked.get("languages")
    on = {**asked, "auto": False}
    if languages is not None:
        on["languages"] = [None if lang in base_langs else lang for lang in languages]
    elif not on.get("first_tokens") and on.get("loss_batch") is None:
        on = None  # nothing asked of the adapted model but the candidates below
    out = decode_encoded(model, encoded, encoded_len, **on) if on else BatchDecoding()
    size = encoded.shape[0]
    new_langs = [lang for lang in model_languages(model) if lang not in base_langs]
    texts, ids, best = language_candidates(model, encoded, encoded_len, new_langs)
    with base_adapters.adapters_off(model):
        base_encoded, base_len = model.forward(input_signal=signal, input_signal_length=signal_len)
        by_language = {}
        for lang in base_langs:
            lang_texts, lang_ids = base_decoding(
                model,
                base_encoded,
                base_len,
                [lang] * size,
                held,
                scripts=asked.get("scripts"),
                with_ids=True,
            )
            scores = sequence_log_likelihoods(
                model, base_encoded, base_len, lang_ids, pieces=base_pieces(model, held)
            ).cpu()
            by_language[lang] = lang_texts
            for b in range(size):
                if scores[b] > best[b]:
                    best[b], texts[b], ids[b] = scores[b], lang_texts[b], lang_ids[b]
    out.texts = texts
    if languages is not None:
        if out.given_texts is None:
            out.given_texts = [None] * size
        for b, lang in enumerate(languages):
            if lang in base_langs:
                out.given_texts[b] = by_language[lang][b]
            elif out.given_texts[b] is None:
                out.given_texts[b] = texts[b]  # no language given: decoded auto
    return out


def model_languages(model) -> list[str]:
    """The languages ``model`` has a tag for, sorted."""
    tag_ids = vocabulary.language_tag_ids(model)
    pieces = vocabulary.model_pieces(model) or model.tokenizer.ids_to_tokens(sorted(tag_ids))
    if len(pieces) <= max(tag_ids, default=-1):
        return []
    return sorted({leading_lang(pieces[i]) for i in tag_ids})


def base_pieces(model, held: dict) -> torch.Tensor:
    """True for the pieces the base of a frozen-base model had (its first ``held["pieces"]``)."""
    own = torch.zeros(int(model.decoder.blank_idx), dtype=torch.bool)
    own[: held["pieces"]] = True
    return own


def _named_language(model, ids: list[int] | None) -> str | None:
    """The language whose tag auto decoding wrote first, None for none."""
    if not ids:
        return None
    if ids[0] not in vocabulary.language_tag_ids(model):
        return None
    return leading_lang(model.tokenizer.ids_to_tokens([ids[0]])[0])


def base_decoding(
    model,
    encoded,
    encoded_len,
    languages: list[str],
    held: dict,
    *,
    scripts: bool | None = None,
    with_ids: bool = False,
):
    """Transcripts of the base's languages ``languages`` (one per utterance) written as the base
    writes them, from the encoder's output with the adapters off (``held``: the model's
    ``base_adapters.record_of``): the pieces past the base's own never written. Where the base has
    the language's tag (one of its pieces), decoding starts from it with the language given, as
    the base decodes with it given (under LANGUAGE_GIVEN_SCRIPTS, ``scripts`` by default, the
    pieces of the scripts the base records for it); where the base has no tag for it, the base
    decodes as it comes and the language's tag is put in front. Call with the adapters off
    (``base_adapters.adapters_off``). With ``with_ids``: (transcripts, the piece ids the base
    wrote: its tag first where it has one)."""
    if scripts is None:
        scripts = config.LANGUAGE_GIVEN_SCRIPTS == "1"
    tags = vocabulary.language_tag_pieces(model, languages)
    pieces = held["pieces"]
    own = base_pieces(model, held)
    masks = (
        vocabulary.language_piece_masks(model, languages, recorded=held["scripts"])
        if scripts
        else [None] * len(tags)
    )
    firsts = [tag if tag is not None and tag < pieces else None for tag in tags]
    kept = [
        own & mask if mask is not None and first is not None else own
        for mask, first in zip(masks, firsts)
    ]
    texts, ids = started_decoding(
        model,
        encoded,
        encoded_len,
        firsts,
        kept,
        tag_ids=vocabulary.language_tag_ids(model),
        walk_pieces=own,
    )
    for b, (first, tag) in enumerate(zip(firsts, tags)):
        if first is None and tag is not None:
            texts[b] = model.tokenizer.ids_to_text([tag] + ids[b])
    return (texts, ids) if with_ids else texts


@torch.no_grad()
def decode_encoded(
    model,
    encoded: torch.Tensor,
    encoded_len: torch.Tensor,
    *,
    auto: bool = True,
    languages=None,
    scripts: bool | None = None,
    first_tokens: bool = False,
    loss_batch=None,
    keep_auto_ids: bool = False,
) -> BatchDecoding:
    """Every decoding asked for of one batch, from the encoder's output: auto (``auto``), with the
    language given (``languages``: one per utterance, None or "" for an utterance decodes it auto
    there too; ``scripts``, default LANGUAGE_GIVEN_SCRIPTS=1: after the tag, only the pieces of
    ``vocabulary.language_piece_masks``), the first piece of auto decoding (``first_tokens``) and the loss of
    ``loss_batch`` (the AsrBatch of this audio, with its tokens)."""
    out = BatchDecoding()
    if languages is not None:
        # What the vocabulary says of the languages, asked before any search: a language the
        # model has no tag for is refused before the batch is decoded at all.
        if scripts is None:
            scripts = config.LANGUAGE_GIVEN_SCRIPTS == "1"
        kept = vocabulary.language_piece_masks(model, languages) if scripts else None
        tag_ids = vocabulary.language_tag_ids(model)
        firsts = vocabulary.language_tag_pieces(model, languages)
        if kept is None:
            kept = [None] * len(firsts)
    auto_ids = None
    if auto:
        decode_auto = scored_decoding if config.AUTO_LANGUAGE == "score" else auto_decoding
        out.texts, auto_ids = decode_auto(model, encoded, encoded_len)
        if keep_auto_ids:
            out.auto_ids = auto_ids
    if languages is not None:
        rows = list(range(len(firsts)))
        if auto:
            # Where auto decoding wrote the given tag first and then only kept pieces, the search
            # with the language given takes every step auto's took: its text is auto's.
            rows = [
                b
                for b in rows
                if firsts[b] is not None
                and (auto_ids is None or not _auto_is_given(auto_ids[b], firsts[b], kept[b]))
            ]
        out.given_texts = list(out.texts) if auto else [None] * len(firsts)
        if rows:
            at = torch.tensor(rows, device=encoded.device)
            texts = greedy_texts_of_encoded(
                model,
                encoded if len(rows) == len(firsts) else encoded[at],
                encoded_len if len(rows) == len(firsts) else encoded_len[at],
                [firsts[b] for b in rows],
                [kept[b] for b in rows],
                tag_ids=tag_ids,
            )
            for b, text in zip(rows, texts):
                out.given_texts[b] = text
    if first_tokens:
        out.first_tokens = first_tokens_of_encoded(model, encoded, encoded_len)
    if loss_batch is not None:
        kind = asr_model.family(model)
        out.loss = float(kind.loss_of_encoded(model, encoded, encoded_len, loss_batch))
    return out


def _auto_is_given(ids: list[int], tag: int, kept: torch.Tensor | None) -> bool:
    """True when auto decoding's pieces ``ids`` start with ``tag`` and go on in ``kept`` pieces
    alone (None: any), so that decoding from ``tag`` would write them too."""
    if not ids or ids[0] != tag:
        return False
    if kept is None or len(ids) == 1:
        return True
    return bool(kept[ids[1:]].all())


@contextlib.contextmanager
def decoding_graphs(model):
    """Greedy decoding with NeMo's CUDA graphs for as long as the block lasts.

    NeMo's own model hooks rebuild the decoder's CUDA graphs before each validation (a graph
    captured under another precision or batch layout decodes wrong: NeMo's fix for erratic
    validation WER) and release them after (they hold their memory otherwise, for the rest of the
    run). Lightning calls the hooks of our TrainingModule, not NeMo's, so validation and
    evaluation do it here. A model without these methods (or a CPU, where there are no graphs)
    is left as it is."""
    enable = getattr(model, "maybe_enable_cuda_graphs", None)
    disable = getattr(model, "disable_cuda_graphs", None)
    if base_adapters.record_of(model) is not None:
        # A graph captured with the adapters on would replay them for the base's languages too.
        enable = None
        if callable(disable):
            disable()
    if callable(enable):
        enable(force_reinit=True)
    try:
        yield model
    finally:
        if callable(disable):
            disable()


def release_decoding_graphs(model) -> None:
    """Drop the decoder's CUDA graphs (training holds none: NeMo's on_train_epoch_start does the same)."""
    disable = getattr(model, "disable_cuda_graphs", None)
    if callable(disable):
        disable()


# ---- greedy TDT -----------------------------------------------------------------------------


def greedy_texts_of_encoded(
    model,
    encoded,
    encoded_len,
    first_pieces: list[int | None] | None = None,
    kept: list[torch.Tensor | None] | None = None,
    *,
    tag_ids: frozenset[int] = frozenset(),
) -> list[str]:
    """Greedy transcripts from the encoder's output; where ``first_pieces`` gives an utterance a
    piece id, its decoding starts from that piece as if it had emitted it (the language given)
    and writes after it only the pieces ``kept`` marks True for it (None: any piece); None
    decodes it as it comes (auto). ``tag_ids``: the model's language tags
    (``vocabulary.language_tag_ids``), for ``started_texts``."""
    if first_pieces is None or all(p is None for p in first_pieces):
        return auto_decoding(model, encoded, encoded_len)[0]
    return started_texts(model, encoded, encoded_len, first_pieces, kept, tag_ids=tag_ids)


def auto_decoding(model, encoded, encoded_len) -> tuple[list[str], list | None]:
    """Greedy transcripts decoded auto and the piece ids of each (None when the decoding
    does not give them)."""
    hyps = model.decoding.rnnt_decoder_predictions_tensor(
        encoder_output=encoded, encoded_lengths=encoded_len
    )
    ids = [getattr(hyp, "y_sequence", None) for hyp in hyps]
    if any(i is None for i in ids):
        return [hyp.text for hyp in hyps], None
    return [hyp.text for hyp in hyps], [[int(i) for i in seq] for seq in ids]


def scored_decoding(model, encoded, encoded_len) -> tuple[list[str], list | None]:
    """Auto decoding that chooses each utterance's language by the model's own evidence
    (AUTO_LANGUAGE=score): the batch is decoded with each of the model's languages given (its
    tag first, then, under LANGUAGE_GIVEN_SCRIPTS, that language's pieces only), each transcript
    is scored by the model's TDT log-likelihood of its pieces (``sequence_log_likelihoods``:
    every alignment, the tag included), and each utterance keeps its most likely transcript.
    Greedy transcripts and their piece ids, as ``auto_decoding``. A model with fewer than two
    language tags decodes as ``auto_decoding``."""
    languages = model_languages(model)
    if len(languages) < 2:
        return auto_decoding(model, encoded, encoded_len)
    texts, ids, _ = language_candidates(model, encoded, encoded_len, languages)
    return texts, ids


def language_candidates(
    model, encoded, encoded_len, languages: list[str]
) -> tuple[list[str], list[list[int]], torch.Tensor]:
    """Per utterance, the most likely of its transcripts decoded with each of ``languages`` given
    (``scored_decoding``'s search and score): (transcripts, piece ids, log-likelihoods [B], -inf
    and "" where ``languages`` is empty)."""
    tag_ids = vocabulary.language_tag_ids(model)
    size = encoded.shape[0]
    scripts = config.LANGUAGE_GIVEN_SCRIPTS == "1"
    best = torch.full((size,), float("-inf"))
    texts: list[str] = [""] * size
    ids: list[list[int]] = [[] for _ in range(size)]
    for lang in languages:
        given = [lang] * size
        firsts = vocabulary.language_tag_pieces(model, given)
        kept = vocabulary.language_piece_masks(model, given) if scripts else None
        lang_texts, lang_ids = started_decoding(
            model, encoded, encoded_len, firsts, kept, tag_ids=tag_ids
        )
        scores = sequence_log_likelihoods(model, encoded, encoded_len, lang_ids).cpu()
        for b in range(size):
            if scores[b] > best[b]:
                best[b], texts[b], ids[b] = scores[b], lang_texts[b], lang_ids[b]
    return texts, ids, best


@torch.no_grad()
def sequence_log_likelihoods(
    model, encoded, encoded_len, ids: list[list[int]], pieces: torch.Tensor | None = None
) -> torch.Tensor:
    """log P(``ids[b]`` | utterance b) [B] under the model's TDT: the prediction network reads
    each piece sequence, the joint scores every frame against every prefix, and the TDT
    forward sums over all alignments (``tdt_loss.tdt_loss`` with sigma 0: the probability the
    model's softmaxes give, not the training loss's logit undernormalization). ``pieces``, a bool
    tensor over the pieces: the softmax over those and blank alone, as a model without the
    others gives it."""
    import tdt_loss

    device = encoded.device
    blank = int(model.decoder.blank_idx)
    durations = list(getattr(model.decoding.decoding, "durations", None) or [])
    if not durations:
        durations = [int(d) for d in model.cfg.loss.tdt_kwargs.durations]
    lengths = torch.tensor([len(seq) for seq in ids], dtype=torch.long, device=device)
    labels = torch.full((len(ids), max(1, int(lengths.max()))), blank, dtype=torch.long)
    for b, seq in enumerate(ids):
        labels[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    labels = labels.to(device)
    modes = (model.decoder.training, model.joint.training)
    model.decoder.eval()
    model.joint.eval()
    try:
        decoded, _, _ = model.decoder(targets=labels, target_length=lengths)
        with asr_model._logits_for_the_loss(model.joint):
            acts = model.joint.joint(encoded.transpose(1, 2), decoded.transpose(1, 2))
    finally:
        model.decoder.train(modes[0])
        model.joint.train(modes[1])
    if pieces is not None:
        acts = acts.float()
        acts[..., :blank][..., ~pieces.to(acts.device)] = torch.finfo(acts.dtype).min
    nll = tdt_loss.tdt_loss(
        acts, labels, encoded_len, lengths, blank=blank, durations=durations, reduction="none"
    )
    return -nll.float()


def started_texts(
    model,
    encoded,
    encoded_len,
    first_pieces: list[int | None],
    kept: list[torch.Tensor | None] | None = None,
    *,
    tag_ids: frozenset[int],
) -> list[str]:
    """``started_decoding``'s transcripts."""
    return started_decoding(model, encoded, encoded_len, first_pieces, kept, tag_ids=tag_ids)[0]


def started_decoding(
    model,
    encoded,
    encoded_len,
    first_pieces: list[int | None],
    kept: list[torch.Tensor | None] | None = None,
    *,
    tag_ids: frozenset[int],
    walk_pieces: torch.Tensor | None = None,
) -> tuple[list[str], list[list[int]]]:
    """Greedy transcripts, and their piece ids (the given piece first), of a batch in which
    utterance b starts with ``first_pieces[b]``, a language's tag, in front of what the model
    writes (None: the utterance decodes auto), and after it writes only the pieces ``kept[b]``
    marks True (a bool tensor over the pieces; None: any piece).

    Greedy decoding walks the frames with the start state until a piece beats blank
    (``first_emissions``), at frame t with duration d. Where that piece is a language tag, one of
    ``tag_ids`` (the model's guess of the language), the given tag takes its place: the prediction network reads
    it and the search goes on from frame t + d. Where it is any other piece (a model that writes
    no tag, or skipped it), the given tag goes before it: the prediction network reads the tag
    and the search goes on from frame t itself (the tag took no frame), where the model chooses
    its first piece after the tag. So an utterance whose language the model names right decodes
    exactly as auto; one it takes for another language is written from its own tag on; a model
    that writes no tag loses no word to it. NeMo's label-looping greedy decoding
    (``greedy_batch``, its default for TDT, with or without CUDA graphs) continues a batch from
    such a state and frame, as it continues a stream chunk by chunk; the state is built for the
    whole batch at once and the search is auto decoding's loop.
    The piece is then put in front of each transcript. Pieces left out of ``kept`` lose every
    step of the search to blank or a kept piece (``_KeptPieces``); blank and the durations are
    always kept. ``walk_pieces`` (a bool tensor over the pieces; None: all) limits the walk to
    the first piece to those pieces, as a model that has no others walks it."""
    from nemo.collections.asr.parts.utils.rnnt_utils import batched_hyps_to_hypotheses

    infer = model.decoding.decoding
    computer = getattr(infer, "decoding_computer", None)
    if computer is None:
        raise config.ConfigError(
            "decoding with the language given needs NeMo's label-looping greedy decoding "
            "(decoding.strategy: greedy_batch with greedy.loop_labels: true, NeMo's default); "
            f"this model decodes with {type(infer).__name__}: set its "
            "decoding config (model.change_decoding_strategy) or decode without a language"
        )
    modes = (model.decoder.training, model.joint.training)
    model.decoder.eval()
    model.joint.eval()
    try:
        with torch.inference_mode():
            starts = first_emissions(model, encoded, encoded_len, pieces=walk_pieces)
            frames = [
                int(length)
                if first is None
                else first[2] + (first[3] if first[0] in tag_ids else 0)
                for first, length in zip(starts, encoded_len.tolist())
            ]
            state = started_state(model, first_pieces, frames)
            keeping = kept is not None and any(k is not None for k in kept)
            if keeping:
                _KeptPieces.install(computer, len(first_pieces)).keep(kept)
            try:
                batched, _ = computer(
                    x=encoded.transpose(1, 2), out_len=encoded_len, prev_batched_state=state
                )
            finally:
                if keeping:
                    computer.joint.keep_all()
    finally:
        model.decoder.train(modes[0])
        model.joint.train(modes[1])
    hyps = batched_hyps_to_hypotheses(batched, batch_size=encoded.shape[0])
    emitted = {p: torch.tensor([int(p)]) for p in set(first_pieces) if p is not None}
    for hyp, piece in zip(hyps, first_pieces):
        if piece is not None:
            hyp.y_sequence = torch.cat((emitted[piece], hyp.y_sequence.to(torch.long)))
    ids = [[int(i) for i in hyp.y_sequence.tolist()] for hyp in hyps]
    return [hyp.text for hyp in model.decoding.decode_hypothesis(hyps)], ids


def started_state(model, first_pieces: list[int | None], frames: list[int]):
    """NeMo's batched label-looping state after the prediction network read the start symbol
    and then ``first_pieces[b]`` (after the start symbol alone where it is None), at frame
    ``frames[b]`` (0 where the piece is None)."""
    from nemo.collections.asr.parts.submodules.transducer_decoding.label_looping_base import (
        BatchedLabelLoopingState,
    )

    device = next(model.joint.parameters()).device
    size = len(first_pieces)
    blank = int(model.decoder.blank_idx)
    given = torch.tensor([p is not None for p in first_pieces], device=device)
    pieces = torch.tensor([blank if p is None else int(p) for p in first_pieces], device=device)
    # the start state is one for every utterance: read the start symbol once
    start_out, start = model.decoder.predict(
        torch.full((1, 1), blank, dtype=torch.long, device=device),
        None,
        add_sos=False,
        batch_size=1,
    )
    start = _states_for_batch(model.decoder, start, size)
    start_out = model.joint.project_prednet(start_out).expand(size, -1, -1)
    out, state = model.decoder.predict(pieces.unsqueeze(1), start, add_sos=False, batch_size=size)
    out = torch.where(given[:, None, None], model.joint.project_prednet(out), start_out)
    model.decoder.batch_replace_states_mask(src_states=start, dst_states=state, mask=~given)
    return BatchedLabelLoopingState(
        predictor_states=state,
        predictor_outputs=out.contiguous(),
        labels=pieces,
        decoded_lengths=torch.zeros(size, dtype=torch.long, device=device),
        time_jumps=torch.tensor(
            [0 if p is None else int(f) for p, f in zip(first_pieces, frames)],
            dtype=torch.long,
            device=device,
        ),
    )


def first_tokens_of_encoded(model, encoded, encoded_len) -> list[tuple[int, float] | None]:
    """Per utterance, (piece id, probability) of the first piece greedy decoding emits, None
    when it emits none."""
    return [
        None if first is None else first[:2]
        for first in first_emissions(model, encoded, encoded_len)
    ]


def first_emissions(
    model, encoded, encoded_len, chunk: int = 32, pieces: torch.Tensor | None = None
) -> list[tuple[int, float, int, int] | None]:
    """Per utterance, (piece id, probability, frame, duration) of the first piece greedy
    decoding emits, None when it emits none; the probability is the softmax over the pieces
    and blank of the joint's output at that step, the duration the frames greedy decoding
    then moves on by (the best duration there; 0 for a model without durations).

    Until its first piece, greedy decoding feeds the prediction network its start state
    alone, so the joint of each frame with that one state decides it: from frame 0, a blank
    moves on by its predicted duration (at least one frame, as NeMo's greedy TDT does), the
    first piece ends the walk. The joint runs over ``chunk`` frames at a time, from the
    earliest frame an unfinished utterance has reached, so a walk that ends early (the usual
    case: the language tag comes first) costs a few frames' joint, on any device and
    precision: the joint's log-softmax on CPU shifts every output by one constant, which
    changes neither the argmaxes nor the softmax over the pieces and blank. ``pieces``, a bool
    tensor over the pieces: only those (and blank) are candidates, as in a model without the
    others."""
    blank = int(model.decoder.blank_idx)
    durations = list(getattr(model.decoding.decoding, "durations", None) or [])
    frames = encoded.transpose(1, 2)  # [B, T, D]
    size = frames.shape[0]
    start, _ = model.decoder.predict(None, None, add_sos=False, batch_size=size)
    lengths = [int(n) for n in encoded_len.tolist()]
    out: list[tuple[int, float, int, int] | None] = [None] * size
    at = [0] * size
    walking = [b for b in range(size) if lengths[b] > 0]
    while walking:
        low = min(at[b] for b in walking)
        rows = torch.tensor(walking, device=frames.device)
        logits = model.joint.joint(frames[rows, low : low + chunk], start[rows])[:, :, 0]
        logits = logits.float()
        if pieces is not None:
            logits = logits.clone()
            logits[..., :blank][..., ~pieces.to(logits.device)] = float("-inf")
        best, tokens = logits[..., : blank + 1].softmax(-1).max(-1)
        steps = (
            logits[..., blank + 1 : blank + 1 + len(durations)].argmax(-1)
            if durations
            else torch.zeros_like(tokens)
        )
        # one copy to the host for the three (each a sync on a GPU); ids are exact in float64
        host = torch.stack((tokens.double(), best.double(), steps.double())).cpu()
        tokens = host[0].long().tolist()
        best = host[1].tolist()
        steps = host[2].long().tolist() if durations else None
        still = []
        for k, b in enumerate(walking):
            end = min(lengths[b], low + len(tokens[k]))
            while at[b] < end:
                j = at[b] - low
                duration = durations[steps[k][j]] if durations else 0
                if tokens[k][j] != blank:
                    out[b] = (int(tokens[k][j]), float(best[k][j]), at[b], duration)
                    break
                at[b] += max(1, duration)
            if out[b] is None and at[b] < lengths[b]:
                still.append(b)
        walking = still
    return out


def _states_for_batch(decoder, state, size: int):
    """One utterance's prediction-network ``state`` as the state of ``size`` utterances. An LSTM
    prediction network's (h, c), each [layers, 1, hidden], is expanded along its batch dimension
    with no loop; any other kind goes through the decoder's split and unsplit, one copy per
    utterance."""
    if isinstance(state, (tuple, list)) and all(
        isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == 1 for t in state
    ):
        return type(state)(t.expand(-1, size, -1).contiguous() for t in state)
    return decoder.batch_unsplit_states(decoder.batch_split_states(state) * size)


class _KeptPieces:
    """The joint as NeMo's label-looping search calls it, with one additive row per utterance on
    its pieces' outputs (0 for a piece kept, -inf for one left out; blank and the durations as
    they are).

    Installed once in a decoding computer (``install``) and left there, with every row 0 except
    while a search with kept pieces runs (``keep``, then ``keep_all``), so auto decoding through
    the same computer is unchanged. The rows live in one buffer that the CUDA graphs of the search
    read by address: ``keep`` writes into it in place, and the buffer grows (and the computer's
    graphs are captured again) only when a batch larger than every one before it comes."""

    def __init__(self, joint, rows: int, pieces: int, device):
        self.joint = joint
        self.pieces = pieces
        # as wide as the joint's output (pieces, blank, durations): one contiguous add per step
        width = max(int(getattr(joint, "num_classes_with_blank", pieces + 1)), pieces + 1)
        with torch.inference_mode(False):  # written in place by every later search
            self.bias = torch.zeros(rows, width, device=device)

    def __getattr__(self, name):
        return getattr(self.joint, name)

    @classmethod
    def install(cls, computer, size: int) -> _KeptPieces:
        """The computer's ``_KeptPieces`` (installed now if it has none) with room for ``size``
        rows and for the batch its CUDA graphs were captured for."""
        joint = computer.joint
        state = getattr(computer, "state", None)
        rows = max(size, int(getattr(state, "batch_size", 0) or 0))
        if isinstance(joint, cls) and joint.bias.shape[0] >= rows:
            return joint
        inner = joint.joint if isinstance(joint, cls) else joint
        device = next(inner.parameters()).device
        computer.joint = cls(inner, rows, int(computer._blank_index), device)
        computer.reset_cuda_graphs_state()  # captured graphs read the joint without these rows
        return computer.joint

    def keep(self, kept: list[torch.Tensor | None]) -> None:
        """Row b keeps the pieces ``kept[b]`` marks True (None: every piece); rows past the batch
        keep every piece."""
        every = torch.ones(self.pieces, dtype=torch.bool)
        rows = torch.stack([every if mask is None else mask.cpu() for mask in kept])
        self.bias.zero_()
        self.bias[: len(kept), : self.pieces].masked_fill_(
            ~rows.to(self.bias.device), float("-inf")
        )

    def keep_all(self) -> None:
        self.bias.zero_()

    def joint_after_projection(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        out = self.joint.joint_after_projection(f, g)
        if out.shape[0] <= self.bias.shape[0]:
            bias = self.bias[: out.shape[0], None, None, :]
            if out.shape[-1] == bias.shape[-1]:
                out += bias
            else:
                out[..., : self.pieces] += bias[..., : self.pieces]
        return out
