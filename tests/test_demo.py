"""`make demo`'s script on a tiny corpus and a few steps: every stage runs (a base model on two
languages, then its finetune), every artifact appears, a second run reuses them, and the closing
page shows the loss drop, the per-language table and each language from the base to the finetune."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import config
from scripts import demo_summary, run_report

REPO = Path(__file__).resolve().parents[1]

STAGES = [
    "corpus",
    "extract",
    "build_manifest",
    "make_train_val",
    "base_split",
    "base_tokenizer",
    "base_train",
    "tokenizer",
    "cache",
    "train",
    "evaluate",
    "report",
    "summary",
    "total",
]


def run_demo(demo_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in config.KNOBS}
    env.update(
        {
            "DEMO_DIR": str(demo_dir),
            "PY": sys.executable,
            "OMP_NUM_THREADS": "1",
            "DEMO_UTTERANCES": "hi=16,en=10,ta=8,te=8,kn=6,ml=6,bn=6",
            "VOCAB_SIZE": "400",
            "VAL_PER_LANG": "2",
            "MAX_STEPS": "6",
            "UNFREEZE_STEP": "3",
            "WARMUP_STEPS": "1",
            "PHASE2_WARMUP": "1",
            "CHECKPOINT_EVERY": "3",
            "DEMO_BASE_STEPS": "4",
            "DEMO_BASE_VOCAB_SIZE": "120",
            "NUM_WORKERS": "0",
            "DEMO_MAX_LOSS_RATIO": "2.0",
        }
    )
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    demo_dir = tmp_path_factory.mktemp("demo")
    first = run_demo(demo_dir)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    timings_first = (demo_dir / "stage_timings.txt").read_text()
    second = run_demo(demo_dir)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    return demo_dir, first, timings_first, second


@pytest.mark.slow
def test_every_stage_runs_in_order(demo):
    _, _, timings, _ = demo
    assert [line.split()[0] for line in timings.splitlines()] == STAGES
    assert "reused" not in timings


@pytest.mark.slow
def test_every_artifact_is_where_the_closing_page_says(demo):
    demo_dir, first, _, _ = demo
    for path in [
        "master_manifest.parquet",
        "master_manifest.summary.json",
        "train_manifest_v2.parquet",
        "val_manifest_v2.parquet",
        "tokenizer/tokenizer.model",
        "train_manifest_v2.*.training-cache/meta.json",
        "checkpoints/step_00000003.ckpt",
        "checkpoints/step_00000006.nemo",
        "base/train_manifest_v2.parquet",
        "base/val_manifest_v2.parquet",
        "base/tokenizer/tokenizer.model",
        "base/checkpoints/step_00000004.nemo",
        "checkpoints/step_00000006.model-card.md",
        "eval/wer_by_language.csv",
        "report/report.md",
        "report/language_mix.png",
        "wandb_logs/demo/metrics.jsonl",
    ]:
        assert list(demo_dir.glob(path)), path
    assert list((demo_dir / "wandb_logs" / "demo" / "wandb").glob("offline-run-*")), (
        "no offline W&B run"
    )
    assert str(demo_dir / "eval" / "wer_by_language.csv") in first.stdout


@pytest.mark.slow
def test_training_ran_both_phases_and_logged_every_step(demo):
    demo_dir, _, _, _ = demo
    records = [
        json.loads(line)
        for line in (demo_dir / "wandb_logs/demo/metrics.jsonl").read_text().splitlines()
    ]
    phases = {r["step"]: r["train/phase"] for r in records if "train/phase" in r}
    assert sorted(phases) == list(range(1, 7)) or sorted(phases) == list(range(0, 6))
    assert set(phases.values()) == {1.0, 2.0}


@pytest.mark.slow
def test_validation_runs_by_default_at_every_checkpoint_on_the_whole_val_set(demo):
    demo_dir, first, _, _ = demo
    records = [
        json.loads(line)
        for line in (demo_dir / "wandb_logs/demo/metrics.jsonl").read_text().splitlines()
    ]
    validations = [r for r in records if "val/wer/all" in r]
    # the base at step 0 (a finetune), then CHECKPOINT_EVERY=3 with EVAL_EVERY_STEPS unset
    assert [r["step"] for r in validations] == [0, 3, 6]
    val_rows = len((demo_dir / "eval/wer_by_language.csv").read_text().splitlines()) - 1
    assert val_rows >= 3
    assert all(r["val/loss"] > 0 for r in validations)
    curve = first.stdout.split("Validation during training", 1)[1]
    assert "\n     0 " in curve and "\n     3 " in curve and "\n     6 " in curve


@pytest.mark.slow
def test_closing_page_shows_the_loss_and_a_row_per_validation_language(demo):
    demo_dir, first, _, _ = demo
    assert "Training loss: start" in first.stdout
    table = first.stdout.split("Per-language WER/CER", 1)[1]
    val_langs = {
        row.split(",")[0]
        for row in (demo_dir / "eval/wer_by_language.csv").read_text().splitlines()[1:]
    }
    assert "all" in val_langs and len(val_langs) >= 3
    for lang in val_langs:
        assert f"\n{lang} " in table


@pytest.mark.slow
def test_the_base_trains_on_its_two_languages_and_the_finetune_extends_it(demo):
    import pyarrow.parquet as pq

    demo_dir, first, _, _ = demo
    for name in ("train_manifest_v2.parquet", "val_manifest_v2.parquet"):
        base = pq.read_table(demo_dir / "base" / name)
        full = pq.read_table(demo_dir / name)
        assert set(base["lang"].to_pylist()) <= {"en", "hi"}
        kept = [r for r in full.to_pylist() if r["lang"] in ("en", "hi")]
        assert (
            base.to_pylist() == kept
        )  # the same split: no finetune validation row in its training
    summary = json.loads((demo_dir / "tokenizer" / "summary.json").read_text())
    assert summary["mode"] == "extend"
    assert "step_00000004.nemo" in summary["extension"]["base"]
    # the finetune's .nemo says which scripts each language is written in, for decoding with a
    # language given: those its tokenizer counted, from every language of its manifest
    from nemo.collections.asr.models import ASRModel

    import vocabulary

    finetuned = ASRModel.restore_from(
        str(demo_dir / "checkpoints" / "step_00000006.nemo"), map_location="cpu"
    )
    scripts = vocabulary.language_scripts(finetuned)
    assert scripts["en"] == {"Latin"} and scripts["hi"] == {"Devanagari"}
    assert scripts["ta"] == {"Tamil"} and set(scripts) == {"en", "hi", "ta", "te", "kn", "ml", "bn"}
    page = first.stdout.split("Finetuning from the base", 1)[1]
    assert "base  step 0     end" in page
    rows = {line.split()[0]: line.split()[1:] for line in page.splitlines()[3:] if line.strip()}
    for lang, cells in rows.items():
        assert (cells[0] == "-") == (lang not in ("en", "hi")), (lang, cells)


@pytest.mark.slow
def test_a_second_demo_reuses_what_is_built(demo):
    _, _, _, second = demo
    # corpus, extract and cache reuse their own finished work inside their step; summary and total
    # are lines of the timings, not steps.
    for stage in [s for s in STAGES if s not in {"corpus", "extract", "cache", "summary", "total"}]:
        assert f"== {stage}: reusing" in second.stdout, stage
    assert "corpus complete" in second.stdout.lower() or "reusing" in second.stdout


def test_loss_drop_averages_both_ends_and_refuses_a_single_step():
    curve = [(s, 10.0 - s) for s in range(1, 21)]
    start, end, window = demo_summary.loss_drop(curve, 10)
    assert (start, end, window) == (
        sum(10.0 - s for s in range(1, 11)) / 10,
        sum(10.0 - s for s in range(11, 21)) / 10,
        10,
    )
    assert demo_summary.loss_drop(curve[:6], 10)[2] == 3
    with pytest.raises(ValueError, match="at least 2"):
        demo_summary.loss_drop(curve[:1], 10)


def test_the_loss_curve_keeps_the_last_record_of_a_step_logged_twice(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"step": 1, "train/loss": 5.0},
                {"step": 2, "train/loss": 4.0},
                {"step": 2, "train/loss": 3.5},
                {"step": 3, "val/wer/all": 0.9},
            ]
        )
        + "\n"
    )
    assert run_report.read_metrics(tmp_path).series("train/loss") == [(1, 5.0), (2, 3.5)]
