"""Benchmark of the training cache build (training_cache.py) against a single-process builder.

Usage:
    python benchmarks/bench_training_cache.py --rows 2000000 --rows 10000000 --workers 1 --workers 2
    python benchmarks/bench_training_cache.py --rows 200000                # a quick check
    python benchmarks/bench_training_cache.py --help

For each ``--rows N`` it builds (once, kept in ``--workdir``) a realistic manifest: 14 languages in
their own scripts with a skewed mix, transcripts of about 110 UTF-8 bytes, durations from the word
count, 1,000 rows per shard, zstd parquet in 262,144-row row groups as scripts/make_train_val.py
writes them; and a 12k-piece BPE SentencePiece model with the 14 language tags as user-defined
symbols. Then, each in a fresh process so peak memory is its own:

  baseline   one process, whole columns in memory: durations, languages, paths and names read whole,
             the text in 250k-row batches tokenized by SentencePiece's own multi-threaded
             ``encode(num_threads=cores)``, everything concatenated and written as one Arrow IPC file.
  cache W    training_cache.build with W worker processes (one per ``--workers``).
  mapped     a process that maps the finished cache (training_cache.ensure finds it), then plans
             the first epoch of rank 0 of 8 (DurationBucketBatchSampler init + first micro-batch).

Printed per build: wall seconds, CPU seconds (process + children), peak memory as the summed PSS of
the process and its workers sampled every 200 ms (forked workers share the parent's pages; PSS counts
them once) next to the process's own peak RSS and what its imports (NeMo, for the tokenizer) take
before the build, and the anonymous RSS the process still holds after the build (after mapping,
for the cache), against the ``mapped`` process. Ratios are against the baseline at the same N.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.process_memory import process_tree, pss_bytes, status_bytes

ROW_GROUP_ROWS = 262_144
ROWS_PER_SHARD = 1000
VOCAB = 12_000
# (code, first code point of the script block, consonants in it, vowel signs offset) and a share.
SCRIPTS = {
    "hi": (0x0915, 36, 0x093E, 0.22),
    "mr": (0x0915, 36, 0x093E, 0.08),
    "ne": (0x0915, 36, 0x093E, 0.03),
    "bn": (0x0995, 36, 0x09BE, 0.09),
    "as": (0x0995, 36, 0x09BE, 0.02),
    "ta": (0x0B95, 22, 0x0BBE, 0.08),
    "te": (0x0C15, 36, 0x0C3E, 0.07),
    "kn": (0x0C95, 36, 0x0CBE, 0.06),
    "ml": (0x0D15, 36, 0x0D3E, 0.06),
    "gu": (0x0A95, 36, 0x0ABE, 0.05),
    "pa": (0x0A15, 36, 0x0A3E, 0.04),
    "or": (0x0B15, 36, 0x0B3E, 0.03),
    "ur": (0x0628, 30, None, 0.02),
    "en": (0x61, 26, None, 0.15),
}
WORDS_PER_LANG = 6000
TARGET_BYTES = 110


# ------------------------------------------------------------------------------------------ corpus


def _vocabulary(rng: np.random.Generator, lang: str) -> list[str]:
    base, consonants, vowel_signs, _ = SCRIPTS[lang]
    words = set()
    while len(words) < WORDS_PER_LANG:
        syllables = int(rng.integers(2, 6))
        chars = []
        for _ in range(syllables):
            chars.append(chr(base + int(rng.integers(0, consonants))))
            if vowel_signs is not None and rng.random() < 0.6:
                chars.append(chr(vowel_signs + int(rng.integers(0, 7))))
        words.add("".join(chars))
    return sorted(words)


def _write_manifest(path: Path, rows: int, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from manifest_schema import lang_tag

    rng = np.random.default_rng(seed)
    langs = list(SCRIPTS)
    shares = np.array([SCRIPTS[lang][3] for lang in langs])
    shares /= shares.sum()
    vocab, first_word, mean_bytes = [], [], []
    for lang in langs:
        words = _vocabulary(rng, lang)
        first_word.append(len(vocab))
        vocab += words
        mean_bytes.append(np.mean([len(w.encode()) + 1 for w in words]))
    vocab_array = pa.array(vocab, pa.string())
    words_per_row = np.array([TARGET_BYTES / b for b in mean_bytes])
    tags = pa.array([lang_tag(lang) for lang in langs])
    tmp = path.with_name(path.name + ".tmp")
    writer = None
    with tqdm(total=rows, desc=f"writing {path.name}", unit="row") as bar:
        for start in range(0, rows, ROW_GROUP_ROWS):
            n = min(ROW_GROUP_ROWS, rows - start)
            lang = rng.choice(len(langs), size=n, p=shares)
            count = np.maximum(1, rng.poisson(words_per_row[lang])).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(count)])
            word = np.array(first_word)[np.repeat(lang, count)] + rng.integers(
                0, WORDS_PER_LANG, offsets[-1]
            )
            texts = pc.binary_join(
                pa.ListArray.from_arrays(
                    pa.array(offsets, pa.int32()), vocab_array.take(pa.array(word))
                ),
                " ",
            )
            text = pc.binary_join_element_wise(tags.take(pa.array(lang)), texts, " ")
            rows_idx = np.arange(start, start + n)
            shard = np.char.add(
                np.array([f"src/{langs[k]}/shard_" for k in lang]),
                (rows_idx // ROWS_PER_SHARD).astype(str),
            )
            duration = np.clip(count / 2.0 + np.abs(rng.normal(0, 0.5, n)), 1.0, 20.0)
            table = pa.table(
                {
                    "segment_id": pa.array(np.char.add("seg", rows_idx.astype(str))),
                    "shard_id": pa.array(shard),
                    "text": text.cast(pa.string()),
                    "duration": pa.array(duration),
                    "lang": pa.array(np.array(langs)[lang]),
                    "tar_member_name": pa.array(np.char.add(rows_idx.astype(str), ".flac")),
                    "tar_path": pa.array(
                        np.char.add(np.char.add("/data/shards/", shard), "/audio.tar")
                    ),
                    "source": pa.array(np.full(n, "src")),
                }
            )
            if writer is None:
                writer = pq.ParquetWriter(
                    tmp, table.schema, compression="zstd", compression_level=1
                )
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
            bar.update(n)
    writer.close()
    os.replace(tmp, path)


def _train_tokenizer(workdir: Path, manifest: Path) -> Path:
    import pyarrow.parquet as pq
    import sentencepiece

    from manifest_schema import lang_tag, split_lang_tags

    model = workdir / "tokenizer" / "tokenizer.model"
    if model.exists():
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    text = pq.ParquetFile(manifest).read_row_group(0, columns=["text"])["text"]
    _, rests = split_lang_tags(text)
    sample = workdir / "tokenizer_sample.txt"
    sample.write_text("\n".join(rests.to_pylist()[:200_000]), encoding="utf-8")
    print("training the 12k BPE tokenizer ...", flush=True)
    sentencepiece.SentencePieceTrainer.train(
        input=str(sample),
        model_prefix=str(model.with_suffix("")),
        vocab_size=VOCAB,
        model_type="bpe",
        character_coverage=1.0,
        user_defined_symbols=[lang_tag(lang) for lang in SCRIPTS],
        num_threads=len(os.sched_getaffinity(0)),
        minloglevel=2,
    )
    return model


def prepare(workdir: Path, rows: int) -> tuple[Path, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    manifest = workdir / f"manifest_{rows}.parquet"
    if not manifest.exists():
        _write_manifest(manifest, rows)
    sample = workdir / "tokenizer_sample.parquet"  # other rows than any benchmarked manifest
    if not sample.exists():
        _write_manifest(sample, 200_000, seed=1)
    return manifest, _train_tokenizer(workdir, sample)


# ------------------------------------------------------------------------------------------ runs


def _tokenizer(model: Path):
    import logging

    for name in ("nemo_logger", "nv_one_logger", "NeMo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    return SentencePieceTokenizer(str(model))


class TreeMemory:
    """Samples the summed PSS of this process and its children every 200 ms: shared pages (a forked
    worker's inherited interpreter, the page cache of mapped files) count once across the tree."""

    def __init__(self):
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.peak = max(self.peak, sum(map(pss_bytes, process_tree(os.getpid()))))

    def _run(self) -> None:
        self._sample()  # a build shorter than one period still gets a sample
        while not self._stop.wait(0.2):
            self._sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def baseline_build(manifest: Path, tokenizer, out: Path, frame_seconds=0.08, max_len=512) -> int:
    """One process, whole columns in memory, SentencePiece's threads; returns rows kept."""
    import itertools

    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet as pq

    from manifest_schema import split_lang_tags

    def column(name, string=False):
        col = pq.read_table(manifest, columns=[name])[name]
        return (col.cast(pa.large_string()) if string else col).combine_chunks()

    duration = column("duration").to_numpy()
    lang = column("lang", True).dictionary_encode()
    processor = tokenizer.tokenizer
    threads = len(os.sched_getaffinity(0))
    id_parts, lengths = [], []
    for batch in pq.ParquetFile(manifest).iter_batches(batch_size=250_000, columns=["text"]):
        _, rests = split_lang_tags(batch.column(0).cast(pa.large_string()))
        for start in range(0, len(rests), 100_000):
            encoded = processor.encode(rests.slice(start, 100_000).to_pylist(), num_threads=threads)
            n = np.fromiter(map(len, encoded), np.int64, len(encoded))
            lengths.append(n)
            flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(n.sum()))
            id_parts.append(flat.astype(np.uint16))
    n_tokens = 1 + np.concatenate(lengths)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    ids = np.concatenate(id_parts)
    keep = n_tokens <= np.floor(duration / frame_seconds + 1e-9)
    rows = pa.array(np.flatnonzero(keep))
    tar = column("tar_path", True).dictionary_encode()
    shard = column("shard_id", True).dictionary_encode()
    table = pa.table(
        {
            "token_ids": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(ids)).take(rows),
            "audio_dir": tar.take(rows),
            "shard_id": shard.take(rows),
            "tar_member_name": column("tar_member_name", True).take(rows),
            "duration": pa.array(duration).take(rows),
            "lang": lang.take(rows),
            "manifest_row": rows,
        }
    )
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(table.num_rows, 1))
    return table.num_rows


def run_one(kind: str, manifest: Path, model: Path, out_dir: Path, workers: int) -> dict:
    """Runs in its own process; returns the figures as a dict."""
    import pyarrow as pa

    import training_cache

    tokenizer = _tokenizer(model)
    before_anon = status_bytes("RssAnon")
    imports_pss = pss_bytes(os.getpid())
    tree = TreeMemory()
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    result: dict = {"kind": kind}
    if kind == "baseline":
        result["kept"] = baseline_build(manifest, tokenizer, out_dir / "baseline.arrow")
        result["bytes"] = (out_dir / "baseline.arrow").stat().st_size
    elif kind == "cache":
        info = training_cache.ensure(
            manifest,
            tokenizer,
            frame_seconds=0.08,
            max_token_len=512,
            cache_dir=out_dir,
            workers=workers,
            progress=False,
        )
        cols = training_cache.CacheColumns(info.path)
        result.update(
            kept=len(cols.durations),
            bytes=training_cache.directory_size(info.path),
            worker_peak=info.summary["build_peak_rss_worker"],
            built=info.built,
        )
    else:  # mapped
        info = training_cache.ensure(
            manifest,
            tokenizer,
            frame_seconds=0.08,
            max_token_len=512,
            cache_dir=out_dir,
            progress=False,
        )
        cols = training_cache.CacheColumns(info.path)
        result.update(kept=len(cols.durations), built=info.built)
    result["seconds"] = time.perf_counter() - t0
    result["cpu_seconds"] = _cpu_seconds() - cpu0
    result["tree_peak_pss"] = tree.stop()
    result["imports_pss"] = imports_pss
    result["peak_rss"] = status_bytes("VmHWM")
    result["anon_after"] = status_bytes("RssAnon") - before_anon
    result["arrow_pool"] = pa.total_allocated_bytes()
    if kind == "mapped":
        from sampler import BatchingSettings, DurationBucketBatchSampler

        t1 = time.perf_counter()
        sampler = DurationBucketBatchSampler(
            cols.durations,
            cols.lang_codes,
            BatchingSettings.from_config(),
            language_names=cols.lang_names,
            world_size=8,
            rank=0,
        )
        result["sampler_init"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        next(iter(sampler))
        result["first_plan"] = time.perf_counter() - t2
    return result


def _in_child(kind: str, manifest: Path, model: Path, out_dir: Path, workers: int) -> dict:
    cmd = [sys.executable, __file__, "--_run", kind, "--_manifest", str(manifest), "--_model",
           str(model), "--_out", str(out_dir), "--_workers", str(workers)]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    if proc.returncode:
        sys.exit(f"{kind} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(rows: int, workers: list[int], workdir: Path, baseline: bool = True) -> list[str]:
    import shutil

    manifest, model = prepare(workdir, rows)
    lines = [
        f"rows {rows:,} ({manifest.stat().st_size / 2**20:.0f} MiB parquet), {os.cpu_count()} cores"
    ]
    out = workdir / f"out_{rows}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    base = _in_child("baseline", manifest, model, out, 0) if baseline else None
    if base is None:
        lines.append("  baseline      skipped (--no-baseline)")
    else:
        (out / "baseline.arrow").unlink()
        lines.append(
            f"  baseline      {base['seconds']:7.1f} s wall {base['cpu_seconds']:7.1f} CPU-s  peak RSS "
            f"{base['peak_rss'] / 2**30:5.2f} GiB (of it imports {base['imports_pss'] / 2**30:.2f} GiB; "
            f"PSS {base['tree_peak_pss'] / 2**30:.2f} GiB)  held after {base['anon_after'] / 2**20:6.0f} "
            f"MiB  file {base['bytes'] / 2**20:.0f} MiB  kept {base['kept']:,}"
        )
    mapped = None
    for w in workers:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        r = _in_child("cache", manifest, model, out, w)
        mapped = _in_child("mapped", manifest, model, out, w)
        assert base is None or r["kept"] == base["kept"], (r["kept"], base["kept"])
        ratio = f"time {r['seconds'] / base['seconds']:.2f}x baseline" if base else ""
        lines.append(
            f"  cache W={w:<3d}   {r['seconds']:7.1f} s wall {r['cpu_seconds']:7.1f} CPU-s  peak "
            f"{r['tree_peak_pss'] / 2**30:5.2f} GiB PSS of parent + workers (parent RSS "
            f"{r['peak_rss'] / 2**30:.2f} GiB, of it imports {r['imports_pss'] / 2**30:.2f} GiB)  "
            f"held after {r['anon_after'] / 2**20:6.0f} MiB vs mapped-only "
            f"{mapped['anon_after'] / 2**20:.0f} MiB  cache {r['bytes'] / 2**20:.0f} MiB  {ratio}"
        )
    lines.append(
        f"  mapped start  {mapped['seconds']:7.3f} s (cache found by content key, mapped), sampler "
        f"init {mapped['sampler_init']:.2f} s, first plan {mapped['first_plan']:.2f} s (rank 0 of 8)"
    )
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rows", type=int, action="append", help="manifest rows (repeatable; default 2,000,000)"
    )
    ap.add_argument(
        "--workers",
        type=int,
        action="append",
        help="cache build workers (repeatable; default 1 and 2)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/bench_training_cache"),
        help="corpus and outputs (kept between runs)",
    )
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the one-process builder (at 30M rows it needs about 17 GiB)",
    )
    ap.add_argument("--_run", help=argparse.SUPPRESS)
    ap.add_argument("--_manifest", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_workers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._run:
        print(json.dumps(run_one(args._run, args._manifest, args._model, args._out, args._workers)))
        return
    for rows in args.rows or [2_000_000]:
        lines = bench(rows, args.workers or [1, 2], args.workdir, baseline=not args.no_baseline)
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
