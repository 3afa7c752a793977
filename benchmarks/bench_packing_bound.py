"""Benchmark the heaviest-batch bound (``batch_bound.heaviest_packed_batch``) against the heaviest batch of
one epoch's plan, which it replaces, in one process; and how close the bound is to what the sampler
really packs.

Usage:
    python benchmarks/bench_packing_bound.py                      # 10M utterances, then 25 epochs of 200k
    python benchmarks/bench_packing_bound.py --utterances 1000000 --epochs 10   # a quick look

The corpus: durations lognormal (median 6 s, sigma 0.6) clipped to 0.5..20 s, 7 languages at
random, tokens at a lognormal density (median 4 per second, sigma 0.35), the default batching knobs
at MAX_BATCH_DURATION=600 and EPOCH_SIZE a tenth of the corpus.

Measured:
- time and peak extra memory (tracemalloc) of each way at ``--utterances``: the baseline builds
  the sampler and epoch 0's plan and takes its heaviest batch; ours builds the sampler and runs
  ``packed_batch_bound`` over the whole corpus (a sort and prefix sums per bucket).
- tightness at ``--tight-utterances``: the bound's padded frames and joint cells against the
  heaviest batch of every one of ``--epochs`` epochs (the bound must hold for each; the closer to
  1.0 the more useful it is to the max-batch search).
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import numpy as np

from batch_bound import packed_batch_bound
from sampler import BatchingSettings, DurationBucketBatchSampler

LANGS = ("hi", "en", "ta", "te", "bn", "mr", "kn")
MAX_BATCH_SECONDS = 600.0


def make_corpus(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    durations = np.clip(rng.lognormal(np.log(6.0), 0.6, n), 0.5, 20.0)
    languages = np.array(LANGS)[rng.integers(0, len(LANGS), n)]
    density = rng.lognormal(np.log(4.0), 0.35, n)
    tokens = np.clip(
        1 + np.round(density * durations).astype(np.int64),
        2,
        np.maximum(2, (durations / 0.08).astype(np.int64)),
    )
    return durations, languages, tokens


def settings_for(n: int) -> BatchingSettings:
    return BatchingSettings.from_config(
        max_batch_duration=MAX_BATCH_SECONDS,
        epoch_size=n // 10,
        grad_accum=1,
        base_languages=(),
        base_share=0.0,
    )


def epoch_heaviest(sampler: DurationBucketBatchSampler, tokens: np.ndarray) -> tuple[float, float]:
    """(padded frames, joint cells) of the heaviest batch of the sampler's current epoch."""
    plan = sampler._plan()
    starts = plan.offsets[:-1]
    longest = np.maximum.reduceat(sampler.durations[plan.flat], starts)
    frames = np.diff(plan.offsets) * np.ceil(longest / sampler.frame_seconds)
    cells = frames * (np.maximum.reduceat(tokens[plan.flat], starts) + 1)
    return float(frames.max()), float(cells.max())


def measured(fn) -> tuple[float, int, object]:
    """(wall seconds, peak extra traced bytes, result) of ``fn()``."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return seconds, peak, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--utterances", type=int, default=10_000_000, help="corpus of the timing")
    parser.add_argument(
        "--tight-utterances", type=int, default=200_000, help="corpus of the tightness check"
    )
    parser.add_argument("--epochs", type=int, default=25, help="epochs of the tightness check")
    args = parser.parse_args(argv)

    durations, languages, tokens = make_corpus(args.utterances)
    settings = settings_for(args.utterances)

    def baseline():
        sampler = DurationBucketBatchSampler(durations, languages, settings, token_lengths=tokens)
        return epoch_heaviest(sampler, tokens)

    def ours():
        sampler = DurationBucketBatchSampler(durations, languages, settings, token_lengths=tokens)
        return packed_batch_bound(sampler)

    print(f"{args.utterances:,} utterances, EPOCH_SIZE {settings.epoch_size:,} ...", flush=True)
    base_s, base_bytes, _ = measured(baseline)
    ours_s, ours_bytes, _ = measured(ours)
    n = args.utterances
    print(f"{'':34s}{'epoch 0':>14s}{'bound':>14s}{'ratio':>10s}")
    print(f"{'wall time (s)':34s}{base_s:14.2f}{ours_s:14.2f}{ours_s / base_s:10.2f}")
    print(
        f"{'peak extra memory (B/utterance)':34s}{base_bytes / n:14.1f}{ours_bytes / n:14.1f}"
        f"{ours_bytes / max(base_bytes, 1):10.2f}"
    )

    durations, languages, tokens = make_corpus(args.tight_utterances, seed=1)
    settings = settings_for(args.tight_utterances)
    sampler = DurationBucketBatchSampler(durations, languages, settings, token_lengths=tokens)
    bound = packed_batch_bound(sampler)
    seen = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen.append(epoch_heaviest(sampler, tokens))
    heaviest = [max(s[i] for s in seen) for i in range(2)]
    print(
        f"\n{args.tight_utterances:,} utterances, {args.epochs} epochs of "
        f"{settings.epoch_size:,}: bound / heaviest batch seen (epoch 0 alone)"
    )
    for i, what in enumerate(("padded frames", "joint cells")):
        print(
            f"  {what:14s} {bound[i]:12.0f} / {heaviest[i]:12.0f} = {bound[i] / heaviest[i]:.3f}"
            f"   (epoch 0: {seen[0][i]:.0f}, {seen[0][i] / heaviest[i]:.3f} of the heaviest)"
        )
    over = [e for e, s in enumerate(seen) if s[0] > bound[0] or s[1] > bound[1]]
    print(f"  epochs packing past the bound: {over or 'none'}")


if __name__ == "__main__":
    main()
