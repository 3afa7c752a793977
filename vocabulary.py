"""What a model's vocabulary means: its pieces, its language tags, and which pieces each language
may write.

Decoding, validation, the tokenizer step and the training cache all ask here:

- ``model_pieces`` / ``tokenizer_matches``: a model's SentencePiece pieces in id order, and whether
  they are a tokenizer directory's.
- ``tag_piece_id`` / ``language_tag_pieces`` / ``language_tag_ids``: the single piece of a language
  tag ``<|xx|>`` (``manifest_schema.lang_tag``) in a tokenizer or a model.
- ``language_scripts`` and its records (``LANGUAGE_SCRIPTS_FILE`` in a tokenizer directory,
  ``SCRIPTS_KEY`` in a model's config): the scripts each language is written in;
  ``language_piece_masks`` turns them into the pieces a language given may write.
- ``tokenize_transcript``: a transcript's ids behind its tag; ``tokenizer_fingerprint``: what
  identifies a tokenizer (the training cache's key); ``PIECE_COUNTS_FILE``: how often the tokenizer
  step saw each piece; ``TokenizerError``: a base tokenizer that cannot be read or extended.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import config
from manifest_schema import UNKNOWN_LANG, known_lang, lang_tag, leading_lang
from process_control import UserError
from script_languages import scripts_of

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vocabulary")


def _spm_pieces(model_file: Path) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def model_pieces(model) -> list[str] | None:
    """The pieces of the model's SentencePiece tokenizer in id order, or None for another kind."""
    inner = getattr(model.tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "id_to_piece"):
        return None
    return [inner.id_to_piece(i) for i in range(inner.get_piece_size())]


def tokenizer_matches(model, tokenizer_dir: Path) -> bool:
    """True when the model's SentencePiece pieces are exactly those of ``tokenizer_dir/tokenizer.model``."""
    ours = model_pieces(model)
    return ours is not None and ours == _spm_pieces(tokenizer_dir / "tokenizer.model")


def tag_piece_id(tokenizer, lang: str) -> int | None:
    """The single token id of ``lang_tag(lang)``, None when the tokenizer has no such piece."""
    tag = lang_tag(lang)
    token_id = int(tokenizer.token_to_id(tag))
    # An unknown piece maps to <unk>; mapping the id back is the test that does not depend on which
    # id <unk> has.
    return token_id if tokenizer.ids_to_tokens([token_id]) == [tag] else None


# In a tokenizer directory (scripts/train_tokenizer.py writes it): per language, how many letters
# of each script (script_languages.letter_script) a sample of its training texts holds.
LANGUAGE_SCRIPTS_FILE = "language_scripts.json"


# The key of a model's config that lists, per language, the scripts it is written in.
SCRIPTS_KEY = "language_scripts"


# A script counts as one a language is written in from this share of its letters on: code-mixed
# English words in Hindi transcripts are in, a stray character of another script is out.
SCRIPT_MIN_SHARE = 0.01


def write_language_scripts(tokenizer_dir: Path, letters: dict[str, dict[str, int]]) -> None:
    """``LANGUAGE_SCRIPTS_FILE`` in ``tokenizer_dir``: ``letters[lang][script]``, letters counted."""
    record = {lang: dict(sorted(counts.items())) for lang, counts in sorted(letters.items())}
    (Path(tokenizer_dir) / LANGUAGE_SCRIPTS_FILE).write_text(
        json.dumps(record, indent=1, ensure_ascii=False), encoding="utf-8"
    )


def read_language_scripts(tokenizer_dir: Path) -> dict[str, dict[str, int]] | None:
    """What ``write_language_scripts`` stored in ``tokenizer_dir``; None when there is none (a
    tokenizer directory from elsewhere) or it is not such a record."""
    try:
        record = json.loads((Path(tokenizer_dir) / LANGUAGE_SCRIPTS_FILE).read_text("utf-8"))
        return {
            str(lang): {str(script): int(n) for script, n in counts.items()}
            for lang, counts in record.items()
        }
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def scripts_written_in(letters: dict[str, int]) -> list[str]:
    """The scripts holding at least SCRIPT_MIN_SHARE of ``letters`` (script -> count), sorted."""
    total = sum(letters.values())
    return sorted(s for s, n in letters.items() if n > 0 and n >= SCRIPT_MIN_SHARE * total)


def record_language_scripts(model, tokenizer_dir: Path) -> dict[str, list[str]]:
    """Write into ``model``'s config (``SCRIPTS_KEY``), which its checkpoints and .nemo exports
    carry, the scripts each language is written in: those of ``tokenizer_dir``'s record for the
    languages it counted, the base's record (the config ``model`` starts from) for the others.
    Returns what was written ({} and nothing written when neither records any)."""
    from omegaconf import open_dict

    scripts = dict(language_scripts(model))
    counted = read_language_scripts(tokenizer_dir) or {}
    scripts.update({lang: scripts_written_in(letters) for lang, letters in counted.items()})
    out = {lang: sorted(scripts[lang]) for lang in sorted(scripts)}
    if out:
        with open_dict(model.cfg):
            model.cfg[SCRIPTS_KEY] = out
    return out


def language_scripts(model) -> dict[str, frozenset[str]]:
    """Per language, the scripts ``model``'s config records it written in; {} when it records none
    (a model this project did not train, or trained before it recorded them)."""
    recorded = (getattr(model, "cfg", None) or {}).get(SCRIPTS_KEY) or {}
    try:
        return {str(lang): frozenset(str(s) for s in scripts) for lang, scripts in recorded.items()}
    except (AttributeError, TypeError):
        return {}


class LanguageNotInModel(config.ConfigError):
    """A language given for decoding whose tag is no single piece of the model's vocabulary."""


def language_tag_pieces(model, languages) -> list[int | None]:
    """The piece id of each language's tag ``<|lang|>`` in ``model``'s vocabulary, None where the
    language is not known (None, empty or ``UNKNOWN_LANG``: decoded auto); LanguageNotInModel
    naming the language and the tags the model has when one has no single piece."""
    known: dict[str, int | None] = {}
    out: list[int | None] = []
    for lang in languages:
        if not known_lang(lang):
            out.append(None)
            continue
        if lang not in known:
            known[lang] = tag_piece_id(model.tokenizer, lang)
        if known[lang] is None:
            tags = sorted({leading_lang(p) for p in (model_pieces(model) or []) if leading_lang(p)})
            raise LanguageNotInModel(
                f"the model has no tag {lang_tag(lang)} for the language {lang!r} given to "
                f"decode with (its tags: {', '.join(tags) or 'none'}); give one of those, or "
                "no language to let the model guess it"
            )
        out.append(known[lang])
    return out


# Pieces that are no language's own writing, kept for every language: SentencePiece's special
# pieces and its byte pieces (<0xE0>: a byte of a character the vocabulary lacks).
_SPECIAL_PIECES = frozenset({"<unk>", "<s>", "</s>", "<pad>"})


def always_kept(piece: str) -> bool:
    """True for a special or byte piece, which decoding with any language given may write."""
    return piece in _SPECIAL_PIECES or (
        len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
    )


def is_language_tag(piece: str) -> bool:
    """True for a piece that is a language's tag, ``<|hi|>``."""
    lang = leading_lang(piece)
    return lang is not None and piece == lang_tag(lang)


# Per tokenizer object (a new vocabulary is a new one): the ids of its language tags, each piece's
# (special, scripts, is a tag), and the masks built from them, per (language, scripts).
_PIECE_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def language_tag_ids(model) -> frozenset[int]:
    """The ids of every language tag among ``model``'s pieces (``is_language_tag``)."""
    known = _PIECE_MASKS.setdefault(model.tokenizer, {})
    if "tags" not in known:
        pieces = model_pieces(model)
        if pieces is None:
            tokenizer = model.tokenizer
            pieces = tokenizer.ids_to_tokens(list(range(int(tokenizer.vocab_size))))
        known["tags"] = frozenset(i for i, piece in enumerate(pieces) if is_language_tag(piece))
    return known["tags"]


def language_piece_masks(model, languages, recorded=None) -> list[torch.Tensor | None]:
    """Per utterance, which pieces decoding with its language given may write after the tag: a
    bool tensor over ``model``'s pieces, True for a piece whose letters are all of the scripts the
    model records that language written in (``language_scripts``), for a piece
    without letters (digits, punctuation, the word boundary) and for ``always_kept`` pieces;
    False for every language tag. None (any piece) where the language is not known
    (``manifest_schema.known_lang``), where the model records no scripts for it (or none: a
    language whose texts had no letters), or for a tokenizer that is not SentencePiece.
    ``recorded``: language -> scripts, used instead of the model's record."""
    import torch  # here: the training cache asks this module too, and never needs torch

    recorded = language_scripts(model) if recorded is None else recorded
    wanted = {lang for lang in languages if known_lang(lang) and recorded.get(lang)}
    if not wanted:
        return [None] * len(languages)
    known = _PIECE_MASKS.setdefault(model.tokenizer, {})
    if "pieces" not in known:
        pieces = model_pieces(model)
        known["pieces"] = (
            None
            if pieces is None
            else [
                (always_kept(piece), scripts_of(piece), is_language_tag(piece)) for piece in pieces
            ]
        )
    if known["pieces"] is None:
        return [None] * len(languages)
    masks = {}
    for lang in wanted:
        key = (lang, recorded[lang])
        if key not in known:
            known[key] = torch.tensor(
                [
                    not tag and (special or written <= recorded[lang])
                    for special, written, tag in known["pieces"]
                ]
            )
        masks[lang] = known[key]
    return [masks.get(lang) if known_lang(lang) else None for lang in languages]


def kept_scripts_phrase(model, languages) -> str:
    """How decoding with ``languages`` given writes after the tag, for a report's heading: in the
    scripts the model records for each (LANGUAGE_GIVEN_SCRIPTS=1), or from the tag alone; and,
    where ``UNKNOWN_LANG`` is among them, that it is decoded auto."""
    undetermined = f"; {UNKNOWN_LANG}: decoded auto" if UNKNOWN_LANG in languages else ""
    if config.LANGUAGE_GIVEN_SCRIPTS != "1":
        return "the tag alone (LANGUAGE_GIVEN_SCRIPTS=0)" + undetermined
    recorded = language_scripts(model)
    asked = sorted({known_lang(lang) for lang in languages} - {None})
    kept = [f"{lang} {'+'.join(sorted(recorded[lang]))}" for lang in asked if recorded.get(lang)]
    alone = [lang for lang in asked if not recorded.get(lang)]
    parts = [f"then only pieces of its scripts ({', '.join(kept)})"] if kept else []
    if alone:
        parts.append(f"the tag alone for {', '.join(alone)} (the model records no scripts for it)")
    return ("; ".join(parts) or "the tag alone") + undetermined


def tokenize_transcript(tokenizer, tag_id: int, transcript: str, max_token_len: int) -> list[int]:
    """``[tag_id] + text_to_ids(transcript)``, truncated to ``max_token_len``.

    Tokenizing ``"<|hi|> text"`` whole would give ``['▁', '<|hi|>', ...]``: SentencePiece prefixes a
    word boundary before the user-defined tag, so the tag would be the second token, not the first.
    """
    ids = tokenizer.text_to_ids(transcript)
    return [tag_id] + ids[: max_token_len - 1]


@functools.cache
def _warn_missing_field(name: str) -> None:
    import sentencepiece

    log.warning(
        f"sentencepiece {sentencepiece.__version__} has no TrainerSpec.{name}: tokenizer fingerprints "
        f"keep that path where a newer sentencepiece set one (a training cache keyed by it is rebuilt "
        f"once; sentencepiece>=0.2.3 reads it)"
    )


def sentencepiece_model_without_paths(model: bytes) -> bytes:
    """``model`` (a serialized SentencePiece ModelProto) without the paths of the files it was
    trained from and into (the trainer's input, model prefix and seed pieces file, a normalization
    rule file): what it encodes with and how it was trained, so the same pieces and settings give
    the same bytes wherever they were trained."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model)
    fields = proto.trainer_spec.DESCRIPTOR.fields_by_name
    for name in ("input", "model_prefix", "seed_sentencepieces_file"):
        if name in fields:
            proto.trainer_spec.ClearField(name)
        else:
            _warn_missing_field(name)
    for spec in (proto.normalizer_spec, proto.denormalizer_spec):
        spec.ClearField("normalization_rule_tsv")
    return proto.SerializeToString(deterministic=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the SentencePiece model without the paths it was trained with
    (``sentencepiece_model_without_paths``), or of the vocabulary for other tokenizers: two
    trainings of the same tokenizer share their caches."""
    processor = getattr(tokenizer, "tokenizer", None)
    if hasattr(processor, "serialized_model_proto"):
        blob = sentencepiece_model_without_paths(processor.serialized_model_proto())
    else:
        blob = "\n".join(tokenizer.ids_to_tokens(list(range(tokenizer.vocab_size)))).encode()
    return hashlib.sha256(blob).hexdigest()


# In a tokenizer directory (scripts/train_tokenizer.py writes it): how often each piece occurs in
# the text the tokenizer was trained on, sampled with the training language mix. A finetune starts
# the output bias of every piece its base lacks from it (asr_model.new_piece_prior).
PIECE_COUNTS_FILE = "piece_counts.json"


def write_piece_counts(tokenizer_dir: Path, counts: list[int], sentences: int) -> None:
    """``PIECE_COUNTS_FILE`` in ``tokenizer_dir``: ``counts[i]`` occurrences of piece i in
    ``sentences`` sampled training texts (each with its language tag), tied to the directory's
    tokenizer.model by its sha256."""
    model = (Path(tokenizer_dir) / "tokenizer.model").read_bytes()
    record = {
        "tokenizer_model_sha256": hashlib.sha256(model).hexdigest(),
        "sentences": int(sentences),
        "counts": [int(c) for c in counts],
    }
    (Path(tokenizer_dir) / PIECE_COUNTS_FILE).write_text(json.dumps(record), encoding="utf-8")


def read_piece_counts(tokenizer_dir: Path) -> list[int] | None:
    """The piece counts ``write_piece_counts`` stored for ``tokenizer_dir``'s tokenizer.model, or
    None when there are none or they belong to another tokenizer.model (a file copied beside it)."""
    directory = Path(tokenizer_dir)
    try:
        record = json.loads((directory / PIECE_COUNTS_FILE).read_text(encoding="utf-8"))
        model = (directory / "tokenizer.model").read_bytes()
        counts = record["counts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("tokenizer_model_sha256") != hashlib.sha256(model).hexdigest():
        log.warning(
            "%s was counted for another tokenizer.model than the one beside it: ignored",
            directory / PIECE_COUNTS_FILE,
        )
        return None
    return counts


class TokenizerError(UserError, ValueError):
    """A base tokenizer that cannot be read or extended; the message says which and what to do."""
