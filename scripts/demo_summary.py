"""The closing page of `make demo`: where every artifact went, the loss drop and the WER/CER table.

Usage (scripts/demo.sh runs it with the demo's environment):
    python scripts/demo_summary.py
    python scripts/demo_summary.py --wer-csv demo_data/eval/wer_by_language.csv --max-loss-ratio 0.7

Training loss is noisy per micro-batch, so "start" and "end" are the means of the first and last
``--window`` logged optimizer steps of ``metrics.jsonl``. The exit status is 1 when end/start is above
``--max-loss-ratio``, so a demo whose model did not learn does not look like a success.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import config
from run_logging import run_directory


def loss_curve(metrics_path: Path) -> list[tuple[int, float]]:
    """(step, train/loss) of every logged optimizer step, in order, the last record of a step winning
    (a resumed run logs the steps after its checkpoint again)."""
    by_step: dict[int, float] = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "train/loss" in record and record.get("step") is not None:
                by_step[int(record["step"])] = float(record["train/loss"])
    return sorted(by_step.items())


def validation_curve(metrics_path: Path) -> list[tuple[int, float, float | None]]:
    """(step, val/wer/all, val/loss or None) of every validation in ``metrics_path``, in step order
    (the last record of a step winning)."""
    by_step: dict[int, tuple[float, float | None]] = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record.get("val/wer/all") is not None and record.get("step") is not None:
                by_step[int(record["step"])] = (
                    float(record["val/wer/all"]),
                    record.get("val/loss"),
                )
    return [(step, wer, loss) for step, (wer, loss) in sorted(by_step.items())]


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
        "--window", type=int, default=10, help="steps averaged at each end (default 10)"
    )
    parser.add_argument(
        "--max-loss-ratio",
        type=float,
        default=0.7,
        help="fail when end/start loss is above this (default 0.7)",
    )
    args = parser.parse_args(argv)

    data = Path(config.DATA_DIR)
    run_dir = args.run_dir or run_directory()
    wer_csv = args.wer_csv or data / "eval" / "wer_by_language.csv"
    artifacts = [
        ("shards + extracted FLACs", config.SHARDS_DIR),
        ("master manifest", config.MASTER_MANIFEST_PATH),
        ("train / val manifests", f"{config.TRAIN_MANIFEST_PATH}, {config.VAL_MANIFEST_PATH}"),
        ("build summaries", f"{data}/*.summary.json"),
        ("tokenizer", config.TOKENIZER_DIR),
        ("training caches (tokenized manifests)", f"{config.CACHE_DIR or data}/*.training-cache"),
        ("checkpoints + final .nemo", config.CHECKPOINT_DIR),
        ("W&B offline run (wandb sync it)", f"{run_dir}/wandb"),
        ("metrics without W&B", run_dir / "metrics.jsonl"),
        ("per-language WER/CER CSV", wer_csv),
        ("data report (PNG + markdown)", data / "report"),
    ]
    print("\nArtifacts:")
    for name, path in artifacts:
        print(f"  {name:<32} {path}")

    start, end, window = loss_drop(loss_curve(run_dir / "metrics.jsonl"), args.window)
    ratio = end / start
    verdict = (
        "ok" if ratio <= args.max_loss_ratio else f"ABOVE the {args.max_loss_ratio:.0%} target"
    )
    print(
        f"\nTraining loss: start {start:.3f} (mean of first {window} steps), end {end:.3f} "
        f"(last {window}); end/start = {ratio:.2f} ({verdict})"
    )

    curve = validation_curve(run_dir / "metrics.jsonl")
    if curve:
        print(
            f"\nValidation during training (every {config.EVAL_EVERY_STEPS} steps on "
            f"{config.VAL_MANIFEST_PATH}):"
        )
        print(f"{'step':>6} {'WER %':>7} {'loss':>8}")
        for step, wer, loss in curve:
            print(f"{step:>6} {100 * wer:>7.1f} {'n/a' if loss is None else f'{loss:.3f}':>8}")
    else:
        print("\nValidation during training: none logged (EVAL_EVERY_STEPS=0?)")

    with open(wer_csv, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    print(f"\nPer-language WER/CER on {config.VAL_MANIFEST_PATH} (greedy decoding):")
    print(format_table(rows))
    return 0 if ratio <= args.max_loss_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
