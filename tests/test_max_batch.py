"""max_batch.py: the heaviest micro-batch preflight and the step benchmark run, and the search for
the largest MAX_BATCH_DURATION."""

from __future__ import annotations

import math

import numpy as np
import pytest

import config
import max_batch
from batch_bound import heaviest_packed_batch
from sampler import BatchingSettings, DurationBucketBatchSampler


def padded_frames_and_joint_cells(durations, tokens) -> tuple[float, float]:
    frames = len(durations) * math.ceil(max(durations) / config.ENCODER_FRAME_SECONDS)
    return float(frames), float(frames * (max(tokens) + 1))


def test_the_tested_batch_is_as_heavy_as_every_batch_dealt_to_any_rank():
    # The synthetic corpus piles utterances up at MAX_DURATION (20 s): 4 copies of the longest fill
    # 80 s, while a sum-of-seconds fill of slightly shorter ones pads 5 x 18-19 s in the top bucket.
    shape = max_batch.heaviest_batch_shape(90.0, tokens_per_second=5.0)
    tested = padded_frames_and_joint_cells(shape.durations, shape.tokens)
    rng = np.random.default_rng(0)
    n = 200_000
    durations = np.clip(
        rng.lognormal(np.log(6.0), 0.6, n), config.MIN_DURATION, config.MAX_DURATION
    )
    languages = np.array(max_batch.LANGS)[rng.integers(0, len(max_batch.LANGS), n)]
    frames = (durations / config.ENCODER_FRAME_SECONDS).astype(np.int64)
    tokens = np.clip(1 + np.round(5.0 * durations).astype(np.int64), 2, np.minimum(512, frames))
    settings = BatchingSettings.from_config(max_batch_duration=90.0, seed=0, grad_accum=4)
    longest = float(durations.max())
    copies_of_longest = int(90.0 // longest) * math.ceil(longest / config.ENCODER_FRAME_SECONDS)
    heavier_than_copies = 0
    for rank in range(8):
        sampler = DurationBucketBatchSampler(
            durations, languages, settings, world_size=8, rank=rank, token_lengths=tokens
        )
        for batch in sampler:
            dealt = padded_frames_and_joint_cells(durations[batch], tokens[batch])
            assert dealt[0] <= tested[0] and dealt[1] <= tested[1], (rank, batch, dealt, tested)
            heavier_than_copies += dealt[0] > copies_of_longest
    assert heavier_than_copies > 0, "the corpus must pad more than copies of its longest utterance"


@pytest.mark.parametrize("limit", [20.0, 37.0, 90.0, 412.5, 600.0])
def test_search_finds_the_largest_five_second_multiple_that_fits(limit):
    tried = []

    def fits_at(cap):
        tried.append(cap)
        return cap <= limit

    assert max_batch.bisect_max_batch_duration(fits_at, 20.0, 600.0) == 5.0 * (limit // 5.0)
    assert len(tried) <= 9  # bisection, not a scan of 117 candidates


def test_search_reports_none_when_even_the_longest_utterance_does_not_fit():
    assert max_batch.bisect_max_batch_duration(lambda cap: False, 20.0, 600.0) is None


def speakers_corpus(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` utterances: lognormal durations (median 6 s) clipped to 0.5..20 s, 7 languages, and
    each at its speaker's own rate of tokens (lognormal around 4 a second): the sparse duration
    tails and the token-dense rows an epoch draws differ from epoch to epoch."""
    rng = np.random.default_rng(seed)
    durations = np.clip(rng.lognormal(np.log(6.0), 0.6, n), 0.5, 20.0)
    languages = np.array(max_batch.LANGS)[rng.integers(0, len(max_batch.LANGS), n)]
    rate = rng.lognormal(np.log(4.0), 0.35, n)
    frames = (durations / config.ENCODER_FRAME_SECONDS).astype(np.int64)
    tokens = np.clip(1 + np.round(rate * durations).astype(np.int64), 2, np.maximum(2, frames))
    return durations, languages, tokens


@pytest.mark.parametrize(
    "epoch_size", [3_000, 0, 90_000], ids=["below-the-corpus", "the-corpus", "above-the-corpus"]
)
def test_no_epoch_packs_a_batch_heavier_than_the_tested_one_and_the_heaviest_comes_close(
    epoch_size,
):
    # 30k utterances: an EPOCH_SIZE of 3k draws other rows each epoch, and later epochs pack
    # batches with about a third more joint cells than the first.
    durations, languages, tokens = speakers_corpus(30_000)
    settings = BatchingSettings.from_config(
        max_batch_duration=200.0,
        epoch_size=epoch_size,
        seed=0,
        grad_accum=1,
        base_languages=(),
        base_share=0.0,
    )
    shape = max_batch.BatchShape(*heaviest_packed_batch(durations, languages, tokens, settings))
    tested = padded_frames_and_joint_cells(shape.durations, shape.tokens)
    sampler = DurationBucketBatchSampler(durations, languages, settings, token_lengths=tokens)
    heaviest = [0.0, 0.0]
    for epoch in range(20):
        sampler.set_epoch(epoch)
        for batch in sampler:
            dealt = padded_frames_and_joint_cells(durations[batch], tokens[batch])
            assert dealt[0] <= tested[0] and dealt[1] <= tested[1], (epoch, dealt, tested)
            assert durations[batch].max() <= max(shape.durations)
            heaviest = [max(h, x) for h, x in zip(heaviest, dealt)]
    # Close enough to be worth searching with: a bound several times the real batches would
    # make the max-batch search settle on a fraction of what a GPU holds.
    assert tested[0] <= 1.25 * heaviest[0] and tested[1] <= 1.25 * heaviest[1], (tested, heaviest)


def test_a_lone_utterance_over_the_joint_cap_is_in_the_bound():
    durations, languages, tokens = speakers_corpus(5_000)
    tokens[np.argmax(durations)] = 511  # one very dense longest utterance: a batch of its own
    settings = BatchingSettings.from_config(
        max_batch_duration=90.0, seed=0, grad_accum=1, base_languages=(), base_share=0.0
    )
    shape = heaviest_packed_batch(durations, languages, tokens, settings)
    frames = math.ceil(durations.max() / config.ENCODER_FRAME_SECONDS)
    assert padded_frames_and_joint_cells(*shape)[1] >= frames * 512


def test_the_synthetic_batch_needs_no_base_languages_for_a_base_from_elsewhere(monkeypatch):
    # Its languages are made up: a base that records none must not stop a synthetic preflight.
    monkeypatch.setattr(config, "INIT_MODEL", "nvidia/parakeet-tdt-0.6b-v2")
    monkeypatch.setattr(config, "BASE_LANGUAGES", ())
    monkeypatch.setattr(config, "BASE_LANGUAGE_SHARE", 0.25)
    assert max_batch.heaviest_batch_shape(90.0, tokens_per_second=5.0).durations


def test_a_batch_of_few_long_utterances_holds_no_more_than_fit_in_its_seconds():
    # A top bucket from 6 s with a pile of utterances at MAX_DURATION (12 s) and a micro-batch of
    # 20 s: a batch holds rows of at least 6 s each, so at most 3 of them (or one over the cap).
    rng = np.random.default_rng(0)
    n = 100_000
    durations = np.clip(rng.lognormal(np.log(6.0), 0.6, n), 0.5, 12.0)
    languages = np.array(max_batch.LANGS)[rng.integers(0, len(max_batch.LANGS), n)]
    tokens = np.clip(1 + np.round(12.5 * durations).astype(np.int64), 2, 150)
    settings = BatchingSettings.from_config(
        max_batch_duration=20.0,
        boundaries=(2.0, 3.0, 4.0, 6.0),
        seed=0,
        grad_accum=1,
        base_languages=(),
        base_share=0.0,
    )
    shape = heaviest_packed_batch(durations, languages, tokens, settings)
    assert len(shape[0]) <= 3, len(shape[0])
    sampler = DurationBucketBatchSampler(durations, languages, settings, token_lengths=tokens)
    dealt = max(len(batch) for batch in sampler if durations[batch].min() >= 6.0)
    assert dealt <= len(shape[0])


def test_with_speed_perturbation_no_batch_plays_heavier_than_the_tested_one():
    # Played at 0.9, an utterance lasts 11 % longer: the tested batch covers the batches as played
    # (packed by those durations), and its utterances are the longest as played.
    durations, languages, tokens = speakers_corpus(30_000)
    settings = BatchingSettings.from_config(
        max_batch_duration=200.0,
        seed=0,
        grad_accum=1,
        base_languages=(),
        base_share=0.0,
        speed_factors=(0.9, 1.0, 1.1),
    )
    shape = max_batch.BatchShape(*heaviest_packed_batch(durations, languages, tokens, settings))
    tested = padded_frames_and_joint_cells(shape.durations, shape.tokens)
    assert max(shape.durations) == pytest.approx(durations.max() / 0.9)
    sampler = DurationBucketBatchSampler(durations, languages, settings, token_lengths=tokens)
    heaviest = [0.0, 0.0]
    for epoch in range(10):
        sampler.set_epoch(epoch)
        for batch in sampler:
            played = durations[batch] / np.array(batch.speeds)
            dealt = padded_frames_and_joint_cells(played, tokens[batch])
            assert dealt[0] <= tested[0] and dealt[1] <= tested[1], (epoch, dealt, tested)
            assert played.max() <= max(shape.durations)
            heaviest = [max(h, x) for h, x in zip(heaviest, dealt)]
    assert tested[0] <= 1.25 * heaviest[0] and tested[1] <= 1.25 * heaviest[1], (tested, heaviest)
