"""A Common Voice release in miniature: one folder per language with train/dev/test/validated TSVs
as Common Voice writes them (tab-separated, quotes as they are, the v17 columns), clips/ with MP3
clips at 48 kHz mono, and clip_durations.tsv; plus the defects a real download can hold."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf

COLUMNS = (
    "client_id",
    "path",
    "sentence_id",
    "sentence",
    "sentence_domain",
    "up_votes",
    "down_votes",
    "age",
    "gender",
    "accents",
    "variant",
    "locale",
    "segment",
)
SENTENCES = {
    "hi": ["नमस्ते दुनिया", "सुप्रभात", "बिल्ली बैठी", "दरवाज़ा खोलो", "किताब पढ़ो", "पानी दो"],
    "en": ["hello world", "good morning", "the cat sat", "open the door", "read a book", "go on"],
}
LOCALE = {"hi": "hi", "en": "en", "pa": "pa-IN"}
RATE = 48_000


def mp3(seconds: float, k: int) -> bytes:
    """MP3 noise of ``seconds`` at 48 kHz mono (libsndfile >= 1.1 writes MPEG layer III)."""
    rng = np.random.default_rng(k)
    samples = (0.05 * rng.standard_normal(int(seconds * RATE))).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, samples, RATE, format="MP3", subtype="MPEG_LAYER_III")
    return buffer.getvalue()


def clip_rows(lang: str, n: int, split: str, start: int = 0) -> list[dict]:
    """``n`` rows of ``split`` (clips numbered from ``start``): four speakers, votes 2-4 up and
    0-1 down, every fifth row in the Benchmark segment."""
    rows = []
    for i in range(start, start + n):
        rows.append(
            {
                "client_id": f"{lang}-client-{i % 4}",
                "path": f"common_voice_{lang}_{i:05d}.mp3",
                "sentence_id": f"s{i}",
                "sentence": f"{SENTENCES[lang][i % 6]} {i}",
                "sentence_domain": "",
                "up_votes": str(2 + i % 3),
                "down_votes": str(i % 2),
                "age": "twenties" if i % 2 else "thirties",
                "gender": "female_feminine" if i % 2 else "male_masculine",
                "accents": "",
                "variant": "",
                "locale": LOCALE.get(lang, lang),
                "segment": "Benchmark" if i % 5 == 0 else "",
                "split": split,
                "seconds": round(1.0 + 0.1 * (i % 5), 2),
            }
        )
    return rows


def tsv_line(row: dict) -> str:
    return "\t".join(row[c] for c in COLUMNS)


def write_release(
    root: Path, lang: str, rows: list[dict], extra_lines: dict[str, list[str]] | None = None
) -> Path:
    """``root/<lang>/`` with a TSV per split (its rows in order, then ``extra_lines[split]`` as
    they are), validated.tsv (train + dev + test), clip_durations.tsv and an MP3 per row."""
    folder = root / lang
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    header = "\t".join(COLUMNS)
    extra_lines = extra_lines or {}
    by_split: dict[str, list[str]] = {"train": [], "dev": [], "test": []}
    durations = ["clip\tduration[ms]"]
    for k, row in enumerate(rows):
        by_split[row["split"]].append(tsv_line(row))
        clip = folder / "clips" / row["path"]
        if not clip.exists():
            clip.write_bytes(mp3(row["seconds"], k))
            durations.append(f"{row['path']}\t{round(row['seconds'] * 1000)}")
    validated = []
    for split, lines in by_split.items():
        lines = lines + extra_lines.get(split, [])
        validated += lines
        (folder / f"{split}.tsv").write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
    (folder / "validated.tsv").write_text("\n".join([header, *validated]) + "\n", encoding="utf-8")
    (folder / "clip_durations.tsv").write_text("\n".join(durations) + "\n", encoding="utf-8")
    return folder
