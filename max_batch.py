"""The sampler's heaviest micro-batch, real optimizer steps on it, and the largest MAX_BATCH_DURATION
a GPU holds: what preflight checks a node with and what the step benchmark times.

The heaviest micro-batch at a MAX_BATCH_DURATION is ``batch_bound.heaviest_packed_batch``: copies of
the longest utterance, as many as reach the padded encoder frames and with the tokens that reach the
joint cells no batch the sampler packs exceeds in any epoch (``batch_bound.packed_batch_bound``: from
the packing rules and the caps over the whole manifest, not one epoch's draw), so that no batch
training deals is heavier in padded frames or in joint cells. With SPEED_PERTURB both are of the
durations as played (the sampler packs by them): its utterances are the longest / the slowest
factor, e.g. 20 s / 0.9 = 22.2 s. It is taken from a manifest's
durations, languages and token lengths when one is at hand (``manifest_batch_shape``), else from a
synthetic corpus of 200k utterances (``synthetic_corpus``: lognormal durations, median 6 s, clipped
to MIN_DURATION..MAX_DURATION) with a given number of tokens per second.

Steps are Lightning ``Trainer.fit`` on that batch repeated, one optimizer step per batch, with the
given precision, ACCELERATOR and GRAD_CLIP; ``warmup`` steps are dropped.

The search (CUDA): the largest MAX_BATCH_DURATION, in steps of 5 s, whose heaviest micro-batch runs
two phase-2 optimizer steps with peak allocated memory <= 90% of the device's memory, by bisection
between MAX_DURATION and an upper end; an out-of-memory counts as "does not fit" and everything is
freed before the next try.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch

import config
from batch_bound import heaviest_packed_batch
from dataset import AsrBatch
from sampler import BatchingSettings, token_density
from step_speed import SpeedSettings, apply_to_model
from training_cache import tag_token_id
from training_step import TrainingModule

LANGS = ("hi", "en", "ta", "te", "bn", "mr", "kn")
NEMO_LOG_EVERY_N_STEPS = 10  # trainer.log_every_n_steps of NeMo's FastConformer configs
HEADROOM = 0.9  # the share of GPU memory a step may peak at
SEARCH_STEP_S = 5.0

# --------------------------------------------------------------------------------------------------
# The heaviest micro-batch
# --------------------------------------------------------------------------------------------------


@dataclass
class BatchShape:
    durations: list[float]
    tokens: list[int]

    @property
    def audio_seconds(self) -> float:
        return float(sum(self.durations))

    def describe(self) -> str:
        return (
            f"{len(self.durations)} utterances, {self.audio_seconds:.1f} s of audio, longest "
            f"{max(self.durations):.1f} s, {max(self.tokens)} tokens at most"
        )


def synthetic_corpus(
    tokens_per_second: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(durations, languages, token lengths) of 200k synthetic utterances: lognormal durations
    (median 6 s, sigma 0.6) clipped to MIN_DURATION..MAX_DURATION, languages of LANGS at random,
    ``1 + tokens_per_second x duration`` tokens (at least 2, at most MAX_TOKEN_LEN and the frames)."""
    rng = np.random.default_rng(seed)
    n = 200_000
    durations = np.clip(
        rng.lognormal(np.log(6.0), 0.6, n), config.MIN_DURATION, config.MAX_DURATION
    )
    languages = np.array(LANGS)[rng.integers(0, len(LANGS), n)]
    frames = (durations / config.ENCODER_FRAME_SECONDS).astype(np.int64)
    tokens = np.clip(
        1 + np.round(tokens_per_second * durations).astype(np.int64),
        2,
        np.maximum(2, np.minimum(config.MAX_TOKEN_LEN, frames)),
    )
    return durations, languages, tokens


def heaviest_batch_shape(
    max_batch_duration: float, tokens_per_second: float, seed: int = 0
) -> BatchShape:
    """The sampler's heaviest micro-batch (``batch_bound.heaviest_packed_batch``) on the synthetic
    corpus at ``tokens_per_second``, without a replay floor: its languages are no base's."""
    durations, languages, tokens = synthetic_corpus(tokens_per_second, seed)
    settings = BatchingSettings.from_config(
        max_batch_duration=max_batch_duration, seed=seed, base_languages=(), base_share=0.0
    )
    return BatchShape(*heaviest_packed_batch(durations, languages, tokens, settings))


def manifest_batch_shape(dataset, max_batch_duration: float) -> BatchShape:
    """The sampler's heaviest micro-batch (``batch_bound.heaviest_packed_batch``) on a loaded
    training manifest (a ``dataset.LocalShardDataset``) at ``max_batch_duration``, the other
    batching knobs as configured."""
    settings = BatchingSettings.from_config(
        max_batch_duration=max_batch_duration, frame_seconds=dataset.frame_seconds
    )
    return BatchShape(
        *heaviest_packed_batch(
            dataset.durations,
            dataset.lang_codes,
            dataset.token_lengths,
            settings,
            language_names=dataset.lang_names,
        )
    )


def manifest_token_density(manifest: Path, tokenizer, quantile: float = 0.999) -> float:
    """Tokens per second of audio (the tag included) at ``quantile`` of ``manifest``'s utterances,
    through its training cache: the density the sampler's joint cap assumes. 5.0 when there is no
    manifest (a synthetic run)."""
    if not manifest.is_file():
        print(
            f"no manifest at {manifest}: tokens per second 5.0 (pass --manifest for real densities)"
        )
        return 5.0
    from dataset import LocalShardDataset

    dataset = LocalShardDataset(manifest, tokenizer, progress=False)
    value = token_density(dataset.durations, dataset.token_lengths, quantile)
    p50 = token_density(dataset.durations, dataset.token_lengths, 0.5)
    print(
        f"token density of {manifest.name}: p50 {p50:.1f}, "
        f"p99.9 {value:.1f} tokens per second (the heaviest batch takes p99.9)"
    )
    return value


def estimated_host_bytes(model, shape: BatchShape) -> int:
    """A rough peak of a phase-2 CPU step: 16 bytes per parameter (weights, gradients, AdamW's two
    moments) plus 8 float32 copies of the joint tensor of one fused sub-batch (logits, their log-softmax,
    gradients and the loss's temporaries; 8 fits the full-size model's measured peak). A model
    without a transducer joint (a CTC family) counts its parameters only."""
    weights = 16 * sum(p.numel() for p in model.parameters())
    joint = getattr(model, "joint", None)
    if joint is None:
        return weights
    sub = min(
        len(shape.durations),
        joint._fused_batch_size if joint.fuse_loss_wer else len(shape.durations),
    )
    frames = int(max(shape.durations) / config.ENCODER_FRAME_SECONDS) + 1
    logits = sub * frames * (max(shape.tokens) + 1) * joint.num_classes_with_blank * 4
    return weights + 8 * logits


def available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def make_batch(shape: BatchShape, tokenizer, seed: int = 0) -> AsrBatch:
    """An AsrBatch of the given shape: noise audio, random pieces after each utterance's language tag."""
    g = torch.Generator().manual_seed(seed)
    sr = config.TARGET_SAMPLE_RATE
    lengths = [int(d * sr) for d in shape.durations]
    signal = torch.zeros(len(lengths), max(lengths))
    for i, n in enumerate(lengths):
        signal[i, :n] = 0.05 * torch.randn(n, generator=g)
    langs = [LANGS[i % len(LANGS)] for i in range(len(lengths))]
    tags = []
    for lang in langs:
        try:
            tags.append(tag_token_id(tokenizer, lang))
        except ValueError:  # a TOKENIZER_DIR without this language: any piece stands in for the tag
            tags.append(len(LANGS))
    vocab = tokenizer.vocab_size
    tokens = torch.zeros(len(lengths), max(shape.tokens), dtype=torch.int64)
    for i, u in enumerate(shape.tokens):
        tokens[i, 0] = tags[i]
        tokens[i, 1:u] = torch.randint(len(LANGS), vocab, (u - 1,), generator=g)
    return AsrBatch(
        signal=signal,
        signal_len=torch.tensor(lengths),
        tokens=tokens,
        token_len=torch.tensor(shape.tokens),
        langs=langs,
        durations=list(shape.durations),
        bad_audio={},
    )


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer(pl.Callback):
    """Wall time of every optimizer step (``grad_accum`` training batches each), device work
    included: from the start of its first micro-batch to the end of its last."""

    def __init__(self, grad_accum: int = 1):
        self.grad_accum = grad_accum
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.grad_accum == 0:
            sync(pl_module.device)
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.grad_accum == 0:
            sync(pl_module.device)
            self.times.append(time.perf_counter() - self._start)


class FixedPhase(pl.Callback):
    """The project's phase ``phase`` for the whole run, applied as train.py applies it: at every batch
    start (callbacks.EncoderUnfreezeCallback calls the same ``enter_phase``)."""

    def __init__(self, phase: int):
        self.phase = phase

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pl_module.enter_phase(self.phase)


class NemoFrozenEncoder(pl.Callback):
    """Phase 1 for NeMo's own step: ``encoder.freeze()`` (no grads, eval mode), re-imposed per batch."""

    def on_train_start(self, trainer, pl_module):
        pl_module.encoder.freeze()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.encoder.eval()


class PeakRSS:
    """Peak resident set size of this process while the block runs, sampled every 5 ms."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self.peak = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def reset_model(model) -> None:
    """Every parameter trainable (of a frozen-base model: its adapters and the vocabulary's parts,
    ``base_adapters.hold_weights``), train mode, no gradients: the state both sides start from."""
    import asr_model
    import base_adapters

    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    if base_adapters.record_of(model) is not None:
        base_adapters.hold_weights(model, [p for p, _ in asr_model.new_piece_parameters(model)])
    model.zero_grad(set_to_none=True)
    model._trainer = None
    # NeMo's configure_optimizers keeps its optimizer (AdamW moments: 8 bytes a parameter) on the model.
    model._optimizer = model._scheduler = None
    gc.collect()


def _same(batch):
    return batch


@dataclass
class RunResult:
    times: list[float]
    peak_bytes: int

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def benchmark_trainer(
    device: torch.device,
    precision: str,
    *,
    max_steps: int,
    max_epochs: int,
    grad_accum: int,
    callbacks: list[pl.Callback],
) -> pl.Trainer:
    """A Trainer for timed steps on ``device``: ``precision``, ``grad_accum`` micro-batches per
    optimizer step, GRAD_CLIP, no logger, checkpoint, progress bar or validation."""
    return pl.Trainer(
        accelerator=device.type,
        # This very GPU (cuda:<local rank> under torchrun), not the first visible one.
        devices=[device.index] if device.type == "cuda" and device.index is not None else 1,
        precision=precision,
        max_steps=max_steps,
        max_epochs=max_epochs,
        accumulate_grad_batches=grad_accum,
        gradient_clip_val=config.GRAD_CLIP or None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        log_every_n_steps=NEMO_LOG_EVERY_N_STEPS,
        callbacks=callbacks,
    )


def run_steps(
    side: str,
    model,
    batch: AsrBatch,
    phase: int,
    *,
    warmup: int,
    steps: int,
    device: torch.device,
    precision: str,
    grad_accum: int = 1,
    speed: SpeedSettings | None = None,
    callbacks: list[pl.Callback] | None = None,
    base=None,
    batching=None,
) -> RunResult:
    """``warmup + steps`` optimizer steps of ``side`` ("project" or "nemo") in one Trainer.fit,
    ``grad_accum`` micro-batches (copies of ``batch``) each. The project's step runs with ``speed``
    (default: the step-speed knobs), NeMo's with the model's own settings. ``callbacks`` (a
    profiler's, say) run after the phase is set and before the step timer. ``base`` and
    ``batching``: the project's TrainingModule's (a frozen base copy that DISTILL_WEIGHT and
    L2SP_WEIGHT act with; the sampler settings naming the base's languages)."""
    reset_model(model)
    timer = StepTimer(grad_accum)
    micro_batches = (warmup + steps) * grad_accum
    if side == "project":
        module = TrainingModule(model, batching=batching, speed=speed, base=base)
        extra = [FixedPhase(phase)]
        data = [batch] * micro_batches
    else:
        apply_to_model(model, SpeedSettings())
        module = model
        extra = [NemoFrozenEncoder()] if phase == 1 else []
        data = [(batch.signal, batch.signal_len, batch.tokens, batch.token_len)] * micro_batches
    trainer = benchmark_trainer(
        device,
        precision,
        max_steps=warmup + steps,
        max_epochs=1,
        grad_accum=grad_accum,
        callbacks=[*extra, *(callbacks or []), timer],
    )
    loader = torch.utils.data.DataLoader(data, batch_size=None, collate_fn=_same)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as rss:
        trainer.fit(module, train_dataloaders=loader)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss.peak
    if phase == 1 and side == "nemo":
        model.encoder.unfreeze()
    del trainer, module
    gc.collect()
    return RunResult(timer.times[warmup:], peak)


# --------------------------------------------------------------------------------------------------
# The search for MAX_BATCH_DURATION
# --------------------------------------------------------------------------------------------------


def step_precision(device: torch.device) -> str:
    """PRECISION, except float32 on a CPU when PRECISION is left at its default (bf16 autocast is
    the GPU default; a CPU trains in float32)."""
    if device.type == "cpu" and config.KNOBS["PRECISION"].source == "default":
        return "32-true"
    return config.PRECISION


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fits(
    model, tokenizer, shape: BatchShape, device: torch.device, precision: str
) -> tuple[bool, int]:
    """(fits with headroom, peak allocated bytes or 0 after an out-of-memory) for phase 2 on a batch
    of ``shape``."""
    batch = make_batch(shape, tokenizer)
    total = torch.cuda.get_device_properties(device).total_memory
    peak, ok = 0, False
    try:
        result = run_steps(
            "project", model, batch, 2, warmup=1, steps=1, device=device, precision=precision
        )
        peak, ok = result.peak_bytes, result.peak_bytes <= HEADROOM * total
    except Exception as exc:  # noqa: BLE001  (only an out-of-memory is an answer; anything else is a bug)
        if not is_oom(exc):
            raise
    finally:
        reset_model(model)
        torch.cuda.empty_cache()
    return ok, peak


def bisect_max_batch_duration(
    fits_at: Callable[[float], bool], lowest: float, highest: float, step: float = SEARCH_STEP_S
) -> float | None:
    """The largest multiple of ``step`` in [lowest, highest] at which ``fits_at`` is True, assuming it
    is True up to some duration and False beyond; None when it is False already at ``lowest``."""
    lo = max(step, step * math.ceil(lowest / step))
    if not fits_at(lo):
        return None
    hi = step * math.floor(highest / step) + step  # first duration taken not to fit
    while hi - lo > step:
        mid = lo + step * ((hi - lo) // (2 * step))
        if fits_at(mid):
            lo = mid
        else:
            hi = mid
    return lo


def find_max_batch_duration(
    model,
    tokenizer,
    shape_at: Callable[[float], BatchShape],
    max_search: float,
    device: torch.device,
    precision: str,
) -> float | None:
    """The largest MAX_BATCH_DURATION (bisection, see the module docstring) whose heaviest batch,
    ``shape_at(seconds)`` (``manifest_batch_shape`` of the training manifest when one is loaded,
    else ``heaviest_batch_shape``), fits."""
    total = torch.cuda.get_device_properties(device).total_memory

    def fits_at(cap: float) -> bool:
        shape = shape_at(cap)
        ok, peak = fits(model, tokenizer, shape, device, precision)
        detail = f"peak {peak / 2**30:.1f} of {total / 2**30:.1f} GiB" if peak else "out of memory"
        print(
            f"  {cap:6.0f} s: {'fits' if ok else 'does not fit'} ({shape.describe()}; {detail})",
            flush=True,
        )
        return ok

    return bisect_max_batch_duration(fits_at, config.MAX_DURATION, max_search)
