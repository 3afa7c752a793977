"""What scripts/make_train_val.py prints of a split: its summary (rows in and out per language,
what was dropped and why, the language corrections, the leaks across splits, the files written)
and its warnings (speaker ids several sources use, languages with a large share in validation).
Text only: the split itself is make_train_val.py's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from manifest_schema import summary_path


def format_shared_speaker_ids(report: dict[str, Any]) -> str:
    """The one line ``speaker_keys``'s report prints: ids several sources use, counted apart."""
    sources = report["sources"]
    return (
        f"{report['ids']:,} speaker id(s) (e.g. {report['example'][:40]!r}) appear in more than "
        f"one of the sources {', '.join(sources)}: counted as different people in each source; if they "
        f"are the same people, pass --same-speakers {','.join(sources)} (hashed ids, such as Common "
        f"Voice's client_id, are always taken as one person)"
    )


def format_large_validation(large: dict[str, dict[str, int]], fraction: float) -> list[str]:
    """One line per language of ``large_validation_shares``: its rows on each side, and the flags
    that would keep its validation within ``fraction``."""
    cap = math.floor(fraction * 100) / 100
    lines = []
    for lang, rows in large.items():
        total = rows["train"] + rows["val"]
        fits = math.floor(fraction * total)
        lines.append(
            f"{lang}: {rows['val']:,} rows in validation and {rows['train']:,} in train "
            f"({rows['val'] / total:.0%} of its rows in validation, over "
            f"VAL_WARN_FRACTION={fraction:.3g}): to train on more of them pass --max-val-fraction "
            f"{cap:g}"
            + (f" or --val-per-lang {fits}" if fits else "")
            + " (and --allow-short-val if a language then gets no validation row)"
        )
    return lines


def format_confusion(corrections: dict[str, int]) -> str:
    """Given (rows) x corrected (columns) table of the changed tags."""
    if not corrections:
        return "language corrections: none"
    pairs = {tuple(k.split("->")): n for k, n in corrections.items()}
    given = sorted({g for g, _ in pairs})
    corrected = sorted({c for _, c in pairs})
    width = max(6, *(len(c) + 1 for c in corrected))
    lines = [
        "language corrections (rows: given tag, columns: corrected tag)",
        "given   " + "".join(f"{c:>{width}}" for c in corrected),
    ]
    for g in given:
        lines.append(
            f"{g:<8}" + "".join(f"{pairs.get((g, c), 0) or '.':>{width}}" for c in corrected)
        )
    return "\n".join(lines)


def format_leaks(leaks: dict[str, Any]) -> str:
    """One line: the rows of each side whose audio or speaker is also on a more held-out side."""
    parts = []
    for kind, pairs in sorted(leaks["rows"].items()):
        for pair, n in pairs.items():
            side, other = pair.split("/")
            who = f" ({leaks['speakers'][pair]:,} speakers)" if kind == "speaker" else ""
            parts.append(f"{n:,} {side} rows share their {kind}{who} with {other}")
    if not parts:
        return "leaks across splits: none (no speaker and no audio in two splits)"
    action = "removed (--keep-leaks keeps them)" if leaks["removed"] else "kept (--keep-leaks)"
    return f"leaks across splits: {'; '.join(parts)}: {action}"


def format_summary(
    summary: dict[str, Any], train_path: Path, val_path: Path, test_path: Path | None = None
) -> str:
    lines = [format_confusion(summary["lang_corrections"])]
    if summary["unresolved_devanagari_conflicts"]:
        lines.append(
            "Devanagari text under a non-Devanagari tag, left as tagged (use --lang-fixes): "
            + ", ".join(f"{k}={v:,}" for k, v in summary["unresolved_devanagari_conflicts"].items())
        )
    dropped = sum(summary["dropped"].values())
    test_rows = summary.get("test_rows", 0)
    lines.append(
        f"rows: {summary['rows_in']:,} in = {summary['rows_out']:,} train + {summary['val_rows']:,} val "
        + (f"+ {test_rows:,} test " if test_rows else "")
        + f"+ {dropped:,} dropped"
    )
    for reason, n in sorted(summary["dropped"].items()):
        lines.append(f"  dropped {reason:<24} {n:>12,}")
    test_by_lang = summary.get("test_by_lang", {})
    langs = sorted(
        set(summary["kept_by_lang"])
        | set(summary["val_by_lang"])
        | set(test_by_lang)
        | set(summary["dropped_by_lang"])
    )
    test_head = f" {'test':>8}" if test_rows else ""
    lines.append(f"  {'lang':<8} {'train':>12} {'val':>8}{test_head} {'dropped':>10}")
    for lang in langs:
        test_cell = f" {test_by_lang.get(lang, 0):>8,}" if test_rows else ""
        lines.append(
            f"  {lang:<8} {summary['kept_by_lang'].get(lang, 0):>12,} {summary['val_by_lang'].get(lang, 0):>8,}"
            f"{test_cell} {sum(summary['dropped_by_lang'].get(lang, {}).values()):>10,}"
        )
    if summary["val_shortfall"]:
        lines.append(
            "validation short of its quota (groups too large to fit): "
            + ", ".join(f"{k}={v}" for k, v in summary["val_shortfall"].items())
        )
    split = summary["split"]
    if split.get("mode") == "keep":
        kept = split["kept"]
        lines.append(
            f"splits kept as the sources gave them: {kept['train']:,} train, {kept['val']:,} dev, "
            f"{kept['test']:,} test rows"
            + (
                f"; rows without a split split by speaker for {', '.join(split['resplit_languages'])}"
                if split["resplit_languages"]
                else ""
            )
            + " (--splits resplit splits train and dev by speaker instead)"
        )
    if "grouped_by" in split:
        lines.append(
            f"split grouped by {split['grouped_by']}: {split['val_groups']:,} val groups, "
            f"{split['train_groups']:,} train groups"
        )
    if "leaks" in summary:
        lines.append(format_leaks(summary["leaks"]))
    written = [train_path, val_path]
    if summary.get("test_manifest"):
        written.append(Path(summary["test_manifest"]))
    lines.append(f"wrote {', '.join(map(str, written))} and {summary_path(train_path).name}")
    if summary.get("test_manifest"):
        lines.append(
            f"score a model on the test split: python scripts/evaluate.py MODEL --manifest "
            f"{summary['test_manifest']}"
        )
    if summary.get("nemo_json"):
        lines.append(f"wrote NeMo JSON manifests {', '.join(summary['nemo_json'])}")
    return "\n".join(lines)
