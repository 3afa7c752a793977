"""What a run keeps on disk, and how it finds it again.

Step checkpoints (``checkpoint_name``, written whole or not at all by ``AtomicCheckpointIO``),
``find_last_checkpoint`` and ``resolve_resume_from`` (RESUME_FROM), ``resolve_model_path`` (the model
argument of the scripts: a path, ``last`` or ``best``), the RNG states an exact
resume restores, and the run's ledger, CHECKPOINT_DIR/run.json: its identity (``run_identity``: name
and W&B id, so a resumed job continues the same run) and the validation WER of each checkpoint
(``record_validation``, ``best_checkpoints``), which keeps the best checkpoint through pruning.
Every reader of a step checkpoint, Lightning's resume included, loads it as data
(``read_checkpoint``: torch's weights-only unpickler and ``safe_globals``); a checkpoint whose
pickle names anything else, as one that would run code does, is refused before it is unpickled.

One directory, one run, one timeline: a fresh run refuses a CHECKPOINT_DIR that holds another run's
step files, and so does a resume of a checkpoint from elsewhere (``check_directory_for_run``); a
resume of a checkpoint trained with other run-defining settings is refused unless RESUME_CHANGES
names them (``check_resume_settings``); ``plan_resume`` says what RESUME_FROM means for the
directory (a fresh start, a continuation, the requeue of a branch or rewind, a branch, a rewind),
and ``apply_resume_plan`` moves the step files a rewind abandons (or that cannot be read) into a
folder beside them, so ``last``, ``best`` and pruning only ever see the run's current timeline.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

import config
import knob_values
from atomic_files import atomic_write, disk_full
from process_control import UserError

log = logging.getLogger("checkpoints")


CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)\.ckpt$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.ckpt"


def checkpoint_number(path: Path) -> int:
    """The step in a step checkpoint's name (``step_00005000.ckpt`` -> 5000)."""
    return int(CHECKPOINT_PATTERN.match(Path(path).name).group(1))


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the path, the cause and what
    to do."""


def free_bytes(directory: Path) -> int:
    """Free bytes on the file system of ``directory`` (or of its nearest existing parent)."""
    directory = Path(directory)
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return shutil.disk_usage(directory).free


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO, but the file appears under its name only once complete, and
    a failed save or load says which file, why and what to do (CheckpointError).

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
        try:
            atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))
        except (OSError, RuntimeError) as exc:
            # torch.save reports a full disk as "unexpected pos N vs M" from its zip writer.
            free = free_bytes(Path(path).parent)
            full = disk_full(exc) or "unexpected pos" in str(exc)
            raise CheckpointError(
                f"cannot save checkpoint {path}: {'disk full: ' if full else ''}{exc}; "
                f"{free / 2**30:.1f} GiB free on that file system. Free space, set KEEP_CHECKPOINTS "
                f"to keep fewer, or point CHECKPOINT_DIR at a larger file system"
            ) from exc

    def load_checkpoint(self, path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The checkpoint, memory-mapped (``read_checkpoint(mmap=True)``): its tensors are pages of
        the file, read as Lightning copies them into the model and the optimizer, and shared by the
        ranks of a node through the page cache (copy-on-write: nothing is written back). Every rank
        loading its own copy would hold ranks x the checkpoint (about 7.6 GB at full size with
        AdamW's moments) at once."""
        return read_checkpoint(
            Path(path),
            advice="resume from an older one (RESUME_FROM=<path>, or RESUME_FROM=last skips "
            "unreadable ones) or delete it",
            mmap=True,
        )


def read_checkpoint(
    path: Path,
    advice: str = "use an older step_*.ckpt or delete it",
    *,
    mmap: bool = False,
) -> dict[str, Any]:
    """The step checkpoint at ``path``, loaded on the CPU as data only (``torch.load`` with
    ``weights_only=True``: tensors, plain containers, ``safe_globals`` and, for a checkpoint that
    names them, ``NEMO_CONFIG_ENUMS``), after the cheap
    ``checkpoint_problem`` check. Any failure is a CheckpointError naming the path, the cause and
    ``advice``; a checkpoint whose pickle names anything else (a function, a class: what a pickle
    runs as it loads) is refused naming it, before any of it is unpickled. ``mmap``: the file is
    mapped instead of read, so tensors that are never touched (a reader of the weights leaves
    AdamW's moments alone) cost no memory."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"cannot load checkpoint {path}: {problem}; {advice}")
    try:
        with torch.serialization.safe_globals(safe_globals()):
            named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            foreign = [name for name in named if name not in NEMO_CONFIG_ENUMS]
            if not foreign:
                with torch.serialization.safe_globals(nemo_config_enums(named)):
                    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if _WEIGHTS_ONLY_REFUSAL not in str(exc):
            raise CheckpointError(
                f"cannot load checkpoint {path}: {type(exc).__name__}: {exc}; {advice}"
            ) from exc
        raise CheckpointError(
            f"refusing to load checkpoint {path}: {_refused(exc)}, which no checkpoint train.py "
            f"writes holds; {advice}"
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"cannot load checkpoint {path}: {type(exc).__name__}: {exc}; {advice}"
        ) from exc
    raise CheckpointError(
        f"refusing to load checkpoint {path}: its pickle names {', '.join(sorted(foreign))}, which "
        f"no checkpoint train.py writes holds (loading it would run that code); {advice}"
    )


def safe_globals() -> list[Any]:
    """What every step checkpoint holds besides tensors and plain containers, as its pickle names
    it (for ``torch.serialization.safe_globals``): NumPy's RNG state (an array of uint32,
    ``rng_state``), under NumPy 2's module names and NumPy 1's."""
    try:
        multiarray = np._core.multiarray
    except AttributeError:  # NumPy 1
        multiarray = np.core.multiarray
    reconstruct = multiarray._reconstruct
    return [
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


# The enums of NeMo's decoding configs (RNNTDecodingConfig, CTCDecodingConfig), which a model
# description (``PORTABLE_KEY``) may hold as enums; train.py writes their names, as a .nemo's YAML
# holds them. tests/test_checkpoint_loading.py checks that this is all of them.
NEMO_CONFIG_ENUMS = (
    "nemo.collections.asr.parts.utils.batched_beam_decoding_utils.BlankLMScoreMode",
    "nemo.collections.asr.parts.utils.batched_beam_decoding_utils.PruningMode",
)


def nemo_config_enums(names: list[str]) -> list[type]:
    """The classes of ``NEMO_CONFIG_ENUMS`` among ``names``: imported only for a checkpoint that
    names them (NeMo's import takes seconds), and only from that list."""
    import importlib

    found = []
    for name in names:
        if name in NEMO_CONFIG_ENUMS:
            module, _, attribute = name.rpartition(".")
            found.append(getattr(importlib.import_module(module), attribute))
    return found


# What torch's error says before what its weights-only unpickler refused.
_WEIGHTS_ONLY_REFUSAL = "WeightsUnpickler error:"


def _refused(exc: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, from its error (several paragraphs): the text
    after ``_WEIGHTS_ONLY_REFUSAL`` up to the next paragraph, else the error's first line."""
    text = str(exc)
    _, marker, after = text.partition(_WEIGHTS_ONLY_REFUSAL)
    if marker:
        paragraphs = [p.strip() for p in after.split("\n\n") if p.strip()]
        if paragraphs:
            return " ".join(paragraphs[0].split())
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a complete checkpoint (missing, truncated, not torch.save's zip), or
    None. Reads the zip's central directory only: cheap even for a 7 GB file."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except FileNotFoundError:
        return "no such file"
    except (zipfile.BadZipFile, OSError) as exc:
        return f"truncated or not a checkpoint ({exc})"
    if not any(e.filename.endswith("/data.pkl") for e in entries):
        return "not a torch checkpoint (no data.pkl)"
    if any(e.header_offset + e.compress_size > size for e in entries):
        return "truncated (an entry ends past the end of the file)"
    return None


def step_checkpoints(checkpoint_dir: Path | None = None) -> list[Path]:
    """The step checkpoints in ``checkpoint_dir`` (CHECKPOINT_DIR), oldest first."""
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def prune_checkpoints(
    keep: int, checkpoint_dir: Path | None = None, keep_best: int = 0
) -> list[Path]:
    """Delete all but the newest ``keep`` step checkpoints (keep <= 0: delete none), sparing the
    ``keep_best`` with the lowest validation WER (``best_checkpoints``); the deleted."""
    if keep <= 0:
        return []
    spared = set(best_checkpoints(keep_best, checkpoint_dir)) if keep_best > 0 else set()
    old = [p for p in step_checkpoints(checkpoint_dir)[:-keep] if p not in spared]
    for path in old:
        path.unlink(missing_ok=True)
    return old


def estimated_checkpoint_bytes(module: torch.nn.Module) -> int:
    """What one step checkpoint of ``module`` takes: its parameters and buffers, plus AdamW's two
    float32 moments per parameter (a frozen encoder gets them too once it trains), plus 1%."""
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    moments = sum(2 * p.numel() * 4 for p in module.parameters())
    return int((weights + moments) * 1.01)


def checkpoint_room(size: int, directory: Path, keep: int) -> tuple[int, int, int]:
    """(checkpoints of ``size`` bytes that ``directory``'s file system has room for, how many it
    should have room for, free bytes). Wanted: the KEEP_CHECKPOINTS newest plus the one being
    written (its temporary file exists until the oldest is pruned); with every checkpoint kept
    (``keep`` 0), the next 3."""
    free = free_bytes(directory)
    room = int(free // size) if size else 0
    return room, 3 if keep == 0 else keep + 1, free


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a step checkpoint was saved at (its file is mapped, not read)."""
    return int(read_checkpoint(Path(path), mmap=True).get("global_step", 0))


def find_last_checkpoint(checkpoint_dir: Path | None = None) -> Path | None:
    """The step checkpoint with the highest step in ``checkpoint_dir`` (CHECKPOINT_DIR), or None.
    Temporary files of an interrupted save never match the name pattern."""
    found = step_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def resolve_resume_from(
    resume_from: str | None = None, checkpoint_dir: Path | None = None
) -> str | None:
    """``ckpt_path`` for trainer.fit from RESUME_FROM (``plan_resume(...).path``): '' -> None (fresh
    start); 'last' -> the newest readable step checkpoint in CHECKPOINT_DIR (None, logged, when
    there is none yet, so a restart loop can always pass RESUME_FROM=last); otherwise a path that
    must exist, or, for the requeue of a run that began there, the run's own newest checkpoint."""
    return plan_resume(resume_from, checkpoint_dir).path


@dataclass(frozen=True)
class ResumePlan:
    """What RESUME_FROM means for CHECKPOINT_DIR now.

    ``path``: the checkpoint trainer.fit resumes (None: a fresh start). ``kind``: ``fresh``,
    ``continue`` (the directory's newest readable checkpoint), ``branch`` (a checkpoint of another
    directory, into one without step files) or ``rewind`` (an older checkpoint of the directory).
    ``set_aside``: step files that leave the directory before the run starts (``apply_resume_plan``)
    because they are not on the timeline that continues: the later steps a rewind abandons, newer
    checkpoints that cannot be read, or, for a fresh start, a directory of only unreadable ones;
    ``aside_name`` names the folder they go to.
    """

    path: str | None
    kind: str
    set_aside: tuple[Path, ...] = ()
    aside_name: str = ""


def _step_of(path: Path) -> int:
    """The step a file of ``run_files`` belongs to, from its name (those names are the project's)."""
    return int(STEP_FILE_PATTERN.match(Path(path).name).group(1))


def _same_file(a: str | Path, b: str | Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


# Knobs a requeue may change without meaning a new timeline: how long it trains, how it saves,
# logs, loads and watches. Paths are left out too (a run directory can move to another disk), and
# so are the run-defining settings, which ``check_resume_settings`` checks on every resume.
REQUEUE_NEUTRAL_SETTINGS = frozenset(
    {
        *knob_values.RUN_DEFINING_SETTINGS,
        "DATA_SOURCES",
        "CACHE_DIR",
        "RESUME_FROM",
        "RESUME_CHANGES",
        "MAX_STEPS",
        "CHECKPOINT_EVERY",
        "KEEP_CHECKPOINTS",
        "KEEP_BEST_CHECKPOINTS",
        "EVAL_EVERY_STEPS",
        "EVAL_BASE",
        "EVAL_SAMPLES_PER_LANG",
        "VAL_LANGUAGE_GIVEN",
        "LANGUAGE_GIVEN_SCRIPTS",
        "AUTO_LANGUAGE",
        "FORGETTING_WARN_POINTS",
        "NUM_WORKERS",
        "CACHE_BUILD_WORKERS",
        "COLLECTIVE_TIMEOUT_MINUTES",
        "WATCHDOG_SECONDS",
        "MAX_EMPTY_STEPS",
        "AUDIO_CHECK_SAMPLES",
        "WANDB_MODE",
        "WANDB_PROJECT",
        "IGNORE_UNKNOWN_ENV",
        "ACCELERATOR",
        # How the step runs, not what it computes beyond rounding (step_speed.py).
        "USE_PYTORCH_SDPA",
        "JOINT_FUSED_BATCH_SIZE",
        "FUSED_ADAMW",
        "COMPILE_ENCODER",
        "MATMUL_PRECISION",
        "HOST_MEMORY_REUSE",
    }
)


def timeline_settings() -> dict[str, Any]:
    """This job's settings that shape the training itself (``config.run_settings`` less paths and
    ``REQUEUE_NEUTRAL_SETTINGS``): equal in a job and its requeue."""
    paths = {name for name, knob in config.KNOBS.items() if isinstance(knob.value, Path)}
    return {
        name: value
        for name, value in config.run_settings().items()
        if name not in REQUEUE_NEUTRAL_SETTINGS and name not in paths
    }


def job_record() -> dict[str, Any]:
    """What the job that starts a timeline (a branch or a rewind) records about itself in run.json
    (``started_by``), so that its requeue is told from a later job that names the same starting
    checkpoint on purpose: SLURM's job id (kept by a requeue) and ``timeline_settings``."""
    return {"slurm_job_id": os.environ.get("SLURM_JOB_ID") or None, "settings": timeline_settings()}


def _names_timeline_start(resume_from: str, record: dict[str, Any], directory: Path) -> bool:
    """Whether RESUME_FROM names the checkpoint the directory's timeline began at (``started_from``):
    the same path, or, for a rewind inside the directory, the same name there (the directory may
    have moved since)."""
    started = record.get("started_from")
    if not started:
        return False
    if _same_file(resume_from, started):
        return True
    return bool(
        record.get("started_inside")
        and Path(resume_from).name == Path(started).name
        and Path(resume_from).resolve().parent == directory.resolve()
    )


def _requeue_change(record: dict[str, Any]) -> str | None:
    """None when this job is the requeue of the one that began the timeline (the same SLURM job, or
    the same ``timeline_settings``); else what differs, which makes it a new rewind."""
    by = record.get("started_by")
    if by is None:  # a record without it: the path is all there is to go by
        return None
    job = os.environ.get("SLURM_JOB_ID")
    if job and by.get("slurm_job_id") == job:
        return None
    then, now = by.get("settings") or {}, timeline_settings()
    changed = [
        f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in sorted(now) if then.get(k) != now[k]
    ]
    return "; ".join(changed) or None


def plan_resume(resume_from: str | None = None, checkpoint_dir: Path | None = None) -> ResumePlan:
    """The ``ResumePlan`` of RESUME_FROM (default: config.RESUME_FROM) in CHECKPOINT_DIR. Moves and
    writes nothing, so every rank computes it and they agree (``apply_resume_plan`` acts, rank 0).

    A RESUME_FROM naming the checkpoint the directory's timeline began at (run.json's
    ``started_from``: where its run branched or rewound from) is one of two things, told apart by
    what that job recorded (``started_by``): its requeue (the same SLURM job, or the same
    ``timeline_settings``), which continues from the timeline's newest checkpoint, never from its
    start again; or a new rewind to it (other settings: a new learning rate, say), which abandons
    the timeline as any rewind does. The step of a checkpoint comes from the checkpoint, never from
    its name."""
    resume_from = config.RESUME_FROM if resume_from is None else resume_from
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    if not resume_from:
        found = step_checkpoints(directory)
        if found and all(checkpoint_problem(p) is not None for p in found):
            return ResumePlan(None, "fresh", tuple(run_files(directory)), "unreadable")
        return ResumePlan(None, "fresh")
    if resume_from == "best":
        raise CheckpointError(
            "RESUME_FROM=best: a resume continues a run from its newest state (RESUME_FROM=last). "
            "To train on from the best checkpoint, give its path (`python scripts/evaluate.py best` "
            "names it) with an empty CHECKPOINT_DIR: that starts a new run from it"
        )
    if resume_from == "last":
        return _newest_readable(directory, "RESUME_FROM=last")
    # Before the file must exist: pruning may have removed the checkpoint a rewind began at.
    record = read_run_record(directory)
    if _names_timeline_start(resume_from, record, directory) and step_checkpoints(directory):
        change = _requeue_change(record)
        if change is None:
            plan = _newest_readable(directory, f"RESUME_FROM={resume_from} (where this run began)")
            if plan.path is not None:
                return plan
        else:
            log.warning(
                "RESUME_FROM=%s is where this timeline began, and this job is not its requeue "
                "(%s): a new rewind to it (RESUME_FROM=last would continue the timeline)",
                resume_from,
                change,
            )
    if not Path(resume_from).is_file():
        raise FileNotFoundError(
            f"RESUME_FROM={resume_from}: no such checkpoint file; give a step_*.ckpt path, "
            f"'last' (newest in CHECKPOINT_DIR) or leave it empty"
        )
    if Path(resume_from).resolve().parent != directory.resolve():
        return ResumePlan(resume_from, "branch")
    problem = checkpoint_problem(Path(resume_from))
    if problem is not None:
        raise CheckpointError(f"RESUME_FROM={resume_from}: {problem}; give a readable checkpoint")
    step = checkpoint_step(resume_from)
    later = [p for p in run_files(directory) if _step_of(p) > step]
    if later:
        return ResumePlan(
            resume_from, "rewind", tuple(later), f"after_{checkpoint_name(step)[:-5]}"
        )
    return ResumePlan(resume_from, "continue")


def _newest_readable(directory: Path, what: str) -> ResumePlan:
    candidates = step_checkpoints(directory)[::-1]
    if not candidates:
        log.warning(
            "%s: no step checkpoint (step_*.ckpt) in CHECKPOINT_DIR=%s; starting fresh",
            what,
            directory,
        )
        return ResumePlan(None, "fresh")
    # A requeue loop must not fail forever on one bad file: take the newest that is complete.
    for path in candidates:
        if checkpoint_problem(path) is None:
            if path == candidates[0]:
                log.info("%s: resuming from %s", what, path)
                return ResumePlan(str(path), "continue")
            log.warning(
                "%s: the newest checkpoint %s cannot be used (%s); resuming from %s instead",
                what,
                candidates[0],
                checkpoint_problem(candidates[0]),
                path,
            )
            later = [p for p in run_files(directory) if _step_of(p) > _step_of(path)]
            return ResumePlan(str(path), "continue", tuple(later), "unreadable")
    raise CheckpointError(
        f"{what}: none of the {len(candidates)} step checkpoints in CHECKPOINT_DIR="
        f"{directory} can be opened (newest {candidates[0].name}: "
        f"{checkpoint_problem(candidates[0])}); set RESUME_FROM= to start fresh (they are moved "
        f"into a folder unreadable_<time> beside them)"
    )


def apply_resume_plan(plan: ResumePlan, checkpoint_dir: Path | None = None) -> Path | None:
    """On global rank 0: move ``plan.set_aside`` into CHECKPOINT_DIR/<aside_name>_<UTC time>/ with
    the validation scores run.json holds for them (a run.json of their own there); for a rewind,
    the run's record becomes that of a new timeline: a new W&B run (and metrics directory) named
    <name>-from-step_<step>, whose history starts after that step, ``started_from`` the
    rewound-to checkpoint. Other ranks do nothing. Returns the folder (None: nothing moved)."""
    if int(os.environ.get("RANK", "0")) != 0 or not (plan.set_aside or plan.kind == "rewind"):
        return None
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    record = read_run_record(directory)
    scores = record.get("validation", {})
    moved = {str(_step_of(p)) for p in plan.set_aside}
    aside = None
    if plan.set_aside:
        stamp = f"{plan.aside_name}_{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        aside = directory / stamp
        for n in range(2, 1000):  # two rewinds within a second must not share (and overwrite) one
            if not aside.exists():
                break
            aside = directory / f"{stamp}-{n}"
        aside.mkdir(parents=True)
        for path in plan.set_aside:
            path.rename(aside / path.name)
        _write_run_record(
            {**record, "validation": {k: v for k, v in scores.items() if k in moved}}, aside
        )
        log.warning(
            "moved %d step file(s) of CHECKPOINT_DIR=%s that the %s does not continue (%s) into %s",
            len(plan.set_aside),
            directory,
            "rewind" if plan.kind == "rewind" else "run",
            ", ".join(p.name for p in plan.set_aside),
            aside,
        )
    live = {k: v for k, v in scores.items() if k not in moved}
    if plan.kind == "rewind":
        base = record.get("base_name") or record.get("name") or new_run_name()
        if config.WANDB_RUN_NAME and config.WANDB_RUN_NAME not in (base, record.get("name")):
            base = config.WANDB_RUN_NAME  # a new name, meant (RESUME_CHANGES)
        wandb_id = secrets.token_hex(6)
        name = f"{base}-from-{checkpoint_name(checkpoint_step(plan.path))[:-5]}"
        if name == record.get("name"):  # rewound to where this timeline began: a run of its own
            name = f"{name}-{wandb_id[:4]}"
        record = {
            "name": name,
            "wandb_id": wandb_id,
            "base_name": base,
            "started_from": os.path.abspath(plan.path),
            "started_inside": True,
            "started_by": job_record(),
        }
        log.warning(
            "rewind to %s: the run goes on as W&B run %r (metrics under WANDB_LOG_DIR/%s)",
            plan.path,
            name,
            name,
        )
    elif plan.kind == "fresh":
        record = {}
    if live or record:
        _write_run_record({**record, **({"validation": live} if live else {})}, directory)
    elif (directory / RUN_RECORD).exists():
        (directory / RUN_RECORD).unlink()
    return aside


def resolve_model_path(model: str) -> Path:
    """``model`` as a path to a .nemo file or a step checkpoint; 'last' = the newest step checkpoint
    in CHECKPOINT_DIR, 'best' = the one with the lowest validation WER (``best_checkpoints``)."""
    if model == "best":
        return best_checkpoints(1, strict=True)[0]
    if model == "last":
        found = find_last_checkpoint()
        if found is None:
            raise FileNotFoundError(
                f"'last': no step_*.ckpt in CHECKPOINT_DIR={config.CHECKPOINT_DIR}"
            )
        return found
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(
            f"model {path} does not exist; give a .nemo file, a step_*.ckpt, 'last' or 'best'"
        )
    if path.suffix not in (".nemo", ".ckpt"):
        raise ValueError(f"model {path}: expected a .nemo file or a .ckpt step checkpoint")
    return path


# ---- RNG states of an exact resume ------------------------------------------------------------


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


# ---- the run's identity -------------------------------------------------------------------------


def new_run_name() -> str:
    """WANDB_RUN_NAME, else run-<UTC time>: the name of a run that starts fresh."""
    return config.WANDB_RUN_NAME or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())


RUN_RECORD = "run.json"
# The key of a step checkpoint that holds the run as its model card tells it
# (``training_step.TrainingModule.run_record``).
RUN_RECORD_KEY = "run_record"
# The key of a step checkpoint that holds the model's portable description (asr_model.py writes
# it: class, config, tokenizer files), read without building the model.
PORTABLE_KEY = "asr_model"
# What run.json says about the timeline, kept when a job starts a new W&B run on it.
TIMELINE_KEYS = frozenset({"validation", "started_from", "started_inside", "started_by"})


def read_run_record(checkpoint_dir: Path | None = None) -> dict[str, Any]:
    """CHECKPOINT_DIR/run.json ({} when there is none or it cannot be read)."""
    record = Path(checkpoint_dir or config.CHECKPOINT_DIR) / RUN_RECORD
    try:
        return json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_run_record(data: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
    record = Path(checkpoint_dir or config.CHECKPOINT_DIR) / RUN_RECORD
    record.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1)
    atomic_write(record, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def run_identity(
    resuming: bool, checkpoint_dir: Path | None = None, resume_path: str | Path | None = None
) -> tuple[str, str]:
    """(run name, W&B run id) of this job.

    A job that resumes a checkpoint of CHECKPOINT_DIR reuses the pair recorded in CHECKPOINT_DIR/
    run.json by the job that wrote it, so W&B continues the same run (Lightning's WandbLogger passes
    resume="allow") and metrics.jsonl stays one file across crashes and requeues; an explicit
    WANDB_RUN_NAME that names neither the record's run nor the name it was started under
    (``base_name``, a rewind's) starts a new run under that name (RESUME_CHANGES allowed it). A
    checkpoint resumed from another directory starts a new run (a branch of its run) and records
    it as ``started_from``, so the branch's requeue, which names it again, continues the branch
    (``plan_resume``). A fresh job takes WANDB_RUN_NAME (else run-<UTC time>) and a new id, and
    global rank 0 records them.
    """
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    saved = read_run_record(directory)
    inside = resume_path is None or Path(resume_path).resolve().parent == directory.resolve()
    if resume_path is not None and saved.get("started_from"):
        inside = inside or _same_file(resume_path, saved["started_from"])
    if resuming and inside and {"name", "wandb_id"} <= saved.keys():
        if config.WANDB_RUN_NAME in ("", saved["name"], saved.get("base_name")):
            return saved["name"], saved["wandb_id"]
    name = new_run_name()
    identity = (name, secrets.token_hex(6))
    if int(os.environ.get("RANK", "0")) == 0:
        record: dict[str, Any] = {"name": identity[0], "wandb_id": identity[1]}
        if resuming and inside:
            # the scores of the checkpoints still here, and where the timeline began
            record |= {k: saved[k] for k in saved.keys() & TIMELINE_KEYS}
        elif resuming:
            record["started_from"] = os.path.abspath(resume_path)
            record["started_by"] = job_record()
        _write_run_record(record, directory)
    return identity


def record_log_dir(log_dir: Path, checkpoint_dir: Path | None = None) -> None:
    """Note in run.json the directory the run's metrics.jsonl is in (``log_dir``)."""
    data = read_run_record(checkpoint_dir)
    if data.get("log_dir") != str(Path(log_dir).resolve()):
        data["log_dir"] = str(Path(log_dir).resolve())
        _write_run_record(data, checkpoint_dir)


STEP_FILE_PATTERN = re.compile(r"^step_(\d+)\.")


def run_files(checkpoint_dir: Path | None = None) -> list[Path]:
    """What a run leaves in CHECKPOINT_DIR under names another run would reuse: its step
    checkpoints, then every other file named after a step (``step_<N>.<anything>``: the exports,
    their model cards, averages and blends, the WER tables evaluate.py writes beside them), by
    step. A rewind moves all of a step's files together (``plan_resume``)."""
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    if not directory.is_dir():
        return []
    checkpoints = step_checkpoints(directory)
    others = sorted(
        (int(m.group(1)), p.name, p)
        for p in directory.iterdir()
        if (m := STEP_FILE_PATTERN.match(p.name)) and p not in checkpoints and not p.is_dir()
    )
    return checkpoints + [p for _, _, p in others]


def check_directory_for_run(
    resume_path: str | Path | None,
    checkpoint_dir: Path | None = None,
    set_aside: tuple[Path, ...] = (),
) -> None:
    """CheckpointError when this job would write into another run's CHECKPOINT_DIR: a fresh run
    (``resume_path`` None) where step files exist, or a resume of a checkpoint from another directory
    into one that holds step files. Its overwritten and mixed checkpoints would make ``last`` and
    ``best`` name another run's files. Files the job moves aside first (``set_aside``, of its
    ``ResumePlan``) do not count."""
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    if resume_path is not None and Path(resume_path).resolve().parent == directory.resolve():
        return
    files = [p for p in run_files(directory) if p not in set_aside]
    if not files:
        return
    name = read_run_record(directory).get("name")
    owner = f"run {name!r}" if name else "another run"
    newest = [p for p in files if p.suffix == ".ckpt"][-1:] or files[-1:]
    what = (
        f"a resume of {resume_path} (a checkpoint of another directory) there"
        if resume_path is not None
        else "a fresh run there"
    )
    raise CheckpointError(
        f"CHECKPOINT_DIR={directory} holds {owner} ({len(files)} step files, newest "
        f"{newest[0].name}): {what} would overwrite and mix with its checkpoints. Continue that run "
        f"with RESUME_FROM=last, or give this run its own CHECKPOINT_DIR (or DATA_DIR)"
    )


def run_defining_changes(recorded: dict[str, Any]) -> list[str]:
    """How this job's run-defining settings (knob_values.RUN_DEFINING_SETTINGS) differ from ``recorded``,
    the ``run_record`` a step checkpoint carries, as ``NAME 'old' -> 'new'``, leaving out those
    RESUME_CHANGES names. MODEL_CONFIG counts only while INIT_MODEL is empty (it builds the model
    then); an empty WANDB_RUN_NAME continues the recorded run's name, and so does the name itself."""
    settings = recorded.get("settings") or {}
    now = config.run_settings()
    changes = []
    for name in knob_values.RUN_DEFINING_SETTINGS:
        if name in config.RESUME_CHANGES or name not in settings:
            continue
        old, new = settings[name], now[name]
        if name == "MODEL_CONFIG" and (now["INIT_MODEL"] or settings.get("INIT_MODEL")):
            continue
        if name == "WANDB_RUN_NAME":
            same = new in ("", old, (recorded.get("run") or {}).get("name"))
        elif name in ("TOKENIZER_DIR", "MODEL_CONFIG", "TRAIN_MANIFEST_PATH"):
            same = old is not None and new is not None and _same_file(old, new)
        else:
            same = old == new
        if not same:
            changes.append(f"{name} {old!r} -> {new!r}")
    return changes


def check_resume_settings(resume_path: str | Path, checkpoint_dir: Path | None = None) -> None:
    """CheckpointError when the step checkpoint ``resume_path`` was trained with other run-defining
    settings than this job's (``run_defining_changes``): it would continue that run as if it were
    this one (and a wrong CHECKPOINT_DIR would rename it, overwrite its settings and mix metrics).
    One line: the changes, both directories, and RESUME_CHANGES to say a change is meant."""
    recorded = read_checkpoint(Path(resume_path), mmap=True).get("run_record") or {}
    if not recorded.get("settings"):
        log.warning(
            "%s records no settings: its INIT_MODEL, tokenizer and train manifest are not compared "
            "with this job's",
            resume_path,
        )
        return
    changes = run_defining_changes(recorded)
    if not changes:
        return
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    source = config.KNOBS["CHECKPOINT_DIR"].source
    name = (recorded.get("run") or {}).get("name")
    names = ",".join(c.split(" ", 1)[0] for c in changes)
    raise CheckpointError(
        f"RESUME_FROM={config.RESUME_FROM} resolves to {resume_path} (in "
        f"{Path(resume_path).resolve().parent}) of run {name!r}, trained with other settings than "
        f"this job's: {'; '.join(changes)}; CHECKPOINT_DIR={directory}"
        f"{' (derived from DATA_DIR)' if source != 'env' else ''}. If that is another run, point "
        f"CHECKPOINT_DIR at this run's own directory; to continue it with these settings, set "
        f"RESUME_CHANGES={names}"
    )


def record_validation(step: int, evaluation: dict[str, Any] | None, checkpoint_dir=None) -> bool:
    """Note in run.json the validation of the checkpoint of ``step`` (an evaluation of that very
    step: ``TrainingModule.last_evaluation``) and how its texts were compared (its ``scoring``);
    False when there is none for this step."""
    if not evaluation or evaluation.get("step") != step:
        return False
    overall = (evaluation.get("results") or {}).get("all")
    if not overall or not overall.get("words"):
        return False
    data = read_run_record(checkpoint_dir)
    data.setdefault("validation", {})[str(step)] = {
        "wer": overall["word_edits"] / overall["words"],
        "cer": overall["char_edits"] / overall["chars"] if overall.get("chars") else None,
        "loss": evaluation.get("loss"),
        "scoring": evaluation.get("scoring"),
    }
    _write_run_record(data, checkpoint_dir)
    return True


# A checkpoint whose scoring cannot be read (``validation_scoring``): it is never among the best.
_UNREADABLE = object()


# What a checkpoint's own run record says of its scoring, by (path, size, mtime): a run that prunes
# at every save reads each checkpoint of an older run.json once, not at every save.
_scoring_read: dict[tuple[str, int, int], Any] = {}


def validation_scoring(entry: dict[str, Any], path: Path) -> Any:
    """How the validation WER of run.json's ``entry`` for the step checkpoint ``path`` compared
    texts: the entry's ``scoring`` (None: as written, tags stripped); for an entry without one (a
    run.json older than the field), the ``scoring`` of the validation the checkpoint itself carries
    (its run record's ``evaluation`` of that step), read once per process and file;
    ``_UNREADABLE`` when the checkpoint cannot be read."""
    if "scoring" in entry:
        return entry["scoring"]
    try:
        stat = path.stat()
    except OSError:
        return _UNREADABLE
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _scoring_read:
        try:
            record = read_checkpoint(path, mmap=True).get(RUN_RECORD_KEY) or {}
        except CheckpointError:
            return _UNREADABLE
        evaluation = record.get("evaluation") or {}
        _scoring_read[key] = (
            evaluation.get("scoring") if evaluation.get("step") == checkpoint_number(path) else None
        )
    return _scoring_read[key]


def best_checkpoints(
    n: int, checkpoint_dir: Path | None = None, *, strict: bool = False
) -> list[Path]:
    """The ``n`` step checkpoints of CHECKPOINT_DIR with the lowest validation WER (val/wer/all, as
    run.json records it; ties go to the later step), best first. Only WERs scored alike are
    compared: those scored as the newest of these checkpoints was (``validation_scoring``), so a
    run resumed across a change of scoring (texts as written, then normalized) never ranks one
    kind against the other. ``strict``: a CheckpointError when fewer than ``n`` exist (else: as
    many as there are)."""
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    scores = read_run_record(directory).get("validation", {})
    scored = [
        (path, scores[str(checkpoint_number(path))])
        for path in step_checkpoints(directory)
        if str(checkpoint_number(path)) in scores
    ]
    scoring = {path: validation_scoring(entry, path) for path, entry in scored}
    readable = [path for path, _ in scored if scoring[path] is not _UNREADABLE]
    newest = scoring[readable[-1]] if readable else None
    ranked = sorted(
        (entry["wer"], -checkpoint_number(path), path)
        for path, entry in scored
        if path in readable and scoring[path] == newest
    )
    best = [path for _, _, path in ranked[: max(0, n)]]
    if strict and len(best) < n:
        other = len(scored) - len(ranked)
        raise CheckpointError(
            f"'best': {len(best)} step checkpoint(s) in CHECKPOINT_DIR={directory} have a validation "
            f"score in {RUN_RECORD}, {n} asked for"
            + (
                f" ({other} more scored otherwise or unreadable: WERs of texts compared "
                f"differently are not ranked together)"
                if other
                else ""
            )
            + ". Only checkpoints saved at a validation step are scored (EVAL_EVERY_STEPS, "
            "default CHECKPOINT_EVERY); use 'last' or a path"
        )
    return best
