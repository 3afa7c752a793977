"""What a run keeps on disk, and how it finds it again.

Step checkpoints (``checkpoint_name``, written whole or not at all by ``AtomicCheckpointIO``),
``find_last_checkpoint`` and ``resolve_resume_from`` (RESUME_FROM), ``resolve_model_path`` (the model
argument of the scripts), ``export_nemo``, the RNG states an exact resume restores, and the run's
identity (``run_identity``: its name and W&B id, recorded in CHECKPOINT_DIR/run.json so a resumed job
continues the same run).
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
from atomic_files import atomic_write, disk_full, write_together
from process_control import UserError

log = logging.getLogger("checkpoints")


CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)\.ckpt$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.ckpt"


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
        return read_checkpoint(
            Path(path),
            lambda: super(AtomicCheckpointIO, self).load_checkpoint(path, *args, **kwargs),
            advice="resume from an older one (RESUME_FROM=<path>, or RESUME_FROM=last skips "
            "unreadable ones) or delete it",
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


def prune_checkpoints(keep: int, checkpoint_dir: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` step checkpoints (keep <= 0: delete none); the deleted."""
    if keep <= 0:
        return []
    old = step_checkpoints(checkpoint_dir)[:-keep]
    for path in old:
        path.unlink(missing_ok=True)
    return old


def estimated_checkpoint_bytes(module: torch.nn.Module) -> int:
    """What one step checkpoint of ``module`` takes: its parameters and buffers, plus AdamW's two
    float32 moments per parameter (a frozen encoder gets them too once it trains), plus 1%."""
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    moments = sum(2 * p.numel() * 4 for p in module.parameters())
    return int((weights + moments) * 1.01)


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


def export_nemo(model, path: str | os.PathLike, record: dict[str, Any] | None = None) -> Path:
    """``model.save_to`` a .nemo file and write its model card beside it (``model_card``, from the
    run ``record``), as one set (``atomic_files.write_together``, the card last): a crash leaves
    the previous pair, or the new .nemo without a card, never a card describing another model."""
    import model_card

    path = Path(path)
    text = model_card.render(record or {}, model, path.name)
    write_together(
        {
            path: lambda tmp: model.save_to(tmp),
            model_card.card_path(path): lambda tmp: Path(tmp).write_text(text, encoding="utf-8"),
        },
        f"{os.getpid()}",
    )
    return path


def resolve_model_path(model: str) -> Path:
    """``model`` as a path to a .nemo file or a step checkpoint; 'last' = the newest step checkpoint
    in CHECKPOINT_DIR."""
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
            f"model {path} does not exist; give a .nemo file, a step_*.ckpt or 'last'"
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


def run_identity(resuming: bool, checkpoint_dir: Path | None = None) -> tuple[str, str]:
    """(run name, W&B run id) of this job.

    A job that resumes from a checkpoint reuses the pair recorded in CHECKPOINT_DIR/run.json by the
    job that wrote it, so W&B continues the same run (Lightning's WandbLogger passes resume="allow")
    and metrics.jsonl stays one file across crashes and requeues; an explicit WANDB_RUN_NAME that
    differs from the record starts a new run under that name. A fresh job takes WANDB_RUN_NAME (else
    run-<UTC time>) and a new id, and global rank 0 records them.
    """
    record = Path(checkpoint_dir or config.CHECKPOINT_DIR) / RUN_RECORD
    if resuming and record.is_file():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if not config.WANDB_RUN_NAME or config.WANDB_RUN_NAME == saved["name"]:
            return saved["name"], saved["wandb_id"]
    name = new_run_name()
    identity = (name, secrets.token_hex(6))
    if int(os.environ.get("RANK", "0")) == 0:
        record.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"name": identity[0], "wandb_id": identity[1]})
        atomic_write(record, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return identity
