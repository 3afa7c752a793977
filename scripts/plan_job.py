"""Plan a training job before booking GPUs for it: optimizer steps per epoch and in all, where the
two phases fall, wall time and GPU-hours, DataLoader workers and CPU cores per node, checkpoint size
and disk. Every figure says whether it was measured (device, date, the page of docs/ that holds it)
or is predicted, and from what.

Usage:
    python scripts/plan_job.py --epochs 3 --gpus 8 --gpu h100          # TRAIN_MANIFEST_PATH's corpus
    python scripts/plan_job.py --manifest data/train_manifest_v2.parquet --epochs 3 --gpus 8 \\
        --nodes 2 --gpu h200
    python scripts/plan_job.py --hours 3000 --languages hi,ta,en --epochs 3 --gpus 8 --gpu h100
    python scripts/plan_job.py --languages hi:1500,ta:500,en:1000 --epochs 3 --gpus 8 --gpu h100
    GRAD_ACCUM=1 MAX_BATCH_DURATION=480 python scripts/plan_job.py ...    # the job's own knobs

The batching, schedule and checkpoint knobs are read as the job's environment sets them
(config.py): export what train.py will run with, then plan. One epoch is packed by train.py's own
sampler (``manifest_report.sampler_plan``): the manifest as it is, or for ``--hours`` a synthetic
corpus of the sampler's reference durations (lognormal, median 6 s, sigma 0.6, clipped to
MIN_DURATION..MAX_DURATION) scaled to the hours. Every rank gets whole optimizer steps of
GRAD_ACCUM micro-batches, so

    optimizer steps per epoch = floor(micro-batches of one epoch / (ranks x GRAD_ACCUM))
    optimizer steps in all    = ceil(epochs x steps per epoch)            (set MAX_STEPS to it)

The figures the plan rests on are ``FIGURES``, each with its device, date and the page of docs/
that states it (tests/test_plan_job.py checks the page still says it). Only an H200 step was
measured: ``--gpu h100`` is predicted from it, and any other GPU kind gets the figures that need no
GPU and a note that nothing is measured for it. The model is parakeet-tdt-0.6b's architecture (the
one measured), whatever MODEL_CONFIG says.

Wrong input (a missing manifest, a malformed ``--languages``, zero GPUs, ...) is one line,
``error: ...`` naming the argument, and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import config
from manifest_schema import LANG_CODE_PATTERN, UNKNOWN_LANG
from process_control import UserError, report_user_error

MEASURED = "measured"
PREDICTED = "predicted"


@dataclass(frozen=True)
class Figure:
    """A figure the plan rests on: its value, whether it was measured in this project or is
    predicted, what and where (device, date), and the page of docs/ that states it in the words of
    ``quote`` (whitespace aside)."""

    value: float
    kind: str
    what: str
    page: str
    quote: str

    def source(self) -> str:
        return f"{self.kind}: {self.what}, {self.page}"


_H200_STEP = "H200, 2026-11-27, the full-size step in bf16-mixed"
_CPU_WORKER = "2-core x86-64, 2026-11-28"

FIGURES = {
    "step_audio_s": Figure(
        120.0,
        MEASURED,
        f"{_H200_STEP}, its micro-batch at MAX_BATCH_DURATION=90",
        "docs/benchmarks.md",
        "6 utterances, 120.0 s of audio",
    ),
    "step_phase1_s": Figure(
        0.153,
        MEASURED,
        f"{_H200_STEP}, phase 1",
        "docs/benchmarks.md",
        "phase 1: 0.153 s/step, 784 audio s/s",
    ),
    "step_phase2_s": Figure(
        0.227,
        MEASURED,
        f"{_H200_STEP}, phase 2",
        "docs/benchmarks.md",
        "phase 2: 0.227 s/step, 528 audio s/s",
    ),
    "parameters": Figure(
        0.632e9,
        MEASURED,
        "H200, 2026-11-27, configs/parakeet_tdt_0.6b.yaml at 12k pieces",
        "docs/benchmarks.md",
        "0.632 B parameters",
    ),
    "worker_audio_s_per_s": Figure(
        1360.0,
        MEASURED,
        f"{_CPU_WORKER}, one DataLoader worker, no augmentation (bench_data_path.py)",
        "docs/benchmarks.md",
        "one worker delivers 1,360 audio s/s",
    ),
    # A worker's CPU per second of audio: decoding, and what each augmentation adds to it.
    "decode_ms": Figure(
        0.27,
        MEASURED,
        f"{_CPU_WORKER}, decoding",
        "docs/benchmarks.md",
        "A worker decodes 1 audio second in 0.27 ms",
    ),
    "speed_ms": Figure(
        0.18,
        MEASURED,
        f"{_CPU_WORKER}, SPEED_PERTURB=0.9,1.0,1.1",
        "docs/benchmarks.md",
        "two thirds of the utterances, 0.18 ms",
    ),
    "noise_generated_ms": Figure(
        0.07,
        MEASURED,
        f"{_CPU_WORKER}, generated noise on every utterance",
        "docs/benchmarks.md",
        "generated noise on every utterance adds 0.07 ms",
    ),
    "noise_files_ms": Figure(
        0.36,
        MEASURED,
        f"{_CPU_WORKER}, NOISE_DIR noise on every utterance",
        "docs/benchmarks.md",
        "0.36 ms, more than the utterance itself",
    ),
}

# A worker's audio rate under augmentation over its rate without, where a setting was measured as
# such: (speed factors, noise source, NOISE_PROB) -> the figure.
AUGMENTATION_RATIOS = {
    ((0.9, 1.0, 1.1), None, 0.0): Figure(
        0.57,
        MEASURED,
        f"{_CPU_WORKER}, SPEED_PERTURB=0.9,1.0,1.1",
        "docs/benchmarks.md",
        "speed 0.9,1.0,1.1 2215 0.57",
    ),
    ((), "generated", 1.0): Figure(
        0.79,
        MEASURED,
        f"{_CPU_WORKER}, NOISE_PROB=1, generated",
        "docs/benchmarks.md",
        "noise p=1, generated 2978 0.79",
    ),
    ((), "files", 1.0): Figure(
        0.44,
        MEASURED,
        f"{_CPU_WORKER}, NOISE_PROB=1, NOISE_DIR",
        "docs/benchmarks.md",
        "noise p=1, NOISE_DIR 1594 0.44",
    ),
    ((0.9, 1.0, 1.1), "generated", 0.5): Figure(
        0.55,
        MEASURED,
        f"{_CPU_WORKER}, SPEED_PERTURB=0.9,1.0,1.1 and NOISE_PROB=0.5, generated",
        "docs/benchmarks.md",
        "speed + noise p=0.5, generated 2086 0.55",
    ),
}

# Workers for a quarter more audio than the GPU takes, as benchmarks.md's worker arithmetic: a
# worker's rate varies with the audio and the storage.
WORKER_HEADROOM = 1.25

# NVIDIA's data sheets: both chips have 989 TFLOP/s of dense bf16; memory bandwidth differs.
H200_TB_PER_S = 4.8
H100_SXM_TB_PER_S = 3.35


@dataclass(frozen=True)
class GpuKind:
    """How a GPU kind's step relates to the H200's measured one: ``slower`` multiplies its time per
    micro-batch (``how`` says why), the bound safe for booking time. Its audio demand is taken as
    the H200's, the bound safe for sizing workers: no kind listed is faster."""

    name: str
    slower: float
    how: str


GPUS = {
    "h200": GpuKind("H200", 1.0, "the step measured on an H200"),
    "h100": GpuKind(
        "H100",
        H200_TB_PER_S / H100_SXM_TB_PER_S,
        f"x {H200_TB_PER_S / H100_SXM_TB_PER_S:.2f} for an H100: the H200's memory bandwidth over "
        f"an H100 SXM's ({H200_TB_PER_S} / {H100_SXM_TB_PER_S} TB/s; both 989 TFLOP/s of dense "
        "bf16), the most a step bound by memory traffic loses; no H100 was measured",
    ),
}

# The synthetic corpus --hours is packed from: the sampler's reference durations, this many.
SYNTHETIC_UTTERANCES = 100_000
SYNTHETIC_MEDIAN_S = 6.0
SYNTHETIC_SIGMA = 0.6

# Knobs the plan's figures depend on, as its first lines show them.
SETTINGS_SHOWN = (
    "MAX_BATCH_DURATION",
    "GRAD_ACCUM",
    "TEMPERATURE",
    "LANG_WEIGHTING",
    "EPOCH_SIZE",
    "SPEED_PERTURB",
    "NOISE_PROB",
    "NOISE_DIR",
    "NUM_WORKERS",
    "MAX_STEPS",
    "UNFREEZE_STEP",
    "WARMUP_STEPS",
    "PHASE2_WARMUP",
    "CHECKPOINT_EVERY",
    "KEEP_CHECKPOINTS",
    "KEEP_BEST_CHECKPOINTS",
    "PRECISION",
)
# Knobs the plan reads (listed in --help with their values now).
KNOBS_READ = (
    "TRAIN_MANIFEST_PATH",
    "MIN_DURATION",
    "MAX_DURATION",
    "BUCKET_BOUNDARIES",
    *SETTINGS_SHOWN,
)


class PlanInputError(UserError, ValueError):
    """An argument of plan_job.py the plan cannot use; the message names it."""


# ---- the corpus ---------------------------------------------------------------------------------


@dataclass
class Corpus:
    """What one epoch holds: ``batches`` micro-batches (every rank's, before the deal) carrying
    ``audio_s`` seconds of audio as played; ``describe`` says what it is, ``packing`` where its
    packing comes from."""

    describe: str
    batches: float
    audio_s: float
    packing: str


def parse_languages(text: str) -> list[tuple[str, float | None]]:
    """``hi,ta,en`` or ``hi:1500,ta:500,en:1000`` as [(language, hours or None)]."""
    out: list[tuple[str, float | None]] = []
    for item in text.split(","):
        lang, _, hours = item.strip().partition(":")
        lang = lang.strip().lower()
        if not re.fullmatch(LANG_CODE_PATTERN, lang) or any(lang == seen for seen, _ in out):
            raise PlanInputError(
                f"--languages {text!r}: expected distinct language codes such as 'hi,ta,en', each "
                f"with its hours if known ('hi:1500,ta:500,en:1000'); bad: {item.strip()!r}"
            )
        if not hours:
            out.append((lang, None))
            continue
        try:
            value = float(hours)
        except ValueError:
            value = -1.0
        if not 0 < value < math.inf:
            raise PlanInputError(
                f"--languages {text!r}: {lang}'s hours {hours!r} are not a positive number"
            )
        out.append((lang, value))
    return out


def hours_per_language(hours: float | None, languages: str | None) -> tuple[dict[str, float], str]:
    """({language: hours}, how the split was chosen) from --hours and --languages."""
    given = parse_languages(languages) if languages else [(UNKNOWN_LANG, None)]
    if hours is not None and not 0 < hours < math.inf:
        raise PlanInputError(f"--hours {hours:g}: expected a positive number of hours")
    known = [h for _, h in given if h is not None]
    if known and len(known) < len(given):
        raise PlanInputError(
            f"--languages {languages!r}: give the hours of every language or of none"
        )
    if known:
        total = sum(known)
        if hours is not None and abs(total - hours) > 0.005 * hours:
            raise PlanInputError(
                f"--hours {hours:g} differs from the {total:g} h --languages {languages!r} sums to: "
                "leave out --hours or make them agree"
            )
        return {lang: h for lang, h in given}, "hours per language as given"
    if hours is None:
        raise PlanInputError(
            "--languages without hours: add --hours H, or give each language's hours "
            "('hi:1500,ta:500,en:1000')"
        )
    split = "one language" if not languages else "split evenly across the languages"
    return {lang: hours / len(given) for lang, _ in given}, split


def _pack(durations: np.ndarray, languages: np.ndarray) -> tuple[int, float]:
    """(micro-batches, seconds of audio) of epoch 0 as train.py's sampler packs it."""
    from scripts.manifest_report import sampler_plan

    plan = sampler_plan(durations, languages)
    kept = np.asarray(plan["batches"], dtype=np.float64)
    audio = float(np.sum(kept * np.asarray(plan["mean_batch_seconds"])))
    batches = int(kept.sum()) + int(plan["stats"]["trimmed_batches"])
    # The trimmed batches (fewer than GRAD_ACCUM) are the cheapest: counted at the kept mean.
    return batches, audio * batches / max(kept.sum(), 1.0)


def corpus_from_manifest(path: Path) -> Corpus:
    """One epoch of the manifest as train.py's sampler packs it (without the joint cap, which
    needs the training cache's token counts)."""
    from scripts.manifest_report import read_manifest

    try:
        durations, languages = read_manifest(path)
    except (FileNotFoundError, ValueError) as exc:
        raise PlanInputError(f"--manifest (default TRAIN_MANIFEST_PATH): {exc}") from None
    batches, audio = _pack(durations, languages)
    names, codes = np.unique(languages, return_inverse=True)
    hours = np.bincount(codes, weights=durations) / 3600
    per_lang = ", ".join(f"{n} {h:,.0f} h" for n, h in zip(names.tolist(), hours.tolist()))
    return Corpus(
        f"{path}: {len(durations):,} utterances, {durations.sum() / 3600:,.0f} h ({per_lang})",
        batches,
        audio,
        f"the sampler's plan of epoch 0 of {path.name}, without the joint cap "
        "(MAX_BATCH_JOINT_CELLS needs the training cache)",
    )


def corpus_from_hours(hours: dict[str, float], split: str) -> Corpus:
    """One epoch of ``hours`` of audio (per language), packed as the sampler packs a synthetic
    corpus of its reference durations, scaled to the hours: each language's utterances are
    taken to last as long as the others'."""
    total_s = 3600 * sum(hours.values())
    rng = np.random.default_rng(0)
    durations = np.clip(
        rng.lognormal(np.log(SYNTHETIC_MEDIAN_S), SYNTHETIC_SIGMA, SYNTHETIC_UTTERANCES),
        config.MIN_DURATION,
        config.MAX_DURATION,
    )
    shares = np.array(list(hours.values())) / sum(hours.values())
    counts = np.floor(shares * SYNTHETIC_UTTERANCES).astype(int)
    counts[0] += SYNTHETIC_UTTERANCES - counts.sum()
    languages = np.repeat(np.array(list(hours)), counts)
    batches, audio = _pack(durations, languages)
    # EPOCH_SIZE set: the sample's plan already holds one epoch's utterances.
    scale = total_s / durations.sum() if config.EPOCH_SIZE == 0 else 1.0
    names = list(hours)
    per_lang = (
        ""
        if names == [UNKNOWN_LANG]
        else " (" + ", ".join(f"{n} {h:,.0f} h" for n, h in hours.items()) + f": {split})"
    )
    return Corpus(
        f"{total_s / 3600:,.0f} h of audio{per_lang}",
        batches * scale,
        audio * scale,
        f"the sampler's plan of a synthetic corpus of lognormal durations (median "
        f"{SYNTHETIC_MEDIAN_S:g} s, sigma {SYNTHETIC_SIGMA:g}, {config.MIN_DURATION:g}-"
        f"{config.MAX_DURATION:g} s), scaled to the hours",
    )


# ---- the plan -----------------------------------------------------------------------------------


def augmentation_ratio() -> Figure | None:
    """A worker's audio rate with the augmentation in force over its rate without; None without
    augmentation. Measured where the setting was; else predicted from the measured costs per
    second of audio."""
    from sampler_inputs import speed_factors

    speeds = speed_factors(config.SPEED_PERTURB)
    prob = float(config.NOISE_PROB)
    noise = None if prob == 0 else ("files" if config.NOISE_DIR else "generated")
    if not speeds and noise is None:
        return None
    measured = AUGMENTATION_RATIOS.get((tuple(speeds), noise, prob))
    if measured is not None:
        return measured
    ms = {name: FIGURES[name].value for name in FIGURES if name.endswith("_ms")}
    # The resample costs only the utterances played at a factor other than 1: two in three of
    # the measured 0.9,1.0,1.1.
    resampled = sum(f != 1.0 for f in speeds) / len(speeds) if speeds else 0.0
    extra = ms["speed_ms"] * resampled / (2 / 3)
    if noise:
        extra += prob * ms[f"noise_{noise}_ms"]
    ratio = ms["decode_ms"] / (ms["decode_ms"] + extra)
    return Figure(
        ratio,
        PREDICTED,
        f"{ms['decode_ms']:g} ms of decoding per audio second over {ms['decode_ms'] + extra:.3g} "
        "with this augmentation, from the costs measured per audio second (2-core x86-64, "
        "2026-11-28)",
        "docs/benchmarks.md",
        "",
    )


def checkpoint_bytes(parameters: float) -> int:
    """One step checkpoint of a model of ``parameters`` weights in the PRECISION's weight dtype,
    as ``checkpoints.estimated_checkpoint_bytes`` counts it (a meta-device stand-in: no memory)."""
    import torch

    from checkpoints import estimated_checkpoint_bytes

    model = torch.nn.Module()
    model.weights = torch.nn.Parameter(
        torch.empty(int(parameters), device="meta", dtype=weight_dtype())
    )
    return estimated_checkpoint_bytes(model)


def weight_dtype():
    """The dtype Lightning keeps the weights in under PRECISION (mixed precisions keep float32)."""
    import torch

    return {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}.get(
        config.PRECISION, torch.float32
    )


def schedule_warnings(total_steps: int) -> list[str]:
    """train.py's warnings about the schedule (``training_step.schedule_warnings``) for a run of
    ``total_steps`` optimizer steps, whatever MAX_STEPS says now."""
    import training_step

    in_effect = config.MAX_STEPS
    config.MAX_STEPS = total_steps
    try:
        return training_step.schedule_warnings()
    finally:
        config.MAX_STEPS = in_effect


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h"


def plan_lines(corpus: Corpus, epochs: float, gpus: int, nodes: int, gpu: str) -> list[str]:
    """The plan as printed: ``given:`` lines (the inputs), sections of figure lines (``  label:
    value  (measured|predicted: source)``), a ``note:`` for a GPU kind nothing is measured for,
    ``warning:`` lines, and the ``run with:`` line."""
    ranks = gpus * nodes
    accum = config.GRAD_ACCUM
    cap = config.MAX_BATCH_DURATION
    kind = GPUS.get(gpu)
    per_step = ranks * accum
    steps_per_epoch = int(corpus.batches // per_step)
    if steps_per_epoch == 0:
        raise PlanInputError(
            f"--gpus {gpus} --nodes {nodes}: one epoch packs into {corpus.batches:,.0f} "
            f"micro-batches, fewer than the {ranks} ranks x GRAD_ACCUM={accum} of one optimizer "
            "step: fewer ranks, a smaller GRAD_ACCUM or MAX_BATCH_DURATION, or more data"
        )
    total = math.ceil(epochs * steps_per_epoch)
    batch_audio = corpus.audio_s / corpus.batches
    out = [
        f"given: {corpus.describe}",
        f"given: {epochs:g} epochs on {nodes} node(s) x {gpus} GPUs ({kind.name if kind else gpu})"
        f" = {ranks} ranks",
        "given: " + " ".join(f"{k}={_knob(k)}" for k in SETTINGS_SHOWN),
        "steps",
        f"  audio per optimizer step: {per_step * batch_audio:,.0f} s = {ranks} ranks x {accum} "
        f"micro-batches x {cap:g} s x {batch_audio / cap:.1%} filled  (predicted: "
        f"{corpus.packing})",
        f"  optimizer steps per epoch: {steps_per_epoch:,}  (predicted: {corpus.batches:,.0f} "
        f"micro-batches of {batch_audio:.1f} s, {per_step} to an optimizer step)",
        f"  optimizer steps in all: {total:,}  (predicted: {epochs:g} epochs x {steps_per_epoch:,})",
    ]
    unfreeze = config.UNFREEZE_STEP
    phase1 = min(unfreeze, total)
    phase2 = total - phase1
    at = f"predicted: UNFREEZE_STEP={unfreeze} against the {total:,} steps"
    out.append("phases")
    if phase1:
        whole = ", the whole run" if phase1 == total else ""
        out.append(
            f"  phase 1, encoder frozen: steps 0-{phase1:,} (epochs 0-"
            f"{phase1 / steps_per_epoch:.2f}{whole}), LR warm-up WARMUP_STEPS="
            f"{config.WARMUP_STEPS}  ({at})"
        )
    if phase2:
        out.append(
            f"  phase 2, everything trains: steps {phase1:,}-{total:,} (epochs "
            f"{phase1 / steps_per_epoch:.2f}-{epochs:g}), LR warm-up PHASE2_WARMUP="
            f"{config.PHASE2_WARMUP}, then cosine to MIN_LR  ({at})"
        )
    warnings = [f"warning: {line}" for line in schedule_warnings(total)]
    if config.MAX_STEPS != total:
        warnings.append(
            f"warning: MAX_STEPS={config.MAX_STEPS} (in effect) is "
            f"{config.MAX_STEPS / steps_per_epoch:,.1f} epochs of this corpus, not {epochs:g}: "
            f"set MAX_STEPS={total}"
        )
    run_with = {"MAX_STEPS": total}
    if kind is None:
        out.append(
            f"note: no time, GPU-hours or workers: nothing is measured on {gpu} GPUs "
            "(docs/benchmarks.md holds an H200's step only; --gpu h200 or h100 plans from it); "
            "gpu_acceptance.py's throughput stage measures the step and the workers it needs"
        )
    else:
        out += _time(kind, phase1, phase2, batch_audio, ranks)
        out += _workers(kind, phase1, gpus, warnings, run_with)
    out += _disk(total)
    out += warnings
    out.append("run with: " + " ".join(f"{k}={v}" for k, v in run_with.items()))
    return out


def _knob(name: str) -> str:
    value = getattr(config, name)
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" for v in value) or "off"
    if value is None or (name == "NUM_WORKERS" and config.KNOBS[name].source != "env"):
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _time(kind: GpuKind, phase1: int, phase2: int, batch_audio: float, ranks: int) -> list[str]:
    """Time per micro-batch in each phase, wall time, GPU-hours, time between checkpoints."""
    accum = config.GRAD_ACCUM
    step_audio = FIGURES["step_audio_s"].value
    # A lighter micro-batch than the measured one is taken to take as long (the measured step
    # left an H200 mostly idle: time per kernel, not per second of audio), a heavier one as long
    # per second of audio: the slower of the two, the side safe for booking.
    heavier = max(1.0, batch_audio / step_audio)
    lines = ["time"]
    times = {}
    for phase, steps in ((1, phase1), (2, phase2)):
        measured = FIGURES[f"step_phase{phase}_s"]
        times[phase] = measured.value * kind.slower * heavier
        if not steps:
            continue
        how = f"the H200's {measured.value:g} s for {step_audio:g} s of audio ({measured.source()})"
        if heavier > 1:
            how += f" x {heavier:.2f} for {batch_audio:.0f} s"
        else:
            how += f", the plan's {batch_audio:.0f} s micro-batch taken as no faster"
        if kind.slower != 1:
            how += f"; {kind.how}"
        lines.append(
            f"  one micro-batch, phase {phase}: {times[phase]:.3f} s on an {kind.name}  "
            f"(predicted: {how})"
        )
    wall = accum * (phase1 * times[1] + phase2 * times[2])
    lines += [
        f"  wall time: {_hours(wall)}  (predicted: {accum} micro-batches a step x "
        f"({phase1:,} phase-1 steps x {times[1]:.3f} s + {phase2:,} phase-2 steps x "
        f"{times[2]:.3f} s); not counted: start-up, validation, checkpoint saves, the all-reduce "
        "between nodes)",
        f"  GPU-hours: {wall * ranks / 3600:,.1f}  (predicted: the wall time x {ranks} GPUs)",
    ]
    if config.CHECKPOINT_EVERY <= phase1 + phase2:
        lines.append(
            f"  a checkpoint every {config.CHECKPOINT_EVERY:,} steps: every "
            f"{_hours(wall * config.CHECKPOINT_EVERY / (phase1 + phase2))}  (predicted: the wall "
            "time per step; at most what a job killed without a stop signal loses)"
        )
    return lines


def _workers(kind: GpuKind, phase1: int, gpus: int, warnings: list, run_with: dict) -> list[str]:
    """A GPU's audio demand, one worker's rate (under the augmentation in force), the workers a GPU
    needs and the cores a node needs; a warning where NUM_WORKERS is set below the need."""
    phase = 1 if phase1 else 2  # phase 1 is the faster: its demand is the higher
    measured = FIGURES[f"step_phase{phase}_s"]
    step_audio = FIGURES["step_audio_s"].value
    demand = step_audio / measured.value
    if kind.name == "H200":
        how = f"{measured.kind}: {step_audio:g} s in {measured.value:g} s, {measured.what}"
    else:
        how = (
            f"predicted: the H200's {step_audio:g} s in {measured.value:g} s, "
            f"{measured.kind} ({measured.what}), an {kind.name} taken as no faster"
        )
    worker = FIGURES["worker_audio_s_per_s"]
    ratio = augmentation_ratio()
    rate = worker.value * (ratio.value if ratio else 1.0)
    workers = math.ceil(WORKER_HEADROOM * demand / rate)
    lines = [
        "data loading",
        f"  a GPU's demand: at most {demand:,.0f} audio s/s in phase {phase}  ({how}, "
        f"{measured.page})",
        f"  one DataLoader worker: {worker.value:,.0f} audio s/s  ({worker.source()})",
    ]
    if ratio:
        noise_dir = " from NOISE_DIR" if config.NOISE_DIR and config.NOISE_PROB else ""
        lines.append(
            f"  with SPEED_PERTURB={_knob('SPEED_PERTURB')}, NOISE_PROB={_knob('NOISE_PROB')}"
            f"{noise_dir}: x {ratio.value:.2f}, {rate:,.0f} audio s/s  ({ratio.source()})"
        )
    lines += [
        f"  DataLoader workers per GPU: {workers}  (predicted: ceil({WORKER_HEADROOM:g} x "
        f"{demand:,.0f} / {rate:,.0f}), a quarter spare)",
        f"  CPU cores per node: {gpus * (workers + 1)}  (predicted: {gpus} GPUs x "
        f"({_plural(workers, 'worker')} + 1 for the rank))",
    ]
    if config.KNOBS["NUM_WORKERS"].source == "env":
        if config.NUM_WORKERS < workers:
            warnings.append(
                f"warning: NUM_WORKERS={config.NUM_WORKERS} is below the {workers} a GPU needs: "
                f"set NUM_WORKERS={workers}"
            )
            run_with["NUM_WORKERS"] = workers
    elif workers > 4:
        run_with["NUM_WORKERS"] = workers  # NUM_WORKERS's default stops at 4
    return lines


def _disk(total: int) -> list[str]:
    """Checkpoint size, how many the run keeps at once, and the space CHECKPOINT_DIR needs."""
    params = FIGURES["parameters"]
    size = checkpoint_bytes(params.value)
    nemo = params.value * weight_dtype().itemsize
    every = config.CHECKPOINT_EVERY
    keep = config.KEEP_CHECKPOINTS
    best = config.KEEP_BEST_CHECKPOINTS
    saved = total // every
    # A new checkpoint is written before the oldest is pruned; a stop signal saves one whatever
    # the schedule.
    on_disk = max(1, saved if keep == 0 else min(saved, keep + best + 1))
    kept = (
        "all kept (KEEP_CHECKPOINTS=0)" if keep == 0 else f"KEEP_CHECKPOINTS={keep} + {best} best"
    )
    return [
        "disk",
        f"  model: {params.value / 1e9:.3f} B parameters  ({params.source()})",
        f"  one step checkpoint: {size / 2**30:.2f} GiB  (predicted: "
        f"checkpoints.estimated_checkpoint_bytes: the weights under {config.PRECISION}, AdamW's "
        "two float32 moments, 1% more)",
        f"  step checkpoints saved: {saved:,}, {kept}; at most {on_disk} on disk at once  "
        f"(predicted: every {every:,} of {total:,} steps, at least one for a stop signal)",
        f"  CHECKPOINT_DIR needs: {(on_disk * size + nemo) / 2**30:,.1f} GiB  (predicted: "
        f"{_plural(on_disk, 'checkpoint')} + the final .nemo, {nemo / 2**30:.2f} GiB of weights)",
    ]


# ---- command line -------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are PlanInputErrors: one line naming the argument, exit code 2."""

    def error(self, message):
        raise PlanInputError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment variables read (config.py), effective values now:\n"
        + "\n".join(f"  {k}={_knob(k)}  ({config.KNOBS[k].help})" for k in KNOBS_READ),
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="a training manifest parquet (default TRAIN_MANIFEST_PATH, unless --hours or "
        "--languages describe the corpus)",
    )
    parser.add_argument("--hours", type=float, default=None, help="hours of training audio")
    parser.add_argument(
        "--languages",
        default=None,
        help="the corpus's languages, 'hi,ta,en' (with --hours, split evenly) or with their hours "
        "'hi:1500,ta:500,en:1000'",
    )
    parser.add_argument("--epochs", type=float, required=True, help="passes over the corpus")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node (nproc_per_node)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--gpu",
        required=True,
        help="GPU kind: h200 (measured), h100 (predicted from the H200); any other is accepted "
        "and planned without time and workers (nothing is measured for it)",
    )
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what the plan cannot use, naming the argument."""
    for name in ("gpus", "nodes"):
        if getattr(args, name) < 1:
            raise PlanInputError(f"--{name} {getattr(args, name)}: expected 1 or more")
    if not 0 < args.epochs < math.inf:
        raise PlanInputError(f"--epochs {args.epochs:g}: expected a positive number of epochs")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", args.gpu.lower()):
        raise PlanInputError(f"--gpu {args.gpu!r}: expected a GPU kind such as h100 or h200")
    if args.manifest is not None and (args.hours is not None or args.languages):
        raise PlanInputError(
            "--manifest with --hours or --languages: the manifest has its own hours and "
            "languages; give one or the other"
        )


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_arguments(args)
        if args.hours is not None or args.languages:
            corpus = corpus_from_hours(*hours_per_language(args.hours, args.languages))
        else:
            corpus = corpus_from_manifest(args.manifest or config.TRAIN_MANIFEST_PATH)
        lines = plan_lines(corpus, args.epochs, args.gpus, args.nodes, args.gpu.lower())
    except UserError as exc:
        return report_user_error(exc)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
