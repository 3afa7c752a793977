"""Check a node before a training job spends its allocation: will it run, fit and be fed?

Usage (the training job's environment exported: the same knobs, manifests and model):
    python scripts/preflight.py                         # one process: this GPU (or the CPU) and the node
    torchrun --nproc_per_node 8 scripts/preflight.py    # every GPU, and the all-reduce between them
    python scripts/preflight.py --data-seconds 60 --no-search

One line per check, ``ok`` / ``warn`` / ``fail`` / ``skip``, the figure, and after ``->`` what to do;
under torchrun the line of the worst rank, with how the ranks split. The block between the rules is
what to paste into an issue. Exit 0 when nothing failed, 1 when a check failed, 2 for a bad knob.
A rank that fails a check does not hold up the others: the report still comes, naming the rank.

  gpu          the device torch sees, its memory (free and total), the driver against torch's CUDA
  inputs       what train.py refuses before it builds a model (manifests and their split, the
               transcript style, the model's inputs, RESUME_FROM and CHECKPOINT_DIR, the steps
               left), with its message
  augmentation the speed factors and noise train.py applies; a NOISE_DIR it refuses fails here
  model        the configured model (INIT_MODEL or MODEL_CONFIG) built on every rank
  tdt-loss     the start-up check of train.py: NeMo's numba TDT and RNN-T kernels against tdt_loss.py,
               and what one loss costs with TDT_LOSS=numba and =torch (CUDA)
  caches       the training caches of TRAIN_MANIFEST_PATH and VAL_MANIFEST_PATH for this tokenizer;
               a validation manifest they leave nothing to score fails it
  step         the configured model's heaviest micro-batch at MAX_BATCH_DURATION (copies of the
               longest utterance with the padded frames and joint cells no batch the sampler packs
               exceeds in any epoch), one optimizer step in each phase in PRECISION: fits or not,
               peak memory, step time
  max-batch    the largest MAX_BATCH_DURATION whose heaviest micro-batch fits in 90% of the GPU's
               memory (max_batch.py's bisection; CUDA, --no-search skips it)
  all-reduce   bus bandwidth between the ranks (NCCL on GPU, gloo on CPU) and what the model's
               gradients cost per optimizer step, as a share of the step
  data         audio seconds per second one rank's DataLoader (NUM_WORKERS workers, the real
               sampler; without a training cache a random sample of the manifest's rows) delivers
               from the storage as it is, the files dropped from the page cache first (cold) where
               the OS allows, against what the step consumes; unreadable audio fails it
  checkpoints  free space in CHECKPOINT_DIR for the next KEEP_CHECKPOINTS saves at the model's size
  wandb        the W&B server in the resolved mode (an unreachable one: the run logs offline)

On a CPU-only machine the GPU checks say ``skip`` and the step runs on the CPU in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import config

VERDICTS = ("ok", "skip", "warn", "fail")  # in order of severity
# The oldest driver (its CUDA version, as cudaDriverGetVersion reports it) that runs each CUDA
# major of torch's build, and the driver branch users know it by.
DRIVER_FOR_CUDA = {13: (13000, "580"), 12: (12000, "525"), 11: (11000, "450")}
FEED_MARGIN = 1.25  # the data path should deliver this many times what the step consumes
ALLREDUCE_WARN_SHARE = 0.2
# Hidden from Lightning while a one-device Trainer runs inside a torchrun or srun job.
TORCHRUN_ENV = (
    "TORCHELASTIC_RUN_ID",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "ROLE_RANK",
    "SLURM_NTASKS",
)


@dataclass
class Check:
    """One line of the report."""

    name: str
    verdict: str
    figure: str
    advice: str = ""

    def line(self) -> str:
        text = f"{self.verdict:<5} {self.name:<12} {self.figure}"
        return f"{text} -> {self.advice}" if self.advice else text


@dataclass
class Node:
    """What the checks learn and pass on to later checks, per rank."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: object = None
    model: object = None
    dataset: object = None
    consumes_audio_per_second: float | None = None  # phase 2, one micro-batch at a time
    optimizer_step_seconds: float | None = None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# --------------------------------------------------------------------------------------------------
# gpu
# --------------------------------------------------------------------------------------------------


def driver_cuda_version() -> tuple[int | None, str]:
    """(the newest CUDA version the NVIDIA driver runs, as cudaDriverGetVersion reports it: 13000 is
    13.0; how it was read), or (None, why not). Asks CUDA's Python bindings, then NVML, then the
    driver library itself: torch's wheels have no public call for it, and none that every torch
    release keeps."""
    tried = []
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if int(err) == 0:
            return int(version), "cuda.bindings"
        tried.append(f"cuda.bindings: {err}")
    except Exception as exc:  # noqa: BLE001  (not installed, or too old for this API)
        tried.append(f"cuda.bindings: {type(exc).__name__}")
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlSystemGetCudaDriverVersion()), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001
        tried.append(f"NVML: {type(exc).__name__}")
    try:
        import ctypes

        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return int(version.value), "libcuda"
        tried.append("libcuda: cuDriverGetVersion failed")
    except OSError as exc:
        tried.append(f"libcuda: {type(exc).__name__}")
    return None, "; ".join(tried)


def cuda_version_text(version: int | None) -> str:
    """13000 -> "13.0" (cudaDriverGetVersion's encoding); None -> "unknown"."""
    return "unknown" if version is None else f"{version // 1000}.{version % 1000 // 10}"


def driver_verdict(driver_cuda: int | None, torch_cuda: str | None) -> tuple[str, str]:
    """(verdict, advice) for a driver supporting CUDA ``driver_cuda`` (cudaDriverGetVersion: 12040
    is 12.4) under a torch built for ``torch_cuda`` ("13.0")."""
    if not torch_cuda:
        return "fail", "this torch is a CPU build: install the CUDA wheel (requirements-gpu.txt)"
    major = int(torch_cuda.split(".")[0])
    needed, branch = DRIVER_FOR_CUDA.get(major, (major * 1000, "?"))
    if driver_cuda is None:
        return "warn", "the driver's CUDA version cannot be read"
    if driver_cuda < needed:
        have = f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}"
        return "fail", (
            f"the driver supports CUDA {have}, torch needs {torch_cuda}: install an NVIDIA driver "
            f">= {branch}"
        )
    return "ok", ""


def nvidia_smi() -> list[str]:
    """``name, driver_version, memory.total, memory.used`` of every GPU nvidia-smi lists ([] when
    there is no nvidia-smi or it fails)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,memory.used",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def check_gpu(node: Node) -> Check:
    import torch

    wants_gpu = config.ACCELERATOR in ("gpu", "cuda")
    if node.device.type != "cuda":
        if config.ACCELERATOR == "cpu":
            return Check("gpu", "skip", "ACCELERATOR=cpu")
        gpus = nvidia_smi()
        if gpus:
            if not torch.version.cuda:
                advice = driver_verdict(None, None)[1]
            else:
                branch = DRIVER_FOR_CUDA.get(int(torch.version.cuda.split(".")[0]), (0, "?"))[1]
                advice = (
                    f"torch cannot initialise CUDA: a driver older than {branch} (torch is built "
                    f"for CUDA {torch.version.cuda}) or missing CUDA libraries; install "
                    f"requirements-gpu.txt on an NVIDIA driver >= {branch}"
                )
            return Check(
                "gpu",
                "fail",
                f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}) but torch "
                f"{torch.__version__} (CUDA {torch.version.cuda}) cannot use them",
                advice,
            )
        return Check(
            "gpu",
            "fail" if wants_gpu else "skip",
            f"no CUDA device (ACCELERATOR={config.ACCELERATOR}, torch {torch.__version__}, "
            f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU build'})",
            "this node has no GPU for ACCELERATOR=" + config.ACCELERATOR
            if wants_gpu
            else "the CPU checks follow",
        )
    free, total = torch.cuda.mem_get_info(node.device)
    driver_cuda, how = driver_cuda_version()
    smi = nvidia_smi()
    driver = smi[0].split(",")[1].strip() if smi else "?"
    figure = (
        f"{torch.cuda.get_device_name(node.device)} ({node.device}), {total / 2**30:.1f} GiB, "
        f"{free / 2**30:.1f} free; driver {driver} (CUDA {cuda_version_text(driver_cuda)}: {how}), torch "
        f"{torch.__version__} CUDA {torch.version.cuda}; {torch.cuda.device_count()} visible"
    )
    verdict, advice = driver_verdict(driver_cuda, torch.version.cuda)
    if verdict == "ok" and free < 0.9 * total:
        verdict = "warn"
        advice = (
            f"{(total - free) / 2**30:.1f} GiB of this GPU are taken by another process: "
            f"`nvidia-smi` shows which"
        )
    return Check("gpu", verdict, figure, advice)


# --------------------------------------------------------------------------------------------------
# tdt-loss
# --------------------------------------------------------------------------------------------------


def _loss_call_seconds(loss, device, shape=(4, 250, 80, 1024)) -> float:
    """Median seconds of a forward and backward of ``loss`` on B x T x (U+1) x (V+1+D) logits."""
    import torch

    B, T, U, V = shape
    g = torch.Generator(device=device).manual_seed(0)
    acts = torch.randn(
        B, T, U + 1, V + 1 + len(loss.durations), device=device, generator=g
    ).requires_grad_(True)
    labels = torch.randint(0, V, (B, U), device=device, generator=g)
    act_lens = torch.full((B,), T, device=device)
    label_lens = torch.full((B,), U, device=device)
    times = []
    for _ in range(4):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss(acts, labels, act_lens, label_lens).sum().backward()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        acts.grad = None
    return statistics.median(times[1:])


def check_tdt_loss(node: Node) -> Check:
    import asr_model
    import tdt_loss

    if node.device.type != "cuda":
        return Check("tdt-loss", "skip", "CPU: train.py runs tdt_loss.py there (no CUDA kernel)")
    if not isinstance(asr_model.family(node.model), asr_model.TDT):
        return Check("tdt-loss", "skip", f"{asr_model.family(node.model).name}: no TDT loss")
    inner = node.model.loss._loss
    start = time.perf_counter()
    try:
        diff = tdt_loss.check_cuda_loss(inner, node.device)
    except tdt_loss.TDTLossCheckFailed as exc:
        return Check("tdt-loss", "fail", first_line(exc), "TDT_LOSS=torch trains without numba")
    checked = time.perf_counter() - start
    figure = (
        f"TDT_LOSS={inner.cuda_backend}: TDT and RNN-T kernels agree with tdt_loss.py to "
        f"{diff:.1e} ({checked:.1f} s, compilation included)"
    )
    figure += "; " + loss_costs_text(inner.durations, inner.sigma, node.device)
    return Check("tdt-loss", "ok", figure)


def loss_costs_text(durations, sigma: float, device, backends=None) -> str:
    """What one TDT loss costs on ``device`` with each of ``backends`` (default all of
    tdt_loss.BACKENDS; numba left out where it cannot be built), as one phrase."""
    import tdt_loss

    costs = {}
    for backend in backends or tdt_loss.BACKENDS:
        probe = tdt_loss.DeviceDispatchTDTLoss(
            1024, durations, sigma=sigma, omega=0.0, cuda_backend=backend
        )
        if backend == "numba":
            try:
                probe.cuda_loss = tdt_loss._numba_tdt_loss(
                    1024, {"durations": durations, "sigma": sigma}, "mean_batch"
                )._loss
            except Exception:  # noqa: BLE001  (numba missing: only torch's cost is shown)
                continue
        costs[backend] = _loss_call_seconds(probe, device)
    return "one loss (4 x 20 s x 80 tokens x 1k pieces, forward + backward): " + ", ".join(
        f"{b} {s * 1e3:.0f} ms" for b, s in costs.items()
    )


# --------------------------------------------------------------------------------------------------
# caches
# --------------------------------------------------------------------------------------------------


def training_cache_of(manifest: Path, tokenizer) -> Path | None:
    """The training cache train.py would map for ``manifest`` with these knobs, None if absent."""
    import training_cache

    return training_cache.lookup(
        manifest,
        tokenizer,
        frame_seconds=config.ENCODER_FRAME_SECONDS,
        max_token_len=config.MAX_TOKEN_LEN,
        cache_dir=config.CACHE_DIR,
    )


def check_caches(node: Node) -> Check:
    import training_cache
    from training_step import nothing_to_validate, validation_manifest

    manifests = [Path(config.TRAIN_MANIFEST_PATH)]
    with contextlib.suppress(Exception):
        val = validation_manifest()
        if val is not None:
            manifests.append(Path(val))
    missing_manifests = [m for m in manifests if not m.is_file()]
    if missing_manifests:
        return Check(
            "caches",
            "fail",
            f"no manifest at {missing_manifests[0]}",
            "build it with build_manifest.py and scripts/make_train_val.py (or set "
            "TRAIN_MANIFEST_PATH / VAL_MANIFEST_PATH)",
        )
    found, missing = [], []
    for k, manifest in enumerate(manifests):
        path = training_cache_of(manifest, node.model.tokenizer)
        (found if path is not None else missing).append(manifest.name)
        if k and path is not None:  # the validation manifest, tokenized: can it score anything?
            empty = nothing_to_validate(manifest, training_cache.CacheColumns(path).summary)
            if empty:
                return Check("caches", "fail", *empty)
    if missing:
        return Check(
            "caches",
            "warn",
            f"no training cache of {', '.join(missing)} for this tokenizer"
            + (f" (present: {', '.join(found)})" if found else ""),
            "run scripts/build_training_cache.py before the job (train.py would build it at "
            "start-up while the GPUs wait); the data check needs it",
        )
    return Check("caches", "ok", f"present for {', '.join(found)}")


# --------------------------------------------------------------------------------------------------
# step and max-batch
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def outside_torchrun():
    """torchrun's (and SLURM's) variables hidden while a one-device Trainer runs, so Lightning
    does not take this rank for part of a multi-process job."""
    saved = {k: os.environ.pop(k) for k in TORCHRUN_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def heaviest_shape(node: Node, max_batch_duration: float):
    """The sampler's heaviest micro-batch at ``max_batch_duration`` (max_batch.py): from the
    training manifest when its training cache is there, else from max_batch's synthetic corpus."""
    import max_batch

    if node.dataset is not None:
        shape = max_batch.manifest_batch_shape(node.dataset, max_batch_duration)
        return shape, "the heaviest batch the sampler packs from the manifest"
    return (
        max_batch.heaviest_batch_shape(max_batch_duration, 5.0),
        "synthetic, 5 tokens a second",
    )


def heaviest_batch_phrase(shape, max_batch_duration: float) -> str:
    """What the step check runs, in words: ``shape`` (``max_batch.heaviest_batch_shape`` or
    ``manifest_batch_shape``) is n copies of the longest utterance, a bound on the padded frames
    and joint cells of every micro-batch the sampler packs at ``max_batch_duration``. Its padded
    seconds may exceed ``max_batch_duration`` (a real batch holds at most that much audio, padded to
    its longest utterance): the phrase says which number is which."""
    n, longest = len(shape.durations), max(shape.durations)
    return (
        f"MAX_BATCH_DURATION={max_batch_duration:g}'s padding bound: {n} x the longest utterance "
        f"({longest:.1f} s) = {shape.audio_seconds:.1f} s padded, {max(shape.tokens)} tokens each "
        f"(every batch the sampler packs holds at most {max_batch_duration:g} s of audio and pads "
        f"to no more than this)"
    )


def check_step(node: Node) -> Check:
    import dataclasses

    import torch

    import base_anchor
    import max_batch
    from sampler import BatchingSettings

    device = node.device
    precision = max_batch.step_precision(device)
    shape, source = heaviest_shape(node, config.MAX_BATCH_DURATION)
    batch = max_batch.make_batch(shape, node.model.tokenizer)
    described = f"{heaviest_batch_phrase(shape, config.MAX_BATCH_DURATION)}; {source}, {precision}"
    # The run's frozen base copy (DISTILL_WEIGHT, DISTILL_JOINT_WEIGHT, L2SP_WEIGHT) is on the
    # device beside the step, and a micro-batch of the base's languages alone distils every row.
    base = base_anchor.frozen_base(node.model, precision)
    batching = None
    if base is not None:
        batching = dataclasses.replace(
            BatchingSettings.from_config(), base_languages=tuple(sorted(set(batch.langs)))
        )
        described += (
            f"; with the frozen base copy ({base.nbytes() / 2**20:.0f} MiB), every utterance "
            f"distilled"
        )
    if device.type == "cpu":
        need, have = (
            max_batch.estimated_host_bytes(node.model, shape),
            max_batch.available_host_bytes(),
        )
        if need > have:
            return Check(
                "step",
                "warn",
                f"{described}: needs about {need / 2**30:.0f} GiB on CPU, "
                f"{have / 2**30:.0f} GiB available; not run",
                "a CPU step of this size cannot run here; run preflight on the GPU node",
            )
    results = {}
    try:
        with outside_torchrun():
            for phase in (1, 2):
                results[phase] = max_batch.run_steps(
                    "project",
                    node.model,
                    batch,
                    phase,
                    warmup=1,
                    steps=2,
                    device=device,
                    precision=precision,
                    base=base,
                    batching=batching,
                )
    except Exception as exc:  # noqa: BLE001
        if device.type == "cuda" and max_batch.is_oom(exc):
            max_batch.reset_model(node.model)
            torch.cuda.empty_cache()
            return Check(
                "step",
                "fail",
                f"{described}: out of memory in phase {len(results) + 1}",
                "lower MAX_BATCH_DURATION (the max-batch line says to what)",
            )
        raise
    phase2 = results[2].median
    node.consumes_audio_per_second = shape.audio_seconds / phase2
    node.optimizer_step_seconds = phase2 * config.GRAD_ACCUM
    memory = max(r.peak_bytes for r in results.values())
    figure = (
        f"{described}: phase 1 {results[1].median:.2f} s, phase 2 {phase2:.2f} s a micro-batch "
        f"({node.consumes_audio_per_second:.0f} audio s/s)"
    )
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        figure += f", peak {memory / 2**30:.1f} of {total / 2**30:.1f} GiB"
        if memory > max_batch.HEADROOM * total:
            return Check(
                "step",
                "warn",
                figure,
                f"above {max_batch.HEADROOM:.0%} of the GPU: fragmentation can still run it out of memory "
                "hours in; lower MAX_BATCH_DURATION",
            )
        return Check("step", "ok", figure)
    return Check("step", "ok", f"{figure}, peak host RSS {memory / 2**30:.1f} GiB")


def check_max_batch(node: Node, args) -> Check:
    import max_batch

    if node.device.type != "cuda":
        return Check("max-batch", "skip", "needs a CUDA device")
    if args.no_search:
        return Check("max-batch", "skip", "--no-search")
    with outside_torchrun():
        best = max_batch.find_max_batch_duration(
            node.model,
            node.model.tokenizer,
            lambda seconds: heaviest_shape(node, seconds)[0],
            args.max_search,
            node.device,
            config.PRECISION,
        )
    if best is None:
        return Check(
            "max-batch",
            "fail",
            f"even MAX_DURATION={config.MAX_DURATION:g} s does not fit",
            "lower MAX_DURATION or use a GPU with more memory",
        )
    now = config.MAX_BATCH_DURATION
    figure = f"largest MAX_BATCH_DURATION that fits: {best:g} s (now {now:g} s)"
    if now > best:
        return Check("max-batch", "fail", figure, f"set MAX_BATCH_DURATION={best:g}")
    return Check("max-batch", "ok", figure)


# --------------------------------------------------------------------------------------------------
# all-reduce
# --------------------------------------------------------------------------------------------------


def check_all_reduce(node: Node) -> Check:
    import torch
    import torch.distributed as dist

    if node.world_size == 1:
        return Check("all-reduce", "skip", "one process (torchrun --nproc_per_node N measures it)")
    buffer, why = None, "no model (see the model line)"
    if node.model is not None:
        try:
            grads = sum(p.numel() for p in node.model.parameters() if p.requires_grad) * 4
            size = min(grads, 256 * 2**20)
            buffer = torch.ones(size // 4, dtype=torch.float32, device=node.device)
        except Exception as exc:  # noqa: BLE001  (this rank's line says why; the others skip too)
            why = first_line(exc)
    missing = failing_ranks(node, buffer is not None)
    if missing:
        if node.model is None:
            return Check("all-reduce", "skip", why)
        if buffer is None:
            return Check("all-reduce", "fail", f"cannot take part: {why}")
        return Check(
            "all-reduce",
            "skip",
            f"not measured: rank(s) {', '.join(map(str, missing))} cannot take part",
        )
    times = []
    for i in range(6):
        dist.barrier()
        if node.device.type == "cuda":
            torch.cuda.synchronize(node.device)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if node.device.type == "cuda":
            torch.cuda.synchronize(node.device)
        if i:
            times.append(time.perf_counter() - start)
    n = node.world_size
    moved = 2 * (n - 1) / n  # ring all-reduce: bytes each rank sends per byte reduced
    bus = size * moved / statistics.median(times)
    per_step = grads * moved / bus
    figure = (
        f"{dist.get_backend()} over {n} ranks: {bus / 1e9:.2f} GB/s bus bandwidth; the "
        f"{grads / 2**20:,.0f} MiB of gradients take {per_step:.3f} s a step"
    )
    if node.optimizer_step_seconds:
        share = per_step / (per_step + node.optimizer_step_seconds)
        figure += f", {share:.0%} of an optimizer step (GRAD_ACCUM={config.GRAD_ACCUM})"
        if share > ALLREDUCE_WARN_SHARE:
            return Check(
                "all-reduce",
                "warn",
                figure,
                "slow interconnect: NCCL_DEBUG=INFO shows the transport NCCL chose; raise "
                "GRAD_ACCUM to spread it over more audio",
            )
    return Check("all-reduce", "ok", figure)


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------


def drop_from_page_cache(paths) -> int:
    """Ask the OS to forget the cached pages of ``paths`` (posix_fadvise DONTNEED: no privileges
    needed, clean pages only); how many it accepted."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    dropped = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return dropped


def manifest_sample(manifest: Path, count: int, rank: int, world_size: int):
    """(audio paths, durations, languages) of up to ``count`` rows of ``manifest`` drawn at random
    (SEED), a different share of one draw per rank: the data check's reads without a training cache."""
    import numpy as np
    import polars as pl
    import pyarrow.parquet as pq

    import manifest_schema

    columns = manifest_schema.audio_columns(pq.read_schema(manifest).names)
    frame = pl.read_parquet(manifest, columns=[*columns, "duration", "lang"])
    order = np.random.default_rng(config.SEED).permutation(len(frame))
    rows = order[rank::world_size][:count]
    picked = frame[rows].select(manifest_schema.audio_path_expr(columns), "duration", "lang")
    return (
        picked[manifest_schema.AUDIO_COLUMN].to_list(),
        picked["duration"].to_numpy(),
        picked["lang"].to_list(),
    )


def data_reader(node: Node, args):
    """(DataLoader, the audio paths it reads in order, what it reads): the real sampler over the
    training cache when there is one, else a random sample of the manifest's rows in micro-batches
    of MAX_BATCH_DURATION seconds, NUM_WORKERS workers either way."""
    import numpy as np

    from dataset import AudioFileDataset, SignalSafeDataLoader, collate_asr_batch
    from sampler import BatchingSettings
    from training_step import build_dataloader

    if node.dataset is not None:
        loader, sampler = build_dataloader(
            node.dataset,
            BatchingSettings.from_config(),
            world_size=node.world_size,
            rank=node.rank,
            pin_memory=node.device.type == "cuda",
        )
        planned = []
        for indices in sampler:
            planned.extend(indices)
            if len(planned) >= args.data_files:
                break
        augmented = sampler.speed_factors or node.dataset.noise.prob > 0
        return (
            loader,
            [node.dataset.audio_path(int(i)) for i in planned],
            "the training sampler" + (", augmented as configured" if augmented else ""),
        )
    manifest = Path(config.TRAIN_MANIFEST_PATH)
    if not manifest.is_file():
        raise FileNotFoundError(
            f"no manifest at {manifest}: build it with build_manifest.py and "
            "scripts/make_train_val.py (or set TRAIN_MANIFEST_PATH)"
        )
    paths, durations, langs = manifest_sample(manifest, args.data_files, node.rank, node.world_size)
    if not paths:
        raise FileNotFoundError(
            f"{manifest} has no rows: rebuild it with scripts/make_train_val.py"
        )
    dataset = AudioFileDataset(
        paths, durations, langs, duration_tolerance=config.AUDIO_DURATION_TOLERANCE
    )
    # Consecutive rows up to MAX_BATCH_DURATION seconds each (at least one row): the reads and
    # decodes of a training micro-batch, without the sampler that needs the cache's token lengths.
    batch_of = np.cumsum(durations) // config.MAX_BATCH_DURATION
    cuts = np.flatnonzero(np.diff(batch_of)) + 1
    batches = [part.tolist() for part in np.split(np.arange(len(paths)), cuts)]
    workers = config.NUM_WORKERS
    loader = SignalSafeDataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=collate_asr_batch,
        num_workers=workers,
        pin_memory=node.device.type == "cuda",
        prefetch_factor=2 if workers > 0 else None,
        timeout=config.COLLECTIVE_TIMEOUT_MINUTES * 60 if workers > 0 else 0,
    )
    augmented = config.SPEED_PERTURB or config.NOISE_PROB > 0
    return (
        loader,
        paths,
        f"{len(paths)} rows of {manifest.name} at random, no training cache"
        + (", so without the configured augmentation" if augmented else ""),
    )


def check_data(node: Node, args) -> Check:
    workers = config.NUM_WORKERS
    loader, paths, source = data_reader(node, args)
    cold = drop_from_page_cache(paths)
    state = "cold" if cold == len(paths) else f"{cold} of {len(paths)} files dropped from cache"
    start = time.perf_counter()
    first = None
    audio = good = bad = 0
    batches = 0
    for batch in loader:
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            audio += sum(batch.durations)
        good += len(batch.durations)
        bad += sum(batch.bad_audio.values())
        batches += 1
        if now - start > args.data_seconds or good + bad >= len(paths):
            break
    elapsed = (time.perf_counter() - first) if first is not None else 0.0
    del loader
    gc.collect()
    if good == 0:
        return Check(
            "data",
            "fail",
            f"none of {bad} audio files read could be decoded (first: {paths[0] if paths else '?'})",
            "check DATA_DIR / SHARDS_DIR on this node and run scripts/extract_audio.py",
        )
    if batches < 3 or elapsed <= 0:
        return Check(
            "data",
            "warn",
            f"only {batches} micro-batch(es) in {args.data_seconds:g} s",
            "too few to measure: raise --data-seconds, or the storage is very slow",
        )
    rate = audio / elapsed
    figure = (
        f"{rate:.0f} audio s/s per rank (NUM_WORKERS={workers}, {state}, "
        f"{batches} micro-batches of {source}, first after {first - start:.1f} s)"
    )
    advice_bad = ""
    if bad:
        figure += f", {bad} of {good + bad} files unreadable"
        advice_bad = "; some audio is unreadable: scripts/extract_audio.py, or check the shards"
    demand = args.consume_audio_per_second or node.consumes_audio_per_second
    if demand is None:
        return Check("data", "warn", figure, "no step time to compare with" + advice_bad)
    figure += f"; the step consumes {demand:.0f}"
    if rate < FEED_MARGIN * demand:
        idle = max(0.0, 1 - rate / demand)
        return Check(
            "data",
            "warn",
            figure,
            f"the GPU would wait for data (idle about {idle:.0%}): raise NUM_WORKERS "
            f"({os.cpu_count()} cores for {node.world_size} rank(s)) or move the audio to "
            f"faster storage" + advice_bad,
        )
    return Check("data", "warn" if bad else "ok", figure, advice_bad.lstrip("; "))


# --------------------------------------------------------------------------------------------------
# checkpoints and wandb
# --------------------------------------------------------------------------------------------------


def check_checkpoints(node: Node) -> Check:
    import checkpoints

    directory = Path(config.CHECKPOINT_DIR)
    from training_step import TrainingModule

    size = checkpoints.estimated_checkpoint_bytes(TrainingModule(node.model))
    room, wanted, free = checkpoints.checkpoint_room(size, directory, config.KEEP_CHECKPOINTS)
    figure = (
        f"{directory}: {free / 2**30:.1f} GiB free, a checkpoint about {size / 2**30:.2f} GiB: "
        f"room for {room}, the next {wanted} wanted (KEEP_CHECKPOINTS={config.KEEP_CHECKPOINTS})"
    )
    if room < 1:
        return Check(
            "checkpoints",
            "fail",
            figure,
            "the first save would fail: free space or move CHECKPOINT_DIR",
        )
    if room < wanted:
        return Check(
            "checkpoints",
            "warn",
            figure,
            "free space, set KEEP_CHECKPOINTS, or move CHECKPOINT_DIR",
        )
    return Check("checkpoints", "ok", figure)


def check_wandb() -> Check:
    import run_logging

    mode = config.wandb_mode()
    if mode != "disabled" and not run_logging.wandb_installed():
        return Check(
            "wandb",
            "warn",
            f"mode {mode}, but the wandb package is not installed: the run logs to metrics.jsonl only",
            "pip install wandb (it is in requirements.txt), or set WANDB_MODE=disabled",
        )
    if mode != "online":
        return Check(
            "wandb",
            "ok",
            f"mode {mode}"
            + (" (upload later with `wandb sync`)" if mode == "offline" else " (no W&B logging)"),
        )
    url = run_logging.wandb_base_url()
    start = time.perf_counter()
    why = run_logging.wandb_reachable(url)
    if why is not None:
        return Check(
            "wandb",
            "warn",
            f"mode online, server unreachable ({why})",
            "the run will log offline (upload with `wandb sync`); check the proxy or WANDB_BASE_URL",
        )
    return Check(
        "wandb", "ok", f"mode online, {url} answers in {time.perf_counter() - start:.1f} s"
    )


# --------------------------------------------------------------------------------------------------
# Running the checks
# --------------------------------------------------------------------------------------------------


def guarded(name: str, fn, *args) -> Check:
    """``fn(*args)``; an error is that check's failure, not the end of the report: a condition the
    user can fix (``process_control.USER_ERRORS``: too little data, a bad knob, a missing file) with
    the fix its message gives, anything else as an unexpected error."""
    import process_control

    try:
        return fn(*args)
    except process_control.USER_ERRORS as exc:
        what, _, fix = str(exc).strip().splitlines()[0].rpartition(": ")
        return Check(name, "fail", what or fix, fix if what else "")
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("preflight").debug("check %s", name, exc_info=True)
        return Check(name, "fail", first_line(exc), "an unexpected error: please report it")


def failing_ranks(node: Node, ok: bool) -> list[int]:
    """The ranks whose ``ok`` is False; a collective: every rank calls it at the same point of
    ``run_checks``, whatever failed before, so that a check with collectives runs on all or none."""
    from collectives import all_gather_objects

    if node.world_size == 1:
        return [] if ok else [node.rank]
    return [rank for rank, fine in enumerate(all_gather_objects(bool(ok))) if not fine]


def build_model(node: Node) -> Check:
    """The configured model on this rank's device (``node.model``), or the reason it cannot be built."""
    import asr_model

    try:
        node.model = asr_model.build_model()
    except Exception as exc:  # noqa: BLE001
        node.model = None
        return Check("model", "fail", first_line(exc), "check INIT_MODEL / MODEL_CONFIG")
    if node.device.type == "cuda":
        node.model.to(node.device)
    parameters = sum(p.numel() for p in node.model.parameters())
    return Check(
        "model",
        "ok",
        f"{config.INIT_MODEL or config.MODEL_CONFIG}: {asr_model.family(node.model).name}, "
        f"{parameters / 1e6:.1f} M parameters",
    )


def load_dataset(node: Node):
    """train.py's training dataset (``training_step.build_dataset``: its noise included) when the
    manifest's training cache exists (never built here); None without one. Its errors (an empty
    manifest, a NOISE_DIR it refuses) are the caches and augmentation lines' to report."""
    from training_step import build_dataset

    manifest = Path(config.TRAIN_MANIFEST_PATH)
    if node.model is None or not manifest.is_file():
        return None
    if training_cache_of(manifest, node.model.tokenizer) is None:
        return None
    return build_dataset(node.model.tokenizer, progress=False)


def check_inputs() -> Check:
    """What train.py refuses before it builds a model (``training_step.startup_refusals``: the
    manifests and their split, the transcript style, the model's inputs, RESUME_FROM and its
    CHECKPOINT_DIR, the steps left), with the same message; nothing on disk changes."""
    from training_step import startup_refusals, steps_left

    plan = startup_refusals()
    start = f"resumes {plan.path}" if plan.path is not None else "starts fresh"
    return Check("inputs", "ok", f"{start}, {steps_left(plan.path)} optimizer steps to train")


def check_augmentation() -> Check:
    """The augmentation train.py would apply (SPEED_PERTURB, NOISE_*), NOISE_DIR read as its
    training dataset reads it: a NOISE_DIR train.py refuses fails here with the same message."""
    from dataset import NoiseSettings, augmentation_in_force

    return Check(
        "augmentation",
        "ok",
        augmentation_in_force(NoiseSettings.from_config(), config.SPEED_PERTURB),
    )


def check_schedule() -> Check:
    """The training-schedule knobs train.py warns about (training_step.schedule_warnings), before the run."""
    from training_step import schedule_warnings

    problems = schedule_warnings()
    if not problems:
        return Check(
            "schedule", "ok", f"MAX_STEPS={config.MAX_STEPS}, UNFREEZE_STEP={config.UNFREEZE_STEP}"
        )
    return Check("schedule", "warn", "; ".join(problems))


def run_checks(node: Node, args) -> list[Check]:
    """Every check of this rank, in report order.

    Every rank runs the same collectives in the same order, whatever fails: the per-GPU checks
    (tdt-loss, step, max-batch) run rank-local (``collectives.rank_local``), and the ranks agree
    (``failing_ranks``) before the all-reduce check whether every one of them can run it. A rank's
    failure is its own line, which the merged report names by rank."""
    from collectives import rank_local

    checks = [
        guarded("gpu", check_gpu, node),
        check_schedule(),
        guarded("inputs", check_inputs),
        guarded("augmentation", check_augmentation),
        build_model(node),
    ]
    if node.model is None:
        checks += [
            Check(name, "skip", "no model (see the model line)")
            for name in ("tdt-loss", "caches", "step", "max-batch")
        ]
    else:
        checks.append(guarded("tdt-loss", check_tdt_loss, node))
        checks.append(guarded("caches", check_caches, node))
        try:
            node.dataset = load_dataset(node)
        except Exception:  # noqa: BLE001  (the caches and augmentation lines say what is wrong)
            node.dataset = None
        with rank_local():
            checks.append(guarded("step", check_step, node))
            checks.append(guarded("max-batch", check_max_batch, node, args))
    checks.append(guarded("all-reduce", check_all_reduce, node))
    checks.append(guarded("data", check_data, node, args))
    if node.rank == 0:
        checks.append(
            guarded("checkpoints", check_checkpoints, node)
            if node.model is not None
            else Check("checkpoints", "skip", "no model (see the model line)")
        )
        checks.append(guarded("wandb", check_wandb))
    return checks


def merge(per_rank: list[list[Check]]) -> list[Check]:
    """One check per name: the worst rank's, its figure prefixed with the rank and the split of
    verdicts over ranks when they differ or there are several."""
    order: list[str] = []
    by_name: dict[str, list[tuple[int, Check]]] = {}
    for rank, checks in enumerate(per_rank):
        for check in checks:
            if check.name not in by_name:
                order.append(check.name)
            by_name.setdefault(check.name, []).append((rank, check))
    merged = []
    for name in order:
        entries = by_name[name]
        rank, worst = max(entries, key=lambda e: (VERDICTS.index(e[1].verdict), -e[0]))
        if len(entries) > 1:
            counts = {v: sum(c.verdict == v for _, c in entries) for v in VERDICTS}
            split = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
            worst = Check(
                name, worst.verdict, f"rank {rank}: {worst.figure} [{split}]", worst.advice
            )
        merged.append(worst)
    return merged


def header(node: Node) -> str:
    import torch

    import max_batch

    precision = max_batch.step_precision(node.device)
    if precision != config.PRECISION:
        precision += f" (the CPU's; PRECISION={config.PRECISION} is for GPUs)"
    return (
        f"preflight {datetime.datetime.now().isoformat(timespec='seconds')} on "
        f"{platform.node()}: {node.world_size} process(es), {os.cpu_count()} cores, torch "
        f"{torch.__version__}, Python {platform.python_version()}; model "
        f"{config.INIT_MODEL or config.MODEL_CONFIG}, MAX_BATCH_DURATION={config.MAX_BATCH_DURATION:g}, "
        f"GRAD_ACCUM={config.GRAD_ACCUM}, NUM_WORKERS={config.NUM_WORKERS}, PRECISION={precision}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_epilog("preflight"),
    )
    parser.add_argument(
        "--data-seconds",
        type=float,
        default=20.0,
        help="how long the data check reads (default 20)",
    )
    parser.add_argument(
        "--data-files",
        type=int,
        default=2000,
        help="most audio files the data check reads (default 2000)",
    )
    parser.add_argument(
        "--consume-audio-per-second",
        type=float,
        default=None,
        help="audio seconds per second one rank's step consumes, instead of the step check's "
        "figure (to check a data path for a faster GPU than this node's)",
    )
    parser.add_argument("--no-search", action="store_true", help="skip the max-batch bisection")
    parser.add_argument(
        "--max-search", type=float, default=400.0, help="the max-batch bisection's upper end, s"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(logging.ERROR)
    for name in (
        "lightning.pytorch",
        "lightning.fabric",
        "pytorch_lightning",
        "lightning.pytorch.utilities.rank_zero",
        "pytorch_lightning.utilities.rank_zero",
        "lightning.fabric.utilities.rank_zero",
        "dataset",  # bad audio: the data check counts it
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    node = Node(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )
    accelerator = config.ACCELERATOR
    use_cuda = accelerator in ("gpu", "cuda") or (
        accelerator == "auto" and torch.cuda.is_available()
    )
    if use_cuda and torch.cuda.is_available():
        node.device = torch.device("cuda", node.local_rank)
        torch.cuda.set_device(node.device)
    else:
        node.device = torch.device("cpu")
    if node.world_size > 1:
        dist.init_process_group(
            "nccl" if node.device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(minutes=config.COLLECTIVE_TIMEOUT_MINUTES),
        )
    torch.manual_seed(config.SEED)
    checks = run_checks(node, args)
    per_rank = [checks]
    if node.world_size > 1:
        per_rank = [None] * node.world_size
        dist.all_gather_object(per_rank, checks)
        dist.destroy_process_group()
    if node.rank != 0:
        return 0
    merged = merge(per_rank)
    rule = "-" * 100
    print("\n".join([rule, header(node), *(c.line() for c in merged), rule]), flush=True)
    failed = [c.name for c in merged if c.verdict == "fail"]
    warned = [c.name for c in merged if c.verdict == "warn"]
    skipped = [c.name for c in merged if c.verdict == "skip"]
    print(
        f"{len(merged)} checks: {len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, "
        f"{len(warned)} warned, {len(skipped)} skipped{' (' + ', '.join(skipped) + ')' if skipped else ''}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
