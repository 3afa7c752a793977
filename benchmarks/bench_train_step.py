"""Time real optimizer steps of train.py's TrainingModule against NeMo's own training_step, same model.

Usage:
    python benchmarks/bench_train_step.py                                    # MODEL_CONFIG (tiny), CPU
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml MAX_BATCH_DURATION=20 python benchmarks/bench_train_step.py
    INIT_MODEL=/models/parakeet-tdt-0.6b-v2.nemo python benchmarks/bench_train_step.py     # a real model
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml PRECISION=bf16-mixed python benchmarks/bench_train_step.py
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml python benchmarks/bench_train_step.py --find-max-batch-duration
    python benchmarks/bench_train_step.py --grad-accum 4            # optimizer steps as a real job takes them
    python benchmarks/bench_train_step.py --profile --trace step.json   # where one phase-2 step's time goes
    python benchmarks/bench_train_step.py --levers sdpa,fused-adamw,fused-batch-size=16,tf32,compile

What it does:
- Model: ``asr_model.build_model`` (INIT_MODEL, else MODEL_CONFIG) with TOKENIZER_DIR when that holds a
  tokenizer, else a synthetic multilingual BPE tokenizer of ``--vocab-size`` pieces (default
  VOCAB_SIZE) trained once into ``--work-dir``.
- Batch: a micro-batch as heavy as every batch the sampler packs at MAX_BATCH_DURATION
  (``batch_bound.heaviest_packed_batch``: copies of the longest utterance, as many as reach the most
  padded encoder frames of any batch packed in any epoch) from a synthetic corpus of 200k
  utterances (lognormal durations, median 6 s, clipped to MIN_DURATION..MAX_DURATION), with
  ``--tokens-per-second`` tokens per utterance second plus the language tag, and noise as audio.
- Steps: Lightning ``Trainer.fit`` on that batch repeated, ``--grad-accum`` micro-batches per
  optimizer step (default 1; a real job: GRAD_ACCUM), with PRECISION, ACCELERATOR, GRAD_CLIP and the
  step-speed knobs (step_speed.py; NeMo's side runs the model's own settings); ``--warmup`` steps
  are dropped, the median of ``--steps`` is reported. Phase 1: ``TrainingModule.enter_phase(1)``
  freezes the encoder at every batch start; for NeMo the encoder is frozen the NeMo way
  (``encoder.freeze()``, kept in eval mode). Phase 2: all trains.
  Order: project p1, NeMo p1, project p2, NeMo p2, then the same with NeMo first, ``--rounds``
  runs of each in all (default 2, so neither side always runs first); each side has its own
  optimizer (AdamW both: ours from config.py, NeMo's from ``cfg.optim``), the model is shared.
  NeMo's step decodes a training WER every ``log_every_n_steps`` (10, as in NeMo's configs);
  the median skips those steps unless they are most of them.
- Printed: parameters, optimizer step time per phase and side, audio seconds per second (the
  utterances' own audio, no padding), peak memory (host RSS sampled every 5 ms on CPU;
  ``torch.cuda.max_memory_allocated`` on CUDA), the ratio project / NeMo (target <= 1.0) and, on
  CUDA, model FLOPs utilization.

--profile: instead of the timing, ``--warmup`` phase-2 optimizer steps of the project, then one
under torch.profiler, sorted into its parts (benchmarks/step_profile.py: each part's forward and
backward, the step boundary, the optimizer, host syncs, the allocator; host and device time) and
printed as a table; ``--trace FILE`` keeps the chrome trace (chrome://tracing, Perfetto).

--predict-mfu P: instead of the timing, the step time and audio s/s the FLOP count predicts at MFU
P% of the device's peak (a prediction, printed as one; nothing runs).

--levers A,B,...: instead of the timing, phase-2 optimizer steps of the project with the step-speed
knobs as set (off) and with each lever on (step_speed.LEVERS: sdpa, fused-adamw, compile, tf32,
host-memory-reuse, and fused-batch-size=N), alternating, ``--rounds`` runs each; per lever the
median on/off ratio of the paired rounds, and the loss of the batch in eval mode (no dropout, no
SpecAugment) with the lever on against off from the same weights, whose relative difference must
stay within bf16 noise.

FLOPs of one optimizer step (B utterances padded to T encoder frames and U+1 decoder positions,
encoder of L layers, width d, P_enc parameters; joint hidden H, V+1+D outputs; k = 3 with the
encoder training (forward + backward), 1 with it frozen):
    encoder   k * (2 * P * B * T                   (per-frame weights: P, the weights of the layers'
                                                    linear maps and convolutions but the position
                                                    projections')
                   + 2 * P_pos * (2T - 1)          (the position projections: one table of 2T - 1
                                                    relative positions per batch, not per utterance)
                   + 2 * L * d * B * T * (4T - 1)  (scores T x T, position scores T x (2T - 1), values)
                   + B * S)                        (S: the subsampling convolutions on one utterance,
                                                    counted by torch's FlopCounterMode)
    joint     3 * 2 * B * T * (U + 1) * H * (V + 1 + D)          (output projection, forward + backward)
The encoder's term is the matmul and convolution count torch's FlopCounterMode makes of its forward
(tests/test_bench_train_step.py holds the two equal on the tiny config; the 0.6B model at 2 x 20 s:
6.416e11 both ways, where a T^2 position term and per-utterance position projections would count
1.8% less). MFU = FLOPs / step time / peak bf16 dense FLOP/s of the device (H100 and H200: 989e12;
``--peak-tflops`` for others). The prediction network, the joint's input projections and the loss
are left out (under 1% at full size).

--find-max-batch-duration (CUDA): the largest MAX_BATCH_DURATION, in steps of 5 s, whose heaviest
micro-batch runs two phase-2 optimizer steps with peak allocated memory <= 90% of the device's
memory, by bisection between MAX_DURATION and ``--max-search`` seconds; an out-of-memory counts as
"does not fit" and everything is freed before the next try. Prints the line to set.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import asr_model
import config
import step_speed
from benchmarks import step_profile
from dataset import AsrBatch
from manifest_schema import tagged_text
from max_batch import (
    HEADROOM,
    LANGS,
    RunResult,
    available_host_bytes,
    estimated_host_bytes,
    find_max_batch_duration,
    heaviest_batch_shape,
    make_batch,
    manifest_token_density,
    reset_model,
    run_steps,
    step_precision,
    sync,
)
from step_speed import SpeedSettings, apply_to_model

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


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


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------


def subsampling_flops(enc, mel_frames: int) -> tuple[float, int]:
    """(FLOPs, encoder frames out) of the subsampling convolutions on one utterance of
    ``mel_frames`` feature frames, as torch's FlopCounterMode counts them: they run before the
    frame rate drops, so their cost is not their parameters' per frame."""
    from torch.utils.flop_counter import FlopCounterMode

    device = next(enc.parameters()).device
    features = torch.zeros(1, mel_frames, enc._feat_in, device=device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out, _ = enc.pre_encode(features, torch.tensor([mel_frames], device=device))
    return float(counter.get_total_flops()), int(out.shape[1])


def encoder_forward_flops(enc, B: int, mel_frames: int) -> float:
    """Matmul and convolution FLOPs of the encoder's forward on B utterances of ``mel_frames``
    feature frames, for its full-context relative-position attention (the formula in the module
    docstring, the count torch's FlopCounterMode makes)."""
    L, d = enc.n_layers, enc.d_model
    subsampling, T = subsampling_flops(enc, mel_frames)
    # The multiply-adds are the weights of the layers' linear maps and convolutions (their biases
    # and the norms are elementwise, which the count leaves out).
    weights = [
        (name, m.weight.numel())
        for name, m in enc.layers.named_modules()
        if isinstance(m, torch.nn.Linear | torch.nn.Conv1d)
    ]
    positions = sum(n for name, n in weights if name.endswith("self_attn.linear_pos"))
    per_frame = sum(n for _, n in weights) - positions
    return float(
        2 * per_frame * B * T
        + 2 * positions * (2 * T - 1)
        + 2 * L * d * B * T * (4 * T - 1)
        + B * subsampling
    )


def step_flops(model, batch: AsrBatch, phase: int) -> float:
    """Model FLOPs of one optimizer step on ``batch`` (formula in the module docstring)."""
    B, samples = batch.signal.shape
    mel_frames = samples // model.preprocessor.featurizer.hop_length + 1  # centred frames
    T = int(samples / config.TARGET_SAMPLE_RATE / config.ENCODER_FRAME_SECONDS)
    k = 3 if phase == 2 else 1
    encoder = k * encoder_forward_flops(model.encoder, B, mel_frames)
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
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (a real job: GRAD_ACCUM); step times and audio "
        "seconds per second are per optimizer step",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one phase-2 optimizer step of the project instead of timing both sides",
    )
    parser.add_argument(
        "--trace", type=Path, default=None, help="with --profile: write the chrome trace here"
    )
    parser.add_argument(
        "--levers",
        type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
        default=None,
        help="time phase 2 with each of these step-speed levers on against off (sdpa, fused-adamw, "
        "compile, tf32, host-memory-reuse, fused-batch-size=N)",
    )
    parser.add_argument(
        "--keep-base",
        action="store_true",
        help="time phase 2 with the base kept (a frozen copy of it: DISTILL_WEIGHT as set, 1 when "
        "0, on every utterance; L2SP_WEIGHT as set) against without",
    )
    parser.add_argument(
        "--frozen-base",
        type=int,
        default=0,
        metavar="DIM",
        help="time phase 2 of the frozen base (BASE_ADAPTER_DIM=DIM: adapters and the last quarter "
        "of the pieces as new rows train) against the whole model training",
    )
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
    parser.add_argument(
        "--predict-mfu",
        type=float,
        default=None,
        help="run nothing: print the step time and audio s/s the FLOP count predicts at this MFU "
        "(percent) on the device's peak (--peak-tflops, default an H100/H200's 989)",
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
            model,
            model.tokenizer,
            lambda seconds: heaviest_batch_shape(seconds, args.tokens_per_second),
            args.max_search,
            device,
            precision,
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
    too_large = estimated_host_bytes(model, shape) > available_host_bytes()
    if device.type == "cpu" and too_large and not args.predict_mfu:
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
        f"{shape.describe()}; {args.grad_accum} per optimizer step"
    )
    # As train.py applies it: process-wide, so NeMo's side runs with it too.
    process_changes = step_speed.apply_to_process(
        SpeedSettings.from_config(), on_cpu=device.type == "cpu"
    )
    print(f"step speed: {describe_speed(SpeedSettings.from_config(), model, process_changes)}")
    if args.predict_mfu:
        return predict(model, batch, shape, args)
    if args.profile:
        return profile_step(model, batch, shape, args, device, precision)
    if args.levers:
        return compare_levers(model, batch, shape, args, device, precision)
    if args.keep_base:
        return compare_keep_base(model, batch, shape, args, device, precision)
    if args.frozen_base:
        return compare_frozen_base(model, batch, shape, args, device, precision, tokenizer_dir)
    return time_sides(model, batch, shape, args, device, precision)


def predict(model, batch, shape, args) -> int:
    """What the FLOP count predicts at ``--predict-mfu``: a prediction, printed as one."""
    peak = (args.peak_tflops or PEAK_BF16_FLOPS["H100"] / 1e12) * 1e12
    mfu = args.predict_mfu / 100
    audio = shape.audio_seconds * args.grad_accum
    for phase in (1, 2):
        flops = step_flops(model, batch, phase) * args.grad_accum
        step_s = flops / (mfu * peak)
        print(
            f"phase {phase} PREDICTED (not measured) at MFU {args.predict_mfu:g}% of "
            f"{peak / 1e12:g} TFLOP/s: {flops / 1e9:.4g} GFLOP a step, {step_s:.4g} s/step, "
            f"{audio / step_s:.0f} audio s/s"
        )
    return 0


def describe_speed(settings: SpeedSettings, model, process_changes: list[str]) -> str:
    """The step-speed settings as the project's step will run them on ``model`` (the model is
    left as it was found: its own settings), with what ``apply_to_process`` changed."""
    changes = apply_to_model(model, settings)
    apply_to_model(model, SpeedSettings())
    return step_speed.describe(settings, changes + process_changes)


def run_kwargs(args, device, precision) -> dict:
    return dict(
        warmup=args.warmup,
        steps=args.steps,
        device=device,
        precision=precision,
        grad_accum=args.grad_accum,
    )


def time_sides(model, batch, shape, args, device, precision) -> int:
    """Both phases of both sides, ``--rounds`` times: the step times, audio s/s, memory, MFU, ratio."""
    phases = [int(p) for p in args.phases.split(",") if p.strip()]
    sides = ["project"] if args.skip_nemo else ["project", "nemo"]
    results: dict[tuple[str, int], list[RunResult]] = {}
    for round_ in range(args.rounds):
        for phase in phases:
            # Odd rounds run NeMo first: whatever the first run of a process pays (allocator and page
            # warm-up) falls on each side equally often.
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                results.setdefault((side, phase), []).append(
                    run_steps(side, model, batch, phase, **run_kwargs(args, device, precision))
                )
    peak = peak_flops(device, args.peak_tflops)
    memory_kind = "peak GPU memory allocated" if device.type == "cuda" else "peak host RSS"
    audio = shape.audio_seconds * args.grad_accum
    for phase in phases:
        flops = step_flops(model, batch, phase) * args.grad_accum
        medians = {}
        for side in sides:
            runs = results[(side, phase)]
            times = [t for r in runs for t in r.times]
            med = statistics.median(times)
            medians[side] = med
            line = (
                f"phase {phase} {side:<7}: median step {med:8.3f} s over {len(times)} steps "
                f"(min {min(times):.3f}, max {max(times):.3f}), {audio / med:8.1f} audio s/s, "
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


class ProfileStep(pl.Callback):
    """Profile optimizer step ``step`` (0-based; ``grad_accum`` micro-batches) of a run: the
    profiler starts at its first micro-batch and stops after its last, device synchronized at both
    ends; ``wall_s`` is the time in between."""

    def __init__(self, step: int, grad_accum: int, device: torch.device):
        self.first = step * grad_accum
        self.last = self.first + grad_accum - 1
        self.device = device
        self.prof = None
        self.wall_s = 0.0
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.first:
            sync(self.device)
            self.prof = torch.profiler.profile(activities=step_profile.activities(self.device))
            self.prof.start()
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.last and self.prof is not None:
            sync(self.device)
            self.wall_s = time.perf_counter() - self._start
            self.prof.stop()


class MarkParts(pl.Callback):
    """``step_profile.PartMarks`` on the trained model and its module for the whole run."""

    def __init__(self):
        self.marks = None

    def on_train_start(self, trainer, pl_module):
        self.marks = step_profile.PartMarks(pl_module.model, pl_module).__enter__()

    def on_train_end(self, trainer, pl_module):
        if self.marks is not None:
            self.marks.__exit__(None, None, None)


def profile_step(model, batch, shape, args, device, precision) -> int:
    """``--warmup`` phase-2 optimizer steps of the project, then one profiled: the parts table."""
    profiler = ProfileStep(args.warmup, args.grad_accum, device)
    run_steps(
        "project",
        model,
        batch,
        2,
        warmup=args.warmup,
        steps=1,
        device=device,
        precision=precision,
        grad_accum=args.grad_accum,
        callbacks=[MarkParts(), profiler],
    )
    if profiler.prof is None:
        print("the profiled step did not run", file=sys.stderr)
        return 1
    table = step_profile.step_table(profiler.prof.events(), wall_s=profiler.wall_s, device=device)
    print(
        step_profile.format_table(
            table,
            f"where one phase-2 optimizer step's time goes ({args.grad_accum} micro-batch(es) of "
            f"{shape.describe()}; {device.type}, {precision}):",
        )
    )
    if args.trace is not None:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.prof.export_chrome_trace(str(args.trace))
        print(f"trace written: {args.trace}")
    return 0


def eval_loss(model, batch: AsrBatch, device: torch.device, precision: str) -> float:
    """The loss of ``batch`` in eval mode (no dropout, no SpecAugment), under ``precision``."""
    model.eval()
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if precision.startswith("bf16")
        else contextlib.nullcontext()
    )
    with torch.no_grad(), autocast:
        loss = asr_model.training_loss(
            model.to(device), batch.on_device(device), encoder_frozen=True
        )
    model.train()
    return float(loss)


def compare_levers(model, batch, shape, args, device, precision) -> int:
    """Phase 2 with each lever on against the knobs as set, alternating, ``--rounds`` rounds."""
    on_cpu = device.type == "cpu"
    base = SpeedSettings.from_config().resolved(on_cpu=on_cpu)
    audio = shape.audio_seconds * args.grad_accum
    changes = step_speed.apply_to_process(base, on_cpu=on_cpu)
    print(
        f"levers, each on against the knobs as set ({describe_speed(base, model, changes)}), "
        "phase 2:"
    )
    for lever in args.levers:
        try:
            on = base.with_lever(lever)
        except ValueError as exc:
            print(f"error: --levers: {exc}", file=sys.stderr)
            return 2
        if on == base:
            print(f"{lever:<22}: already on in the knobs as set; nothing to compare")
            continue
        losses = {}
        for name, settings in (("off", base), ("on", on)):
            apply_to_model(model, settings)
            step_speed.apply_to_process(settings, on_cpu=on_cpu)
            losses[name] = eval_loss(model, batch, device, precision)
        apply_to_model(model, SpeedSettings())
        runs: dict[str, list[RunResult]] = {"off": [], "on": []}
        for round_ in range(args.rounds):
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            for name in order:
                settings = base if name == "off" else on
                step_speed.apply_to_process(settings, on_cpu=on_cpu)
                runs[name].append(
                    run_steps(
                        "project",
                        model,
                        batch,
                        2,
                        speed=settings,
                        **run_kwargs(args, device, precision),
                    )
                )
        step_speed.apply_to_process(base, on_cpu=on_cpu)
        medians = {k: statistics.median(t for r in v for t in r.times) for k, v in runs.items()}
        paired = [
            on_run.median / off_run.median for on_run, off_run in zip(runs["on"], runs["off"])
        ]
        ratio = statistics.median(paired)
        loss_diff = abs(losses["on"] - losses["off"]) / max(abs(losses["off"]), 1e-12)
        peak = max(r.peak_bytes for r in runs["on"]) / 2**30
        print(
            f"{lever:<22}: on/off step time {ratio:.3f} (paired rounds "
            + ", ".join(f"{r:.3f}" for r in paired)
            + f"); on {medians['on']:.3f} s ({audio / medians['on']:.1f} audio s/s, peak "
            f"{peak:.2f} GiB), off {medians['off']:.3f} s; eval loss on {losses['on']:.5f}, off "
            f"{losses['off']:.5f} (relative difference {loss_diff:.1e})"
        )
    return 0


def compare_keep_base(model, batch, shape, args, device, precision) -> int:
    """Phase 2 with the base kept against without, alternating, ``--rounds`` rounds: the frozen
    copy train.py makes (``base_anchor.frozen_base``: its matrix weights in the training dtype
    unless L2SP_WEIGHT pulls toward them), DISTILL_WEIGHT as set (1 when 0), every utterance of the batch
    in one of the base's languages (distillation's most: in a run only the base's share is)."""
    import dataclasses

    import base_anchor
    from sampler import BatchingSettings

    weight = config.DISTILL_WEIGHT or 1.0
    dtype = base_anchor.run_copy_dtype(precision)
    base = base_anchor.FrozenBase.of(model, dtype)
    batching = dataclasses.replace(
        BatchingSettings.from_config(), base_languages=tuple(sorted(set(batch.langs)))
    )
    on_cpu = device.type == "cpu"
    speed = SpeedSettings.from_config().resolved(on_cpu=on_cpu)
    print(
        f"the base kept: a frozen copy of {base.nbytes() / 2**20:.0f} MiB "
        f"({'float32' if config.L2SP_WEIGHT > 0 else precision} weights), DISTILL_WEIGHT={weight:g} on every "
        f"utterance, L2SP_WEIGHT={config.L2SP_WEIGHT:g}; phase 2:"
    )
    runs: dict[str, list[RunResult]] = {"off": [], "on": []}
    saved = config.DISTILL_WEIGHT
    try:
        for round_ in range(args.rounds):
            for name in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                config.DISTILL_WEIGHT = weight if name == "on" else 0.0
                runs[name].append(
                    run_steps(
                        "project",
                        model,
                        batch,
                        2,
                        speed=speed,
                        base=base if name == "on" else None,
                        batching=batching,
                        **run_kwargs(args, device, precision),
                    )
                )
    finally:
        config.DISTILL_WEIGHT = saved
    print(paired_line("keep-base", runs, "on", "off", shape.audio_seconds * args.grad_accum))
    return 0


def paired_line(label: str, runs: dict[str, list[RunResult]], a: str, b: str, audio: float) -> str:
    """One line of two sides timed in alternating rounds: the median over the rounds of side
    ``a``'s step time over ``b``'s in the same round, each round's ratio, and per side the median
    step time over every step, its audio seconds per second (``audio`` per step) and its peak."""
    medians = {k: statistics.median(t for r in v for t in r.times) for k, v in runs.items()}
    paired = [x.median / y.median for x, y in zip(runs[a], runs[b])]
    peaks = {k: max(r.peak_bytes for r in v) / 2**30 for k, v in runs.items()}
    return (
        f"{label}: {a}/{b} step time {statistics.median(paired):.3f} (paired rounds "
        + ", ".join(f"{r:.3f}" for r in paired)
        + "); "
        + ", ".join(
            f"{k} {medians[k]:.3f} s ({audio / medians[k]:.1f} audio s/s, peak {peaks[k]:.2f} GiB)"
            for k in (a, b)
        )
    )


def compare_frozen_base(model, batch, shape, args, device, precision, tokenizer_dir) -> int:
    """Phase 2 of the model built again as a frozen base (``base_adapters.add_adapters`` with
    ``--frozen-base`` as BASE_ADAPTER_DIM, the last quarter of its pieces taken for the new ones)
    against the whole model training, alternating, ``--rounds`` rounds; with what each side
    trains: its parameters taking gradients, and the bytes of their float32 gradients and AdamW
    moments (12 per parameter). A CPU's peak is the process's resident set, which keeps what
    the allocator does not hand back: compare the counted bytes there."""
    import base_adapters
    import vocabulary

    torch.manual_seed(config.SEED)  # the same weights as ``model``
    held = asr_model.build_model(tokenizer_dir=tokenizer_dir, adapter_dim=0)
    pieces = vocabulary.model_pieces(held)
    own = len(pieces) * 3 // 4
    held.new_piece_rows = list(range(own, len(pieces)))
    base_adapters.add_adapters(
        held,
        args.frozen_base,
        ("en",),
        pieces[:own],
        [p for p, _ in asr_model.new_piece_parameters(held)],
    )
    speed = SpeedSettings.from_config().resolved(on_cpu=device.type == "cpu")
    trained = {}
    for name, which in (("whole", model), ("frozen", held)):
        reset_model(which)
        trained[name] = sum(p.numel() for p in which.parameters() if p.requires_grad)
    print(
        f"the frozen base: BASE_ADAPTER_DIM={args.frozen_base}, {len(pieces) - own} of "
        f"{len(pieces)} pieces new; trains {trained['frozen']:,} parameters (the adapters and "
        f"the vocabulary's two tensors) against {trained['whole']:,}: gradients and AdamW moments "
        f"{12 * trained['frozen'] / 2**30:.2f} GiB against {12 * trained['whole'] / 2**30:.2f} "
        f"GiB; phase 2:"
    )
    runs: dict[str, list[RunResult]] = {"whole": [], "frozen": []}
    for round_ in range(args.rounds):
        for name in ("whole", "frozen") if round_ % 2 == 0 else ("frozen", "whole"):
            runs[name].append(
                run_steps(
                    "project",
                    held if name == "frozen" else model,
                    batch,
                    2,
                    speed=speed,
                    **run_kwargs(args, device, precision),
                )
            )
    audio = shape.audio_seconds * args.grad_accum
    print(paired_line("frozen-base", runs, "frozen", "whole", audio))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
