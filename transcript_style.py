"""The style of the training targets (TRANSCRIPT_STYLE): plain or punctuated, which one a run
uses, what a base model writes, and the record a manifest and a trained model carry.

A model learns to write what its targets say: a base that writes punctuation and capitals
(Parakeet-TDT 0.6B v2 and v3) finetuned on plain targets learns to stop. So the style follows the
base unless set:

- ``auto`` (the default): the style INIT_MODEL writes (``base_style``), plain without a base (a
  run from scratch, the demo's base) or when the base's file holds no style to read; a base path
  that does not exist, or a pretrained name that cannot be fetched here, is an error, never plain.
- ``plain`` / ``punctuated``: as set; build_manifest.py warns (one line) when the base writes
  the other style.

What a base writes: a model this project trained records the style of its targets in its config
(``CONFIG_KEY``; its step checkpoints and .nemo exports carry it); any other base is judged by its
tokenizer: a vocabulary with a piece holding ``.``, ``,``, ``?`` or a danda was trained on
punctuated text (a plain-trained tokenizer never sees them: the plain style removes every mark).

build_manifest.py writes the style into the master's parquet metadata (``STYLE_KEY``) and summary;
make_train_val.py copies it into the train and validation manifests; train.py checks it
(``check_manifest_style``): a manifest of one style and TRANSCRIPT_STYLE set to the other is
refused with one line; under ``auto`` the manifest's style is used, with a warning when the base
writes the other.

Usage::

    style, why = resolve_style()                  # TRANSCRIPT_STYLE, auto resolved against INIT_MODEL
    write_manifest_file(frame, path, metadata={STYLE_KEY: style})
    check_manifest_style(train_manifest)          # train.py: the manifest's style, or a UserError
"""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path

import config
from pretrained_models import ModelNotFetched
from process_control import UserError
from transcript_cleaning import check_style

log = logging.getLogger("transcript_style")

# The parquet metadata key (and summary setting) that names a manifest's style.
STYLE_KEY = "transcript_style"
# The key of a trained model's config (and so of its .nemo's model_config.yaml) naming the style
# of the targets it was trained on.
CONFIG_KEY = "transcript_style"
# A piece holding one of these means the tokenizer was trained on punctuated text.
PUNCTUATION_EVIDENCE = ".,?\u0964"


class TranscriptStyleError(UserError, ValueError):
    """A manifest's style and TRANSCRIPT_STYLE disagree, or a base's style cannot be read."""


def tokenizer_writes_punctuation(model: bytes) -> bool:
    """Whether a serialized SentencePiece model has a normal piece holding a sentence mark
    (``PUNCTUATION_EVIDENCE``)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model)
    normal = 1  # ModelProto.SentencePiece.Type.NORMAL
    return any(
        p.type == normal and any(c in p.piece for c in PUNCTUATION_EVIDENCE) for p in proto.pieces
    )


def recorded_style(model_path: str | Path) -> str | None:
    """The style a model this project trained records (``CONFIG_KEY`` in a .nemo's or unpacked
    .nemo directory's model_config.yaml, or a step checkpoint's model config); None for anything
    else (a pretrained name, a model from elsewhere, an unreadable file)."""
    import yaml

    path = Path(model_path)
    try:
        if path.suffix == ".ckpt" and path.is_file():
            import asr_model
            import checkpoints

            checkpoint = checkpoints.read_checkpoint(path, mmap=True)
            style = ((checkpoint.get(asr_model.PORTABLE_KEY) or {}).get("config") or {}).get(
                CONFIG_KEY
            )
        elif path.is_dir():
            text = (path / "model_config.yaml").read_text(encoding="utf-8")
            style = (yaml.safe_load(text) or {}).get(CONFIG_KEY)
        elif path.is_file():
            style = None
            with tarfile.open(path, "r:*") as archive:
                for member in archive:
                    if Path(member.name).name == "model_config.yaml":
                        text = archive.extractfile(member).read().decode("utf-8")
                        style = (yaml.safe_load(text) or {}).get(CONFIG_KEY)
                        break
        else:
            return None
    except (OSError, tarfile.TarError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return None
    return style if style in ("plain", "punctuated") else None


def base_style(init_model: str | None = None) -> tuple[str | None, str]:
    """(style, how it was found) for the base ``init_model`` (default INIT_MODEL): its recorded
    style, else what its tokenizer says; (None, why) without a base or when its file holds neither.
    A base that is not there is never a guess, since the style decides the targets: a .nemo or
    .ckpt path that does not exist is a TranscriptStyleError, and a pretrained name that cannot be
    fetched here ``pretrained_models.ModelNotFetched`` (one line, in seconds without internet)."""
    init_model = config.INIT_MODEL if init_model is None else init_model
    if not init_model:
        return None, "no INIT_MODEL (a model from scratch)"
    if init_model.endswith((".nemo", ".ckpt")) and not Path(init_model).is_file():
        raise TranscriptStyleError(
            f"INIT_MODEL={init_model} does not exist; give a .nemo file, a step_*.ckpt or a "
            f"pretrained name such as nvidia/parakeet-tdt-0.6b-v2"
        )
    recorded = recorded_style(init_model)
    if recorded:
        return recorded, f"INIT_MODEL={init_model} records {recorded} targets"
    from base_tokenizer import base_tokenizer_model

    try:
        model, _ = base_tokenizer_model(init_model)
    except ModelNotFetched:
        raise
    except UserError as exc:
        return None, f"INIT_MODEL={init_model}'s tokenizer cannot be read ({exc})"
    if tokenizer_writes_punctuation(model):
        return "punctuated", f"INIT_MODEL={init_model}'s tokenizer has punctuation pieces"
    return "plain", f"INIT_MODEL={init_model}'s tokenizer has no punctuation pieces"


def resolve_style(style: str | None = None, init_model: str | None = None) -> tuple[str, str]:
    """(style, why): ``style`` (default TRANSCRIPT_STYLE) with ``auto`` resolved against the base
    ``init_model`` (default INIT_MODEL) as the module doc says; ValueError for an unknown style."""
    style = config.TRANSCRIPT_STYLE if style is None else style
    if style != "auto":
        return check_style(style), f"TRANSCRIPT_STYLE={style}"
    init_model = config.INIT_MODEL if init_model is None else init_model
    written, how = base_style(init_model)
    if written is None and init_model:
        # A base whose style cannot be told: plain would be a guess, and it decides the targets.
        raise TranscriptStyleError(
            f"TRANSCRIPT_STYLE=auto cannot tell which style the base writes: {how}; set "
            f"TRANSCRIPT_STYLE=punctuated or plain as the base writes, or fix INIT_MODEL"
        )
    if written is None:
        return "plain", f"TRANSCRIPT_STYLE=auto: plain, {how}"
    return written, f"TRANSCRIPT_STYLE=auto: {how}"


def base_mismatch(style: str, init_model: str | None = None) -> str | None:
    """One line when the base (default INIT_MODEL) writes a style other than ``style``, or when it
    cannot be had to say (the targets' style is set, so this is a warning, never an error), else
    None."""
    init_model = config.INIT_MODEL if init_model is None else init_model
    try:
        written, how = base_style(init_model)
    except (ModelNotFetched, TranscriptStyleError) as exc:
        return f"the {style} targets are not checked against the base's style: {exc}"
    if written is None and init_model:
        return f"the {style} targets are not checked against the base's style: {how}"
    if written is None or written == style:
        return None
    other = "plain" if style == "punctuated" else "punctuated"
    return (
        f"the training targets are {style} but {how}: a finetune on them teaches the base to "
        f"write {style} text; set TRANSCRIPT_STYLE={other} (or auto) and rebuild the manifest to "
        f"keep what the base writes"
    )


def manifest_style(path: str | Path) -> str | None:
    """The style in a parquet manifest's metadata; None for one written without it (by an older
    build_manifest.py, or a NeMo JSON manifest)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.suffix != ".parquet":
        return None
    meta = pq.read_metadata(path).metadata or {}
    value = meta.get(STYLE_KEY.encode())
    return value.decode() if value else None


def check_manifest_style(path: str | Path, variable: str = "TRAIN_MANIFEST_PATH") -> str | None:
    """The style of the manifest at ``path`` (None: unrecorded, nothing checked).

    TRANSCRIPT_STYLE set to plain or punctuated and a manifest of the other style: a
    TranscriptStyleError naming both. Under ``auto`` the manifest's style stands, and a warning
    says when the base (INIT_MODEL) writes the other."""
    recorded = manifest_style(path)
    if recorded is None:
        return None
    if config.TRANSCRIPT_STYLE not in ("auto", recorded):
        raise TranscriptStyleError(
            f"{variable}={path} holds {recorded} targets but TRANSCRIPT_STYLE="
            f"{config.TRANSCRIPT_STYLE}: rebuild it (build_manifest.py, make_train_val.py) with "
            f"this TRANSCRIPT_STYLE, or set TRANSCRIPT_STYLE={recorded}"
        )
    if config.TRANSCRIPT_STYLE == "auto":
        mismatch = base_mismatch(recorded)
        if mismatch:
            log.warning("%s: %s", variable, mismatch)
    return recorded


def record_style(model, style: str | None) -> None:
    """Write ``style`` into ``model``'s config (``CONFIG_KEY``), which its checkpoints and .nemo
    exports carry; None removes what its base's config said."""
    from omegaconf import open_dict

    with open_dict(model.cfg):
        if style is None:
            model.cfg.pop(CONFIG_KEY, None)
        else:
            model.cfg[CONFIG_KEY] = style
