"""A report of one training run from its metrics.jsonl: PNG charts and a one-page report.md.

Usage:
    python scripts/run_report.py                       # the run of CHECKPOINT_DIR (its run.json)
    python scripts/run_report.py runs/ft               # a run directory (holds metrics.jsonl)
    python scripts/run_report.py /ckpt/ft --out /tmp/r # a CHECKPOINT_DIR; PNGs + report.md to /tmp/r

Needs no W&B account and no network: it reads the file every run writes beside its W&B files
(``WANDB_LOG_DIR/<run name>/metrics.jsonl``, with ``hparams.json``). It works on a run that is still
going (a half-written last line is skipped) and on a finished one; a resumed run's repeated steps count
once, the last record of a step winning.

Written to ``--out`` (default ``<run dir>/report``):
- ``training.png``: train/loss (and val/loss) and train/lr per optimizer step, the unfreeze
  marked, and a red x on each validation at which the run overfits (OVERFITTING_WARN_VALIDATIONS).
- ``validation.png``: WER and CER per language at every validation (step 0 is the base when finetuning).
- ``language_mix.png``: the realized share of each language against the sampler's target.
- ``data_path.png``: padding efficiency, audio seconds per second, skipped steps and bad audio.
- ``language_id.png``: which language the model guessed (the tag its hypothesis starts with) for each
  language's validation utterances, at the first and the latest validation, as a heatmap.
- ``report.md``: the numbers to quote, with the charts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import config
from atomic_files import atomic_write
from checkpoints import read_run_record
from run_logging import run_directory
from training_metrics import LossAtValidation, losses_at_validations, overfitting_steps

LOSS_WINDOW = 20  # optimizer steps averaged for the "loss now" and "loss at start" figures


@dataclass
class RunMetrics:
    """The scalars of one run, one record per step (the last logged record of a step wins)."""

    steps: dict[int, dict] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    skipped_lines: int = 0
    # {table key: {step: [rows]}}, the last record of a step winning (as for the scalars)
    tables: dict[str, dict[int, list]] = field(default_factory=dict)

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every step that logged ``key`` with a number, in step order."""
        out = []
        for step in sorted(self.steps):
            value = self.steps[step].get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                out.append((step, float(value)))
        return out

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` (e.g. ``val/wer/``) that any step logged, sorted, ``all`` first."""
        found = {k for record in self.steps.values() for k in record if k.startswith(prefix)}
        return sorted(found, key=lambda k: (not k.endswith("/all"), k))

    def latest(self, key: str) -> float | None:
        values = self.series(key)
        return values[-1][1] if values else None


def read_metrics(run_dir: Path) -> RunMetrics:
    """The run's metrics.jsonl and hparams.json. A line that does not parse (the one a running job is
    writing) is counted in ``skipped_lines``, not fatal; table records go to ``tables``."""
    metrics = RunMetrics()
    path = run_dir / "metrics.jsonl"
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                metrics.skipped_lines += 1
                continue
            if not isinstance(record, dict) or record.get("step") is None:
                continue
            if "table" in record:
                rows = record.get("rows")
                if isinstance(rows, list):
                    by_step = metrics.tables.setdefault(str(record["table"]), {})
                    by_step[int(record["step"])] = rows
                continue
            step = int(record["step"])
            # A step logs its training scalars and, at a validation, its val/ scalars in separate
            # records: merge them; a later job's record of the same step (a resume) overrides.
            metrics.steps.setdefault(step, {}).update(record)
    hparams = run_dir / "hparams.json"
    if hparams.is_file():
        try:
            metrics.settings = json.loads(hparams.read_text(encoding="utf-8"))
        except ValueError:
            metrics.settings = {}
    return metrics


def find_run_dir(target: Path | None) -> Path:
    """The run directory that ``target`` names: a directory holding metrics.jsonl, or a
    CHECKPOINT_DIR whose run.json names the run's log directory (or its name, under WANDB_LOG_DIR);
    default CHECKPOINT_DIR."""
    target = Path(target or config.CHECKPOINT_DIR)
    if (target / "metrics.jsonl").is_file():
        return target
    record = read_run_record(target)
    name = record.get("name")
    if name:
        # Where the run logged (run.json's log_dir), else its name under WANDB_LOG_DIR: a data tree
        # mounted elsewhere since is found through WANDB_LOG_DIR.
        candidates = [Path(record["log_dir"])] if record.get("log_dir") else []
        candidates.append(run_directory(name))
        for run_dir in candidates:
            if (run_dir / "metrics.jsonl").is_file():
                return run_dir
        raise SystemExit(
            f"run_report: {target}/run.json names run {name!r}, but no metrics.jsonl is in "
            f"{' or '.join(str(c) for c in candidates)}: set WANDB_LOG_DIR to where that run "
            f"logged, or pass its run directory"
        )
    raise SystemExit(
        f"run_report: {target} holds neither metrics.jsonl (a run directory) nor run.json (a "
        f"CHECKPOINT_DIR): pass WANDB_LOG_DIR/<run name> or the run's CHECKPOINT_DIR"
    )


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _fmt(value: float | None, spec: str = ".3f", scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def unfreeze_step(metrics: RunMetrics) -> int | None:
    """The run's UNFREEZE_STEP setting, else the first step logged in phase 2."""
    value = metrics.settings.get("UNFREEZE_STEP")
    if isinstance(value, (int, float)):
        return int(value)
    for step, phase in metrics.series("train/phase"):
        if phase >= 2:
            return step
    return None


def validation_table(metrics: RunMetrics, unit: str) -> list[tuple[str, list[tuple[int, float]]]]:
    """(language, [(step, WER or CER)]) for every language validated, ``all`` first."""
    return [
        (key.rsplit("/", 1)[1], metrics.series(key))
        for key in metrics.keys_with_prefix(f"val/{unit}/")
    ]


def forgetting_limit(metrics: RunMetrics) -> float:
    """FORGETTING_WARN_POINTS of the run (its recorded settings; this shell's when absent)."""
    import config

    try:
        return float(metrics.settings.get("FORGETTING_WARN_POINTS", config.FORGETTING_WARN_POINTS))
    except (TypeError, ValueError):
        return float(config.FORGETTING_WARN_POINTS)


def forgetting_rows(
    metrics: RunMetrics,
) -> list[tuple[str, list[tuple[int, float]], list[tuple[int, float]]]]:
    """(base language, [(step, val/forgetting points)], [(step, val/forgetting_given points)])."""
    return [
        (
            key.rsplit("/", 1)[1],
            metrics.series(key),
            metrics.series(f"val/forgetting_given/{key.rsplit('/', 1)[1]}"),
        )
        for key in metrics.keys_with_prefix("val/forgetting/")
    ]


def overfitting_rises(metrics: RunMetrics) -> int:
    """OVERFITTING_WARN_VALIDATIONS of the run (its recorded settings; this shell's when absent)."""
    try:
        return int(
            metrics.settings.get(
                "OVERFITTING_WARN_VALIDATIONS", config.OVERFITTING_WARN_VALIDATIONS
            )
        )
    except (TypeError, ValueError):
        return int(config.OVERFITTING_WARN_VALIDATIONS)


def overfitting(metrics: RunMetrics) -> tuple[list[LossAtValidation], list[int]]:
    """(the losses of every validation with a val/loss, the steps of those at which the run
    overfits: ``training_metrics.overfitting_steps``, as train.py judges it while it runs)."""
    validations = losses_at_validations(metrics.series("val/loss"), metrics.series("train/loss"))
    return validations, overfitting_steps(validations, overfitting_rises(metrics))


def base_wer(metrics: RunMetrics, lang: str) -> float | None:
    """The WER of ``lang`` at the step-0 validation (the base's), else as its forgetting series
    implies it (val/wer now minus val/forgetting points at one step); None when neither is logged."""
    wer = dict(metrics.series(f"val/wer/{lang}"))
    if 0 in wer:
        return wer[0]
    for step, points in metrics.series(f"val/forgetting/{lang}"):
        if step in wer:
            return wer[step] - points / 100
    return None


def forgetting_judged(base: float | None) -> bool:
    """Whether forgetting can be judged from a base WER: not when the base already got every word
    wrong or worse (WER at or above 1.0): it did not know that validation, so there was nothing
    to forget, and a WER that moves above 1.0 measures insertions, not forgetting."""
    return base is None or base < 1.0


def language_mix(metrics: RunMetrics) -> list[tuple[str, float | None, float | None]]:
    """(language, realized share, target share) at the newest step that logged them."""
    langs = {k.split("/", 1)[1] for k in metrics.keys_with_prefix("lang_share/")}
    langs |= {k.split("/", 1)[1] for k in metrics.keys_with_prefix("lang_target/")}
    return [
        (lang, metrics.latest(f"lang_share/{lang}"), metrics.latest(f"lang_target/{lang}"))
        for lang in sorted(langs)
    ]


def language_confusion(metrics: RunMetrics, step: int) -> dict[str, dict[str, int]]:
    """{true language: {guessed language: utterances}} of the validation at ``step``, from its
    ``val/lid_confusion`` table."""
    out: dict[str, dict[str, int]] = {}
    for row in metrics.tables.get("val/lid_confusion", {}).get(step, []):
        if isinstance(row, list) and len(row) == 3 and isinstance(row[2], (int, float)):
            true, guess = str(row[0]), str(row[1])
            out.setdefault(true, {})[guess] = out.get(true, {}).get(guess, 0) + int(row[2])
    return out


def plot_language_id(metrics: RunMetrics):
    """Heatmaps of the language confusion (rows: true language, columns: guessed, cells: share of
    the row's utterances, with counts) at the first and the latest validation."""
    import matplotlib.pyplot as plt
    import numpy as np

    from evaluation import NO_TAG

    steps = sorted(metrics.tables.get("val/lid_confusion", {}))
    if not steps:
        return None
    shown = [steps[0]] if len(steps) == 1 else [steps[0], steps[-1]]
    confusions = [language_confusion(metrics, step) for step in shown]
    trues = sorted({lang for c in confusions for lang in c})
    guessed = {g for c in confusions for row in c.values() for g in row}
    # the true languages in the same order along both axes, then other guesses, "none" last
    columns = (
        trues + sorted(guessed - set(trues) - {NO_TAG}) + ([NO_TAG] if NO_TAG in guessed else [])
    )
    width = 1.2 + 0.6 * len(columns)
    fig, axes = plt.subplots(
        1, len(shown), figsize=(width * len(shown) + 1.5, 1.5 + 0.5 * len(trues)), squeeze=False
    )
    for ax, step, confusion in zip(axes[0], shown, confusions):
        counts = np.array([[confusion.get(t, {}).get(g, 0) for g in columns] for t in trues], float)
        totals = counts.sum(axis=1, keepdims=True)
        shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
        ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, aspect="auto")
        for i, j in np.ndindex(counts.shape):
            if counts[i, j]:
                ax.text(
                    j,
                    i,
                    f"{100 * shares[i, j]:.0f}%\n{counts[i, j]:.0f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if shares[i, j] > 0.6 else "black",
                )
        ax.set_xticks(range(len(columns)), columns)
        ax.set_yticks(range(len(trues)), trues)
        ax.set_xlabel("guessed (first token)")
        ax.set_ylabel("true language")
        label = (
            "base (step 0)" if step == 0 and metrics.settings.get("INIT_MODEL") else f"step {step}"
        )
        ax.set_title(f"language identification, {label}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_training(metrics: RunMetrics):
    import matplotlib.pyplot as plt

    loss, lr = metrics.series("train/loss"), metrics.series("train/lr")
    if not loss and not lr:
        return None
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    if loss:
        ax_loss.plot(*zip(*loss), lw=0.8, label="train/loss")
    val = metrics.series("val/loss")
    if val:
        ax_loss.plot(*zip(*val), "o-", label="val/loss")
        flagged = set(overfitting(metrics)[1])
        marked = [(s, v) for s, v in val if s in flagged]
        if marked:
            ax_loss.plot(
                *zip(*marked),
                "x",
                color="red",
                ms=11,
                mew=2.5,
                label=f"overfitting (OVERFITTING_WARN_VALIDATIONS={overfitting_rises(metrics)})",
            )
    ax_loss.set_ylabel("loss")
    if lr:
        ax_lr.plot(*zip(*lr), color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    unfreeze = unfreeze_step(metrics)
    for ax in (ax_loss, ax_lr):
        if unfreeze is not None:
            ax.axvline(unfreeze, color="grey", ls="--", lw=1, label="unfreeze (phase 2)")
        ax.grid(alpha=0.3)
    ax_loss.legend(loc="best")  # the validation loss may lie high
    fig.suptitle("Loss and learning rate")
    fig.tight_layout()
    return fig


def plot_validation(metrics: RunMetrics):
    import matplotlib.pyplot as plt

    tables = {unit: validation_table(metrics, unit) for unit in ("wer", "cer")}
    if not any(series for _, series in tables["wer"]):
        return None
    limit = forgetting_limit(metrics)
    forgotten = {
        lang: {s for s, points in series if limit > 0 and points > limit}
        for lang, series, _ in forgetting_rows(metrics)
        if forgetting_judged(base_wer(metrics, lang))
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, unit in zip(axes, ("wer", "cer")):
        given = dict(validation_table(metrics, f"{unit}_given"))
        for lang, series in tables[unit]:
            if series:
                steps, values = zip(*series)
                (line,) = ax.plot(
                    steps,
                    [100 * v for v in values],
                    "o-",
                    lw=2.2 if lang == "all" else 1.2,
                    label=lang,
                )
                if given.get(lang):
                    g_steps, g_values = zip(*given[lang])
                    ax.plot(
                        g_steps, [100 * v for v in g_values], "--", color=line.get_color(), lw=1
                    )
                marked = [(s, 100 * v) for s, v in series if s in forgotten.get(lang, ())]
                if marked and unit == "wer":
                    ax.plot(*zip(*marked), "x", color="red", ms=11, mew=2.5)
        ax.set_title(
            f"validation {unit.upper()} %"
            + (" (dashed: language given)" if given else "")
            + (
                f"; x: forgetting above {limit:g} points"
                if unit == "wer" and any(forgotten.values())
                else ""
            )
        )
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_language_mix(metrics: RunMetrics):
    import matplotlib.pyplot as plt

    mix = language_mix(metrics)
    if not mix:
        return None
    langs = [lang for lang, _, _ in mix]
    x = range(len(langs))
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(langs) + 2), 4))
    ax.bar([i - 0.2 for i in x], [100 * (s or 0) for _, s, _ in mix], 0.4, label="realized")
    ax.bar([i + 0.2 for i in x], [100 * (t or 0) for _, _, t in mix], 0.4, label="target")
    ax.set_xticks(list(x), langs)
    ax.set_ylabel("% of utterances")
    ax.set_title("Language mix: realized (last 100 steps) vs target")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_data_path(metrics: RunMetrics):
    import matplotlib.pyplot as plt

    panels = [
        ("data/padding_efficiency", "padding efficiency"),
        ("throughput/audio_s_per_s", "audio seconds per second"),
        ("train/skipped_steps", "skipped optimizer steps (total)"),
        ("data/bad_audio_total", "bad audio utterances (total)"),
    ]
    if not any(metrics.series(key) for key, _ in panels):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex=True)
    unfreeze = unfreeze_step(metrics)
    for ax, (key, title) in zip(axes.flat, panels):
        series = metrics.series(key)
        if series:
            ax.plot(*zip(*series), lw=0.8)
            top = max(v for _, v in series)
            # Efficiency is a share; counts start at 0: a flat line then reads as flat, not as noise.
            ax.set_ylim(0, 1.02 if key == "data/padding_efficiency" else max(1.0, 1.1 * top))
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if unfreeze is not None:
            ax.axvline(unfreeze, color="grey", ls="--", lw=1)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.tight_layout()
    return fig


def loss_lines(metrics: RunMetrics) -> list[str]:
    """The report's validation-loss and overfitting lines (none for a run without val/loss)."""
    val = metrics.series("val/loss")
    if not val:
        return []
    (first_step, first), (last_step, last) = val[0], val[-1]
    best_step, best = min(val, key=lambda sv: (sv[1], -sv[0]))
    lines = [
        f"- Validation loss: first {first:.4f} (step {first_step}), lowest {best:.4f} "
        f"(step {best_step}), latest {last:.4f} (step {last_step})"
    ]
    rises = overfitting_rises(metrics)
    if rises <= 0:
        lines.append("- Overfitting: not judged (OVERFITTING_WARN_VALIDATIONS=0)")
        return lines
    _, flagged = overfitting(metrics)
    if flagged:
        lines.append(
            f"- **Overfitting** at step {', '.join(map(str, flagged))}: the validation loss rose "
            f"at each of the last {rises} validations while the training loss fell "
            f"(OVERFITTING_WARN_VALIDATIONS); use the lowest-WER checkpoint ('best'), fewer "
            f"steps, more data or augmentation: see docs/training.md"
        )
    else:
        lines.append(
            f"- Overfitting: none (the validation loss never rose at {rises} validations in a row "
            f"while the training loss fell; OVERFITTING_WARN_VALIDATIONS={rises})"
        )
    return lines


def render_report(run_dir: Path, metrics: RunMetrics, charts: list[str]) -> str:
    """The Markdown page: what a user quotes about the run, then the charts."""
    settings = metrics.settings
    steps = sorted(metrics.steps)
    last_step = steps[-1] if steps else None
    max_steps = settings.get("MAX_STEPS")
    losses = [v for _, v in metrics.series("train/loss")]
    window = min(LOSS_WINDOW, max(1, len(losses) // 2))
    unfreeze = unfreeze_step(metrics)
    lines = [f"# Run report: {run_dir.name}", ""]
    progress = f"step {last_step}" + (f" of {max_steps}" if max_steps else "")
    if max_steps and last_step is not None and last_step < max_steps:
        progress += " (still going, or stopped early)"
    lines += [
        f"- Run directory: `{run_dir}`",
        f"- Progress: {progress}; unfreeze at step {unfreeze if unfreeze is not None else 'n/a'}",
        f"- Base model: `{settings.get('INIT_MODEL') or 'none (trained from scratch)'}`",
        f"- Train loss: first {window} steps {_fmt(_mean(losses[:window]))}, "
        f"last {window} steps {_fmt(_mean(losses[-window:]))}",
        f"- Learning rate now: {_fmt(metrics.latest('train/lr'), '.3g')}",
    ]
    lines += loss_lines(metrics)
    pad = [v for _, v in metrics.series("data/padding_efficiency")]
    lines.append(f"- Padding efficiency: median {_fmt(statistics.median(pad) if pad else None)}")
    rate = metrics.series("throughput/audio_s_per_s")
    boundary = unfreeze if unfreeze is not None else math.inf
    for label, values in (
        ("phase 1 (encoder frozen)", [v for s, v in rate if s < boundary]),
        ("phase 2", [v for s, v in rate if s >= boundary]),
    ):
        if values:
            lines.append(
                f"- Audio seconds per second, {label}: median {statistics.median(values):.1f}"
            )
    wait = [v for _, v in metrics.series("time/data_wait_fraction_max")]
    if wait:
        lines.append(f"- Data wait (worst rank): median {statistics.median(wait):.3f} of step time")
    skipped = metrics.latest("train/skipped_steps")
    bad = metrics.latest("data/bad_audio_total")
    lines.append(
        f"- Skipped optimizer steps: {_fmt(skipped, '.0f')}; bad audio utterances: {_fmt(bad, '.0f')}"
    )
    reasons = [
        f"{key.rsplit('/', 1)[1]} {metrics.latest(key):.0f}"
        for key in metrics.keys_with_prefix("data/bad_audio/")
        if metrics.latest(key)
    ]
    if reasons:
        lines.append(f"  - by reason: {', '.join(reasons)}")
    if metrics.skipped_lines:
        lines.append(f"- {metrics.skipped_lines} unreadable line(s) of metrics.jsonl left out")

    for unit in ("wer", "cer"):
        table = validation_table(metrics, unit)
        if not any(series for _, series in table):
            continue
        lines += ["", f"## Validation {unit.upper()} %", ""]
        first_step = min(s for _, series in table for s, _ in series)
        first_label = "base (step 0)" if first_step == 0 and settings.get("INIT_MODEL") else "first"
        lines += [
            f"| language | {first_label} | best (step) | latest (step) |",
            "|---|---|---|---|",
        ]
        for lang, series in table:
            if not series:
                continue
            first = series[0][1] if series[0][0] == first_step else None
            best_step, best = min(series, key=lambda sv: (sv[1], -sv[0]))
            latest_step, latest = series[-1]
            lines.append(
                f"| {lang} | {_fmt(first, '.1f', 100)} | {100 * best:.1f} ({best_step}) "
                f"| {100 * latest:.1f} ({latest_step}) |"
            )
    given = dict(validation_table(metrics, "wer_given"))
    if any(given.values()):
        lines += [
            "",
            "## Validation WER % with the language given (decoded from each utterance's own tag)",
            "",
            "| language | first (step) | latest (step) | latest auto | auto - given |",
            "|---|---|---|---|---|",
        ]
        auto = dict(validation_table(metrics, "wer"))
        for lang, series in given.items():
            if not series:
                continue
            (first_step, first), (latest_step, latest) = series[0], series[-1]
            auto_now = dict(auto.get(lang, [])).get(latest_step)
            lines.append(
                f"| {lang} | {100 * first:.1f} ({first_step}) | {100 * latest:.1f} ({latest_step}) "
                f"| {_fmt(auto_now, '.1f', 100)} "
                f"| {_fmt(None if auto_now is None else auto_now - latest, '+.1f', 100)} |"
            )
    forgetting = forgetting_rows(metrics)
    if forgetting:
        limit = forgetting_limit(metrics)
        lines += [
            "",
            f"## Forgetting: the base's languages against step 0 (WER points; warned above "
            f"{limit:g}, FORGETTING_WARN_POINTS)",
            "",
            "| base language | latest (step) | worst (step) | latest, language given | verdict |",
            "|---|---|---|---|---|",
        ]
        for lang, series, given_series in forgetting:
            if not series:
                continue
            latest_step, latest = series[-1]
            worst_step, worst = max(series, key=lambda sv: (sv[1], -sv[0]))
            flagged = [s for s, v in series if limit > 0 and v > limit]
            base = base_wer(metrics, lang)
            if not forgetting_judged(base):
                verdict = (
                    f"none: the base's WER was already {100 * base:.1f}% at step 0 (at or "
                    f"above 100%: nothing known to forget)"
                )
            elif flagged:
                verdict = (
                    f"**forgetting** at step {', '.join(map(str, flagged))}: see docs/training.md"
                )
            else:
                verdict = "kept"
            lines.append(
                f"| {lang} | {latest:+.1f} ({latest_step}) | {worst:+.1f} ({worst_step}) "
                f"| {_fmt(given_series[-1][1] if given_series else None, '+.1f')} | {verdict} |"
            )
    lid = validation_table(metrics, "lid_acc")
    if any(series for _, series in lid):
        lines += [
            "",
            "## Language identification % (hypotheses starting with the right tag)",
            "",
            "| language | first (step) | latest (step) |",
            "|---|---|---|",
        ]
        for lang, series in lid:
            if series:
                (first_step, first), (latest_step, latest) = series[0], series[-1]
                lines.append(
                    f"| {lang} | {100 * first:.1f} ({first_step}) | {100 * latest:.1f} ({latest_step}) |"
                )
    mix = language_mix(metrics)
    if mix:
        lines += [
            "",
            "## Language mix (last 100 steps)",
            "",
            "| language | realized % | target % |",
        ]
        lines.append("|---|---|---|")
        for lang, share, target in mix:
            lines.append(f"| {lang} | {_fmt(share, '.1f', 100)} | {_fmt(target, '.1f', 100)} |")
    if charts:
        lines += ["", "## Charts", ""] + [f"![{Path(c).stem}]({c})" for c in charts]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, out_dir: Path) -> Path:
    """Charts and report.md of the run in ``run_dir`` into ``out_dir``; the path of report.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = read_metrics(run_dir)
    if not metrics.steps:
        raise SystemExit(
            f"run_report: {run_dir}/metrics.jsonl holds no logged step yet: wait for the first "
            f"optimizer step (LOG_EVERY_N_STEPS) and run it again"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = []
    for name, plot in (
        ("training.png", plot_training),
        ("validation.png", plot_validation),
        ("language_mix.png", plot_language_mix),
        ("data_path.png", plot_data_path),
        ("language_id.png", plot_language_id),
    ):
        fig = plot(metrics)
        if fig is None:  # nothing of it logged yet
            continue
        atomic_write(out_dir / name, lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=110))
        plt.close(fig)
        charts.append(name)
    text = render_report(run_dir, metrics, charts)
    report = out_dir / "report.md"
    atomic_write(report, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "run",
        nargs="?",
        type=Path,
        default=None,
        help="a run directory (holds metrics.jsonl) or a CHECKPOINT_DIR (default CHECKPOINT_DIR)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the PNGs and report.md go (default RUN/report)",
    )
    args = parser.parse_args(argv)
    run_dir = find_run_dir(args.run)
    report = write_report(run_dir, args.out or run_dir / "report")
    print(report.read_text(encoding="utf-8"))
    print(f"run_report: wrote {report} and its charts beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
