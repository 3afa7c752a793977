"""Two-phase Parakeet-TDT finetuning under torchrun, steered by environment variables (config.py).

Usage:
    python train.py --help                                   # this text + the variables it reads
    torchrun --nproc_per_node 8 train.py                     # one 8-GPU node
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train.py
    INIT_MODEL=nvidia/parakeet-tdt-0.6b-v2 PRECISION=bf16-mixed torchrun --nproc_per_node 8 train.py
    # CPU smoke run of the tiny model (configs/tiny_tdt.yaml), two processes:
    ACCELERATOR=cpu PRECISION=32-true NUM_WORKERS=0 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 train.py

What a run does:
- Model (``build_model``): INIT_MODEL is a .nemo file (restore_from) or a pretrained name
  (from_pretrained); empty INIT_MODEL builds MODEL_CONFIG fresh with TOKENIZER_DIR. When the
  tokenizer in TOKENIZER_DIR differs from the model's, ``change_vocabulary`` swaps decoder and joint
  and ``tdt_loss.attach_tdt_loss`` rebuilds the TDT loss NeMo replaced with a wrong-blank RNN-T loss.
  The loss runs NeMo's numba kernel on CUDA (``tdt_loss.tdt_loss`` with TDT_LOSS=torch) and
  ``tdt_loss.tdt_loss`` on CPU. On CUDA, every rank first runs its loss once on a small known problem
  against ``tdt_loss.tdt_loss`` (``tdt_loss.check_cuda_loss``): a broken GPU install stops the job
  before any data is loaded, with the line that installs the loss.
- Data (``build_dataloader``): LocalShardDataset over TRAIN_MANIFEST_PATH, batched by
  DurationBucketBatchSampler for this rank (rank and world size from torchrun / torch.distributed).
  The first optimizer step of each epoch gets this rank's most expensive micro-batches, so an
  out-of-memory shows in minute one; their size is logged at start-up.
- Phases (callbacks.EncoderUnfreezeCallback): below UNFREEZE_STEP the encoder is frozen (no grads,
  eval mode, run without autograd; its weights and BatchNorm statistics stay bit-identical), then
  the whole model trains. LR: ``lr_at_step``.
- Faults: a micro-batch whose every utterance was bad audio contributes a zero loss that still
  touches every trainable parameter (DDP's all-reduce completes, nothing is learned, no fake
  utterance). A non-finite loss on any rank, a non-finite gradient norm, or an optimizer step with no
  utterance on any rank skips that optimizer step on every rank (all ranks decide from the same
  all-reduced flags): no parameter, optimizer moment or BatchNorm statistic changes, and
  ``TrainingModule.skipped_steps`` counts it. The global step and the LR schedule still advance.
- DDP (torchrun, one process per GPU): find_unused_parameters=True in phase 1 (the encoder is frozen
  after the wrap, see callbacks.EncoderUnfreezeCallback), False in phase 2 (a new wrapper);
  BatchNorm statistics are averaged over ranks once per optimizer step instead of DDP's per-forward
  broadcast, so every parameter AND buffer is identical on all ranks at every step boundary;
  NeMo's per-forward all-reduce of the batch length in the Conformer encoder is switched off, so no
  collective depends on a rank running a forward.

Environment variables read (config.py has defaults and help; ``python config.py`` prints them):
    INIT_MODEL, MODEL_CONFIG, TOKENIZER_DIR, TDT_LOSS, TRAIN_MANIFEST_PATH, NUM_WORKERS, GRAD_ACCUM,
    MAX_STEPS, PRECISION, ACCELERATOR, PHASE1_LR, PHASE2_LR, MIN_LR, WARMUP_STEPS, UNFREEZE_STEP, PHASE2_WARMUP,
    WEIGHT_DECAY, GRAD_CLIP, SEED, MAX_BATCH_DURATION, BUCKET_BOUNDARIES, BUCKET_SORT_JITTER, TEMPERATURE,
    LANG_WEIGHTING, EPOCH_SIZE, BATCH_COST_QUADRATIC, TARGET_SAMPLE_RATE, MAX_TOKEN_LEN,
    ENCODER_FRAME_SECONDS, AUDIO_DURATION_TOLERANCE, RESUME_FROM, CHECKPOINT_DIR, CHECKPOINT_EVERY, EVAL_EVERY_STEPS,
    EVAL_SAMPLES_PER_LANG, VAL_MANIFEST_PATH, WANDB_MODE, WANDB_PROJECT, WANDB_RUN_NAME, WANDB_LOG_DIR
    and torchrun's WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE.

Watching and keeping a run (callbacks.py):
- Metrics per optimizer step to W&B (offline under WANDB_LOG_DIR/<run> without WANDB_API_KEY; upload
  later with ``wandb sync``) and to WANDB_LOG_DIR/<run>/metrics.jsonl; the progress bar counts
  optimizer steps of MAX_STEPS, micro-batches second.
- A checkpoint every CHECKPOINT_EVERY optimizer steps: CHECKPOINT_DIR/step_<step>.ckpt, written
  atomically, all kept; CHECKPOINT_DIR/step_<step>.nemo at the end (scripts/export_nemo.py on demand).
- RESUME_FROM=<path> or RESUME_FROM=last continues at exactly the next micro-batch (sampler
  position, optimizer, LR, phase, step, RNG states); EVAL_EVERY_STEPS > 0 logs per-language WER.
- The LightningModule (``TrainingModule``) exposes, on every rank: ``model`` (the NeMo model),
  ``dataset``, ``sampler``; ``skipped_steps`` (same on all ranks), ``empty_micro_batches``, ``nonfinite_losses`` and
  ``bad_audio`` (Counter by reason, this rank); ``last_loss`` (micro-batch), ``last_grad_norm``
  (before clipping, of the last optimizer step), ``phase`` (1 or 2). The batch itself (an
  ``AsrBatch`` with langs and durations) reaches ``on_train_batch_end`` of every callback.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import math
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import callbacks
import config
import tdt_loss

log = logging.getLogger("train")

ENV_VARS = (
    "INIT_MODEL",
    "MODEL_CONFIG",
    "TOKENIZER_DIR",
    "TDT_LOSS",
    "TRAIN_MANIFEST_PATH",
    "NUM_WORKERS",
    "GRAD_ACCUM",
    "MAX_STEPS",
    "PRECISION",
    "ACCELERATOR",
    "PHASE1_LR",
    "PHASE2_LR",
    "MIN_LR",
    "WARMUP_STEPS",
    "UNFREEZE_STEP",
    "PHASE2_WARMUP",
    "WEIGHT_DECAY",
    "GRAD_CLIP",
    "SEED",
    "MAX_BATCH_DURATION",
    "BUCKET_BOUNDARIES",
    "BUCKET_SORT_JITTER",
    "TEMPERATURE",
    "LANG_WEIGHTING",
    "EPOCH_SIZE",
    "BATCH_COST_QUADRATIC",
    "TARGET_SAMPLE_RATE",
    "MAX_TOKEN_LEN",
    "ENCODER_FRAME_SECONDS",
    "AUDIO_DURATION_TOLERANCE",
    "RESUME_FROM",
    "CHECKPOINT_DIR",
    "CHECKPOINT_EVERY",
    "EVAL_EVERY_STEPS",
    "EVAL_SAMPLES_PER_LANG",
    "VAL_MANIFEST_PATH",
    "WANDB_MODE",
    "WANDB_PROJECT",
    "WANDB_RUN_NAME",
    "WANDB_LOG_DIR",
)


# --------------------------------------------------------------------------------------------------
# Learning rate
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def _spm_pieces(model_file: Path) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def tokenizer_matches(model, tokenizer_dir: Path) -> bool:
    """True when the model's SentencePiece pieces are exactly those of ``tokenizer_dir/tokenizer.model``."""
    inner = getattr(model.tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "id_to_piece"):
        return False
    ours = [inner.id_to_piece(i) for i in range(inner.get_piece_size())]
    return ours == _spm_pieces(tokenizer_dir / "tokenizer.model")


def ensure_validation_ds(model) -> None:
    """NeMo's transcribe() fails on a model whose cfg.validation_ds is None: give it a minimal one."""
    from omegaconf import open_dict

    if model.cfg.get("validation_ds") is None:
        with open_dict(model.cfg):
            model.cfg.validation_ds = {
                "manifest_filepath": None,
                "sample_rate": model.cfg.get("sample_rate", 16000),
                "batch_size": 4,
                "shuffle": False,
                "num_workers": 0,
                "pin_memory": False,
                "use_start_end_token": False,
            }


def build_model(
    init_model: str | None = None,
    model_config: Path | None = None,
    tokenizer_dir: Path | None = None,
):
    """The NeMo TDT model to train, on CPU, with TOKENIZER_DIR's vocabulary and a device-dispatching TDT loss.

    ``init_model``: a .nemo path (restore_from) or a pretrained name (from_pretrained); empty means a
    fresh model from the ``model_config`` YAML (its ``model:`` section) with ``tokenizer.dir`` set to
    ``tokenizer_dir``. Defaults come from INIT_MODEL, MODEL_CONFIG and TOKENIZER_DIR.
    """
    from nemo.collections.asr.models import ASRModel, EncDecRNNTBPEModel
    from omegaconf import OmegaConf, open_dict

    init_model = config.INIT_MODEL if init_model is None else init_model
    model_config = Path(model_config or config.MODEL_CONFIG)
    tokenizer_dir = Path(tokenizer_dir or config.TOKENIZER_DIR)
    if not (tokenizer_dir / "tokenizer.model").exists():
        raise FileNotFoundError(
            f"TOKENIZER_DIR={tokenizer_dir} has no tokenizer.model; "
            "run scripts/train_tokenizer.py or point TOKENIZER_DIR at one"
        )

    if init_model:
        if init_model.endswith(".nemo") or Path(init_model).exists():
            if not Path(init_model).exists():
                raise FileNotFoundError(f"INIT_MODEL={init_model} does not exist")
            log.info("restoring %s", init_model)
            model = ASRModel.restore_from(init_model, map_location="cpu")
        else:
            log.info("downloading pretrained %s (needs network access)", init_model)
            model = ASRModel.from_pretrained(init_model, map_location="cpu")
    else:
        if not model_config.exists():
            raise FileNotFoundError(
                f"MODEL_CONFIG={model_config} does not exist (INIT_MODEL is empty)"
            )
        cfg = OmegaConf.load(model_config)
        cfg = cfg.model if "model" in cfg else cfg
        with open_dict(cfg):
            cfg.tokenizer.dir = str(tokenizer_dir)
            cfg.tokenizer.type = "bpe"
        log.info("building a fresh model from %s", model_config)
        model = EncDecRNNTBPEModel(cfg=cfg)

    use_tokenizer(model, tokenizer_dir)
    ensure_validation_ds(model)
    make_encoder_forward_rank_local(model)
    return model


def use_tokenizer(model, tokenizer_dir: Path) -> None:
    """Give ``model`` the vocabulary of ``tokenizer_dir`` and a TDT loss whose blank matches its joint.

    A model whose pieces already are those of ``tokenizer_dir`` keeps its decoder and joint; any
    other gets NeMo's ``change_vocabulary`` (new decoder and joint). Either way the loss is rebuilt
    by ``tdt_loss.attach_tdt_loss`` (TDT_LOSS chooses what runs on CUDA).
    """
    if not tokenizer_matches(model, tokenizer_dir):
        old = model.tokenizer.vocab_size
        # NeMo 3.0 replaces the TDT loss here with an RNN-T loss whose blank counts the durations:
        # attach_tdt_loss below rebuilds it from cfg.loss.
        model.change_vocabulary(new_tokenizer_dir=str(tokenizer_dir), new_tokenizer_type="bpe")
        log.info(
            "vocabulary changed from %d to %d pieces (TOKENIZER_DIR=%s): decoder and joint are new",
            old,
            model.tokenizer.vocab_size,
            tokenizer_dir,
        )
    tdt_loss.attach_tdt_loss(model)


def make_encoder_forward_rank_local(model) -> None:
    """Stop NeMo's ConformerEncoder from all-reducing the batch's max length inside every forward.

    With ``sync_max_audio_length`` (NeMo's default) each encoder forward is a collective: a rank
    that skips one (an empty micro-batch, a rank-local evaluation) desynchronises every later
    all-reduce (gloo aborts with "Received data size doesn't match", NCCL hangs), and each forward
    pays a GPU sync. The sync only keeps the relative-position table the same length on every rank;
    the forward reads the table by relative position, whose sinusoidal entries do not depend on the
    table's length, the table is no DDP-synchronised buffer, and it already covers
    ``pos_emb_max_len`` (5000 feature frames = 50 s) from construction on.
    """
    encoder = model.encoder
    if hasattr(encoder, "sync_max_audio_length"):
        encoder.sync_max_audio_length = False


# --------------------------------------------------------------------------------------------------
# The LightningModule
# --------------------------------------------------------------------------------------------------


class TrainingModule(pl.LightningModule):
    """Trains a NeMo TDT model on our AsrBatch micro-batches; the NeMo model itself stays unchanged.

    NeMo's own training_step, data setup and optimizer config are not used: this module owns the
    step, the DataLoader and AdamW + ``lr_at_step``. See the module docstring for the attributes
    monitoring callbacks read.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.dataset = None
        self.sampler = None
        self.encoder_frozen = False  # set by callbacks.EncoderUnfreezeCallback
        self.phase = 2
        self.skipped_steps = 0
        self.empty_micro_batches = 0
        self.nonfinite_losses = 0
        self.bad_audio: collections.Counter = collections.Counter()
        self.last_loss: torch.Tensor | None = None
        self.last_grad_norm: float | None = None
        self._grad_norm: torch.Tensor | None = (
            None  # of this optimizer step, for configure_gradient_clipping
        )
        self._window_bad = 0  # non-finite losses of this rank since the last optimizer step
        self._window_utterances = 0  # real utterances of this rank since the last optimizer step
        self._window_buffers: dict[str, torch.Tensor] | None = (
            None  # BatchNorm buffers when the window began
        )
        self._batchnorms: list[tuple[str, torch.nn.Module]] | None = None

    def on_fit_start(self):
        # Before the dataset is loaded: a CUDA loss that cannot run should cost seconds, not a node-hour.
        if self.device.type == "cuda":
            diff = tdt_loss.check_cuda_loss(self.model.loss._loss, self.device)
            log.info(
                "rank %d: TDT loss on %s (TDT_LOSS=%s) agrees with tdt_loss.py on a known problem "
                "(largest difference %.2g)",
                self.global_rank,
                self.device,
                config.TDT_LOSS,
                diff,
            )

    # ---- data -----------------------------------------------------------------------------------
    def train_dataloader(self):
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        if (
            dist.is_available()
            and dist.is_initialized()
            and (dist.get_rank(), dist.get_world_size()) != (rank, world_size)
        ):
            raise RuntimeError(
                f"Lightning says rank {rank}/{world_size} but torch.distributed says "
                f"{dist.get_rank()}/{dist.get_world_size()}; check the torchrun launch"
            )
        # Rank 0 loads first so any cache the dataset builds next to the manifest is written once.
        if rank != 0:
            self.trainer.strategy.barrier("dataset")
        self.dataset = build_dataset(self.model.tokenizer)
        if rank == 0:
            self.trainer.strategy.barrier("dataset")
        loader, self.sampler = build_dataloader(
            self.dataset, world_size=world_size, rank=rank, pin_memory=self.device.type == "cuda"
        )
        if getattr(self, "resume_sampler_state", None) is not None:
            # Set by callbacks.ExactResumeCallback from the checkpoint; Lightning builds the iterator
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

    def on_train_epoch_start(self):
        # Lightning calls set_epoch on a batch_sampler's inner sampler only, never on the batch_sampler.
        if self.sampler is not None:
            self.sampler.set_epoch(self.trainer.current_epoch)
            # Lightning sized every epoch from len() of the first plan and ends an epoch at that count;
            # each epoch's plan has its own length (packing differs), so tell it this one's.
            self.trainer.fit_loop.max_batches = len(self.sampler)

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
        """The model's TDT loss of one non-empty micro-batch (the reduction of cfg.rnnt_reduction)."""
        m = self.model
        # A frozen encoder needs no autograd graph: less memory and time; its outputs are constants.
        with torch.no_grad() if self.encoder_frozen else contextlib.nullcontext():
            encoded, encoded_len = m.forward(
                input_signal=batch.signal, input_signal_length=batch.signal_len
            )
        decoded, target_len, _ = m.decoder(targets=batch.tokens, target_length=batch.token_len)
        if m.joint.fuse_loss_wer:
            loss, _, _, _ = m.joint(
                encoder_outputs=encoded,
                decoder_outputs=decoded,
                encoder_lengths=encoded_len,
                transcripts=batch.tokens,
                transcript_lengths=batch.token_len,
                compute_wer=False,
            )
            return loss
        joint = m.joint(encoder_outputs=encoded, decoder_outputs=decoded)
        return m.loss(
            log_probs=joint,
            targets=batch.tokens,
            input_lengths=encoded_len,
            target_lengths=target_len,
        )

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
        else:
            self._window_utterances += batch.batch_size
            loss = self.compute_loss(batch)
            if not torch.isfinite(loss).item():
                self.nonfinite_losses += 1
                self._window_bad += 1
                log.warning(
                    "rank %d micro-batch %d: loss %s (langs %s, durations %s); this optimizer step "
                    "is skipped on every rank",
                    self.global_rank,
                    batch_idx,
                    loss.item(),
                    sorted(set(batch.langs)),
                    [round(d, 2) for d in batch.durations],
                )
                loss = self.zero_loss()
        self.last_loss = loss.detach()
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Every rank reaches this point once per optimizer step, so the all-reduce cannot hang.
        flags = torch.tensor(
            [float(self._window_bad), float(self._window_utterances)], device=self.device
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags)
        self._window_bad = self._window_utterances = 0
        window_buffers, self._window_buffers = self._window_buffers, None
        params = [p for p in self.parameters() if p.grad is not None]
        grad_norm = (
            torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        )
        self.last_grad_norm = float(grad_norm)
        self._grad_norm = grad_norm
        reason = None
        if flags[0] > 0:
            reason = f"non-finite loss on {int(flags[0])} micro-batch(es)"
        elif flags[1] == 0:
            reason = "no utterance on any rank (every micro-batch was bad audio)"
        elif not math.isfinite(self.last_grad_norm):
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
                for p in self.model.encoder.parameters():
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
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
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
        # Base LR 1.0, so LambdaLR's factor IS the learning rate of lr_at_step.
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1.0, betas=(0.9, 0.98), weight_decay=config.WEIGHT_DECAY
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule_from_config())
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def build_dataset(tokenizer):
    """LocalShardDataset over TRAIN_MANIFEST_PATH (feasibility-filtered)."""
    from dataset import LocalShardDataset

    path = Path(config.TRAIN_MANIFEST_PATH)
    if not path.exists():
        raise FileNotFoundError(
            f"TRAIN_MANIFEST_PATH={path} does not exist; build it with scripts/make_train_val.py"
        )
    dataset = LocalShardDataset(path, tokenizer)
    if len(dataset) == 0:
        raise ValueError(
            f"TRAIN_MANIFEST_PATH={path}: no utterance is left after the feasibility filter "
            f"({getattr(dataset, 'load_summary', {})})"
        )
    return dataset


def build_dataloader(dataset, *, world_size: int, rank: int, pin_memory: bool):
    """(DataLoader, sampler) for this rank: one batch_sampler micro-batch per step, NUM_WORKERS workers."""
    from dataset import collate_asr_batch
    from sampler import DurationBucketBatchSampler

    if hasattr(dataset, "lang_codes") and hasattr(dataset, "lang_names"):
        sampler = DurationBucketBatchSampler(
            dataset.durations,
            dataset.lang_codes,
            language_names=dataset.lang_names,
            world_size=world_size,
            rank=rank,
        )
    else:
        sampler = DurationBucketBatchSampler(
            dataset.durations, dataset.languages, world_size=world_size, rank=rank
        )
    workers = config.NUM_WORKERS
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_asr_batch,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
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


# --------------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------------


def distributed_env() -> dict:
    """World size, ranks and node layout from torchrun's variables (1 process when they are absent)."""
    env = os.environ
    world_size = int(env.get("WORLD_SIZE", 1))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % local_world_size:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}: "
            "every node must run the same --nproc_per_node"
        )
    return {
        "world_size": world_size,
        "rank": int(env.get("RANK", 0)),
        "local_rank": int(env.get("LOCAL_RANK", 0)),
        "local_world_size": local_world_size,
        "num_nodes": world_size // local_world_size,
    }


def build_callbacks() -> list[pl.Callback]:
    """The trainer's callbacks (callbacks.py). TrainingMetricsCallback comes after PerLanguageWERCallback
    so an evaluation's time counts in its step's time, not as data wait; Lightning moves the
    checkpoint callback to the end of the list itself."""
    return [
        callbacks.EncoderUnfreezeCallback(),
        callbacks.EpochBoundarySyncCallback(),
        callbacks.ExactResumeCallback(),
        callbacks.StepOnlyModelCheckpoint(),
        callbacks.PerLanguageWERCallback(),
        callbacks.TrainingMetricsCallback(),
        callbacks.OptimizerStepProgressBar(),
    ]


def build_loggers(resuming: bool):
    """W&B (offline without WANDB_API_KEY) and <run dir>/metrics.jsonl: callbacks.build_loggers."""
    return callbacks.build_loggers(resuming=resuming)


def resume_checkpoint() -> str | None:
    """``ckpt_path`` for trainer.fit from RESUME_FROM (a path, 'last', or empty); see callbacks.ExactResumeCallback."""
    return callbacks.resolve_resume_from()


def build_trainer(
    callback_list: list[pl.Callback], env: dict, resuming: bool = False
) -> pl.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    accelerator = config.ACCELERATOR
    if env["world_size"] > 1:
        # find_unused_parameters: the encoder is frozen AFTER DDP registered its parameters, so its
        # gradients are all-reduced once it is unfrozen (a module frozen before the wrap is never
        # synchronised again and ranks silently diverge); meanwhile DDP must tolerate its missing grads.
        # Phase 2 switches it off (callbacks.stop_searching_unused_parameters).
        # broadcast_buffers=False: BatchNorm statistics are averaged once per step instead
        # (TrainingModule.average_batchnorm_statistics).
        strategy = DDPStrategy(
            find_unused_parameters=True, gradient_as_bucket_view=True, broadcast_buffers=False
        )
    else:
        strategy = "auto"
    return pl.Trainer(
        accelerator=accelerator,
        devices=env["local_world_size"],
        num_nodes=env["num_nodes"],
        strategy=strategy,
        precision=config.PRECISION,
        max_steps=config.MAX_STEPS,
        max_epochs=-1,
        accumulate_grad_batches=config.GRAD_ACCUM,
        gradient_clip_val=config.GRAD_CLIP or None,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callback_list),
        callbacks=callback_list,
        logger=build_loggers(resuming),
        log_every_n_steps=1,
        benchmark=False,
        enable_model_summary=False,
    )


def log_startup(trainer: pl.Trainer, env: dict, model) -> None:
    """Every distributed assumption, once per rank (rank lines) and once for the run (rank 0)."""
    device = trainer.strategy.root_device
    log.info(
        "rank %d/%d (local %d/%d, node %d/%d) on %s, threads %d",
        trainer.global_rank,
        trainer.world_size,
        env["local_rank"],
        env["local_world_size"],
        trainer.node_rank,
        env["num_nodes"],
        device,
        torch.get_num_threads(),
    )
    if trainer.global_rank != 0:
        return
    audio_per_step = config.MAX_BATCH_DURATION * config.GRAD_ACCUM * trainer.world_size
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "world size %d = %d node(s) x %d process(es); strategy %s; precision %s; accelerator %s",
        trainer.world_size,
        env["num_nodes"],
        env["local_world_size"],
        type(trainer.strategy).__name__,
        config.PRECISION,
        config.ACCELERATOR,
    )
    log.info(
        "optimizer step = %d ranks x %d micro-batches x <= %.0f s = up to %.0f s (%.1f min) of audio",
        trainer.world_size,
        config.GRAD_ACCUM,
        config.MAX_BATCH_DURATION,
        audio_per_step,
        audio_per_step / 60,
    )
    log.info(
        "model %s: %.1f M parameters, vocabulary %d, TDT loss %s; encoder frozen for steps < %d",
        type(model).__name__,
        n_params / 1e6,
        model.tokenizer.vocab_size,
        model.loss._loss,
        config.UNFREEZE_STEP,
    )
    log.info(
        "max_steps %d, LR: warmup %d -> %.2e, phase 2 at %d: warmup %d -> %.2e, cosine -> %.2e; "
        "AdamW weight decay %g; grad clip %g",
        config.MAX_STEPS,
        config.WARMUP_STEPS,
        config.PHASE1_LR,
        config.UNFREEZE_STEP,
        config.PHASE2_WARMUP,
        config.PHASE2_LR,
        config.MIN_LR,
        config.WEIGHT_DECAY,
        config.GRAD_CLIP,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    epilog = "Effective values now:\n" + "\n".join(
        f"  {name}={config.KNOBS[name].value!s}  ({config.KNOBS[name].help})" for name in ENV_VARS
    )
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parse_args(argv)
    env = distributed_env()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {env['rank']}] %(levelname)s %(name)s: %(message)s",
    )
    # Same seed everywhere for the model's initial weights (DDP also broadcasts rank 0's).
    pl.seed_everything(config.SEED, workers=True)
    model = build_model()
    # Per-rank randomness from here on (dropout, SpecAugment masks, dither), still a function of SEED.
    torch.manual_seed(config.SEED + env["rank"])
    module = TrainingModule(model)
    callback_list = build_callbacks()
    ckpt_path = resume_checkpoint()
    trainer = build_trainer(callback_list, env, resuming=ckpt_path is not None)
    log_startup(trainer, env, model)
    trainer.fit(module, ckpt_path=ckpt_path)
    log.info(
        "done: %d optimizer steps, %d skipped; %d empty micro-batches, %d non-finite losses; bad audio %s",
        trainer.global_step,
        module.skipped_steps,
        module.empty_micro_batches,
        module.nonfinite_losses,
        dict(module.bad_audio),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
