"""Where a run's metrics go: W&B and a local JSON-lines file, under WANDB_LOG_DIR/<run name>.

``build_loggers`` gives the Lightning loggers of one run (W&B online, offline or disabled, and
``JsonlMetricsLogger``); ``run_directory`` says where a run's files live; ``log_to_loggers`` sends
scalars from global rank 0. The run's name and W&B id survive a resume (``checkpoints.run_identity``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

import checkpoints
import config
from atomic_files import atomic_write


def _json_setting(value: Any) -> Any:
    """A setting as JSON keeps its type (number, bool, string, null, list); anything else is its str."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return _json_value(value)
    if isinstance(value, (list, tuple)):
        return [_json_setting(v) for v in value]
    return str(value)


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
        # The last step earlier jobs of this run logged (build_loggers sets it when resuming).
        self.logged_through = -1

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
            {k: _json_setting(v) for k, v in params.items()},
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
    log_dir = Path(log_dir or config.WANDB_LOG_DIR)
    name = run_name or checkpoints.new_run_name()
    return log_dir / name


def build_loggers(run_dir: Path | None = None, resuming: bool = False) -> list[Logger]:
    """[WandbLogger (unless WANDB_MODE resolves to disabled), JsonlMetricsLogger] for one run.

    W&B mode: config.wandb_mode() (WANDB_MODE, else online with WANDB_API_KEY, else offline). An
    offline run lives in <run dir>/wandb/offline-run-*/ and is uploaded later with
    ``wandb sync <that dir>``. Name and W&B id come from ``run_identity``: a resumed job continues
    its run.
    """
    name, run_id = checkpoints.run_identity(resuming)
    run_dir = Path(run_dir or run_directory(name))
    loggers: list[Logger] = []
    mode = config.wandb_mode()
    if mode != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        if int(os.environ.get("RANK", "0")) == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
        loggers.append(
            WandbLogger(
                project=config.WANDB_PROJECT,
                name=name,
                id=run_id,
                save_dir=str(run_dir),
                mode=mode,
                log_model=False,
            )
        )
    jsonl = JsonlMetricsLogger(run_dir / "metrics.jsonl")
    if resuming:
        jsonl.logged_through = last_logged_step(jsonl.path)
    loggers.append(jsonl)
    return loggers


def last_logged_step(metrics_path: Path) -> int:
    """The highest step in a run's metrics.jsonl (-1 when there is none): what earlier jobs of the
    run already logged."""
    last = -1
    try:
        with open(metrics_path, encoding="utf-8") as f:
            for line in f:
                try:
                    step = json.loads(line).get("step")
                except ValueError:  # a line cut by a crash
                    continue
                if isinstance(step, int):
                    last = max(last, step)
    except FileNotFoundError:
        pass
    return last


def already_logged(trainer, step: int) -> bool:
    """Whether an earlier job of this run logged ``step``: a resumed job redoes the steps between its
    checkpoint and the crash, and logging them again would put them twice into one history (W&B,
    ``wandb sync`` of the run's offline directories, metrics.jsonl). With an exact resume the redone
    steps compute what was logged the first time."""
    return any(step <= getattr(logger, "logged_through", -1) for logger in trainer.loggers)


def log_to_loggers(trainer, metrics: dict[str, float], step: int) -> None:
    """Scalars to every logger of ``trainer``, from global rank 0 only, unless an earlier job of
    the run logged ``step`` already (``already_logged``)."""
    if trainer.is_global_zero and not already_logged(trainer, step):
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
