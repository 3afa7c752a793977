"""Train the SentencePiece tokenizer of the run on the train manifest's texts, or extend a base model's.

Usage:
    python scripts/train_tokenizer.py --help
    python scripts/train_tokenizer.py                         # TRAIN_MANIFEST_PATH -> TOKENIZER_DIR
    VOCAB_SIZE=4000 python scripts/train_tokenizer.py --manifest data/train_manifest_v2.parquet \\
        --output data/tokenizer_4k --sample-sentences 500000
    INIT_MODEL=parakeet-tdt-0.6b-v2.nemo TOKENIZER_MODE=extend python scripts/train_tokenizer.py

Modes (TOKENIZER_MODE; auto = extend when INIT_MODEL names a base model, else new):
- new: a BPE model learned from the manifest alone (below).
- extend: the base model's SentencePiece model (INIT_MODEL or --base: a .nemo, a train.py step
  checkpoint, a tokenizer directory, or a pretrained name, downloaded) with pieces appended: every
  base piece keeps its id, score and type, and the normalizer, the special pieces and the byte
  fallback setting stay the base's. The appended pieces are learned from the manifest's sentences
  that hold a character the base has no piece for (temperature-sampled, as below), by a model of
  the base's type (BPE or unigram) over text normalized as the base normalizes it; only pieces with
  at least one such character are kept (all new characters first, then merges in learned order, up
  to VOCAB_SIZE pieces in all with the tags). So text the base covers cannot contain an appended
  piece and is segmented exactly as before: checked on the manifest's covered sentences before the
  tokenizer is written. BPE pieces are appended with scores below every base piece, so every base
  merge still comes first; unigram pieces keep their learned log-probabilities.
- tags: the base tokenizer as it is, plus the ``<|lang|>`` tags: for a base that covers the languages.
A WordPiece or aggregate (one tokenizer per language) base, or a word or character SentencePiece
model, is refused with one line: extending one would change how the base segments its own text.

What it guarantees:
- Every ``<|lang|>`` tag found at the start of a manifest text is a user-defined symbol: one piece,
  one id, never split (``token_to_id("<|hi|>")`` works, and so does encoding "<|hi|> text").
- SentencePiece learns from the texts WITHOUT their tag: dataset.py emits the tag id followed by
  the ids of the rest, so the tag must not shape the merges of the text.
- ``character_coverage=1.0``: rare Indic characters keep their own piece instead of ``<unk>``.
- Sentences are drawn per language with the training temperature (share ~ n_l^TEMPERATURE, n_l by
  utterance count or hours as LANG_WEIGHTING says), so small languages get vocabulary.
- The output directory is what NeMo's ``process_asr_text_tokenizer.py`` writes: tokenizer.model,
  tokenizer.vocab and vocab.txt (same rules as NeMo's ``create_spt_model``), plus summary.json and
  piece_counts.json (each piece's occurrences in up to 200k of the sampled texts, tags included:
  a finetune starts the output bias of each piece its base lacks from its share) and
  language_scripts.json (per language, the letters of each script in up to 20k of its texts: the
  trained model records the scripts each language is written in, and decoding with a language
  given writes only pieces of those scripts).
  It is built in a temporary directory beside TOKENIZER_DIR and renamed into place, so a crash
  never leaves a half-written tokenizer.
- When the corpus cannot fill VOCAB_SIZE pieces (tiny corpora), the vocabulary is capped to what
  SentencePiece can learn and a warning says so.

Reads: TRAIN_MANIFEST_PATH, TOKENIZER_DIR, VOCAB_SIZE, TEMPERATURE, LANG_WEIGHTING, SEED,
TOKENIZER_MODE, INIT_MODEL (config.py).
Reports per language: the unknown-piece rate, tokens per second of audio and, when extending, the
share of tokens that are base pieces and appended pieces.
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
from manifest_schema import is_nemo_json, lang_tag, split_lang_tags
from process_control import UserError
from script_languages import script_letters
from vocabulary import (
    TokenizerError,
    scripts_written_in,
    sentencepiece_model_without_paths,
    write_language_scripts,
    write_piece_counts,
)

log = logging.getLogger("train_tokenizer")

SPECIAL_PIECES = ("<s>", "</s>", "<pad>", "<unk>")
REPORT_SENTENCES_PER_LANG = 2000
# Sampled sentences whose pieces are counted (piece_counts.json): plenty for the shares of the
# pieces that matter, a few seconds of encoding.
COUNT_SENTENCES = 200_000
# Texts per language whose letters are counted by script (language_scripts.json): a script holding
# one letter in a hundred shows in thousands of letters.
SCRIPT_SENTENCES_PER_LANG = 20_000


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


def _train_spm(
    sentence_file: Path,
    prefix: Path,
    vocab_size: int,
    user_symbols: list[str],
    *,
    model_type: str = "bpe",
    cap: bool = False,
    **options,
) -> None:
    settings = dict(
        input=str(sentence_file),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        user_defined_symbols=user_symbols,
        bos_id=-1,
        eos_id=-1,
        shuffle_input_sentence=True,
        input_sentence_size=0,
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    settings.update(options)
    try:
        spm.SentencePieceTrainer.train(**settings)
    except RuntimeError as exc:
        marker = "value <= "
        if not cap or marker not in str(exc):
            raise
        settings["vocab_size"] = int(str(exc).split(marker, 1)[1].split(".")[0].strip())
        spm.SentencePieceTrainer.train(**settings)


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


# ModelProto.TrainerSpec.ModelType and ModelProto.SentencePiece.Type values (sentencepiece_model.proto)
UNIGRAM, BPE = 1, 2
NORMAL, USER_DEFINED = 1, 4
STANDARD_NORMALIZERS = ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity")


def _proto(data: bytes):
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(data)
    return proto


def covered_characters(proto) -> set[str]:
    """Every character that occurs in a normal piece of ``proto``: text made of these alone can be
    segmented by the model without its byte fallback or <unk>."""
    return {c for p in proto.pieces if p.type == NORMAL for c in p.piece}


def has_new_characters(proto, sentences: list[str]) -> list[bool]:
    """For each sentence, whether it holds a character no normal piece of ``proto`` has, judged
    on the text as ``proto`` normalizes it (a space is then the whitespace marker its pieces hold)."""
    covered = covered_characters(proto)
    normalizer = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    return [any(c not in covered for c in text) for text in normalizer.normalize(sentences)]


def extend_model(
    base: bytes,
    sentences: list[str],
    vocab_size: int,
    tags: list[str],
    work: Path,
    *,
    tags_only: bool = False,
) -> tuple[bytes, dict]:
    """The base SentencePiece model with ``tags`` and, unless ``tags_only``, pieces learned from
    ``sentences`` appended (module doc, TOKENIZER_MODE=extend); returns (model, counts)."""
    proto = _proto(base)
    model_type = proto.trainer_spec.model_type
    if model_type not in (UNIGRAM, BPE):
        raise TokenizerError(
            "the base is a word or character SentencePiece model: pieces appended to it would "
            "change how it segments its own text; use TOKENIZER_MODE=new"
        )
    base_size = len(proto.pieces)
    existing = {p.piece for p in proto.pieces}
    new_tags = [t for t in tags if t not in existing]
    appended: list[tuple[str, float]] = []
    learned_from = 0
    if not tags_only:
        budget = vocab_size - base_size - len(new_tags)
        if budget <= 0:
            raise TokenizerError(
                f"VOCAB_SIZE={vocab_size} leaves no room for new pieces: the base has {base_size} "
                f"and there are {len(new_tags)} new tags; raise VOCAB_SIZE, or use "
                f"TOKENIZER_MODE=tags to keep the base as it is"
            )
        appended, learned_from = _learn_new_pieces(proto, sentences, budget, work)
    for piece, score in appended:
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, score, NORMAL
    for tag in new_tags:
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = tag, 0.0, USER_DEFINED
    proto.trainer_spec.vocab_size = len(proto.pieces)
    counts = {
        "base_pieces": base_size,
        "appended_pieces": len(appended),
        "appended_characters": sum(1 for piece, _ in appended if len(piece) == 1),
        "appended_tags": len(new_tags),
        "learned_from_sentences": learned_from,
    }
    return proto.SerializeToString(), counts


def _learn_new_pieces(
    proto, sentences: list[str], budget: int, work: Path
) -> tuple[list[tuple[str, float]], int]:
    """Up to ``budget`` (piece, score) pairs, each holding a character ``proto`` has no piece for:
    every such character, then merges in learned order; learned from the sentences that hold such
    a character (``has_new_characters``) alone, whose count comes second."""
    covered = covered_characters(proto)
    existing = {p.piece for p in proto.pieces}
    new = has_new_characters(proto, sentences)
    rule = proto.normalizer_spec.name
    if rule not in STANDARD_NORMALIZERS:
        # A custom normalizer: normalize as the base does, then learn from that text as it is.
        base_sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        sentences = [s.replace("\u2581", " ").strip() for s in base_sp.normalize(sentences)]
        rule = "identity"
    new_text = [s for s, is_new in zip(sentences, new) if is_new]
    if not new_text:
        return [], 0
    sentence_file = work / "new_sentences.txt"
    sentence_file.write_text("\n".join(new_text) + "\n", encoding="utf-8")
    target = budget + 64
    for _ in range(4):  # pieces of covered characters alone are learned too: grow until enough
        _train_spm(
            sentence_file,
            work / "appended",
            target,
            [],
            model_type="unigram" if proto.trainer_spec.model_type == UNIGRAM else "bpe",
            normalization_rule_name=rule,
            add_dummy_prefix=proto.normalizer_spec.add_dummy_prefix,
            remove_extra_whitespaces=proto.normalizer_spec.remove_extra_whitespaces,
            cap=True,
        )
        learned = _proto((work / "appended.model").read_bytes())
        usable = [
            p
            for p in learned.pieces
            if p.type == NORMAL
            and p.piece not in existing
            and any(c not in covered for c in p.piece)
        ]
        if len(usable) >= budget or len(learned.pieces) < target:  # enough, or all the text has
            break
        target = int(target * budget / max(len(usable), 1) * 1.1) + 64
    chars = [p for p in usable if len(p.piece) == 1]
    merges = [p for p in usable if len(p.piece) > 1]
    if len(chars) > budget:
        raise TokenizerError(
            f"VOCAB_SIZE leaves {budget} pieces for new text, fewer than its {len(chars)} new "
            f"characters; raise VOCAB_SIZE above {proto.trainer_spec.vocab_size + len(chars) + 64}"
        )
    merges = merges[: budget - len(chars)]
    if proto.trainer_spec.model_type == UNIGRAM:
        return [(p.piece, p.score) for p in merges + chars], len(new_text)
    # BPE merges by score: every appended piece after every base piece, in learned order.
    lowest = min((p.score for p in proto.pieces if p.type == NORMAL), default=0.0)
    return [(p.piece, lowest - 1.0 - i) for i, p in enumerate(merges + chars)], len(new_text)


def check_extension(base: bytes, extended: bytes, sentences: list[str], limit: int = 2000) -> int:
    """ValueError unless every base piece keeps its id and the base's covered sentences (up to
    ``limit``) are segmented exactly as the base segments them; returns how many were compared."""
    base_proto = _proto(base)
    base_sp = spm.SentencePieceProcessor(model_proto=base)
    new_sp = spm.SentencePieceProcessor(model_proto=extended)
    for i, piece in enumerate(base_proto.pieces):
        if new_sp.id_to_piece(i) != piece.piece:
            raise ValueError(f"base piece {i} {piece.piece!r} moved in the extended tokenizer")
    same: list[str] = []
    for start in range(0, len(sentences), 10 * limit):
        chunk = sentences[start : start + 10 * limit]
        same += [s for s, new in zip(chunk, has_new_characters(base_proto, chunk)) if not new]
        if len(same) >= limit:
            break
    same = same[:limit]
    if base_sp.encode(same) != new_sp.encode(same):
        raise ValueError("the extended tokenizer segments text the base covers differently")
    return len(same)


def count_pieces(model_file: Path, tags: np.ndarray, rests: np.ndarray) -> list[int]:
    """Occurrences of every piece of ``model_file`` in the texts as dataset.py emits them: each
    row's ``<|lang|>`` tag, then its text's pieces."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    counts = np.zeros(sp.get_piece_size(), dtype=np.int64)
    for start in range(0, len(rests), 10_000):
        ids = sp.encode(rests[start : start + 10_000].tolist())
        flat = np.fromiter((i for row in ids for i in row), dtype=np.int64)
        counts += np.bincount(flat, minlength=len(counts))
    for lang, n in zip(*np.unique(tags, return_counts=True)):
        tag = sp.piece_to_id(lang_tag(str(lang)))
        if tag != sp.unk_id():
            counts[tag] += n
    return counts.tolist()


def language_script_letters(
    tags: np.ndarray, rests: np.ndarray, rng: np.random.Generator
) -> dict[str, dict[str, int]]:
    """Per language, the letters of each script (``script_languages.script_letters``) in up to
    SCRIPT_SENTENCES_PER_LANG of its texts, drawn at random."""
    out = {}
    for lang in sorted(set(tags.tolist())):
        rows = np.flatnonzero(tags == lang)
        if len(rows) > SCRIPT_SENTENCES_PER_LANG:
            rows = rng.choice(rows, SCRIPT_SENTENCES_PER_LANG, replace=False)
        out[lang] = script_letters(rests[rows].tolist())
    return out


def report(
    model_file: Path,
    tags: np.ndarray,
    rests: np.ndarray,
    durations: np.ndarray,
    rng: np.random.Generator,
    base_pieces: int | None = None,
) -> dict[str, dict[str, float]]:
    """Per language: unknown-piece rate and tokens (tag + text, as dataset.py emits) per audio
    second; with ``base_pieces`` (an extended tokenizer) also the share of the text's tokens that
    are base pieces (ids below it) and appended ones."""
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
        if base_pieces is not None:
            n_base = sum(1 for e in encoded for i in e if i < base_pieces)
            out[lang]["base_piece_share"] = n_base / max(n_pieces, 1)
            out[lang]["appended_piece_share"] = (n_pieces - n_base) / max(n_pieces, 1)
    return out


def write_model_files(model: bytes, directory: Path) -> list[str]:
    """tokenizer.model, tokenizer.vocab and NeMo's vocab.txt of a SentencePiece model; returns its
    user-defined pieces (vocab.txt leaves them out, as NeMo's create_spt_model does)."""
    proto = _proto(model)
    (directory / "tokenizer.model").write_bytes(model)
    (directory / "tokenizer.vocab").write_text(
        "".join(f"{p.piece}\t{p.score:g}\n" for p in proto.pieces), encoding="utf-8"
    )
    user_symbols = [p.piece for p in proto.pieces if p.type == USER_DEFINED]
    (directory / "vocab.txt").write_text(
        "\n".join(nemo_vocab_lines(directory / "tokenizer.vocab", user_symbols)) + "\n",
        encoding="utf-8",
    )
    return user_symbols


def resolve_mode(mode: str | None, base: str | None) -> tuple[str, str | None]:
    """(mode, base): TOKENIZER_MODE and INIT_MODEL unless given; auto = extend with a base."""
    mode = config.TOKENIZER_MODE if mode is None else mode
    base = config.INIT_MODEL if base is None else base
    if mode == "auto":
        mode = "extend" if base else "new"
    if mode != "new" and not base:
        raise TokenizerError(
            f"TOKENIZER_MODE={mode} extends a base model's tokenizer: set INIT_MODEL (or --base) "
            f"to its .nemo, step checkpoint, tokenizer directory or pretrained name"
        )
    return mode, base or None


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
    mode: str | None = None,
    base: str | None = None,
) -> dict:
    """Train (``mode`` new) or extend (extend, tags) the tokenizer and write ``output_dir``
    atomically; return the summary dict. ``mode``, ``base``: TOKENIZER_MODE, INIT_MODEL."""
    manifest_path = Path(manifest_path or config.TRAIN_MANIFEST_PATH)
    output_dir = Path(output_dir or config.TOKENIZER_DIR)
    vocab_size = vocab_size or config.VOCAB_SIZE
    temperature = config.TEMPERATURE if temperature is None else temperature
    lang_weighting = lang_weighting or config.LANG_WEIGHTING
    rng = np.random.default_rng(config.SEED if seed is None else seed)
    setting = "INIT_MODEL" if base is None else "--base"
    mode, base = resolve_mode(mode, base)
    base_model, base_from = None, None
    if base and mode != "new":
        from base_tokenizer import base_tokenizer_model

        base_model, base_from = base_tokenizer_model(base, setting)
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"TRAIN_MANIFEST_PATH={manifest_path} does not exist; "
            "build it with scripts/make_train_val.py or pass --manifest"
        )
    if is_nemo_json(manifest_path):
        raise TokenizerError(
            f"{manifest_path} is a NeMo JSON manifest: import it with python build_manifest.py "
            f"--source nemo:{manifest_path}, split it with scripts/make_train_val.py, and pass the "
            f"train manifest it writes (see README, Bring your own data)"
        )
    try:
        table = pq.read_table(manifest_path, columns=["text", "duration"])
    except (OSError, ValueError) as exc:  # pyarrow: not parquet, or a column missing
        raise TokenizerError(
            f"{manifest_path}: not a train manifest ({type(exc).__name__}: {exc}); build it with "
            f"scripts/make_train_val.py"
        ) from None
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
        extension: dict = {}
        if base_model is None:
            sentence_file = work / "sentences.txt"
            with open(sentence_file, "w", encoding="utf-8") as f:
                for start in tqdm(
                    range(0, len(chosen), 100_000),
                    desc="writing sampled sentences",
                    unit="100k",
                    disable=None,  # no bar in a log file, where its redraws are garbage
                ):
                    f.write("\n".join(rests[chosen[start : start + 100_000]].tolist()))
                    f.write("\n")
            trained_size = train_with_cap(
                sentence_file, work / "tokenizer", vocab_size, user_symbols
            )
            sentence_file.unlink()
            # SentencePiece records the temporary paths it trained with; without them the same
            # tokenizer is the same bytes wherever it was trained.
            model_file = work / "tokenizer.model"
            model_file.write_bytes(sentencepiece_model_without_paths(model_file.read_bytes()))
            (work / "vocab.txt").write_text(
                "\n".join(nemo_vocab_lines(work / "tokenizer.vocab", user_symbols)) + "\n",
                encoding="utf-8",
            )
        else:
            extended, extension = extend_model(
                base_model,
                rests[chosen].tolist(),
                vocab_size,
                user_symbols,
                work,
                tags_only=mode == "tags",
            )
            for leftover in work.iterdir():  # the appended pieces' own model and sentences
                leftover.unlink()
            write_model_files(extended, work)
            extension["covered_sentences_checked"] = check_extension(
                base_model, extended, rests.tolist()
            )
            extension["base"] = base_from
            trained_size = len(_proto(extended).pieces)
            if trained_size < vocab_size and mode == "extend":
                log.warning(
                    "VOCAB_SIZE=%d is more than this corpus can fill: %d pieces (%d base, %d appended)",
                    vocab_size,
                    trained_size,
                    extension["base_pieces"],
                    extension["appended_pieces"],
                )
        counted = chosen[:COUNT_SENTENCES]
        write_piece_counts(
            work,
            count_pieces(work / "tokenizer.model", tags[counted], rests[counted]),
            len(counted),
        )
        letters = language_script_letters(tags, rests, rng)
        write_language_scripts(work, letters)
        per_lang = report(
            work / "tokenizer.model",
            tags,
            rests,
            durations,
            rng,
            base_pieces=extension.get("base_pieces"),
        )
        summary = {
            "mode": mode,
            **({"extension": extension} if extension else {}),
            "manifest": str(manifest_path),
            "rows_in": int(table.num_rows),
            "sampled_sentences": int(len(chosen)),
            "vocab_size_requested": int(vocab_size),
            "vocab_size": int(trained_size),
            "temperature": temperature,
            "lang_weighting": lang_weighting,
            "user_defined_symbols": user_symbols,
            "target_share": shares,
            "per_language": {
                lang: {**row, "scripts": scripts_written_in(letters.get(lang, {}))}
                for lang, row in per_lang.items()
            },
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
    extension = summary.get("extension")
    print(
        f"tokenizer ({summary.get('mode', 'new')}): {summary['vocab_size']} pieces (requested "
        f"{summary['vocab_size_requested']}) from {summary['sampled_sentences']} sampled sentences "
        f"-> {output_dir}"
    )
    if extension:
        print(
            f"  base: {extension['base']}: {extension['base_pieces']} pieces kept with their ids; "
            f"appended {extension['appended_pieces']} pieces ({extension['appended_characters']} "
            f"new characters, learned from the {extension['learned_from_sentences']} sampled "
            f"sentences that hold one) and {extension['appended_tags']} tags; "
            f"{extension['covered_sentences_checked']} sentences the base covers segment as before"
        )
    head = f"{'lang':<8} {'share':>7} {'unk rate':>9} {'tokens/s':>9}"
    head += f" {'base pieces':>12} {'new pieces':>11}" if extension else ""
    print(head + "  written in (language_scripts.json)")
    for lang, row in summary["per_language"].items():
        line = (
            f"{lang:<8} {summary['target_share'][lang]:>7.3f} {row['unk_rate']:>9.5f} "
            f"{row['tokens_per_second']:>9.2f}"
        )
        if extension:
            line += f" {row['base_piece_share']:>12.1%} {row['appended_piece_share']:>11.1%}"
        print(f"{line}  {', '.join(row.get('scripts') or ['no letters'])}")


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
        "--mode",
        choices=("auto", "new", "extend", "tags"),
        default=None,
        help="new, extend or tags (default TOKENIZER_MODE; auto = extend when a base is given)",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="the base model whose tokenizer extend and tags start from: a .nemo, a step_*.ckpt, "
        "a tokenizer directory or a pretrained name (default INIT_MODEL)",
    )
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
            mode=args.mode,
            base=args.base,
        )
    except (VocabularyTooSmall, UserError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary, output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
