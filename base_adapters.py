"""The frozen-base mode (BASE_ADAPTER_DIM): a finetune that keeps every weight its base had as it
was, and learns the new languages in NeMo adapters and in the new pieces' rows alone.

``add_adapters`` turns the model ``asr_model.build_model`` made from the base (through its
vocabulary extension) into such a model: the encoder becomes NeMo's adapter-capable class with the
same weights, a ``LinearAdapter`` of BASE_ADAPTER_DIM goes into each encoder layer, the prediction
network and the joint (NeMo's ``add_adapter``), and every parameter the base had stops taking
gradients. The rows of the vocabulary's parts (the prediction network's embedding, the joint's
output) hold the base's pieces and the new ones in one tensor: the new rows train, and
``HeldRows`` puts the base's rows back after every optimizer step, so that AdamW's weight decay
cannot move them either. BatchNorm keeps the base's statistics (``hold_statistics``).

The model records which languages are the base's (``record``, in its config under ``CONFIG_KEY``,
so every checkpoint and .nemo carries it). Decoding (``decoding.decode_batch``) writes an utterance
of a base language with the adapters off and only the base's pieces: the base's own decoding,
bit for bit (``base_decoding``); every other language with the adapters on, which is also how
auto decoding names the language. NeMo's own tools load the exported .nemo with its adapters on.

Usage::

    add_adapters(model, dim=32, languages=("en",), base_pieces=pieces_before_the_extension)
    record_of(model)           # {"languages": ("en",), "pieces": 1024, "scripts": {}}; or None
    with adapters_off(model): ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

import config

# The key of a frozen-base model's config (and so of its .nemo's model_config.yaml) that names
# the base's languages and how many pieces the base had (the first ones of the vocabulary).
CONFIG_KEY = "frozen_base"
# One adapter per part that NeMo lets carry one: every encoder layer, the prediction network's
# output and the joint's hidden layer.
ADAPTER_NAMES = ("encoder:new_languages", "decoder:new_languages_pred", "joint:new_languages_joint")
# The adapter class (a checkpoint's description allows it: asr_model.DESCRIPTION_ADAPTER_TARGETS).
ADAPTER_CLASS = "nemo.collections.common.parts.adapter_modules.LinearAdapter"


def record_of(model) -> dict | None:
    """{"languages": the base's languages, "pieces": how many pieces the base had, "scripts":
    language -> the scripts the base records it written in} of a frozen-base model; None for any
    other model."""
    cfg = getattr(model, "cfg", None)
    held = cfg.get(CONFIG_KEY) if cfg is not None and hasattr(cfg, "get") else None
    if not held:
        return None
    scripts = held.get("scripts") or {}
    return {
        "languages": tuple(str(lang) for lang in held["languages"]),
        "pieces": int(held["pieces"]),
        "scripts": {str(lang): frozenset(str(s) for s in v) for lang, v in scripts.items()},
    }


def is_adapter_parameter(name: str) -> bool:
    """True for a parameter of a NeMo adapter (they live in each module's ``adapter_layer``)."""
    return ".adapter_layer." in f".{name}"


def add_adapters(
    model,
    dim: int,
    languages: Sequence[str],
    base_pieces: Sequence[str],
    piece_rows: Sequence[torch.nn.Parameter],
) -> None:
    """Make ``model`` (the base as ``asr_model.build_model`` carried it onto its vocabulary)
    a frozen-base model with adapters of hidden size ``dim``, recording ``languages`` as the
    base's. ``base_pieces``: the base's vocabulary, which must be the first pieces of the model's
    (an extension: each base piece at its own id); ``piece_rows``: the vocabulary's parts (the
    family's ``piece_rows``), which keep training for the rows of the new pieces (none: no new
    piece).
    ConfigError naming what to change where the model cannot be one."""
    import vocabulary

    if not languages:
        raise config.ConfigError(
            "BASE_ADAPTER_DIM decodes the base's languages with the adapters off, and the base's "
            "languages are unknown: set BASE_LANGUAGES (e.g. BASE_LANGUAGES=en)"
        )
    if record_of(model) is not None or _has_adapters(model):
        raise config.ConfigError(
            "BASE_ADAPTER_DIM: INIT_MODEL already has adapters; finetune from the base it was "
            "made from, or set BASE_ADAPTER_DIM=0"
        )
    pieces = vocabulary.model_pieces(model) or []
    if list(pieces[: len(base_pieces)]) != list(base_pieces):
        raise config.ConfigError(
            "BASE_ADAPTER_DIM needs TOKENIZER_DIR to extend the base's tokenizer (each base piece "
            "at its own id), so that the base's languages decode with the base's own pieces: "
            "train it with INIT_MODEL set (scripts/train_tokenizer.py, TOKENIZER_MODE=auto)"
        )
    _use_adapter_encoder(model)
    for name in ADAPTER_NAMES:
        model.add_adapter(
            name,
            {
                "_target_": ADAPTER_CLASS,
                "in_features": -1,  # each part sets its own width
                "dim": int(dim),
                "activation": "swish",
                "norm_position": "pre",
                "dropout": 0.0,
            },
        )
    model.set_enabled_adapters(enabled=True)
    from omegaconf import open_dict

    # The scripts the base records for its languages, before the run records its own: the base
    # decodes a language given with them (none recorded: with every piece).
    scripts = vocabulary.language_scripts(model)
    with open_dict(model.cfg):
        model.cfg[CONFIG_KEY] = {
            "languages": list(languages),
            "pieces": len(base_pieces),
            "scripts": {lang: sorted(scripts[lang]) for lang in languages if lang in scripts},
        }
    hold_weights(model, piece_rows)


def _has_adapters(model) -> bool:
    return any(is_adapter_parameter(name) for name, _ in model.named_parameters())


def _use_adapter_encoder(model) -> None:
    """Replace the encoder by NeMo's adapter-capable class of it (ConformerEncoderAdapter for a
    ConformerEncoder), with the same config and weights."""
    from nemo.core.classes.mixins import adapter_mixins
    from omegaconf import open_dict

    encoder = model.encoder
    if isinstance(encoder, adapter_mixins.AdapterModuleMixin):
        return
    registered = adapter_mixins.get_registered_adapter(type(encoder))
    if registered is None:
        raise config.ConfigError(
            f"BASE_ADAPTER_DIM: NeMo has no adapter class for this model's encoder "
            f"({type(encoder).__name__}); set BASE_ADAPTER_DIM=0"
        )
    cls = registered.adapter_class
    with open_dict(model.cfg):
        model.cfg.encoder._target_ = f"{cls.__module__}.{cls.__name__}"
    adapted = model.from_config_dict(model.cfg.encoder)
    adapted.load_state_dict(encoder.state_dict())
    adapted.train(encoder.training)
    for attribute in ("sync_max_audio_length",):
        if hasattr(encoder, attribute):
            setattr(adapted, attribute, getattr(encoder, attribute))
    model.encoder = adapted


def hold_weights(model, piece_rows: Sequence[torch.nn.Parameter]) -> None:
    """No gradient for any parameter of ``model`` but the adapters' and ``piece_rows`` (whose base
    rows ``HeldRows`` holds); BatchNorm in eval mode."""
    rows = {id(p) for p in piece_rows}
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_parameter(name) or id(p) in rows)
    hold_statistics(model)


def hold_statistics(model) -> None:
    """Every BatchNorm of ``model`` in eval mode: its running statistics are the base's and stay so
    (call again after anything puts the model into train mode)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()


def set_encoder_adapters_trainable(model, trainable: bool) -> None:
    """Phase 1 freezes the encoder's adapters, phase 2 trains them; the base's encoder weights
    never train and its BatchNorm statistics never change."""
    encoder = model.encoder
    for name, p in encoder.named_parameters():
        p.requires_grad_(trainable and is_adapter_parameter(name))
    encoder.train(trainable)
    hold_statistics(encoder)


class HeldRows:
    """The base's rows of the vocabulary's parts, put back after every optimizer step: for each
    (parameter, rows of the new pieces) of ``new_rows`` (``asr_model.new_piece_parameters``), the
    parameter's other rows (the base's pieces, blank and the durations) end each step as they began
    the run. Registered as an optimizer step post-hook by ``attach``."""

    def __init__(self, new_rows: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]):
        self.held = []
        for p, rows in new_rows:
            keep = torch.ones(p.shape[0], dtype=torch.bool)
            keep[rows.cpu()] = False
            index = keep.nonzero().squeeze(1)
            self.held.append((p, index, p.detach()[index.to(p.device)].clone()))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(self._restore)

    @torch.no_grad()
    def _restore(self, optimizer, args, kwargs) -> None:
        for k, (p, index, values) in enumerate(self.held):
            if values.device != p.device:  # the rows follow the model to its device once
                index, values = index.to(p.device), values.to(p.device)
                self.held[k] = (p, index, values)
            p.index_copy_(0, index, values.to(p.dtype))


@contextlib.contextmanager
def adapters_off(model):
    """Every adapter of ``model`` off for the block (the base's own forward), on again after."""
    model.set_enabled_adapters(enabled=False)
    try:
        yield model
    finally:
        model.set_enabled_adapters(enabled=True)


def describe(record: dict, dim: int) -> str:
    """The start-up phrase of the frozen-base mode."""
    return (
        f"the base's weights held as they are; LinearAdapters of BASE_ADAPTER_DIM={dim} in every "
        f"encoder layer, the prediction network and the joint, and the new pieces' rows learn the "
        f"new languages; {', '.join(record['languages'])} decode with the adapters off (exactly "
        f"the base)"
    )
