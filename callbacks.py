"""The Lightning callbacks of the training job (train.py wires them up); each one is thin.

EncoderUnfreezeCallback (the two phases), EpochBoundarySyncCallback (each epoch's plan),
TrainingMetricsCallback and OptimizerStepProgressBar (watching a run), StepOnlyModelCheckpoint and
ExactResumeCallback (keeping it), PerLanguageWERCallback (WER during training), ProgressWatchdog
(a rank that stops). The machinery they use lives in modules named for it: training_metrics.py (what
is logged), evaluation.py (WER/CER and greedy transcription), checkpoints.py (checkpoint files,
resume, RNG states, run identity), run_logging.py (loggers), collectives.py (cross-rank reductions),
rank_watchdog.py (the watchdog thread and the ranks' states in the process group's store).
"""

from __future__ import annotations

import dataclasses
import gc
import logging as _logging
import math
import os
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as _pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO

import asr_model
import base_adapters
import checkpoints
import config as _config
import evaluation
import model_card
import process_control
import training_metrics
from collectives import all_gather_objects
from dataset import BAD_AUDIO_REASONS
from punctuation_scoring import punctuation_case_scores, punctuation_metrics
from rank_watchdog import RankWatchdog
from run_logging import already_logged, log_to_loggers
from transcript_style import manifest_style

_log = _logging.getLogger("callbacks")

# ---- EncoderUnfreezeCallback -------------------------------------------------------------------------------
_unfreeze_log = _logging.getLogger("callbacks.unfreeze")


class EncoderUnfreezeCallback(_pl.Callback):
    """Two training phases, switched at optimizer step ``unfreeze_step`` (default UNFREEZE_STEP).

    Phase 1 (global_step < unfreeze_step): ``pl_module.enter_phase(1)`` at every batch start freezes
    the encoder (no gradients, eval mode, run without autograd), so its whole state_dict (weights and
    BatchNorm buffers) stays bit-identical.
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
        encoder = asr_model.encoder(pl_module.model)
        # A frozen-base model's base weights never train (base_adapters): only its adapters unfreeze.
        held = base_adapters.record_of(pl_module.model) is not None
        frozen = [
            n
            for n, p in encoder.named_parameters()
            if not p.requires_grad and (not held or base_adapters.is_adapter_parameter(n))
        ]
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
        phase = 1 if trainer.global_step < self.unfreeze_step else 2
        pl_module.enter_phase(phase)
        if phase == 2 and self.phase != 2:
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
                    ("frozen (eval mode, no gradients)" if phase == 1 else "unfrozen (training)")
                    + (
                        " (its adapters; the base's weights stay frozen)"
                        if base_adapters.record_of(pl_module.model) is not None
                        else ""
                    ),
                )
            self.phase = phase


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
    before = memory_in_use(module)
    # The old wrapper's gradient buckets (as large as the trainable parameters: 2.5 GB at full size)
    # go before the new ones are allocated, at the step where AdamW's encoder moments appear too.
    strategy.model = None
    del wrapper
    gc.collect()
    released = memory_in_use(module)
    strategy._ddp_kwargs["find_unused_parameters"] = False
    strategy.model = strategy._setup_model(module)
    strategy._register_ddp_hooks()
    if trainer.global_rank == 0:
        _unfreeze_log.info(
            "re-wrap memory: %s before, %s with the old buckets freed, %s with the new ones",
            before,
            released,
            memory_in_use(module),
        )
    return True


def memory_in_use(module) -> str:
    """What the device of ``module`` holds now: CUDA allocated and reserved, else this process's RSS."""
    device = next(module.parameters()).device
    if device.type == "cuda":
        return (
            f"{torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / 2**30:.2f} GiB reserved"
        )
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return f"{pages * os.sysconf('SC_PAGE_SIZE') / 2**30:.2f} GiB RSS"


# ---- TrainingMetricsCallback ----------------------------------------------------------------------


class TrainingMetricsCallback(_pl.Callback):
    """Logs training_metrics.STEP_METRICS once per optimizer step, from global rank 0.

    Each rank fills a ``training_metrics.Window`` between two optimizer steps (GRAD_ACCUM
    micro-batches): the micro-batch measures by themselves, the timers and fault-counter growth
    here. One all-reduce per kind of reduction combines the ranks; the cumulative totals (skipped
    steps, bad audio, ...) survive a resume as this callback's state. ``last_metrics`` holds the
    latest dict (the progress bar shows part of it).

    It also watches for overfitting (``training_metrics.OverfittingWatch``, state in the checkpoint):
    each step's train/loss, and each validation PerLanguageWERCallback (earlier in the list) left in
    ``pl_module.last_evaluation``, the end-of-run one included; ``warn_of_overfitting`` once a run.
    """

    def __init__(self, share_window: int = 100):
        self.share_window = int(share_window)
        self.last_metrics: dict[str, float] = {}
        self.totals: dict[str, Any] = {}
        self._keys: dict[str, list[str]] = {"lang": [], "reason": list(BAD_AUDIO_REASONS)}
        self._target: dict[str, float] = {}
        self._recent: deque = deque(maxlen=self.share_window)
        self._counters_seen: dict[str, float] = {}
        self._last_step = 0
        self._step_started = 0.0
        self._batch_ended: float | None = None
        self._lr = math.nan
        self._window = training_metrics.Window(self._keys)
        self.overfitting = training_metrics.OverfittingWatch(_config.OVERFITTING_WARN_VALIDATIONS)

    # -- state carried in the checkpoint (rank 0's, i.e. the all-reduced totals) --
    def state_dict(self) -> dict[str, Any]:
        return {"totals": self.totals, "overfitting": self.overfitting.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.totals = state_dict.get("totals", {})
        if "overfitting" in state_dict:
            self.overfitting.load_state_dict(state_dict["overfitting"])

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            params = _config.run_settings()
            params.update(world_size=trainer.world_size, resumed_at_step=trainer.global_step)
            trade_off = getattr(pl_module, "finetuning_trade_off", None)
            if trade_off:
                params["finetuning_trade_off"] = trade_off
            for logger in trainer.loggers:
                logger.log_hyperparams(params)
        self._last_step = trainer.global_step
        self._counters_seen = {
            name: float(getattr(pl_module, name)) for name in training_metrics.MODULE_COUNTERS
        }
        self._step_started = time.perf_counter()
        self._batch_ended = self._step_started
        if not self.totals:
            self.totals = training_metrics.empty_totals(self._keys)
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        stats = pl_module.sampler.epoch_stats()
        langs = [str(lang) for lang in stats["languages"]]
        if langs != self._keys["lang"]:
            self._keys["lang"] = langs
            self._recent.clear()
            self._window = training_metrics.Window(self._keys)
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
                    self._window.add("checkpoint_seconds", cb.last_save_seconds)
            self._window.add("wait_seconds", max(0.0, now - ended))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # The LR this step uses (the scheduler moves it after the step).
        self._lr = float(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._window.add_micro_batch(batch, pl_module)
        self._batch_ended = time.perf_counter()
        if trainer.global_step == self._last_step:
            return  # still accumulating: no optimizer step yet
        self._last_step = trainer.global_step
        metrics = self._step_metrics(trainer, pl_module)
        self.last_metrics = metrics
        self._window = training_metrics.Window(self._keys)
        self._step_started = time.perf_counter()
        self._batch_ended = self._step_started
        log_to_loggers(trainer, metrics, step=trainer.global_step)
        self._watch_overfitting(trainer, pl_module, metrics.get("train/loss"))

    def on_train_end(self, trainer, pl_module) -> None:
        # The validation PerLanguageWERCallback runs at the end of a run whose last step is no
        # multiple of EVAL_EVERY_STEPS: after this step's training loss was counted.
        self._watch_overfitting(trainer, pl_module, None)

    def _watch_overfitting(self, trainer, pl_module, train_loss: float | None) -> None:
        """Count this step's training loss in the interval of the validation it precedes, and
        record a validation not yet recorded: the step-0 one closes an empty interval before this
        step's loss, one at this step closes the interval with it."""
        watch = self.overfitting
        latest = getattr(pl_module, "last_evaluation", None) or {}
        step = latest.get("step")
        new = step is not None and (watch.last_step is None or step > watch.last_step)
        if new and step < trainer.global_step:
            self._record_validation(trainer, step, latest.get("loss"))
            new = False
        watch.train_step(train_loss)
        if new:
            self._record_validation(trainer, step, latest.get("loss"))

    def _record_validation(self, trainer, step: int, loss: float | None) -> None:
        watch = self.overfitting
        if watch.validation(step, loss) and not watch.warned:
            watch.warned = True
            if trainer.is_global_zero:
                warn_of_overfitting(watch.validations[-(watch.rises + 1) :])

    def _step_metrics(self, trainer, pl_module) -> dict[str, float]:
        w = self._window
        step_s = time.perf_counter() - self._step_started
        device = pl_module.device
        cuda = device.type == "cuda"
        w.set("step_seconds", step_s)
        w.set("step_seconds_max", step_s)
        w.set("wait_fraction_max", w.values["wait_seconds"] / step_s if step_s > 0 else 0.0)
        if cuda:
            w.set("peak_memory_gib", torch.cuda.max_memory_allocated(device) / 2**30)
            w.set("peak_reserved_gib", torch.cuda.max_memory_reserved(device) / 2**30)
        # The module's fault counters are per rank and restart at 0 in a resumed process: their
        # growth since the last step is what the ranks combine.
        for name in training_metrics.MODULE_COUNTERS:
            now = float(getattr(pl_module, name))
            w.set(name, now - self._counters_seen.get(name, 0.0))
            self._counters_seen[name] = now
        reduced = w.reduced(device)
        training_metrics.add_to_totals(self.totals, reduced)
        self._recent.append(reduced["lang_utterances"])
        step = training_metrics.Step(
            measures=reduced,
            total=self.totals,
            trainer=trainer,
            module=pl_module,
            lr=self._lr,
            recent_langs=training_metrics.recent_sum(self._recent),
            target_share=self._target,
        )
        metrics = training_metrics.step_metrics(step, cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        return metrics


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
    48/5000) | loss 1.2345 | lr 3.00e-04 | phase 1]``: the same unit as the checkpoint names, where a
    micro-batch counter would run GRAD_ACCUM times faster.

    On a terminal the bar updates every ``refresh_rate`` micro-batches (default 1). When stdout is a
    file or a pipe (SLURM logs, ``> train.log``) there is no bar, whose carriage returns and
    redraws garble a log: every ``refresh_rate`` micro-batches (default 100) and at the last step,
    rank 0 logs one plain line, ``step 12/32 (37%) | micro-batch 49 (...) | ... | 0.52 steps/s,
    ETA 0:00:38``. Rates and the ETA count only the steps this process trained: a resumed run's
    earlier steps took no time here.
    """

    def __init__(self, refresh_rate: int | None = None, plain: bool | None = None, **kwargs: Any):
        import sys

        self.plain = not sys.stdout.isatty() if plain is None else plain
        if refresh_rate is None:
            refresh_rate = 100 if self.plain else 1
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self._start_step = 0
        self._start_time = time.monotonic()

    @property
    def train_description(self) -> str:
        return "step"

    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step = trainer.global_step
        self._start_time = time.monotonic()
        if self.plain:
            from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

            self.train_progress_bar = Tqdm(disable=True)
            return
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        # tqdm's rate is (n - initial) / elapsed: the resumed steps are not this process's work.
        self.train_progress_bar.initial = trainer.global_step
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

    def rate_line(self, step: int, max_steps: int) -> str:
        """``0.52 steps/s, ETA 0:00:38`` from the steps this process trained (empty before one)."""
        import datetime

        done = step - self._start_step
        elapsed = time.monotonic() - self._start_time
        if done <= 0 or elapsed <= 0:
            return ""
        rate = done / elapsed
        text = f"{rate:.3g} steps/s"
        if max_steps > 0:
            eta = datetime.timedelta(seconds=round(max(0, max_steps - step) / rate))
            text += f", ETA {eta}"
        return text

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
        postfix = progress_postfix(
            progress.total.processed,
            trainer.current_epoch,
            progress.current.processed,
            int(epoch_total) if epoch_total and math.isfinite(epoch_total) else None,
            loss,
            lr,
            getattr(pl_module, "phase", None),
        )
        if self.plain:
            step, total = trainer.global_step, trainer.max_steps
            head = f"step {step}/{total} ({step / total:.0%})" if total > 0 else f"step {step}"
            rate = self.rate_line(step, total)
            _log.info("%s | %s%s", head, postfix, f" | {rate}" if rate else "")
            return
        self.train_progress_bar.set_postfix_str(postfix, refresh=False)
        self._set_n(trainer.global_step)


# CHECKPOINT_DIR holds this run's own step checkpoints when it resumes, and those of earlier runs:
# StepOnlyModelCheckpoint names files by step and never deletes what it did not write (outside
# KEEP_CHECKPOINTS), so Lightning's note that the directory is not empty is no warning here.
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


class StepOnlyModelCheckpoint(ModelCheckpoint):
    """A checkpoint every ``every_n_steps`` optimizer steps (CHECKPOINT_EVERY) as
    ``<dirpath>/step_<step:08d>.ckpt`` (dirpath: CHECKPOINT_DIR), the newest KEEP_CHECKPOINTS kept
    (0: all) and, whatever that says, the KEEP_BEST_CHECKPOINTS with the lowest validation WER
    (scored in CHECKPOINT_DIR/run.json when the checkpoint's step was validated); nothing else: no
    epoch-end, validation or metric-based saves. At the end of training, ``step_<step>.nemo`` (the
    NeMo model). At set-up, rank 0 logs a checkpoint's estimated size and warns when the file system
    cannot hold the next few.

    - Saved right after the optimizer step, so a resume starts at a gradient-accumulation boundary.
    - Preemption: when the ranks agreed on a stop signal in this optimizer step
      (``TrainingModule.stop_agreed``, see process_control.py), this step is saved whatever its number,
      training stops, ``preempted`` is set and no .nemo is exported; train.py exits with
      ``process_control.PREEMPTED_EXIT_CODE``.
    - Atomic: ``setup`` installs AtomicCheckpointIO on the strategy; global rank 0 writes a temporary
      file in the same directory and renames it when complete; Lightning's barrier in
      ``trainer.save_checkpoint`` holds every rank until then.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_steps: int | None = None,
        export_nemo_at_end: bool = True,
        keep: int | None = None,
        keep_best: int | None = None,
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
        self.keep = int(_config.KEEP_CHECKPOINTS if keep is None else keep)
        self.keep_best = int(_config.KEEP_BEST_CHECKPOINTS if keep_best is None else keep_best)
        self.export_nemo_at_end = export_nemo_at_end
        self._seen_step = 0
        self.last_save_ended = -math.inf  # perf_counter() when the last save finished
        self.last_save_seconds = 0.0
        self.preempted = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and Path(self.dirpath).is_dir():
            # What a crash mid-save left behind: hidden, never resumable, possibly gigabytes.
            for stale in Path(self.dirpath).glob(".step_*.tmp*"):
                _log.warning("removing %s, an interrupted save", stale)
                stale.unlink(missing_ok=True)
        if trainer.is_global_zero:
            self._warn_when_space_runs_short(pl_module)
        io = trainer.strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = checkpoints.AtomicCheckpointIO()
        elif not isinstance(io, checkpoints.AtomicCheckpointIO):
            _log.warning(
                "checkpoint IO %s is not TorchCheckpointIO: checkpoints are written by it, not atomically "
                "by StepOnlyModelCheckpoint",
                type(io).__name__,
            )

    def _warn_when_space_runs_short(self, pl_module) -> None:
        size = checkpoints.estimated_checkpoint_bytes(pl_module)
        room, wanted, free = checkpoints.checkpoint_room(size, Path(self.dirpath), self.keep)
        _log.info(
            "a step checkpoint takes about %.2f GiB; %s has %.1f GiB free (room for %d)",
            size / 2**30,
            self.dirpath,
            free / 2**30,
            room,
        )
        if room < wanted:
            _log.warning(
                "CHECKPOINT_DIR=%s has room for %d checkpoint(s) of about %.2f GiB (%.1f GiB free), "
                "fewer than the next %d: free space, set KEEP_CHECKPOINTS, or move CHECKPOINT_DIR",
                self.dirpath,
                room,
                size / 2**30,
                free / 2**30,
                wanted,
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
        # A stop signal at the last step changes nothing: the run ends (and exports) as planned.
        stop = getattr(pl_module, "stop_agreed", False) and step < trainer.max_steps
        if step % self.every_n_steps == 0 or stop:
            started = time.perf_counter()
            path = Path(self.dirpath) / checkpoints.checkpoint_name(step)
            self._save_checkpoint(trainer, str(path))
            self.last_save_ended = time.perf_counter()
            self.last_save_seconds = self.last_save_ended - started
            if trainer.is_global_zero:
                evaluation = getattr(pl_module, "last_evaluation", None)
                checkpoints.record_validation(step, evaluation, Path(self.dirpath))
                for old in checkpoints.prune_checkpoints(
                    self.keep, Path(self.dirpath), keep_best=self.keep_best
                ):
                    _log.info(
                        "removed %s (KEEP_CHECKPOINTS=%d, KEEP_BEST_CHECKPOINTS=%d)",
                        old.name,
                        self.keep,
                        self.keep_best,
                    )
            if stop:
                self.preempted = True
                trainer.should_stop = True
                _log.warning(
                    "rank %d: stop signal: saved %s in %.1f s; stopping (exit code %d, resume with "
                    "RESUME_FROM=last)",
                    trainer.global_rank,
                    path,
                    self.last_save_seconds,
                    process_control.PREEMPTED_EXIT_CODE,
                )

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # no epoch-end saves

    def on_validation_end(self, trainer, pl_module) -> None:
        pass  # no metric-based saves

    def on_train_end(self, trainer, pl_module) -> None:
        if self.preempted:
            return  # the run continues elsewhere; its .nemo comes at its real end
        if (
            trainer.global_step > 0
            and getattr(pl_module, "skipped_steps", 0) >= trainer.global_step
        ):
            return  # every step was skipped: nothing was learned (train.py reports it and fails)
        if self.export_nemo_at_end and trainer.is_global_zero and trainer.global_step > 0:
            path = Path(self.dirpath) / f"step_{trainer.global_step:08d}.nemo"
            record = pl_module.run_record() if hasattr(pl_module, "run_record") else None
            model_card.export_nemo(pl_module.model, path, record)
            _log.info("exported %s and its model card", path)
        trainer.strategy.barrier("nemo_export")


class ProgressWatchdog(_pl.Callback):
    """Reports a rank that makes no progress (WATCHDOG_SECONDS): ``rank_watchdog.RankWatchdog``
    started with training, told of every finished micro-batch, stopped with training."""

    def __init__(self, seconds: int | None = None):
        self.watchdog = RankWatchdog(_config.WATCHDOG_SECONDS if seconds is None else seconds)

    def on_train_start(self, trainer, pl_module) -> None:
        self.watchdog.start(trainer.global_rank, trainer.world_size, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.alive(trainer)

    def alive(self, trainer) -> None:
        """The rank made progress: a micro-batch, or a batch of a validation between two steps."""
        self.watchdog.alive(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.watchdog.stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.watchdog.stop()


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
        checkpoint["rng_states"] = all_gather_objects(checkpoints.capture_rng_state(pl_module))
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
            checkpoints.restore_rng_state(self._pending_rng, pl_module)
            self._pending_rng = None


# ---- EpochBoundarySyncCallback --------------------------------------------------------------------------


class EpochBoundarySyncCallback(_pl.Callback):
    """At every epoch start: the sampler's plan for that epoch, then a barrier, so no rank starts a
    new epoch's plan before every rank has finished the previous one.

    Lightning 2.4 calls set_epoch only on ``loader.sampler`` and ``loader.batch_sampler.sampler``,
    never on a custom batch_sampler: without this, epoch 2 would replay an exhausted plan (measured:
    the fit loop then spins forever on an empty iterator). set_epoch with the current epoch keeps the
    position, so a restored mid-epoch sampler is not rewound.

    Each epoch's plan has its own length (packing, speed factors and subsets differ), and every
    epoch trains exactly that many micro-batches. Lightning 2.4 reads len() of the loader once,
    when it first builds it, and ends every later epoch at that count twice over: the fit loop's
    ``max_batches`` and the CombinedLoader's ``limits`` (which size the data fetcher's ``done``).
    Both are set here to this epoch's plan, before the epoch's iterator is made.
    """

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        pl_module.sampler.set_epoch(trainer.current_epoch)
        planned = len(pl_module.sampler)
        loop = trainer.fit_loop
        loop.max_batches = planned
        loader = getattr(loop, "_combined_loader", None)
        if loader is None or len(loader.flattened) != 1:
            raise RuntimeError(
                "EpochBoundarySyncCallback expects the fit loop to hold the one training loader "
                f"(lightning {_pl.__version__} changed its internals): pin lightning as "
                "requirements.txt does"
            )
        loader.limits = [planned]
        trainer.strategy.barrier("epoch_boundary")


def log_base_and_final(base: dict | None, final: dict | None) -> None:
    """One line: validation WER per language of the base (step 0) and of the last validation."""
    table = evaluation.base_and_final_rates(base, final)
    if table:
        _log.info(
            "validation WER per language, base (step 0) -> step %d: %s",
            final["step"],
            ", ".join(
                f"{lang} {bw:.3f} -> {fw:.3f}"
                for lang, (bw, fw, _, _) in table.items()
                if bw is not None and fw is not None
            ),
        )


def warn_of_overfitting(window: list[training_metrics.LossAtValidation]) -> None:
    """One warning line: the validation loss rose at each validation of ``window`` after its first
    while the training loss fell (``training_metrics.overfitting_at``), the numbers, what to do."""
    first, last = window[0], window[-1]
    _log.warning(
        "step %d: overfitting: the validation loss rose at each of the last %d validations "
        "(%.4f at step %d -> %.4f) while the training loss fell (its mean between validations "
        "%.4f up to step %d -> %.4f up to step %d; OVERFITTING_WARN_VALIDATIONS=%d). The model "
        "learns its training utterances, not the language: use the checkpoint with the lowest "
        "validation WER ('best', kept by KEEP_BEST_CHECKPOINTS) rather than the last, train fewer "
        "steps (MAX_STEPS), or add data (more speakers and sources) or augmentation; "
        'docs/training.md, "Overfitting"',
        last.step,
        len(window) - 1,
        first.val_loss,
        first.step,
        last.val_loss,
        window[1].train_loss,
        window[1].step,
        last.train_loss,
        last.step,
        len(window) - 1,
    )


class PerLanguageWERCallback(_pl.Callback):
    """Validation every ``every_n_steps`` optimizer steps (EVAL_EVERY_STEPS, default CHECKPOINT_EVERY;
    0 = off): greedy WER and CER per language and the loss on VAL_MANIFEST_PATH, all of it
    (EVAL_SAMPLES_PER_LANG = 0) or ``samples_per_lang`` utterances per language.

    The utterances are split across ranks (rank r decodes every world_size-th by duration, longest and
    shortest spread evenly); hypotheses and loss sums are gathered with all_gather_object, and rank 0
    logs ``val/wer/<lang>``, ``val/cer/<lang>``, ``val/wer_sub|del|ins/<lang>``, ``val/loss`` (the
    training loss's reduction, averaged over utterances; comparable with ``train/loss``),
    ``val/lid_acc/<lang>`` (how often the hypothesis starts with the language's own tag) and the
    tables ``val/examples`` (lang, reference, hypothesis; up to ``examples_per_lang`` per language)
    and ``val/lid_confusion`` (true, guessed language, utterances;
    ``evaluation.language_confusion``). W&B keeps the best (lowest) ``val/wer/*``, ``val/cer/*`` and
    ``val/loss`` (highest ``val/lid_acc/*``) as the run's summary. The result
    goes to ``pl_module.last_evaluation`` (every checkpoint and the model card carry it); a run whose
    last step is not a multiple of ``every_n_steps`` is validated once more at its end. A step in
    which the ranks agreed to stop (``stop_agreed``) is not validated: they save it and exit. Decoding
    uses ``evaluation.decode`` (our dataset and collate, one encoder forward for text and loss) and
    tells the ProgressWatchdog after each batch that the rank is alive. ``at_start``: validate once
    more at step 0 of a fresh run (not a resume), before any update; the result is also kept as
    ``pl_module.base_evaluation``, and the end of the run logs base vs final per language.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        samples_per_lang: int | None = None,
        manifest_path: str | os.PathLike | None = None,
        max_batch_seconds: float | None = None,
        examples_per_lang: int = 3,
        with_loss: bool = True,
        at_start: bool = False,
    ):
        self.at_start = at_start
        self.every_n_steps = int(
            _config.EVAL_EVERY_STEPS if every_n_steps is None else every_n_steps
        )
        self.samples_per_lang = int(
            _config.EVAL_SAMPLES_PER_LANG if samples_per_lang is None else samples_per_lang
        )
        # None: training_step.validation_manifest() decides at train start
        self.manifest_path = Path(manifest_path) if manifest_path is not None else None
        self.max_batch_seconds = float(
            _config.MAX_BATCH_DURATION if max_batch_seconds is None else max_batch_seconds
        )
        self.examples_per_lang = examples_per_lang
        self.with_loss = with_loss
        # both decodings from one encoder forward: auto, and from each utterance's language tag
        self.language_given = _config.VAL_LANGUAGE_GIVEN == "1"
        # the base's languages, whose WER against the step-0 validation is the forgetting
        self.base_languages: tuple[str, ...] | None = None
        self.dataset = None
        self.indices = np.zeros(0, dtype=np.int64)
        self.references: dict[int, str] = {}
        self.last_results: dict[str, evaluation.ErrorCounts] = {}
        self.excluded: dict[str, dict[str, tuple[int, list[str]]]] = {}
        self.punctuated = False  # the manifest's targets keep punctuation: score it too
        self._seen_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step
        if self.every_n_steps <= 0:
            return
        from dataset import LocalShardDataset
        from training_step import ValidationError, nothing_to_validate, validation_manifest

        if self.manifest_path is None:
            self.manifest_path = validation_manifest()
            if self.manifest_path is None:
                self.every_n_steps = 0  # warned: the run goes on without validation
                return
        if not self.manifest_path.is_file():
            raise ValidationError(
                f"EVAL_EVERY_STEPS={self.every_n_steps} but VAL_MANIFEST_PATH={self.manifest_path} "
                "does not exist; build it with scripts/make_train_val.py or set EVAL_EVERY_STEPS=0"
            )
        self.dataset = LocalShardDataset(
            self.manifest_path, pl_module.model.tokenizer, progress=False
        )
        # Refused before the first step: a run without its validation curves is found out only
        # when someone looks for them, after the compute is spent.
        empty = nothing_to_validate(
            self.manifest_path, dict(self.dataset.load_summary, rows_kept=len(self.dataset))
        )
        if empty:
            what, todo = empty
            raise ValidationError(f"EVAL_EVERY_STEPS={self.every_n_steps} but {what}; {todo}")
        if self.samples_per_lang > 0:
            self.indices = evaluation.select_eval_indices(
                self.dataset.lang_codes, self.samples_per_lang, seed=_config.SEED
            )
        else:
            self.indices = np.arange(len(self.dataset))
        texts = evaluation.manifest_texts(self.dataset)
        self.references = {int(i): texts[int(i)] for i in self.indices}
        self.punctuated = manifest_style(self.manifest_path) == "punctuated"
        self.excluded = evaluation.excluded_rows(self.dataset)
        if _config.INIT_MODEL:
            import model_languages

            self.base_languages = model_languages.base_languages()
        if trainer.is_global_zero:
            if self.excluded:
                _log.warning(
                    "validation leaves out rows it cannot score, per language: %s",
                    evaluation.describe_excluded(self.excluded),
                )
            for logger in trainer.loggers:
                define_metric = getattr(getattr(logger, "experiment", None), "define_metric", None)
                if callable(define_metric):
                    for pattern in (
                        "val/wer/*",
                        "val/cer/*",
                        "val/wer_given/*",
                        "val/cer_given/*",
                        "val/loss",
                    ):
                        define_metric(pattern, summary="min")
                    define_metric("val/lid_acc/*", summary="max")
            _log.info(
                "validation every %d optimizer steps on %d utterances of %s (%s)",
                self.every_n_steps,
                len(self.indices),
                self.manifest_path,
                "all of it"
                if self.samples_per_lang <= 0
                else f"up to {self.samples_per_lang} per language",
            )
        if self.at_start and trainer.global_step == 0:
            # The base as it is, before any update: every per-language curve starts from it.
            if self.evaluate(trainer, pl_module):
                pl_module.base_evaluation = pl_module.last_evaluation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return
        self._seen_step = step
        # Ranks that agreed to stop in this step save it and exit (StepOnlyModelCheckpoint, next):
        # a validation pass would spend the little time a preempted job has left.
        if getattr(pl_module, "stop_agreed", False):
            return
        if self.every_n_steps > 0 and step % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        # The final model's card and the run's last point: a run whose last step is no multiple of
        # EVAL_EVERY_STEPS is validated once more at its end (not when a stop signal ended it: the
        # job is being preempted and its time is short).
        if (
            self.every_n_steps > 0
            and self.dataset is not None
            and trainer.global_step > 0
            and trainer.global_step % self.every_n_steps != 0
            and not getattr(pl_module, "stop_agreed", False)
        ):
            self.evaluate(trainer, pl_module)
        if trainer.is_global_zero:
            log_base_and_final(
                getattr(pl_module, "base_evaluation", None),
                getattr(pl_module, "last_evaluation", None),
            )

    def evaluate(self, trainer, pl_module) -> dict[str, evaluation.ErrorCounts]:
        """Decode this rank's share, gather, and (rank 0) log. Every rank must call it."""
        started = time.perf_counter()
        mine = evaluation.rank_share(
            self.indices, self.dataset.durations, trainer.global_rank, trainer.world_size
        )
        watchdogs = [cb for cb in getattr(trainer, "callbacks", []) if hasattr(cb, "alive")]
        names, codes = self.dataset.lang_names, self.dataset.lang_codes
        decoded = evaluation.decode(
            pl_module.model,
            self.dataset,
            mine,
            max_batch_seconds=self.max_batch_seconds,
            device=pl_module.device,
            autocast=trainer.precision_plugin.forward_context,
            with_loss=self.with_loss,
            languages=(lambda i: names[codes[i]]) if self.language_given else None,
            after_batch=lambda: [w.alive(trainer) for w in watchdogs],
            should_stop=process_control.stop_requested,
        )
        gathered: dict[int, str | None] = {}
        gathered_given: dict[int, str | None] = {}
        loss_sum, loss_utterances, stopped = 0.0, 0, False
        for part in all_gather_objects(
            (
                decoded.texts,
                decoded.loss_sum,
                decoded.loss_utterances,
                decoded.stopped,
                decoded.given_texts,
            )
        ):
            gathered.update(part[0])
            loss_sum, loss_utterances = loss_sum + part[1], loss_utterances + part[2]
            stopped = stopped or part[3]
            gathered_given.update(part[4])
        if stopped:
            # A stop signal reached a rank during the pass: what was decoded is a partial set, and
            # the job's time is short. Every rank saw the same gathered flag: they save this step
            # (StepOnlyModelCheckpoint runs next) and stop; the next validation runs at its step.
            pl_module.stop_agreed = True
            if trainer.is_global_zero:
                _log.warning(
                    "step %d: validation cut short by a stop signal after %.1f s; not logged",
                    trainer.global_step,
                    time.perf_counter() - started,
                )
            return {}
        done = [i for i in sorted(gathered) if gathered[i] is not None]
        langs = [names[codes[i]] for i in done]
        refs = [self.references[i] for i in done]
        outs = [gathered[i] for i in done]
        results = evaluation.corpus_error_rates(refs, outs, langs)
        results_given = (
            evaluation.corpus_error_rates(refs, [gathered_given[i] for i in done], langs)
            if self.language_given
            else None
        )
        confusion = evaluation.language_confusion(langs, outs)
        self.last_results = results
        loss = loss_sum / loss_utterances if loss_utterances else None
        pl_module.last_evaluation = {
            "step": int(trainer.global_step),
            "loss": loss,
            "results": {lang: dataclasses.asdict(c) for lang, c in results.items()},
            "excluded": evaluation.describe_excluded(self.excluded),
            "scoring": evaluation.NORMALIZED_SCORING,
        }
        if results_given is not None:
            pl_module.last_evaluation["results_given"] = {
                lang: dataclasses.asdict(c) for lang, c in results_given.items()
            }
        forgetting = evaluation.forgetting(
            getattr(pl_module, "base_evaluation", None),
            pl_module.last_evaluation,
            self.base_languages,
        )
        forgetting_warnings = evaluation.forgetting_warnings(trainer.global_step, forgetting)
        if trainer.is_global_zero:
            seconds = time.perf_counter() - started
            lid = evaluation.language_id_accuracy(confusion)
            metrics = training_metrics.evaluation_metrics(
                results, len(done), seconds, lid, results_given, forgetting
            )
            if loss is not None:
                metrics["val/loss"] = loss
            for line in forgetting_warnings:
                _log.warning(line)
            if self.punctuated:
                metrics.update(punctuation_metrics(punctuation_case_scores(refs, outs, langs)))
            log_to_loggers(trainer, metrics, step=trainer.global_step)
            rows = evaluation.examples_by_language(langs, refs, outs, self.examples_per_lang)
            for logger in trainer.loggers:
                if hasattr(logger, "log_table") and not already_logged(
                    trainer, trainer.global_step
                ):
                    logger.log_table(
                        "val/examples",
                        ["lang", "reference", "hypothesis"],
                        rows,
                        step=trainer.global_step,
                    )
                    logger.log_table(
                        "val/lid_confusion",
                        ["true", "guessed", "utterances"],
                        evaluation.confusion_rows(confusion),
                        step=trainer.global_step,
                    )
            _log.info(
                "step %d: validation on %d utterances in %.1f s: loss %s; greedy WER %s%s; "
                "language identified %s",
                trainer.global_step,
                len(done),
                seconds,
                "n/a" if loss is None else f"{loss:.4f}",
                ", ".join(f"{lang} {c.wer:.3f}" for lang, c in results.items()),
                ""
                if results_given is None
                else "; with the language given "
                + ", ".join(f"{lang} {c.wer:.3f}" for lang, c in results_given.items()),
                ", ".join(f"{lang} {a:.3f}" for lang, a in lid.items()),
            )
        return results
