"""Scoring a model on a manifest: corpus-level WER and CER per language, greedy transcription.

The one implementation behind the in-training evaluation (callbacks.PerLanguageWERCallback) and
scripts/evaluate.py: ``ErrorCounts`` / ``corpus_error_rates`` (corpus-level rates of hypothesis and
reference after one normalization, ``normalize_for_scoring``), ``greedy_transcribe`` (the training
pipeline's audio loading and collate, the model's greedy decoding of decoding.py), and the helpers
that choose and split what is decoded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import config
import decoding
from manifest_schema import leading_lang, strip_lang_tag

# What ``normalize_for_scoring`` does, in words: printed by scripts/evaluate.py, in docs/metrics.md.
SCORING_NORMALIZATION = (
    "both sides Unicode NFC, tags (<|hi|>, [noise]) removed, punctuation and symbols "
    "(danda, double danda, quotes, dashes, ...) turned into spaces, whitespace collapsed, "
    "lower-cased; letters, digits, in-word apostrophes and combining signs "
    "(virama, nukta, vowel signs) kept"
)

# The ``scoring`` a validation record (``last_evaluation``) carries when its counts are of
# normalized texts; records written before normalized scoring carry none (tags stripped only).
NORMALIZED_SCORING = "normalized"


def normalize_for_scoring(texts: Sequence[str]) -> list[str]:
    """Each text as it is scored: the plain training targets' cleaning
    (``transcript_cleaning.clean_text``: NFC, tags removed, punctuation and symbols to spaces,
    whitespace collapsed, in-word apostrophes kept as ``'``), then lower-cased.

    Guarantees: a plain training target, a raw transcript of it (punctuation, capitals, dandas,
    quotes, spacing) and the same text written in another case all give one string, so a perfect
    transcript scores 0 whatever the manifest's origin or the targets' style; letters and
    combining signs of every script are kept, so Indic spelling errors still count. Vectorized
    (polars), for corpora of any size; where polars is not installed (a training node), the same
    rules one string at a time (``transcript_cleaning.clean_text_without_polars``).
    """
    try:
        import polars as pl
    except ImportError:  # a training node installed from the training-only wheelhouse
        from transcript_cleaning import clean_text_without_polars

        return [clean_text_without_polars(text).lower() for text in texts]
    from transcript_cleaning import clean_text_column

    column = pl.Series("text", list(texts), dtype=pl.String)
    return clean_text_column(column).str.to_lowercase().to_list()


@dataclasses.dataclass
class ErrorCounts:
    """Edit counts summed over utterances: rates are corpus-level (total edits / total reference
    units). Word edits split into substitutions, deletions and insertions (one minimal alignment)."""

    word_edits: int = 0
    words: int = 0
    char_edits: int = 0
    chars: int = 0
    utterances: int = 0
    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0

    @property
    def wer(self) -> float:
        return self.word_edits / self.words if self.words else math.nan

    @property
    def cer(self) -> float:
        return self.char_edits / self.chars if self.chars else math.nan

    def rate(self, edits: int) -> float:
        """``edits`` per reference word (the WER's share of substitutions, deletions or insertions)."""
        return edits / self.words if self.words else math.nan

    def add(self, reference: str, hypothesis: str) -> None:
        """Count one utterance as given (tags stripped, whitespace collapsed: normalizing is
        ``corpus_error_rates``'s). CER counts characters including the single spaces between words
        (jiwer's convention)."""
        from kaldialign import edit_distance  # C++ Levenshtein; NeMo's ASR extra installs it

        ref, hyp = strip_lang_tag(reference), strip_lang_tag(hypothesis)
        words = edit_distance(ref.split(), hyp.split())
        self.word_edits += words["total"]
        self.substitutions += words["sub"]
        self.deletions += words["del"]
        self.insertions += words["ins"]
        self.words += len(ref.split())
        self.char_edits += edit_distance(list(ref), list(hyp))["total"]
        self.chars += len(ref)
        self.utterances += 1


def corpus_error_rates(
    references: Sequence[str],
    hypotheses: Sequence[str],
    languages: Sequence[str],
    *,
    as_written: bool = False,
) -> dict[str, ErrorCounts]:
    """ErrorCounts per language plus "all" (every utterance), corpus-level, of both sides after
    ``normalize_for_scoring``; with ``as_written``, of the texts as written (tags stripped and
    whitespace collapsed only: punctuation, case and dandas count)."""
    if not len(references) == len(hypotheses) == len(languages):
        raise ValueError(
            f"corpus_error_rates: {len(references)} references, {len(hypotheses)} hypotheses and "
            f"{len(languages)} languages; expected one of each per utterance"
        )
    if not as_written:
        references, hypotheses = (
            normalize_for_scoring(references),
            normalize_for_scoring(hypotheses),
        )
    counts: dict[str, ErrorCounts] = {}
    total = ErrorCounts()
    for ref, hyp, lang in zip(references, hypotheses, languages):
        counts.setdefault(lang, ErrorCounts()).add(ref, hyp)
        total.add(ref, hyp)
    counts = dict(sorted(counts.items()))
    counts["all"] = total
    return counts


# ---- language identification: the tag a hypothesis starts with ------------------------------------

# The guess of a hypothesis that starts with no language tag (its first token is no tag).
NO_TAG = "none"


def language_confusion(
    languages: Sequence[str], hypotheses: Sequence[str]
) -> dict[str, dict[str, int]]:
    """{true language: {guessed language: utterances}} of greedy hypotheses (tags included, as the
    model emits them): the guess is the language of the tag a hypothesis starts with, its first
    decoded token (``NO_TAG`` when it starts with none). Languages sorted, guesses in the order of
    their counts, largest first."""
    if len(languages) != len(hypotheses):
        raise ValueError(
            f"language_confusion: {len(languages)} languages and {len(hypotheses)} hypotheses; "
            "expected one of each per utterance"
        )
    counts: dict[str, dict[str, int]] = {}
    for lang, hypothesis in zip(languages, hypotheses):
        guess = leading_lang(hypothesis) or NO_TAG
        row = counts.setdefault(lang, {})
        row[guess] = row.get(guess, 0) + 1
    return {
        lang: dict(sorted(row.items(), key=lambda kv: (-kv[1], kv[0])))
        for lang, row in sorted(counts.items())
    }


def language_id_accuracy(confusion: dict[str, dict[str, int]]) -> dict[str, float]:
    """{language: share of its utterances whose hypothesis starts with its own tag}, plus "all"
    (every utterance pooled), from ``language_confusion``."""
    out: dict[str, float] = {}
    right = total = 0
    for lang, row in confusion.items():
        n = sum(row.values())
        out[lang] = row.get(lang, 0) / n if n else math.nan
        right, total = right + row.get(lang, 0), total + n
    out["all"] = right / total if total else math.nan
    return out


def confusion_rows(confusion: dict[str, dict[str, int]]) -> list[list[Any]]:
    """``language_confusion`` as table rows [true language, guessed language, utterances]."""
    return [[lang, guess, n] for lang, row in confusion.items() for guess, n in row.items()]


# ---- greedy decoding with the training pipeline's dataset and collate ---------------------------


def select_eval_indices(lang_codes: np.ndarray, per_lang: int, seed: int = 0) -> np.ndarray:
    """Up to ``per_lang`` dataset indices per language code, a seeded choice, sorted (the same on every rank)."""
    rng = np.random.default_rng(seed)
    chosen = []
    for code in np.unique(lang_codes):
        rows = np.flatnonzero(lang_codes == code)
        chosen.append(rows if len(rows) <= per_lang else rng.choice(rows, per_lang, replace=False))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def pack_by_duration(
    indices: Sequence[int], durations: np.ndarray, max_batch_seconds: float
) -> list[list[int]]:
    """``indices`` sorted by duration and cut into batches of at most ``max_batch_seconds`` of audio
    (an utterance longer than that gets a batch of its own)."""
    order = sorted((int(i) for i in indices), key=lambda i: float(durations[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    seconds = 0.0
    for i in order:
        d = float(durations[i])
        if current and seconds + d > max_batch_seconds:
            batches.append(current)
            current, seconds = [], 0.0
        current.append(i)
        seconds += d
    if current:
        batches.append(current)
    return batches


@dataclasses.dataclass
class Decoded:
    """What ``decode`` returns: ``texts``, {dataset index: greedy text decoded auto, or None for
    bad audio}; with languages given, ``given_texts``, {index: greedy text decoded from the
    language's tag (auto where the index has no language), or None for bad audio}; with the loss asked for, the sum over
    batches of (batch loss x utterances) and those utterances; with the first tokens asked for,
    ``first_tokens``, {index: (piece id, probability) of the first piece auto decoding emitted, or
    None} (``decoding.decode_batch``); ``stopped``: ``should_stop`` ended the decoding before
    every index was decoded."""

    texts: dict[int, str | None]
    loss_sum: float = 0.0
    loss_utterances: int = 0
    stopped: bool = False
    first_tokens: dict[int, tuple[int, float] | None] = dataclasses.field(default_factory=dict)
    given_texts: dict[int, str | None] = dataclasses.field(default_factory=dict)

    @property
    def loss(self) -> float:
        """Mean loss per utterance (each batch's loss has the training loss's reduction)."""
        return self.loss_sum / self.loss_utterances if self.loss_utterances else math.nan


def decode(
    model,
    dataset,
    indices: Sequence[int],
    *,
    max_batch_seconds: float = 60.0,
    device: torch.device | str | None = None,
    autocast: Callable[[], Any] | None = None,
    progress: bool = False,
    with_loss: bool = False,
    with_first_tokens: bool = False,
    languages: Callable[[int], str | None] | None = None,
    auto: bool = True,
    after_batch: Callable[[], None] | None = None,
    should_stop: Callable[[], Any] | None = None,
) -> Decoded:
    """Greedy hypotheses of ``dataset[i]`` for each ``i`` in ``indices``: decoded auto (unless
    ``auto`` is False, when ``Decoded.texts`` holds only the bad audio's None), and with
    ``languages`` (dataset index -> language, None for none) decoded from that language's tag
    too, ``Decoded.given_texts``; with ``with_loss`` the loss of the same batches and with
    ``with_first_tokens`` the first piece auto decoding emits and its probability, all from the
    same encoder forward.

    Audio goes through the training pipeline's own loading and collate (soundfile + soxr, the same
    resampling and padding) and ``decoding.decode_batch``: no temporary manifests, no NeMo
    dataloader, and so no dependence on ``cfg.validation_ds``. Every module's train/eval mode is
    restored afterwards (a frozen encoder stays in eval mode), and the decoder's CUDA graphs are
    rebuilt before and released after (``decoding.decoding_graphs``). ``after_batch`` is called after each
    batch (a watchdog's sign of life); when ``should_stop()`` is true after a batch, decoding ends
    there (``Decoded.stopped``).
    """
    if not auto and languages is None:
        raise ValueError("decode: nothing to decode (auto is off and no languages are given)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    modes = {m: m.training for m in model.modules()}
    model.eval()
    out = Decoded({})
    batches = pack_by_duration(indices, dataset.durations, max_batch_seconds)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="decoding", unit="batch")
    asked = dict(
        with_loss=with_loss, with_first_tokens=with_first_tokens, languages=languages, auto=auto
    )
    try:
        with decoding.decoding_graphs(model):
            for batch_indices in batches:
                _decode_batch(model, dataset, batch_indices, out, device, autocast, **asked)
                if after_batch is not None:
                    after_batch()
                if should_stop is not None and should_stop():
                    out.stopped = True
                    break
    finally:
        for module, training in modes.items():
            module.train(training)
    return out


def _decode_batch(
    model,
    dataset,
    batch_indices,
    out: Decoded,
    device,
    autocast,
    *,
    with_loss: bool,
    with_first_tokens: bool,
    languages: Callable[[int], str | None] | None,
    auto: bool,
) -> None:
    """Decode one batch of ``dataset`` into ``out``: what ``decode`` was asked for."""
    from dataset import collate_asr_batch

    items = [dataset[i] for i in batch_indices]
    good = [i for i, item in zip(batch_indices, items) if item is not None]
    bad = {i: None for i, item in zip(batch_indices, items) if item is None}
    out.texts.update(bad)
    if languages is not None:
        out.given_texts.update(bad)
    if not good:
        return
    batch = collate_asr_batch([item for item in items if item is not None]).on_device(device)
    with autocast() if autocast is not None else contextlib.nullcontext():
        decoded = decoding.decode_batch(
            model,
            batch.signal,
            batch.signal_len,
            auto=auto,
            languages=None if languages is None else [languages(i) for i in good],
            first_tokens=with_first_tokens,
            loss_batch=batch if with_loss else None,
        )
    if decoded.loss is not None and math.isfinite(decoded.loss):
        out.loss_sum += decoded.loss * len(good)
        out.loss_utterances += len(good)
    if decoded.first_tokens is not None:
        out.first_tokens.update(zip(good, decoded.first_tokens))
    if decoded.texts is not None:
        out.texts.update(zip(good, decoded.texts))
    if decoded.given_texts is not None:
        out.given_texts.update(zip(good, decoded.given_texts))


def greedy_transcribe(
    model, dataset, indices: Sequence[int], **kwargs: Any
) -> dict[int, str | None]:
    """``decode(...).texts``: {index: greedy text, or None for bad audio}."""
    return decode(model, dataset, indices, **kwargs).texts


def rank_share(
    indices: Sequence[int], durations: np.ndarray, rank: int, world_size: int
) -> list[int]:
    """This rank's part of ``indices``: every world_size-th by duration, so each rank gets a similar
    amount of audio (longest and shortest spread evenly)."""
    by_duration = sorted((int(i) for i in indices), key=lambda i: float(durations[i]))
    return by_duration[rank :: max(1, world_size)]


def examples_by_language(
    langs: Sequence[str], references: Sequence[str], hypotheses: Sequence[str], per_lang: int
) -> list[list[str]]:
    """Up to ``per_lang`` rows [lang, reference, hypothesis] per language, tags stripped, in order."""
    rows: list[list[str]] = []
    seen: dict[str, int] = {}
    for lang, ref, hyp in zip(langs, references, hypotheses):
        if seen.get(lang, 0) < per_lang:
            seen[lang] = seen.get(lang, 0) + 1
            rows.append([lang, strip_lang_tag(ref), strip_lang_tag(hyp)])
    return rows


def manifest_texts(dataset) -> list[str]:
    """The manifest's ``text`` of every dataset item (tag included), via ``dataset.manifest_rows``."""
    import pyarrow.parquet as pq

    texts = pq.read_table(dataset.manifest_path, columns=["text"]).column("text").to_pylist()
    return [texts[int(r)] for r in dataset.manifest_rows]


def base_and_final_rates(base: dict | None, final: dict | None) -> dict[str, tuple]:
    """{language: (base WER, final WER, base CER, final CER)} of two validations (``last_evaluation``
    dicts), for the languages both scored; {} when either is missing or both are the same step."""
    if not base or not final or base.get("step") == final.get("step"):
        return {}

    def rates(counts: dict) -> tuple[float | None, float | None]:
        words, chars = counts.get("words", 0), counts.get("chars", 0)
        return (
            counts.get("word_edits", 0) / words if words else None,
            counts.get("char_edits", 0) / chars if chars else None,
        )

    out = {}
    for lang, counts in (final.get("results") or {}).items():
        if lang in (base.get("results") or {}):
            (bw, bc), (fw, fc) = rates(base["results"][lang]), rates(counts)
            out[lang] = (bw, fw, bc, fc)
    return out


def _word_error_rate(counts: dict | None) -> float | None:
    """The WER of one language's counts as a validation record holds them, None without words."""
    if not counts or not counts.get("words"):
        return None
    return counts.get("word_edits", 0) / counts["words"]


def forgetting(
    base: dict | None, now: dict | None, base_languages: Sequence[str] | None
) -> dict[str, dict[str, float | None]]:
    """How far each of the base's languages has moved from the step-0 validation: {language:
    {"base", "now": auto WER; "points": 100 x (now - base); and with the language given where
    both validations decoded it, "base_given", "now_given", "points_given" (else None)}}, for the
    base languages both validations scored ("all" is no language). {} when the base's languages
    are unknown or there is no step-0 validation. Positive points: the language got worse."""
    if not base or not now or not base_languages or base.get("step") != 0:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for lang in base_languages:
        before = _word_error_rate((base.get("results") or {}).get(lang))
        after = _word_error_rate((now.get("results") or {}).get(lang))
        if before is None or after is None:
            continue
        before_given = _word_error_rate((base.get("results_given") or {}).get(lang))
        after_given = _word_error_rate((now.get("results_given") or {}).get(lang))
        given = before_given is not None and after_given is not None
        out[lang] = {
            "base": before,
            "now": after,
            "points": 100 * (after - before),
            "base_given": before_given if given else None,
            "now_given": after_given if given else None,
            "points_given": 100 * (after_given - before_given) if given else None,
        }
    return out


EXCLUSION_REASONS = {
    "infeasible_tokens_gt_frames": "more tokens than encoder frames",
    "bad_duration": "no valid duration",
}


def forgetting_warnings(step: int, forgetting: dict[str, dict[str, float | None]]) -> list[str]:
    """One warning line per base language whose auto WER rose more than FORGETTING_WARN_POINTS
    above its step-0 validation (``forgetting``), with the numbers and what to do. A language
    whose WER was already at or above 1.0 at step 0 gets none: the base knew nothing of it to
    forget."""
    limit = float(config.FORGETTING_WARN_POINTS)
    if limit <= 0:
        return []
    lines = []
    for lang, row in forgetting.items():
        if row["points"] is None or row["points"] <= limit or row["base"] >= 1.0:
            continue
        given = (
            f"; with the language given {100 * row['base_given']:.1f} -> "
            f"{100 * row['now_given']:.1f}"
            if row.get("points_given") is not None
            else ""
        )
        lines.append(
            f"step {step}: the base language {lang} is being forgotten: its WER rose "
            f"{row['points']:.1f} points above step 0's ({100 * row['base']:.1f} -> "
            f"{100 * row['now']:.1f}{given}; FORGETTING_WARN_POINTS={limit:g}). Keep more of it: "
            "raise BASE_LANGUAGE_SHARE (the replay share), lower ENCODER_LR_SCALE or PHASE2_LR, or "
            "blend with the base at export (scripts/export_nemo.py --blend-sweep); "
            'docs/training.md, "Forgetting"'
        )
    return lines


def excluded_rows(dataset) -> dict[str, dict[str, tuple[int, list[str]]]]:
    """{language: {reason: (rows, the first few segment_ids)}} of the manifest rows a
    ``LocalShardDataset`` left out (it cannot score them: see ``EXCLUSION_REASONS``); {} for a
    dataset that leaves none out. Ids come from the training cache's listed rows; a cache that
    lists none gives counts alone."""
    summary = getattr(dataset, "load_summary", None) or {}
    counts = summary.get("dropped_by_lang") or {}
    if not counts:
        return {}
    listed = summary.get("dropped_rows_by_lang") or {}
    rows = sorted({r for by in listed.values() for rs in by.values() for r in rs})
    ids: dict[int, str] = {}
    if rows:
        import pyarrow.parquet as pq

        # On the calling thread alone: DataLoader workers fork from this process later, and a fork
        # must not inherit Arrow's thread pools mid-work.
        column = (
            pq.ParquetFile(dataset.manifest_path, pre_buffer=False)
            .read(columns=["segment_id"], use_threads=False)
            .column(0)
        )
        ids = {r: str(column[r].as_py()) for r in rows if r < len(column)}
    return {
        lang: {
            reason: (n, [ids.get(r, f"row {r}") for r in listed.get(lang, {}).get(reason, [])])
            for reason, n in by_reason.items()
        }
        for lang, by_reason in sorted(counts.items())
    }


def describe_excluded(excluded: dict[str, dict[str, tuple[int, list[str]]]]) -> str:
    """One line: per language, how many rows were left out, why, and the first ids."""
    parts = []
    for lang, by_reason in excluded.items():
        for reason, (n, ids) in by_reason.items():
            named = f": {', '.join(ids)}{', ...' if n > len(ids) else ''}" if ids else ""
            parts.append(f"{lang} {n} ({EXCLUSION_REASONS.get(reason, reason)}{named})")
    return "; ".join(parts)
