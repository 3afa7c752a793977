"""Benchmark importing a Common Voice TSV against importing the same rows as a NeMo JSON manifest
with ``check=none``, side by side in one process: rows per second and their ratio.

Usage:
    python benchmarks/bench_common_voice.py --help
    python benchmarks/bench_common_voice.py                  # 1,000,000 rows
    python benchmarks/bench_common_voice.py --rows 200000 --keep /tmp/bench_cv

It writes one synthetic Common Voice language folder: ``train.tsv`` (the v17 columns, a sentence
with a quote every 50 rows), ``clip_durations.tsv``, and ``clips/`` with a hard link per row to one
short MP3 (a directory entry per clip, as a real release has, without the disk space). The same
rows, durations included, become ``given.json`` in that folder, naming the same clips. Each build
goes through ``build_manifest.build_manifest`` (filters, cleaning, tags, the master written), in
turn, ``--repeat`` times; the fastest of each counts:

  nemo-none   --source nemo:given.json:check=none  (durations and files trusted)
  cv-none     --source cv:DIR:check=none           (clip_durations.tsv and clips trusted)
  cv-exists   --source cv:DIR:check=exists         (every clip looked up: missing ones found)

Printed: rows, seconds and rows per second of each, and the ratio of each cv build's rows per
second to nemo-none's (above 1: the TSV import is faster per row). Both builds must keep the same
rows (checked).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import soundfile as sf

import build_manifest as bm

WORDS = ["नमस्ते", "दुनिया", "बिल्ली", "दरवाज़ा", "किताब", "पानी", "घर", "आज", "कल", "चलो"]


def write_release(folder: Path, rows: int, seed: int, per_copy: int = 50_000) -> None:
    """``folder`` as a Common Voice language folder of ``rows`` train rows, and ``given.json``."""
    rng = np.random.default_rng(seed)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    words = pl.Series(WORDS)
    k = pl.int_range(0, rows, eager=True)
    picks = [words.gather(rng.integers(0, len(WORDS), rows)) for _ in range(4)]
    sentence = pl.concat_str(picks, separator=" ")
    quoted = (k % 50 == 0).to_numpy()
    sentence = pl.select(
        pl.when(pl.lit(pl.Series(quoted))).then('"' + sentence + '"').otherwise(sentence)
    ).to_series()
    seconds = pl.Series(np.round(rng.uniform(1.0, 10.0, rows), 3))
    frame = pl.DataFrame(
        {
            "client_id": "client" + (k % 5000).cast(pl.String),
            "path": "common_voice_hi_" + k.cast(pl.String).str.zfill(8) + ".mp3",
            "sentence_id": "s" + k.cast(pl.String),
            "sentence": sentence,
            "sentence_domain": "",
            "up_votes": (2 + k % 3).cast(pl.String),
            "down_votes": (k % 2).cast(pl.String),
            "age": "",
            "gender": "",
            "accents": "",
            "variant": "",
            "locale": "hi",
            "segment": "",
        }
    )
    frame.write_csv(folder / "train.tsv", separator="\t", quote_style="never")
    durations = frame.select(
        pl.col("path").alias("clip"), (seconds * 1000).cast(pl.Int64).alias("duration[ms]")
    )
    durations.write_csv(folder / "clip_durations.tsv", separator="\t", quote_style="never")
    frame.select(
        ("clips/" + pl.col("path")).alias("audio_filepath"),
        (durations["duration[ms]"] / 1000).alias("duration"),
        pl.col("sentence").alias("text"),
        pl.col("locale").alias("lang"),
        pl.col("client_id").alias("speaker_id"),
    ).write_ndjson(folder / "given.json")
    clip = folder / "clip.mp3"
    sf.write(clip, np.zeros(4800, np.float32), 48000, format="MP3", subtype="MPEG_LAYER_III")
    source = clip
    for n, name in enumerate(frame["path"]):
        if n % per_copy == 0:  # file systems cap the links of one file
            source = clip.with_name(f"clip_{n // per_copy}.mp3")
            shutil.copyfile(clip, source)
        os.link(source, folder / "clips" / name)


def build(spec: str, work: Path, name: str) -> tuple[float, pl.DataFrame]:
    out = work / f"m_{name}.parquet"
    started = time.perf_counter()
    bm.build_manifest(
        None,
        out,
        sources=[spec],
        audio_dir=work / "imported",
        languages=(),
        min_duration=0.0,
        max_duration=1e9,
        min_quality=-1.0,
        progress=False,
    )
    return time.perf_counter() - started, pl.read_parquet(out, columns=["audio_filepath", "text"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="TSV rows (default 1M)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each build (default 2)")
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep the files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_cv_"))
    folder = work / "hi"
    try:
        if folder.exists():
            shutil.rmtree(folder)
        started = time.perf_counter()
        write_release(folder, args.rows, args.seed)
        print(
            f"corpus: {args.rows:,} rows, train.tsv {(folder / 'train.tsv').stat().st_size / 2**20:.0f}"
            f" MiB, given.json {(folder / 'given.json').stat().st_size / 2**20:.0f} MiB, "
            f"{args.rows:,} clips (hard links) ({time.perf_counter() - started:.0f} s to write)"
        )
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        specs = {
            "nemo-none": f"nemo:{folder / 'given.json'}:check=none,name=given",
            "cv-none": f"cv:{folder}:check=none,name=cv",
            "cv-exists": f"cv:{folder}:check=exists,name=cv",
        }
        best: dict[str, float] = {}
        kept: dict[str, pl.DataFrame] = {}
        for _ in range(args.repeat):
            for name, spec in specs.items():
                seconds, kept[name] = build(spec, work, name)
                best[name] = min(best.get(name, seconds), seconds)
        reference = kept["nemo-none"].sort("audio_filepath")
        same = {n: kept[n].sort("audio_filepath").equals(reference) for n in specs}
        print(f"{'build':<10} {'rows kept':>10} {'seconds':>8} {'rows/s':>10} {'vs nemo-none':>13}")
        base = args.rows / best["nemo-none"]
        for name in specs:
            speed = args.rows / best[name]
            print(
                f"{name:<10} {kept[name].height:>10,} {best[name]:>8.2f} {speed:>10,.0f} "
                f"{speed / base:>12.2f}x"
            )
        if not all(same.values()):
            raise SystemExit(f"the builds kept different rows: {same}")
        print("same rows kept by every build: yes")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
