"""Every knob of the pipeline, each overridable by an environment variable of the same name.

Usage:
    python config.py               # print every effective value and where it came from
    python config.py --markdown    # the table of environment variables of docs/knobs.md
    python config.py --update-docs     # rewrite that table in docs/knobs.md between its markers
    TEMPERATURE=0.5 python config.py

Other modules read values at call time as ``config.NAME`` (never ``from config import NAME``), so a
test can monkeypatch one value. Derived paths (manifests, tokenizer, checkpoints, W&B logs) follow
``DATA_DIR`` unless they are set themselves.

A bad value fails at import with one ``ConfigError`` that names each bad variable, the value given
and what is expected, for example ``GRAD_ACCUM='four': expected an integer``; any entry point that
imports this module reports it as one line, ``error: ...``, and exits with code 2. So does a variable
that looks like a knob but is none (``unknown_variables``): ``MAX_STEP is not a setting; did you mean
MAX_STEPS?``, since a silently ignored typo starts a run with the wrong settings.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import knob_values
from env_variables import unknown_variables
from file_names import is_utf8, printable
from process_control import UserError, exit_on_user_errors

REPO_DIR = Path(__file__).resolve().parent

PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")
WANDB_MODES = ("online", "offline", "disabled")
LANG_WEIGHTINGS = ("count", "hours")


class ConfigError(UserError, ValueError):
    """One or more environment variables hold a value the pipeline cannot use."""


# The pipeline's steps, in the order they run; each knob names the steps that read it.
STEPS = (
    "demo_corpus",
    "extract_audio",
    "build_manifest",
    "make_train_val",
    "train_tokenizer",
    "build_cache",
    "train",
    "evaluate",
    "export_nemo",
    "transcribe",
    "manifest_report",
    "preflight",
)
# A step that reads exactly what another reads: scripts/preflight.py checks a node for train.py.
STEP_READS_AS = {"preflight": "train"}


@dataclass(frozen=True)
class Knob:
    name: str
    value: Any
    source: str  # "default", "derived" or "env"
    help: str
    steps: tuple[str, ...] = ()  # the pipeline steps (STEPS) that read it
    shown: str | None = (
        None  # the default as docs/knobs.md's table shows it, when it is machine-made
    )


# --- parsers: each turns the raw string into a typed value or raises ValueError("expected ...") ---


# --- checks on a typed value: return None when fine, else what is expected ---


def default_workers(env: Mapping[str, str]) -> int:
    """DataLoader workers per rank when NUM_WORKERS is unset: this process's usable cores divided
    among the node's ranks (LOCAL_WORLD_SIZE, which torchrun sets), one of them left to the rank,
    at least 1 and at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        local_ranks = max(1, int(env.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        local_ranks = 1
    return max(1, min(4, cores // local_ranks - 1))


def read_config(env: Mapping[str, str]) -> dict[str, Knob]:
    """Resolve every knob from ``env`` (normally ``os.environ``); raise ConfigError listing all bad values."""
    knobs: dict[str, Knob] = {}
    errors: list[str] = []

    def knob(
        name: str,
        default: Any,
        parse: Callable[[str], Any],
        help: str,
        check: Callable[[Any], str | None] | None = None,
        derived: bool = False,
        *,
        steps: tuple[str, ...],
        shown: str | None = None,
    ) -> Any:
        unknown = set(steps) - set(STEPS)
        assert not unknown, f"knob {name}: unknown steps {sorted(unknown)}"
        raw = env.get(name)
        if raw is None or (
            raw.strip() == ""
            and parse is not knob_values.text
            and parse is not knob_values.languages
        ):
            value, source = default, ("derived" if derived else "default")
        else:
            try:
                value = parse(raw)
            except ValueError as exc:
                # repr would show a byte that is not UTF-8 as a surrogate (\udcNN), not as itself
                shown = repr(raw) if is_utf8(raw) else f"'{printable(raw)}'"
                errors.append(f"{name}={shown}: {exc}")
                value, source = default, "env"
            else:
                source = "env"
                problem = check(value) if check else None
                if problem:
                    errors.append(f"{name}={raw!r}: {problem}")
        knobs[name] = Knob(name, value, source, help, tuple(steps), shown)
        return value

    # Paths
    data_dir = knob(
        "DATA_DIR",
        REPO_DIR / "data",
        knob_values.path,
        "Root of the data tree; the paths below follow it unless set",
        steps=STEPS,
    )
    knob(
        "SHARDS_DIR",
        data_dir / "shards",
        knob_values.path,
        "Input shards: <source>/<lang>/<shard>/{metadata,audio_index}.parquet + audio.tar",
        derived=True,
        steps=("extract_audio", "build_manifest", "demo_corpus"),
    )
    knob(
        "DATA_SOURCES",
        (),
        knob_values.sources,
        "Sources build_manifest imports, separated by ';': nemo:train.json, hf:parquet_dir, "
        "kaldi:data_dir, cv:common_voice_language_dir, shards:DIR, each with :option=value,... "
        "(see docs/bring_your_own_data.md); "
        "empty = the shards under SHARDS_DIR",
        steps=("build_manifest",),
    )
    knob(
        "IMPORTED_AUDIO_DIR",
        data_dir / "imported_audio",
        knob_values.path,
        "Where build_manifest writes imported audio as FLAC (tar members, parquet bytes, Kaldi "
        "segments)",
        derived=True,
        steps=("build_manifest",),
    )
    knob(
        "MASTER_MANIFEST_PATH",
        data_dir / "master_manifest.parquet",
        knob_values.path,
        "build_manifest.py output",
        derived=True,
        steps=("build_manifest", "make_train_val"),
    )
    knob(
        "TRAIN_MANIFEST_PATH",
        data_dir / "train_manifest_v2.parquet",
        knob_values.path,
        "make_train_val.py output read by train.py",
        derived=True,
        steps=("make_train_val", "train_tokenizer", "build_cache", "train", "manifest_report"),
    )
    knob(
        "VAL_MANIFEST_PATH",
        data_dir / "val_manifest_v2.parquet",
        knob_values.path,
        "make_train_val.py output read by evaluation",
        derived=True,
        steps=("make_train_val", "build_cache", "train", "evaluate"),
    )
    knob(
        "TEST_MANIFEST_PATH",
        data_dir / "test_manifest_v2.parquet",
        knob_values.path,
        "make_train_val.py output: the source's own test split, never trained on "
        "(scripts/evaluate.py MODEL --manifest it)",
        derived=True,
        steps=("make_train_val",),
    )
    knob(
        "TOKENIZER_DIR",
        data_dir / "tokenizer",
        knob_values.path,
        "SentencePiece tokenizer directory (train_tokenizer.py output)",
        derived=True,
        steps=("train_tokenizer", "build_cache", "train", "evaluate", "export_nemo", "transcribe"),
    )
    knob(
        "CHECKPOINT_DIR",
        data_dir / "checkpoints",
        knob_values.path,
        "Step checkpoints and the final .nemo",
        derived=True,
        steps=("train", "evaluate", "export_nemo", "transcribe"),
    )
    knob(
        "WANDB_LOG_DIR",
        data_dir / "wandb_logs",
        knob_values.path,
        "W&B run directory (offline runs live here) and the local metrics JSONL",
        derived=True,
        steps=("train",),
    )

    # Weights & Biases
    knob(
        "WANDB_PROJECT",
        "parakeet-tdt-finetune",
        knob_values.text,
        "W&B project name",
        steps=("train",),
    )
    knob(
        "WANDB_MODE",
        "",
        knob_values.choice("", *WANDB_MODES),
        "online, offline or disabled; empty = online with WANDB_API_KEY, else offline",
        steps=("train",),
    )
    knob(
        "WANDB_RUN_NAME", "", knob_values.text, "W&B run name; empty = generated", steps=("train",)
    )

    # Model
    knob(
        "INIT_MODEL",
        "",
        knob_values.text,
        "A .nemo path or a pretrained name (e.g. nvidia/parakeet-tdt-0.6b-v2); empty = fresh model from MODEL_CONFIG",
        steps=("train_tokenizer", "train", "evaluate", "export_nemo", "transcribe"),
    )
    knob(
        "MODEL_CONFIG",
        REPO_DIR / "configs" / "tiny_tdt.yaml",
        knob_values.path,
        "YAML of a fresh model, used when INIT_MODEL is empty",
        steps=("train", "evaluate", "export_nemo", "transcribe"),
    )
    knob(
        "RESUME_FROM",
        "",
        knob_values.text,
        "A checkpoint path, or 'last' for the newest in CHECKPOINT_DIR; empty = start fresh",
        steps=("train",),
    )
    knob(
        "RESUME_CHANGES",
        (),
        knob_values.run_defining_settings,
        "Run-defining settings a resume may change from its checkpoint's (comma-separated, of "
        + ", ".join(knob_values.RUN_DEFINING_SETTINGS)
        + "); any other change is refused, so a wrong CHECKPOINT_DIR cannot continue another run",
        steps=("train",),
    )
    knob(
        "VOCAB_SIZE",
        12000,
        knob_values.integer,
        "SentencePiece vocabulary size for train_tokenizer.py",
        knob_values.positive,
        steps=("train_tokenizer",),
    )
    knob(
        "TOKENIZER_MODE",
        "auto",
        knob_values.choice("auto", "new", "extend", "tags"),
        "train_tokenizer.py: new = learned from the manifest; extend = the base model's (INIT_MODEL) "
        "with pieces for what it does not cover and the tags appended, every base piece keeping its "
        "id; tags = the base's plus the tags only; auto = extend when INIT_MODEL is set, else new",
        steps=("train_tokenizer",),
    )
    knob(
        "DECODER_INIT",
        "carry",
        knob_values.choice("carry", "fresh"),
        "When TOKENIZER_DIR's vocabulary differs from the base model's: carry = keep the base's "
        "decoder and joint (and a hybrid's CTC decoder), with the rows of pieces both vocabularies "
        "share, blank and durations moved to their new ids and new pieces started below every base "
        "piece (a base without SentencePiece pieces is refused); fresh = NeMo's change_vocabulary "
        "(a new decoder and joint)",
        steps=("train",),
    )
    knob(
        "NEW_PIECE_BIAS",
        "equal",
        knob_values.choice("equal", "frequency"),
        "DECODER_INIT=carry: where the output bias of a piece the base lacks starts, below the mean "
        "base piece: equal = log(1/N) for N new pieces; frequency = log of its share of the new "
        "pieces in the tokenizer's sampled text (TOKENIZER_DIR/piece_counts.json)",
        steps=("train",),
    )
    knob(
        "TDT_LOSS",
        "numba",
        knob_values.choice("numba", "torch"),
        "TDT loss on CUDA: numba = NeMo's kernel (requirements-gpu.txt), torch = tdt_loss.py "
        "(no numba needed, slower); CPU always runs tdt_loss.py",
        steps=("train", "evaluate"),
    )
    knob(
        "ENCODER_FRAME_SECONDS",
        0.08,
        knob_values.number,
        "Seconds per encoder frame (10 ms hop x 8x subsampling); utterances with more tokens than frames are dropped",
        knob_values.positive,
        steps=("build_cache", "train", "evaluate"),
    )

    # Data
    knob(
        "LANGUAGES",
        (),
        knob_values.languages,
        "Comma-separated language codes to keep (e.g. 'hi,ta,en'); empty = all",
        steps=("build_manifest", "make_train_val"),
    )
    knob(
        "TARGET_SAMPLE_RATE",
        16000,
        knob_values.integer,
        "Audio is resampled to this rate (Hz)",
        knob_values.positive,
        steps=("train", "evaluate", "transcribe"),
    )
    knob(
        "MIN_DURATION",
        0.5,
        knob_values.number,
        "Shortest utterance kept, seconds",
        knob_values.non_negative,
        steps=("build_manifest",),
    )
    knob(
        "MAX_DURATION",
        20.0,
        knob_values.number,
        "Longest utterance kept, seconds",
        knob_values.positive,
        steps=("build_manifest", "manifest_report", "demo_corpus"),
    )
    knob(
        "MIN_QUALITY",
        0.0,
        knob_values.number,
        "Lowest tx_quality_score kept",
        steps=("build_manifest",),
    )
    knob(
        "TRANSCRIPT_STYLE",
        "auto",
        knob_values.choice("auto", "plain", "punctuated"),
        "How build_manifest.py writes the training targets: plain = punctuation and symbols removed "
        "(the danda too), case as written; punctuated = the sentence punctuation . , ? ! ; : and "
        "the danda and double danda kept, attached to the word before, and case as written; both "
        "remove tags, quotes and other symbols and normalize spaces and Unicode. auto = punctuated "
        "when INIT_MODEL writes punctuation (its recorded style, else its tokenizer has pieces for "
        ". , or ?), else plain. Recorded in the manifest; train.py refuses a manifest of another "
        "style (docs/training.md)",
        steps=("build_manifest", "train"),
    )
    knob(
        "MAX_TOKEN_LEN",
        512,
        knob_values.integer,
        "Token sequences are truncated to this length",
        knob_values.positive,
        steps=("build_cache", "train", "evaluate"),
    )
    knob(
        "AUDIO_DURATION_TOLERANCE",
        0.25,
        knob_values.number,
        "Decoded audio whose length differs from the manifest by more (seconds) is bad audio",
        knob_values.non_negative,
        steps=("train", "evaluate", "transcribe"),
    )
    knob(
        "VAL_PER_LANG",
        200,
        knob_values.integer,
        "Validation utterances per language (make_train_val.py)",
        knob_values.non_negative,
        steps=("make_train_val",),
    )
    knob(
        "VAL_MAX_FRACTION",
        0.5,
        knob_values.number,
        "At most this share of a language's rows goes to validation (make_train_val.py)",
        lambda v: None if 0 <= v <= 1 else "expected a fraction between 0 and 1",
        steps=("make_train_val",),
    )
    knob(
        "VAL_WARN_FRACTION",
        1 / 3,
        knob_values.number,
        "A split that puts more than this share of a language's rows into validation warns, "
        "naming the flag that keeps more for training (make_train_val.py)",
        lambda v: None if 0 <= v <= 1 else "expected a fraction between 0 and 1",
        steps=("make_train_val",),
        shown="1/3",
    )
    knob(
        "SCRIPT_VOTE_THRESHOLD",
        0.9,
        knob_values.number,
        "Share of a transcript's letters in one script for that script to correct its language tag (make_train_val.py)",
        lambda v: None if 0.5 < v <= 1 else "expected a fraction above 0.5 and at most 1",
        steps=("build_manifest", "make_train_val"),
    )

    # Sampler
    knob(
        "BUCKET_BOUNDARIES",
        (3.0, 5.0, 8.0, 12.0, 16.0),
        knob_values.boundaries,
        "Duration bucket edges in seconds, or 'auto:K' for K quantile buckets",
        steps=("train", "manifest_report"),
    )
    knob(
        "MAX_BATCH_DURATION",
        90.0,
        knob_values.number,
        "Seconds of raw audio per micro-batch (per GPU)",
        knob_values.positive,
        steps=("train", "manifest_report"),
    )
    knob(
        "TEMPERATURE",
        0.3,
        knob_values.number,
        "Language mix: share ~ n_l^T (1 = natural, 0 = uniform)",
        lambda v: None if v >= 0 else "expected a value >= 0 (1 = natural shares, 0 = uniform)",
        steps=("train_tokenizer", "train", "manifest_report"),
    )
    knob(
        "LANG_WEIGHTING",
        "count",
        knob_values.choice(*LANG_WEIGHTINGS),
        "Temperature over utterance counts or over hours",
        steps=("train_tokenizer", "train", "manifest_report"),
    )
    knob(
        "BASE_LANGUAGE_SHARE",
        0.25,
        knob_values.number,
        "Replay: the least share of the language mix (after TEMPERATURE) that the base model's "
        "languages (BASE_LANGUAGES) get together when the data also has new ones, so finetuning "
        "keeps them; 0 = none",
        lambda v: None if 0 <= v < 1 else "expected a share in [0, 1), e.g. 0.25",
        steps=("train", "manifest_report"),
    )
    knob(
        "BASE_LANGUAGES",
        (),
        knob_values.languages,
        "The languages the base model (INIT_MODEL) was trained on, which BASE_LANGUAGE_SHARE keeps "
        "(comma-separated); empty = those INIT_MODEL records (a .nemo or step checkpoint this "
        "project trained); a base from elsewhere records none and needs them set while "
        "BASE_LANGUAGE_SHARE > 0 and the data has two or more languages",
        steps=("train", "manifest_report", "export_nemo"),
    )
    knob(
        "EPOCH_SIZE",
        0,
        knob_values.integer,
        "Utterances per sampler epoch; 0 = the number of utterances",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "BATCH_COST_QUADRATIC",
        0.0,
        knob_values.number,
        "Quadratic term of the batch cost model (attention), per second^2",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "MAX_BATCH_JOINT_CELLS",
        0.0,
        knob_values.number,
        "Most transducer-joint cells (utterances x encoder frames x (tokens + 1), padded) in a "
        "micro-batch; a batch over it is cut. 0 = those of MAX_BATCH_DURATION seconds of copies of "
        "the manifest's longest utterance at its p99.9 tokens per second; below 0 = no cap",
        steps=("train",),
    )
    knob(
        "BATCH_COST_JOINT",
        0.001,
        knob_values.number,
        "Seconds of audio one joint cell costs in the batch cost model (ordering and rank balance); "
        "0.001 for parakeet-tdt-0.6b at 12k pieces (2 x 640 x 12k FLOPs per cell against its "
        "encoder's per second of audio)",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "BUCKET_SORT_JITTER",
        0.05,
        knob_values.number,
        "Relative random spread of the within-bucket duration sort: higher = more random batches, more padding",
        knob_values.non_negative,
        steps=("train",),
    )

    # Augmentation of training audio (validation and evaluation are never augmented)
    knob(
        "SPEED_PERTURB",
        (),
        knob_values.speed_factors,
        "Speed perturbation of training audio: comma-separated factors, one drawn per utterance "
        "and epoch, e.g. 0.9,1.0,1.1 (Kaldi's, Lhotse's and NeMo's set; 1.1 = 10 % faster and "
        "higher, so 1/1.1 as long). The sampler packs batches by the durations played, so "
        "MAX_BATCH_DURATION holds; an utterance with more tokens than encoder frames at its "
        "factor plays at 1. Empty or 1 = off",
        steps=("train", "manifest_report"),
        shown="off",
    )
    knob(
        "NOISE_PROB",
        0.0,
        knob_values.number,
        "Share of training utterances that get additive noise at an SNR from NOISE_SNR_DB, e.g. "
        "0.5; 0 = off",
        lambda v: None if 0 <= v <= 1 else "expected a probability between 0 and 1",
        steps=("train",),
    )
    knob(
        "NOISE_SNR_DB",
        (10.0, 20.0),
        knob_values.decibel_range,
        "Signal-to-noise ratio of the added noise, dB over the whole utterance: 'low,high', drawn "
        "uniformly per utterance (Lhotse's CutMix default), or one number",
        steps=("train",),
    )
    knob(
        "NOISE_DIR",
        None,
        knob_values.path,
        "Noise recordings (FLAC or WAV, searched recursively, e.g. MUSAN's noise/) that "
        "NOISE_PROB adds: a file and an offset drawn per utterance, looped when shorter; empty = "
        "generated Gaussian noise, its colour drawn per utterance from white to brown (power ~ "
        "1/f^b, b = 0, 0.5, 1, 1.5 or 2)",
        steps=("train",),
    )

    # Training cache (training_cache.py)
    knob(
        "CACHE_DIR",
        None,
        knob_values.path,
        "Where training caches live (tokenized manifests, one directory each); empty: beside each "
        "manifest. Set it when the data directory is read-only or small",
        steps=("build_cache", "train", "evaluate"),
    )
    knob(
        "CACHE_BUILD_WORKERS",
        0,
        knob_values.integer,
        "Processes that tokenize a manifest into its training cache; 0: every usable core",
        knob_values.non_negative,
        steps=("build_cache", "train", "evaluate"),
    )

    # Training
    knob(
        "NUM_WORKERS",
        default_workers(env),
        knob_values.integer,
        "DataLoader workers per rank; default: the node's usable cores / local ranks - 1 (a core "
        "for the rank itself), at least 1, at most 4. What a job needs: scripts/plan_job.py (1 per "
        "GPU at the step measured on an H200, 2 with SPEED_PERTURB; docs/operations.md)",
        knob_values.non_negative,
        derived=True,
        steps=("train",),
        shown="cores/ranks-1, 1..4",
    )
    knob(
        "GRAD_ACCUM",
        4,
        knob_values.integer,
        "Micro-batches per optimizer step",
        knob_values.positive,
        steps=("train",),
    )
    knob(
        "MAX_STEPS",
        600000,
        knob_values.integer,
        "Optimizer steps of the whole run",
        knob_values.positive,
        steps=("train",),
    )
    checkpoint_every = knob(
        "CHECKPOINT_EVERY",
        5000,
        knob_values.integer,
        "Save a checkpoint every N optimizer steps",
        knob_values.positive,
        steps=("train",),
    )
    knob(
        "COLLECTIVE_TIMEOUT_MINUTES",
        10.0,
        knob_values.number,
        "A collective (all-reduce, barrier) waiting longer than this ends the job with an error: a "
        "stopped or hung rank costs minutes, not the default 30",
        knob_values.positive,
        steps=("train",),
    )
    knob(
        "WATCHDOG_SECONDS",
        300,
        knob_values.integer,
        "A rank that completes no micro-batch for this long logs where it waits and which rank last "
        "made progress when; 0 turns the watchdog off",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "MAX_EMPTY_STEPS",
        50,
        knob_values.integer,
        "Stop with an error after this many optimizer steps in a row with no utterance on any rank "
        "(all audio missing); 0 never stops",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "AUDIO_CHECK_SAMPLES",
        64,
        knob_values.integer,
        "Audio files of the train manifest each rank opens at start-up; none readable stops the "
        "run before training. 0 skips the check",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "KEEP_CHECKPOINTS",
        0,
        knob_values.integer,
        "Step checkpoints kept in CHECKPOINT_DIR: the newest N (and the best, KEEP_BEST_CHECKPOINTS); "
        "0 keeps all",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "KEEP_BEST_CHECKPOINTS",
        1,
        knob_values.integer,
        "Step checkpoints with the lowest validation WER (val/wer/all) kept whatever "
        "KEEP_CHECKPOINTS says; 'best' in evaluate.py, export_nemo.py and transcribe.py names them",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "PHASE1_LR",
        3e-4,
        knob_values.number,
        "Peak LR of phase 1 (encoder frozen)",
        knob_values.positive,
        steps=("train",),
    )
    knob(
        "PHASE2_LR",
        1e-4,
        knob_values.number,
        "Peak LR of phase 2 (encoder unfrozen)",
        knob_values.positive,
        steps=("train",),
    )
    knob(
        "MIN_LR",
        1e-6,
        knob_values.number,
        "LR at MAX_STEPS after cosine decay",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "UNFREEZE_STEP",
        40000,
        knob_values.integer,
        "Optimizer step at which the encoder is unfrozen (0 = never frozen)",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "WARMUP_STEPS",
        5000,
        knob_values.integer,
        "Linear warmup steps of phase 1",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "PHASE2_WARMUP",
        3000,
        knob_values.integer,
        "Linear warmup steps after unfreezing",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "ENCODER_LR_SCALE",
        1.0,
        knob_values.number,
        "The encoder's LR is this times the schedule's (phase 2, or from step 0 with "
        "UNFREEZE_STEP=0); decoder and joint get the schedule's own. Below 1 a finetune's encoder "
        "drifts less from its base, and the new languages learn more slowly (docs/training.md)",
        knob_values.positive,
        steps=("train",),
    )
    knob(
        "NEW_PIECE_LR_SCALE",
        10.0,
        knob_values.number,
        "Finetuning with DECODER_INIT=carry: the rows of the pieces the base lacked (prediction "
        "embedding, joint output, a hybrid's CTC output) take steps this many times the LR's, so "
        "a new language's pieces catch up with the base's",
        knob_values.positive,
        steps=("train",),
    )
    knob(
        "NEW_PIECE_WARMUP",
        0,
        knob_values.integer,
        "The new pieces' rows' factor NEW_PIECE_LR_SCALE ramps in linearly from 1x over this many "
        "optimizer steps from step 0 (0 = the full factor from the first step), apart from the "
        "LR's own warmups",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "NEW_PIECE_DECAY",
        0,
        knob_values.integer,
        "After NEW_PIECE_WARMUP, the new pieces' rows' factor NEW_PIECE_LR_SCALE falls by cosine "
        "back to 1x over this many optimizer steps and stays there (0 = it stays at "
        "NEW_PIECE_LR_SCALE), apart from the LR's own decay",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "DISTILL_WEIGHT",
        0.0,
        knob_values.number,
        "Finetuning (INIT_MODEL set): a frozen copy of the base runs on each micro-batch's "
        "utterances of the base's languages, and the loss adds this times the mean squared "
        "difference of the encoder's output from the copy's there (phase 2); 0 = off. The copy "
        "costs one more model's weights per rank (in bf16 under bf16 precision)",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "DISTILL_JOINT_WEIGHT",
        0.0,
        knob_values.number,
        "Finetuning (INIT_MODEL set): on each micro-batch's utterances of the base's languages, "
        "the loss adds this times the KL divergence of the joint's distribution over the pieces "
        "from the frozen base copy's, at every cell of the transducer's lattice (both phases); "
        "charges the probability the finetune gives the new pieces on the base's speech; 0 = off",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "BASE_ADAPTER_DIM",
        0,
        knob_values.integer,
        "Finetuning (INIT_MODEL set): > 0 keeps every weight of the base as it is and learns the "
        "new languages in NeMo LinearAdapters of this hidden size (every encoder layer, the "
        "prediction network, the joint) and the new pieces' rows; the base's languages "
        "(BASE_LANGUAGES or INIT_MODEL's record) decode with the adapters off, exactly as the "
        "base; 0 = off (the whole model trains)",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "L2SP_WEIGHT",
        0.0,
        knob_values.number,
        "Finetuning (INIT_MODEL set): after each optimizer step every weight the base had moves "
        "back toward the base's value by this times its LR times its distance (L2-SP, decoupled "
        "as AdamW's weight decay; the new pieces' rows are free); 0 = off",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "WEIGHT_DECAY",
        1e-3,
        knob_values.number,
        "AdamW weight decay",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "GRAD_CLIP",
        1.0,
        knob_values.number,
        "Gradient norm clip (0 = off)",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "EVAL_EVERY_STEPS",
        checkpoint_every,
        knob_values.integer,
        "Validation (per-language WER/CER and loss on VAL_MANIFEST_PATH) every N optimizer steps; "
        "default CHECKPOINT_EVERY, so every checkpoint has its scores; 0 = off",
        knob_values.non_negative,
        derived=True,
        steps=("train",),
    )
    knob(
        "EVAL_BASE",
        "auto",
        knob_values.choice("auto", "1", "0"),
        "Validate at step 0, before the first update: auto = when finetuning (INIT_MODEL set), so every "
        "per-language WER curve starts from the base and the model card shows base vs finetuned; "
        "1 = always; 0 = never. A resumed job does not repeat it",
        steps=("train",),
    )
    knob(
        "VAL_LANGUAGE_GIVEN",
        "1",
        knob_values.choice("1", "0"),
        "Validation decodes every utterance twice from one encoder forward: auto (the model names "
        "the language: val/wer/<lang>) and from its language's tag (val/wer_given/<lang>), so a "
        "wrong language is told from a wrong word; 0 = auto only",
        steps=("train",),
    )
    knob(
        "LANGUAGE_GIVEN_SCRIPTS",
        "1",
        knob_values.choice("1", "0"),
        "Decoding with the language given (validation's val/wer_given, evaluate.py, transcribe.py "
        "--lang) writes, after the tag, only pieces of the scripts the model records that "
        "language written in (train_tokenizer.py counts them; pieces without letters always "
        "pass), so an English utterance cannot drift into Tamil script; 0 = the tag alone",
        steps=("train", "evaluate", "transcribe"),
    )
    knob(
        "AUTO_LANGUAGE",
        "first",
        knob_values.choice("first", "score"),
        "Auto decoding (the language not given): first = the language whose tag the model "
        "writes first; score = decode the utterance with each of the model's languages given "
        "and keep the transcript the model itself scores most likely (its TDT log-likelihood), "
        "one decoding and one loss per language",
        steps=("train", "evaluate", "transcribe"),
    )
    knob(
        "FORGETTING_WARN_POINTS",
        5.0,
        knob_values.number,
        "Warn at each validation where a base language's WER (auto) has risen more than this many "
        "points above its step-0 validation (val/forgetting/<lang>); 0 = never warn",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "OVERFITTING_WARN_VALIDATIONS",
        3,
        knob_values.integer,
        "Warn once when the validation loss rose at each of the last N validations while the "
        "training loss fell (its mean since the previous validation, last interval of those against "
        "the first); run_report.py marks every such validation. 0 = never warn",
        knob_values.zero_or_at_least_two,
        steps=("train",),
    )
    knob(
        "EVAL_SAMPLES_PER_LANG",
        0,
        knob_values.integer,
        "Validation utterances per language (a seeded choice); 0 = the whole validation manifest, "
        "split across ranks",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "SEED",
        1234,
        knob_values.integer,
        "Seed of the sampler plan, model init and workers",
        steps=("make_train_val", "train_tokenizer", "train", "demo_corpus"),
    )
    knob(
        "PRECISION",
        "bf16-mixed",
        knob_values.choice(*PRECISIONS),
        "Lightning precision",
        steps=("train",),
    )
    knob(
        "ACCELERATOR",
        "auto",
        knob_values.choice("auto", "cpu", "gpu", "cuda"),
        "Lightning accelerator",
        steps=("train",),
    )

    # Step speed (step_speed.py): how the step runs, never what it computes beyond rounding.
    knob(
        "USE_PYTORCH_SDPA",
        "auto",
        knob_values.choice("auto", "1", "0"),
        "The encoder's attention through torch's scaled_dot_product_attention (fused kernels) "
        "instead of NeMo's matmul-softmax-matmul: auto = as the model's config says "
        "(use_pytorch_sdpa), 1 = on, 0 = off",
        steps=("train",),
    )
    knob(
        "JOINT_FUSED_BATCH_SIZE",
        0,
        knob_values.integer,
        "Utterances per sub-batch of the fused joint + loss (fused_batch_size): larger runs fewer, "
        "larger joint kernels and holds more joint memory at once; 0 = as the model's config says "
        "(4 in Parakeet's)",
        knob_values.non_negative,
        steps=("train",),
    )
    knob(
        "FUSED_ADAMW",
        "0",
        knob_values.choice("1", "0"),
        "AdamW's fused kernel (torch.optim.AdamW(fused=True)): one kernel for the whole update "
        "instead of a few per parameter list",
        steps=("train",),
    )
    knob(
        "COMPILE_ENCODER",
        "0",
        knob_values.choice("1", "0"),
        "Compile each encoder layer with torch.compile (dynamic shapes; the first steps of each "
        "new shape pay for compiling)",
        steps=("train",),
    )
    knob(
        "MATMUL_PRECISION",
        "highest",
        knob_values.choice("highest", "high", "medium"),
        "torch.set_float32_matmul_precision for the parts that run in float32 under bf16-mixed "
        "(the mel front end, attention scores NeMo keeps in float32, the loss): high = TF32 tensor "
        "cores, still finer than bf16",
        steps=("train",),
    )
    knob(
        "HOST_MEMORY_REUSE",
        "auto",
        knob_values.choice("auto", "1", "0"),
        "Keep the host memory torch frees for its next tensors (glibc malloc: no mmap per large "
        "block, no heap trimming) instead of faulting it in again page by page every step: auto = "
        "on when the step runs on the CPU, where its largest tensors live",
        steps=("train",),
    )

    knob(
        "IGNORE_UNKNOWN_ENV",
        "",
        knob_values.text,
        "Comma-separated variables that look like knobs but are not, to let pass (every entry point "
        "refuses them otherwise, as likely typos); '*' turns the check off",
        steps=STEPS,
    )

    errors += unknown_variables(env, knobs)

    # Cross-checks, reported with the values that clash.
    v = {k: kn.value for k, kn in knobs.items()}
    if v["MIN_DURATION"] >= v["MAX_DURATION"]:
        errors.append(
            f"MAX_DURATION={v['MAX_DURATION']!r} with MIN_DURATION={v['MIN_DURATION']!r}: "
            "expected MIN_DURATION < MAX_DURATION"
        )
    if v["MIN_LR"] > min(v["PHASE1_LR"], v["PHASE2_LR"]):
        errors.append(f"MIN_LR={v['MIN_LR']!r}: expected at most PHASE1_LR and PHASE2_LR")
    if errors:
        # One problem is one line; several are listed under it.
        sep = " " if len(errors) == 1 else "\n  "
        raise ConfigError("invalid configuration:" + sep + sep.join(errors))
    return knobs


def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in value)
    return str(value)


def run_settings(knobs: Mapping[str, Knob] | None = None) -> dict[str, Any]:
    """Every knob's effective value as JSON types: numbers stay numbers (so W&B can filter and
    plot runs by them), paths become strings, tuples lists."""
    out: dict[str, Any] = {}
    for k in (KNOBS if knobs is None else knobs).values():
        value = k.value
        if isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[k.name] = value
    return out


def describe(knobs: Mapping[str, Knob]) -> str:
    """A plain table of every effective value and its source."""
    width = max(len(n) for n in knobs)
    return "\n".join(
        f"{k.name:<{width}}  {_format_value(k.value)!s:<40}  ({k.source})" for k in knobs.values()
    )


def markdown_table(knobs: Mapping[str, Knob]) -> str:
    """docs/knobs.md's table, generated from the declarations so it cannot drift."""
    rows = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
    for k in knobs.values():
        default = k.shown or _format_value(k.value)
        if isinstance(k.value, Path):
            try:
                default = str(Path(k.value).relative_to(REPO_DIR))
                default = "<repo>/" + default
            except ValueError:
                pass
        read_by = "every step" if set(k.steps) == set(STEPS) else ", ".join(k.steps)
        rows.append(f"| `{k.name}` | `{default}` | {read_by} | {k.help} |")
    return "\n".join(rows)


def describe_for_help(step: str, knobs: Mapping[str, Knob] | None = None) -> str:
    """``NAME=value  (help)`` lines of every knob ``step`` reads: the epilog of a script's --help."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; expected one of {', '.join(STEPS)}")
    knobs = KNOBS if knobs is None else knobs
    step = STEP_READS_AS.get(step, step)
    return "\n".join(
        f"  {k.name}={_format_value(k.value)}  ({k.help})"
        for k in knobs.values()
        if step in k.steps
    )


def help_epilog(step: str, examples: str = "") -> str:
    """The epilog of a step's --help: ``examples``, then every knob ``step`` reads with its
    effective value now."""
    head = f"{examples.rstrip()}\n\n" if examples else ""
    return (
        f"{head}Environment variables read (config.py; `python config.py` lists every knob), "
        f"effective values now:\n{describe_for_help(step)}"
    )


KNOBS_PAGE = REPO_DIR / "docs" / "knobs.md"
TABLE_START = "<!-- config-table:start (generated by `python config.py --update-docs`) -->"
TABLE_END = "<!-- config-table:end -->"


def update_docs(page: Path = KNOBS_PAGE) -> bool:
    """Replace the table between the page's markers; return True when the file changed."""
    from doc_tables import MissingMarkers, update_section

    try:
        return update_section(page, TABLE_START, TABLE_END, markdown_table(read_config({})))
    except MissingMarkers as exc:
        raise ConfigError(str(exc)) from None


# Every entry point imports this module: a bad knob (or any UserError that escapes to the top) is
# one line and exit code 2 there, as in train.py.
exit_on_user_errors()
KNOBS = read_config(os.environ)
globals().update({name: kn.value for name, kn in KNOBS.items()})

# Typed names for readers and linters; values come from KNOBS above.
DATA_DIR: Path
SHARDS_DIR: Path
DATA_SOURCES: tuple[str, ...]
IMPORTED_AUDIO_DIR: Path
MASTER_MANIFEST_PATH: Path
TRAIN_MANIFEST_PATH: Path
VAL_MANIFEST_PATH: Path
TEST_MANIFEST_PATH: Path
TOKENIZER_DIR: Path
CACHE_DIR: Path | None
CACHE_BUILD_WORKERS: int
CHECKPOINT_DIR: Path
WANDB_LOG_DIR: Path
WANDB_PROJECT: str
WANDB_MODE: str
WANDB_RUN_NAME: str
INIT_MODEL: str
MODEL_CONFIG: Path
RESUME_FROM: str
RESUME_CHANGES: tuple[str, ...]
VOCAB_SIZE: int
TOKENIZER_MODE: str
DECODER_INIT: str
NEW_PIECE_BIAS: str
TDT_LOSS: str
ENCODER_FRAME_SECONDS: float
LANGUAGES: tuple[str, ...]
TARGET_SAMPLE_RATE: int
MIN_DURATION: float
MAX_DURATION: float
MIN_QUALITY: float
TRANSCRIPT_STYLE: str
MAX_TOKEN_LEN: int
AUDIO_DURATION_TOLERANCE: float
VAL_PER_LANG: int
VAL_MAX_FRACTION: float
VAL_WARN_FRACTION: float
SCRIPT_VOTE_THRESHOLD: float
BUCKET_BOUNDARIES: tuple[float, ...] | str
MAX_BATCH_DURATION: float
TEMPERATURE: float
LANG_WEIGHTING: str
BASE_LANGUAGE_SHARE: float
BASE_LANGUAGES: tuple[str, ...]
EPOCH_SIZE: int
BATCH_COST_QUADRATIC: float
BUCKET_SORT_JITTER: float
MAX_BATCH_JOINT_CELLS: float
BATCH_COST_JOINT: float
SPEED_PERTURB: tuple[float, ...]
NOISE_PROB: float
NOISE_SNR_DB: tuple[float, float]
NOISE_DIR: Path | None
NUM_WORKERS: int
GRAD_ACCUM: int
MAX_STEPS: int
CHECKPOINT_EVERY: int
KEEP_CHECKPOINTS: int
KEEP_BEST_CHECKPOINTS: int
MAX_EMPTY_STEPS: int
COLLECTIVE_TIMEOUT_MINUTES: float
WATCHDOG_SECONDS: int
AUDIO_CHECK_SAMPLES: int
PHASE1_LR: float
PHASE2_LR: float
MIN_LR: float
UNFREEZE_STEP: int
WARMUP_STEPS: int
PHASE2_WARMUP: int
ENCODER_LR_SCALE: float
DISTILL_WEIGHT: float
DISTILL_JOINT_WEIGHT: float
L2SP_WEIGHT: float
BASE_ADAPTER_DIM: int
AUTO_LANGUAGE: str
NEW_PIECE_LR_SCALE: float
NEW_PIECE_WARMUP: int
NEW_PIECE_DECAY: int
WEIGHT_DECAY: float
GRAD_CLIP: float
EVAL_EVERY_STEPS: int
EVAL_BASE: str
EVAL_SAMPLES_PER_LANG: int
VAL_LANGUAGE_GIVEN: str
LANGUAGE_GIVEN_SCRIPTS: str
FORGETTING_WARN_POINTS: float
OVERFITTING_WARN_VALIDATIONS: int
SEED: int
PRECISION: str
ACCELERATOR: str
USE_PYTORCH_SDPA: str
JOINT_FUSED_BATCH_SIZE: int
FUSED_ADAMW: str
COMPILE_ENCODER: str
MATMUL_PRECISION: str
HOST_MEMORY_REUSE: str
IGNORE_UNKNOWN_ENV: str


def wandb_mode() -> str:
    """WANDB_MODE, or offline when it is unset and no API key is present."""
    mode = globals()["WANDB_MODE"]  # bound from KNOBS above; tests monkeypatch it
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Every knob of the pipeline (environment variables): with no option, each "
        "effective value and where it came from (default, derived or env).",
        epilog="Examples:\n  python config.py\n  TEMPERATURE=0.5 python config.py\n"
        "  python config.py --update-docs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--markdown", action="store_true", help="print docs/knobs.md's knob table")
    what.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite that table in docs/knobs.md between its markers",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(read_config({})))
    elif args.update_docs:
        changed = update_docs()
        print("docs/knobs.md table " + ("updated" if changed else "already up to date"))
    else:
        print(describe(KNOBS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
