"""Plot a manifest: durations, hours and language mix, sampler buckets, and every row dropped on
the way to training.

Usage:
    python scripts/manifest_report.py                                  # TRAIN_MANIFEST_PATH -> DATA_DIR/report
    python scripts/manifest_report.py data/master_manifest.parquet --out report/master
    TEMPERATURE=0.5 python scripts/manifest_report.py data/train_manifest_v2.parquet \\
        --summary data/master_manifest.summary.json --summary data/train_manifest_v2.summary.json

Writes into ``--out``:
    durations.png       duration histogram per language (small multiples, bucket edges dashed)
    hours.png           hours of audio per language
    language_mix.png    natural, target and realized language shares of one sampler epoch at TEMPERATURE
    buckets.png         batches and utterances per duration bucket, padding efficiency per bucket
    dropped.png         rows dropped by reason (one colour per build step) and per language
    report.md           the same numbers as tables, with the plots inlined

The sampler is sampler.DurationBucketBatchSampler with the config.py settings (BUCKET_BOUNDARIES,
MAX_BATCH_DURATION, TEMPERATURE, LANG_WEIGHTING, GRAD_ACCUM, SEED, EPOCH_SIZE) on one rank, so
the plots show the plan of a whole epoch. Build summaries default to every ``*.summary.json`` beside
the manifest that has a ``dropped`` table (build_manifest.py, make_train_val.py). The training
caches' drops (rows with more tokens than encoder frames, or no valid duration) come from the caches
train.py would map for the manifest and, when it is TRAIN_MANIFEST_PATH, for VAL_MANIFEST_PATH
(--val-manifest): built for TOKENIZER_DIR, ENCODER_FRAME_SECONDS and MAX_TOKEN_LEN in CACHE_DIR by
scripts/build_training_cache.py. A validation language that loses more than a tenth of its rows
there gets a WARNING line in report.md and on the terminal, and its dropped rows are listed by
segment_id with their tokens and frames.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pyarrow.parquet as pq

import config
import training_cache
from atomic_files import atomic_write
from file_names import printable
from manifest_schema import SUMMARY_SUFFIX

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

COLORS = {"natural": "#9e9e9e", "target": "#1f77b4", "realized": "#ff7f0e"}
DPI = 110
# Dropped rows listed in report.md per training cache, language and reason (the cache's
# dropped_rows.parquet lists them all).
CACHE_ROWS_LISTED = 10


# --- data --------------------------------------------------------------------------------------


def read_manifest(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(durations float64, languages str) of the manifest; a clear error when columns are missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"manifest {path} does not exist; build it first (build_manifest.py, "
            "scripts/make_train_val.py) or pass another path"
        )
    names = pq.read_schema(path).names
    missing = [c for c in ("duration", "lang") if c not in names]
    if missing:
        raise ValueError(
            f"manifest {path} lacks column(s) {missing}; expected the manifest schema "
            "(segment_id, shard_id, text, duration, lang, ...)"
        )
    table = pq.read_table(path, columns=["duration", "lang"])
    if table.num_rows == 0:
        raise ValueError(f"manifest {path} has no rows")
    durations = table.column("duration").to_numpy().astype(np.float64)
    languages = np.asarray(table.column("lang").to_numpy(zero_copy_only=False)).astype(str)
    return durations, languages


def language_table(durations: np.ndarray, languages: np.ndarray) -> list[dict[str, Any]]:
    """Per language: utterances, hours, duration quantiles; sorted by hours, largest first."""
    names, codes = np.unique(languages, return_inverse=True)
    counts = np.bincount(codes, minlength=len(names))
    seconds = np.bincount(codes, weights=durations, minlength=len(names))
    # Sorted by language, then duration: each language's slice is sorted, quantiles come cheap.
    by_lang = np.split(durations[np.lexsort((durations, codes))], np.cumsum(counts)[:-1])
    rows = []
    for i, name in enumerate(names):
        d = by_lang[i]
        rows.append(
            {
                "lang": str(name),
                "utterances": int(counts[i]),
                "hours": float(seconds[i] / 3600),
                "median_s": float(np.median(d)),
                "p95_s": float(np.quantile(d, 0.95)),
                "min_s": float(d[0]),
                "max_s": float(d[-1]),
            }
        )
    return sorted(rows, key=lambda r: (-r["hours"], r["lang"]))


def sampler_plan(durations: np.ndarray, languages: np.ndarray) -> dict[str, Any]:
    """One epoch of the configured sampler on one rank: its epoch_stats() plus per-bucket fill,
    every figure in the seconds the batches play (each row's duration over its SPEED_PERTURB
    factor), as the sampler packs them."""
    # heavy import (torch), only when plotting it
    from sampler import BatchingSettings, DurationBucketBatchSampler

    settings = BatchingSettings.from_config()
    sampler = DurationBucketBatchSampler(durations, languages, settings, world_size=1, rank=0)
    sampler.set_epoch(0)
    stats = sampler.epoch_stats()
    labels = list(stats["batches_per_bucket"])
    edges = np.asarray(getattr(sampler, "boundaries", ()), dtype=np.float64)
    if len(edges) + 1 != len(labels):
        edges = np.asarray(config.BUCKET_BOUNDARIES, dtype=np.float64)
    # The plan's batches, flattened in C (no per-row Python): bucket, size, longest and total audio.
    batches = list(sampler)
    sizes = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
    flat = np.fromiter(
        itertools.chain.from_iterable(batches), dtype=np.int64, count=int(sizes.sum())
    )
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    speeds = np.fromiter(
        itertools.chain.from_iterable(b.speeds or itertools.repeat(1.0, len(b)) for b in batches),
        dtype=np.float64,
        count=len(flat),
    )
    dur = durations[flat] / speeds
    longest = np.maximum.reduceat(dur, starts) if len(starts) else np.zeros(0)
    audio = np.add.reduceat(dur, starts) if len(starts) else np.zeros(0)
    bucket = np.searchsorted(
        edges, longest, side="right"
    )  # the sampler's bucket: edges <= duration
    n = len(labels)
    padded = np.bincount(bucket, weights=sizes * longest, minlength=n)
    real = np.bincount(bucket, weights=audio, minlength=n)
    corpus_bucket = np.searchsorted(edges, durations, side="right")
    return {
        "stats": stats,
        "labels": labels,
        "edges": edges.tolist(),
        "batches": np.bincount(bucket, minlength=n).tolist(),
        "planned_utterances": np.bincount(bucket, weights=sizes, minlength=n).astype(int).tolist(),
        "corpus_utterances": np.bincount(corpus_bucket, minlength=n).tolist(),
        "padding_efficiency": (real / np.maximum(padded, 1e-12)).tolist(),
        "mean_batch_seconds": (real / np.maximum(np.bincount(bucket, minlength=n), 1)).tolist(),
    }


def find_summaries(manifest: Path) -> list[Path]:
    """Every ``*.summary.json`` beside the manifest that holds a ``dropped`` table."""
    found = []
    for path in sorted(Path(manifest).parent.glob("*" + SUMMARY_SUFFIX)):
        try:
            if isinstance(json.loads(path.read_text()).get("dropped"), dict):
                found.append(path)
        except (OSError, ValueError, AttributeError):
            continue
    return found


def read_summaries(paths: list[Path]) -> list[dict[str, Any]]:
    """[{"step": file stem, "path", "rows_in", "rows_out", "dropped": {reason: n}, "dropped_by_lang"}]."""
    steps = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"summary {path}: cannot be read as JSON ({exc})") from None
        if not isinstance(data.get("dropped"), dict):
            raise ValueError(
                f"summary {path}: no 'dropped' table; expected a build summary "
                "(build_manifest.py or make_train_val.py output)"
            )
        steps.append(
            {
                # printable: a name that is not UTF-8 could not be written into report.md
                "step": printable(Path(path).name).removesuffix(SUMMARY_SUFFIX),
                "path": printable(path),
                "rows_in": data.get("rows_in"),
                "rows_out": data.get("rows_out"),
                "dropped": {str(k): int(v) for k, v in data["dropped"].items()},
                "dropped_by_lang": data.get("dropped_by_lang", {}),
                "val_rows": data.get("val_rows"),
                "lang_corrections": data.get("lang_corrections", {}),
            }
        )
    return steps


def find_caches(manifest: Path, val_manifest: Path | None) -> tuple[list[tuple[Path, Path]], str]:
    """([(manifest, its training cache)], a note on what was not found) for ``manifest`` and
    ``val_manifest``: the caches ``training_cache.ensure`` would map with the configured
    TOKENIZER_DIR, ENCODER_FRAME_SECONDS, MAX_TOKEN_LEN and CACHE_DIR (nothing is built)."""
    model = Path(config.TOKENIZER_DIR) / "tokenizer.model"
    if not model.is_file():
        return [], (
            f"No tokenizer at TOKENIZER_DIR={config.TOKENIZER_DIR}, so no training cache to read the "
            "drops of (scripts/train_tokenizer.py, then scripts/build_training_cache.py)."
        )
    fingerprint = training_cache.model_file_fingerprint(model)
    found, missing = [], []
    for path in [manifest] + ([val_manifest] if val_manifest is not None else []):
        cache = training_cache.lookup_by_fingerprint(
            path,
            fingerprint,
            frame_seconds=config.ENCODER_FRAME_SECONDS,
            max_token_len=config.MAX_TOKEN_LEN,
            cache_dir=config.CACHE_DIR,
        )
        (found.append((Path(path), cache)) if cache is not None else missing.append(str(path)))
    note = (
        f"No training cache of {', '.join(missing)} for TOKENIZER_DIR={config.TOKENIZER_DIR}, "
        f"ENCODER_FRAME_SECONDS={config.ENCODER_FRAME_SECONDS:g}, MAX_TOKEN_LEN="
        f"{config.MAX_TOKEN_LEN}: its drops are not shown (scripts/build_training_cache.py builds it)."
        if missing
        else ""
    )
    return found, note


def read_cache_drops(caches: list[tuple[Path, Path]], val_manifest: Path | None) -> list[dict]:
    """Build steps (as ``read_summaries`` gives them) of the training caches, each also with its
    ``record`` (the dropped_rows.parquet), ``listed`` (its first dropped rows per language and
    reason) and ``warnings`` (one line per language of the validation manifest that loses more
    than a tenth of its rows)."""
    steps = []
    for manifest, cache in caches:
        meta = json.loads((cache / training_cache.META_FILE).read_text())
        summary = meta["summary"]
        record = cache / training_cache.DROPPED_FILE
        table = training_cache.read_dropped_rows(cache)
        listed = [
            row
            for _, group in itertools.groupby(
                sorted(table.to_pylist(), key=lambda r: (r["lang"], r["reason"])),
                key=lambda r: (r["lang"], r["reason"]),
            )
            for row in itertools.islice(group, CACHE_ROWS_LISTED)
        ]
        validation = val_manifest is not None and manifest.resolve() == val_manifest.resolve()
        heavy = training_cache.heavy_drops(summary) if validation else []
        steps.append(
            {
                "step": f"training cache of {manifest.stem}",
                "path": str(cache),
                "rows_in": summary["rows_read"],
                "rows_out": summary["rows_kept"],
                "dropped": {r: n for r, n in summary["dropped"].items() if n},
                "dropped_by_lang": summary.get("dropped_by_lang", {}),
                "val_rows": None,
                "lang_corrections": {},
                "record": str(record),
                "listed": listed,
                "heavy": heavy,
                "warnings": [
                    training_cache.validation_drop_warning(manifest, h, summary, record)
                    for h in heavy
                ],
            }
        )
    return steps


def drops_by_language(steps: list[dict]) -> tuple[list[str], list[tuple[str, str, dict]]]:
    """(languages, [(step, reason, {lang: rows})]): every step's drops per language and reason."""
    langs = sorted({lang for s in steps for lang in s["dropped_by_lang"]})
    rows = [
        (
            s["step"],
            reason,
            {
                lang: v[reason]
                for lang, v in s["dropped_by_lang"].items()
                if isinstance(v, dict) and v.get(reason)
            },
        )
        for s in steps
        for reason, _ in sorted(s["dropped"].items(), key=lambda kv: -kv[1])
    ]
    return langs, rows


# --- plots -------------------------------------------------------------------------------------


def _thousands(axis: matplotlib.axis.Axis) -> None:
    """At most ~6 ticks, written 120,000: long plain numbers collide on a crowded axis."""
    axis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=6, integer=True))
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))


def _save(fig: plt.Figure, path: Path) -> None:
    # A reader never sees half a PNG. The suffix tells savefig the format.
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=DPI), suffix=".png")
    plt.close(fig)


def plot_durations(
    durations: np.ndarray, languages: np.ndarray, table: list[dict], edges: list[float]
) -> plt.Figure:
    langs = [r["lang"] for r in table]
    cols = min(3, len(langs))
    rows = -(-len(langs) // cols)
    top = max(float(durations.max()), float(config.MAX_DURATION))
    width = 0.5 if top <= 40 else top / 80
    bins = np.arange(0.0, top + width, width)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 2.6 * rows + 0.8), sharex=True, squeeze=False
    )
    for ax, r in zip(axes.flat, table):
        ax.hist(durations[languages == r["lang"]], bins=bins, color="#1f77b4")
        for edge in edges:
            ax.axvline(edge, color="#555555", linestyle="--", linewidth=0.7)
        ax.set_title(f"{r['lang']}: {r['utterances']:,} utts, {r['hours']:.2f} h", fontsize=10)
        ax.set_ylabel("utterances")
        _thousands(ax.yaxis)
    for i, ax in enumerate(axes.flat):
        if i >= len(table):
            ax.set_visible(False)
        elif i >= len(table) - cols:  # the lowest visible panel of each column
            ax.set_xlabel("duration (s)")
            ax.tick_params(labelbottom=True)
    fig.suptitle(
        f"Utterance duration per language ({width:g} s bins; dashed: bucket edges)", fontsize=12
    )
    fig.tight_layout()
    return fig


def plot_hours(table: list[dict]) -> plt.Figure:
    langs = [r["lang"] for r in table][::-1]
    hours = np.array([r["hours"] for r in table][::-1])
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(langs) + 1.6))
    bars = ax.barh(langs, hours, color="#1f77b4")
    labels = [f"{r['hours']:.2f} h  ({r['utterances']:,} utts)" for r in table][::-1]
    ax.bar_label(bars, labels=labels, padding=4, fontsize=9)
    ax.set_xlim(0, hours.max() * 1.45)  # room for the labels
    ax.set_xlabel("hours of audio")
    ax.set_ylabel("language")
    ax.set_title(
        f"Hours per language (total {hours.sum():.2f} h, {sum(r['utterances'] for r in table):,} utts)"
    )
    fig.tight_layout()
    return fig


def plot_language_mix(stats: dict, langs: list[str]) -> plt.Figure:
    x = np.arange(len(langs))
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(langs) + 2), 4.2))
    for k, kind in enumerate(("natural", "target", "realized")):
        share = [100 * stats[f"{kind}_share"].get(lang, 0.0) for lang in langs]
        ax.bar(x + (k - 1) * width, share, width, label=kind, color=COLORS[kind])
    ax.set_xticks(x, langs)
    unit = stats.get("share_unit", "utterances")
    ax.set_ylabel(f"share of the epoch's {unit} (%)")
    ax.set_xlabel("language")
    ax.set_title(f"Language mix of one sampler epoch at TEMPERATURE={config.TEMPERATURE:g}")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_buckets(plan: dict) -> plt.Figure:
    labels, x = plan["labels"], np.arange(len(plan["labels"]))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (
        (plan["batches"], "batches", "Batches per bucket", "{:,.0f}"),
        (
            plan["planned_utterances"],
            "utterances in the epoch plan",
            "Utterances per bucket",
            "{:,.0f}",
        ),
        (
            plan["padding_efficiency"],
            "real audio / padded audio",
            "Padding efficiency per bucket",
            "{:.3f}",
        ),
    )
    for k, (ax, (values, ylabel, title, fmt)) in enumerate(zip(axes, panels)):
        bars = ax.bar(x, values, color="#1f77b4")
        texts = [fmt.format(v) if v else "" for v in values]
        if k == 2:  # inside the bars, clear of the epoch line drawn across their tops
            ax.bar_label(bars, labels=texts, label_type="center", color="white", fontsize=9)
        else:
            ax.bar_label(bars, labels=texts, padding=2, fontsize=8)
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_xlabel("bucket (longest utterance in the batch)")
        ax.set_ylabel(ylabel)
        if k < 2:
            _thousands(ax.yaxis)
        ax.set_title(title, fontsize=11)
        ax.margins(y=0.15)
    overall = plan["stats"]["padding_efficiency"]
    axes[2].set_ylim(0, 1.12)
    axes[2].axhline(overall, color="#ff7f0e", linestyle="--", linewidth=1)
    axes[2].set_title(
        f"Padding efficiency per bucket\n(dashed: whole epoch, {overall:.3f})", fontsize=11
    )
    fig.suptitle(f"Bucket fill at MAX_BATCH_DURATION={config.MAX_BATCH_DURATION:g} s", fontsize=12)
    fig.tight_layout()
    return fig


def plot_dropped(steps: list[dict]) -> plt.Figure:
    items = [
        (s["step"], reason, n)
        for s in steps
        for reason, n in sorted(s["dropped"].items(), key=lambda kv: -kv[1])
    ]
    langs, per_lang = drops_by_language(steps)
    heights = (0.42 * max(1, len(items)) + 1.4, 0.42 * max(1, len(langs)) + 1.4)
    fig, (ax, by_lang) = plt.subplots(
        2,
        1,
        figsize=(10, sum(heights) + 0.6),
        gridspec_kw={"height_ratios": heights},
        squeeze=True,
    )
    if not items:
        ax.text(0.5, 0.5, "no rows dropped", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
    else:
        palette = plt.get_cmap("tab10")
        step_color = {s["step"]: palette(i % 10) for i, s in enumerate(steps)}
        y = np.arange(len(items))[::-1]
        bars = ax.barh(y, [n for _, _, n in items], color=[step_color[s] for s, _, _ in items])
        ax.bar_label(bars, labels=[f"{n:,}" for _, _, n in items], padding=3, fontsize=9)
        ax.set_yticks(y, [reason for _, reason, _ in items])
        ax.set_xlim(0, max(n for _, _, n in items) * 1.2)
        _thousands(ax.xaxis)
        ax.set_xlabel("rows dropped")
        ax.set_ylabel("reason")
        handles = [plt.Rectangle((0, 0), 1, 1, color=step_color[s["step"]]) for s in steps]
        ax.legend(
            handles,
            [
                f"{s['step']} ({s['rows_in']:,} rows in)" if s["rows_in"] is not None else s["step"]
                for s in steps
            ],
            title="build step",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            frameon=False,
            fontsize=9,
        )
    ax.set_title("Rows dropped by reason, per build step")
    _plot_dropped_by_language(by_lang, langs, per_lang, steps)
    fig.tight_layout()
    return fig


def _plot_dropped_by_language(ax, langs: list[str], per_lang: list, steps: list[dict]) -> None:
    """One stacked bar per language, a segment per (build step, reason)."""
    if not langs:
        ax.text(0.5, 0.5, "no rows dropped", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
        return
    palette = plt.get_cmap("tab20")
    y = np.arange(len(langs))[::-1]
    left = np.zeros(len(langs))
    for k, (step, reason, counts) in enumerate(per_lang):
        values = np.array([counts.get(lang, 0) for lang in langs], dtype=np.float64)
        ax.barh(y, values, left=left, color=palette(k % 20), label=f"{step}: {reason}")
        left += values
    warned = {
        h["lang"]: f"{100 * h['dropped'] / h['read']:.0f}%"
        for s in steps
        for h in s.get("heavy", [])
    }
    labels = [
        f"{int(n):,}" + (f"  ({warned[lang]} of its validation rows)" if lang in warned else "")
        for lang, n in zip(langs, left)
    ]
    for yy, n, label, lang in zip(y, left, labels, langs):
        ax.text(
            n,
            yy,
            " " + label,
            va="center",
            fontsize=9,
            color="#c62828" if lang in warned else "black",
        )
    ax.set_yticks(y, langs)
    ax.set_xlim(0, left.max() * (1.6 if warned else 1.2))
    _thousands(ax.xaxis)
    ax.set_xlabel("rows dropped")
    ax.set_ylabel("language")
    ax.legend(
        title="build step: reason",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
        fontsize=8,
    )
    ax.set_title("Rows dropped per language, every build step")


def build_figures(
    durations: np.ndarray,
    languages: np.ndarray,
    table: list[dict],
    plan: dict | None,
    steps: list[dict],
    edges: list[float],
) -> dict[str, plt.Figure]:
    """File name -> figure, for every plot the inputs allow (no sampler plan: no mix or bucket plots)."""
    figures = {
        "durations.png": plot_durations(durations, languages, table, edges),
        "hours.png": plot_hours(table),
    }
    if plan is not None:
        figures["language_mix.png"] = plot_language_mix(plan["stats"], [r["lang"] for r in table])
        figures["buckets.png"] = plot_buckets(plan)
    if steps:
        figures["dropped.png"] = plot_dropped(steps)
    return figures


# --- markdown ----------------------------------------------------------------------------------


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(
    out: Path,
    manifest: Path,
    table: list[dict],
    plan: dict | None,
    steps: list[dict],
    cache_note: str = "",
) -> str:
    total_h = sum(r["hours"] for r in table)
    parts = [
        f"# Data report: {manifest.name}",
        "",
        f"Manifest `{manifest}`: {sum(r['utterances'] for r in table):,} utterances, {total_h:.2f} hours, "
        f"{len(table)} languages. Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "## Hours per language",
        "",
        "![hours per language](hours.png)",
        "",
        _md_table(
            [
                "lang",
                "utterances",
                "hours",
                "share of hours",
                "median s",
                "p95 s",
                "min s",
                "max s",
            ],
            [
                [
                    r["lang"],
                    f"{r['utterances']:,}",
                    f"{r['hours']:.3f}",
                    f"{100 * r['hours'] / max(total_h, 1e-12):.1f}%",
                    f"{r['median_s']:.2f}",
                    f"{r['p95_s']:.2f}",
                    f"{r['min_s']:.2f}",
                    f"{r['max_s']:.2f}",
                ]
                for r in table
            ],
        ),
        "",
        "## Duration per language",
        "",
        "![duration histograms](durations.png)",
        "",
    ]
    if plan is not None:
        st = plan["stats"]
        langs = [r["lang"] for r in table]
        parts += [
            f"## Language mix at TEMPERATURE={config.TEMPERATURE:g}",
            "",
            f"One epoch of the sampler (LANG_WEIGHTING={config.LANG_WEIGHTING}, shares of "
            f"{st.get('share_unit', 'utterances')}): natural = the manifest's own mix, target ~ n^T, "
            "realized = the epoch's plan.",
            "",
            "![language mix](language_mix.png)",
            "",
            _md_table(
                ["lang", "natural", "target", "realized", "repeated", "skipped"],
                [
                    [
                        lang,
                        f"{100 * st['natural_share'].get(lang, 0):.1f}%",
                        f"{100 * st['target_share'].get(lang, 0):.1f}%",
                        f"{100 * st['realized_share'].get(lang, 0):.1f}%",
                        st.get("repeated", {}).get(lang, 0),
                        st.get("skipped", {}).get(lang, 0),
                    ]
                    for lang in langs
                ],
            ),
            "",
            "## Buckets and padding",
            "",
            f"Padding efficiency of the epoch: **{st['padding_efficiency']:.3f}** (real audio / batch size x "
            f"longest utterance). MAX_BATCH_DURATION={config.MAX_BATCH_DURATION:g} s, "
            f"{sum(plan['batches']):,} batches.",
            "",
            "![buckets](buckets.png)",
            "",
            _md_table(
                [
                    "bucket",
                    "utterances in manifest",
                    "utterances in plan",
                    "batches",
                    "utts / batch",
                    "audio s / batch",
                    "padding efficiency",
                ],
                [
                    [
                        lab,
                        f"{c:,}",
                        f"{u:,}",
                        f"{b:,}",
                        f"{u / b:.1f}" if b else "-",
                        f"{s:.1f}" if b else "-",
                        f"{e:.3f}" if b else "-",
                    ]
                    for lab, c, u, b, s, e in zip(
                        plan["labels"],
                        plan["corpus_utterances"],
                        plan["planned_utterances"],
                        plan["batches"],
                        plan["mean_batch_seconds"],
                        plan["padding_efficiency"],
                    )
                ],
            ),
            "",
        ]
    parts += ["## Rows dropped", ""]
    parts += [f"> **{line}**\n" for s in steps for line in s.get("warnings", [])]
    if not any("record" not in s for s in steps):
        parts += [
            "No build summaries (`*.summary.json`) found beside the manifest; pass them with --summary.",
            "",
        ]
    if cache_note:
        parts += [cache_note, ""]
    if steps:
        langs, per_lang = drops_by_language(steps)
        parts += [
            "![rows dropped](dropped.png)",
            "",
            "Every build step's drops per language and reason:",
            "",
            _md_table(
                ["build step", "reason", "rows", *langs],
                [
                    [
                        step,
                        reason,
                        f"{sum(c.values()):,}",
                        *(f"{c.get(lang, 0):,}" for lang in langs),
                    ]
                    for step, reason, c in per_lang
                ],
            ),
            "",
        ]
        for s in steps:
            total = sum(s["dropped"].values())
            rows_in = "?" if s["rows_in"] is None else f"{s['rows_in']:,}"
            rows_out = "?" if s["rows_out"] is None else f"{s['rows_out']:,}"
            val = "" if s.get("val_rows") is None else f" (+ {s['val_rows']:,} validation)"
            parts += [
                f"### {s['step']}",
                "",
                f"`{s['path']}`: {rows_in} rows in, {rows_out} out{val}, {total:,} dropped.",
                "",
            ]
            if s.get("lang_corrections"):
                parts += [
                    "Language tags corrected (given->corrected): "
                    + ", ".join(f"{k} {v:,}" for k, v in sorted(s["lang_corrections"].items()))
                    + ".",
                    "",
                ]
            if s["dropped"]:
                parts += [
                    _md_table(
                        ["reason", "rows", "by language"],
                        [
                            [
                                reason,
                                f"{n:,}",
                                ", ".join(
                                    f"{lang} {v[reason]}"
                                    for lang, v in sorted(s["dropped_by_lang"].items())
                                    if reason in v
                                ),
                            ]
                            for reason, n in sorted(s["dropped"].items(), key=lambda kv: -kv[1])
                        ],
                    ),
                    "",
                ]
            if s.get("listed"):
                parts += [
                    f"Every dropped row is listed in `{s['record']}`; the first "
                    f"{CACHE_ROWS_LISTED} per language and reason:",
                    "",
                    _md_table(
                        ["segment_id", "lang", "reason", "tokens", "frames", "duration s", "row"],
                        [
                            [
                                r["segment_id"],
                                r["lang"],
                                r["reason"],
                                r["tokens"],
                                r["frames"],
                                f"{r['duration']:.2f}",
                                r["manifest_row"],
                            ]
                            for r in s["listed"]
                        ],
                    ),
                    "",
                ]
    text = "\n".join(parts)
    atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return text


def default_val_manifest(manifest: Path) -> Path | None:
    """VAL_MANIFEST_PATH when ``manifest`` is TRAIN_MANIFEST_PATH and it exists, else None."""
    val = Path(config.VAL_MANIFEST_PATH)
    same = Path(manifest).resolve() == Path(config.TRAIN_MANIFEST_PATH).resolve()
    return val if same and val.is_file() else None


def write_report(
    manifest: Path,
    out: Path,
    summaries: list[Path] | None = None,
    *,
    with_sampler: bool = True,
    val_manifest: Path | None = None,
) -> dict[str, Any]:
    """Write the plots and report.md for ``manifest`` into ``out``; return what was written and the
    numbers. The drops of the training caches of ``manifest`` and ``val_manifest`` (default
    ``default_val_manifest``) are shown with the build summaries'."""
    manifest, out = Path(manifest), Path(out)
    val_manifest = default_val_manifest(manifest) if val_manifest is None else Path(val_manifest)
    durations, languages = read_manifest(manifest)
    out.mkdir(parents=True, exist_ok=True)
    table = language_table(durations, languages)
    plan = sampler_plan(durations, languages) if with_sampler else None
    edges = (
        plan["edges"]
        if plan
        else ([] if isinstance(config.BUCKET_BOUNDARIES, str) else list(config.BUCKET_BOUNDARIES))
    )
    steps = read_summaries(find_summaries(manifest) if summaries is None else summaries)
    caches, cache_note = find_caches(manifest, val_manifest)
    steps += read_cache_drops(caches, val_manifest)
    figures = build_figures(durations, languages, table, plan, steps, edges)
    for name, fig in figures.items():
        _save(fig, out / name)
    files = list(figures)
    write_markdown(out, manifest, table, plan, steps, cache_note)
    return {
        "out": str(out),
        "files": files + ["report.md"],
        "languages": table,
        "padding_efficiency": plan["stats"]["padding_efficiency"] if plan else None,
        "summaries": [s["path"] for s in steps if "record" not in s],
        "caches": [str(cache) for _, cache in caches],
        "cache_note": cache_note,
        "warnings": [line for s in steps for line in s.get("warnings", [])],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_epilog(
            "manifest_report",
            "Example:\n  python scripts/manifest_report.py data/train_manifest_v2.parquet "
            "--out data/report",
        ),
    )
    parser.add_argument(
        "manifest",
        nargs="?",
        type=Path,
        default=None,
        help=f"manifest parquet (default TRAIN_MANIFEST_PATH = {config.TRAIN_MANIFEST_PATH})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output directory (default DATA_DIR/report = {config.DATA_DIR / 'report'})",
    )
    parser.add_argument(
        "--summary",
        type=Path,
        action="append",
        default=None,
        help="a build summary JSON to plot drops from; repeatable (default: every "
        "*.summary.json beside the manifest)",
    )
    parser.add_argument(
        "--val-manifest",
        type=Path,
        default=None,
        help="the validation manifest whose training cache's drops to show and warn about (default "
        "VAL_MANIFEST_PATH when the manifest is TRAIN_MANIFEST_PATH)",
    )
    parser.add_argument(
        "--no-sampler",
        action="store_true",
        help="skip the language-mix and bucket plots (they build one sampler epoch)",
    )
    args = parser.parse_args(argv)
    manifest = args.manifest if args.manifest is not None else config.TRAIN_MANIFEST_PATH
    out = args.out if args.out is not None else config.DATA_DIR / "report"
    started = time.perf_counter()
    try:
        result = write_report(
            manifest,
            out,
            args.summary,
            with_sampler=not args.no_sampler,
            val_manifest=args.val_manifest,
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"manifest_report: error: {exc}", file=sys.stderr)
        return 1
    print(f"data report for {manifest} ({time.perf_counter() - started:.1f} s):")
    for row in result["languages"]:
        print(
            f"  {row['lang']:<6} {row['utterances']:>10,} utts {row['hours']:>9.2f} h  "
            f"median {row['median_s']:.1f} s"
        )
    if result["padding_efficiency"] is not None:
        print(f"  padding efficiency of one epoch: {result['padding_efficiency']:.3f}")
    print(f"  drops from: {', '.join(result['summaries']) or 'no summaries found'}")
    print(f"  training caches: {', '.join(result['caches']) or result['cache_note']}")
    for line in result["warnings"]:
        print(f"  {line}")
    print(f"wrote {', '.join(result['files'])} to {result['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
