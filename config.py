"""Every knob of the pipeline, each overridable by an environment variable of the same name.

Usage:
    python config.py               # print every effective value and where it came from
    python config.py --markdown    # the README's table of environment variables
    python config.py --update-readme   # rewrite that table in README.md between its markers
    TEMPERATURE=0.5 python config.py

Other modules read values at call time as ``config.NAME`` (never ``from config import NAME``), so a
test can monkeypatch one value. Derived paths (manifests, tokenizer, checkpoints, W&B logs) follow
``DATA_DIR`` unless they are set themselves.

A bad value fails at import with one ``ConfigError`` that names each bad variable, the value given
and what is expected, for example ``GRAD_ACCUM='four': expected an integer``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from process_control import UserError

REPO_DIR = Path(__file__).resolve().parent

PRECISIONS = ("32-true", "32", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")
WANDB_MODES = ("online", "offline", "disabled")
LANG_WEIGHTINGS = ("count", "hours")


class ConfigError(UserError, ValueError):
    """One or more environment variables hold a value the pipeline cannot use."""


# The pipeline's steps, in the order they run; each knob names the steps that read it.
STEPS = (
    "extract_audio",
    "build_manifest",
    "make_train_val",
    "train_tokenizer",
    "build_cache",
    "train",
    "evaluate",
    "manifest_report",
)


@dataclass(frozen=True)
class Knob:
    name: str
    value: Any
    source: str  # "default", "derived" or "env"
    help: str
    steps: tuple[str, ...] = ()  # the pipeline steps (STEPS) that read it


# --- parsers: each turns the raw string into a typed value or raises ValueError("expected ...") ---


def _int(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("expected a finite number")
    return value


def _str(raw: str) -> str:
    return raw.strip()


def _path(raw: str) -> Path:
    raw = raw.strip()
    if not raw:
        raise ValueError("expected a path")
    return Path(raw).expanduser()


def _languages(raw: str) -> tuple[str, ...]:
    codes = tuple(c.strip() for c in raw.split(",") if c.strip())
    bad = [c for c in codes if not c.replace("-", "").replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"expected comma-separated language codes such as 'hi,en' (bad: {bad})")
    return codes


def _boundaries(raw: str) -> tuple[float, ...] | str:
    raw = raw.strip()
    if raw.startswith("auto:"):
        k = raw[5:]
        if not k.isdigit() or int(k) < 2:
            raise ValueError(
                "expected 'auto:K' with an integer K >= 2, or increasing seconds like '3,5,8'"
            )
        return raw
    try:
        values = tuple(float(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise ValueError("expected increasing seconds like '3,5,8,12,16', or 'auto:K'") from None
    if not values or any(v <= 0 or v != v for v in values):
        raise ValueError("expected positive seconds like '3,5,8,12,16', or 'auto:K'")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError("expected strictly increasing seconds like '3,5,8,12,16', or 'auto:K'")
    return values


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value

    return parse


# --- checks on a typed value: return None when fine, else what is expected ---


def _positive(v: float) -> str | None:
    return None if v > 0 else "expected a value > 0"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else "expected a value >= 0"


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
    ) -> Any:
        unknown = set(steps) - set(STEPS)
        assert not unknown, f"knob {name}: unknown steps {sorted(unknown)}"
        raw = env.get(name)
        if raw is None or (raw.strip() == "" and parse is not _str and parse is not _languages):
            value, source = default, ("derived" if derived else "default")
        else:
            try:
                value = parse(raw)
            except ValueError as exc:
                errors.append(f"{name}={raw!r}: {exc}")
                value, source = default, "env"
            else:
                source = "env"
                problem = check(value) if check else None
                if problem:
                    errors.append(f"{name}={raw!r}: {problem}")
        knobs[name] = Knob(name, value, source, help, tuple(steps))
        return value

    # Paths
    data_dir = knob(
        "DATA_DIR",
        REPO_DIR / "data",
        _path,
        "Root of the data tree; the paths below follow it unless set",
        steps=STEPS,
    )
    knob(
        "SHARDS_DIR",
        data_dir / "shards",
        _path,
        "Input shards: <source>/<lang>/<shard>/{metadata,audio_index}.parquet + audio.tar",
        derived=True,
        steps=("extract_audio", "build_manifest"),
    )
    knob(
        "MASTER_MANIFEST_PATH",
        data_dir / "master_manifest.parquet",
        _path,
        "build_manifest.py output",
        derived=True,
        steps=("build_manifest", "make_train_val"),
    )
    knob(
        "TRAIN_MANIFEST_PATH",
        data_dir / "train_manifest_v2.parquet",
        _path,
        "make_train_val.py output read by train.py",
        derived=True,
        steps=("make_train_val", "train_tokenizer", "build_cache", "train", "manifest_report"),
    )
    knob(
        "VAL_MANIFEST_PATH",
        data_dir / "val_manifest_v2.parquet",
        _path,
        "make_train_val.py output read by evaluation",
        derived=True,
        steps=("make_train_val", "build_cache", "train", "evaluate"),
    )
    knob(
        "TOKENIZER_DIR",
        data_dir / "tokenizer",
        _path,
        "SentencePiece tokenizer directory (train_tokenizer.py output)",
        derived=True,
        steps=("train_tokenizer", "build_cache", "train", "evaluate"),
    )
    knob(
        "CHECKPOINT_DIR",
        data_dir / "checkpoints",
        _path,
        "Step checkpoints and the final .nemo",
        derived=True,
        steps=("train", "evaluate"),
    )
    knob(
        "WANDB_LOG_DIR",
        data_dir / "wandb_logs",
        _path,
        "W&B run directory (offline runs live here) and the local metrics JSONL",
        derived=True,
        steps=("train",),
    )

    # Weights & Biases
    knob("WANDB_PROJECT", "parakeet-tdt-finetune", _str, "W&B project name", steps=("train",))
    knob(
        "WANDB_MODE",
        "",
        _choice("", *WANDB_MODES),
        "online, offline or disabled; empty = online with WANDB_API_KEY, else offline",
        steps=("train",),
    )
    knob("WANDB_RUN_NAME", "", _str, "W&B run name; empty = generated", steps=("train",))

    # Model
    knob(
        "INIT_MODEL",
        "",
        _str,
        "A .nemo path or a pretrained name (e.g. nvidia/parakeet-tdt-0.6b-v2); empty = fresh model from MODEL_CONFIG",
        steps=("train", "evaluate"),
    )
    knob(
        "MODEL_CONFIG",
        REPO_DIR / "configs" / "tiny_tdt.yaml",
        _path,
        "YAML of a fresh model, used when INIT_MODEL is empty",
        steps=("train", "evaluate"),
    )
    knob(
        "RESUME_FROM",
        "",
        _str,
        "A checkpoint path, or 'last' for the newest in CHECKPOINT_DIR; empty = start fresh",
        steps=("train",),
    )
    knob(
        "VOCAB_SIZE",
        12000,
        _int,
        "SentencePiece vocabulary size for train_tokenizer.py",
        _positive,
        steps=("train_tokenizer",),
    )
    knob(
        "TDT_LOSS",
        "numba",
        _choice("numba", "torch"),
        "TDT loss on CUDA: numba = NeMo's kernel (requirements-gpu.txt), torch = tdt_loss.py "
        "(no numba needed, slower); CPU always runs tdt_loss.py",
        steps=("train", "evaluate"),
    )
    knob(
        "ENCODER_FRAME_SECONDS",
        0.08,
        _float,
        "Seconds per encoder frame (10 ms hop x 8x subsampling); utterances with more tokens than frames are dropped",
        _positive,
        steps=("build_cache", "train", "evaluate"),
    )

    # Data
    knob(
        "LANGUAGES",
        (),
        _languages,
        "Comma-separated language codes to keep (e.g. 'hi,ta,en'); empty = all",
        steps=("build_manifest", "make_train_val"),
    )
    knob(
        "TARGET_SAMPLE_RATE",
        16000,
        _int,
        "Audio is resampled to this rate (Hz)",
        _positive,
        steps=("train", "evaluate"),
    )
    knob(
        "MIN_DURATION",
        0.5,
        _float,
        "Shortest utterance kept, seconds",
        _non_negative,
        steps=("build_manifest",),
    )
    knob(
        "MAX_DURATION",
        20.0,
        _float,
        "Longest utterance kept, seconds",
        _positive,
        steps=("build_manifest", "manifest_report"),
    )
    knob("MIN_QUALITY", 0.0, _float, "Lowest tx_quality_score kept", steps=("build_manifest",))
    knob(
        "MAX_TOKEN_LEN",
        512,
        _int,
        "Token sequences are truncated to this length",
        _positive,
        steps=("build_cache", "train", "evaluate"),
    )
    knob(
        "AUDIO_DURATION_TOLERANCE",
        0.25,
        _float,
        "Decoded audio whose length differs from the manifest by more (seconds) is bad audio",
        _non_negative,
        steps=("train", "evaluate"),
    )
    knob(
        "VAL_PER_LANG",
        200,
        _int,
        "Validation utterances per language (make_train_val.py)",
        _non_negative,
        steps=("make_train_val",),
    )
    knob(
        "VAL_MAX_FRACTION",
        0.5,
        _float,
        "At most this share of a language's rows goes to validation (make_train_val.py)",
        lambda v: None if 0 <= v <= 1 else "expected a fraction between 0 and 1",
        steps=("make_train_val",),
    )
    knob(
        "SCRIPT_VOTE_THRESHOLD",
        0.9,
        _float,
        "Share of a transcript's letters in one script for that script to correct its language tag (make_train_val.py)",
        lambda v: None if 0.5 < v <= 1 else "expected a fraction above 0.5 and at most 1",
        steps=("make_train_val",),
    )

    # Sampler
    knob(
        "BUCKET_BOUNDARIES",
        (3.0, 5.0, 8.0, 12.0, 16.0),
        _boundaries,
        "Duration bucket edges in seconds, or 'auto:K' for K quantile buckets",
        steps=("train", "manifest_report"),
    )
    knob(
        "MAX_BATCH_DURATION",
        90.0,
        _float,
        "Seconds of raw audio per micro-batch (per GPU)",
        _positive,
        steps=("train", "manifest_report"),
    )
    knob(
        "TEMPERATURE",
        0.3,
        _float,
        "Language mix: share ~ n_l^T (1 = natural, 0 = uniform)",
        lambda v: None if v >= 0 else "expected a value >= 0 (1 = natural shares, 0 = uniform)",
        steps=("train_tokenizer", "train", "manifest_report"),
    )
    knob(
        "LANG_WEIGHTING",
        "count",
        _choice(*LANG_WEIGHTINGS),
        "Temperature over utterance counts or over hours",
        steps=("train_tokenizer", "train", "manifest_report"),
    )
    knob(
        "EPOCH_SIZE",
        0,
        _int,
        "Utterances per sampler epoch; 0 = the number of utterances",
        _non_negative,
        steps=("train",),
    )
    knob(
        "BATCH_COST_QUADRATIC",
        0.0,
        _float,
        "Quadratic term of the batch cost model (attention), per second^2",
        _non_negative,
        steps=("train",),
    )
    knob(
        "BUCKET_SORT_JITTER",
        0.05,
        _float,
        "Relative random spread of the within-bucket duration sort: higher = more random batches, more padding",
        _non_negative,
        steps=("train",),
    )

    # Training cache (training_cache.py)
    knob(
        "CACHE_DIR",
        None,
        _path,
        "Where training caches live (tokenized manifests, one directory each); empty: beside each "
        "manifest. Set it when the data directory is read-only or small",
        steps=("build_cache", "train", "evaluate"),
    )
    knob(
        "CACHE_BUILD_WORKERS",
        0,
        _int,
        "Processes that tokenize a manifest into its training cache; 0: every usable core",
        _non_negative,
        steps=("build_cache", "train", "evaluate"),
    )

    # Training
    knob("NUM_WORKERS", 12, _int, "DataLoader workers per rank", _non_negative, steps=("train",))
    knob("GRAD_ACCUM", 4, _int, "Micro-batches per optimizer step", _positive, steps=("train",))
    knob("MAX_STEPS", 600000, _int, "Optimizer steps of the whole run", _positive, steps=("train",))
    checkpoint_every = knob(
        "CHECKPOINT_EVERY",
        5000,
        _int,
        "Save a checkpoint every N optimizer steps",
        _positive,
        steps=("train",),
    )
    knob(
        "COLLECTIVE_TIMEOUT_MINUTES",
        10.0,
        _float,
        "A collective (all-reduce, barrier) waiting longer than this ends the job with an error: a "
        "stopped or hung rank costs minutes, not the default 30",
        _positive,
        steps=("train",),
    )
    knob(
        "WATCHDOG_SECONDS",
        300,
        _int,
        "A rank that completes no micro-batch for this long logs where it waits and which rank last "
        "made progress when; 0 turns the watchdog off",
        _non_negative,
        steps=("train",),
    )
    knob(
        "MAX_EMPTY_STEPS",
        50,
        _int,
        "Stop with an error after this many optimizer steps in a row with no utterance on any rank "
        "(all audio missing); 0 never stops",
        _non_negative,
        steps=("train",),
    )
    knob(
        "AUDIO_CHECK_SAMPLES",
        64,
        _int,
        "Audio files of the train manifest each rank opens at start-up; none readable stops the "
        "run before training. 0 skips the check",
        _non_negative,
        steps=("train",),
    )
    knob(
        "KEEP_CHECKPOINTS",
        0,
        _int,
        "Step checkpoints kept in CHECKPOINT_DIR: the newest N; 0 keeps all",
        _non_negative,
        steps=("train",),
    )
    knob(
        "PHASE1_LR",
        3e-4,
        _float,
        "Peak LR of phase 1 (encoder frozen)",
        _positive,
        steps=("train",),
    )
    knob(
        "PHASE2_LR",
        1e-4,
        _float,
        "Peak LR of phase 2 (encoder unfrozen)",
        _positive,
        steps=("train",),
    )
    knob(
        "MIN_LR",
        1e-6,
        _float,
        "LR at MAX_STEPS after cosine decay",
        _non_negative,
        steps=("train",),
    )
    knob(
        "UNFREEZE_STEP",
        40000,
        _int,
        "Optimizer step at which the encoder is unfrozen (0 = never frozen)",
        _non_negative,
        steps=("train",),
    )
    knob(
        "WARMUP_STEPS",
        5000,
        _int,
        "Linear warmup steps of phase 1",
        _non_negative,
        steps=("train",),
    )
    knob(
        "PHASE2_WARMUP",
        3000,
        _int,
        "Linear warmup steps after unfreezing",
        _non_negative,
        steps=("train",),
    )
    knob("WEIGHT_DECAY", 1e-3, _float, "AdamW weight decay", _non_negative, steps=("train",))
    knob("GRAD_CLIP", 1.0, _float, "Gradient norm clip (0 = off)", _non_negative, steps=("train",))
    knob(
        "EVAL_EVERY_STEPS",
        checkpoint_every,
        _int,
        "Validation (per-language WER/CER and loss on VAL_MANIFEST_PATH) every N optimizer steps; "
        "default CHECKPOINT_EVERY, so every checkpoint has its scores; 0 = off",
        _non_negative,
        derived=True,
        steps=("train",),
    )
    knob(
        "EVAL_SAMPLES_PER_LANG",
        0,
        _int,
        "Validation utterances per language (a seeded choice); 0 = the whole validation manifest, "
        "split across ranks",
        _non_negative,
        steps=("train",),
    )
    knob(
        "SEED",
        1234,
        _int,
        "Seed of the sampler plan, model init and workers",
        steps=("make_train_val", "train_tokenizer", "train"),
    )
    knob("PRECISION", "bf16-mixed", _choice(*PRECISIONS), "Lightning precision", steps=("train",))
    knob(
        "ACCELERATOR",
        "auto",
        _choice("auto", "cpu", "gpu", "cuda"),
        "Lightning accelerator",
        steps=("train",),
    )

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
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
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
    """The README's table, generated from the declarations so it cannot drift."""
    rows = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
    for k in knobs.values():
        default = _format_value(k.value)
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
    return "\n".join(
        f"  {k.name}={_format_value(k.value)}  ({k.help})"
        for k in knobs.values()
        if step in k.steps
    )


README_TABLE_START = "<!-- config-table:start (generated by `python config.py --update-readme`) -->"
README_TABLE_END = "<!-- config-table:end -->"


def update_readme(readme: Path) -> bool:
    """Replace the table between the README's markers; return True when the file changed."""
    from readme_tables import MissingMarkers, update_readme_section

    try:
        return update_readme_section(
            readme, README_TABLE_START, README_TABLE_END, markdown_table(read_config({}))
        )
    except MissingMarkers as exc:
        raise ConfigError(str(exc)) from None


KNOBS = read_config(os.environ)
globals().update({name: kn.value for name, kn in KNOBS.items()})

# Typed names for readers and linters; values come from KNOBS above.
DATA_DIR: Path
SHARDS_DIR: Path
MASTER_MANIFEST_PATH: Path
TRAIN_MANIFEST_PATH: Path
VAL_MANIFEST_PATH: Path
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
VOCAB_SIZE: int
TDT_LOSS: str
ENCODER_FRAME_SECONDS: float
LANGUAGES: tuple[str, ...]
TARGET_SAMPLE_RATE: int
MIN_DURATION: float
MAX_DURATION: float
MIN_QUALITY: float
MAX_TOKEN_LEN: int
AUDIO_DURATION_TOLERANCE: float
VAL_PER_LANG: int
VAL_MAX_FRACTION: float
SCRIPT_VOTE_THRESHOLD: float
BUCKET_BOUNDARIES: tuple[float, ...] | str
MAX_BATCH_DURATION: float
TEMPERATURE: float
LANG_WEIGHTING: str
EPOCH_SIZE: int
BATCH_COST_QUADRATIC: float
BUCKET_SORT_JITTER: float
NUM_WORKERS: int
GRAD_ACCUM: int
MAX_STEPS: int
CHECKPOINT_EVERY: int
KEEP_CHECKPOINTS: int
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
WEIGHT_DECAY: float
GRAD_CLIP: float
EVAL_EVERY_STEPS: int
EVAL_SAMPLES_PER_LANG: int
SEED: int
PRECISION: str
ACCELERATOR: str


def wandb_mode() -> str:
    """WANDB_MODE, or offline when it is unset and no API key is present."""
    mode = globals()["WANDB_MODE"]  # bound from KNOBS above; tests monkeypatch it
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


if __name__ == "__main__":
    if "--markdown" in sys.argv[1:]:
        print(markdown_table(read_config({})))
    elif "--update-readme" in sys.argv[1:]:
        changed = update_readme(REPO_DIR / "README.md")
        print("README.md table " + ("updated" if changed else "already up to date"))
    else:
        print(describe(KNOBS))
