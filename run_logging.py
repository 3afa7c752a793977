"""Where a run's metrics go: W&B and a local JSON-lines file, under WANDB_LOG_DIR/<run name>.

``build_loggers`` gives the Lightning loggers of one run (W&B online, offline or disabled, and
``JsonlMetricsLogger``); ``run_directory`` says where a run's files live; ``log_to_loggers`` sends
scalars from global rank 0. The run's name and W&B id survive a resume (``checkpoints.run_identity``).

W&B never ends a run (``ResilientWandbLogger``): a server that cannot be reached at start-up turns
the run into an offline one within a bounded wait (``WANDB_PROBE_SECONDS`` for the probe, then
``WANDB_INIT_SECONDS`` for wandb.init), and a W&B that fails later (its service process killed by the
signal that preempts the job, a lost connection) is a warning: metrics.jsonl keeps every value.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.loggers.logger import DummyExperiment, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

import checkpoints
import config
from atomic_files import atomic_write

log = logging.getLogger("run_logging")

# How long a job waits for W&B before it logs offline: the reachability probe, then wandb.init.
WANDB_PROBE_SECONDS = 10.0
WANDB_INIT_SECONDS = 60.0


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


def wandb_base_url() -> str:
    """The W&B server this process would talk to: WANDB_BASE_URL, else W&B's default."""
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def wandb_reachable(url: str | None = None, timeout: float = WANDB_PROBE_SECONDS) -> str | None:
    """None when the W&B server answers an HTTP request within ``timeout`` seconds (any status),
    else why not (connection refused, no route, DNS, timeout)."""
    url = url or wandb_base_url()
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{url}: {type(reason).__name__}: {reason}"


class ResilientWandbLogger(WandbLogger):
    """Lightning's WandbLogger that never ends the run it logs.

    - Start: in online mode the server is probed first (``wandb_reachable``); unreachable, or a
      wandb.init that fails or exceeds WANDB_INIT_SECONDS, gives one warning and an offline run in
      the same directory with the same id, so ``wandb sync`` uploads it into the same run later.
      This holds for an explicit WANDB_MODE=online too: the GPUs are worth more than a live chart,
      and nothing is lost (the offline run and metrics.jsonl hold every value).
    - Later: an exception while logging (W&B's service process killed by the signal that preempts
      the job, a lost connection) is one warning; W&B is left alone for the rest of the process
      and the run, its checkpoint save included, goes on.
    """

    def __init__(self, *args: Any, mode: str = "offline", **kwargs: Any):
        settings = kwargs.pop("settings", None)
        if settings is None:
            import wandb

            settings = wandb.Settings(init_timeout=WANDB_INIT_SECONDS)
        super().__init__(*args, mode=mode, settings=settings, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)  # W&B warns that the setting does nothing
        self.failed: str | None = None

    @property
    @rank_zero_experiment
    def experiment(self):
        if self.failed is not None:
            return DummyExperiment()
        if self._experiment is not None:
            return self._experiment
        if self._wandb_init.get("mode") == "online":
            problem = wandb_reachable()
            if problem is not None:
                self._go_offline(f"cannot reach the W&B server ({problem})")
        try:
            return WandbLogger.experiment.fget(self)
        except Exception as exc:  # wandb raises its own CommError / UsageError / timeouts
            if self._wandb_init.get("mode") != "online":
                self._give_up(exc)
                return DummyExperiment()
            self._go_offline(f"wandb.init failed ({_first_line(exc)})")
            try:  # the failed online attempt keeps the run id registered in this process
                import wandb

                wandb.teardown()
            except Exception:
                pass
        try:
            return WandbLogger.experiment.fget(self)
        except Exception as exc:
            self._give_up(exc)
            return DummyExperiment()

    def _go_offline(self, why: str) -> None:
        self._wandb_init["mode"] = "offline"
        log.warning(
            "%s: this run logs to W&B offline under %s and trains on; upload it later with "
            "`wandb sync %s/wandb/offline-run-*`",
            why,
            self._wandb_init.get("dir"),
            self._wandb_init.get("dir"),
        )

    def _give_up(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = _first_line(exc)
            log.warning(
                "W&B stopped working (%s); the run goes on without it, every metric is in "
                "metrics.jsonl beside it",
                self.failed,
            )
            _forget_wandb_service()

    def _guarded(self, call, *args: Any, **kwargs: Any) -> None:
        if self.failed is not None:
            return
        try:
            call(*args, **kwargs)
        except Exception as exc:
            self._give_up(exc)

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        self._guarded(super().log_metrics, metrics, step)

    @rank_zero_only
    def log_hyperparams(self, params, *args: Any, **kwargs: Any) -> None:
        self._guarded(super().log_hyperparams, params, *args, **kwargs)

    @rank_zero_only
    def log_table(self, *args: Any, **kwargs: Any) -> None:
        self._guarded(super().log_table, *args, **kwargs)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._guarded(super().finalize, status)


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:limit]}"


def _forget_wandb_service() -> None:
    """Unregister W&B's exit hook when its service process is gone: at exit it would only print
    the lost connection's traceback (wandb 0.31 internals; nothing happens where they differ)."""
    try:
        from wandb.sdk import wandb_setup

        connection = getattr(wandb_setup._singleton, "_connection", None)
        cleanup = getattr(connection, "_cleanup", None)
        if callable(cleanup):
            cleanup()
    except Exception:
        pass


def run_directory(run_name: str | None = None, log_dir: Path | None = None) -> Path:
    """WANDB_LOG_DIR/<run name>: the W&B files (wandb/offline-run-*) and metrics.jsonl of one run.

    The name is ``run_name``, else WANDB_RUN_NAME, else run-<UTC time>; only global rank 0 writes there.
    """
    log_dir = Path(log_dir or config.WANDB_LOG_DIR)
    name = run_name or checkpoints.new_run_name()
    return log_dir / name


RUN_ID_FILE = "wandb_id"


def own_run_directory(run_dir: Path, run_id: str, recorded: dict) -> Path:
    """``run_dir``, unless another run logs there: then ``<run_dir>-<run_id>``, with a warning.

    A run directory is claimed by the W&B run id in its ``wandb_id`` file (written by global rank 0
    at the run's first job). A directory naming another id belongs to another run of the same name
    (WANDB_RUN_NAME reused in another CHECKPOINT_DIR, or a branch that kept its source's name):
    writing there would append this run's steps to that run's metrics.jsonl and overwrite its
    hparams.json. One holding metrics.jsonl but no id (a run that began before runs claimed their
    directory) is this run's only when this job continues the run CHECKPOINT_DIR/run.json recorded
    before it (``recorded``: the same W&B id, and no metrics directory of another name noted
    there); it is then claimed. The directory chosen is recorded in run.json (``log_dir``), where
    scripts/run_report.py finds it."""
    marker = run_dir / RUN_ID_FILE
    try:
        owner = marker.read_text(encoding="utf-8").strip()
    except OSError:
        owner = None
    # By name: the recorded path is stale once the logs move to another disk.
    noted = recorded.get("log_dir")
    continues = recorded.get("wandb_id") == run_id and (
        noted is None or Path(noted).name == run_dir.name
    )
    theirs = (owner is not None and owner != run_id) or (
        owner is None and not continues and (run_dir / "metrics.jsonl").exists()
    )
    chosen = run_dir.with_name(f"{run_dir.name}-{run_id}") if theirs else run_dir
    if int(os.environ.get("RANK", "0")) == 0:
        if theirs:
            log.warning(
                "%s holds another run's metrics (W&B id %s): this run (id %s) logs to %s instead",
                run_dir,
                owner or "not recorded",
                run_id,
                chosen,
            )
        chosen.mkdir(parents=True, exist_ok=True)
        if not (chosen / RUN_ID_FILE).exists():
            (chosen / RUN_ID_FILE).write_text(run_id + "\n", encoding="utf-8")
        checkpoints.record_log_dir(chosen)
    return chosen


def wandb_installed() -> bool:
    """Whether the wandb package imports here (a GPU image may not ship it)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


def build_loggers(run_dir: Path | None = None, resume_path: str | None = None) -> list[Logger]:
    """[ResilientWandbLogger (unless WANDB_MODE resolves to disabled), JsonlMetricsLogger] for one run.

    W&B mode: config.wandb_mode() (WANDB_MODE, else online with WANDB_API_KEY, else offline). An
    offline run lives in <run dir>/wandb/offline-run-*/ and is uploaded later with
    ``wandb sync <that dir>``. Name and W&B id come from ``run_identity``: a job resuming
    ``resume_path`` continues its run.
    """
    resuming = resume_path is not None
    recorded = checkpoints.read_run_record()  # as the jobs before this one left it
    name, run_id = checkpoints.run_identity(resuming, resume_path=resume_path)
    run_dir = Path(run_dir or own_run_directory(run_directory(name), run_id, recorded))
    loggers: list[Logger] = []
    mode = config.wandb_mode()
    if mode != "disabled" and not wandb_installed():
        if int(os.environ.get("RANK", "0")) == 0:
            log.warning(
                f"WANDB_MODE resolves to {mode} but the wandb package is not installed: this run "
                f"logs to {run_dir / 'metrics.jsonl'} only (pip install wandb, or set "
                f"WANDB_MODE=disabled)"
            )
        mode = "disabled"
    if mode != "disabled":
        if int(os.environ.get("RANK", "0")) == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
        loggers.append(
            ResilientWandbLogger(
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
