"""What training-time augmentation costs a DataLoader worker: audio seconds per CPU second of one
process fetching train.py's planned micro-batches, with each augmentation against none.

Usage:
    python benchmarks/bench_augmentation.py --manifest data/train_manifest_v2.parquet
    python benchmarks/bench_augmentation.py --manifest M --noise-dir musan/noise --rounds 7

What it does, in one process (TOKENIZER_DIR's tokenizer, the training cache beside the manifest or
in CACHE_DIR; the batching knobs as train.py reads them):
1. The settings: none; SPEED_PERTURB=0.9,1.0,1.1; NOISE_PROB=1 with generated noise; NOISE_PROB=1
   from ``--noise-dir`` (when given); and SPEED_PERTURB=0.9,1.0,1.1 with NOISE_PROB=0.5 (generated).
2. Each setting's plan (``sampler.DurationBucketBatchSampler`` with its speed factors) and its first
   ``--batches`` micro-batches, fetched once untimed (the page cache warm, the noise bank made).
3. ``--rounds`` rounds; in each, every setting fetches and collates its micro-batches as a worker
   does (``LocalShardDataset.__getitems__`` of the planned batch, ``collate_asr_batch``), the
   settings in a rotated order, timed in CPU time of the process (time.process_time: on a shared
   machine wall time also counts the waits for a core). The audio is the seconds handed out (after
   the speed change).
4. Per setting: the median over rounds of audio seconds per CPU second, and the median over rounds
   of its ratio to no augmentation in the same round (paired, so a busier round hits both).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import config
from dataset import LocalShardDataset, NoiseSettings, collate_asr_batch
from sampler import BatchingSettings, DurationBucketBatchSampler

SPEEDS = (0.9, 1.0, 1.1)


@dataclasses.dataclass
class Setting:
    name: str
    speeds: tuple[float, ...]
    noise: NoiseSettings


def settings_to_compare(noise_dir: Path | None) -> list[Setting]:
    snr = (10.0, 20.0)
    out = [
        Setting("none", (), NoiseSettings(0.0, snr)),
        Setting("speed 0.9,1.0,1.1", SPEEDS, NoiseSettings(0.0, snr)),
        Setting("noise p=1, generated", (), NoiseSettings(1.0, snr)),
    ]
    if noise_dir is not None:
        out.append(Setting("noise p=1, NOISE_DIR", (), NoiseSettings(1.0, snr, noise_dir)))
    out.append(Setting("speed + noise p=0.5, generated", SPEEDS, NoiseSettings(0.5, snr)))
    return out


def planned_batches(dataset, speeds: tuple[float, ...], count: int) -> list:
    batching = BatchingSettings.from_config(
        speed_factors=speeds, frame_seconds=dataset.frame_seconds, grad_accum=1
    )
    sampler = DurationBucketBatchSampler(
        dataset.durations,
        dataset.lang_codes,
        batching,
        language_names=dataset.lang_names,
        token_lengths=dataset.token_lengths,
    )
    batches = []
    for batch in sampler:
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


def fetch(dataset, batches) -> float:
    """Audio seconds handed out for ``batches``, fetched and collated as a worker does."""
    audio = 0.0
    for batch in batches:
        audio += sum(collate_asr_batch(dataset.__getitems__(batch)).durations)
    return audio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="the training manifest whose audio is read (default TRAIN_MANIFEST_PATH)",
    )
    parser.add_argument("--noise-dir", type=Path, default=None, help="noise recordings (NOISE_DIR)")
    parser.add_argument("--batches", type=int, default=30, help="micro-batches per setting")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
    args = parser.parse_args(argv)
    manifest = args.manifest or Path(config.TRAIN_MANIFEST_PATH)
    if not manifest.is_file():
        print(
            f"error: no manifest at {manifest} (--manifest or TRAIN_MANIFEST_PATH)", file=sys.stderr
        )
        return 2
    from nemo.collections.common.tokenizers import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(str(Path(config.TOKENIZER_DIR) / "tokenizer.model"))
    work = []
    for setting in settings_to_compare(args.noise_dir):
        dataset = LocalShardDataset(manifest, tokenizer, progress=False, noise=setting.noise)
        batches = planned_batches(dataset, setting.speeds, args.batches)
        fetch(dataset, batches)  # untimed: the page cache warm
        work.append((setting, dataset, batches))
    print(
        f"{manifest.name}: {len(work[0][1])} utterances; {args.batches} micro-batches of "
        f"MAX_BATCH_DURATION={config.MAX_BATCH_DURATION:g} s per setting, {args.rounds} rounds"
    )
    rates: dict[str, list[float]] = {s.name: [] for s, _, _ in work}
    ratios: dict[str, list[float]] = {s.name: [] for s, _, _ in work}
    for r in range(args.rounds):
        order = work[r % len(work) :] + work[: r % len(work)]
        this_round = {}
        for setting, dataset, batches in order:
            start = time.process_time()
            audio = fetch(dataset, batches)
            this_round[setting.name] = audio / (time.process_time() - start)
        for name, rate in this_round.items():
            rates[name].append(rate)
            ratios[name].append(rate / this_round["none"])
    print(f"{'setting':<32} {'audio s per CPU s':>18} {'vs none (paired rounds)':>30}")
    for setting, _, _ in work:
        name = setting.name
        spread = ", ".join(f"{x:.2f}" for x in ratios[name])
        print(
            f"{name:<32} {statistics.median(rates[name]):>18.0f} "
            f"{statistics.median(ratios[name]):>8.2f} ({spread})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
