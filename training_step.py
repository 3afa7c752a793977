"""What one optimizer step of train.py does: the LightningModule, its data and its LR schedule.

``TrainingModule`` owns the step (loss via ``asr_model``, fault skipping, BatchNorm averaging over
ranks), its DataLoader (``build_dataset`` + ``build_dataloader``: LocalShardDataset batched by
DurationBucketBatchSampler for this rank) and AdamW with ``lr_at_step``. train.py wires it to a
Trainer and the callbacks; benchmarks use it directly.

What callbacks read from it, on every rank: ``model`` (the NeMo model), ``dataset``, ``sampler``;
``skipped_steps`` (same on all ranks), ``empty_micro_batches``, ``nonfinite_losses`` and
``bad_audio`` (Counter by reason, this rank); ``last_loss`` (what the last micro-batch computed:
non-finite when it was, 0 for an empty one), ``last_grad_norm``
(before clipping, of the last optimizer step), ``phase`` (1 or 2). The batch itself (an
``AsrBatch`` with langs and durations) reaches ``on_train_batch_end`` of every callback.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist

import asr_model
import base_adapters
import base_anchor
import checkpoints
import collectives
import config
import decoding
import process_control
import step_speed

log = logging.getLogger("train")


# ---- learning rate ------------------------------------------------------------------------------


def lr_at_step(
    step: int,
    *,
    warmup_steps: int,
    phase1_lr: float,
    unfreeze_step: int,
    phase2_warmup: int,
    phase2_lr: float,
    min_lr: float,
    max_steps: int,
) -> float:
    """LR of optimizer step ``step`` (0-based).

    Phase 1 (step < unfreeze_step): linear warmup over ``warmup_steps`` to ``phase1_lr``, then flat.
    Phase 2: linear warmup over ``phase2_warmup`` to ``phase2_lr``, then cosine decay reaching
    ``min_lr`` at ``max_steps`` (and staying there). The first step of each warmup gets
    peak / warmup, never 0, so no step is wasted.
    """
    if step < unfreeze_step:
        if step < warmup_steps:
            return phase1_lr * (step + 1) / warmup_steps
        return phase1_lr
    s = step - unfreeze_step
    if s < phase2_warmup:
        return phase2_lr * (s + 1) / phase2_warmup
    decay_steps = max_steps - unfreeze_step - phase2_warmup
    progress = min(1.0, (s - phase2_warmup) / decay_steps) if decay_steps > 0 else 1.0
    return min_lr + 0.5 * (phase2_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def new_piece_scale_at_step(step: int, *, scale: float, warmup: int, decay: int) -> float:
    """The factor on AdamW's step of the new pieces' rows at optimizer step ``step`` (0-based): their
    LR is ``lr_at_step(step)`` times it, every other row's ``lr_at_step(step)``.

    With ``warmup`` and ``decay`` 0 it is ``scale`` at every step. Over the first ``warmup`` steps
    it ramps linearly from 1 to ``scale`` (step s: 1 + (scale - 1) * (s + 1) / warmup, so the first
    step already adds, as ``lr_at_step``'s warmups do); then, with ``decay`` > 0, it falls by cosine
    from ``scale`` to 1 over the next ``decay`` steps and stays 1.
    """
    if step < warmup:
        share = (step + 1) / warmup
    elif decay > 0:
        progress = min(1.0, (step - warmup) / decay)
        share = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        return scale
    return 1.0 + (scale - 1.0) * share


def describe_new_piece_schedule() -> str:
    """How the new pieces' rows step under the current settings, for the run's start-up log."""
    text = f"NEW_PIECE_LR_SCALE={config.NEW_PIECE_LR_SCALE:g} x the LR"
    if config.NEW_PIECE_WARMUP > 0:
        text += f", ramped in from 1x over NEW_PIECE_WARMUP={config.NEW_PIECE_WARMUP} steps"
    if config.NEW_PIECE_DECAY > 0:
        text += f", then back to 1x by cosine over NEW_PIECE_DECAY={config.NEW_PIECE_DECAY} steps"
    return text


def lr_schedule_from_config():
    """``lr_at_step`` with every keyword taken from config.py at call time."""
    kwargs = dict(
        warmup_steps=config.WARMUP_STEPS,
        phase1_lr=config.PHASE1_LR,
        unfreeze_step=config.UNFREEZE_STEP,
        phase2_warmup=config.PHASE2_WARMUP,
        phase2_lr=config.PHASE2_LR,
        min_lr=config.MIN_LR,
        max_steps=config.MAX_STEPS,
    )
    return lambda step: lr_at_step(step, **kwargs)


def tokenizer_summary() -> dict:
    """How TOKENIZER_DIR was made (train_tokenizer.py's summary.json: mode, base and counts), or {}."""
    import json

    try:
        summary = json.loads((Path(config.TOKENIZER_DIR) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return {
        "mode": summary.get("mode", "new"),
        "vocab_size": summary.get("vocab_size"),
        **({"extension": summary["extension"]} if "extension" in summary else {}),
    }


class NoTrainingData(process_control.UserError, RuntimeError):
    """The run cannot learn: no audio of its manifest can be read (at start-up, or for
    MAX_EMPTY_STEPS optimizer steps in a row)."""


def check_audio_sample(
    dataset, *, samples: int, rank: int = 0, manifest=None
) -> list[tuple[str, str]]:
    """Open ``samples`` random audio files of ``dataset`` (seeded by ``rank``): NoTrainingData when
    none can be read, naming the directories they were expected in; a warning when some cannot.
    Returns the unreadable ones as (path, reason)."""
    import soundfile as sf

    n = len(dataset)
    if samples <= 0 or n == 0:
        return []
    picks = np.random.default_rng(1000 + rank).choice(n, size=min(samples, n), replace=False)
    bad = []
    for i in picks:
        path = dataset.audio_path(int(i))
        try:
            sf.info(path)
        except Exception as exc:  # libsndfile reports each failure its own way
            bad.append((path, "no such file" if not os.path.exists(path) else str(exc)))
    if len(bad) == len(picks):
        dirs = sorted({os.path.dirname(p) for p, _ in bad})
        raise NoTrainingData(
            f"rank {rank}: none of {len(picks)} sampled audio files of {manifest or 'the manifest'} "
            f"can be read (first: {bad[0][0]}: {bad[0][1]}); expected under {dirs[0]}"
            f"{f' and {len(dirs) - 1} other directories' if len(dirs) > 1 else ''}. Check DATA_DIR / "
            f"SHARDS_DIR on this node and run scripts/extract_audio.py (AUDIO_CHECK_SAMPLES=0 skips "
            f"this check)"
        )
    if bad:
        log.warning(
            "rank %d: %d of %d sampled audio files cannot be read (first: %s: %s); they are skipped "
            "as bad audio",
            rank,
            len(bad),
            len(picks),
            *bad[0],
        )
    return bad


def group_lr_scales() -> list[float]:
    """The LR of each of ``parameter_groups``' groups as a multiple of ``lr_at_step``'s: decoder and
    joint 1, the encoder ENCODER_LR_SCALE."""
    return [1.0, config.ENCODER_LR_SCALE]


def parameter_groups(model) -> list[dict]:
    """AdamW's parameter groups: [0] every parameter outside the encoder (decoder, joint, ...),
    [1] the encoder's; each in ``model.parameters()`` order. The LR of group 0 is the schedule's
    (what train/lr logs), group 1's is ``group_lr_scales``' multiple of it."""
    encoder = {id(p) for p in asr_model.encoder(model).parameters()}
    params = list(model.parameters())
    return [
        {"params": [p for p in params if id(p) not in encoder]},
        {"params": [p for p in params if id(p) in encoder]},
    ]


def regroup_single_group_state(checkpoint: dict, model) -> bool:
    """Give a checkpoint whose AdamW had one parameter group (every parameter, in
    ``model.parameters()`` order: this app before ``parameter_groups``) that layout, in place, so
    its moments resume under today's groups; its LambdaLR gets one base LR per group. True when
    it changed something."""
    states = checkpoint.get("optimizer_states") or []
    if len(states) != 1 or len(states[0].get("param_groups", ())) != 1:
        return False
    groups = parameter_groups(model)
    (old_group,) = states[0]["param_groups"]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    if len(old_group["params"]) != len(index):
        return False  # not this model's optimizer: Lightning's own load names the mismatch
    order = [index[id(p)] for group in groups for p in group["params"]]  # new index -> old index
    old_state = states[0].get("state", {})
    states[0]["state"] = {
        new: old_state[old_group["params"][old]]
        for new, old in enumerate(order)
        if old_group["params"][old] in old_state
    }
    start, new_groups = 0, []
    for group in groups:
        new_groups.append({**old_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    states[0]["param_groups"] = new_groups
    for scheduler in checkpoint.get("lr_schedulers") or []:
        for key in ("base_lrs", "_last_lr"):
            if isinstance(scheduler.get(key), list) and len(scheduler[key]) == 1:
                scheduler[key] = scheduler[key] * len(groups)
        if isinstance(scheduler.get("lr_lambdas"), list) and len(scheduler["lr_lambdas"]) == 1:
            scheduler["lr_lambdas"] = scheduler["lr_lambdas"] * len(groups)
    return True


class NewPieceLRScale:
    """NEW_PIECE_LR_SCALE: after every optimizer step, the change AdamW made to each row of a piece
    the base model lacked (``asr_model.new_piece_parameters``: row indices on their parameter's
    device, taken when the optimizer is configured) is multiplied by ``factor(step())``, the
    factor of the optimizer step being taken (``new_piece_scale_at_step``; ``step`` counts as the
    LR schedule does, so a resumed run goes on where it stopped); every other row keeps AdamW's own
    step. A row-wise LR: AdamW's steps do not depend on the size of the gradient, so scaling the
    gradient could not do it. A skipped step (no gradients) changes nothing, and so stays
    unchanged. Registered as the optimizer's step hooks."""

    def __init__(
        self,
        rows: list[tuple[torch.nn.Parameter, torch.Tensor]],
        factor: Callable[[int], float],
        step: Callable[[], int],
    ):
        self.rows, self.factor, self.step = rows, factor, step
        self._before: list[torch.Tensor] | None = None
        self._scale_now = 1.0

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        if self.rows:
            optimizer.register_step_pre_hook(self._remember)
            optimizer.register_step_post_hook(self._scale)

    @torch.no_grad()
    def _remember(self, optimizer, args, kwargs) -> None:
        self._scale_now = float(self.factor(self.step()))
        if self._scale_now != 1.0:
            self._before = [p[rows].clone() for p, rows in self.rows]

    @torch.no_grad()
    def _scale(self, optimizer, args, kwargs) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        for (p, rows), old in zip(self.rows, before):
            p[rows] = old + self._scale_now * (p[rows] - old)


def apply_current_lr_schedule(trainer) -> None:
    """Set every param group's LR to ``lr_at_step(global_step)`` times its ``group_lr_scales``
    under the current settings.

    A resumed run restores each group's "lr" as the checkpoint's job computed it, under that job's
    settings (LambdaLR recomputes it only after the next step): without this, the first step after
    raising MAX_STEPS or changing an LR knob would still use the old schedule.
    """
    schedule = lr_schedule_from_config()
    for optimizer in trainer.optimizers:
        scales = group_lr_scales() if len(optimizer.param_groups) > 1 else [1.0]
        for group, scale in zip(optimizer.param_groups, scales):
            group["lr"] = schedule(trainer.global_step) * scale


# ---- the LightningModule ---------------------------------------------------------------------

RUN_RECORD_KEY = checkpoints.RUN_RECORD_KEY  # where a step checkpoint holds ``run_record``


class TrainingModule(pl.LightningModule):
    """Trains a NeMo model (one of asr_model.FAMILIES) on our AsrBatch micro-batches, unchanged.

    NeMo's own training_step, data setup and optimizer config are not used: this module owns the
    step, the DataLoader and AdamW + ``lr_at_step``. See the module docstring for the attributes
    monitoring callbacks read.
    """

    def __init__(self, model, batching=None, speed=None, base=None):
        super().__init__()
        self.model = model
        # base_anchor.FrozenBase of the base as received (None: nothing distilled or pulled):
        # kept outside the module's children, so DDP, the optimizer and checkpoints never see it.
        self.frozen_base = base
        self.distill_weight = config.DISTILL_WEIGHT if base is not None else 0.0
        self.distill_joint_weight = config.DISTILL_JOINT_WEIGHT if base is not None else 0.0
        self.last_distill: torch.Tensor | None = None  # this micro-batch's term, None if none
        # The sampler's settings (sampler.BatchingSettings): train.py passes the knobs it read.
        self.batching = batching if batching is not None else _batching_from_config()
        # How the step runs (step_speed.SpeedSettings), applied to the model it trains right here.
        self.speed = speed if speed is not None else step_speed.SpeedSettings.from_config()
        self.speed_changes = step_speed.apply_to_model(model, self.speed)
        self.dataset = None
        self.sampler = None
        # train.finetuning_trade_off of this run (None: not a finetune learning new languages):
        # in the W&B settings and the model card
        self.finetuning_trade_off: str | None = None
        self.encoder_frozen = False  # set by enter_phase
        self.phase = 2
        self.skipped_steps = 0
        self.empty_micro_batches = 0
        self.nonfinite_losses = 0
        self.bad_audio: collections.Counter = collections.Counter()
        self.last_loss: torch.Tensor | None = None
        self.last_grad_norm: float | None = None
        # The gradient norm of this optimizer step, for configure_gradient_clipping.
        self._grad_norm: torch.Tensor | None = None
        # (loss on the device, micro-batch, langs, durations) of this rank's micro-batches since the
        # last optimizer step: their finiteness is read once, at the step boundary.
        self._window_losses: list[tuple] = []
        self._window_utterances = 0  # real utterances of this rank since the last optimizer step
        # BatchNorm buffers when the window began, restored when the step is skipped.
        self._window_buffers: dict[str, torch.Tensor] | None = None
        self._batchnorms: list[tuple[str, torch.nn.Module]] | None = None
        self.stop_agreed = False  # a rank received a stop signal: save after this step and stop
        self.empty_steps_in_a_row = 0  # optimizer steps with no utterance on any rank
        # {"step", "results": {lang: ErrorCounts fields}, "loss"} of the newest validation
        # (callbacks.PerLanguageWERCallback): in every checkpoint and the model card
        self.last_evaluation: dict | None = None
        # The same for the validation at step 0 (EVAL_BASE): the base model before any update, so the
        # run's summary and the model card can state base vs finetuned per language.
        self.base_evaluation: dict | None = None
        self._portable: dict | None = None  # asr_model.portable_description, made at the first save
        # The base's path, weights hash and build settings (asr_model.base_identity), as the run's
        # first job loaded it; a resume carries the checkpoint's (on_load_checkpoint).
        self.base_model: dict | None = getattr(model, "base_model", None)
        self._training_hours: dict[str, float] | None = None

    def enter_phase(self, phase: int) -> None:
        """Phase 1: the encoder frozen (``asr_model.set_encoder_trainable``), run without autograd;
        phase 2: everything trains. Call at every batch start: Lightning puts the whole module back
        into train mode, and BatchNorm in train mode updates its statistics even with frozen weights."""
        asr_model.set_encoder_trainable(self.model, phase != 1)
        self.encoder_frozen = phase == 1
        self.phase = phase

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Every step checkpoint carries what rebuilds the model alone (``asr_model.PORTABLE_KEY``)
        and what its model card says (``run_record``)."""
        if self._portable is None:
            self._portable = asr_model.portable_description(self.model)
        checkpoint[asr_model.PORTABLE_KEY] = self._portable
        checkpoint[RUN_RECORD_KEY] = self.run_record()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if regroup_single_group_state(checkpoint, self.model):
            log.info(
                "the checkpoint's optimizer had one parameter group: split into the encoder's and "
                "the rest's, with its moments"
            )
        record = checkpoint.get(RUN_RECORD_KEY, {})
        self.last_evaluation = record.get("evaluation")
        self.base_evaluation = record.get("base_evaluation")
        # The base as the run's first job recorded it (None: from before bases were recorded); where
        # this job loaded the very same weights, at the path it found them (a run moved to another
        # machine exports there without naming its base).
        recorded, loaded = record.get("base_model"), getattr(self.model, "base_model", None)
        if recorded and loaded and loaded["weights_sha256"] == recorded["weights_sha256"]:
            recorded = {**recorded, "path": loaded["path"]}
        self.base_model = recorded

    def run_record(self) -> dict:
        """The run as a model card tells it: its name and W&B id, the base model it started from
        (path, weights hash, build settings), how the vocabulary changed from the base model's (the
        tokenizer's mode, the carried and new rows), settings (numbers as numbers),
        hours of training audio per language, the step, the world size, the newest validation and the
        validation at step 0 (the base, when EVAL_BASE ran it), and which side of the finetuning
        trade-off the run took."""
        if self._training_hours is None and self.dataset is not None:
            names, codes = self.dataset.lang_names, self.dataset.lang_codes
            seconds = np.bincount(codes, weights=self.dataset.durations, minlength=len(names))
            self._training_hours = {n: float(s) / 3600 for n, s in zip(names, seconds) if s > 0}
        trainer = self._trainer
        identity = checkpoints.read_run_record()
        return {
            "run": {k: identity[k] for k in ("name", "wandb_id") if k in identity},
            "vocabulary_change": getattr(self.model, "vocabulary_change", None),
            "finetuning_trade_off": self.finetuning_trade_off,
            "base_model": self.base_model,
            "tokenizer": tokenizer_summary(),
            "settings": config.run_settings(),
            "training_hours": self._training_hours or {},
            "step": int(trainer.global_step) if trainer is not None else None,
            "world_size": int(trainer.world_size) if trainer is not None else None,
            "evaluation": self.last_evaluation,
            "base_evaluation": self.base_evaluation,
        }

    def on_fit_start(self):
        if self.frozen_base is not None:
            self.frozen_base.to(self.device)
        # Before the dataset is loaded: a CUDA loss that cannot run should cost seconds, not a node-hour.
        if self.device.type == "cuda":
            checked = asr_model.check_loss_on_device(self.model, self.device)
            if checked:
                log.info("rank %d: %s", self.global_rank, checked)

    # ---- data -----------------------------------------------------------------------------------
    def train_dataloader(self):
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        if collectives.is_distributed() and (dist.get_rank(), dist.get_world_size()) != (
            rank,
            world_size,
        ):
            raise RuntimeError(
                f"Lightning says rank {rank}/{world_size} but torch.distributed says "
                f"{dist.get_rank()}/{dist.get_world_size()}; check the torchrun launch"
            )
        # The training cache exists by now (prepare_training_caches ran before the process group
        # was formed): every rank only maps it, so no rank waits in a collective here.
        if self.dataset is None:  # train.py builds it before fit, to check its audio
            self.dataset = build_dataset(self.model.tokenizer)
        loader, self.sampler = build_dataloader(
            self.dataset,
            self.batching,
            world_size=world_size,
            rank=rank,
            pin_memory=self.device.type == "cuda",
        )
        if getattr(self, "resume_sampler_state", None) is not None:
            # Set from the checkpoint by callbacks.ExactResumeCallback; Lightning builds the iterator
            # right after this returns, so it yields only the epoch's remaining micro-batches.
            self.sampler.load_state_dict(self.resume_sampler_state)
            log.info(
                "rank %d: sampler resumes epoch %d at micro-batch %d",
                rank,
                self.resume_sampler_state["epoch"],
                self.resume_sampler_state["position"],
            )
            self.resume_sampler_state = None
        log_first_step(self.sampler, rank)
        return loader

    def on_train_start(self):
        apply_current_lr_schedule(self.trainer)
        # Training holds no decoding CUDA graphs (validation builds and releases its own).
        decoding.release_decoding_graphs(self.model)
        # From here a stop signal waits for the next step boundary, where the ranks save and stop.
        # Lightning installed its own SIGTERM handler at fit start, which ends the run after the
        # current micro-batch (mid-accumulation, with nothing saved): ours replaces it for the run.
        process_control.set_training(True)
        process_control.install_stop_handlers()

    def on_train_batch_start(self, batch, batch_idx):
        if self._window_buffers is None:
            # A skipped step must not keep what its forward passes did to BatchNorm statistics (a NaN
            # there would poison every later step), so they are restored from here. Only BatchNorm's:
            # no other buffer changes in a forward, and some are large (the relative-position table of
            # the full-size encoder is 41 MB).
            self._window_buffers = {
                name: b.detach().clone() for name, b in self.batchnorm_buffers()
            }

    # ---- the step -------------------------------------------------------------------------------
    def compute_loss(self, batch) -> torch.Tensor:
        """The model's loss of one non-empty micro-batch (``asr_model.training_loss``), plus the
        distillation term on its utterances of the base's languages
        (``base_anchor.distilled_loss``) when DISTILL_WEIGHT or DISTILL_JOINT_WEIGHT is on."""
        if self.distill_weight <= 0 and self.distill_joint_weight <= 0:
            return asr_model.training_loss(self.model, batch, encoder_frozen=self.encoder_frozen)
        loss, self.last_distill = base_anchor.distilled_loss(
            self.model,
            batch,
            self.frozen_base,
            self.batching.base_languages,
            self.distill_weight,
            encoder_frozen=self.encoder_frozen,
            joint_weight=self.distill_joint_weight,
        )
        return loss

    def zero_loss(self) -> torch.Tensor:
        """0 that depends on every trainable parameter: DDP sees them all used, gradients are zeros."""
        return sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0

    def training_step(self, batch, batch_idx):
        for reason, n in batch.bad_audio.items():
            self.bad_audio[reason] += n
        if batch.is_empty:
            self.empty_micro_batches += 1
            log.warning(
                "rank %d micro-batch %d: every utterance was bad audio; it contributes nothing",
                self.global_rank,
                batch_idx,
            )
            loss = self.zero_loss()
            self.last_loss = loss.detach()
        else:
            self._window_utterances += batch.batch_size
            self.last_distill = None
            loss = self.compute_loss(batch)
            # What this micro-batch computed, non-finite included (the metrics leave it out of the mean).
            self.last_loss = loss.detach()
            # Whether it is finite stays on the device until the step boundary reads the window's
            # flags in one go (a read here would stall the GPU's queue every micro-batch). A
            # non-finite loss trains as it is: its gradients are non-finite, and the step it is in
            # is skipped on every rank (on_before_optimizer_step) before they touch a weight.
            self._window_losses.append(
                (self.last_loss, batch_idx, sorted(set(batch.langs)), list(batch.durations))
            )
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Every rank reaches this point once per optimizer step, so the all-reduce cannot hang.
        # A stop signal (preemption) rides on the same all-reduce: every rank learns at this step
        # whether any rank got one, so they all save after this step and stop together.
        window, self._window_losses = self._window_losses, []
        bad = (
            torch.stack([~torch.isfinite(loss) for loss, *_ in window]).to(torch.float64)
            if window
            else torch.zeros(0, dtype=torch.float64, device=self.device)
        )
        local = torch.tensor(
            [float(self._window_utterances), float(process_control.stop_requested() is not None)],
            dtype=torch.float64,
            device=self.device,
        )
        flags = torch.cat([bad.sum().reshape(1).to(self.device), local])
        if collectives.is_distributed():
            dist.all_reduce(flags)
        params = [p for p in self.parameters() if p.grad is not None]
        grad_norm = (
            torch.nn.utils.get_total_norm([p.grad for p in params])
            if params
            else torch.zeros((), device=self.device)
        )
        self._grad_norm = grad_norm
        # The one read by the host of this step's values: the agreed flags, the gradient norm and
        # this rank's per-micro-batch finiteness.
        read = torch.cat(
            [
                flags,
                grad_norm.detach().to(self.device, torch.float64).reshape(1),
                bad.to(self.device),
            ]
        ).tolist()
        flags, self.last_grad_norm, mine = read[:3], read[3], read[4:]
        self.stop_agreed = flags[2] > 0
        self._window_utterances = 0
        for (loss, batch_idx, langs, durations), is_bad in zip(window, mine):
            if is_bad:
                self.nonfinite_losses += 1
                log.warning(
                    "rank %d micro-batch %d: loss %s (langs %s, durations %s); this optimizer step "
                    "is skipped on every rank",
                    self.global_rank,
                    batch_idx,
                    float(loss),
                    langs,
                    [round(d, 2) for d in durations],
                )
        window_buffers, self._window_buffers = self._window_buffers, None
        reason = None
        if flags[0] > 0:
            reason = f"non-finite loss on {int(flags[0])} micro-batch(es)"
        elif flags[1] == 0:
            reason = "no utterance on any rank (every micro-batch was bad audio)"
        self.empty_steps_in_a_row = self.empty_steps_in_a_row + 1 if flags[1] == 0 else 0
        limit = config.MAX_EMPTY_STEPS
        if limit and self.empty_steps_in_a_row >= limit:
            # Every rank sees the same all-reduced count, so every rank stops here together.
            raise NoTrainingData(
                f"{self.empty_steps_in_a_row} optimizer steps in a row had no utterance on any rank "
                f"(bad audio on this rank: {dict(self.bad_audio)}): the audio files are missing or "
                f"unreadable. Check DATA_DIR / SHARDS_DIR on every node and run "
                f"scripts/extract_audio.py (MAX_EMPTY_STEPS={limit})"
            )
        elif reason is None and not math.isfinite(self.last_grad_norm):
            reason = f"gradient norm {self.last_grad_norm}"
        if reason is not None:
            # No gradient at all: AdamW leaves every parameter and its moments untouched.
            for p in self.parameters():
                p.grad = None
            if window_buffers is not None:
                with torch.no_grad():
                    for name, b in self.batchnorm_buffers():
                        b.copy_(window_buffers[name])
            self.skipped_steps += 1
            if self.global_rank == 0:
                log.warning(
                    "optimizer step %d skipped on every rank: %s (%d skipped so far)",
                    self.global_step,
                    reason,
                    self.skipped_steps,
                )
        else:
            self.average_batchnorm_statistics()
            if self.encoder_frozen:
                # DDP may hand unused parameters a zero gradient; AdamW would then still decay them.
                for p in asr_model.encoder(self.model).parameters():
                    p.grad = None

    def batchnorm_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(name, buffer) of every BatchNorm running statistic: the buffers a forward pass changes."""
        if self._batchnorms is None:  # the module tree is fixed once training starts
            self._batchnorms = [
                (prefix, m)
                for prefix, m in self.named_modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            ]
        return [
            (f"{prefix}.{name}", b)
            for prefix, m in self._batchnorms
            for name, b in m.named_buffers(recurse=False)
            if b is not None
        ]

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        # on_before_optimizer_step (just before this) measured the norm of these very gradients: clip
        # with it instead of letting Lightning read every gradient a second time (a full pass over
        # 0.6 B values per optimizer step at full size). Same norm, same clipping, bit for bit.
        grad_norm, self._grad_norm = self._grad_norm, None
        if (
            not gradient_clip_val
            or grad_norm is None
            or gradient_clip_algorithm not in (None, "norm")
        ):
            return super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )
        params = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, grad_norm)

    def average_batchnorm_statistics(self) -> None:
        """Make BatchNorm running statistics the mean over ranks, once per optimizer step.

        Each rank's forward passes update its own statistics. DDP's usual fix (broadcast_buffers)
        copies rank 0's at the next forward, so ranks still differ after their last forward and the
        other ranks' data never counts; SyncBatchNorm would put a collective into every forward,
        which a rank with an empty micro-batch skips. Averaging here keeps every buffer identical on
        all ranks at every step boundary (and in every checkpoint) for one small all-reduce per step.
        Only BatchNorm in train mode: the frozen encoder's statistics must not change by a single bit.
        """
        if not collectives.is_distributed() or dist.get_world_size() == 1:
            return
        norms = [
            m
            for m in self.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and m.training
            and m.track_running_stats
        ]
        if not norms:
            return
        stats = [b for m in norms for b in (m.running_mean, m.running_var)]
        flat = torch._utils._flatten_dense_tensors(stats)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for b, synced in zip(stats, torch._utils._unflatten_dense_tensors(flat, stats)):
            b.copy_(synced)
        counts = torch.stack([m.num_batches_tracked for m in norms])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        for m, n in zip(norms, counts):
            m.num_batches_tracked.copy_(n)

    def configure_optimizers(self):
        # Base LR 1.0, so LambdaLR's factor IS the learning rate of lr_at_step (times the group's scale).
        optimizer = torch.optim.AdamW(
            parameter_groups(self.model),
            lr=1.0,
            betas=(0.9, 0.98),
            weight_decay=config.WEIGHT_DECAY,
            **step_speed.adamw_options(self.speed),
        )
        step_speed.keep_kernel_choice(optimizer)
        schedule = lr_schedule_from_config()
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            [lambda step, k=scale: schedule(step) * k for scale in group_lr_scales()],
        )
        new_piece_schedule = functools.partial(
            new_piece_scale_at_step,
            scale=config.NEW_PIECE_LR_SCALE,
            warmup=config.NEW_PIECE_WARMUP,
            decay=config.NEW_PIECE_DECAY,
        )
        # The scheduler's count is the step whose LR AdamW is about to apply, restored on a resume.
        NewPieceLRScale(
            asr_model.new_piece_parameters(self.model),
            new_piece_schedule,
            lambda: scheduler.last_epoch,
        ).attach(optimizer)
        if base_adapters.record_of(self.model) is not None:
            # The frozen-base mode: the base's rows of the vocabulary's parts end every step as
            # they began the run (AdamW's decay would move them, gradient or not).
            base_adapters.HeldRows(asr_model.new_piece_parameters(self.model)).attach(optimizer)
        if self.frozen_base is not None:
            base_anchor.PullTowardBase(
                self.model.named_parameters(),
                self.frozen_base,
                config.L2SP_WEIGHT,
                asr_model.new_piece_parameters(self.model),
            ).attach(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


# ---- data ---------------------------------------------------------------------------------------


class ValidationError(process_control.UserError):
    """Validation was asked for and has nothing to run on."""


_warned_without_validation: set[Path] = set()


def nothing_to_validate(manifest: Path, summary: dict) -> tuple[str, str] | None:
    """(what is wrong, what to do) when validation on ``manifest`` could score nothing, judged from
    its training cache's ``summary`` (rows read, dropped and kept); None when it can."""
    if summary.get("rows_kept", 1) > 0:
        return None
    dropped = ", ".join(f"{n} {why}" for why, n in summary.get("dropped", {}).items() if n)
    return (
        f"VAL_MANIFEST_PATH={manifest} has no utterance to score ({summary.get('rows_read', 0)} "
        f"rows read" + (f", dropped: {dropped}" if dropped else "") + ")",
        "point it at a manifest with rows (scripts/make_train_val.py) or set EVAL_EVERY_STEPS=0",
    )


def validation_manifest() -> Path | None:
    """The manifest validation runs on, or None when it is off (EVAL_EVERY_STEPS=0).

    A missing VAL_MANIFEST_PATH is a ValidationError when the user set it or EVAL_EVERY_STEPS; when
    both are defaults (a run pointed at another TRAIN_MANIFEST_PATH only) it is a warning and the run
    goes on without validation."""
    if config.EVAL_EVERY_STEPS <= 0:
        return None
    path = Path(config.VAL_MANIFEST_PATH)
    if path.is_file():
        return path
    asked = [
        name
        for name in ("VAL_MANIFEST_PATH", "EVAL_EVERY_STEPS")
        if config.KNOBS[name].source == "env"
    ]
    if asked:
        raise ValidationError(
            f"EVAL_EVERY_STEPS={config.EVAL_EVERY_STEPS} but VAL_MANIFEST_PATH={path} does not exist "
            f"(set: {', '.join(asked)}); build it with scripts/make_train_val.py or set "
            f"EVAL_EVERY_STEPS=0"
        )
    if int(os.environ.get("RANK", 0)) == 0 and path not in _warned_without_validation:
        _warned_without_validation.add(path)  # the caches and the callback both ask
        log.warning(
            "no validation in this run: VAL_MANIFEST_PATH=%s does not exist (scripts/make_train_val.py "
            "writes it beside the train manifest); set VAL_MANIFEST_PATH, or EVAL_EVERY_STEPS=0 to "
            "say so",
            path,
        )
    return None


def prepare_training_caches(tokenizer) -> None:
    """Build the training caches train.py maps (TRAIN_MANIFEST_PATH; VAL_MANIFEST_PATH when
    evaluation is on) unless scripts/build_training_cache.py already did.

    Called by every rank before the process group exists: one process per cache directory builds,
    the others wait on its file lock, so a long build can never run into a collective timeout.
    """
    import training_cache

    manifests = [train_manifest_path()]
    val = validation_manifest()
    if val is not None:
        from manifest_schema import check_same_split

        manifests.append(val)
        check_same_split(*manifests)
    for path in manifests:
        info = training_cache.ensure(
            path,
            tokenizer,
            frame_seconds=config.ENCODER_FRAME_SECONDS,
            max_token_len=config.MAX_TOKEN_LEN,
            cache_dir=config.CACHE_DIR,
            workers=config.CACHE_BUILD_WORKERS,
            progress=int(os.environ.get("LOCAL_RANK", 0)) == 0,
        )
        if info.built:
            log.info(
                "built the training cache of %s in %.1f s (scripts/build_training_cache.py builds "
                "it before training)",
                path,
                info.summary["build_seconds"],
            )


def train_manifest_path() -> Path:
    """TRAIN_MANIFEST_PATH; FileNotFoundError naming the variable when it does not exist."""
    path = Path(config.TRAIN_MANIFEST_PATH)
    if not path.exists():
        raise FileNotFoundError(
            f"TRAIN_MANIFEST_PATH={path} does not exist; build it with scripts/make_train_val.py"
        )
    return path


def startup_refusals() -> checkpoints.ResumePlan:
    """What train.py refuses before it builds a model, checked changing nothing on disk (preflight
    runs the same): the manifests and their split, the train manifest's transcript style against
    TRANSCRIPT_STYLE, the tokenizer and INIT_MODEL or MODEL_CONFIG, RESUME_FROM with the
    CHECKPOINT_DIR it writes into (``checkpoints.plan_resume``: a requeue continues its run's
    newest checkpoint, a rewind moves the later steps aside) and the run-defining settings against
    the checkpoint's, and the steps left to train. Returns the resume plan, not yet applied; a
    problem is a UserError naming the variable."""
    import transcript_style
    from manifest_schema import check_same_split

    train = train_manifest_path()
    val = validation_manifest()
    if val is not None:
        check_same_split(train, val)
    transcript_style.check_manifest_style(train)
    asr_model.check_model_inputs()
    plan = checkpoints.plan_resume()
    checkpoints.check_directory_for_run(plan.path, set_aside=plan.set_aside)
    if plan.path is not None:
        checkpoints.check_resume_settings(plan.path)
    steps_left(plan.path)
    return plan


def steps_left(ckpt_path: str | None) -> int:
    """Optimizer steps this job has to do: MAX_STEPS minus the resumed checkpoint's step. A
    checkpoint past MAX_STEPS is a UserError (MAX_STEPS lowered by mistake)."""
    if ckpt_path is None:
        return config.MAX_STEPS
    step = checkpoints.checkpoint_step(ckpt_path)
    if step > config.MAX_STEPS:
        raise checkpoints.CheckpointError(
            f"RESUME_FROM={config.RESUME_FROM} resolves to {ckpt_path}, at optimizer step {step}, "
            f"past MAX_STEPS={config.MAX_STEPS}: nothing would be trained. Raise MAX_STEPS above "
            f"{step} to continue this run, or start a new one in another CHECKPOINT_DIR"
        )
    return config.MAX_STEPS - step


def build_dataset(tokenizer, *, progress: bool = True):
    """LocalShardDataset over TRAIN_MANIFEST_PATH (feasibility-filtered), with the noise the NOISE_*
    knobs configure: NoiseDirError (the message train.py exits with) when NOISE_DIR cannot serve."""
    from dataset import LocalShardDataset, NoiseSettings

    path = train_manifest_path()
    dataset = LocalShardDataset(
        path, tokenizer, progress=progress, noise=NoiseSettings.from_config()
    )
    if len(dataset) == 0:
        raise ValueError(
            f"TRAIN_MANIFEST_PATH={path}: no utterance is left after the feasibility filter "
            f"({dataset.load_summary})"
        )
    return dataset


def _batching_from_config():
    from sampler import BatchingSettings

    return BatchingSettings.from_config()


def build_dataloader(
    dataset, batching, *, world_size: int, rank: int, pin_memory: bool, workers: int | None = None
):
    """(DataLoader, sampler) for this rank: one batch_sampler micro-batch per step, ``workers``
    (default NUM_WORKERS) workers that leave stop signals to the rank
    (``dataset.SignalSafeDataLoader``). ``batching``: the sampler's settings
    (``sampler.BatchingSettings``), with the encoder frame of ``dataset``'s cache."""
    import dataclasses

    from dataset import SignalSafeDataLoader, collate_asr_batch
    from sampler import DurationBucketBatchSampler

    sampler = DurationBucketBatchSampler(
        dataset.durations,
        dataset.lang_codes,
        dataclasses.replace(batching, frame_seconds=dataset.frame_seconds),
        language_names=dataset.lang_names,
        world_size=world_size,
        rank=rank,
        token_lengths=dataset.token_lengths,
    )
    workers = config.NUM_WORKERS if workers is None else workers
    loader = SignalSafeDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_asr_batch,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
        # A worker that delivers nothing for this long (a deadlocked or stuck worker) fails the job
        # with "DataLoader timed out" instead of hanging it; the watchdog shows where it waited.
        timeout=config.COLLECTIVE_TIMEOUT_MINUTES * 60 if workers > 0 else 0,
    )
    return loader, sampler


def log_first_step(sampler, rank: int) -> None:
    stats = sampler.epoch_stats()
    first = stats["first_step"]
    log.info(
        "rank %d: %d micro-batches this epoch; the first optimizer step starts with this rank's most "
        "expensive micro-batch: %d utterances, %.1f s of audio, longest %.1f s",
        rank,
        stats["num_batches_per_rank"],
        first["utterances"],
        first["audio_seconds"],
        first["max_duration"],
    )


def schedule_warnings() -> list[str]:
    """One line per training-schedule knob (MAX_STEPS, UNFREEZE_STEP, WARMUP_STEPS, PHASE2_WARMUP)
    whose value the run cannot reach, each naming the knobs and a value that works. Warnings, not
    errors: the run still trains, only not as its knobs suggest. A frozen encoder for the whole run
    is a real choice (a decoder-only finetune, or a run to be resumed with a larger MAX_STEPS), so
    it is said, not refused."""
    max_steps, unfreeze = config.MAX_STEPS, config.UNFREEZE_STEP
    warmup, phase2_warmup = config.WARMUP_STEPS, config.PHASE2_WARMUP
    out = []
    phase1 = min(unfreeze, max_steps)
    if 0 < phase1 < warmup:
        out.append(
            f"WARMUP_STEPS={warmup} is longer than phase 1 ({phase1} optimizer steps: UNFREEZE_STEP="
            f"{unfreeze}, MAX_STEPS={max_steps}), so the LR never gets above "
            f"{config.PHASE1_LR * phase1 / warmup:.2e} of PHASE1_LR={config.PHASE1_LR:.2e}: "
            f"set WARMUP_STEPS={max(1, phase1 // 10)} (a tenth of phase 1)"
        )
    phase2 = max_steps - unfreeze
    if 0 < phase2 < phase2_warmup:
        out.append(
            f"PHASE2_WARMUP={phase2_warmup} is longer than phase 2 ({phase2} optimizer steps: "
            f"MAX_STEPS={max_steps} - UNFREEZE_STEP={unfreeze}), so the LR never gets above "
            f"{config.PHASE2_LR * phase2 / phase2_warmup:.2e} of PHASE2_LR={config.PHASE2_LR:.2e}: "
            f"set PHASE2_WARMUP={max(1, phase2 // 10)} (a tenth of phase 2)"
        )
    if 0 < unfreeze and max_steps <= unfreeze:
        out.append(
            f"UNFREEZE_STEP={unfreeze} >= MAX_STEPS={max_steps}: the encoder stays frozen for the "
            f"whole run and only the decoder and joint train; set UNFREEZE_STEP={max_steps // 2} "
            "(or any value below MAX_STEPS) to finetune the encoder too"
        )
    return out
