"""Transcribe audio files with a trained model: the language it heard and the text, as JSONL.

Usage:
    python scripts/transcribe.py model.nemo a.flac b.wav              # prints lang + text per file
    python scripts/transcribe.py last --manifest test.json --out hyps.jsonl
    python scripts/transcribe.py model.nemo --lang hi call1.wav call2.wav  # the language known
    python scripts/transcribe.py step_00600000.ckpt --manifest data/val_manifest_v2.parquet

The model is a .nemo file, a train.py step checkpoint (.ckpt, rebuilt from the description it
carries), 'last' (the newest step checkpoint in CHECKPOINT_DIR) or 'best' (the one with the lowest
validation WER). Inputs are audio files (any format
libsndfile reads; resampled to the model's rate, downmixed to mono) or a manifest: NeMo JSON
(``audio_filepath`` per line) or this pipeline's parquet (the extracted FLAC of each row).

The model writes ``<|lang|>`` first: each output row holds that language (``lang``; null when the
hypothesis starts with no tag), how sure the model was of it (``lang_prob``: the softmax probability
of that tag at the decoding step that emitted it, over every piece and blank; null without a tag)
and the text without it. With the language known, ``--lang hi`` decodes every file from the tag
``<|hi|>`` (the model writes Hindi from its first piece on, and cannot take the audio for another
language; after the tag it writes only pieces of the scripts the model records for Hindi, as
LANGUAGE_GIVEN_SCRIPTS=1 says), and ``--lang manifest`` takes each row's language from the manifest
(its ``lang``, or the tag its ``text`` starts with; a row without one, or of undetermined
language ``und``, is decoded auto, as evaluate.py does); stderr says how the given languages were
decoded. ``lang_given`` says which: true where the language was given (``lang`` is then that
language and ``lang_prob`` null). Files are decoded longest-first in batches of
``--batch-seconds`` of audio, on the GPU when there is one. An unreadable file gets a row with
``"error"`` instead of a text and is named on stderr; the exit status is 1 when any file failed.

Output: JSONL to ``--out`` (written whole under a temporary name, then renamed) or to stdout; without
``--out``, stdout shows ``lang<TAB>text<TAB>file`` lines instead when it is a terminal. Stdout carries
nothing else: whatever NeMo, Lightning or any library prints while the model loads and decodes (to
Python's stdout or to file descriptor 1) goes to stderr, so ``transcribe.py m.nemo a.wav > out.jsonl``
is valid JSONL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from process_control import UserError

FROM_MANIFEST = "manifest"


def inputs_of(
    files: list[Path], manifest: Path | None, lang: str | None = None
) -> tuple[list[str], list[str | None] | None]:
    """The audio paths to transcribe (the files given, or the manifest's) and the language to
    decode each with: None for all without ``lang``; ``lang`` for every file; with
    ``lang="manifest"``, each manifest row's ``lang`` or the tag its ``text`` starts with (None
    for a row with neither; decoding takes None and ``UNKNOWN_LANG`` alike: auto)."""
    from manifest_schema import (
        AUDIO_COLUMN,
        ManifestError,
        audio_columns,
        audio_dirs_and_names,
        is_nemo_json,
        leading_lang,
        read_nemo_manifest,
    )

    if lang == FROM_MANIFEST and manifest is None:
        raise ManifestError("--lang manifest takes each row's language from --manifest; give one")
    if manifest is None:
        if not files:
            raise ManifestError("give audio files or --manifest")
        return [str(f) for f in files], None if lang is None else [lang] * len(files)
    if files:
        raise ManifestError("give audio files or --manifest, not both")
    if not manifest.is_file():
        raise ManifestError(f"--manifest {manifest} does not exist")
    if is_nemo_json(manifest):
        rows = read_nemo_manifest(manifest)
        paths = [r.audio_filepath for r in rows]
        langs = [r.lang or leading_lang(r.text or "") for r in rows]
    else:
        # pyarrow, which training needs too: a GPU node's training-only install has no polars
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(manifest).names
        except (OSError, pa.ArrowException) as exc:
            raise ManifestError(
                f"--manifest {manifest}: not NeMo JSON nor parquet ({exc})"
            ) from None
        where = audio_columns(names)
        columns = where + [c for c in ("lang", "text") if c in names]
        table = pq.read_table(manifest, columns=list(dict.fromkeys(columns)))
        if where == [AUDIO_COLUMN]:
            paths = table.column(AUDIO_COLUMN).to_pylist()
        else:
            dirs, files = audio_dirs_and_names({c: table.column(c).combine_chunks() for c in where})
            paths = [
                f"{d}/{f}" for d, f in zip(dirs.cast(pa.string()).to_pylist(), files.to_pylist())
            ]
        if "lang" in names:
            langs = table.column("lang").to_pylist()
        elif "text" in names:
            langs = [leading_lang(t or "") for t in table.column("text").to_pylist()]
        else:
            langs = [None] * len(paths)
    if lang is None:
        return paths, None
    if lang != FROM_MANIFEST:
        return paths, [lang] * len(paths)
    return paths, [x or None for x in langs]


@contextlib.contextmanager
def stdout_kept_for_results():
    """Inside: everything written to stdout, by Python code or by C code on file descriptor 1,
    goes to stderr. Yields a text stream on the original stdout, for the results alone."""
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", encoding="utf-8", closefd=True)
    saved_fd1, saved_stdout = os.dup(1), sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield results
    finally:
        sys.stdout.flush()
        results.flush()
        os.dup2(saved_fd1, 1)
        os.close(saved_fd1)
        sys.stdout = saved_stdout
        results.close()


def transcribe(
    model,
    paths: list[str],
    *,
    batch_seconds: float = 120.0,
    device: str = "cpu",
    languages: list[str | None] | None = None,
) -> list[dict]:
    """One row per path, in input order: {"audio_filepath", "duration", "lang", "lang_given",
    "lang_prob", "text"}, or {"audio_filepath", "error"} for a file that could not be read ("file
    not found" when it does not exist). ``languages`` (one per path, None or ``UNKNOWN_LANG`` for
    none): decode from that language's tag; ``lang_given`` is then true and ``lang`` that language. Decoded auto,
    ``lang`` is the tag the hypothesis starts with and ``lang_prob`` the probability of the first
    emitted piece when that piece is the tag of ``lang``, else null."""
    import evaluation
    from dataset import AudioFileDataset
    from manifest_schema import known_lang, lang_tag, leading_lang, strip_lang_tag

    dataset = AudioFileDataset(paths)
    decoded = evaluation.decode(
        model,
        dataset,
        range(len(dataset)),
        max_batch_seconds=batch_seconds,
        device=device,
        progress=len(paths) > 1 and sys.stderr.isatty(),
        with_first_tokens=True,
        auto=languages is None,
        languages=None if languages is None else languages.__getitem__,
    )
    texts = decoded.texts if languages is None else decoded.given_texts
    rows = []
    for i, path in enumerate(paths):
        hypothesis = texts.get(i)
        if hypothesis is None:
            error = "unreadable or empty audio" if Path(path).exists() else "file not found"
            rows.append({"audio_filepath": path, "error": error})
            continue
        given = known_lang(languages[i]) if languages is not None else None
        lang, first = leading_lang(hypothesis), decoded.first_tokens.get(i)
        tag_first = (
            not given
            and lang is not None
            and first is not None
            and model.tokenizer.ids_to_tokens([first[0]])[0] == lang_tag(lang)
        )
        rows.append(
            {
                "audio_filepath": path,
                "duration": round(float(dataset.durations[i]), 3),
                "lang": given or lang,
                "lang_given": bool(given),
                "lang_prob": round(first[1], 4) if tag_first else None,
                "text": strip_lang_tag(hypothesis),
            }
        )
    return rows


def check_languages(model, languages: list[str | None], args: argparse.Namespace) -> None:
    """LanguageNotInModel, before any decoding, for a language the model has no tag for, naming
    where it came from (the manifest's row, or --lang)."""
    import vocabulary
    from manifest_schema import known_lang

    first_row: dict[str, int] = {}
    for row, lang in enumerate(languages, 1):
        if known_lang(lang):
            first_row.setdefault(lang, row)
    for lang, row in first_row.items():
        try:
            vocabulary.language_tag_pieces(model, [lang])
        except vocabulary.LanguageNotInModel as exc:
            where = f"{args.manifest} row {row}" if args.lang == FROM_MANIFEST else "--lang"
            raise vocabulary.LanguageNotInModel(f"{where}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    import config

    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=config.help_epilog("transcribe"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        help="a .nemo file, a train.py step checkpoint (.ckpt), 'last' (the newest in "
        "CHECKPOINT_DIR) or 'best' (the lowest validation WER)",
    )
    parser.add_argument("files", nargs="*", type=Path, help="audio files to transcribe")
    parser.add_argument(
        "--manifest", type=Path, default=None, help="NeMo JSON or parquet manifest of audio"
    )
    parser.add_argument(
        "--lang",
        default=None,
        help="decode every file from this language's tag (e.g. hi), or 'manifest': each row's "
        "language from --manifest; default: the model names the language",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSONL path (default stdout)")
    parser.add_argument(
        "--batch-seconds", type=float, default=120.0, help="seconds of audio per decoding batch"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default cuda when available)")
    args = parser.parse_intermixed_args(argv)  # files may follow the options
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    interactive = args.out is None and sys.stdout.isatty()
    with stdout_kept_for_results() as results:
        return run(args, results, interactive)


def run(args: argparse.Namespace, results, interactive: bool) -> int:
    """Load the model, transcribe, and write the rows to ``args.out`` or ``results``."""
    import torch

    import asr_model
    import checkpoints
    import vocabulary
    from atomic_files import atomic_write
    from manifest_schema import known_lang

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        paths, languages = inputs_of(args.files, args.manifest, args.lang)
        model = asr_model.load_trained_model(checkpoints.resolve_model_path(args.model), device)
        if languages is not None:
            check_languages(model, languages, args)
            given = [lang for lang in languages if known_lang(lang)]
            if given:
                how = vocabulary.kept_scripts_phrase(model, given)
                print(f"transcribe: with the language given: its tag, {how}", file=sys.stderr)
            if len(given) < len(languages):
                print(
                    f"transcribe: {len(languages) - len(given)} of {len(languages)} file(s) of "
                    "no known language (none given, or und): decoded auto (lang_given false)",
                    file=sys.stderr,
                )
    except (UserError, FileNotFoundError, ValueError) as exc:
        print(f"transcribe: error: {exc}", file=sys.stderr)
        return 2
    rows = transcribe(
        model, paths, batch_seconds=args.batch_seconds, device=device, languages=languages
    )
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"transcribe: cannot read {r['audio_filepath']}: {r['error']}", file=sys.stderr)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if args.out is not None:
        atomic_write(args.out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        print(f"wrote {len(rows)} transcript(s) to {args.out}", file=sys.stderr)
    elif interactive:
        for r in rows:
            if "error" not in r:
                results.write(f"{r['lang'] or '?'}\t{r['text']}\t{r['audio_filepath']}\n")
    else:
        results.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
