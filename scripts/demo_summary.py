"""The closing page of `make demo`: where every artifact went, the loss drop, the validation curve,
the per-language WER/CER table and, for a finetune, each language's WER from the base model to the
finetune's step 0 and end; the run's own report (scripts/run_report.py) is written beside its metrics.

Usage (scripts/demo.sh runs it with the demo's environment):
    python scripts/demo_summary.py
    python scripts/demo_summary.py --wer-csv demo_data/eval/wer_by_language.csv --max-loss-ratio 0.7
    python scripts/demo_summary.py --base-run-dir demo_data/wandb_logs/demo-base

Training loss is noisy per micro-batch, so "start" and "end" are the means of the first and last
``--window`` logged optimizer steps of ``metrics.jsonl``. The exit status is 1 when end/start is above
``--max-loss-ratio``, so a demo whose model did not learn does not look like a success. Paths and
settings come from the run's own ``hparams.json`` where it recorded them, so a ``--run-dir`` of another
run is described as that run was launched.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import config
from run_logging import run_directory
from scripts import run_report


def loss_drop(curve: list[tuple[int, float]], window: int) -> tuple[float, float, int]:
    """(mean loss of the first steps, mean of the last steps, steps in each mean): ``window`` steps
    at each end, fewer for a run shorter than two windows."""
    window = min(window, len(curve) // 2)
    if window < 1:
        raise ValueError(
            f"only {len(curve)} logged optimizer step(s); need at least 2 to compare start and end"
        )
    losses = [loss for _, loss in curve]
    return sum(losses[:window]) / window, sum(losses[-window:]) / window, window


def format_table(rows: list[dict[str, str]]) -> str:
    header = f"{'lang':<6} {'utts':>5} {'words':>6} {'WER %':>7} {'CER %':>7}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['lang']:<6} {int(row['utterances']):>5} {int(row['words']):>6} "
            f"{100 * float(row['wer']):>7.1f} {100 * float(row['cer']):>7.1f}"
        )
    return "\n".join(lines)


def read_wer_csv(path: Path) -> dict[str, dict[str, str]]:
    """evaluate.py's CSV as {lang: row}."""
    with open(path, encoding="utf-8", newline="") as f:
        return {row["lang"]: row for row in csv.DictReader(f)}


def last_validation(metrics: run_report.RunMetrics) -> dict[str, float]:
    """{lang: WER} of the run's last validation."""
    steps = [step for step, record in metrics.steps.items() if "val/wer/all" in record]
    if not steps:
        return {}
    return {
        key.removeprefix("val/wer/"): value
        for key, value in metrics.steps[max(steps)].items()
        if key.startswith("val/wer/") and isinstance(value, (int, float))
    }


def from_the_base(
    base: dict[str, float], step0: dict[str, float], end: dict[str, dict[str, str]]
) -> str:
    """Per language: WER % of the base model on its own languages (``base``, its run's last
    validation; "-" for a language it was not trained on), of the finetune at step 0 (``step0``, the
    run's step-0 validation) and at its end (``end``, evaluate.py's rows)."""
    header = f"{'lang':<6} {'base':>7} {'step 0':>7} {'end':>7}"
    lines = [header, "-" * len(header)]
    for lang in sorted(end, key=lambda k: (k == "all", k)):
        if lang == "all":
            continue
        own = base.get(lang)
        cells = [
            f"{100 * own:>7.1f}" if own is not None else f"{'-':>7}",
            f"{100 * step0[lang]:>7.1f}" if lang in step0 else f"{'n/a':>7}",
            f"{100 * float(end[lang]['wer']):>7.1f}",
        ]
        lines.append(f"{lang:<6} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the run's directory (default WANDB_LOG_DIR/WANDB_RUN_NAME)",
    )
    parser.add_argument(
        "--wer-csv",
        type=Path,
        default=None,
        help="evaluate.py's CSV (default DATA_DIR/eval/wer_by_language.csv)",
    )
    parser.add_argument(
        "--base-run-dir",
        type=Path,
        default=None,
        help="the run directory (metrics.jsonl) of the base model a finetune started from: its last "
        "validation scores the base on its own languages",
    )
    parser.add_argument(
        "--window", type=int, default=10, help="steps averaged at each end (default 10)"
    )
    parser.add_argument(
        "--max-loss-ratio",
        type=float,
        default=0.7,
        help="fail when end/start loss is above this (default 0.7)",
    )
    args = parser.parse_args(argv)

    run_dir = args.run_dir or run_directory()
    metrics = run_report.read_metrics(run_dir)
    setting = metrics.settings.get

    def path_of(knob: str) -> str:
        return str(setting(knob) or getattr(config, knob))

    data = Path(path_of("DATA_DIR"))
    wer_csv = args.wer_csv or data / "eval" / "wer_by_language.csv"
    report = run_report.write_report(run_dir, run_dir / "report")
    artifacts = [
        ("shards + extracted FLACs", path_of("SHARDS_DIR")),
        ("master manifest", path_of("MASTER_MANIFEST_PATH")),
        (
            "train / val manifests",
            f"{path_of('TRAIN_MANIFEST_PATH')}, {path_of('VAL_MANIFEST_PATH')}",
        ),
        ("build summaries", f"{data}/*.summary.json"),
        ("tokenizer", path_of("TOKENIZER_DIR")),
        (
            "training caches (tokenized manifests)",
            f"{setting('CACHE_DIR') or data}/*.training-cache",
        ),
        ("checkpoints + final .nemo", path_of("CHECKPOINT_DIR")),
        ("W&B offline run (wandb sync it)", f"{run_dir}/wandb"),
        ("metrics without W&B", run_dir / "metrics.jsonl"),
        ("run report (PNG + markdown)", report),
        ("per-language WER/CER CSV", wer_csv),
        ("data report (PNG + markdown)", data / "report"),
    ]
    print("\nArtifacts:")
    for name, path in artifacts:
        print(f"  {name:<38} {path}")

    start, end, window = loss_drop(metrics.series("train/loss"), args.window)
    ratio = end / start
    verdict = (
        "ok" if ratio <= args.max_loss_ratio else f"ABOVE the {args.max_loss_ratio:.0%} target"
    )
    print(
        f"\nTraining loss: start {start:.3f} (mean of first {window} steps), end {end:.3f} "
        f"(last {window}); end/start = {ratio:.2f} ({verdict})"
    )

    wer = metrics.series("val/wer/all")
    val_loss = dict(metrics.series("val/loss"))
    if wer:
        steps = ", ".join(str(step) for step, _ in wer)
        print(f"\nValidation during training (steps {steps} on {path_of('VAL_MANIFEST_PATH')}):")
        print(f"{'step':>6} {'WER %':>7} {'loss':>8}")
        for step, value in wer:
            loss = val_loss.get(step)
            print(f"{step:>6} {100 * value:>7.1f} {'n/a' if loss is None else f'{loss:.3f}':>8}")
    else:
        print("\nValidation during training: none logged (EVAL_EVERY_STEPS=0?)")

    end = read_wer_csv(wer_csv)
    print(f"\nPer-language WER/CER on {path_of('VAL_MANIFEST_PATH')} (greedy decoding):")
    print(format_table(list(end.values())))
    step0 = {
        key.removeprefix("val/wer/"): value
        for key, value in metrics.steps.get(0, {}).items()
        if key.startswith("val/wer/") and isinstance(value, (int, float))
    }
    if setting("INIT_MODEL") or step0:
        base = (
            last_validation(run_report.read_metrics(args.base_run_dir))
            if args.base_run_dir and (args.base_run_dir / "metrics.jsonl").is_file()
            else {}
        )
        print(
            f"\nFinetuning from the base {setting('INIT_MODEL') or ''} (WER %): the base on its own "
            f"languages, the finetune before its first update (step 0) and at its end:"
        )
        print(from_the_base(base, step0, end))
    return 0 if ratio <= args.max_loss_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
