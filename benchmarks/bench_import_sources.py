"""Benchmark importing a NeMo JSON manifest with build_manifest.py against building the same rows
from in-house shards, on the same machine: rows per second and peak memory.

Usage:
    python benchmarks/bench_import_sources.py --help
    python benchmarks/bench_import_sources.py                      # 1,000,000 rows; 100,000 with headers
    python benchmarks/bench_import_sources.py --rows 250000 --header-rows 20000 --keep /tmp/bench

It writes synthetic shards (metadata.parquet + audio_index.parquet, as bench_build_manifest.py
does) and gives every indexed row an audio file where extract_audio.py would put it (hard links to
one short FLAC: a directory entry per row, as a real corpus has, without the disk space). The same
rows then become a NeMo JSON manifest (audio_filepath, duration, text, lang, speaker_id,
tx_quality_score; the rows without audio left out, as NeMo manifests have none). Each build runs
in a fresh child process, one after the other, so that its peak memory (VmHWM) is its own:

  shards        build_manifest.py over the shard tree (the in-house path)
  nemo-exists   --source nemo:...:check=exists (durations given and trusted, every file looked up)
  nemo-none     --source nemo:...:check=none (durations and files trusted, as the shard build
                trusts audio_index.parquet)
  nemo-header   --source nemo:... on the first --header-rows rows with the durations removed, so
                every audio header is read (the default check)

Printed: seconds, rows per second, peak RSS and bytes per row of each, and the ratios of
nemo-exists and nemo-none to shards. Both builds must keep the same rows (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import soundfile as sf

from benchmarks.bench_build_manifest import write_corpus
from manifest_schema import INDEX_FILE, METADATA_FILE

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from pathlib import Path
import build_manifest as bm
t = time.perf_counter()
kind, arg, out, audio = sys.argv[1:5]
summary = bm.build_manifest(
    Path(arg) if kind == "shards" else None, Path(out),
    sources=None if kind == "shards" else [arg], audio_dir=Path(audio),
    languages=(), min_duration=0.0, max_duration=1e9, min_quality=-1.0, progress=False,
)
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        peak = int(line.split()[1]) * 1024
print(json.dumps({"seconds": time.perf_counter() - t, "peak": peak,
                  "rows_in": summary["rows_in"], "rows_out": summary["rows_out"]}))
"""


def link_audio(shards_dir: Path, clip: Path, per_copy: int = 50_000) -> int:
    """A hard link to a copy of ``clip`` at every indexed row's extracted-audio path (a new copy
    every ``per_copy`` links: file systems cap the links of one file); returns how many."""
    n, source = 0, clip
    for index in sorted(shards_dir.rglob(INDEX_FILE)):
        for member in pl.read_parquet(index, columns=["tar_member_name"])["tar_member_name"]:
            if n % per_copy == 0:
                source = clip.with_name(f"{clip.stem}_{n // per_copy}{clip.suffix}")
                shutil.copyfile(clip, source)
            os.link(source, index.parent / member)
            n += 1
    return n


def write_nemo_manifest(shards_dir: Path, path: Path, rows: int | None, durations: bool) -> int:
    """The shard rows that have audio as a NeMo JSON manifest (the first ``rows`` when given)."""
    meta = pl.scan_parquet(str(shards_dir / "*/*/*" / METADATA_FILE), include_file_paths="m")
    index = pl.scan_parquet(str(shards_dir / "*/*/*" / INDEX_FILE), include_file_paths="i")
    directory = pl.col("m").str.replace(r"/[^/]*$", "")
    frame = (
        meta.with_columns(directory.alias("dir"))
        .join(
            index.with_columns(pl.col("i").str.replace(r"/[^/]*$", "").alias("dir")),
            on=["dir", "segment_id"],
        )
        .select(
            pl.concat_str("dir", pl.lit("/"), "tar_member_name").alias("audio_filepath"),
            pl.col("duration_s").alias("duration"),
            pl.col("transcription_native").alias("text"),
            pl.coalesce("segment_language", pl.col("dir").str.extract(r"/([^/]+)/[^/]+$")).alias(
                "lang"
            ),
            "speaker_id",
            "tx_quality_score",
            "segment_id",
        )
        .collect()
    )
    if rows is not None:
        frame = frame.head(rows)
    if not durations:
        frame = frame.drop("duration")
    frame.write_ndjson(path)
    return frame.height


def run_child(kind: str, arg: str, out: Path, audio: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, kind, arg, str(out), str(audio)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"{kind} build failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="shard rows (default 1M)")
    parser.add_argument(
        "--header-rows",
        type=int,
        default=100_000,
        help="rows of the import that reads every audio header (default 100k)",
    )
    parser.add_argument("--rows-per-shard", type=int, default=2000)
    parser.add_argument("--keep", type=Path, default=None, help="work here and keep the files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_import_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        shards = work / "shards"
        if shards.exists():
            shutil.rmtree(shards)
        t = time.perf_counter()
        n_shards = max(1, args.rows // args.rows_per_shard)
        total = write_corpus(shards, n_shards, args.rows_per_shard, args.seed)
        clip = work / "clip.flac"
        sf.write(clip, np.zeros(1600, np.float32), 16000, format="FLAC")
        linked = link_audio(shards, clip)
        given = write_nemo_manifest(shards, work / "given.json", None, durations=True)
        headers = write_nemo_manifest(
            shards, work / "headers.json", args.header_rows, durations=False
        )
        print(
            f"corpus: {total:,} shard rows in {n_shards} shards, {linked:,} audio files (hard "
            f"links); NeMo JSON {given:,} rows, {headers:,} without durations "
            f"({time.perf_counter() - t:.0f} s to write)"
        )
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        audio = work / "imported"
        results = {
            "shards": run_child("shards", str(shards), work / "m_shards.parquet", audio),
            "nemo-exists": run_child(
                "nemo",
                f"nemo:{work / 'given.json'}:check=exists,name=given",
                work / "m_given.parquet",
                audio,
            ),
            "nemo-none": run_child(
                "nemo",
                f"nemo:{work / 'given.json'}:check=none,name=given",
                work / "m_given_none.parquet",
                audio,
            ),
            "nemo-header": run_child(
                "nemo",
                f"nemo:{work / 'headers.json'}:name=headers",
                work / "m_headers.parquet",
                audio,
            ),
        }
        print(
            f"{'build':<12} {'rows in':>10} {'kept':>10} {'seconds':>8} {'rows/s':>10} "
            f"{'peak MiB':>9} {'B/row':>7}"
        )
        for name, r in results.items():
            print(
                f"{name:<12} {r['rows_in']:>10,} {r['rows_out']:>10,} {r['seconds']:>8.2f} "
                f"{r['rows_in'] / r['seconds']:>10,.0f} {r['peak'] / 2**20:>9.0f} "
                f"{r['peak'] / r['rows_in']:>7.0f}"
            )
        base = results["shards"]
        for name in ("nemo-exists", "nemo-none"):
            run = results[name]
            speed = (run["rows_in"] / run["seconds"]) / (base["rows_in"] / base["seconds"])
            memory = (run["peak"] / run["rows_in"]) / (base["peak"] / base["rows_in"])
            print(f"{name} / shards: {speed:.2f}x rows per second, {memory:.2f}x memory per row")
        kept = {
            name: pl.read_parquet(work / f"m_{name}.parquet", columns=["audio_filepath"])
            for name in ("shards", "given")
        }
        same = kept["shards"].sort("audio_filepath").equals(kept["given"].sort("audio_filepath"))
        print(f"same rows kept: {same}")
        return 0 if same else 1
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
