"""The data path at the step's rate: what one DataLoader worker delivers, how long train.py's step
waits for data when the real loader feeds it, and how many workers (CPU cores) a GPU needs.

Usage:
    python benchmarks/bench_data_path.py --manifest data/train_manifest_v2.parquet      # CPU, MODEL_CONFIG
    MODEL_CONFIG=configs/parakeet_tdt_0.6b.yaml PRECISION=bf16-mixed MAX_BATCH_DURATION=600 \\
      NUM_WORKERS=4 python benchmarks/bench_data_path.py --manifest .../train_manifest_v2.parquet \\
      --repeat 80 --steps 6 --demand 2400

What it does, in one process (TOKENIZER_DIR's tokenizer; the other knobs as train.py reads them):
1. The corpus: ``--manifest``'s rows ``--repeat`` times over (new segment ids, the same audio
   files), written into ``--work-dir`` with its training cache, so that an epoch outlasts the run.
2. One worker: train.py's sampler and dataset (``training_step.build_dataloader``) with one worker
   and no model, for ``--worker-seconds``: the audio seconds (the utterances' own, no padding) one
   worker, so one CPU core, delivers per second, over as many epochs as that takes. The first
   micro-batches (the worker's start and what it had ready: they arrive at once) are left out; the
   files were read once before, so this is decoding's rate with the page cache warm (cold storage
   adds its reads: preflight's data check measures them on the node).
3. The step fed by that loader: ``TrainingModule`` as train.py builds it, phase 2, GRAD_ACCUM
   micro-batches per optimizer step, PRECISION, NUM_WORKERS workers, ``--warmup`` + ``--steps``
   optimizer steps, each measured as train.py logs it (``callbacks.TrainingMetricsCallback``): step
   time, audio seconds per second, the share of the step spent waiting for data.
4. Workers per GPU: W = ceil(1.25 x demand / one worker's rate), the demand being ``--demand``
   (audio s/s a GPU's step consumes: the fastest phase's, from bench_train_step.py) or else the rate
   step 3 measured; the 25% is headroom for batches of longer files and busier cores. A node of G
   GPUs then needs G x (W + 1) cores: each rank's own process takes one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

import asr_model
import callbacks
import config
import training_cache
from max_batch import FixedPhase, benchmark_trainer, step_precision
from sampler import BatchingSettings
from training_step import NoTrainingData, TrainingModule, build_dataloader, check_audio_sample

HEADROOM = 1.25  # workers supply this multiple of the demand
WAIT_TARGET = 0.02  # the share of step time the step may wait for data


def repeated_manifest(manifest: Path, repeat: int, out_dir: Path) -> Path:
    """``manifest``'s rows ``repeat`` times over, each copy's segment ids suffixed ``~k``, written
    atomically to ``out_dir`` (over an earlier one: the training cache knows it by its content)."""
    out = out_dir / f"{manifest.stem}_x{repeat}.parquet"
    table = pq.read_table(manifest)
    ids = table.column("segment_id").cast(pa.string())
    parts = [
        table.set_column(
            table.column_names.index("segment_id"),
            "segment_id",
            pc.binary_join_element_wise(ids, pa.scalar(f"~{k}"), ""),
        )
        for k in range(repeat)
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    pq.write_table(pa.concat_tables(parts), tmp)
    tmp.replace(out)
    return out


def load_dataset(manifest: Path, tokenizer, work_dir: Path):
    """The training dataset of ``manifest`` as train.py builds it (the NOISE_* knobs' noise
    included: augmentation costs the workers time), its cache in ``work_dir``."""
    from dataset import LocalShardDataset, NoiseSettings

    training_cache.ensure(
        manifest,
        tokenizer,
        frame_seconds=config.ENCODER_FRAME_SECONDS,
        max_token_len=config.MAX_TOKEN_LEN,
        cache_dir=work_dir / "cache",
        workers=config.CACHE_BUILD_WORKERS,
        progress=False,
    )
    return LocalShardDataset(
        manifest,
        tokenizer,
        cache_dir=work_dir / "cache",
        progress=False,
        noise=NoiseSettings.from_config(),
    )


# The micro-batches a worker may have ready before the timing starts (the loader's prefetch_factor
# and the one in flight): they arrive at once, so they are left out of the rate.
PREFETCHED = 3
# Fewer timed micro-batches than this give no rate: advice from them would be noise.
MIN_TIMED_BATCHES = 5


def one_worker_rate(dataset, seconds: float) -> tuple[float | None, int, float, int]:
    """(audio seconds per second, micro-batches, seconds timed, unreadable files) of train.py's
    loader with one worker and no model, timed for ``seconds`` over as many epochs as that takes,
    after the micro-batches the worker had ready at the start (``PREFETCHED``, which arrive at
    once). The rate is None when fewer than ``MIN_TIMED_BATCHES`` were timed."""
    loader, sampler = build_dataloader(
        dataset, BatchingSettings.from_config(), world_size=1, rank=0, pin_memory=False, workers=1
    )
    audio, batches, seen, bad = 0.0, 0, 0, 0
    first = now = time.perf_counter()
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        seen_before = seen
        for batch in loader:
            now = time.perf_counter()
            bad += sum(batch.bad_audio.values())
            seen += 1
            if seen <= PREFETCHED:
                first = now
                continue
            audio += sum(batch.durations)
            batches += 1
            if now - first >= seconds:
                break
        if seen == seen_before or now - first >= seconds:
            break
    elapsed = now - first if batches else 0.0
    del loader
    rate = audio / elapsed if batches >= MIN_TIMED_BATCHES and elapsed > 0 else None
    return rate, batches, elapsed, bad


class StepMetrics(pl.Callback):
    """The metrics ``callbacks.TrainingMetricsCallback`` computed for each optimizer step."""

    def __init__(self, source: callbacks.TrainingMetricsCallback):
        self.source = source
        self.steps: list[dict] = []
        self._seen = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = self.source.last_metrics  # {} until the first optimizer step
        if metrics and metrics is not self._seen:
            self._seen = metrics
            self.steps.append(dict(metrics))


def fed_steps(model, dataset, device, precision: str, steps: int) -> list[dict]:
    """``steps`` phase-2 optimizer steps of ``TrainingModule`` fed by its own DataLoader (train.py's
    sampler, dataset and NUM_WORKERS workers): each step's metrics as train.py logs them."""
    module = TrainingModule(model)
    module.dataset = dataset
    metrics_cb = callbacks.TrainingMetricsCallback()
    collector = StepMetrics(metrics_cb)
    trainer = benchmark_trainer(
        device,
        precision,
        max_steps=steps,
        max_epochs=-1,
        grad_accum=config.GRAD_ACCUM,
        callbacks=[FixedPhase(2), metrics_cb, collector],
    )
    trainer.fit(module)
    return collector.steps


def workers_needed(demand: float, per_worker: float) -> int:
    """Workers whose summed rate covers ``demand`` with HEADROOM (at least 1); ValueError for a
    worker rate that is not positive (no measurement, not a worker that needs no help)."""
    if not per_worker > 0:
        raise ValueError(f"one worker's rate {per_worker}: expected a measured rate > 0")
    return max(1, math.ceil(HEADROOM * demand / per_worker))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="the manifest whose audio feeds the run (default TRAIN_MANIFEST_PATH)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="copies of its rows (an epoch must outlast the run)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps before them")
    parser.add_argument(
        "--worker-seconds", type=float, default=10.0, help="how long one worker is timed"
    )
    parser.add_argument(
        "--demand",
        type=float,
        default=None,
        help="audio s/s a GPU's step consumes (default: what the fed steps measured)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="for the cores a node needs (default 8)"
    )
    parser.add_argument(
        "--skip-training", action="store_true", help="measure one worker only (no model)"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "bench_data_path",
        help="where the repeated manifest and its cache go",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "train", "dataset"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    manifest = args.manifest or Path(config.TRAIN_MANIFEST_PATH)
    if not manifest.is_file():
        print(
            f"error: no manifest at {manifest} (--manifest or TRAIN_MANIFEST_PATH)", file=sys.stderr
        )
        return 2
    accelerator = config.ACCELERATOR
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else "cpu")
    precision = step_precision(device)

    model = asr_model.build_model()
    corpus = repeated_manifest(manifest, args.repeat, args.work_dir)
    dataset = load_dataset(corpus, model.tokenizer, args.work_dir)
    try:  # as train.py does: a manifest whose audio is not where it says fails here, in one line
        check_audio_sample(dataset, samples=config.AUDIO_CHECK_SAMPLES, manifest=manifest)
    except NoTrainingData as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hours = float(dataset.durations.sum()) / 3600
    print(
        f"corpus: {manifest.name} x {args.repeat} = {len(dataset)} utterances, {hours:.2f} h; "
        f"MAX_BATCH_DURATION={config.MAX_BATCH_DURATION:g}, GRAD_ACCUM={config.GRAD_ACCUM}, "
        f"NUM_WORKERS={config.NUM_WORKERS}; {os.cpu_count()} cores; device {device}, {precision}"
    )
    rate, batches, elapsed, bad = one_worker_rate(dataset, args.worker_seconds)
    skipped = f"; {bad} unreadable files skipped" if bad else ""
    if rate is None:
        print(
            f"error: one worker delivered {batches} micro-batches in {elapsed:.1f} s after the "
            f"{PREFETCHED} it had ready: too few to time (at least {MIN_TIMED_BATCHES}); raise "
            f"--worker-seconds or --repeat{skipped}",
            file=sys.stderr,
        )
        return 1
    print(
        f"one worker: {rate:.0f} audio s/s ({batches} micro-batches in {elapsed:.1f} s after the "
        f"{PREFETCHED} it had ready, page cache warm{skipped})"
    )
    demand = args.demand
    if not args.skip_training:
        torch.manual_seed(config.SEED)
        steps = fed_steps(model, dataset, device, precision, args.warmup + args.steps)
        timed = steps[args.warmup :]
        if not timed:
            print("error: no optimizer step was timed", file=sys.stderr)
            return 1
        step_s = statistics.median(s["time/step_s"] for s in timed)
        audio = statistics.median(s["throughput/audio_s_per_s"] for s in timed)
        wait = sum(s["time/data_wait_fraction"] * s["time/step_s"] for s in timed) / sum(
            s["time/step_s"] for s in timed
        )
        worst = max(s["time/data_wait_fraction_max"] for s in timed)
        print(
            f"fed by the loader: phase 2, NUM_WORKERS={config.NUM_WORKERS}: median step {step_s:.3f} s, "
            f"{audio:.1f} audio s/s, data wait {wait:.1%} of step time (worst step {worst:.1%}) "
            f"over {len(timed)} steps"
        )
        demand = demand or audio
    if demand:
        need = workers_needed(demand, rate)
        cores = args.gpus_per_node * (need + 1)
        print(
            f"workers per GPU for a data wait under {WAIT_TARGET:.0%}: {need} (demand {demand:.0f} "
            f"audio s/s, one worker {rate:.0f}, x{HEADROOM:g} headroom); a {args.gpus_per_node}-GPU "
            f"node needs {args.gpus_per_node} x ({need} + 1) = {cores} cores (NUM_WORKERS={need})"
        )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
