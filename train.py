"""Two-phase Parakeet-TDT finetuning under torchrun, steered by environment variables (config.py).

Usage:
    python train.py --help                                   # this text + the variables it reads
    torchrun --nproc_per_node 8 train.py                     # one 8-GPU node
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train.py
    INIT_MODEL=/models/parakeet-tdt-0.6b-v2.nemo PRECISION=bf16-mixed torchrun --nproc_per_node 8 train.py
    # CPU smoke run of the tiny model (configs/tiny_tdt.yaml), two processes:
    ACCELERATOR=cpu PRECISION=32-true NUM_WORKERS=0 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 train.py

What a run does (this file wires it; each part lives where its name says):
- Model (asr_model.py): INIT_MODEL is a .nemo file (restore_from) or a Hugging Face name (its
  cached .nemo, else fetched once: pretrained_models.py; without network, one line naming the path
  form); empty INIT_MODEL builds MODEL_CONFIG fresh with TOKENIZER_DIR. When the
  tokenizer in TOKENIZER_DIR differs from the model's, ``change_vocabulary`` swaps decoder and joint
  and ``tdt_loss.attach_tdt_loss`` rebuilds the TDT loss NeMo replaced with a wrong-blank RNN-T loss.
  TARGET_SAMPLE_RATE and ENCODER_FRAME_SECONDS are checked against the model's own preprocessor.
  The loss runs NeMo's numba kernel on CUDA (``tdt_loss.tdt_loss`` with TDT_LOSS=torch) and
  ``tdt_loss.tdt_loss`` on CPU. On CUDA, every rank first runs its loss once on a small known problem
  against ``tdt_loss.tdt_loss``: a broken GPU install stops the job before any data is loaded, with
  the line that installs the loss.
- Data (training_step.build_dataloader): LocalShardDataset over TRAIN_MANIFEST_PATH (its training
  cache, built by scripts/build_training_cache.py or at start-up before the ranks connect), batched by
  DurationBucketBatchSampler for this rank (rank and world size from torchrun / torch.distributed).
  The first optimizer step of each epoch gets this rank's most expensive micro-batches, so an
  out-of-memory shows in minute one; their size is logged at start-up.
- Phases (callbacks.EncoderUnfreezeCallback): below UNFREEZE_STEP the encoder is frozen (no grads,
  eval mode, run without autograd; its weights and BatchNorm statistics stay bit-identical), then
  the whole model trains. LR: ``training_step.lr_at_step``.
- Faults (training_step.TrainingModule): a micro-batch whose every utterance was bad audio
  contributes a zero loss that still touches every trainable parameter (DDP's all-reduce completes,
  nothing is learned, no fake utterance). A non-finite loss on any rank, a non-finite gradient norm,
  or an optimizer step with no utterance on any rank skips that optimizer step on every rank (all
  ranks decide from the same all-reduced flags): no parameter, optimizer moment or BatchNorm
  statistic changes, and ``skipped_steps`` counts it. The global step and the LR schedule advance.
- DDP (torchrun, one process per GPU): find_unused_parameters=True in phase 1 (the encoder is frozen
  after the wrap, see callbacks.EncoderUnfreezeCallback), False in phase 2 (a new wrapper);
  BatchNorm statistics are averaged over ranks once per optimizer step instead of DDP's per-forward
  broadcast, so every parameter AND buffer is identical on all ranks at every step boundary;
  NeMo's per-forward all-reduce of the batch length in the Conformer encoder is switched off, so no
  collective depends on a rank running a forward.

Watching and keeping a run (callbacks.py):
- Metrics per optimizer step to W&B (offline under WANDB_LOG_DIR/<run> without WANDB_API_KEY; upload
  later with ``wandb sync``) and to WANDB_LOG_DIR/<run>/metrics.jsonl (training_metrics.py lists
  them); the progress bar counts optimizer steps of MAX_STEPS, micro-batches second.
- A checkpoint every CHECKPOINT_EVERY optimizer steps: CHECKPOINT_DIR/step_<step>.ckpt, written
  atomically, all kept; CHECKPOINT_DIR/step_<step>.nemo at the end (scripts/export_nemo.py on demand).
- RESUME_FROM=<path> or RESUME_FROM=last continues at exactly the next micro-batch (sampler
  position, optimizer, LR, phase, step, RNG states); EVAL_EVERY_STEPS > 0 logs per-language WER.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import warnings
from pathlib import Path

import process_control

# Before config.py is imported: a bad knob is found right then, and must read as one line too.
process_control.exit_on_user_errors()
# Before torch touches CUDA: batch shapes vary with every duration bucket and token count, and the
# caching allocator's fixed-size segments fragment under that (memory reserved but unusable, an
# out-of-memory with gigabytes free). Expandable segments grow in place instead. A value the user
# set wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import tqdm  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

import asr_model  # noqa: E402
import base_adapters  # noqa: E402
import base_anchor  # noqa: E402
import callbacks  # noqa: E402
import checkpoints  # noqa: E402
import config  # noqa: E402
import model_languages  # noqa: E402
import run_logging  # noqa: E402
import step_speed  # noqa: E402
import transcript_style  # noqa: E402
import vocabulary  # noqa: E402
from dataset import augmentation_in_force  # noqa: E402
from sampler import BatchingSettings  # noqa: E402
from training_step import (  # noqa: E402
    TrainingModule,
    build_dataset,
    check_audio_sample,
    describe_new_piece_schedule,
    prepare_training_caches,
    schedule_warnings,
    startup_refusals,
    steps_left,
    train_manifest_path,
)

log = logging.getLogger("train")


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


def single_process_hint(env: dict) -> str | None:
    """The warning for ``python train.py`` (no torchrun) where several GPUs are visible: the run
    would use one of them. None under torchrun, on CPU, or with one GPU."""
    if "TORCHELASTIC_RUN_ID" in os.environ or env["world_size"] > 1 or config.ACCELERATOR == "cpu":
        return None
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return None
    return (
        f"{gpus} GPUs are visible but train.py runs as one process on one of them: start it with "
        f"torchrun --nproc_per_node {gpus} train.py to use them all (CUDA_VISIBLE_DEVICES=0 to "
        "use one on purpose)"
    )


def build_callbacks() -> list[pl.Callback]:
    """The trainer's callbacks (callbacks.py), each given the knobs it uses. TrainingMetricsCallback
    comes after PerLanguageWERCallback so an evaluation's time counts in its step's time, not as
    data wait; Lightning moves the checkpoint callback to the end of the list itself."""
    return [
        callbacks.EncoderUnfreezeCallback(unfreeze_step=config.UNFREEZE_STEP),
        callbacks.EpochBoundarySyncCallback(),
        callbacks.ExactResumeCallback(),
        callbacks.StepOnlyModelCheckpoint(
            dirpath=config.CHECKPOINT_DIR,
            every_n_steps=config.CHECKPOINT_EVERY,
            keep=config.KEEP_CHECKPOINTS,
            keep_best=config.KEEP_BEST_CHECKPOINTS,
        ),
        callbacks.ProgressWatchdog(seconds=config.WATCHDOG_SECONDS),
        callbacks.PerLanguageWERCallback(
            every_n_steps=config.EVAL_EVERY_STEPS,
            samples_per_lang=config.EVAL_SAMPLES_PER_LANG,
            max_batch_seconds=config.MAX_BATCH_DURATION,
            at_start=config.EVAL_BASE == "1"
            or (config.EVAL_BASE == "auto" and bool(config.INIT_MODEL)),
        ),
        callbacks.TrainingMetricsCallback(),
        callbacks.OptimizerStepProgressBar(),
    ]


def runs_on_cpu() -> bool:
    """Whether this run's steps run on the CPU (ACCELERATOR=cpu, or auto without a CUDA device)."""
    return config.ACCELERATOR == "cpu" or (
        config.ACCELERATOR == "auto" and not torch.cuda.is_available()
    )


def build_trainer(
    callback_list: list[pl.Callback], env: dict, ckpt_path: str | None = None
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
        # DDP warns on every rank when a backward finds no unused parameter, which phase 2 is until
        # stop_searching_unused_parameters re-wraps DDP: expected with this design; the search's
        # cost was measured (docs/benchmarks.md, "find_unused_parameters").
        warnings.filterwarnings(
            "ignore", message=r"find_unused_parameters=True was specified in DDP constructor"
        )
        strategy = DDPStrategy(
            find_unused_parameters=True,
            gradient_as_bucket_view=True,
            broadcast_buffers=False,
            timeout=datetime.timedelta(minutes=config.COLLECTIVE_TIMEOUT_MINUTES),
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
        logger=run_logging.build_loggers(resume_path=ckpt_path),
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
    log.info("%s; encoder frozen for steps < %d", asr_model.describe(model), config.UNFREEZE_STEP)
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


def training_languages(dataset) -> list[str]:
    """The languages ``dataset`` (a training ``LocalShardDataset``) holds utterances of."""
    import numpy as np

    counts = np.bincount(dataset.lang_codes, minlength=len(dataset.lang_names))
    return sorted(name for name, c in zip(dataset.lang_names, counts.tolist()) if c > 0)


GRID_SECTION = "docs/training.md, 'The grid'"
KEEP_SECTION = "docs/training.md, 'Keeping the base: the levers on the grid'"
# The levers' measured end (KEEP_SECTION, seeds 7, 1234 and 42): the setting that held the base's
# languages near the base in every cell of the grid, and what it cost the new languages.
KEEPING_SETTING = "DISTILL_WEIGHT=10 L2SP_WEIGHT=100 AUTO_LANGUAGE=score"
KEEPING_MEASURED = (
    f"on the grid {KEEPING_SETTING} held the base's languages within 0.054 WER of the base in "
    f"every cell, auto and given (over 0.05 in one cell on one of three seeds), while the new "
    f"languages' CER auto fell up to 0.21 behind a fresh tokenizer's (with the language given "
    f"still ahead of it; seeds 7, 1234 and 42, {KEEP_SECTION})"
)


ADAPTERS_SECTION = "docs/training.md, 'The frozen base with adapters: BASE_ADAPTER_DIM'"
# The frontier's exact end (ADAPTERS_SECTION, seeds 7, 1234 and 42): the base's languages decoded
# by the base itself, auto too, and what the new languages gave for it.
ADAPTERS_SETTING = "BASE_ADAPTER_DIM=32 AUTO_LANGUAGE=score"
ADAPTERS_MEASURED = (
    f"on the grid {ADAPTERS_SETTING} kept the base's languages at the base's WER at every "
    f"validation, auto and given, in every cell, while the new languages' CER auto fell up to "
    f"0.24 behind a fresh tokenizer's and given up to 0.07 (seeds 7, 1234 and 42, "
    f"{ADAPTERS_SECTION})"
)


def finetuning_trade_off(
    vocabulary_change: dict | None,
    base_languages: list[str] | tuple[str, ...] | None,
    data_languages: list[str],
    encoder_lr_scale: float,
    forgetting_warn_points: float,
    anchored: dict[str, float] | None = None,
    adapter_dim: int = 0,
    auto_language: str = "first",
) -> str | None:
    """Which side a finetune takes between learning its new languages fast and keeping its base's,
    as one sentence, or None when it has no such choice (no new language, or, with the base's
    languages unknown, no new piece).

    ``vocabulary_change``: ``model.vocabulary_change`` of a finetune (None: the base's vocabulary
    kept). A run starts as the base when its decoder is carried and no base piece is dropped; the
    finetuning grid measured what follows from each side (docs/training.md). ``anchored``: the
    levers on that keep the run near its base (``base_anchor.levers`` above 0: name -> value);
    ``adapter_dim``: BASE_ADAPTER_DIM of a frozen-base run (``base_adapters``), decoding auto
    by ``auto_language`` (AUTO_LANGUAGE)."""
    base = list(base_languages or ())
    change = vocabulary_change or {}
    learns_new = bool(set(data_languages) - set(base)) if base else change.get("new", 0) > 0
    if not learns_new:
        return None
    kept = ", ".join(base) if base else "BASE_LANGUAGES unknown"
    if change.get("decoder_init") == "fresh" or change.get("dropped", 0) > 0:
        lost = (
            "its decoder and joint start fresh (DECODER_INIT=fresh)"
            if change.get("decoder_init") == "fresh"
            else f"{change['dropped']} of the base's pieces are dropped"
        )
        return (
            f"a new vocabulary over the base's languages ({kept}): {lost}, so step 0 does not "
            f"decode as the base and they are relearned with the new ones; TOKENIZER_MODE=extend "
            f"with DECODER_INIT=carry starts from the base ({GRID_SECTION})"
        )
    if adapter_dim > 0:
        auto = (
            "given and auto (AUTO_LANGUAGE=score: the base scores its own languages)"
            if auto_language == "score"
            else "given; auto, a base language's utterance the adapted model takes for a new "
            "language is written by the adapted model (AUTO_LANGUAGE=score lets the base speak "
            "for its languages)"
        )
        return (
            f"the base's languages ({kept}) kept exactly over the new languages' speed: "
            f"BASE_ADAPTER_DIM={adapter_dim} holds every weight of the base, and its languages "
            f"decode with the adapters off, as the base, {auto}; the new languages learn in the "
            f"adapters and the new pieces' rows alone, more slowly ({ADAPTERS_MEASURED})"
        )
    if anchored:
        levers = " ".join(f"{k}={v:g}" for k, v in anchored.items())
        return (
            f"the base's languages ({kept}) over the new languages' speed: step 0 decodes as the "
            f"base and {levers} keep the finetune near it, so the base's languages drift less "
            f"and the new ones learn more slowly than without ({KEEPING_MEASURED})"
        )
    if encoder_lr_scale < 1:
        return (
            f"the base's languages ({kept}) over the new languages' speed: step 0 decodes as the "
            f"base and the encoder moves at ENCODER_LR_SCALE={encoder_lr_scale:g} x the LR, so "
            f"the base's languages drift less and the new ones learn more slowly than at 1 "
            f"(docs/training.md, 'Measured: the finetuning ablation')"
        )
    warn = (
        f"past FORGETTING_WARN_POINTS={forgetting_warn_points:g}"
        if forgetting_warn_points > 0
        else "by several WER points"
    )
    return (
        f"the new languages' speed over keeping the base's ({kept}): step 0 decodes as the base "
        f"and the new languages learn at least as fast as with a fresh tokenizer, but the base's "
        f"languages may drift {warn} from step 0, auto decoding most ({GRID_SECTION}); "
        f"val/forgetting/<lang> and val/forgetting_given/<lang> show it; decode them with the "
        f"language given, or take the other side with {ADAPTERS_SETTING} (the frontier's exact "
        f"end: {ADAPTERS_MEASURED}), {KEEPING_SETTING} ({KEEPING_MEASURED}), "
        f"ENCODER_LR_SCALE=0.3 or a larger BASE_LANGUAGE_SHARE"
    )


def log_finetuning_levers(
    model, settings: BatchingSettings, data_languages: list[str], trade_off: str | None = None
) -> None:
    """What this run does to keep its base's languages and to speed up the new ones (one line), a
    warning when the replay floor has nothing to keep (the base's languages are not in
    ``data_languages``, the training data's), and the run's ``trade_off``
    (``finetuning_trade_off``), when it has one."""
    rows = asr_model.new_piece_parameters(model)
    parts = []
    if rows:
        parts.append(f"the {len(rows[0][1])} new pieces' rows step {describe_new_piece_schedule()}")
    if config.ENCODER_LR_SCALE != 1:
        parts.append(f"the encoder's LR is ENCODER_LR_SCALE={config.ENCODER_LR_SCALE:g} x the LR")
    data = set(data_languages)
    kept = [lang for lang in settings.base_languages or () if lang in data]
    source = "BASE_LANGUAGES" if config.BASE_LANGUAGES else "INIT_MODEL's record"
    if settings.base_share > 0 and kept and data - set(kept):
        parts.append(
            f"the base's languages ({', '.join(kept)}, from {source}) keep at least "
            f"BASE_LANGUAGE_SHARE={settings.base_share:g} of the mix"
        )
    elif settings.base_share > 0 and settings.base_languages and not kept:
        log.warning(
            "BASE_LANGUAGE_SHARE=%g keeps nothing: the base's languages (%s, from %s) are not in "
            "the training data (%s); name them in BASE_LANGUAGES as the data spells them, or add "
            "data of them to keep them",
            settings.base_share,
            ", ".join(settings.base_languages),
            source,
            ", ".join(sorted(data)),
        )
    if parts:
        log.info("finetuning: %s", "; ".join(parts))
    if trade_off:
        log.info("finetuning trade-off: %s", trade_off)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=config.help_epilog("train"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser.parse_args(argv)


def check_inputs() -> str | None:
    """``training_step.startup_refusals`` (everything the run needs that can be checked before a
    model is built or downloaded, minutes at full size), then, once every check passed, the resume
    plan applied: a refused job leaves the directory as it found it. Returns the checkpoint to
    resume (None: fresh); a problem is a UserError naming the variable."""
    plan = startup_refusals()
    checkpoints.apply_resume_plan(plan)
    return plan.path


@record  # any other failure: its traceback becomes the root cause of torchrun's summary
def main(argv: list[str] | None = None) -> int:
    """Train; 0 when done, PREEMPTED_EXIT_CODE after a stop signal's save, USER_ERROR_EXIT_CODE (one
    line on rank 0) for an error the user can fix, 1 when every step was skipped."""
    try:
        return run(argv)
    except process_control.USER_ERRORS as exc:
        return process_control.report_user_error(exc)


def run(argv: list[str] | None = None) -> int:
    parse_args(argv)
    env = distributed_env()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {env['rank']}] %(levelname)s %(name)s: %(message)s",
    )
    if "TORCHELASTIC_RUN_ID" in os.environ:
        process_control.die_with_parent()  # torchrun's agent: no rank outlives its launcher
    process_control.install_stop_handlers()
    process_control.install_stack_dump()
    # A rank forks its DataLoader workers, and a lock another thread holds at that moment stays
    # held in the worker for good. tqdm's monitor thread, started by the first bar (even a disabled
    # one: a training cache's build, a manifest's hash), would be the rank's one such thread then.
    tqdm.tqdm.monitor_interval = 0
    ckpt_path = check_inputs()
    if env["rank"] == 0:
        hint = single_process_hint(env)
        for line in ([hint] if hint else []) + schedule_warnings():
            log.warning(line)
    if steps_left(ckpt_path) == 0:
        if env["rank"] == 0:
            log.info(
                "nothing to train: %s is at optimizer step %d = MAX_STEPS, the run is complete "
                "(raise MAX_STEPS to train on; scripts/export_nemo.py exports any checkpoint)",
                ckpt_path,
                config.MAX_STEPS,
            )
        return 0
    process_speed_changes = step_speed.apply_to_process(
        step_speed.SpeedSettings.from_config(), on_cpu=runs_on_cpu()
    )
    # Same seed everywhere for the model's initial weights (DDP also broadcasts rank 0's).
    pl.seed_everything(config.SEED, workers=True)
    model = asr_model.build_model()
    # Taken before any update: the base as this run received it, on a resume too (the
    # checkpoint's weights are loaded into the model later, by fit).
    base = base_anchor.frozen_base(model)
    # Per-rank randomness from here on (dropout, SpecAugment masks, dither), still a function of SEED.
    torch.manual_seed(config.SEED + env["rank"])
    # The sampler's knobs, read once here and handed to the module that builds the DataLoader.
    module = TrainingModule(model, batching=BatchingSettings.from_config(), base=base)
    # Before the process group exists, so a cache build never runs into a collective timeout.
    prepare_training_caches(model.tokenizer)
    module.dataset = build_dataset(model.tokenizer)
    data_languages = training_languages(module.dataset)
    if getattr(model, "base_model", None) is not None:
        module.finetuning_trade_off = finetuning_trade_off(
            model.vocabulary_change,
            module.batching.base_languages,
            data_languages,
            config.ENCODER_LR_SCALE,
            config.FORGETTING_WARN_POINTS,
            {k: v for k, v in base_anchor.levers().items() if v > 0},
            config.BASE_ADAPTER_DIM,
            config.AUTO_LANGUAGE,
        )
    model_languages.check_base_languages(
        module.batching.base_languages, data_languages, module.batching.base_share
    )
    # Every checkpoint and .nemo of this run then tells a finetune of it what it was trained on.
    model_languages.record_trained_languages(
        model, model_languages.trained_languages(module.batching.base_languages, data_languages)
    )
    # ...and the scripts each language is written in (decoding with a language given keeps to them).
    vocabulary.record_language_scripts(model, Path(config.TOKENIZER_DIR))
    # ...and in which style it writes (transcript_style: auto for a finetune of it follows it).
    transcript_style.record_style(model, transcript_style.manifest_style(train_manifest_path()))
    # Missing audio (a wrong DATA_DIR on a node, extraction never run) stops the job here, not
    # after hours of skipped steps.
    check_audio_sample(
        module.dataset,
        samples=config.AUDIO_CHECK_SAMPLES,
        rank=env["rank"],
        manifest=config.TRAIN_MANIFEST_PATH,
    )
    callback_list = build_callbacks()
    trainer = build_trainer(callback_list, env, ckpt_path)
    log_startup(trainer, env, model)
    if env["rank"] == 0:
        log.info(
            "step speed: %s",
            step_speed.describe(module.speed, module.speed_changes + process_speed_changes),
        )
        log.info(
            "augmentation: %s",
            augmentation_in_force(
                module.dataset.noise, config.SPEED_PERTURB, module.dataset.noise_recordings
            ),
        )
        log_finetuning_levers(model, module.batching, data_languages, module.finetuning_trade_off)
        anchored = base_anchor.describe(base_anchor.levers(), base)
        held = base_adapters.record_of(model)
        if held is not None:
            anchored = base_adapters.describe(held, config.BASE_ADAPTER_DIM)
        if anchored:
            log.info("keeping the base: %s", anchored)
    trainer.fit(module, ckpt_path=ckpt_path)
    process_control.set_training(False)
    checkpoint_callback = next(
        cb for cb in callback_list if isinstance(cb, callbacks.StepOnlyModelCheckpoint)
    )
    if checkpoint_callback.preempted:
        log.warning(
            "stopped on %s after saving optimizer step %d; exit code %d (RESUME_FROM=last continues)",
            process_control.stop_requested() or "a stop signal on another rank",
            trainer.global_step,
            process_control.PREEMPTED_EXIT_CODE,
        )
        return process_control.PREEMPTED_EXIT_CODE
    if trainer.global_step > 0 and module.skipped_steps >= trainer.global_step:
        log.error(
            "every one of the %d optimizer steps was skipped: the model learned nothing and no .nemo "
            "was exported",
            trainer.global_step,
        )
        return 1
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
