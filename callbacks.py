"""Lightning callbacks of the training job (train.py wires them up).

EncoderUnfreezeCallback (the two phases), TrainingMetricsCallback and OptimizerStepProgressBar
(watching a run), StepOnlyModelCheckpoint and ExactResumeCallback (keeping it),
EpochBoundarySyncCallback, PerLanguageWERCallback, and the one WER/CER implementation that
scripts/evaluate.py shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging as _logging
import math
import os
import random
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as _pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only

import config as _config
from atomic_files import atomic_write

# ---- EncoderUnfreezeCallback -------------------------------------------------------------------------------
_unfreeze_log = _logging.getLogger("callbacks.unfreeze")


class EncoderUnfreezeCallback(_pl.Callback):
    """Two training phases, switched at optimizer step ``unfreeze_step`` (default UNFREEZE_STEP).

    Phase 1 (global_step < unfreeze_step): the encoder of ``pl_module.model`` is frozen. Its
    parameters get no gradient and it runs in eval mode, re-imposed at every batch start because
    Lightning puts the whole module back into train mode, and BatchNorm in train mode updates its
    running statistics even with frozen weights. So the encoder's whole state_dict (weights and
    BatchNorm buffers) stays bit-identical. ``pl_module.encoder_frozen`` tells the training step to run
    it without autograd.
    Phase 2: the encoder trains. The phase depends only on global_step, so a resumed run lands in the
    right phase, and it can only change at an optimizer-step boundary.

    DDP trap: a parameter that does not require grad when DDP wraps the model is left out of DDP's
    gradient all-reduce forever; unfreezing it later lets the ranks drift apart without an error.
    So the encoder is frozen only after the wrap (first batch), DDP starts with
    find_unused_parameters=True (train.py), and ``setup`` (before the wrap) refuses an encoder that
    is already frozen. Entering phase 2 (also on a resume in phase 2) the model is wrapped anew with
    find_unused_parameters=False (``stop_searching_unused_parameters``): every parameter is used in
    every phase-2 backward, so DDP's per-forward search of the autograd graph is pure overhead.
    """

    def __init__(self, unfreeze_step: int | None = None):
        self.unfreeze_step = _config.UNFREEZE_STEP if unfreeze_step is None else int(unfreeze_step)
        self.phase: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        frozen = [n for n, p in pl_module.model.encoder.named_parameters() if not p.requires_grad]
        if frozen:
            raise RuntimeError(
                f"encoder parameters {frozen[:3]}... are frozen before DDP wraps the model; DDP would "
                "never all-reduce their gradients after unfreezing. Leave freezing to "
                "EncoderUnfreezeCallback (do not call encoder.freeze() or load a frozen model)."
            )

    def on_train_start(self, trainer, pl_module) -> None:
        self._apply(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._apply(trainer, pl_module)

    def _apply(self, trainer, pl_module) -> None:
        encoder = pl_module.model.encoder
        phase = 1 if trainer.global_step < self.unfreeze_step else 2
        if phase == 1:
            if self.phase != 1:
                for p in encoder.parameters():
                    p.requires_grad_(False)
            encoder.eval()
        elif self.phase != 2:
            for p in encoder.parameters():
                p.requires_grad_(True)
            encoder.train()
            if stop_searching_unused_parameters(trainer) and trainer.global_rank == 0:
                _unfreeze_log.info(
                    "step %d: DDP re-wrapped with find_unused_parameters=False for phase 2",
                    trainer.global_step,
                )
        if phase != self.phase:
            if trainer.global_rank == 0:
                _unfreeze_log.info(
                    "step %d: phase %d, encoder %s",
                    trainer.global_step,
                    phase,
                    "frozen (eval mode, no gradients)" if phase == 1 else "unfrozen (training)",
                )
            self.phase = phase
        pl_module.encoder_frozen = phase == 1
        pl_module.phase = phase


def stop_searching_unused_parameters(trainer) -> bool:
    """Wrap the LightningModule anew in DDP with find_unused_parameters=False; True when it did.

    DDP fixes find_unused_parameters at construction, so the switch is a new wrapper, built by
    Lightning's own DDPStrategy with its other settings unchanged. The old wrapper's autograd hooks
    are removed first (each gradient is all-reduced once, by the new one) and gradients are dropped
    (a new optimizer step starts here; with gradient_as_bucket_view they are views into the old
    buckets). Building the wrapper broadcasts rank 0's parameters and buffers, already identical on
    every rank: a collective that every rank reaches at the same optimizer-step boundary, because
    the phase depends on global_step alone. No-op without DDP or when it is already off.
    """
    from torch.nn.parallel import DistributedDataParallel

    strategy = trainer.strategy
    wrapper = strategy.model
    if not isinstance(wrapper, DistributedDataParallel) or not wrapper.find_unused_parameters:
        return False
    module = wrapper.module
    module.zero_grad(set_to_none=True)
    wrapper.reducer._remove_autograd_hooks()
    strategy._ddp_kwargs["find_unused_parameters"] = False
    strategy.model = strategy._setup_model(module)
    strategy._register_ddp_hooks()
    return True


# ---- Monitoring, step checkpoints, exact resume, per-language WER ---------------------------------------
# Metric keys logged to W&B and to <run dir>/metrics.jsonl (the run's closing note lists them too):
#   train/loss, train/lr, train/phase, train/grad_norm, train/epoch, train/micro_batch,
#   train/skipped_steps, train/empty_micro_batches, train/nonfinite_losses,
#   time/step_s, time/checkpoint_s, time/data_wait_fraction, time/data_wait_fraction_max,
#   throughput/audio_s_per_step, throughput/audio_s_per_s, throughput/utterances_per_step,
#   throughput/utterances_per_s, data/padding_efficiency, data/bad_audio_total, data/bad_audio/<reason>,
#   lang_share/<lang>, lang_target/<lang>, gpu/peak_memory_gib (CUDA only),
#   val/wer/<lang>, val/cer/<lang>, val/wer/all, val/cer/all, val/utterances, val/seconds,
#   and the table val/examples.
_log = _logging.getLogger("callbacks")

# ---- WER / CER: the one implementation (PerLanguageWERCallback and scripts/evaluate.py) ----------

_LANG_TAG = re.compile(r"<\|[^|<>\s]*\|>")


def strip_lang_tag(text: str) -> str:
    """``text`` without any ``<|lang|>`` tag, whitespace collapsed to single spaces."""
    return " ".join(_LANG_TAG.sub(" ", text).split())


@dataclasses.dataclass
class ErrorCounts:
    """Edit counts summed over utterances: rates are corpus-level (total edits / total reference units)."""

    word_edits: int = 0
    words: int = 0
    char_edits: int = 0
    chars: int = 0
    utterances: int = 0

    @property
    def wer(self) -> float:
        return self.word_edits / self.words if self.words else math.nan

    @property
    def cer(self) -> float:
        return self.char_edits / self.chars if self.chars else math.nan

    def add(self, reference: str, hypothesis: str) -> None:
        """Count one utterance; both sides are tag-stripped. CER counts characters including the single
        spaces between words (jiwer's convention)."""
        from kaldialign import edit_distance  # C++ Levenshtein; NeMo's ASR extra installs it

        ref, hyp = strip_lang_tag(reference), strip_lang_tag(hypothesis)
        self.word_edits += edit_distance(ref.split(), hyp.split())["total"]
        self.words += len(ref.split())
        self.char_edits += edit_distance(list(ref), list(hyp))["total"]
        self.chars += len(ref)
        self.utterances += 1


def corpus_error_rates(
    references: Sequence[str], hypotheses: Sequence[str], languages: Sequence[str]
) -> dict[str, ErrorCounts]:
    """ErrorCounts per language plus "all" (every utterance), corpus-level, tags stripped."""
    if not len(references) == len(hypotheses) == len(languages):
        raise ValueError(
            f"corpus_error_rates: {len(references)} references, {len(hypotheses)} hypotheses and "
            f"{len(languages)} languages; expected one of each per utterance"
        )
    counts: dict[str, ErrorCounts] = {}
    total = ErrorCounts()
    for ref, hyp, lang in zip(references, hypotheses, languages):
        counts.setdefault(lang, ErrorCounts()).add(ref, hyp)
        total.add(ref, hyp)
    counts = dict(sorted(counts.items()))
    counts["all"] = total
    return counts


# ---- greedy decoding with our dataset + collate (PerLanguageWERCallback and scripts/evaluate.py) --


def select_eval_indices(lang_codes: np.ndarray, per_lang: int, seed: int = 0) -> np.ndarray:
    """Up to ``per_lang`` dataset indices per language code, a seeded choice, sorted (the same on every rank)."""
    rng = np.random.default_rng(seed)
    chosen = []
    for code in np.unique(lang_codes):
        rows = np.flatnonzero(lang_codes == code)
        chosen.append(rows if len(rows) <= per_lang else rng.choice(rows, per_lang, replace=False))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def pack_by_duration(
    indices: Sequence[int], durations: np.ndarray, max_batch_seconds: float
) -> list[list[int]]:
    """``indices`` sorted by duration and cut into batches of at most ``max_batch_seconds`` of audio
    (an utterance longer than that gets a batch of its own)."""
    order = sorted((int(i) for i in indices), key=lambda i: float(durations[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    seconds = 0.0
    for i in order:
        d = float(durations[i])
        if current and seconds + d > max_batch_seconds:
            batches.append(current)
            current, seconds = [], 0.0
        current.append(i)
        seconds += d
    if current:
        batches.append(current)
    return batches


def _module_modes(model: torch.nn.Module) -> dict[torch.nn.Module, bool]:
    return {m: m.training for m in model.modules()}


@torch.no_grad()
def greedy_transcribe(
    model,
    dataset,
    indices: Sequence[int],
    *,
    max_batch_seconds: float = 60.0,
    device: torch.device | str | None = None,
    autocast: Callable[[], Any] | None = None,
    progress: bool = False,
) -> dict[int, str | None]:
    """Greedy hypotheses of ``dataset[i]`` for each ``i`` in ``indices``: {index: text, or None for bad audio}.

    Audio goes through the training pipeline's own loading and collate (soundfile + soxr, the same
    resampling and padding) and the model's forward + ``decoding.rnnt_decoder_predictions_tensor``:
    no temporary manifests, no NeMo dataloader, and so no dependence on ``cfg.validation_ds``. Every
    module's train/eval mode is restored afterwards (a frozen encoder stays in eval mode).
    """
    from dataset import collate_asr_batch

    device = torch.device(device) if device is not None else next(model.parameters()).device
    modes = _module_modes(model)
    model.eval()
    out: dict[int, str | None] = {}
    batches = pack_by_duration(indices, dataset.durations, max_batch_seconds)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="decoding", unit="batch")
    try:
        for batch_indices in batches:
            items = [dataset[i] for i in batch_indices]
            good = [i for i, item in zip(batch_indices, items) if item is not None]
            out.update({i: None for i, item in zip(batch_indices, items) if item is None})
            if not good:
                continue
            batch = collate_asr_batch([item for item in items if item is not None])
            with autocast() if autocast is not None else contextlib.nullcontext():
                encoded, encoded_len = model.forward(
                    input_signal=batch.signal.to(device),
                    input_signal_length=batch.signal_len.to(device),
                )
                hyps = model.decoding.rnnt_decoder_predictions_tensor(
                    encoder_output=encoded, encoded_lengths=encoded_len
                )
            if isinstance(hyps, tuple):  # older NeMo returned (best, all)
                hyps = hyps[0]
            for i, hyp in zip(good, hyps):
                out[i] = hyp.text if hasattr(hyp, "text") else str(hyp)
    finally:
        for module, training in modes.items():
            module.train(training)
    return out


def manifest_texts(dataset) -> list[str]:
    """The manifest's ``text`` of every dataset item (tag included), via ``dataset.manifest_rows``."""
    import pyarrow.parquet as pq

    texts = pq.read_table(dataset.manifest_path, columns=["text"]).column("text").to_pylist()
    return [texts[int(r)] for r in dataset.manifest_rows]


# ---- local metrics file and loggers ----------------------------------------------------------------


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


class JsonlMetricsLogger(Logger):
    """The run's scalars as JSON lines (``{"step": .., "time": .., key: value}``), readable without W&B;
    the settings (``log_hyperparams``) go to ``hparams.json`` beside it.

    Lines are appended and flushed one at a time, so a crash loses at most the line being written.
    Tables (``log_table``, the same signature as WandbLogger's) go to the same file as
    ``{"step": .., "table": key, "columns": [..], "rows": [[..]]}``. Writes happen on global rank 0 only.
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = Path(path)

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return self.path.parent.name

    def _write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._write(
            {
                "step": step,
                "time": round(time.time(), 3),
                **{k: _json_value(v) for k, v in metrics.items()},
            }
        )

    @rank_zero_only
    def log_table(
        self, key: str, columns: list[str], data: list[list[Any]], step: int | None = None
    ) -> None:
        self._write(
            {
                "step": step,
                "table": key,
                "columns": list(columns),
                "rows": [[_json_value(v) for v in row] for row in data],
            }
        )

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The run's settings to ``hparams.json`` beside the metrics file (the latest launch's)."""
        params = params if isinstance(params, dict) else vars(params)
        text = json.dumps(
            {
                k: _json_value(v) if isinstance(v, (int, float)) else str(v)
                for k, v in params.items()
            },
            indent=1,
            ensure_ascii=False,
        )
        atomic_write(
            self.path.with_name("hparams.json"),
            lambda tmp: Path(tmp).write_text(text, encoding="utf-8"),
        )


def run_directory(run_name: str | None = None, log_dir: Path | None = None) -> Path:
    """WANDB_LOG_DIR/<run name>: the W&B files (wandb/offline-run-*) and metrics.jsonl of one run.

    The name is ``run_name``, else WANDB_RUN_NAME, else run-<UTC time>; only global rank 0 writes there.
    """
    log_dir = Path(log_dir or _config.WANDB_LOG_DIR)
    name = run_name or _config.WANDB_RUN_NAME or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    return log_dir / name


RUN_RECORD = "run.json"


def run_identity(resuming: bool, checkpoint_dir: Path | None = None) -> tuple[str, str]:
    """(run name, W&B run id) of this job.

    A job that resumes from a checkpoint reuses the pair recorded in CHECKPOINT_DIR/run.json by the
    job that wrote it, so W&B continues the same run (Lightning's WandbLogger passes resume="allow")
    and metrics.jsonl stays one file across crashes and requeues; an explicit WANDB_RUN_NAME that
    differs from the record starts a new run under that name. A fresh job takes WANDB_RUN_NAME (else
    run-<UTC time>) and a new id, and global rank 0 records them.
    """
    record = Path(checkpoint_dir or _config.CHECKPOINT_DIR) / RUN_RECORD
    if resuming and record.is_file():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if not _config.WANDB_RUN_NAME or _config.WANDB_RUN_NAME == saved["name"]:
            return saved["name"], saved["wandb_id"]
    name = run_directory().name
    identity = (name, secrets.token_hex(6))
    if int(os.environ.get("RANK", "0")) == 0:
        record.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"name": identity[0], "wandb_id": identity[1]})
        atomic_write(record, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return identity


def build_loggers(run_dir: Path | None = None, resuming: bool = False) -> list[Logger]:
    """[WandbLogger (unless WANDB_MODE resolves to disabled), JsonlMetricsLogger] for one run.

    W&B mode: config.wandb_mode() (WANDB_MODE, else online with WANDB_API_KEY, else offline). An
    offline run lives in <run dir>/wandb/offline-run-*/ and is uploaded later with
    ``wandb sync <that dir>``. Name and W&B id come from ``run_identity``: a resumed job continues
    its run.
    """
    name, run_id = run_identity(resuming)
    run_dir = Path(run_dir or run_directory(name))
    loggers: list[Logger] = []
    mode = _config.wandb_mode()
    if mode != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        if int(os.environ.get("RANK", "0")) == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
        loggers.append(
            WandbLogger(
                project=_config.WANDB_PROJECT,
                name=name,
                id=run_id,
                save_dir=str(run_dir),
                mode=mode,
                log_model=False,
            )
        )
    loggers.append(JsonlMetricsLogger(run_dir / "metrics.jsonl"))
    return loggers


def log_to_loggers(trainer, metrics: dict[str, float], step: int) -> None:
    """Scalars to every logger of ``trainer``, from global rank 0 only."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


# ---- cross-rank reductions ------------------------------------------------------------------------


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_reduce_tensor(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``values`` reduced over every rank (sum or max); unchanged in a single process."""
    if _distributed():
        values = values.clone()
        torch.distributed.all_reduce(
            values,
            op=torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX,
        )
    return values


def all_gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...]; [obj] in a single process. Every rank must call it."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


# ---- TrainingMetricsCallback ----------------------------------------------------------------------


def _bad_audio_reasons() -> tuple[str, ...]:
    from dataset import BAD_AUDIO_REASONS

    return tuple(BAD_AUDIO_REASONS)


class TrainingMetricsCallback(_pl.Callback):
    """Per optimizer step, one all-reduce over ranks, then scalars logged from global rank 0.

    Everything is measured between two optimizer steps (the "window": GRAD_ACCUM micro-batches per
    rank). Sums over ranks: loss (mean over non-empty micro-batches), audio seconds, utterances,
    padding (real / padded samples), data-wait time, utterances per language, bad audio. Max over
    ranks: step time, the worst rank's data-wait fraction, peak GPU memory. The language share is
    rolling over the last ``share_window`` optimizer steps, next to the sampler's target share.
    Counters (skipped steps, bad audio, ...) are cumulative and survive a resume (callback state).
    ``last_metrics`` holds the latest dict (the progress bar shows part of it).
    """

    _COUNTERS = (
        "skipped_steps",
        "empty_micro_batches",
        "nonfinite_losses",
    )  # order used in _step_metrics

    def __init__(self, share_window: int = 100):
        self.share_window = int(share_window)
        self._counters_seen: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self.totals: dict[str, float] = {}
        self._langs: list[str] = []
        self._target: dict[str, float] = {}
        self._shares: deque = deque(maxlen=self.share_window)
        self._last_step = 0
        self._step_started = 0.0
        self._batch_ended: float | None = None
        self._lr = math.nan
        self._nonfinite_seen = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._w = dict(
            loss_sum=0.0,
            loss_n=0,
            utterances=0,
            audio_s=0.0,
            real=0,
            padded=0,
            wait_s=0.0,
            checkpoint_s=0.0,
        )
        self._w_lang = np.zeros(len(self._langs), dtype=np.float64)
        self._w_bad = np.zeros(len(_bad_audio_reasons()), dtype=np.float64)

    # -- state carried in the checkpoint (rank 0's, i.e. the all-reduced totals) --
    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.totals = dict(state_dict.get("totals", {}))

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            params = {name: str(knob.value) for name, knob in _config.KNOBS.items()}
            params.update(world_size=trainer.world_size, resumed_at_step=trainer.global_step)
            for logger in trainer.loggers:
                logger.log_hyperparams(params)
        self._last_step = trainer.global_step
        self._nonfinite_seen = getattr(pl_module, "nonfinite_losses", 0)
        self._counters_seen = {name: float(getattr(pl_module, name, 0)) for name in self._COUNTERS}
        self._step_started = time.perf_counter()
        self._batch_ended = self._step_started
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        sampler = getattr(pl_module, "sampler", None)
        if sampler is not None:
            stats = sampler.epoch_stats()
            langs = [str(l) for l in stats["languages"]]
            if langs != self._langs:
                self._langs = langs
                self._shares.clear()
                self._w_lang = np.zeros(len(langs), dtype=np.float64)
            self._target = {str(k): float(v) for k, v in stats["target_share"].items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._batch_ended is not None:
            # Between the previous batch's end and this start Lightning fetched this batch, and ran
            # the checkpoint callback (Lightning puts checkpoint callbacks after this one): not data wait.
            ended = self._batch_ended
            for cb in trainer.checkpoint_callbacks:
                if getattr(cb, "last_save_ended", -math.inf) > ended:
                    ended = cb.last_save_ended
                    self._w["checkpoint_s"] += cb.last_save_seconds
            self._w["wait_s"] += max(0.0, now - ended)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._lr = float(
            optimizer.param_groups[0]["lr"]
        )  # the LR this step uses (the scheduler moves it after)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        w = self._w
        if getattr(batch, "bad_audio", None):
            reasons = _bad_audio_reasons()
            for reason, n in batch.bad_audio.items():
                if reason in reasons:
                    self._w_bad[reasons.index(reason)] += n
        if hasattr(batch, "signal") and batch.signal.shape[0] > 0:
            b, t = batch.signal.shape
            w["utterances"] += b
            w["audio_s"] += float(sum(batch.durations))
            w["real"] += int(batch.signal_len.sum())
            w["padded"] += b * t
            loss = getattr(pl_module, "last_loss", None)
            nonfinite = getattr(pl_module, "nonfinite_losses", 0)
            replaced, self._nonfinite_seen = nonfinite != self._nonfinite_seen, nonfinite
            # A non-finite loss was replaced by a zero for DDP's sake: it is not a loss value to average.
            if loss is not None and not replaced and math.isfinite(float(loss)):
                w["loss_sum"] += float(loss)
                w["loss_n"] += 1
            if self._langs:
                index = {l: i for i, l in enumerate(self._langs)}
                for lang in batch.langs:
                    if lang in index:
                        self._w_lang[index[lang]] += 1
        self._batch_ended = time.perf_counter()
        if trainer.global_step == self._last_step:
            return  # still accumulating: no optimizer step yet
        self._last_step = trainer.global_step
        metrics = self._step_metrics(trainer, pl_module)
        self.last_metrics = metrics
        self._reset_window()
        self._step_started = time.perf_counter()
        self._batch_ended = self._step_started
        log_to_loggers(trainer, metrics, step=trainer.global_step)

    def _step_metrics(self, trainer, pl_module) -> dict[str, float]:
        w = self._w
        now = time.perf_counter()
        step_s = now - self._step_started
        device = pl_module.device
        cuda = device.type == "cuda"
        # The module's fault counters are per rank and restart at 0 in a resumed process: sum their
        # growth over ranks into totals that the checkpoint carries.
        counters = [float(getattr(pl_module, name, 0)) for name in self._COUNTERS]
        grown = [
            now_ - self._counters_seen.get(name, 0.0)
            for name, now_ in zip(self._COUNTERS, counters)
        ]
        self._counters_seen = dict(zip(self._COUNTERS, counters))
        sums = torch.tensor(
            [
                w["loss_sum"],
                w["loss_n"],
                w["utterances"],
                w["audio_s"],
                w["real"],
                w["padded"],
                w["wait_s"],
                step_s,
                grown[1],
                grown[2],
                *self._w_lang,
                *self._w_bad,
            ],
            dtype=torch.float64,
            device=device,
        )
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
        maxes = torch.tensor(
            [step_s, w["wait_s"] / step_s if step_s > 0 else 0.0, peak_gib, grown[0]],
            dtype=torch.float64,
            device=device,
        )
        sums = all_reduce_tensor(sums, "sum").cpu().tolist()
        maxes = all_reduce_tensor(maxes, "max").cpu().tolist()
        loss_sum, loss_n, utts, audio_s, real, padded, wait_s, step_s_sum, empty, nonfinite = sums[
            :10
        ]
        n_lang = len(self._langs)
        lang_counts = np.array(sums[10 : 10 + n_lang])
        bad = sums[10 + n_lang :]
        step_max, wait_frac_max, peak, skipped = (
            maxes  # a skip is decided on all ranks alike: not summed
        )

        for name, grew in (
            ("skipped_steps", skipped),
            ("empty_micro_batches", empty),
            ("nonfinite_losses", nonfinite),
        ):
            self.totals[name] = self.totals.get(name, 0.0) + grew
        self.totals["bad_audio_total"] = self.totals.get("bad_audio_total", 0.0) + sum(bad)
        for reason, n in zip(_bad_audio_reasons(), bad):
            self.totals[f"bad_audio/{reason}"] = self.totals.get(f"bad_audio/{reason}", 0.0) + n
        self._shares.append(lang_counts)
        window = np.sum(self._shares, axis=0) if self._shares else lang_counts

        m: dict[str, float] = {
            "train/loss": loss_sum / loss_n if loss_n else math.nan,
            "train/lr": self._lr,
            "train/phase": float(getattr(pl_module, "phase", math.nan)),
            "train/grad_norm": _float_or_nan(getattr(pl_module, "last_grad_norm", None)),
            "train/epoch": float(trainer.current_epoch),
            "train/micro_batch": float(
                trainer.fit_loop.epoch_loop.batch_progress.current.processed
            ),
            "train/skipped_steps": self.totals["skipped_steps"],
            "train/empty_micro_batches": self.totals["empty_micro_batches"],
            "train/nonfinite_losses": self.totals["nonfinite_losses"],
            "time/step_s": step_max,
            "time/checkpoint_s": w["checkpoint_s"],
            "time/data_wait_fraction": wait_s / step_s_sum if step_s_sum > 0 else 0.0,
            "time/data_wait_fraction_max": wait_frac_max,
            "throughput/audio_s_per_step": audio_s,
            "throughput/audio_s_per_s": audio_s / step_max if step_max > 0 else math.nan,
            "throughput/utterances_per_step": utts,
            "throughput/utterances_per_s": utts / step_max if step_max > 0 else math.nan,
            "data/padding_efficiency": real / padded if padded else math.nan,
            "data/bad_audio_total": self.totals["bad_audio_total"],
        }
        for reason in _bad_audio_reasons():
            m[f"data/bad_audio/{reason}"] = self.totals[f"bad_audio/{reason}"]
        total = float(window.sum())
        for lang, n in zip(self._langs, window):
            m[f"lang_share/{lang}"] = float(n) / total if total else math.nan
            m[f"lang_target/{lang}"] = self._target.get(lang, math.nan)
        if cuda:
            m["gpu/peak_memory_gib"] = peak
            torch.cuda.reset_peak_memory_stats(device)
        return m


def _float_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


# ---- progress bar ----------------------------------------------------------------------------------


def progress_postfix(
    micro_batch: int,
    epoch: int,
    epoch_micro_batch: int,
    epoch_micro_batches: int | None,
    loss: float | None,
    lr: float | None,
    phase: int | None,
) -> str:
    """The text after the optimizer-step counter, e.g.
    ``micro-batch 49 (epoch 0: 48/5000) | loss 1.2345 | lr 3.00e-04 | phase 1``."""
    of = f"/{epoch_micro_batches}" if epoch_micro_batches else ""
    parts = [f"micro-batch {micro_batch} (epoch {epoch}: {epoch_micro_batch}{of})"]
    parts.append(f"loss {loss:.4f}" if loss is not None and math.isfinite(loss) else "loss -")
    parts.append(f"lr {lr:.2e}" if lr is not None and math.isfinite(lr) else "lr -")
    parts.append(f"phase {phase}" if phase is not None else "phase -")
    return " | ".join(parts)


class OptimizerStepProgressBar(TQDMProgressBar):
    """One bar for the whole run that counts optimizer steps (global_step of MAX_STEPS), the unit of
    CHECKPOINT_EVERY, with micro-batches second: ``step: 37%| | 12/32 [..., micro-batch 49 (epoch 0:
    48/5000) | loss 1.2345 | lr 3.00e-04 | phase 1]``. The old bar counted micro-batches, GRAD_ACCUM
    times faster than checkpoint steps.

    ``refresh_rate`` (micro-batches between updates) defaults to 1 on a terminal and to 100 when stdout
    is a file (SLURM logs), where every update is a new line.
    """

    def __init__(self, refresh_rate: int | None = None, **kwargs: Any):
        import sys

        if refresh_rate is None:
            refresh_rate = 1 if sys.stdout.isatty() else 100
        super().__init__(refresh_rate=refresh_rate, **kwargs)

    @property
    def train_description(self) -> str:
        return "step"

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        self._set_n(trainer.global_step)

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        pass  # the bar spans the run, not one epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass

    def _set_n(self, n: int) -> None:
        bar = self.train_progress_bar
        if not bar.disable:
            bar.n = n
            bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        last = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        if not self.is_enabled or (progress.total.processed % self.refresh_rate and not last):
            return
        metrics = next(
            (
                cb.last_metrics
                for cb in trainer.callbacks
                if isinstance(cb, TrainingMetricsCallback)
            ),
            {},
        )
        loss = metrics.get("train/loss")
        if loss is None and getattr(pl_module, "last_loss", None) is not None:
            loss = float(pl_module.last_loss)
        lr = metrics.get("train/lr")
        if lr is None and trainer.optimizers:
            lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        epoch_total = trainer.num_training_batches
        self.train_progress_bar.set_postfix_str(
            progress_postfix(
                progress.total.processed,
                trainer.current_epoch,
                progress.current.processed,
                int(epoch_total) if epoch_total and math.isfinite(epoch_total) else None,
                loss,
                lr,
                getattr(pl_module, "phase", None),
            ),
            refresh=False,
        )
        self._set_n(trainer.global_step)


# ---- atomic step checkpoints -------------------------------------------------------------------------

CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)\.ckpt$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO, but the file appears under its name only once complete.

    Lightning's own save goes through an fsspec transaction whose temporary file lives in the system
    temp dir and is then *copied* (shutil.move) when /tmp is another file system, after buffering the
    whole checkpoint in memory: a crash mid-copy leaves a truncated file that looks whole.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO.save_checkpoint got storage_options={storage_options!r}; "
                "it writes local files only"
            )
        atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))


def find_last_checkpoint(checkpoint_dir: Path | None = None) -> Path | None:
    """The step checkpoint with the highest step in ``checkpoint_dir`` (CHECKPOINT_DIR), or None.
    Temporary files of an interrupted save never match the name pattern."""
    directory = Path(checkpoint_dir or _config.CHECKPOINT_DIR)
    if not directory.is_dir():
        return None
    found = [
        (int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))
    ]
    return max(found)[1] if found else None


def resolve_resume_from(
    resume_from: str | None = None, checkpoint_dir: Path | None = None
) -> str | None:
    """``ckpt_path`` for trainer.fit from RESUME_FROM: '' -> None (fresh start); 'last' -> the newest
    step checkpoint in CHECKPOINT_DIR (None, logged, when there is none yet, so a restart loop can
    always pass RESUME_FROM=last); otherwise a path that must exist."""
    resume_from = _config.RESUME_FROM if resume_from is None else resume_from
    if not resume_from:
        return None
    if resume_from == "last":
        directory = Path(checkpoint_dir or _config.CHECKPOINT_DIR)
        last = find_last_checkpoint(directory)
        if last is None:
            _log.warning(
                "RESUME_FROM=last: no step checkpoint (step_*.ckpt) in CHECKPOINT_DIR=%s; starting fresh",
                directory,
            )
            return None
        _log.info("RESUME_FROM=last: resuming from %s", last)
        return str(last)
    if not Path(resume_from).is_file():
        raise FileNotFoundError(
            f"RESUME_FROM={resume_from}: no such checkpoint file; give a step_*.ckpt path, "
            f"'last' (newest in CHECKPOINT_DIR) or leave it empty"
        )
    return resume_from


def export_nemo(model, path: str | os.PathLike) -> Path:
    """``model.save_to`` a .nemo file, atomically (see ``atomic_write``)."""
    path = Path(path)
    atomic_write(path, lambda tmp: model.save_to(tmp), suffix=".tmp.nemo")
    return path


class StepOnlyModelCheckpoint(ModelCheckpoint):
    """A checkpoint every ``every_n_steps`` optimizer steps (CHECKPOINT_EVERY) as
    ``<dirpath>/step_<step:08d>.ckpt`` (dirpath: CHECKPOINT_DIR), all kept, nothing else: no epoch-end,
    validation or metric-based saves. At the end of training, ``step_<step>.nemo`` (the NeMo model).

    - Saved right after the optimizer step, so a resume starts at a gradient-accumulation boundary.
    - Atomic: ``setup`` installs AtomicCheckpointIO on the strategy; global rank 0 writes a temporary
      file in the same directory and renames it when complete; Lightning's barrier in
      ``trainer.save_checkpoint`` holds every rank until then.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_steps: int | None = None,
        export_nemo_at_end: bool = True,
    ):
        every = int(_config.CHECKPOINT_EVERY if every_n_steps is None else every_n_steps)
        if every < 1:
            raise ValueError(f"CHECKPOINT_EVERY={every}: expected >= 1")
        super().__init__(
            dirpath=str(dirpath or _config.CHECKPOINT_DIR),
            filename="step_{step:08d}",
            auto_insert_metric_name=False,
            save_top_k=-1,
            save_last=False,
            every_n_train_steps=every,
            save_on_train_epoch_end=False,
            enable_version_counter=False,
        )
        self.every_n_steps = every
        self.export_nemo_at_end = export_nemo_at_end
        self._seen_step = 0
        self.last_save_ended = -math.inf  # perf_counter() when the last save finished
        self.last_save_seconds = 0.0

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and Path(self.dirpath).is_dir():
            # What a crash mid-save left behind: hidden, never resumable, possibly gigabytes.
            for stale in Path(self.dirpath).glob(".step_*.tmp*"):
                _log.warning("removing %s, an interrupted save", stale)
                stale.unlink(missing_ok=True)
        io = trainer.strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        elif not isinstance(io, AtomicCheckpointIO):
            _log.warning(
                "checkpoint IO %s is not TorchCheckpointIO: checkpoints are written by it, not atomically "
                "by StepOnlyModelCheckpoint",
                type(io).__name__,
            )

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        # After a resume the restored step is already saved: do not save it again one micro-batch later.
        self._seen_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return  # no optimizer step in this micro-batch
        self._seen_step = step
        if step % self.every_n_steps == 0:
            started = time.perf_counter()
            self._save_checkpoint(trainer, str(Path(self.dirpath) / checkpoint_name(step)))
            self.last_save_ended = time.perf_counter()
            self.last_save_seconds = self.last_save_ended - started

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # no epoch-end saves

    def on_validation_end(self, trainer, pl_module) -> None:
        pass  # no metric-based saves

    def on_train_end(self, trainer, pl_module) -> None:
        if self.export_nemo_at_end and trainer.is_global_zero and trainer.global_step > 0:
            path = Path(self.dirpath) / f"step_{trainer.global_step:08d}.nemo"
            export_nemo(pl_module.model, path)
            _log.info("exported %s", path)
        trainer.strategy.barrier("nemo_export")


# ---- exact resume -------------------------------------------------------------------------------------


def capture_rng_state(module: torch.nn.Module | None = None) -> dict[str, Any]:
    """Every random generator a training step draws from, in this process: torch (CPU and CUDA),
    NumPy, Python's ``random``, and any ``random.Random`` a module keeps (NeMo's SpecAugment ``_rng``)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if module is not None:
        state["modules"] = {
            name: m._rng.getstate()
            for name, m in module.named_modules()
            if isinstance(getattr(m, "_rng", None), random.Random)
        }
    return state


def restore_rng_state(state: dict[str, Any], module: torch.nn.Module | None = None) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if module is not None:
        named = dict(module.named_modules())
        for name, rng_state in state.get("modules", {}).items():
            if name in named and isinstance(getattr(named[name], "_rng", None), random.Random):
                named[name]._rng.setstate(rng_state)


class ExactResumeCallback(_pl.Callback):
    """Makes a step checkpoint continue at exactly the next micro-batch (RESUME_FROM).

    Lightning restores the model, optimizer, LR scheduler (LambdaLR over global_step, so the phase and
    LR follow) and loop counters, but (Lightning 2.4, measured):
    1. It replays a plain DataLoader from its first batch. Here the checkpoint carries the sampler's
       state with ``position`` = micro-batches this rank consumed this epoch, counted by Lightning's
       loop (not by the sampler, which the DataLoader's prefetching runs ahead); train.py's
       ``train_dataloader`` loads it into the new sampler (``pl_module.resume_sampler_state``), so the
       iterator yields only the remaining batches of that epoch.
    2. A checkpoint written in ``on_train_batch_end`` records that batch as not completed, so after a
       restore the loop re-counts it: batch_idx is off by one and gradient accumulation steps after
       one micro-batch. ``on_save_checkpoint`` marks it completed (completed = processed).
    3. It does not save RNG states. Each rank's (torch, CUDA, NumPy, Python, module generators) is
       gathered into the checkpoint and restored in ``on_train_start``: after Lightning built the
       restored epoch's DataLoader iterator (which draws a worker seed from torch's generator, a draw
       the straight run made at that epoch's start), and before anything the straight run did after
       the save: the next micro-batch, or, for a save at an epoch's last micro-batch, the next
       epoch's iterator (one draw in both runs).
    Positions are the same on every rank (lockstep micro-batches), so rank 0's sampler state serves all.
    """

    def __init__(self):
        self._pending_rng: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        position = None
        if progress is not None:
            for part in ("current", "total"):
                progress[part]["completed"] = progress[part]["processed"]
            position = int(progress["current"]["processed"])
        sampler = getattr(pl_module, "sampler", None)
        if sampler is not None:
            state = dict(sampler.state_dict())
            if position is not None:
                state["position"] = position
            checkpoint["sampler_state"] = state
        # dump_checkpoint runs on every rank (trainer.save_checkpoint), so this collective is matched.
        checkpoint["rng_states"] = all_gather_objects(capture_rng_state(pl_module))
        checkpoint["world_size"] = trainer.world_size

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        import warnings

        # Lightning's "dataloader is not resumable" warning is about the plain DataLoader; the sampler
        # state restored here makes the resume exact, so the warning would only mislead.
        warnings.filterwarnings(
            "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
        )
        state = checkpoint.get("sampler_state")
        if state is None:
            _log.warning(
                "checkpoint has no sampler_state: the data order restarts at the beginning of epoch %s",
                checkpoint.get("epoch"),
            )
        pl_module.resume_sampler_state = state
        rng = checkpoint.get("rng_states")
        if rng and len(rng) == trainer.world_size:
            self._pending_rng = rng[trainer.global_rank]
        elif rng:
            _log.warning(
                "checkpoint was written by %d ranks, this run has %d: RNG states are not restored "
                "(the data order still is, if the sampler accepts the new world size)",
                len(rng),
                trainer.world_size,
            )

    def on_train_start(self, trainer, pl_module) -> None:
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng, pl_module)
            self._pending_rng = None


# ---- EpochBoundarySyncCallback --------------------------------------------------------------------------


class EpochBoundarySyncCallback(_pl.Callback):
    """At every epoch start: ``set_epoch(current_epoch)`` on the batch sampler, then a barrier, so no
    rank starts a new epoch's plan before every rank has finished the previous one.

    Lightning 2.4 calls set_epoch only on ``loader.sampler`` and ``loader.batch_sampler.sampler``,
    never on a custom batch_sampler: without this, epoch 2 would replay an exhausted plan (measured:
    the fit loop then spins forever on an empty iterator). set_epoch with the current epoch keeps the
    position, so a restored mid-epoch sampler is not rewound.
    """

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        sampler = getattr(pl_module, "sampler", None)
        if sampler is None:
            loader = trainer.train_dataloader
            sampler = getattr(loader, "batch_sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(trainer.current_epoch)
        trainer.strategy.barrier("epoch_boundary")


# ---- PerLanguageWERCallback -------------------------------------------------------------------------------


class PerLanguageWERCallback(_pl.Callback):
    """Every ``every_n_steps`` optimizer steps (EVAL_EVERY_STEPS; 0 = off): greedy WER and CER per language
    on ``samples_per_lang`` (EVAL_SAMPLES_PER_LANG) utterances per language of VAL_MANIFEST_PATH.

    The chosen utterances are split across ranks (rank r decodes every world_size-th, longest and
    shortest spread evenly), hypotheses are gathered with all_gather_object, and rank 0 logs
    ``val/wer/<lang>``, ``val/cer/<lang>``, ``val/wer/all``, ``val/cer/all`` (corpus-level, language
    tags stripped from both sides) and a table ``val/examples`` (lang, reference, hypothesis; up to
    ``examples_per_lang`` per language). Decoding uses ``greedy_transcribe`` (our dataset and
    collate, the model's forward and greedy decoding) rather than NeMo's transcribe(), which would
    need temporary JSON manifests, its own audio loading and a cfg.validation_ds.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        samples_per_lang: int | None = None,
        manifest_path: str | os.PathLike | None = None,
        max_batch_seconds: float | None = None,
        examples_per_lang: int = 3,
    ):
        self.every_n_steps = int(
            _config.EVAL_EVERY_STEPS if every_n_steps is None else every_n_steps
        )
        self.samples_per_lang = int(
            _config.EVAL_SAMPLES_PER_LANG if samples_per_lang is None else samples_per_lang
        )
        self.manifest_path = Path(manifest_path or _config.VAL_MANIFEST_PATH)
        self.max_batch_seconds = float(
            _config.MAX_BATCH_DURATION if max_batch_seconds is None else max_batch_seconds
        )
        self.examples_per_lang = examples_per_lang
        self.dataset = None
        self.indices = np.zeros(0, dtype=np.int64)
        self.references: dict[int, str] = {}
        self.last_results: dict[str, ErrorCounts] = {}
        self._seen_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step
        if self.every_n_steps <= 0:
            return
        from dataset import LocalShardDataset

        if not self.manifest_path.is_file():
            raise FileNotFoundError(
                f"EVAL_EVERY_STEPS={self.every_n_steps} but VAL_MANIFEST_PATH={self.manifest_path} "
                "does not exist; build it with scripts/make_train_val.py or set EVAL_EVERY_STEPS=0"
            )
        self.dataset = LocalShardDataset(
            self.manifest_path, pl_module.model.tokenizer, progress=False
        )
        self.indices = select_eval_indices(
            self.dataset.lang_codes, self.samples_per_lang, seed=_config.SEED
        )
        texts = manifest_texts(self.dataset)
        self.references = {int(i): texts[int(i)] for i in self.indices}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return
        self._seen_step = step
        if self.every_n_steps > 0 and step % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer, pl_module) -> dict[str, ErrorCounts]:
        """Decode this rank's share, gather, and (rank 0) log. Every rank must call it."""
        started = time.perf_counter()
        # Interleave by duration so every rank gets a similar amount of audio.
        by_duration = sorted(self.indices.tolist(), key=lambda i: float(self.dataset.durations[i]))
        mine = by_duration[trainer.global_rank :: max(1, trainer.world_size)]
        hyps = greedy_transcribe(
            pl_module.model,
            self.dataset,
            mine,
            max_batch_seconds=self.max_batch_seconds,
            device=pl_module.device,
            autocast=trainer.precision_plugin.forward_context,
        )
        gathered: dict[int, str | None] = {}
        for part in all_gather_objects(hyps):
            gathered.update(part)
        names = self.dataset.lang_names
        codes = self.dataset.lang_codes
        done = [i for i in sorted(gathered) if gathered[i] is not None]
        langs = [names[codes[i]] for i in done]
        refs = [self.references[i] for i in done]
        outs = [gathered[i] for i in done]
        results = corpus_error_rates(refs, outs, langs)
        self.last_results = results
        if trainer.is_global_zero:
            metrics: dict[str, float] = {
                "val/utterances": float(len(done)),
                "val/seconds": time.perf_counter() - started,
            }
            for lang, c in results.items():
                metrics[f"val/wer/{lang}"] = c.wer
                metrics[f"val/cer/{lang}"] = c.cer
            log_to_loggers(trainer, metrics, step=trainer.global_step)
            rows, per_lang = [], {}
            for lang, ref, hyp in zip(langs, refs, outs):
                if per_lang.get(lang, 0) < self.examples_per_lang:
                    per_lang[lang] = per_lang.get(lang, 0) + 1
                    rows.append([lang, strip_lang_tag(ref), strip_lang_tag(hyp)])
            for logger in trainer.loggers:
                if hasattr(logger, "log_table"):
                    logger.log_table(
                        "val/examples",
                        ["lang", "reference", "hypothesis"],
                        rows,
                        step=trainer.global_step,
                    )
            _log.info(
                "step %d: greedy WER on %d utterances in %.1f s: %s",
                trainer.global_step,
                len(done),
                time.perf_counter() - started,
                ", ".join(f"{lang} {c.wer:.3f}" for lang, c in results.items()),
            )
        return results
