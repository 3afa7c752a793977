"""Time real optimizer steps of train.py's TrainingModule against NeMo's own training_step, same model.

Usage:
    python benchmarks/bench_train_step.py                                    # MODEL_CONFIG (tiny), CPU
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml MAX_BATCH_DURATION=20 python benchmarks/bench_train_step.py
    INIT_MODEL=/models/parakeet-tdt-0.6b-v2.nemo python benchmarks/bench_train_step.py     # a real model
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml PRECISION=bf16-mixed python benchmarks/bench_train_step.py
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml python benchmarks/bench_train_step.py --find-max-batch-duration

What it does:
- Model: ``asr_model.build_model`` (INIT_MODEL, else MODEL_CONFIG) with TOKENIZER_DIR when that holds a
  tokenizer, else a synthetic multilingual BPE tokenizer of ``--vocab-size`` pieces (default
  VOCAB_SIZE) trained once into ``--work-dir``.
- Batch: the sampler's most expensive micro-batch at MAX_BATCH_DURATION (its first, see sampler.py)
  in the longest duration bucket of a synthetic corpus of 200k utterances (lognormal durations,
  median 6 s, clipped to MIN_DURATION..MAX_DURATION), with ``--tokens-per-second`` tokens per
  utterance second plus the language tag, and noise as audio.
- Steps: Lightning ``Trainer.fit`` on that batch repeated, one optimizer step per batch, with
  PRECISION, ACCELERATOR and GRAD_CLIP; ``--warmup`` steps are dropped, the median of ``--steps``
  is reported. Phase 1: ``TrainingModule.enter_phase(1)`` freezes the encoder at every batch start; for NeMo the
  encoder is frozen the NeMo way (``encoder.freeze()``, kept in eval mode). Phase 2: all trains.
  Order: project p1, NeMo p1, project p2, NeMo p2, then the same with NeMo first, ``--rounds``
  runs of each in all (default 2, so neither side always runs first); each side has its own
  optimizer (AdamW both: ours from config.py, NeMo's from ``cfg.optim``), the model is shared.
  NeMo's step decodes a training WER every ``log_every_n_steps`` (10, as in NeMo's configs);
  the median skips those steps unless they are most of them.
- Printed: parameters, step time per phase and side, audio seconds per second, peak memory
  (host RSS sampled every 5 ms on CPU; ``torch.cuda.max_memory_allocated`` on CUDA), the ratio
  project / NeMo (target <= 1.0) and, on CUDA, model FLOPs utilization.

FLOPs of one optimizer step (B utterances padded to T encoder frames and U+1 decoder positions,
encoder of L layers, width d, P_enc parameters; joint hidden H, V+1+D outputs; k = 3 with the
encoder training (forward + backward), 1 with it frozen):
    encoder   k * (2 * P_enc * B * T + 6 * L * d * B * T^2)      (weights; scores, position scores, values)
    joint     3 * 2 * B * T * (U + 1) * H * (V + 1 + D)          (output projection, forward + backward)
MFU = FLOPs / step time / peak bf16 dense FLOP/s of the device (H100 and H200: 989e12; ``--peak-tflops``
for others). Subsampling convolutions, the prediction network and the loss are left out (< 2%).

--find-max-batch-duration (CUDA): the largest MAX_BATCH_DURATION, in steps of 5 s, whose heaviest
micro-batch runs two phase-2 optimizer steps with peak allocated memory <= 90% of the device's
memory, by bisection between MAX_DURATION and ``--max-search`` seconds; an out-of-memory counts as
"does not fit" and everything is freed before the next try. Prints the line to set.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import asr_model
import config
from dataset import AsrBatch
from manifest_schema import tagged_text
from sampler import DurationBucketBatchSampler, token_density
from training_cache import tag_token_id
from training_step import TrainingModule

LANGS = ("hi", "en", "ta", "te", "bn", "mr", "kn")
NEMO_LOG_EVERY_N_STEPS = 10  # trainer.log_every_n_steps of NeMo's FastConformer configs
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
HEADROOM = 0.9
SEARCH_STEP_S = 5.0


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def synthetic_tokenizer(vocab_size: int, work_dir: Path, seed: int = 0) -> Path:
    """A BPE tokenizer with language tags, ``vocab_size`` pieces, trained once on random multi-script words."""
    from scripts import train_tokenizer

    out = work_dir / f"tokenizer_{vocab_size}"
    if (out / "tokenizer.model").exists():
        return out
    rng = np.random.default_rng(seed)
    alphabets = {
        "hi": (0x0905, 0x0939),
        "bn": (0x0985, 0x09B9),
        "ta": (0x0B85, 0x0BB9),
        "te": (0x0C05, 0x0C39),
        "kn": (0x0C85, 0x0CB9),
        "mr": (0x0905, 0x0939),
        "en": (0x61, 0x7A),
    }
    texts, langs = [], []
    for lang in LANGS:
        lo, hi = alphabets[lang]
        letters = np.array([chr(c) for c in range(lo, hi + 1)])
        # A Zipf-like lexicon of 2 x vocab_size words per language: enough distinct merges for the pieces.
        words_per_lang, sentences = max(1_000, 2 * vocab_size), max(500, 3 * vocab_size)
        lexicon = [
            "".join(rng.choice(letters, size=int(n)))
            for n in rng.integers(2, 9, size=words_per_lang)
        ]
        ranks = np.minimum(rng.zipf(1.2, size=sentences * 12), len(lexicon)) - 1
        words = np.array(lexicon, dtype=object)[ranks].reshape(sentences, 12)
        texts += [tagged_text(lang, " ".join(row)) for row in words]
        langs += [lang] * len(words)
    work_dir.mkdir(parents=True, exist_ok=True)
    manifest = work_dir / "tokenizer_corpus.parquet"
    pq.write_table(
        pa.table({"text": texts, "lang": langs, "duration": np.full(len(texts), 6.0)}), manifest
    )
    train_tokenizer.train_tokenizer(
        manifest, out, vocab_size=vocab_size, temperature=1.0, lang_weighting="count", seed=seed
    )
    return out


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


def heaviest_batch_shape(
    max_batch_duration: float, tokens_per_second: float, seed: int = 0
) -> BatchShape:
    """Durations and token counts of the sampler's first (most expensive) micro-batch on a synthetic corpus."""
    rng = np.random.default_rng(seed)
    n = 200_000
    durations = np.clip(
        rng.lognormal(np.log(6.0), 0.6, n), config.MIN_DURATION, config.MAX_DURATION
    )
    languages = np.array(LANGS)[rng.integers(0, len(LANGS), n)]
    edges = DurationBucketBatchSampler(
        durations, languages, world_size=1, rank=0, seed=seed
    ).boundaries
    # The longest bucket: by the sampler's linear cost a batch of many short utterances can cost as
    # much, but the transducer joint (B x T x U) and attention (T^2) make the longest the heaviest.
    longest = durations >= edges[-1] if len(edges) else np.ones(n, dtype=bool)
    durations, languages = durations[longest], languages[longest]
    sampler = DurationBucketBatchSampler(
        durations,
        languages,
        boundaries=edges,
        max_batch_duration=max_batch_duration,
        world_size=1,
        rank=0,
        seed=seed,
    )
    rows = next(iter(sampler))
    chosen = sorted((float(durations[i]) for i in rows), reverse=True)
    tokens = []
    for d in chosen:
        frames = int(d / config.ENCODER_FRAME_SECONDS)
        tokens.append(max(2, min(1 + round(tokens_per_second * d), config.MAX_TOKEN_LEN, frames)))
    return BatchShape(chosen, tokens)


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
    gradients and the loss's temporaries; 8 fits the full-size model's measured peak)."""
    joint = model.joint
    sub = min(
        len(shape.durations),
        joint._fused_batch_size if joint.fuse_loss_wer else len(shape.durations),
    )
    frames = int(max(shape.durations) / config.ENCODER_FRAME_SECONDS) + 1
    logits = sub * frames * (max(shape.tokens) + 1) * joint.num_classes_with_blank * 4
    return 16 * sum(p.numel() for p in model.parameters()) + 8 * logits


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer(pl.Callback):
    """Wall time of every training batch (one optimizer step each), device work included."""

    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync(pl_module.device)
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
    """Every parameter trainable, train mode, no gradients: the state both sides start from."""
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
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
) -> RunResult:
    """``warmup + steps`` optimizer steps of ``side`` ("project" or "nemo") in one Trainer.fit."""
    reset_model(model)
    timer = StepTimer()
    if side == "project":
        module = TrainingModule(model)
        extra = [FixedPhase(phase)]
        data = [batch] * (warmup + steps)
    else:
        module = model
        extra = [NemoFrozenEncoder()] if phase == 1 else []
        data = [(batch.signal, batch.signal_len, batch.tokens, batch.token_len)] * (warmup + steps)
    trainer = pl.Trainer(
        accelerator=device.type,
        # This very GPU (cuda:<local rank> under torchrun), not the first visible one.
        devices=[device.index] if device.type == "cuda" and device.index is not None else 1,
        precision=precision,
        max_steps=warmup + steps,
        max_epochs=1,
        gradient_clip_val=config.GRAD_CLIP or None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        log_every_n_steps=NEMO_LOG_EVERY_N_STEPS,
        callbacks=[*extra, timer],
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
# FLOPs
# --------------------------------------------------------------------------------------------------


def step_flops(model, batch: AsrBatch, phase: int) -> float:
    """Model FLOPs of one optimizer step on ``batch`` (formula in the module docstring)."""
    enc = model.encoder
    p_enc = sum(p.numel() for p in enc.parameters())
    B = batch.signal.shape[0]
    T = int(batch.signal.shape[1] / config.TARGET_SAMPLE_RATE / config.ENCODER_FRAME_SECONDS)
    L, d = enc.n_layers, enc.d_model
    k = 3 if phase == 2 else 1
    encoder = k * (2 * p_enc * B * T + 6 * L * d * B * T * T)
    H = model.joint.joint_hidden
    outputs = model.joint.num_classes_with_blank
    joint = 3 * 2 * B * T * (batch.tokens.shape[1] + 1) * H * outputs
    return float(encoder + joint)


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


# --------------------------------------------------------------------------------------------------
# --find-max-batch-duration
# --------------------------------------------------------------------------------------------------


def step_precision(device: torch.device) -> str:
    """PRECISION, except float32 on a CPU when PRECISION is left at its default (bf16 autocast is
    the GPU default; a CPU trains in float32)."""
    if device.type == "cpu" and config.KNOBS["PRECISION"].source == "default":
        return "32-true"
    return config.PRECISION


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fits(
    model, tokenizer, cap: float, tokens_per_second: float, device: torch.device, precision: str
) -> tuple[bool, int]:
    """(fits with headroom, peak allocated bytes or 0 after an out-of-memory) for phase 2 at ``cap`` seconds."""
    batch = make_batch(heaviest_batch_shape(cap, tokens_per_second), tokenizer)
    total = torch.cuda.get_device_properties(device).total_memory
    peak, ok = 0, False
    try:
        result = run_steps(
            "project", model, batch, 2, warmup=1, steps=1, device=device, precision=precision
        )
        peak, ok = result.peak_bytes, result.peak_bytes <= HEADROOM * total
    except Exception as exc:  # noqa: BLE001  (only an out-of-memory is an answer; anything else is a bug)
        if not _is_oom(exc):
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
    tokens_per_second: float,
    max_search: float,
    device: torch.device,
    precision: str,
) -> float | None:
    total = torch.cuda.get_device_properties(device).total_memory

    def fits_at(cap: float) -> bool:
        ok, peak = fits(model, tokenizer, cap, tokens_per_second, device, precision)
        detail = f"peak {peak / 2**30:.1f} of {total / 2**30:.1f} GiB" if peak else "out of memory"
        print(f"  {cap:6.0f} s: {'fits' if ok else 'does not fit'} ({detail})", flush=True)
        return ok

    return bisect_max_batch_duration(fits_at, config.MAX_DURATION, max_search)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="timed optimizer steps per phase and side"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps before them")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="repeat the runs, pooling the step times; odd rounds run NeMo first",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=None,
        help="transcript tokens per second of audio of the heaviest batch (default: the 99.9th "
        "percentile of the train manifest, tokenized with TOKENIZER_DIR, as the sampler's joint cap "
        "takes it; 5.0 without a manifest: about 2.5-3 words/s x 1.7 pieces/word for a 12k BPE)",
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="the manifest whose token densities shape the batch (default TRAIN_MANIFEST_PATH)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="pieces of the synthetic tokenizer when TOKENIZER_DIR has none (default VOCAB_SIZE)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "bench_train_step",
        help="where the synthetic tokenizer is kept between runs",
    )
    parser.add_argument("--phases", default="1,2", help="which phases to time, e.g. 2")
    parser.add_argument("--skip-nemo", action="store_true", help="time the project's step only")
    parser.add_argument(
        "--find-max-batch-duration",
        action="store_true",
        help="(CUDA) bisect the largest MAX_BATCH_DURATION that fits phase 2 with 10%% headroom",
    )
    parser.add_argument(
        "--max-search", type=float, default=600.0, help="upper end of that search, seconds"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="device bf16 peak for MFU if not known"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)
    for name in (
        "lightning.pytorch",
        "lightning.fabric",
        "pytorch_lightning",
        "train",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    accelerator = config.ACCELERATOR
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else "cpu")
    precision = step_precision(device)
    if args.find_max_batch_duration and device.type != "cuda":
        print(
            "--find-max-batch-duration needs a CUDA device (ACCELERATOR=cpu or no GPU here)",
            file=sys.stderr,
        )
        return 2

    tokenizer_dir = Path(config.TOKENIZER_DIR)
    if not (tokenizer_dir / "tokenizer.model").exists():
        vocab = args.vocab_size or config.VOCAB_SIZE
        print(
            f"TOKENIZER_DIR={tokenizer_dir} has no tokenizer.model: using a synthetic {vocab}-piece one"
        )
        tokenizer_dir = synthetic_tokenizer(vocab, args.work_dir)
    torch.manual_seed(config.SEED)
    model = asr_model.build_model(tokenizer_dir=tokenizer_dir)
    source = config.INIT_MODEL or config.MODEL_CONFIG
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {source}: {n_params / 1e9:.3f} B parameters ({n_params:,}), vocabulary "
        f"{model.tokenizer.vocab_size}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", precision {precision}, threads {torch.get_num_threads()}"
    )

    if args.tokens_per_second is None:
        args.tokens_per_second = manifest_token_density(
            args.manifest or Path(config.TRAIN_MANIFEST_PATH), model.tokenizer
        )

    if args.find_max_batch_duration:
        print(
            f"searching MAX_BATCH_DURATION (phase 2, peak allocated <= {HEADROOM:.0%} of device memory):"
        )
        best = find_max_batch_duration(
            model, model.tokenizer, args.tokens_per_second, args.max_search, device, precision
        )
        if best is None:
            print(
                f"even MAX_DURATION={config.MAX_DURATION:g} s does not fit: lower MAX_DURATION or use a larger GPU"
            )
            return 1
        print(
            f"largest MAX_BATCH_DURATION that fits: {best:g} s -> set MAX_BATCH_DURATION={best:g} "
            f"(GRAD_ACCUM x ranks x {best:g} s of audio per optimizer step)"
        )
        return 0

    shape = heaviest_batch_shape(config.MAX_BATCH_DURATION, args.tokens_per_second)
    if device.type == "cpu" and estimated_host_bytes(model, shape) > available_host_bytes():
        print(
            f"MAX_BATCH_DURATION={config.MAX_BATCH_DURATION:g}: a phase-2 step of {shape.describe()} needs "
            f"about {estimated_host_bytes(model, shape) / 2**30:.0f} GiB on CPU, {available_host_bytes() / 2**30:.0f} "
            "GiB are available; set MAX_BATCH_DURATION=20 (or lower) for CPU runs",
            file=sys.stderr,
        )
        return 2
    batch = make_batch(shape, model.tokenizer)
    print(
        f"micro-batch: the sampler's heaviest at MAX_BATCH_DURATION={config.MAX_BATCH_DURATION:g}: "
        f"{shape.describe()}"
    )
    phases = [int(p) for p in args.phases.split(",") if p.strip()]
    sides = ["project"] if args.skip_nemo else ["project", "nemo"]
    results: dict[tuple[str, int], list[RunResult]] = {}
    for round_ in range(args.rounds):
        for phase in phases:
            # Odd rounds run NeMo first: whatever the first run of a process pays (allocator and page
            # warm-up) falls on each side equally often.
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                results.setdefault((side, phase), []).append(
                    run_steps(
                        side,
                        model,
                        batch,
                        phase,
                        warmup=args.warmup,
                        steps=args.steps,
                        device=device,
                        precision=precision,
                    )
                )
    peak = peak_flops(device, args.peak_tflops)
    memory_kind = "peak GPU memory allocated" if device.type == "cuda" else "peak host RSS"
    for phase in phases:
        flops = step_flops(model, batch, phase)
        medians = {}
        for side in sides:
            runs = results[(side, phase)]
            times = [t for r in runs for t in r.times]
            med = statistics.median(times)
            medians[side] = med
            line = (
                f"phase {phase} {side:<7}: median step {med:8.3f} s over {len(times)} steps "
                f"(min {min(times):.3f}, max {max(times):.3f}), {shape.audio_seconds / med:8.1f} audio s/s, "
                f"{memory_kind} {max(r.peak_bytes for r in runs) / 2**30:.2f} GiB, {flops / 1e9:.1f} GFLOP/step"
            )
            if peak:
                line += f", MFU {flops / med / peak:.1%}"
            print(line)
        if "nemo" in medians:
            ratio = medians["project"] / medians["nemo"]
            per_round = [
                p.median / n.median
                for p, n in zip(results[("project", phase)], results[("nemo", phase)])
            ]
            print(
                f"phase {phase} ratio project / NeMo step time: {ratio:.3f} "
                f"({'meets' if ratio <= 1.0 else 'misses'} the target <= 1.0); per round "
                + ", ".join(f"{r:.3f}" for r in per_round)
            )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
