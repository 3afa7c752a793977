"""scripts/run_report.py: a report of any run from its metrics.jsonl, while it is going and after it
ends, with no W&B account or network."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from scripts import run_report
from tests.tiny_training_data import make_training_data, write_manifest
from tests.torchrun_jobs import signal_every_process, tiny_train_env, torchrun_command

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHARTS = ("training.png", "validation.png", "language_mix.png", "data_path.png")


def write_run(run_dir: Path, records: list[dict], tail: str = "", **settings) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run_dir / "metrics.jsonl").write_text(text, encoding="utf-8")
    (run_dir / "hparams.json").write_text(json.dumps(settings), encoding="utf-8")
    return run_dir


def training_record(step: int, **extra) -> dict:
    return {
        "step": step,
        "train/loss": 10.0 / step,
        "train/lr": 1e-3,
        "train/phase": 1 if step < 5 else 2,
        "data/padding_efficiency": 0.9,
        "throughput/audio_s_per_s": 50.0 if step < 5 else 30.0,
        "train/skipped_steps": 1,
        "data/bad_audio_total": 2,
        "data/bad_audio/missing": 2,
        "lang_share/hi": 0.75,
        "lang_target/hi": 0.5,
        "lang_share/en": 0.25,
        "lang_target/en": 0.5,
        **extra,
    }


def test_the_report_quotes_base_best_and_latest_per_language(tmp_path):
    records = [training_record(s) for s in range(1, 11)]  # phase 2 from step 5 on
    records += [
        {"step": 0, "val/wer/all": 0.8, "val/wer/hi": 0.9, "val/wer/en": 0.05},
        {"step": 5, "val/wer/all": 0.4, "val/wer/hi": 0.5, "val/wer/en": 0.2},
        {"step": 10, "val/wer/all": 0.5, "val/wer/hi": 0.55, "val/wer/en": 0.1},
    ]
    run = write_run(tmp_path / "ft", records, INIT_MODEL="base.nemo", MAX_STEPS=10)
    report = run_report.write_report(run, tmp_path / "out").read_text()
    assert "| language | base (step 0) | best (step) | latest (step) |" in report
    assert "| all | 80.0 | 40.0 (5) | 50.0 (10) |" in report
    assert "| en | 5.0 | 5.0 (0) | 10.0 (10) |" in report
    assert "unfreeze at step 5" in report
    assert "phase 1 (encoder frozen): median 50.0" in report and "phase 2: median 30.0" in report
    assert "Skipped optimizer steps: 1; bad audio utterances: 2" in report
    assert "by reason: missing 2" in report
    assert "| hi | 75.0 | 50.0 |" in report
    for chart in CHARTS:
        assert (tmp_path / "out" / chart).read_bytes().startswith(PNG_MAGIC), chart
        assert f"({chart})" in report


def test_the_language_confusion_of_metrics_jsonl_is_drawn_and_its_accuracy_tabled(tmp_path):
    """The tables a validation logs through JsonlMetricsLogger: the first and the latest
    validation's confusion become language_id.png, the accuracy a table in report.md; a resumed
    step's table replaces the earlier one."""
    import run_logging

    run = tmp_path / "lid"
    logger = run_logging.JsonlMetricsLogger(run / "metrics.jsonl")
    columns = ["true", "guessed", "utterances"]
    for step in range(1, 11):
        logger.log_metrics(training_record(step), step=step)
    for step, rows, acc in (
        (0, [["en", "en", 9], ["en", "ur", 1], ["hi", "hi", 8], ["hi", "none", 2]], (0.9, 0.8)),
        (10, [["en", "en", 5], ["en", "ta", 5], ["hi", "hi", 10]], (0.5, 1.0)),
        (10, [["en", "en", 6], ["en", "ta", 4], ["hi", "hi", 10]], (0.6, 1.0)),  # resumed
    ):
        logger.log_metrics(
            {"val/wer/all": 0.3, "val/lid_acc/en": acc[0], "val/lid_acc/hi": acc[1]}, step=step
        )
        logger.log_table("val/lid_confusion", columns, rows, step=step)
    (run / "hparams.json").write_text(json.dumps({"INIT_MODEL": "base.nemo"}), encoding="utf-8")
    metrics = run_report.read_metrics(run)
    assert run_report.language_confusion(metrics, 0) == {
        "en": {"en": 9, "ur": 1},
        "hi": {"hi": 8, "none": 2},
    }
    assert run_report.language_confusion(metrics, 10) == {
        "en": {"en": 6, "ta": 4},
        "hi": {"hi": 10},
    }
    report = run_report.write_report(run, tmp_path / "out").read_text()
    assert (tmp_path / "out" / "language_id.png").read_bytes().startswith(PNG_MAGIC)
    assert "(language_id.png)" in report
    assert "| en | 90.0 (0) | 60.0 (10) |" in report and "| hi | 80.0 (0) | 100.0 (10) |" in report


def test_the_language_given_and_the_forgetting_of_a_base_language_are_reported(tmp_path):
    """English, the base's language, 10 points worse auto at step 10 (above the run's 5): marked
    as forgetting at that step; with the language given it is 2 points worse, under it."""
    records = [training_record(s) for s in range(1, 11)]
    records += [
        {
            "step": step,
            "val/wer/all": 0.5,
            "val/wer/en": en,
            "val/wer_given/en": given,
            "val/wer/hi": 0.5,
            "val/wer_given/hi": 0.45,
            "val/forgetting/en": 100 * (en - 0.10),
            "val/forgetting_given/en": 100 * (given - 0.10),
        }
        for step, en, given in ((0, 0.10, 0.10), (5, 0.14, 0.11), (10, 0.20, 0.12))
    ]
    run = write_run(
        tmp_path / "ft", records, INIT_MODEL="base.nemo", MAX_STEPS=10, FORGETTING_WARN_POINTS=5
    )
    report = run_report.write_report(run, tmp_path / "out").read_text()
    assert "## Validation WER % with the language given" in report
    assert "| en | 10.0 (0) | 12.0 (10) | 20.0 | +8.0 |" in report
    assert "| hi | 45.0 (0) | 45.0 (10) | 50.0 | +5.0 |" in report
    assert "warned above 5, FORGETTING_WARN_POINTS" in report
    assert "| en | +10.0 (10) | +10.0 (10) | +2.0 | **forgetting** at step 10" in report
    assert (tmp_path / "out" / "validation.png").read_bytes().startswith(PNG_MAGIC)
    # a higher threshold: kept
    run = write_run(tmp_path / "ft2", records, INIT_MODEL="b.nemo", FORGETTING_WARN_POINTS=12)
    report = run_report.write_report(run, tmp_path / "out2").read_text()
    assert "| en | +10.0 (10) | +10.0 (10) | +2.0 | kept |" in report


def test_a_base_language_the_base_never_knew_gets_no_forgetting_verdict(tmp_path):
    """Tamil scored 100% WER at step 0 (the base never learned it) and 120% at step 10: 20 points
    "worse", but nothing known was forgotten; English, known, is judged as usual."""
    records = [training_record(s) for s in range(1, 11)]
    records += [
        {
            "step": step,
            "val/wer/all": 0.5,
            "val/wer/en": en,
            "val/wer/ta": ta,
            "val/forgetting/en": 100 * (en - 0.10),
            "val/forgetting/ta": 100 * (ta - 1.0),
        }
        for step, en, ta in ((0, 0.10, 1.0), (10, 0.12, 1.2))
    ]
    run = write_run(tmp_path / "ft", records, INIT_MODEL="base.nemo", FORGETTING_WARN_POINTS=5)
    report = run_report.write_report(run, tmp_path / "out").read_text()
    assert (
        "| ta | +20.0 (10) | +20.0 (10) | n/a | none: the base's WER was already 100.0% " in report
    )
    assert "kept" not in report.split("| ta |")[1].splitlines()[0]
    assert "| en | +2.0 (10) | +2.0 (10) | n/a | kept |" in report
    metrics = run_report.read_metrics(run)
    assert run_report.base_wer(metrics, "ta") == 1.0
    fig = run_report.plot_validation(metrics)  # no red x for Tamil's 20 "points" either
    assert not [line for ax in fig.axes for line in ax.lines if line.get_marker() == "x"]
    # without the step-0 WER logged, the forgetting series implies the base's
    for record in records:
        if record["step"] == 0:
            del record["val/wer/ta"]
    metrics = run_report.read_metrics(write_run(tmp_path / "ft2", records))
    assert run_report.base_wer(metrics, "ta") == pytest.approx(1.0)


def overfitting_run(val_losses: dict[int, float], steps: int = 10) -> list[dict]:
    """train/loss 10 / step at every step, val/loss at the given steps."""
    records = [training_record(s) for s in range(1, steps + 1)]
    return records + [{"step": s, "val/loss": v, "val/wer/all": 0.5} for s, v in val_losses.items()]


def test_the_report_gives_the_validation_loss_and_marks_where_the_run_overfits(tmp_path):
    """Validation loss 1.0 at step 2, then rising at 4, 6, 8 (the third rise: overfitting at 8) and
    falling at 10, while the training loss (10 / step) falls throughout."""
    records = overfitting_run({2: 1.0, 4: 1.5, 6: 1.6, 8: 1.7, 10: 1.2})
    run = write_run(tmp_path / "of", records, OVERFITTING_WARN_VALIDATIONS=3)
    report = run_report.write_report(run, tmp_path / "out").read_text()
    assert (
        "- Validation loss: first 1.0000 (step 2), lowest 1.0000 (step 2), latest 1.2000 (step 10)"
        in report
    )
    assert "- **Overfitting** at step 8: the validation loss rose at each of the last 3" in report
    metrics = run_report.read_metrics(run)
    fig = run_report.plot_training(metrics)
    marks = [line for line in fig.axes[0].lines if line.get_label().startswith("overfitting")]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [8]
    assert list(marks[0].get_ydata()) == [1.7]
    # the run's own setting decides: four rises were asked for, three happened
    run = write_run(tmp_path / "of4", records, OVERFITTING_WARN_VALIDATIONS=4)
    report = run_report.write_report(run, tmp_path / "out4").read_text()
    assert "- Overfitting: none (the validation loss never rose at 4 validations in a row" in report
    fig = run_report.plot_training(run_report.read_metrics(run))
    assert not [line for line in fig.axes[0].lines if line.get_label().startswith("overfitting")]


def test_a_validation_loss_falling_with_the_training_loss_is_no_overfitting(tmp_path):
    records = overfitting_run({2: 1.0, 4: 0.9, 6: 0.8, 8: 0.7, 10: 0.6})
    report = run_report.write_report(
        write_run(tmp_path / "ok", records), tmp_path / "o"
    ).read_text()
    assert "- Overfitting: none" in report and "**Overfitting**" not in report
    # a run without val/loss has neither line
    report = run_report.write_report(
        write_run(tmp_path / "nv", [training_record(1)]), tmp_path / "o2"
    ).read_text()
    assert "Validation loss" not in report and "Overfitting" not in report


def test_a_run_without_language_identification_draws_no_confusion(tmp_path):
    run = write_run(tmp_path / "old", [training_record(1), {"step": 1, "val/wer/all": 0.5}])
    report = run_report.write_report(run, tmp_path / "out").read_text()
    assert not (tmp_path / "out" / "language_id.png").exists()
    assert "Language identification" not in report


def test_a_half_written_last_line_and_a_resumed_step_are_read_as_the_run_logged_them(tmp_path):
    records = [training_record(1), training_record(2), training_record(2, **{"train/loss": 1.5})]
    run = write_run(tmp_path / "run", records, tail='{"step": 3, "train/lo')
    metrics = run_report.read_metrics(run)
    assert metrics.series("train/loss") == [(1, 10.0), (2, 1.5)]
    assert metrics.skipped_lines == 1
    report = run_report.write_report(run, tmp_path / "out").read_text()
    assert "1 unreadable line(s) of metrics.jsonl left out" in report
    assert "first" in report  # from scratch: no base column
    assert not (tmp_path / "out" / "validation.png").exists()  # nothing validated yet


def test_a_checkpoint_dir_leads_to_its_run_through_run_json(tmp_path, monkeypatch):
    logs = tmp_path / "wandb_logs"
    write_run(logs / "ft", [training_record(1), training_record(2)])
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "run.json").write_text(json.dumps({"name": "ft", "wandb_id": "x"}))
    monkeypatch.setattr(run_report.config, "WANDB_LOG_DIR", logs)
    assert run_report.find_run_dir(checkpoints) == logs / "ft"


def test_a_run_whose_recorded_log_dir_moved_is_found_under_wandb_log_dir(tmp_path, monkeypatch):
    logs = tmp_path / "mounted_elsewhere"
    write_run(logs / "ft", [training_record(1), training_record(2)])
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    record = {"name": "ft", "wandb_id": "x", "log_dir": str(tmp_path / "old_mount" / "ft")}
    (checkpoints / "run.json").write_text(json.dumps(record))
    monkeypatch.setattr(run_report.config, "WANDB_LOG_DIR", logs)
    assert run_report.find_run_dir(checkpoints) == logs / "ft"


def test_a_directory_that_holds_no_run_is_one_line_naming_it(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/run_report.py", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"run_report: {tmp_path} holds neither metrics.jsonl (a run directory) nor run.json (a "
        f"CHECKPOINT_DIR): pass WANDB_LOG_DIR/<run name> or the run's CHECKPOINT_DIR"
    ]


def report_of(checkpoint_dir: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/run_report.py", str(checkpoint_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_a_two_process_run_is_reported_while_it_trains_and_after_it_ends(tmp_path):
    data = make_training_data(tmp_path, per_lang=12)
    val = write_manifest(tmp_path / "val", 3, seed=1, name="val_manifest.parquet")
    # one validation row claims 0.05 s: fewer encoder frames than tokens, so it cannot be scored
    rows = pl.read_parquet(val).with_row_index("i")
    infeasible = rows.get_column("segment_id")[0]
    rows.with_columns(
        pl.when(pl.col("i") == 0).then(0.05).otherwise(pl.col("duration")).alias("duration")
    ).drop("i").write_parquet(val)
    env = tiny_train_env(
        data,
        DATA_DIR=str(tmp_path),
        VAL_MANIFEST_PATH=str(val),
        MAX_STEPS="60",
        UNFREEZE_STEP="20",
        GRAD_ACCUM="1",
        CHECKPOINT_EVERY="30",
        EVAL_EVERY_STEPS="30",
    )
    job = subprocess.Popen(
        torchrun_command(REPO / "train.py"),
        cwd=REPO,
        env=env,
        stdout=open(tmp_path / "train.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    checkpoint_dir = tmp_path / "checkpoints"
    try:
        metrics = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            found = list((tmp_path / "wandb_logs").glob("*/metrics.jsonl"))
            if found and '"train/loss"' in found[0].read_text():
                metrics = found[0]
                break
            time.sleep(0.1)
        assert metrics is not None, (tmp_path / "train.log").read_text()[-3000:]
        # Held mid-run (every process of the job paused), so the report reads a run that is going.
        held = signal_every_process(env, signal.SIGSTOP)
        try:
            during = report_of(checkpoint_dir, env)
        finally:
            for pid in held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert job.wait(timeout=400) == 0, (tmp_path / "train.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert during.returncode == 0, during.stderr
    log = (tmp_path / "train.log").read_text()
    assert "validation leaves out rows it cannot score, per language: " in log
    named = log.split("validation leaves out rows it cannot score, per language: ", 1)[1]
    assert f"(more tokens than encoder frames: {infeasible}" in named.splitlines()[0]
    assert "(still going, or stopped early)" in during.stdout, during.stdout
    after = report_of(checkpoint_dir, env)
    assert after.returncode == 0, after.stderr
    report = (metrics.parent / "report" / "report.md").read_text()
    assert "Progress: step 60 of 60; unfreeze at step 20" in report
    assert "| all |" in report and "(60) |" in report  # validations at 30 and 60, per language
    for chart in CHARTS:
        assert (metrics.parent / "report" / chart).read_bytes().startswith(PNG_MAGIC), chart
