"""Benchmark of dataset.py: node memory of ranks x DataLoader workers, and per-item overhead.

Usage:
    python benchmarks/bench_dataset.py                              # 2M rows, 2 ranks x 4 workers, 30 s
    python benchmarks/bench_dataset.py --rows 200000 --seconds 5    # a quick check
    python benchmarks/bench_dataset.py --part overhead              # only the per-item timing
    python benchmarks/bench_dataset.py --help

Memory. A synthetic manifest in the contract's schema (realistic text: Devanagari and Latin words,
~2.5 words per second of audio; 1,000 rows per shard) is read by ``--ranks`` processes, each with a
DataLoader of ``--workers`` forked workers drawing random batches for ``--seconds``. The parent sums
the PSS (/proc/PID/smaps_rollup) of every process of those trees, for three datasets with the same
process layout:
  null    no manifest at all (decodes the same files): what interpreter, torch, NeMo and the workers
          cost by themselves; subtracted from the other two
  arrow   dataset.LocalShardDataset (its memory-mapped training cache)
  pandas  the pipeline we replace: the same columns in a pandas DataFrame per rank, rows via .iloc
and reports (PSS - null PSS) / (Arrow size of one copy of the manifest columns). Target: arrow <= 1.5x.
Neither disk nor audio buffers are what is measured: every shard directory is a symlink to one pool of
64 files, which for the memory runs are 0.1 s FLACs (the ranks raise AUDIO_DURATION_TOLERANCE so they
are accepted against the manifest's 1-16 s), so every item still reads all its manifest fields and
its tokens. The ranks are throttled (``--rate`` batches/s each) to keep CPU use modest. The pandas baseline gets the
Arrow default ``to_pandas()`` string de-duplication, which favours it here because the pool's member
names repeat (real ones are unique).

Overhead. In one process, with the pool switched to real 1-16 s 16 kHz mono FLACs: ``ds[i]`` against a
bare ``soundfile.read`` of the same file, alternating item by item, in CPU time of the process
(time.process_time: on a shared machine, wall time also counts the waits for a core); the median
over rounds of the ratio. Target: <= 1.25x. Items per second of one process = per DataLoader worker.
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
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import training_cache
import vocabulary
from benchmarks.process_memory import process_tree, pss_bytes, status_bytes
from manifest_schema import TAR_FILE, lang_tag, tag_prefix

LANGS = ("hi", "en", "mr", "ta")
POOL_SIZE = 64
ROWS_PER_SHARD = 1000
WORDS_PER_SECOND = 2.5
VOCAB_WORDS = (
    600  # few enough that the 1024-piece tokenizer keeps most words whole, as a real one does
)
INFEASIBLE_SHARE = 0.005  # rows given far too much text for their audio, to exercise the filter


def _quiet_nemo_logging():
    import logging

    for name in ("nemo_logger", "nv_one_logger", "NeMo"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ------------------------------------------------------------------------------------------ corpus


def _pseudo_words(rng: np.random.Generator, n: int) -> list[str]:
    deva = [chr(c) for c in range(0x0915, 0x0939)]
    vowels = ["", "ा", "ि", "ी", "ु", "े", "ो"]
    latin = list("abcdefghijklmnoprstuvwy")
    words = []
    for k in range(n):
        size = int(rng.integers(2, 6))
        if k % 2:
            words.append("".join(rng.choice(deva) + rng.choice(vowels) for _ in range(size)))
        else:
            words.append("".join(rng.choice(latin, size=size + 1)))
    return words


def build_corpus(workdir: Path, rows: int, seed: int = 0) -> dict:
    """Audio pool, shard symlinks, tokenizer and a manifest of ``rows`` rows under ``workdir``."""
    import sentencepiece
    import soundfile as sf

    rng = np.random.default_rng(seed)
    pool_durations = np.round(np.linspace(1.0, 16.0, POOL_SIZE), 2)
    pool_names = [f"pool_segment_{k:03d}_0000000000000.flac" for k in range(POOL_SIZE)]
    for kind in ("real", "tiny"):
        pool = workdir / f"pool_{kind}"
        pool.mkdir(parents=True, exist_ok=True)
        for name, seconds in zip(pool_names, pool_durations):
            samples = int((seconds if kind == "real" else 0.1) * 16000)
            sf.write(
                str(pool / name), (rng.standard_normal(samples) * 0.1).astype(np.float32), 16000
            )
    use_pool(workdir, "real")

    n_shards = max(1, rows // ROWS_PER_SHARD)
    shard_ids = [f"src{k % 3}/{LANGS[k % len(LANGS)]}/shard_{k:05d}" for k in range(n_shards)]
    for shard in shard_ids:
        link = workdir / "shards" / shard
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(workdir / "audio", target_is_directory=True)

    vocab = _pseudo_words(rng, VOCAB_WORDS)
    shard_of_row = np.minimum(np.arange(rows) // ROWS_PER_SHARD, n_shards - 1)
    lang_of_shard = np.array([s.split("/")[1] for s in shard_ids])
    pool_of_row = rng.integers(0, POOL_SIZE, rows)
    duration = pool_durations[pool_of_row] + rng.uniform(-0.05, 0.05, rows)  # within tolerance
    n_words = np.maximum(1, rng.poisson(duration * WORDS_PER_SECOND)).astype(np.int64)
    infeasible = rng.random(rows) < INFEASIBLE_SHARE
    n_words[infeasible] = (duration[infeasible] * 20).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(n_words)])
    words = pa.array(vocab).take(pa.array(rng.integers(0, len(vocab), int(offsets[-1]))))
    transcripts = pc.binary_join(
        pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), words), " "
    )
    prefix_of_shard = np.array([tag_prefix(lang) for lang in lang_of_shard])
    text = pc.binary_join_element_wise(pa.array(prefix_of_shard[shard_of_row]), transcripts, "")
    lang = pa.array(lang_of_shard[shard_of_row])
    shard_col = pa.array(shard_ids).take(pa.array(shard_of_row))
    tar_path = pa.array([str(workdir / "shards" / s / TAR_FILE) for s in shard_ids]).take(
        pa.array(shard_of_row)
    )
    table = pa.table(
        {
            "segment_id": pa.array(np.char.add("seg", np.arange(rows).astype(str))),
            "shard_id": shard_col,
            "text": text,
            "duration": pa.array(duration),
            "lang": lang,
            "tar_member_name": pa.array(pool_names).take(pa.array(pool_of_row)),
            "tar_path": tar_path,
            "source": pc.utf8_slice_codeunits(shard_col, 0, 4),
            "tx_quality_score": pa.array(rng.uniform(0, 1, rows)),
            "speaker_id": pa.nulls(rows, pa.string()),
        }
    )
    manifest = workdir / "train_manifest_v2.parquet"
    pq.write_table(table, manifest)

    sample = workdir / "tokenizer_corpus.txt"
    sample.write_text("\n".join(text.slice(0, min(rows, 20000)).to_pylist()), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(sample),
        model_prefix=str(workdir / "tokenizer"),
        vocab_size=1024,
        hard_vocab_limit=False,
        character_coverage=1.0,
        user_defined_symbols=[lang_tag(lang) for lang in LANGS],
        minloglevel=2,
    )
    return {
        "manifest": str(manifest),
        "tokenizer": str(workdir / "tokenizer.model"),
        "pool": [str(workdir / "audio" / n) for n in pool_names],
    }


def use_pool(workdir: Path, kind: str) -> None:
    """Point ``workdir/audio`` (the target of every shard symlink) at the real or the tiny pool."""
    tmp = workdir / "audio.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(workdir / f"pool_{kind}", target_is_directory=True)
    os.replace(tmp, workdir / "audio")


def load_tokenizer(model_path: str):
    _quiet_nemo_logging()
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    _quiet_nemo_logging()
    return SentencePieceTokenizer(model_path)


# ------------------------------------------------------------------------------------------ datasets


def make_dataset(kind: str, corpus: dict, tokenizer):
    """The dataset under test, and the arrays a sampler would read from it (touched, like a sampler)."""
    import torch

    import dataset

    if kind == "arrow":
        ds = dataset.LocalShardDataset(corpus["manifest"], tokenizer, progress=False)
        np.bincount(ds.lang_codes), float(ds.durations.sum())
        return ds

    if kind == "pandas":

        class PandasIlocDataset(torch.utils.data.Dataset):
            """The replaced pipeline: a DataFrame per rank, one .iloc row per item."""

            def __init__(self):
                table = pq.read_table(
                    corpus["manifest"], columns=list(training_cache.MANIFEST_COLUMNS)
                )
                self.df = table.to_pandas()

            def __len__(self):
                return len(self.df)

            def __getitem__(self, idx):
                row = self.df.iloc[idx]
                path = os.path.join(os.path.dirname(row["tar_path"]), row["tar_member_name"])
                try:
                    signal = dataset.load_audio(path, expected_duration=float(row["duration"]))
                except dataset.BadAudio:
                    return None
                tag_id = tokenizer.token_to_id(lang_tag(row["lang"]))
                transcript = row["text"][len(tag_prefix(row["lang"])) :]
                tokens = vocabulary.tokenize_transcript(tokenizer, tag_id, transcript, 512)
                return {
                    "signal": torch.from_numpy(signal),
                    "tokens": torch.tensor(tokens),
                    "duration": float(row["duration"]),
                    "lang": row["lang"],
                    "index": idx,
                }

        ds = PandasIlocDataset()
        ds.df["duration"].to_numpy().sum(), ds.df["lang"].to_numpy()
        return ds

    if kind == "null":
        n = pq.ParquetFile(corpus["manifest"]).metadata.num_rows
        pool = corpus["pool"]
        tag_id = tokenizer.token_to_id(lang_tag("hi"))

        class NullDataset(torch.utils.data.Dataset):
            """The same work per item without any manifest: the process tree's own footprint."""

            def __len__(self):
                return n

            def __getitem__(self, idx):
                signal = dataset.load_audio(pool[idx % len(pool)])
                tokens = vocabulary.tokenize_transcript(tokenizer, tag_id, "kabir mehta", 512)
                return {
                    "signal": torch.from_numpy(signal),
                    "tokens": torch.tensor(tokens),
                    "duration": len(signal) / 16000,
                    "lang": "hi",
                    "index": idx,
                }

        return NullDataset()
    raise ValueError(f"unknown dataset kind {kind!r}: expected arrow, pandas or null")


# ------------------------------------------------------------------------------------------ rank process


def run_rank(args) -> None:
    """One 'rank': DataLoader with forked workers over random batches, throttled; then waits on stdin."""
    import torch

    import dataset

    corpus = json.loads(Path(args.workdir, "corpus.json").read_text())
    tokenizer = load_tokenizer(corpus["tokenizer"])
    ds = make_dataset(args.rank_kind, corpus, tokenizer)
    n = len(ds)
    rng = np.random.default_rng(args.rank_seed)

    class RandomBatches(torch.utils.data.Sampler):
        def __iter__(self):
            while True:
                yield rng.integers(0, n, args.batch).tolist()

    loader = torch.utils.data.DataLoader(
        ds,
        batch_sampler=RandomBatches(),
        num_workers=args.workers,
        collate_fn=dataset.collate_asr_batch,
        prefetch_factor=2,
    )
    batches = iter(loader)
    next(batches)
    print("STARTED", flush=True)
    t0 = time.monotonic()
    items = bad = n_batches = 0
    while (elapsed := time.monotonic() - t0) < args.seconds:
        batch = next(batches)
        items += batch.batch_size
        bad += sum(batch.bad_audio.values())
        n_batches += 1
        time.sleep(max(0.0, n_batches / args.rate - (time.monotonic() - t0)))
    print(
        "READY " + json.dumps({"items": items, "bad": bad, "seconds": round(elapsed, 2)}),
        flush=True,
    )
    sys.stdin.readline()  # the parent reads our PSS now, with every worker alive
    del batches


def measure_memory(kind: str, args) -> dict:
    """Start the ranks, sample summed PSS every second; the final sample is taken with all alive."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--workdir",
        str(args.workdir),
        "--_rank",
        kind,
        "--workers",
        str(args.workers),
        "--seconds",
        str(args.seconds),
        "--rate",
        str(args.rate),
        "--batch",
        str(args.batch),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", AUDIO_DURATION_TOLERANCE="1000")  # tiny pool files
    ranks = [
        subprocess.Popen(
            cmd + ["--_rank-seed", str(r)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(args.ranks)
    ]
    try:
        for proc in ranks:
            line = proc.stdout.readline()
            if not line.startswith("STARTED"):
                raise RuntimeError(f"{kind} rank {proc.pid} failed to start (exit {proc.wait()})")
        peak = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            pids = [p for proc in ranks for p in process_tree(proc.pid)]
            peak = max(peak, sum(map(pss_bytes, pids)))
            time.sleep(1.0)
        reports = []
        for proc in ranks:
            line = proc.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"{kind} rank {proc.pid} stopped early (exit {proc.wait()})")
            reports.append(json.loads(line.split(" ", 1)[1]))
        pids = [p for proc in ranks for p in process_tree(proc.pid)]
        final = sum(map(pss_bytes, pids))
        for proc in ranks:
            proc.stdin.write("\n")
            proc.stdin.flush()
        for proc in ranks:
            proc.wait(timeout=60)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
    return {
        "processes": len(pids),
        "final": final,
        "peak": max(peak, final),
        "items": sum(r["items"] for r in reports),
        "bad": sum(r["bad"] for r in reports),
        "seconds": max(r["seconds"] for r in reports),
    }


# ------------------------------------------------------------------------------------------ overhead


def measure_overhead(corpus: dict, items: int, rounds: int) -> list[str]:
    import soundfile as sf

    import dataset

    tokenizer = load_tokenizer(corpus["tokenizer"])
    ds = dataset.LocalShardDataset(corpus["manifest"], tokenizer, progress=False)
    rng = np.random.default_rng(1)
    lines = []
    groups = {
        "all durations (1-16 s)": np.arange(len(ds)),
        "short only (<= 2 s)": np.flatnonzero(ds.durations <= 2.0),
    }
    for label, candidates in groups.items():
        idx = rng.choice(candidates, size=min(items, len(candidates)), replace=False)
        paths = [ds.audio_path(i) for i in idx]
        for i, path in zip(idx, paths):  # page cache and code paths warm for both sides
            assert ds[i] is not None, f"item {i} ({path}) is bad audio"
            sf.read(path, dtype="float32")
        ratios, bare_cpu, ours_cpu, ours_wall = [], [], [], []
        for _ in range(rounds):
            bare = ours = wall = 0.0
            for i, path in zip(idx, paths):
                t0 = time.process_time()
                sf.read(path, dtype="float32")
                t1 = time.process_time()
                w1 = time.perf_counter()
                ds[i]
                wall += time.perf_counter() - w1
                ours += time.process_time() - t1
                bare += t1 - t0
            ratios.append(ours / bare)
            bare_cpu.append(bare)
            ours_cpu.append(ours)
            ours_wall.append(wall)
        n = len(idx)
        b, o = float(np.median(bare_cpu)) / n, float(np.median(ours_cpu)) / n
        lines.append(
            f"  {label:24s} items={n:4d} mean {ds.durations[idx].mean():5.2f} s   soundfile.read "
            f"{b * 1e6:7.1f} us   ds[i] {o * 1e6:7.1f} us   ({(o - b) * 1e6:+6.1f} us)   ratio "
            f"{float(np.median(ratios)):5.3f}x (target <= 1.25; rounds "
            f"{min(ratios):.3f}-{max(ratios):.3f})   {1 / o:6.1f} items/s/worker CPU-bound, "
            f"{n / float(np.median(ours_wall)):6.1f} wall"
        )
    return lines


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=2_000_000, help="manifest rows (default 2M)")
    ap.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    ap.add_argument(
        "--workers", type=int, default=4, help="DataLoader workers per rank (default 4)"
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="seconds each memory run reads items (default 30)",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=10.0,
        help="batches per second per rank, to keep CPU use modest (default 10)",
    )
    ap.add_argument("--batch", type=int, default=16, help="items per batch (default 16)")
    ap.add_argument("--items", type=int, default=300, help="items per overhead round (default 300)")
    ap.add_argument(
        "--rounds", type=int, default=5, help="overhead rounds, median reported (default 5)"
    )
    ap.add_argument(
        "--part",
        choices=("all", "memory", "overhead"),
        default="all",
        help="what to run (default all)",
    )
    ap.add_argument(
        "--impls",
        default="null,arrow,pandas",
        help="datasets of the memory part, comma-separated; null is the baseline subtracted",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        help="where the corpus goes; kept and reused on the next run with the same --rows "
        "(default: a temp dir, removed at the end)",
    )
    ap.add_argument("--_rank", dest="rank_kind", help=argparse.SUPPRESS)
    ap.add_argument("--_rank-seed", dest="rank_seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_build", dest="build_only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.rank_kind:
        run_rank(args)
        return
    if args.build_only:  # a child, so its memory high-water mark is the build's alone
        import dataset

        corpus = json.loads(Path(args.workdir, "corpus.json").read_text())
        tokenizer = load_tokenizer(corpus["tokenizer"])
        before = status_bytes("VmHWM")
        t = time.monotonic()
        ds = dataset.LocalShardDataset(corpus["manifest"], tokenizer, progress=False)
        print(
            json.dumps(
                {
                    "seconds": time.monotonic() - t,
                    "summary": ds.load_summary,
                    "hwm_before": before,
                    "hwm_after": status_bytes("VmHWM"),
                }
            )
        )
        return

    own_dir = args.workdir is None
    args.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_dataset_"))
    try:
        corpus_file = args.workdir / "corpus.json"
        if corpus_file.exists() and json.loads(corpus_file.read_text()).get("rows") == args.rows:
            corpus = json.loads(corpus_file.read_text())
            print(f"reusing the corpus in {args.workdir}")
        else:
            t = time.monotonic()
            corpus = dict(build_corpus(args.workdir, args.rows), rows=args.rows)
            corpus_file.write_text(json.dumps(corpus))
            print(
                f"corpus: {args.rows:,} rows written in {time.monotonic() - t:.1f} s to {args.workdir}"
            )

        columns = pq.read_table(
            corpus["manifest"],
            columns=["text", "duration", "lang", "tar_path", "tar_member_name", "shard_id"],
        )
        one_copy = columns.nbytes
        del columns
        build = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--_build",
                "--workdir",
                str(args.workdir),
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        if build.returncode:
            raise RuntimeError(f"building the dataset failed:\n{build.stderr[-3000:]}")
        built = json.loads(build.stdout.strip().splitlines()[-1])
        summary = built["summary"]
        print(
            f"manifest: {summary['rows_read']:,} rows, {summary['rows_kept']:,} kept, dropped "
            f"{summary['dropped']}; one copy of the 6 manifest columns in Arrow = {one_copy / 2**20:.1f} MiB"
        )
        print(
            f"training cache: {'built' if summary['cache_built'] else 'mapped'} in {built['seconds']:.1f} s, "
            f"peak RSS of that process {built['hwm_after'] / 2**20:.0f} MiB, of which "
            f"{(built['hwm_after'] - built['hwm_before']) / 2**20:.0f} MiB above its imports + tokenizer; "
            f"{training_cache.directory_size(Path(summary['cache'])) / 2**20:.1f} MiB on disk"
        )

        if args.part in ("all", "memory"):
            use_pool(args.workdir, "tiny")
            print(
                f"\nmemory: {args.ranks} ranks x {args.workers} workers, random batches of {args.batch}, "
                f"{args.rate:g} batches/s per rank, {args.seconds:g} s, summed PSS of all processes"
            )
            results = {}
            for kind in args.impls.split(","):
                results[kind] = r = measure_memory(kind, args)
                print(
                    f"  {kind:7s} processes={r['processes']:2d}  PSS final {r['final'] / 2**20:8.1f} MiB  "
                    f"peak {r['peak'] / 2**20:8.1f} MiB  items read {r['items']:6d} (+{r['bad']} bad) "
                    f"in {r['seconds']:.0f} s",
                    flush=True,
                )
            if "null" in results:
                base = results["null"]
                for kind, r in results.items():
                    if kind == "null":
                        continue
                    extra = r["peak"] - base["peak"]
                    print(
                        f"  {kind:7s} dataset memory = peak PSS - null peak PSS = {extra / 2**20:8.1f} MiB = "
                        f"{extra / one_copy:5.2f}x one copy of the columns"
                        + ("  (target <= 1.5x)" if kind == "arrow" else "")
                    )

        if args.part in ("all", "overhead"):
            use_pool(args.workdir, "real")
            print(
                f"\noverhead: one process, {args.rounds} rounds, CPU time, median; 16 kHz mono FLAC "
                f"(no resampling)"
            )
            for line in measure_overhead(corpus, args.items, args.rounds):
                print(line)
    finally:
        if own_dir:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
