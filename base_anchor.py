"""Keeping a finetune near its base: a frozen copy of the base as the finetune received it, the
distillation that keeps the encoder's output (DISTILL_WEIGHT) and the joint's distribution over the
pieces (DISTILL_JOINT_WEIGHT) on the base's languages close to the copy's, and the pull of the
base's weights back toward the copy's (L2SP_WEIGHT).

The copy is taken by ``FrozenBase.of`` from the model ``asr_model.build_model`` returns, before any
update: the base through its vocabulary change, which decodes the base's languages exactly as the
base. A resumed job builds the same model from INIT_MODEL before the checkpoint's weights are
loaded, so its copy is the same. The copy is no submodule of the model it anchors: DDP, the
optimizer and the checkpoints never see it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Sequence

import torch

import asr_model
import config

log = logging.getLogger(__name__)

# The modules whose weights a reduced-precision copy holds in that precision: those autocast
# computes in it (their weights are cast to it at every call anyway). Every other parameter (norms,
# attention's position biases, the prediction network's embedding and LSTM) stays as the model's.
_REDUCED_MODULES = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)


def copy_dtype(precision: str) -> torch.dtype | None:
    """The dtype the frozen copy's matrix weights are kept in under PRECISION ``precision``: the
    dtype autocast computes them in (bf16 or float16), None (as the model's own) otherwise."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


class FrozenBase:
    """A frozen copy of every part of a model that has weights (encoder, decoder, joint, a hybrid's
    CTC decoder), by the model's own names (``encoder.layers.0...``), in eval mode, with no
    gradients. ``weights``: name -> the copy's tensor, for each of the model's parameters."""

    def __init__(self, parts: dict[str, torch.nn.Module]):
        self.parts = torch.nn.ModuleDict(parts)
        self.parts.eval().requires_grad_(False)
        self.weights = dict(self.parts.named_parameters())

    @classmethod
    def of(cls, model, dtype: torch.dtype | None = None) -> FrozenBase:
        """The copy of ``model`` as it is now; with ``dtype``, the weights of its linear and
        convolution layers in that dtype (what autocast casts them to at every call: under
        autocast the copy computes what a float32 copy computes, in about half the memory)."""
        parts = {
            name: copy.deepcopy(module)
            for name, module in model.named_children()
            if any(True for _ in module.parameters())
        }
        base = cls(parts)
        if dtype is not None:
            for module in base.parts.modules():
                if not isinstance(module, _REDUCED_MODULES):
                    continue
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(dtype)
            base.weights = dict(base.parts.named_parameters())
        return base

    def to(self, device) -> FrozenBase:
        self.parts.to(device)
        self.weights = dict(self.parts.named_parameters())
        return self

    @property
    def encoder(self) -> torch.nn.Module:
        return self.parts["encoder"]

    def nbytes(self) -> int:
        """Bytes of the copy's parameters and buffers."""
        tensors = list(self.parts.parameters()) + list(self.parts.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)


# ---- distillation on the base's languages --------------------------------------------------------


def base_rows(langs: Sequence[str], base_languages: Sequence[str] | None) -> list[int]:
    """Indices of the utterances of ``langs`` in one of ``base_languages``."""
    wanted = set(base_languages or ())
    return [i for i, lang in enumerate(langs) if lang in wanted]


def encoder_distance(
    student: torch.Tensor, teacher: torch.Tensor, lengths: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """The distillation term of encoder outputs ``student`` and ``teacher`` [b, D, T] of the same b
    utterances (valid frames ``lengths`` [b]): per utterance the mean over its valid frames and
    the D channels of the squared difference, summed over the b utterances and divided by
    ``batch_size``, the micro-batch's utterances (the training loss's mean over the batch, so an
    utterance weighs the same in both). Gradients flow into ``student`` only."""
    frames = torch.arange(student.shape[-1], device=student.device)
    valid = (frames[None, :] < lengths[:, None]).to(student.dtype)  # [b, T]
    squared = (student.float() - teacher.detach().float()).pow(2).mean(dim=1)  # [b, T]
    per_utterance = (squared * valid).sum(dim=1) / lengths.clamp(min=1).to(squared.dtype)
    return per_utterance.sum() / max(batch_size, 1)


@contextlib.contextmanager
def encoder_input(model):
    """Capture what ``model``'s encoder is called with in the block (its audio features after
    the preprocessor and SpecAugment, and their lengths): the dict gets "signal" and "length"."""
    seen: dict[str, torch.Tensor] = {}

    def grab(module, args, kwargs):
        seen["signal"] = kwargs["audio_signal"] if "audio_signal" in kwargs else args[0]
        seen["length"] = kwargs["length"] if "length" in kwargs else args[1]

    handle = asr_model.encoder(model).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def joint_divergence(
    model,
    base: FrozenBase,
    student_encoded: torch.Tensor,
    teacher_encoded: torch.Tensor,
    encoded_len: torch.Tensor,
    tokens: torch.Tensor,
    token_len: torch.Tensor,
    batch_size: int,
) -> torch.Tensor:
    """The joint's distillation term of b utterances: KL(the base's || the finetune's) between the
    two models' distributions over the pieces and blank (the durations left out) at every cell
    (t, u) of the transducer's lattice (frame t < the utterance's frames, u <= its pieces, each
    model's prediction network reading the same target pieces), per utterance the mean over its
    cells, summed and divided by ``batch_size``. The finetune's probability of a piece the base
    lacked, where the base gives it next to none, is what the term charges most. Gradients flow
    into the finetune's decoder and joint (and ``student_encoded``)."""
    blank = int(model.decoder.blank_idx)
    decoded, _, _ = model.decoder(targets=tokens, target_length=token_len)
    with asr_model._logits_for_the_loss(model.joint):
        student = model.joint.joint(student_encoded.transpose(1, 2), decoded.transpose(1, 2))
    with torch.no_grad():
        base_decoder, base_joint = base.parts["decoder"], base.parts["joint"]
        decoded_t, _, _ = base_decoder(targets=tokens, target_length=token_len)
        with asr_model._logits_for_the_loss(base_joint):
            teacher = base_joint.joint(teacher_encoded.transpose(1, 2), decoded_t.transpose(1, 2))
        log_t = torch.log_softmax(teacher[..., : blank + 1].float(), dim=-1)
    log_s = torch.log_softmax(student[..., : blank + 1].float(), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=-1)  # [b, T, U+1]
    frames = torch.arange(kl.shape[1], device=kl.device)
    steps = torch.arange(kl.shape[2], device=kl.device)
    valid = (frames[None, :, None] < encoded_len[:, None, None]) & (
        steps[None, None, :] <= token_len.to(kl.device)[:, None, None]
    )
    cells = valid.sum(dim=(1, 2)).clamp(min=1)
    per_utterance = (kl * valid).sum(dim=(1, 2)) / cells
    return per_utterance.sum() / max(batch_size, 1)


def distilled_loss(
    model,
    batch,
    base: FrozenBase,
    base_languages: Sequence[str] | None,
    weight: float,
    *,
    encoder_frozen: bool,
    joint_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the training loss of ``batch`` plus the distillation terms, what they added) on the
    utterances of ``base_languages``: ``weight`` x ``encoder_distance`` of the encoder's output
    against the frozen ``base``'s encoder on the very same features (the same SpecAugment masks;
    while the encoder trains), and ``joint_weight`` x ``joint_divergence`` of the joint's
    distribution against the base's (the encoder frozen too: the decoder and joint train then).
    None for what they added, and the plain loss, where nothing is distilled: no utterance of a
    base language, or neither term on (weight 0, or the encoder term alone with the encoder
    frozen, when it is the base's)."""
    rows = base_rows(batch.langs, base_languages)
    encoder_on = weight > 0 and not encoder_frozen
    joint_on = joint_weight > 0
    if not rows or not (encoder_on or joint_on):
        return asr_model.training_loss(model, batch, encoder_frozen=encoder_frozen), None
    # A frozen encoder needs no autograd graph, as in asr_model.training_loss.
    with (
        torch.no_grad() if encoder_frozen else contextlib.nullcontext(),
        encoder_input(model) as seen,
    ):
        encoded, encoded_len = model.forward(
            input_signal=batch.signal, input_signal_length=batch.signal_len
        )
    loss = asr_model.family(model).loss_of_encoded(model, encoded, encoded_len, batch)
    at = torch.tensor(rows, device=encoded.device)
    if encoder_frozen:
        teacher = encoded[at]  # the frozen encoder is the base's own
    else:
        with torch.no_grad():
            teacher, _ = base.encoder(audio_signal=seen["signal"][at], length=seen["length"][at])
    added = torch.zeros((), device=encoded.device)
    if encoder_on:
        added = added + weight * encoder_distance(
            encoded[at], teacher, encoded_len[at], len(batch.langs)
        )
    if joint_on:
        added = added + joint_weight * joint_divergence(
            model,
            base,
            encoded[at],
            teacher,
            encoded_len[at],
            batch.tokens[at],
            batch.token_len[at],
            len(batch.langs),
        )
    return loss + added, added.detach()


# ---- L2-SP: the base's weights pulled toward the base ----------------------------------------------


class PullTowardBase:
    """L2SP_WEIGHT: after every optimizer step, each weight the base had moves toward its value in
    the base by ``weight`` x its group's LR x its distance from it (the decoupled form of an L2
    penalty toward the starting point, as AdamW decouples weight decay: the pull does not pass
    through Adam's normalization). The rows of pieces the base lacked (``new_rows``: parameter ->
    row indices) are not pulled: the base had no value for them. A parameter that took no step
    (no gradient: frozen, or a skipped step) is left as it is. Registered as an optimizer step
    post-hook by ``attach``."""

    def __init__(
        self,
        named: Sequence[tuple[str, torch.nn.Parameter]],
        base: FrozenBase,
        weight: float,
        new_rows: Sequence[tuple[torch.nn.Parameter, torch.Tensor]] = (),
    ):
        self.weight = float(weight)
        self.base = base
        self.named = [(n, p) for n, p in named if n in base.weights]
        self.new_rows = {id(p): rows for p, rows in new_rows}

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        if self.weight > 0:
            optimizer.register_step_post_hook(self._pull)

    @torch.no_grad()
    def _pull(self, optimizer, args, kwargs) -> None:
        lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
        for name, p in self.named:
            if p.grad is None or id(p) not in lr_of:
                continue
            start = self.base.weights[name]
            if start.device != p.device:  # the copy follows the model to its device once
                self.base.to(p.device)
                start = self.base.weights[name]
            delta = p.detach().float() - start.float()
            rows = self.new_rows.get(id(p))
            if rows is not None:
                delta[rows] = 0
            p.sub_((lr_of[id(p)] * self.weight * delta).to(p.dtype))


def levers() -> dict[str, float]:
    """The knobs that keep a finetune near its base, with their values."""
    return {
        "DISTILL_WEIGHT": config.DISTILL_WEIGHT,
        "DISTILL_JOINT_WEIGHT": config.DISTILL_JOINT_WEIGHT,
        "L2SP_WEIGHT": config.L2SP_WEIGHT,
    }


def frozen_base(model, precision: str | None = None) -> FrozenBase | None:
    """The frozen copy of ``model`` (the base as received) that the ``levers`` keep a run near,
    None when all are 0: what train.py trains with, and what a check of its step (preflight, the
    step bench) must hold too. Its matrix weights are in the dtype ``precision`` (default
    PRECISION) computes them in, unless L2SP_WEIGHT pulls toward them (then exact). ConfigError
    for any of them without a base (INIT_MODEL empty)."""
    weights = levers()
    if all(w <= 0 for w in weights.values()):
        return None
    named = " and ".join(f"{k}={v:g}" for k, v in weights.items() if v > 0)
    if config.BASE_ADAPTER_DIM > 0:
        raise config.ConfigError(
            f"{named} keep a finetune near its base, and BASE_ADAPTER_DIM="
            f"{config.BASE_ADAPTER_DIM} already holds every weight of the base as it is: set them "
            "to 0, or BASE_ADAPTER_DIM=0"
        )
    if getattr(model, "base_model", None) is None:
        raise config.ConfigError(
            f"{named} keep a finetune near its base, and this run has none (INIT_MODEL is "
            f"empty): set them to 0 or give the base in INIT_MODEL"
        )
    return FrozenBase.of(model, run_copy_dtype(precision or config.PRECISION))


def run_copy_dtype(precision: str) -> torch.dtype | None:
    """The dtype of a run's copy under ``precision``: ``copy_dtype``'s, or None (exact) where
    L2SP_WEIGHT pulls toward the copy's weights."""
    return None if config.L2SP_WEIGHT > 0 else copy_dtype(precision)


def describe(weights: dict[str, float], base: FrozenBase | None) -> str | None:
    """The start-up phrase of what keeps the run near its base (``weights``: ``levers``), None
    when nothing does."""
    distill_weight = weights.get("DISTILL_WEIGHT", 0.0)
    joint_weight = weights.get("DISTILL_JOINT_WEIGHT", 0.0)
    l2sp_weight = weights.get("L2SP_WEIGHT", 0.0)
    parts = []
    if distill_weight > 0:
        parts.append(
            f"the encoder's output on the base's languages distilled from a frozen copy of the "
            f"base at DISTILL_WEIGHT={distill_weight:g}"
        )
    if joint_weight > 0:
        parts.append(
            f"the joint's distribution over the pieces on the base's languages distilled from "
            f"the copy at DISTILL_JOINT_WEIGHT={joint_weight:g}"
        )
    if l2sp_weight > 0:
        parts.append(
            f"the base's weights pulled toward the base at L2SP_WEIGHT={l2sp_weight:g} x the LR "
            f"per step"
        )
    if not parts:
        return None
    size = f" (the copy: {base.nbytes() / 2**20:.0f} MiB per rank)" if base is not None else ""
    return "; ".join(parts) + size
