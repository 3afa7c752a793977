"""Train the SentencePiece BPE tokenizer of the run on the train manifest's texts.

Usage:
    python scripts/train_tokenizer.py --help
    python scripts/train_tokenizer.py                         # TRAIN_MANIFEST_PATH -> TOKENIZER_DIR
    VOCAB_SIZE=4000 python scripts/train_tokenizer.py --manifest data/train_manifest_v2.parquet \\
        --output data/tokenizer_4k --sample-sentences 500000

What it guarantees:
- Every ``<|lang|>`` tag found at the start of a manifest text is a user-defined symbol: one piece,
  one id, never split (``token_to_id("<|hi|>")`` works, and so does encoding "<|hi|> text").
- SentencePiece learns from the texts WITHOUT their tag: dataset.py emits the tag id followed by
  the ids of the rest, so the tag must not shape the merges of the text.
- ``character_coverage=1.0``: rare Indic characters keep their own piece instead of ``<unk>``.
- Sentences are drawn per language with the training temperature (share ~ n_l^TEMPERATURE, n_l by
  utterance count or hours as LANG_WEIGHTING says), so small languages get vocabulary.
- The output directory is what NeMo's ``process_asr_text_tokenizer.py`` writes: tokenizer.model,
  tokenizer.vocab and vocab.txt (same rules as NeMo's ``create_spt_model``), plus summary.json.
  It is built in a temporary directory beside TOKENIZER_DIR and renamed into place, so a crash
  never leaves a half-written tokenizer.
- When the corpus cannot fill VOCAB_SIZE pieces (tiny corpora), the vocabulary is capped to what
  SentencePiece can learn and a warning says so.

Reads: TRAIN_MANIFEST_PATH, TOKENIZER_DIR, VOCAB_SIZE, TEMPERATURE, LANG_WEIGHTING, SEED (config.py).
Reports per language: the unknown-piece rate and tokens per second of audio.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import sentencepiece as spm
from tqdm import tqdm

import config
from manifest_schema import lang_tag, split_lang_tags

log = logging.getLogger("train_tokenizer")

SPECIAL_PIECES = ("<s>", "</s>", "<pad>", "<unk>")
REPORT_SENTENCES_PER_LANG = 2000


def split_tag(texts) -> tuple[np.ndarray, np.ndarray]:
    """Split "<|lang|> rest" texts (a pyarrow string array) into (langs, rests) numpy string arrays
    (``manifest_schema.split_lang_tags``).

    Raises ValueError naming the first row without a tag: the manifest builder always writes one.
    """
    langs, rests = split_lang_tags(texts)
    missing = pc.is_null(langs)
    if pc.any(missing).as_py():
        row = int(pc.index(missing, True).as_py())
        raise ValueError(
            f"manifest row {row}: text {texts[row].as_py()!r} does not start with a '<|lang|> ' tag; "
            "rebuild the manifest with build_manifest.py"
        )
    return (
        np.asarray(langs.to_numpy(zero_copy_only=False), dtype=object),
        np.asarray(rests.to_numpy(zero_copy_only=False), dtype=object),
    )


def language_shares(weights: dict[str, float], temperature: float) -> dict[str, float]:
    """pi_l ~ w_l^T, normalised; T=1 keeps natural shares, T=0 makes them uniform."""
    langs = sorted(weights)
    w = np.array([weights[lang] for lang in langs], dtype=np.float64)
    p = np.power(w, temperature)
    p /= p.sum()
    return dict(zip(langs, p.tolist()))


def sample_indices(
    tags: np.ndarray,
    weights: dict[str, float],
    temperature: float,
    total: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Row indices with about ``total * pi_l`` rows of language l (repeated when l has fewer rows)."""
    shares = language_shares(weights, temperature)
    chosen = []
    for lang, share in shares.items():
        rows = np.flatnonzero(tags == lang)
        quota = max(1, int(round(share * total)))
        chosen.append(rng.choice(rows, size=quota, replace=quota > len(rows)))
    out = np.concatenate(chosen)
    rng.shuffle(out)
    return out


def nemo_vocab_lines(vocab_file: Path, user_symbols: list[str]) -> list[str]:
    """vocab.txt lines exactly as NeMo's create_spt_model derives them from tokenizer.vocab
    (it leaves out the special pieces and the user-defined symbols)."""
    lines = []
    user_symbols_and_special = set(SPECIAL_PIECES) | set(user_symbols)
    for line in vocab_file.read_text(encoding="utf-8").splitlines():
        piece = line.split("\t")[0]
        if piece in user_symbols_and_special:
            continue
        token = piece[1:] if piece.startswith("\u2581") else f"##{piece}"
        lines.append(token if token else piece[0])
    return lines


def _train_spm(sentence_file: Path, prefix: Path, vocab_size: int, user_symbols: list[str]) -> None:
    spm.SentencePieceTrainer.train(
        input=str(sentence_file),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        user_defined_symbols=user_symbols,
        bos_id=-1,
        eos_id=-1,
        shuffle_input_sentence=True,
        input_sentence_size=0,
        remove_extra_whitespaces=False,
        train_extremely_large_corpus=False,
        minloglevel=2,
    )


class VocabularyTooSmall(ValueError):
    """VOCAB_SIZE cannot hold every character of the corpus plus the tags and special pieces."""


def train_with_cap(
    sentence_file: Path, prefix: Path, vocab_size: int, user_symbols: list[str]
) -> int:
    """Train at ``vocab_size``; if the corpus is too small for it, retry at the largest size it allows.

    SentencePiece says "Vocabulary size too high (N). Please set it to a value <= M." for BPE on a
    small corpus; we take M. Returns the vocabulary size actually trained. A size below what
    character_coverage=1.0 needs (every character, every tag, the special pieces) raises
    VocabularyTooSmall with that minimum: shrinking coverage would turn rare Indic letters into <unk>.
    """
    try:
        _train_spm(sentence_file, prefix, vocab_size, user_symbols)
        return vocab_size
    except RuntimeError as exc:
        message = str(exc)
        if "smaller than required_chars" in message:
            # "... required_chars. 256 vs 302." counts characters and tags, not <unk>/<pad> etc.
            needed = int(message.rsplit(" vs ", 1)[1].split(".")[0])
            raise VocabularyTooSmall(
                f"VOCAB_SIZE={vocab_size} is below the {needed} characters and language tags of this "
                f"corpus (every character keeps its own piece): set VOCAB_SIZE to at least {needed + 8}, "
                "and well above it for useful subwords"
            ) from None
        marker = "value <= "
        if marker not in message:
            raise
        cap = int(message.split(marker, 1)[1].split(".")[0].strip())
        log.warning(
            "VOCAB_SIZE=%d is more than this corpus can fill; training %d pieces instead "
            "(set VOCAB_SIZE <= %d to silence this)",
            vocab_size,
            cap,
            cap,
        )
        _train_spm(sentence_file, prefix, cap, user_symbols)
        return cap


def report(
    model_file: Path,
    tags: np.ndarray,
    rests: np.ndarray,
    durations: np.ndarray,
    rng: np.random.Generator,
) -> dict[str, dict[str, float]]:
    """Per language: unknown-piece rate and tokens (tag + text, as dataset.py emits) per audio second."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    unk = sp.unk_id()
    out = {}
    for lang in sorted(set(tags.tolist())):
        rows = np.flatnonzero(tags == lang)
        if len(rows) > REPORT_SENTENCES_PER_LANG:
            rows = rng.choice(rows, REPORT_SENTENCES_PER_LANG, replace=False)
        encoded = sp.encode(rests[rows].tolist())
        n_pieces = sum(len(e) for e in encoded)
        n_unk = sum(e.count(unk) for e in encoded)
        seconds = float(durations[rows].sum())
        out[lang] = {
            "sentences": int(len(rows)),
            "unk_rate": n_unk / max(n_pieces, 1),
            "tokens_per_second": (n_pieces + len(rows)) / seconds if seconds > 0 else float("nan"),
        }
    return out


def replace_dir(new: Path, target: Path) -> None:
    """Put ``new`` at ``target``: rename the old one aside, rename the new one in, then delete the old."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old)


def train_tokenizer(
    manifest_path: Path | None = None,
    output_dir: Path | None = None,
    *,
    vocab_size: int | None = None,
    temperature: float | None = None,
    lang_weighting: str | None = None,
    sample_sentences: int = 2_000_000,
    seed: int | None = None,
) -> dict:
    """Train the tokenizer and write ``output_dir`` atomically; return the summary dict."""
    manifest_path = Path(manifest_path or config.TRAIN_MANIFEST_PATH)
    output_dir = Path(output_dir or config.TOKENIZER_DIR)
    vocab_size = vocab_size or config.VOCAB_SIZE
    temperature = config.TEMPERATURE if temperature is None else temperature
    lang_weighting = lang_weighting or config.LANG_WEIGHTING
    rng = np.random.default_rng(config.SEED if seed is None else seed)
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"TRAIN_MANIFEST_PATH={manifest_path} does not exist; "
            "build it with scripts/make_train_val.py or pass --manifest"
        )

    table = pq.read_table(manifest_path, columns=["text", "duration"])
    if table.num_rows == 0:
        raise ValueError(
            f"{manifest_path}: the manifest has no rows; nothing to train a tokenizer on"
        )
    tags, rests = split_tag(table.column("text").combine_chunks())
    durations = table.column("duration").to_numpy()
    langs = sorted(set(tags.tolist()))
    if lang_weighting == "hours":
        weights = {lang: float(durations[tags == lang].sum()) for lang in langs}
    else:
        weights = {lang: float((tags == lang).sum()) for lang in langs}
    shares = language_shares(weights, temperature)
    # A corpus smaller than the sample is drawn at its own size: the temperature still reshapes it.
    chosen = sample_indices(tags, weights, temperature, min(sample_sentences, table.num_rows), rng)
    user_symbols = [lang_tag(lang) for lang in langs]

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        sentence_file = work / "sentences.txt"
        with open(sentence_file, "w", encoding="utf-8") as f:
            for start in tqdm(
                range(0, len(chosen), 100_000), desc="writing sampled sentences", unit="100k"
            ):
                f.write("\n".join(rests[chosen[start : start + 100_000]].tolist()))
                f.write("\n")
        trained_size = train_with_cap(sentence_file, work / "tokenizer", vocab_size, user_symbols)
        sentence_file.unlink()
        (work / "vocab.txt").write_text(
            "\n".join(nemo_vocab_lines(work / "tokenizer.vocab", user_symbols)) + "\n",
            encoding="utf-8",
        )
        per_lang = report(work / "tokenizer.model", tags, rests, durations, rng)
        summary = {
            "manifest": str(manifest_path),
            "rows_in": int(table.num_rows),
            "sampled_sentences": int(len(chosen)),
            "vocab_size_requested": int(vocab_size),
            "vocab_size": int(trained_size),
            "temperature": temperature,
            "lang_weighting": lang_weighting,
            "user_defined_symbols": user_symbols,
            "target_share": shares,
            "per_language": per_lang,
        }
        (work / "summary.json").write_text(
            json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8"
        )
        replace_dir(work, output_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return summary


def print_summary(summary: dict, output_dir: Path) -> None:
    print(
        f"tokenizer: {summary['vocab_size']} pieces (requested {summary['vocab_size_requested']}) "
        f"from {summary['sampled_sentences']} sampled sentences -> {output_dir}"
    )
    print(f"{'lang':<8} {'share':>7} {'unk rate':>9} {'tokens/s':>9}")
    for lang, row in summary["per_language"].items():
        print(
            f"{lang:<8} {summary['target_share'][lang]:>7.3f} {row['unk_rate']:>9.5f} "
            f"{row['tokens_per_second']:>9.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=config.help_epilog("train_tokenizer"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--manifest", type=Path, default=None, help="train manifest (default TRAIN_MANIFEST_PATH)"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="tokenizer directory (default TOKENIZER_DIR)"
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="pieces (default VOCAB_SIZE)")
    parser.add_argument(
        "--sample-sentences",
        type=int,
        default=2_000_000,
        help="sentences drawn for SentencePiece (temperature-weighted; default 2,000,000)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    output_dir = Path(args.output or config.TOKENIZER_DIR)
    try:
        summary = train_tokenizer(
            args.manifest,
            output_dir,
            vocab_size=args.vocab_size,
            sample_sentences=args.sample_sentences,
        )
    except VocabularyTooSmall as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary, output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
