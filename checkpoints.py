"""What a run keeps on disk, and how it finds it again.

Step checkpoints (``checkpoint_name``, written whole or not at all by ``AtomicCheckpointIO``),
``find_last_checkpoint`` and ``resolve_resume_from`` (RESUME_FROM), ``resolve_model_path`` (the model
argument of the scripts: a path, ``last`` or ``best``), the RNG states an exact
resume restores, and the run's ledger, CHECKPOINT_DIR/run.json: its identity (``run_identity``: name
and W&B id, so a resumed job continues the same run) and the validation WER of each checkpoint
(``record_validation``, ``best_checkpoints``), which keeps the best checkpoint through pruning.

One directory, one run: a fresh run refuses a CHECKPOINT_DIR that holds another run's step files,
and so does a resume of a checkpoint from elsewhere (``check_directory_for_run``), so ``last`` and
``best`` always mean the checkpoints of the run that directory belongs to.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

import config
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
    load: Callable[[], dict[str, Any]] | None = None,
    advice: str = "use an older step_*.ckpt or delete it",
    *,
    mmap: bool = False,
) -> dict[str, Any]:
    """``load()`` (default: torch.load on the CPU) of the step checkpoint at ``path``, after the
    cheap ``checkpoint_problem`` check; any failure is a CheckpointError naming the path, the cause
    and ``advice``. ``mmap``: the default load maps the file instead of reading it, so tensors that
    are never touched (a reader of the weights leaves AdamW's moments alone) cost no memory."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"cannot load checkpoint {path}: {problem}; {advice}")
    try:
        if load is None:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        return load()
    except Exception as exc:
        raise CheckpointError(
            f"cannot load checkpoint {path}: {type(exc).__name__}: {exc}; {advice}"
        ) from exc


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
    """``ckpt_path`` for trainer.fit from RESUME_FROM: '' -> None (fresh start); 'last' -> the newest
    step checkpoint in CHECKPOINT_DIR (None, logged, when there is none yet, so a restart loop can
    always pass RESUME_FROM=last); otherwise a path that must exist."""
    resume_from = config.RESUME_FROM if resume_from is None else resume_from
    if not resume_from:
        return None
    if resume_from == "best":
        raise CheckpointError(
            "RESUME_FROM=best: a resume continues a run from its newest state (RESUME_FROM=last). "
            "To train on from the best checkpoint, give its path (`python scripts/evaluate.py best` "
            "names it) with an empty CHECKPOINT_DIR: that starts a new run from it"
        )
    if resume_from == "last":
        directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
        candidates = step_checkpoints(directory)[::-1]
        if not candidates:
            log.warning(
                "RESUME_FROM=last: no step checkpoint (step_*.ckpt) in CHECKPOINT_DIR=%s; starting fresh",
                directory,
            )
            return None
        # A requeue loop must not fail forever on one bad file: take the newest that is complete.
        for path in candidates:
            problem = checkpoint_problem(path)
            if problem is None:
                if path != candidates[0]:
                    log.warning(
                        "RESUME_FROM=last: the newest checkpoint %s cannot be used (%s); resuming "
                        "from %s instead",
                        candidates[0],
                        checkpoint_problem(candidates[0]),
                        path,
                    )
                else:
                    log.info("RESUME_FROM=last: resuming from %s", path)
                return str(path)
        raise CheckpointError(
            f"RESUME_FROM=last: none of the {len(candidates)} step checkpoints in CHECKPOINT_DIR="
            f"{directory} can be opened (newest {candidates[0].name}: "
            f"{checkpoint_problem(candidates[0])}); set RESUME_FROM= to start fresh"
        )
    if not Path(resume_from).is_file():
        raise FileNotFoundError(
            f"RESUME_FROM={resume_from}: no such checkpoint file; give a step_*.ckpt path, "
            f"'last' (newest in CHECKPOINT_DIR) or leave it empty"
        )
    return resume_from


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
    WANDB_RUN_NAME that differs from the record starts a new run under that name, and so does a
    checkpoint resumed from another directory (a branch of its run). A fresh job takes
    WANDB_RUN_NAME (else run-<UTC time>) and a new id, and global rank 0 records them.
    """
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    saved = read_run_record(directory)
    inside = resume_path is None or Path(resume_path).resolve().parent == directory.resolve()
    if resuming and inside and {"name", "wandb_id"} <= saved.keys():
        if not config.WANDB_RUN_NAME or config.WANDB_RUN_NAME == saved["name"]:
            return saved["name"], saved["wandb_id"]
    name = new_run_name()
    identity = (name, secrets.token_hex(6))
    if int(os.environ.get("RANK", "0")) == 0:
        record = {"name": identity[0], "wandb_id": identity[1]}
        if resuming and inside and "validation" in saved:
            record["validation"] = saved["validation"]  # the scores of the checkpoints still here
        _write_run_record(record, directory)
    return identity


def run_files(checkpoint_dir: Path | None = None) -> list[Path]:
    """What a run leaves in CHECKPOINT_DIR under names another run would reuse: its step
    checkpoints and step_*.nemo exports, oldest checkpoint first."""
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    if not directory.is_dir():
        return []
    return step_checkpoints(directory) + sorted(directory.glob("step_*.nemo"))


def check_directory_for_run(
    resume_path: str | Path | None, checkpoint_dir: Path | None = None
) -> None:
    """CheckpointError when this job would write into another run's CHECKPOINT_DIR: a fresh run
    (``resume_path`` None) where step files exist, or a resume of a checkpoint from another directory
    into one that holds step files. Its overwritten and mixed checkpoints would make ``last`` and
    ``best`` name another run's files."""
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    if resume_path is not None and Path(resume_path).resolve().parent == directory.resolve():
        return
    files = run_files(directory)
    if not files:
        return
    name = read_run_record(directory).get("name")
    owner = f"run {name!r}" if name else "another run"
    newest = step_checkpoints(directory)[-1:] or files[-1:]
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


def record_validation(step: int, evaluation: dict[str, Any] | None, checkpoint_dir=None) -> bool:
    """Note in run.json the validation of the checkpoint of ``step`` (an evaluation of that very
    step: ``TrainingModule.last_evaluation``); False when there is none for this step."""
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
    }
    _write_run_record(data, checkpoint_dir)
    return True


def best_checkpoints(
    n: int, checkpoint_dir: Path | None = None, *, strict: bool = False
) -> list[Path]:
    """The ``n`` step checkpoints of CHECKPOINT_DIR with the lowest validation WER (val/wer/all, as
    run.json records it; ties go to the later step), best first. ``strict``: a CheckpointError when
    fewer than ``n`` exist (else: as many as there are)."""
    directory = Path(checkpoint_dir or config.CHECKPOINT_DIR)
    scores = read_run_record(directory).get("validation", {})
    scored = [
        (scores[str(step)]["wer"], -step, path)
        for path in step_checkpoints(directory)
        if str(step := checkpoint_number(path)) in scores
    ]
    best = [path for _, _, path in sorted(scored)[: max(0, n)]]
    if strict and len(best) < n:
        raise CheckpointError(
            f"'best': {len(best)} step checkpoint(s) in CHECKPOINT_DIR={directory} have a validation "
            f"score in {RUN_RECORD}, {n} asked for. Only checkpoints saved at a validation step are "
            f"scored (EVAL_EVERY_STEPS, default CHECKPOINT_EVERY); use 'last' or a path"
        )
    return best
