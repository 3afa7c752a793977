"""Per-language WER and CER of a trained model on a manifest (greedy decoding): a table and a CSV.

Usage:
    python scripts/evaluate.py data/checkpoints/step_00600000.nemo
    python scripts/evaluate.py data/checkpoints/step_00005000.ckpt --manifest data/val_manifest_v2.parquet
    python scripts/evaluate.py model.nemo --per-lang 200 --device cuda --out results/wer.csv
    python scripts/evaluate.py last                     # the newest step checkpoint in CHECKPOINT_DIR
    python scripts/evaluate.py model.nemo --manifest test.json --lang hi   # a NeMo JSON manifest
    python scripts/evaluate.py model.nemo --decode auto   # only as the model guesses the language
    python scripts/evaluate.py model.nemo --hyps hyps.jsonl   # and every utterance's hypotheses

Rates are corpus-level per language: total word edits / total reference words (not a mean of
per-utterance WERs), CER likewise over characters (single spaces between words included). The row
``all`` pools every utterance. Hypothesis and reference are compared after one normalization
(``evaluation.normalize_for_scoring``, the one validation uses; the output states it): the plain
training targets' cleaning (NFC, tags removed, punctuation, symbols, dandas and quotes to spaces,
whitespace collapsed) and lower case. So a perfect transcript scores 0 on a raw NeMo JSON manifest
(punctuation, capitals, dandas as written) as on an imported parquet one, and a model that writes
punctuation and case is scored on its words. ``raw_wer`` / ``raw_cer`` (CSV, and ``raw WER`` in the
table) score the texts as written instead (tags stripped only): punctuation and case count there.

A ``.nemo`` file is restored as is. A ``.ckpt`` (train.py's step checkpoint) rebuilds its model from
the description it carries (older checkpoints: the way train.py builds it, from INIT_MODEL or
MODEL_CONFIG and TOKENIZER_DIR), then its weights are loaded. Audio is loaded and padded by the
training pipeline's own loading and collate; decoding is the model's greedy decoding.

The manifest is a parquet manifest of this pipeline, or a NeMo JSON manifest (one object per line:
``audio_filepath`` (relative paths resolved against the manifest's directory), ``duration``,
``text``, and optionally ``lang``; rows without ``lang`` count as ``--lang``, default ``und``).

The CSV (default: ``<model stem>.<manifest stem>.wer.csv`` beside the model) has one row per
language plus ``all``: lang, utterances, words, word_edits (= substitutions + deletions +
insertions, also given), wer, chars, char_edits, cer, bad_audio, excluded (rows of a parquet
manifest left out unscored: more tokens than encoder frames, or no valid duration; the first ids are
printed below the table), raw_wer, raw_cer (the same utterances scored as written), punct_f1 and
case_err (how the marks ending each word and the case of correctly recognized words come out against
the references as written: ``punctuation_scoring``, as a punctuated run's validation reports them;
nan where they cannot mean anything: punct_f1 when neither side writes a sentence mark, case_err
when neither writes a capital letter or the language has no cased words) and lid_acc (language
identification: the share of the language's hypotheses that start with its own tag, as validation's
``val/lid_acc/<lang>``; nan for rows of unknown language, ``und``, which ``all`` leaves out; ``LID``
in the table).
The table shows each kind of word edit per reference word (sub + del + ins = WER).

Every utterance is decoded twice from one encoder forward (``--decode both``, the default): auto,
the model naming the language (``wer``, ``cer``: what a user who does not know the language gets),
and with the language given, decoding started from the row's language tag (``wer_given``,
``cer_given``; ``WER given`` in the table): the gap between the two is what wrong language guesses
cost. Rows of unknown language (``und``) are decoded auto in both. ``--decode auto`` or ``given``
decodes once; the other pair of columns is then empty.

``--hyps FILE`` writes every utterance scored (bad audio too) as one JSON line, in manifest order, for reading the
errors one by one: ``id`` (a parquet row's segment_id; a NeMo JSON row's audio path), ``lang``,
``reference`` (as the manifest writes it), ``hypothesis`` (auto, its language tag first) and
``hypothesis_given`` (each as decoded; null for bad audio), ``words`` (the reference's, normalized
as scored) and ``word_errors`` / ``word_errors_given`` (the word edits each hypothesis costs: summed
over a language and divided by its words, they are its WER), ``bad_audio``. Written atomically.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import sys
from pathlib import Path

import config
from manifest_schema import UNKNOWN_LANG
from process_control import UserError

log = logging.getLogger("evaluate")

CSV_COLUMNS = (
    "lang",
    "utterances",
    "words",
    "word_edits",
    "substitutions",
    "deletions",
    "insertions",
    "wer",
    "chars",
    "char_edits",
    "cer",
    "bad_audio",
    "excluded",
    "raw_wer",
    "raw_cer",
    "punct_f1",
    "case_err",
    "lid_acc",
    "wer_given",
    "cer_given",
)


class NothingToScore(UserError):
    """The manifest has no utterance the model can be scored on (empty, or all of its audio bad)."""


def scoring_set(manifest: Path, tokenizer, *, lang: str | None = None, progress: bool = True):
    """(dataset, reference text per item, language per item, a note on what was read) of a parquet
    manifest (through the training cache) or a NeMo JSON manifest (its audio files as listed; the
    language is each row's ``lang``, else ``lang``, else "und")."""
    import evaluation
    from dataset import AudioFileDataset, LocalShardDataset
    from manifest_schema import ManifestError, is_nemo_json, read_nemo_manifest

    if not is_nemo_json(manifest):
        dataset = LocalShardDataset(manifest, tokenizer, progress=progress)
        names, codes = dataset.lang_names, dataset.lang_codes
        note = (
            f"{dataset.load_summary['dropped']} dropped as unusable of "
            f"{dataset.load_summary['rows_read']} rows"
        )
        return dataset, evaluation.manifest_texts(dataset), [names[c] for c in codes], note
    rows = read_nemo_manifest(manifest)
    untranscribed = [i for i, r in enumerate(rows) if r.text is None]
    if untranscribed:
        raise ManifestError(
            f"{manifest}: {len(untranscribed)} row(s) without a text (first: row "
            f"{untranscribed[0] + 1}); scoring needs a reference for every row "
            f"(scripts/transcribe.py transcribes audio without one)"
        )
    durations = [r.duration for r in rows]
    dataset = AudioFileDataset(
        [r.audio_filepath for r in rows],
        durations=None if any(d is None for d in durations) else durations,
        langs=[r.lang or lang or UNKNOWN_LANG for r in rows],
    )
    return dataset, [r.text for r in rows], dataset.langs, f"{len(rows)} rows read"


def evaluate(
    model,
    manifest: Path,
    *,
    per_lang: int = 0,
    batch_seconds: float = 120.0,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = True,
    lang: str | None = None,
    decode: str = "both",
    hyps_path: Path | None = None,
) -> tuple[dict, dict[str, int], dict, dict, dict, dict, dict]:
    """(ErrorCounts per language + 'all', bad-audio count per language, the rows left out unscored:
    ``evaluation.excluded_rows``, ErrorCounts of the texts as written, (punctuation F1, case error
    rate) per language + 'all' (``score``), language-identification accuracy per known language +
    'all', ErrorCounts per language + 'all' decoded with the language given) of ``model`` on
    ``manifest`` (parquet, or NeMo JSON: see ``scoring_set``; scored by ``score``). ``decode``:
    "both" decodes auto and with the language given, "auto" or "given" only that one (the first five
    then describe it, the last is {} for "auto"; with "given", the language-identification accuracy
    is {}). With ``hyps_path``, every decoded utterance is written there too (``write_hypotheses``)."""
    import numpy as np

    import evaluation

    dataset, texts, langs, note = scoring_set(
        manifest, model.tokenizer, lang=lang, progress=progress
    )
    names = sorted(set(langs))
    codes = np.array([names.index(x) for x in langs], dtype=np.int64)
    indices = (
        evaluation.select_eval_indices(codes, per_lang, seed=seed)
        if per_lang > 0
        else np.arange(len(dataset))
    )
    if decode not in ("both", "auto", "given"):
        raise ValueError(f"decode={decode!r}: expected both, auto or given")
    given = decode in ("both", "given")
    if given:
        import vocabulary

        vocabulary.language_tag_pieces(model, names)  # UNKNOWN_LANG decodes auto
    out = evaluation.decode(
        model,
        dataset,
        indices,
        max_batch_seconds=batch_seconds,
        device=device,
        progress=progress,
        auto=decode != "given",
        languages=langs.__getitem__ if given else None,
    )
    hyps = out.texts if decode != "given" else out.given_texts
    decoded = sum(h is not None for h in hyps.values())
    if not decoded:
        raise NothingToScore(
            f"no utterance of {manifest} could be scored: {len(indices)} selected, "
            f"{len(indices) - decoded} of them bad audio ({note}); check the manifest and that "
            f"its audio exists (DATA_DIR / SHARDS_DIR, scripts/extract_audio.py)"
        )
    if hyps_path is not None:
        write_hypotheses(
            hypothesis_rows(
                utterance_ids(dataset),
                texts,
                langs,
                indices,
                out.texts if decode != "given" else None,
                out.given_texts if given else None,
            ),
            hyps_path,
        )
    results, as_written, bad, punctuation, lid = score(texts, hyps, langs)
    if decode == "given":
        return results, bad, evaluation.excluded_rows(dataset), as_written, punctuation, {}, results
    results_given = score(texts, out.given_texts, langs)[0] if given else {}
    excluded = evaluation.excluded_rows(dataset)
    return results, bad, excluded, as_written, punctuation, lid, results_given


def utterance_ids(dataset) -> list[str]:
    """What names each item of ``scoring_set``'s dataset in the hypotheses file: a parquet
    manifest's ``segment_id`` (its ``audio_filepath`` where the id is empty), a NeMo JSON row's
    audio path (as resolved: absolute)."""
    paths = getattr(dataset, "paths", None)
    if paths is not None:
        return [str(p) for p in paths]
    import pyarrow.parquet as pq

    names = pq.read_schema(dataset.manifest_path).names
    columns = [c for c in ("segment_id", "audio_filepath") if c in names]
    table = pq.read_table(dataset.manifest_path, columns=columns)
    ids = table.column("segment_id").to_pylist() if "segment_id" in names else [None] * len(table)
    paths = (
        table.column("audio_filepath").to_pylist()
        if "audio_filepath" in names
        else [None] * len(ids)
    )
    out = []
    for row in dataset.manifest_rows:
        name = ids[int(row)] or paths[int(row)]
        out.append(str(name) if name else f"row {int(row)}")
    return out


def hypothesis_rows(
    ids: list[str],
    texts: list[str],
    langs: list[str],
    indices,
    auto: dict[int, str | None] | None,
    given: dict[int, str | None] | None,
) -> list[dict]:
    """One dict per utterance of ``indices`` (in their order): ``id``, ``lang``, ``reference`` (as
    the manifest writes it), ``hypothesis`` (decoded auto, its language tag first, when ``auto``)
    and ``hypothesis_given`` (from the language's tag, when ``given``): None for bad audio, which
    ``bad_audio`` marks. ``words``: the reference's words, and ``word_errors`` /
    ``word_errors_given``: the word edits of each hypothesis, both after
    ``evaluation.normalize_for_scoring`` as the WER counts them (None for bad audio)."""
    import evaluation

    indices = [int(i) for i in indices]
    decodings = {"": auto, "_given": given}
    refs = evaluation.normalize_for_scoring([texts[i] for i in indices])
    normalized = {
        suffix: evaluation.normalize_for_scoring(
            ["" if hyps.get(i) is None else hyps[i] for i in indices]
        )
        for suffix, hyps in decodings.items()
        if hyps is not None
    }
    rows = []
    for k, i in enumerate(indices):
        row = {"id": ids[i], "lang": langs[i], "reference": texts[i]}
        bad = False
        for suffix, hyps in decodings.items():
            if hyps is None:
                continue
            row[f"hypothesis{suffix}"] = hyps.get(i)
            bad = bad or hyps.get(i) is None
        row["words"] = len(refs[k].split())
        for suffix in normalized:
            counts = evaluation.ErrorCounts()
            if not bad:
                counts.add(refs[k], normalized[suffix][k])
            row[f"word_errors{suffix}"] = None if bad else counts.word_edits
        row["bad_audio"] = bad
        rows.append(row)
    return rows


def write_hypotheses(rows: list[dict], path: Path) -> None:
    """``rows`` as JSON lines (UTF-8, unescaped), written atomically."""
    import json

    from atomic_files import atomic_write

    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def score(
    texts: list[str], hypotheses: dict[int, str | None], langs: list[str]
) -> tuple[dict, dict, dict[str, int], dict, dict]:
    """(ErrorCounts per language + 'all' after ``evaluation.normalize_for_scoring``, the same as
    written, bad-audio count per language + 'all', (punctuation F1, case error rate) per language
    + 'all' (``punctuation_scoring.punctuation_case_scores``: nan where they cannot mean anything),
    ``evaluation.language_id_accuracy`` of the utterances of a known language) of ``hypotheses``
    ({index: text, or None for bad audio}) against the references ``texts`` (``scoring_set``'s,
    by index)."""
    import evaluation
    from punctuation_scoring import punctuation_case_scores

    done = [i for i in sorted(hypotheses) if hypotheses[i] is not None]
    bad: dict[str, int] = {}
    for i in sorted(hypotheses):
        if hypotheses[i] is None:
            bad[langs[i]] = bad.get(langs[i], 0) + 1
    bad["all"] = sum(bad.values())
    refs, hyps, of = (
        [texts[i] for i in done],
        [hypotheses[i] for i in done],
        [langs[i] for i in done],
    )
    known = [k for k, lang in enumerate(of) if lang != UNKNOWN_LANG]
    confusion = evaluation.language_confusion([of[k] for k in known], [hyps[k] for k in known])
    return (
        evaluation.corpus_error_rates(refs, hyps, of),
        evaluation.corpus_error_rates(refs, hyps, of, as_written=True),
        bad,
        {
            lang: (counts.f1, counts.case_error_rate)
            for lang, counts in punctuation_case_scores(refs, hyps, of).items()
        },
        evaluation.language_id_accuracy(confusion) if known else {},
    )


def result_rows(
    results: dict,
    bad: dict[str, int],
    excluded: dict | None = None,
    as_written: dict | None = None,
    punctuation: dict | None = None,
    lid: dict | None = None,
    given: dict | None = None,
) -> list[dict]:
    """The CSV's rows, one per language of ``results`` (raw_wer / raw_cer from ``as_written``,
    punct_f1 / case_err from ``punctuation``: (F1, case error rate) per language, lid_acc from
    ``lid``, wer_given / cer_given from ``given``)."""
    as_written, punctuation, lid, given = (
        as_written or {},
        punctuation or {},
        lid or {},
        given or {},
    )
    left_out = {
        lang: sum(n for n, _ in by_reason.values()) for lang, by_reason in (excluded or {}).items()
    }
    left_out["all"] = sum(left_out.values())
    return [
        {
            "lang": lang,
            "utterances": c.utterances,
            "words": c.words,
            "word_edits": c.word_edits,
            "substitutions": c.substitutions,
            "deletions": c.deletions,
            "insertions": c.insertions,
            "wer": round(c.wer, 6),
            "chars": c.chars,
            "char_edits": c.char_edits,
            "cer": round(c.cer, 6),
            "bad_audio": bad.get(lang, 0),
            "excluded": left_out.get(lang, 0),
            "raw_wer": round(as_written[lang].wer, 6) if lang in as_written else math.nan,
            "raw_cer": round(as_written[lang].cer, 6) if lang in as_written else math.nan,
            "punct_f1": round(punctuation[lang][0], 6) if lang in punctuation else math.nan,
            "case_err": round(punctuation[lang][1], 6) if lang in punctuation else math.nan,
            "lid_acc": round(lid[lang], 6) if lang in lid else math.nan,
            "wer_given": round(given[lang].wer, 6) if lang in given else math.nan,
            "cer_given": round(given[lang].cer, 6) if lang in given else math.nan,
        }
        for lang, c in results.items()
    ]


def punctuation_line(rows: list[dict]) -> str:
    """The printed line of punctuation F1 / case errors per language ('-' where the number means
    nothing: no sentence mark, or no capital letter, on either side)."""

    def shown(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.3f}"

    if all(math.isnan(r["punct_f1"]) and math.isnan(r["case_err"]) for r in rows):
        return (
            "punctuation F1 / case errors: not scored (neither the references nor the hypotheses "
            "write a sentence mark or a capital letter)"
        )
    return "punctuation F1 / case errors, against the references' marks and case: " + ", ".join(
        f"{r['lang']} {shown(r['punct_f1'])} / {shown(r['case_err'])}" for r in rows
    )


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'lang':<8} {'utts':>7} {'words':>9} {'WER':>8} {'sub':>7} {'del':>7} {'ins':>7} "
        f"{'CER':>8} {'bad':>5} {'excl':>5} {'raw WER':>8} {'LID':>6} {'WER given':>9}"
    ]
    for r in rows:
        shares = [
            r[k] / r["words"] if r["words"] else math.nan
            for k in ("substitutions", "deletions", "insertions")
        ]
        lines.append(
            f"{r['lang']:<8} {r['utterances']:>7} {r['words']:>9} {r['wer']:>8.4f} "
            + " ".join(f"{v:>7.4f}" for v in shares)
            + f" {r['cer']:>8.4f} {r['bad_audio']:>5} {r.get('excluded', 0):>5}"
            + f" {r.get('raw_wer', math.nan):>8.4f} {r.get('lid_acc', math.nan):>6.3f}"
            + f" {r.get('wer_given', math.nan):>9.4f}"
        )
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    from atomic_files import atomic_write

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    atomic_write(path, write)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=config.help_epilog("evaluate"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        help="a .nemo file, a train.py step checkpoint (.ckpt), 'last' (the newest in "
        "CHECKPOINT_DIR) or 'best' (the lowest validation WER)",
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="manifest to evaluate on: parquet, or NeMo JSON (.json/.jsonl: audio_filepath, duration, "
        f"text, optional lang) (default VAL_MANIFEST_PATH={config.VAL_MANIFEST_PATH})",
    )
    parser.add_argument(
        "--lang",
        default=None,
        help="the language of NeMo JSON rows without a 'lang' (default: und, scored under 'und')",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="CSV path (default <model stem>.<manifest stem>.wer.csv beside the model)",
    )
    parser.add_argument(
        "--per-lang",
        type=int,
        default=0,
        help="at most this many utterances per language, a seeded choice (default 0 = all)",
    )
    parser.add_argument(
        "--batch-seconds", type=float, default=120.0, help="seconds of audio per decoding batch"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default cuda when available)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --per-lang choice")
    parser.add_argument(
        "--hyps",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write one JSON line per utterance to FILE: id (a NeMo JSON row: its audio "
        "path), lang, reference, hypothesis (auto) and hypothesis_given, words and word_errors "
        "(word_errors_given) as the WER counts them, bad_audio",
    )
    parser.add_argument(
        "--decode",
        choices=("both", "auto", "given"),
        default="both",
        help="auto: the model names the language; given: decoding starts from each row's "
        "language tag; both (default): both, from one encoder forward",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import torch

    import asr_model
    import checkpoints
    import vocabulary

    model_path = checkpoints.resolve_model_path(args.model)
    manifest = Path(args.manifest or config.VAL_MANIFEST_PATH)
    if not manifest.is_file():
        raise FileNotFoundError(
            f"manifest {manifest} does not exist (--manifest or VAL_MANIFEST_PATH)"
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or model_path.with_name(f"{model_path.stem}.{manifest.stem}.wer.csv")

    try:
        model = asr_model.load_trained_model(model_path, device)
        results, bad, excluded, as_written, punctuation, lid, given = evaluate(
            model,
            manifest,
            per_lang=args.per_lang,
            batch_seconds=args.batch_seconds,
            seed=args.seed,
            device=device,
            lang=args.lang,
            decode=args.decode,
            hyps_path=args.hyps,
        )
    except UserError as exc:
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 2
    from evaluation import SCORING_NORMALIZATION

    rows = result_rows(results, bad, excluded, as_written, punctuation, lid, given)
    write_csv(rows, out)
    kept = vocabulary.kept_scripts_phrase(model, [r["lang"] for r in rows if r["lang"] != "all"])
    how = {
        "both": f"auto; WER given: from each row's language tag, {kept}",
        "auto": "auto",
        "given": f"from each row's language tag, {kept}",
    }
    print(f"{model_path} on {manifest} (greedy decoding {how[args.decode]}, corpus-level rates):")
    print(
        f"normalized before scoring: {SCORING_NORMALIZATION} (raw WER: as written, tags stripped; "
        "LID: share of hypotheses starting with the language's own tag)"
    )
    print(format_table(rows))
    print(punctuation_line(rows))
    if excluded:
        from evaluation import describe_excluded

        print(f"excluded, not scored (excl): {describe_excluded(excluded)}")
    print(f"wrote {out}" + (f" and {args.hyps} (one line per utterance)" if args.hyps else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
