"""Benchmark build_manifest.py against the row-wise pandas pipeline it replaces, on the same shards.

Usage:
    python benchmarks/bench_build_manifest.py --help
    python benchmarks/bench_build_manifest.py                          # 512,000 rows over 320 shards
    python benchmarks/bench_build_manifest.py --shards 400 --rows-per-shard 2000 --keep /tmp/bench
    python benchmarks/bench_build_manifest.py --text-mix dense         # the first version's corpus
    python benchmarks/bench_build_manifest.py --pool-size 110000       # nearly every transcript unique

It writes synthetic shards (metadata.parquet + audio_index.parquet, no audio; how much punctuation
the transcripts hold follows ``--text-mix``, see TEXT_MIXES) into a temp dir, then in one process
builds the manifest twice: first with the baseline (per shard: two parquet reads into pandas, an
inner merge, boolean filters, and a ``df.apply(axis=1)`` that cleans each transcript with Python
``re``, i.e. the existing pipeline's approach), then with ``build_manifest.build_manifest``.
Both write their parquet. It then checks that the two agree row for row, except where the
cleaning of build_manifest.py fixes the baseline's on purpose:
  - bare_tag_rows: transcripts that are only tags or punctuation ("[music] [laugh]", "...") are
    dropped instead of kept as a bare "<|lang|> " tag;
  - respaced_text: punctuation becomes a space instead of gluing words ("a-b" -> "a b", not "ab"),
    curly quotes, guillemets and in-word apostrophes are handled, NFC applied: the texts are equal
    once every space, punctuation and symbol character is removed from both.
Any other difference fails the bench (exit 1). It prints both timings and the speed ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

import build_manifest as bm
from manifest_schema import (
    INDEX_FILE,
    METADATA_FILE,
    OUTPUT_COLUMNS,
    TAG_PATTERN,
    tagged_text,
)

MIN_DURATION, MAX_DURATION, MIN_QUALITY = 0.5, 20.0, 0.3
LANG_WORDS = {
    "hi": ["नमस्ते", "दुनिया", "भारत", "पानी", "क्षेत्र", "हिन्दी", "बहुत", "अच्छा"],
    "ta": ["தமிழ்", "வணக்கம்", "நன்றி", "மொழி", "பள்ளி", "வீடு"],
    "ml": ["മലയാളം", "കേരളത്തില്\u200d", "എന്\u200dറെ", "നന്ദി", "വീട്"],
    "bn": ["বাংলা", "ভাষা", "আমার", "সোনার", "দেশ"],
    "en": ["hello", "world", "don't", "it's", "speech", "model", "data"],
}
TAGS = ["[music]", "[laugh]", "[noise]", "[inaudible]"]
# The text mix. "realistic" (the default) is close to real ASR transcripts: about one word in
# eight ends in a mark (mostly comma, full stop, danda), one in thirty is quoted or bracketed, one
# in twenty is followed by a tag, and one mark in ten is glued to the next word without a space.
# "dense" is the first version of this bench: nearly every word carries a mark or a wrapping pair
# and 30% of the transcripts have no space at all, which no real corpus looks like; it is kept to
# compare with earlier numbers. In both, English words carry apostrophes and the Malayalam ones
# ZWJ chillus, so about a third of the rows take the cleaning's slower path.
TEXT_MIXES = {
    "realistic": dict(
        punct=[""] * 88 + [",", ",", ",", ",", ".", ".", "।", "।", "?", "!", "-", "…"],
        wraps=[("", "")] * 174
        + [("«", "»"), ("“", "”"), ("‘", "’"), ("(", ")"), ("„", "“"), ("[", "]")],
        glued_rows=0.0,
        glued_marks=0.1,
    ),
    "dense": dict(
        punct=["", "", "", "", "", ",", ".", "।", "॥", "?", "!", "-", "…", "—", "–", '"'],
        wraps=[("", "")] * 12
        + [("«", "»"), ("“", "”"), ("‘", "’"), ("(", ")"), ("„", "“"), ("[", "]")],
        glued_rows=0.3,
        glued_marks=0.0,
    ),
}


# --- synthetic corpus ------------------------------------------------------------------------
def make_transcript_pool(lang: str, n: int, rng: np.random.Generator, mix: dict) -> list[str]:
    words = LANG_WORDS[lang]
    punct, wraps = mix["punct"], mix["wraps"]
    pool = []
    for i in range(n):
        if i % 97 == 0:
            pool.append(" ".join(rng.choice(TAGS, size=rng.integers(1, 3))))  # tags only
            continue
        if i % 211 == 0:
            pool.append("... !")  # punctuation only
            continue
        parts = []
        for _ in range(rng.integers(4, 14)):
            w = str(rng.choice(words))
            left, right = wraps[rng.integers(len(wraps))]
            mark = punct[rng.integers(len(punct))]
            # a mark now and then glued to the next word with no space, as in real transcripts
            glue = "\0" if mark and mix["glued_marks"] and rng.random() < mix["glued_marks"] else ""
            parts.append(f"{left}{w}{right}{mark}{glue}")
            if rng.random() < 0.05:
                parts.append(str(rng.choice(TAGS)))
        text = " ".join(parts) if rng.random() < 1 - mix["glued_rows"] else "".join(parts)
        pool.append(text.replace("\0 ", "").replace("\0", ""))
    return pool


def write_corpus(
    root: Path,
    n_shards: int,
    rows_per_shard: int,
    seed: int,
    text_mix: str = "realistic",
    pool_size: int = 4000,
) -> int:
    """Write the shard tree, each row's transcript drawn from ``pool_size`` per language; return the
    number of metadata rows."""
    rng = np.random.default_rng(seed)
    langs = list(LANG_WORDS)
    pools = {
        lang: make_transcript_pool(lang, pool_size, rng, TEXT_MIXES[text_mix]) for lang in langs
    }
    total = 0
    for s in range(n_shards):
        lang = langs[s % len(langs)]
        source = f"src{s % 3}"
        shard_dir = root / source / lang / f"shard_{s:05d}"
        shard_dir.mkdir(parents=True)
        n = rows_per_shard
        seg = np.array([f"{source}-{lang}-{s:05d}-{i:06d}" for i in range(n)], dtype=object)
        pool = pools[lang]
        texts = [pool[j] for j in rng.integers(len(pool), size=n)]
        duration = np.round(rng.uniform(0.1, 24.0, size=n), 3)
        quality = np.round(rng.uniform(0.0, 1.0, size=n), 3)
        quality_arr = pa.array(quality, mask=rng.random(n) < 0.01)
        seg_lang = pa.array(np.where(rng.random(n) < 0.05, "en", None).tolist(), pa.string())
        speaker = pa.array([f"spk{s}_{k}" for k in rng.integers(20, size=n)], pa.string())
        pq.write_table(
            pa.table(
                {
                    "segment_id": pa.array(seg, pa.string()),
                    "transcription_native": pa.array(texts, pa.string()),
                    "duration_s": duration,
                    "tx_quality_score": quality_arr,
                    "segment_language": seg_lang,
                    "speaker_id": speaker,
                }
            ),
            shard_dir / METADATA_FILE,
        )
        indexed = rng.random(n) > 0.01  # ~1% of rows have no audio entry
        pq.write_table(
            pa.table(
                {
                    "segment_id": pa.array(seg[indexed], pa.string()),
                    "tar_member_name": pa.array([f"{x}.flac" for x in seg[indexed]], pa.string()),
                }
            ),
            shard_dir / INDEX_FILE,
        )
        total += n
    return total


# --- baseline: the row-wise pandas pipeline ----------------------------------------------------
# The existing pipeline's cleaning as its write-up quotes it. The write-up shows the tag pattern as
# r"\[.*?\]|" with an empty second branch, which would match everywhere: the "<.*?>" branch was
# most likely lost when the write-up rendered "<...>" as markup, so it is restored here.
_BASE_TAGS = re.compile(r"\[.*?\]|<.*?>", re.IGNORECASE)
_BASE_PUNCT = re.compile(r"[।॥.,!?;:\"'\-—()…%/+=$*@#&_^>|\\<>`~。\u0964\u0965]+")


def baseline_clean(text: str) -> str:
    if not text:
        return ""
    text = _BASE_TAGS.sub("", text)
    text = _BASE_PUNCT.sub("", text)
    return re.sub(r"\s+", " ", text).strip()


def baseline_build(shards_dir: Path, output: Path) -> pd.DataFrame:
    frames = []
    for meta_path in sorted(shards_dir.rglob(METADATA_FILE)):
        shard_dir = meta_path.parent
        source, lang_dir, _ = shard_dir.relative_to(shards_dir).parts
        meta = pq.read_table(
            meta_path,
            columns=[
                "segment_id",
                "transcription_native",
                "duration_s",
                "tx_quality_score",
                "segment_language",
            ],
        ).to_pandas()
        index = pq.read_table(shard_dir / INDEX_FILE).to_pandas()
        df = meta.merge(index, on="segment_id", how="inner")
        df = df[
            (df["duration_s"] >= MIN_DURATION)
            & (df["duration_s"] <= MAX_DURATION)
            & (df["tx_quality_score"] >= MIN_QUALITY)
            & df["transcription_native"].notna()
            & (df["transcription_native"].str.strip().str.len() > 0)
        ].copy()
        if df.empty:
            continue

        def make_text(row):
            lang = row["segment_language"] if isinstance(row["segment_language"], str) else lang_dir
            return tagged_text(lang, baseline_clean(row["transcription_native"]))

        df["text"] = df.apply(make_text, axis=1)
        df["lang"] = df["segment_language"].where(df["segment_language"].notna(), lang_dir)
        df["shard_id"] = shard_dir.relative_to(shards_dir).as_posix()
        df["duration"] = df["duration_s"]
        df["audio_filepath"] = str(shard_dir.absolute()) + "/" + df["tar_member_name"]
        df["source"] = source
        frames.append(df[list(OUTPUT_COLUMNS)])
    result = pd.concat(frames, ignore_index=True)
    result.to_parquet(output, index=False)
    return result


# --- comparison --------------------------------------------------------------------------------
def squash(text: str) -> str:
    """Text with every space, punctuation and symbol removed, NFC: what both cleanings must share."""
    text = unicodedata.normalize("NFC", text)
    return "".join(
        ch for ch in text if not ch.isspace() and unicodedata.category(ch)[0] not in "PSC"
    )


def compare(baseline: pd.DataFrame, candidate: pl.DataFrame) -> dict[str, int]:
    base = pl.from_pandas(baseline)
    cand = candidate.select(OUTPUT_COLUMNS)
    only_base = base.join(cand, on="segment_id", how="anti")
    only_cand = cand.join(base, on="segment_id", how="anti")
    both = base.join(cand, on="segment_id", how="inner", suffix="_new")
    bare = only_base.filter(pl.col("text").str.contains(f"^{TAG_PATTERN} ?$"))
    result = {
        "rows_baseline": base.height,
        "rows_new": cand.height,
        "bare_tag_rows": bare.height,
        "unexpected_only_in_baseline": only_base.height - bare.height,
        "unexpected_only_in_new": only_cand.height,
    }
    mismatched_fields = 0
    for column in ("shard_id", "duration", "lang", "audio_filepath", "source"):
        mismatched_fields += both.filter(pl.col(column) != pl.col(f"{column}_new")).height
    result["unexpected_field_mismatches"] = mismatched_fields
    differing = both.filter(pl.col("text") != pl.col("text_new"))
    unexpected = sum(
        squash(a) != squash(b) for a, b in differing.select("text", "text_new").iter_rows()
    )
    result["identical_text"] = both.height - differing.height
    result["respaced_text"] = differing.height - unexpected
    result["unexpected_text_mismatches"] = unexpected
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python benchmarks/bench_build_manifest.py --shards 320 --rows-per-shard 1600",
    )
    parser.add_argument("--shards", type=int, default=320, help="number of shards (default 320)")
    parser.add_argument(
        "--rows-per-shard", type=int, default=1600, help="metadata rows per shard (default 1600)"
    )
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument(
        "--text-mix",
        choices=sorted(TEXT_MIXES),
        default="realistic",
        help="transcript punctuation mix (default realistic; dense = this bench's first version)",
    )
    parser.add_argument(
        "--pool-size",
        type=int,
        default=4000,
        help="distinct transcripts per language (default 4000, so most repeat; real corpora "
        "rarely repeat one: 110000 makes nearly every row unique, and the corpus slower to write)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="build_manifest.py threads (default: its own)"
    )
    parser.add_argument("--keep", type=Path, default=None, help="write the corpus here and keep it")
    args = parser.parse_args(argv)

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_manifest_"))
    try:
        shards_dir = root / "shards"
        if shards_dir.exists():
            shutil.rmtree(shards_dir)
        t0 = time.perf_counter()
        n_rows = write_corpus(
            shards_dir, args.shards, args.rows_per_shard, args.seed, args.text_mix, args.pool_size
        )
        print(
            f"corpus: {n_rows:,} rows over {args.shards} shards ({args.text_mix} text mix, "
            f"{args.pool_size:,} transcripts per language) in {shards_dir} "
            f"({time.perf_counter() - t0:.1f}s to write)"
        )

        print(
            f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (other jobs share it)"
        )
        t0, c0 = time.perf_counter(), time.process_time()
        baseline = baseline_build(shards_dir, root / "baseline.parquet")
        t_base, c_base = time.perf_counter() - t0, time.process_time() - c0
        print(
            f"baseline (pandas merge + df.apply): {t_base:7.2f}s wall {c_base:7.2f}s cpu  {len(baseline):,} rows"
        )

        t0, c0 = time.perf_counter(), time.process_time()
        summary = bm.build_manifest(
            shards_dir,
            root / "master.parquet",
            languages=(),
            min_duration=MIN_DURATION,
            max_duration=MAX_DURATION,
            min_quality=MIN_QUALITY,
            workers=args.workers,
            progress=False,
        )
        t_new, c_new = time.perf_counter() - t0, time.process_time() - c0
        print(
            f"build_manifest.py (polars):         {t_new:7.2f}s wall {c_new:7.2f}s cpu  "
            f"{summary['rows_out']:,} rows  ({os.cpu_count()} CPUs, {args.workers or 'default'} workers)"
        )

        result = compare(baseline, pl.read_parquet(root / "master.parquet"))
        for key, value in result.items():
            print(f"  {key:<30} {value:>10,}")
        print(f"  new drops by reason: {summary['dropped']}")
        ok = (
            result["unexpected_only_in_baseline"] == 0
            and result["unexpected_only_in_new"] == 0
            and result["unexpected_field_mismatches"] == 0
            and result["unexpected_text_mismatches"] == 0
            and result["rows_baseline"] - result["bare_tag_rows"] == result["rows_new"]
        )
        print(f"rows agree except intended fixes: {'yes' if ok else 'NO'}")
        print(
            f"speed ratio (baseline / build_manifest.py): {t_base / t_new:.1f}x wall clock, "
            f"{c_base / c_new:.1f}x cpu time"
        )
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
