"""Benchmark sampler.py against a re-implementation of the sampler it replaces, in one process.

Usage:
    python benchmarks/bench_sampler.py                    # 2M utterances at world_size 8, then ours at 10M
    python benchmarks/bench_sampler.py --utterances 200000 --large 0   # a quick look
    python benchmarks/bench_sampler.py --help

Both samplers get the same synthetic corpus: 14 languages with skewed counts (30 % .. 1 %), durations
lognormal (median 6 s, sigma 0.6) clipped to 0.5..20 s, T=0.3, 90 s batches, grad_accum 4.

The baseline (``LegacySampler``) follows the existing pipeline's description (reference write-up,
sections 5-6): per-epoch Python loops that bucket every row, order each bucket by U^(1/w) with w the
language's target/natural ratio, pack greedily, sort batches by n x max duration, stride them across
ranks, trim each rank to a multiple of grad_accum and shuffle with the shared epoch RNG.

Measured per sampler:
- time: one rank's construction + epoch plan (what a rank pays per epoch), wall clock and CPU time
  of this process. Ours is the best of ``--repeats`` runs after a warm-up run; the baseline is timed
  once, after its memory run (which warms the allocator). On a shared machine wall clock swings
  with the other load; CPU time much less.
- peak extra memory: tracemalloc's peak over the same work (NumPy reports its buffers to
  tracemalloc, Python objects are traced natively, so both samplers are measured the same way);
  the input arrays / lists exist before the measurement starts and are not counted.
- realized vs target share of the largest and the smallest language over the whole plan (all ranks),
  padding efficiency, and the p99 over steps of max/mean rank cost.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import random
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from sampler import BatchingSettings, DurationBucketBatchSampler

BOUNDARIES = (3.0, 5.0, 8.0, 12.0, 16.0)
MAX_BATCH_SECONDS = 90.0
TEMPERATURE = 0.3
GRAD_ACCUM = 4
SEED = 1234
# Every setting spelled out, so the comparison does not move with config.py's defaults.
SETTINGS = BatchingSettings(
    boundaries=BOUNDARIES,
    max_batch_duration=MAX_BATCH_SECONDS,
    temperature=TEMPERATURE,
    grad_accum=GRAD_ACCUM,
    seed=SEED,
    epoch_size=0,
    lang_weighting="count",
    cost_quadratic=0.0,
    sort_jitter=0.05,
    frame_seconds=0.08,
    max_joint_cells=0.0,
    cost_joint=0.001,
)
# Natural language shares of the synthetic corpus (percent), largest first.
LANGUAGE_PERCENT = {
    "hi": 30,
    "en": 15,
    "bn": 10,
    "ta": 8,
    "te": 7,
    "mr": 6,
    "gu": 5,
    "kn": 4,
    "ml": 4,
    "pa": 3,
    "ur": 3,
    "ne": 2,
    "or": 2,
    "as": 1,
}


class LegacySampler:
    """The replaced sampler's algorithm in plain Python, for comparison only (see module docstring)."""

    def __init__(
        self, durations: list[float], languages: list[str], *, world_size: int, rank: int
    ) -> None:
        self.durations, self.languages = durations, languages
        self.world_size, self.rank = world_size, rank

    def build(self, epoch: int) -> tuple[list[list[int]], list[list[list[int]]]]:
        """(this rank's batches in order, every rank's batches) for ``epoch``."""
        rng = random.Random(SEED + epoch)
        per_lang: dict[str, int] = defaultdict(int)
        for lang in self.languages:
            per_lang[lang] += 1
        total = len(self.durations)
        powered = {lang: count**TEMPERATURE for lang, count in per_lang.items()}
        norm = sum(powered.values())
        ratio = {lang: (powered[lang] / norm) / (per_lang[lang] / total) for lang in per_lang}
        weights = [ratio[lang] for lang in self.languages]

        buckets: dict[int, list[int]] = defaultdict(list)
        for i, dur in enumerate(self.durations):
            buckets[bisect.bisect_right(BOUNDARIES, dur)].append(i)
        batches: list[list[int]] = []
        for rows in buckets.values():
            ranked = sorted(
                ((rng.random() ** (1.0 / max(weights[i], 1e-12)), i) for i in rows), reverse=True
            )
            batch: list[int] = []
            filled = 0.0
            for _, i in ranked:
                if batch and filled + self.durations[i] > MAX_BATCH_SECONDS:
                    batches.append(batch)
                    batch, filled = [], 0.0
                batch.append(i)
                filled += self.durations[i]
            if batch:
                batches.append(batch)

        batches.sort(key=lambda b: len(b) * max(self.durations[i] for i in b), reverse=True)
        usable = len(batches) // self.world_size * self.world_size
        every_rank = []
        for r in range(self.world_size):
            mine = batches[r : usable : self.world_size]
            mine = mine[: len(mine) - len(mine) % GRAD_ACCUM]
            every_rank.append(mine)
        # Every rank's RNG is in the same state here, so the shuffles are the same permutation.
        state = rng.getstate()
        for mine in every_rank:
            rng.setstate(state)
            rng.shuffle(mine)
        return every_rank[self.rank], every_rank


def make_corpus(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    durations = np.clip(rng.lognormal(np.log(6.0), 0.6, n), 0.5, 20.0)
    names = np.array(list(LANGUAGE_PERCENT))
    share = np.array(list(LANGUAGE_PERCENT.values()), dtype=np.float64)
    languages = names[rng.choice(len(names), size=n, p=share / share.sum())]
    return durations, languages


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result)."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - start, time.process_time() - cpu, result


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    del result
    tracemalloc.stop()
    return peak - base


def plan_summary(
    batches: list[list[int]],
    durations: np.ndarray,
    languages: np.ndarray,
    steps: list[list[list[int]]],
) -> dict[str, float]:
    """Shares, padding efficiency and rank balance of a whole plan given as lists of row ids."""
    rows = np.fromiter((i for b in batches for i in b), dtype=np.int64)
    names, counts = np.unique(languages[rows], return_counts=True)
    share = dict(zip(names.tolist(), (counts / counts.sum()).tolist()))
    sizes = np.array([len(b) for b in batches])
    longest = np.array([durations[b].max() for b in batches])
    efficiency = durations[rows].sum() / float((sizes * longest).sum())
    cost = np.array([[len(b) * durations[b].max() for b in step] for step in steps])
    balance = float(np.quantile(cost.max(axis=1) / cost.mean(axis=1), 0.99))
    return {"share": share, "padding_efficiency": float(efficiency), "balance_p99": balance}


def target_shares(languages: np.ndarray) -> dict[str, float]:
    names, counts = np.unique(languages, return_counts=True)
    powered = counts.astype(np.float64) ** TEMPERATURE
    return dict(zip(names.tolist(), (powered / powered.sum()).tolist()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--utterances", type=int, default=2_000_000, help="corpus size of the head-to-head run"
    )
    parser.add_argument(
        "--large", type=int, default=10_000_000, help="corpus size of our solo timing (0 = skip)"
    )
    parser.add_argument(
        "--world-size", type=int, default=8, help="ranks (the plan is built for rank 0)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of ours (best is reported)"
    )
    args = parser.parse_args(argv)
    ws = args.world_size

    durations, languages = make_corpus(args.utterances, SEED)
    dur_list, lang_list = durations.tolist(), languages.tolist()
    print(
        f"corpus: {args.utterances:,} utterances, {len(LANGUAGE_PERCENT)} languages, world_size {ws}, "
        f"grad_accum {GRAD_ACCUM}, T={TEMPERATURE}, cap {MAX_BATCH_SECONDS:g} s"
    )

    def run_legacy():
        return LegacySampler(dur_list, lang_list, world_size=ws, rank=0).build(epoch=0)

    def run_ours():
        sampler = DurationBucketBatchSampler(
            durations,
            languages,
            SETTINGS,
            world_size=ws,
            rank=0,
        )
        len(sampler)  # builds the epoch plan
        return sampler

    print("baseline: measuring memory (traced) ...", flush=True)
    legacy_mem = peak_extra_bytes(run_legacy)
    print("baseline: timing ...", flush=True)
    legacy_s, legacy_cpu, (_, legacy_ranks) = timed(run_legacy)
    print("ours: measuring memory and time ...", flush=True)
    ours_mem = peak_extra_bytes(run_ours)
    timed(run_ours)  # warm-up
    ours_runs = [timed(run_ours) for _ in range(args.repeats)]
    ours_s = min(t for t, _, _ in ours_runs)
    ours_cpu = min(c for _, c, _ in ours_runs)
    sampler = ours_runs[0][2]
    sampler.set_epoch(1)
    epoch_s, epoch_cpu, _ = timed(lambda: len(sampler))
    sampler.set_epoch(0)

    # Whole plans (all ranks) for shares, padding and balance.
    legacy_batches = [b for rank in legacy_ranks for b in rank]
    legacy = plan_summary(
        legacy_batches, durations, languages, [list(s) for s in zip(*legacy_ranks)]
    )
    ours_ranks = [
        list(
            DurationBucketBatchSampler(
                durations,
                languages,
                SETTINGS,
                world_size=ws,
                rank=r,
            )
        )
        for r in range(ws)
    ]
    ours = plan_summary(
        [b for rank in ours_ranks for b in rank],
        durations,
        languages,
        [list(s) for s in zip(*ours_ranks)],
    )
    target = target_shares(languages)
    largest, smallest = max(target, key=target.get), min(target, key=target.get)

    mib = 1 / 2**20
    print()
    print(f"{'':34s}{'baseline':>14s}{'ours':>14s}")
    print(
        f"{'wall time, construct + plan (s)':34s}{legacy_s:14.2f}{ours_s:14.3f}   "
        f"ratio {legacy_s / ours_s:.1f}x (target >= 20x)"
    )
    print(
        f"{'CPU time, construct + plan (s)':34s}{legacy_cpu:14.2f}{ours_cpu:14.3f}   "
        f"ratio {legacy_cpu / ours_cpu:.1f}x"
    )
    print(f"{'wall / CPU time, next epoch (s)':34s}{'':14s}{epoch_s:8.3f} /{epoch_cpu:5.3f}")
    print(
        f"{'peak extra memory (MiB)':34s}{legacy_mem * mib:14.1f}{ours_mem * mib:14.1f}   "
        f"ours/baseline {ours_mem / legacy_mem:.3f} (target <= 0.25)"
    )
    for lang in (largest, smallest):
        print(
            f"{'share of ' + lang + f' (target {100 * target[lang]:.1f} %)':34s}"
            f"{100 * legacy['share'].get(lang, 0.0):13.2f}%{100 * ours['share'].get(lang, 0.0):13.2f}%"
        )
    print(
        f"{'padding efficiency':34s}{legacy['padding_efficiency']:14.4f}{ours['padding_efficiency']:14.4f}"
    )
    print(
        f"{'rank cost balance p99 (max/mean)':34s}{legacy['balance_p99']:14.4f}{ours['balance_p99']:14.4f}"
    )
    print(f"{'micro-batches per rank':34s}{len(legacy_ranks[0]):14d}{len(ours_ranks[0]):14d}")

    if args.large:
        del legacy_ranks, legacy_batches, ours_ranks, sampler, dur_list, lang_list
        big_d, big_l = make_corpus(args.large, SEED + 1)
        print(f"\nours at {args.large:,} utterances ...", flush=True)
        big_mem = peak_extra_bytes(
            lambda: DurationBucketBatchSampler(
                big_d, big_l, SETTINGS, world_size=ws, rank=0
            ).__len__()
        )
        timed(
            lambda: len(DurationBucketBatchSampler(big_d, big_l, SETTINGS, world_size=ws, rank=0))
        )
        runs = [
            timed(
                lambda: len(
                    DurationBucketBatchSampler(big_d, big_l, SETTINGS, world_size=ws, rank=0)
                )
            )[:2]
            for _ in range(max(1, args.repeats - 1))
        ]
        print(
            f"{'wall time, construct + plan (s)':34s}{min(w for w, _ in runs):14.3f}   (target < 5 s; runs: "
            + ", ".join(f"{w:.2f}" for w, _ in runs)
            + ")"
        )
        print(f"{'CPU time, construct + plan (s)':34s}{min(c for _, c in runs):14.3f}")
        print(f"{'peak extra memory (MiB)':34s}{big_mem * mib:14.1f}")


if __name__ == "__main__":
    main()
