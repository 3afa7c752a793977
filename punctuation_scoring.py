"""How well a punctuated model writes punctuation and case: punctuation F1 and case error rate,
per language, beside the word error rate (which evaluation.py computes on normalized text).

Where a mark belongs has one definition, the punctuated training targets' (``TRANSCRIPT_STYLE=
punctuated``, ``transcript_cleaning.clean_text``): both sides are put into that form first (tags
removed, quotes, brackets, dashes and symbols turned into spaces, each kept sentence mark,
``transcript_cleaning.SENTENCE_MARKS``, attached to the word before it; case as written), then
split into words at whitespace; a word's mark is the run of sentence marks that ends it
("raining?" is the word "raining" with the mark "?"). So ``"Stop."``, ``(really?)`` and
``«ठीक।»`` are words with their marks, and a hypothesis equal to a reference's punctuated target
scores 1.0 whatever quotes, brackets or tags the reference was written with. Reference and
hypothesis words are aligned by their lower-cased letters, marks removed (one minimal edit
alignment), so a misrecognized word costs the WER, not these scores:

- punctuation F1: a hypothesis mark is correct when the reference word it is aligned with ends in
  the same mark. precision = correct / hypothesis marks, recall = correct / reference marks, F1
  their harmonic mean (1.0 when neither side has a mark). Marks of inserted and deleted words
  count against precision and recall.
- case error rate: of the aligned words recognized correctly (equal once lower-cased) that hold a
  cased letter, the share written in another case than the reference's (Indic scripts have no
  case: their words do not count).

Usage::

    scores = punctuation_case_scores(references, hypotheses, languages)   # per language + "all"
    metrics = punctuation_metrics(scores)      # {"val/punct_f1/hi": ..., "val/case_err/hi": ...}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from transcript_cleaning import SENTENCE_MARKS

_GAP = "\x00"  # the alignment's gap symbol: no word holds it


def as_punctuated_targets(texts: Sequence[str]) -> list[str]:
    """Each text in the form of a punctuated training target (``clean_text(text, "punctuated")``):
    what the marks of references and hypotheses are read from. Vectorized (polars); where polars
    is not installed (a training node), the same rules one string at a time."""
    try:
        import polars  # noqa: F401
    except ImportError:  # a training node installed from the training-only wheelhouse
        from transcript_cleaning import clean_text_without_polars

        return [clean_text_without_polars(text, "punctuated") for text in texts]
    from transcript_cleaning import clean_texts

    return [text or "" for text in clean_texts(list(texts), "punctuated")]


def split_marks(text: str) -> list[tuple[str, str]]:
    """(word, mark) per whitespace-separated word of a text in punctuated-target form
    (``as_punctuated_targets``): ``mark`` is the run of sentence marks that ends the word ('' when
    none); a token of marks alone is a mark of the word before."""
    out: list[tuple[str, str]] = []
    for token in text.split():
        word = token.rstrip(SENTENCE_MARKS)
        mark = token[len(word) :]
        if word:
            out.append((word, mark))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + mark)
    return out


@dataclasses.dataclass
class PunctuationCounts:
    """Mark and case counts summed over utterances (rates are corpus-level)."""

    marks_correct: int = 0
    marks_hypothesis: int = 0
    marks_reference: int = 0
    cased_words: int = 0
    case_errors: int = 0
    utterances: int = 0
    capitalized: int = 0  # utterances where either side writes a capital letter

    @property
    def precision(self) -> float:
        return self.marks_correct / self.marks_hypothesis if self.marks_hypothesis else math.nan

    @property
    def recall(self) -> float:
        return self.marks_correct / self.marks_reference if self.marks_reference else math.nan

    @property
    def f1(self) -> float:
        """2 correct / (hypothesis marks + reference marks); nan when neither side writes a mark
        (there is no punctuation to score: 1.0 would read as every mark right)."""
        total = self.marks_hypothesis + self.marks_reference
        return 2 * self.marks_correct / total if total else math.nan

    @property
    def case_error_rate(self) -> float:
        """Case errors per recognized word that holds a cased letter; nan where neither side
        writes a capital (plain lower-case text has no case to get wrong) or no such word."""
        if not self.capitalized or not self.cased_words:
            return math.nan
        return self.case_errors / self.cased_words

    def add(self, reference: str, hypothesis: str) -> None:
        """Count one utterance of texts already in punctuated-target form
        (``as_punctuated_targets``; ``punctuation_case_scores`` puts them there)."""
        from kaldialign import align  # C++ alignment; NeMo's ASR extra installs it

        self.capitalized += any(c != c.lower() for c in reference + hypothesis)
        ref, hyp = split_marks(reference), split_marks(hypothesis)
        ref_iter, hyp_iter = iter(ref), iter(hyp)
        for r_key, h_key in align([w.lower() for w, _ in ref], [w.lower() for w, _ in hyp], _GAP):
            r_word, r_mark = next(ref_iter) if r_key != _GAP else ("", "")
            h_word, h_mark = next(hyp_iter) if h_key != _GAP else ("", "")
            self.marks_reference += bool(r_mark)
            self.marks_hypothesis += bool(h_mark)
            self.marks_correct += bool(r_mark) and r_mark == h_mark
            if r_key == h_key and r_key != r_key.upper():  # recognized, holds a cased letter
                self.cased_words += 1
                self.case_errors += r_word != h_word
        self.utterances += 1


def punctuation_case_scores(
    references: Sequence[str], hypotheses: Sequence[str], languages: Sequence[str]
) -> dict[str, PunctuationCounts]:
    """PunctuationCounts per language plus "all" (every utterance), of both sides in
    punctuated-target form (``as_punctuated_targets``: tags, quotes and brackets removed)."""
    if not len(references) == len(hypotheses) == len(languages):
        raise ValueError(
            f"punctuation_case_scores: {len(references)} references, {len(hypotheses)} "
            f"hypotheses and {len(languages)} languages; expected one of each per utterance"
        )
    references, hypotheses = as_punctuated_targets(references), as_punctuated_targets(hypotheses)
    counts: dict[str, PunctuationCounts] = {}
    total = PunctuationCounts()
    for ref, hyp, lang in zip(references, hypotheses, languages):
        counts.setdefault(lang, PunctuationCounts()).add(ref, hyp)
        total.add(ref, hyp)
    counts = dict(sorted(counts.items()))
    counts["all"] = total
    return counts


def punctuation_metrics(scores: dict[str, PunctuationCounts]) -> dict[str, float]:
    """``val/punct_f1/<lang>`` and ``val/case_err/<lang>`` of ``punctuation_case_scores``, each
    only where it means something (a mark on either side; a capital on either side and a cased
    word): a score that cannot be wrong is not shown."""
    out: dict[str, float] = {}
    for lang, counts in scores.items():
        for name, value in (("punct_f1", counts.f1), ("case_err", counts.case_error_rate)):
            if not math.isnan(value):
                out[f"val/{name}/{lang}"] = value
    return out
