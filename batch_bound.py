"""The heaviest micro-batch the sampler can pack from a manifest: the bound the GPU is sized for.

``heaviest_packed_batch`` is a batch at least as heavy, in padded encoder frames, joint cells and
longest utterance, as every batch ``sampler.DurationBucketBatchSampler`` packs from the same
utterances and settings in any epoch, at any world size; preflight's step, the max-batch search
(max_batch.py) and the step benchmark run it. ``packed_batch_bound`` derives the bound from the
packing rules over the whole manifest, not from one epoch's draw.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sampler import (
    _FRAME_EPS,
    _MIN_SORT_SECONDS,
    BatchingSettings,
    DurationBucketBatchSampler,
)
from sampler_inputs import slices


def heaviest_packed_batch(
    durations: Any,
    languages: Any,
    token_lengths: Any,
    settings: BatchingSettings,
    *,
    language_names: Sequence[str] | None = None,
) -> tuple[list[float], list[int]]:
    """A micro-batch at least as heavy as every batch the sampler packs from these utterances with
    ``settings``, in every epoch, as (durations, tokens): n copies of the longest utterance (as
    played: ``longest_played``), n the
    fewest whose padded encoder frames (n x ceil(longest / frame_seconds)) reach
    ``packed_batch_bound``'s, each with the fewest tokens that reach its joint cells. So its padded
    frames, its joint cells and its longest utterance are each >= those of every batch dealt to any
    rank at any world size or grad_accum (those only choose among the packed batches); it
    overstates the padded frames by less than one utterance. Preflight's step, the max-batch search
    and the step benchmark test this batch."""
    sampler = DurationBucketBatchSampler(
        durations,
        languages,
        dataclasses.replace(settings, grad_accum=1),
        language_names=language_names,
        token_lengths=token_lengths,
    )
    most_frames, most_cells = packed_batch_bound(sampler)
    longest = longest_played(sampler)
    frames = max(1, math.ceil(longest / sampler.frame_seconds))
    n = max(1, math.ceil(most_frames / frames))
    needed = max(1, math.ceil(most_cells / (n * frames)) - 1)
    return [longest] * n, [needed] * n


# How far below the mean duration of the rows its span holds a batch's own mean may fall, in
# standard errors of a mean of that many rows: 4 leaves about 3 in 100,000 batches that span a
# whole bucket heavier than the bound (measured: 5-19 % above the heaviest of 25 epochs).
_BOUND_STANDARD_ERRORS = 4.0


# Duration bins per encoder frame in the bound's histogram: the mean duration of a span is known to
# within 1/16 of a frame.
_BOUND_BINS_PER_FRAME = 16


def packed_batch_bound(sampler: DurationBucketBatchSampler) -> tuple[float, float]:
    """(padded encoder frames, joint cells) that no micro-batch ``sampler`` packs exceeds, in any
    epoch: a bound from the packing rules over the whole manifest, not from one epoch's draw.

    The rules: a batch lies in one duration bucket, holds at most ``max_batch_duration`` seconds
    (or is one utterance), no more copies of a row than an epoch draws (``epoch_size`` and the
    language quotas), and, with a joint cap, at most ``max_joint_cells`` cells (or is one
    utterance). Which rows share a batch is the epoch's random draw, sorted by duration: a batch
    whose longest utterance lasts D holds a random draw of the rows of its bucket between its
    shortest and D, so its mean duration is at least that of all the bucket's rows below D
    (weighted by the copies an epoch draws of each: the sparse draw of a small EPOCH_SIZE makes a
    batch span that far), less ``_BOUND_STANDARD_ERRORS`` standard errors of a mean of that many
    rows. So a batch ending at D holds at most (max_batch_duration - D) / that mean + 1 rows, and
    no more than its bucket has up to D; each is padded to ceil(D / frame_seconds) frames and, in
    the joint, to the most tokens of a row up to D. (The rules alone, with any subset of rows an
    epoch could draw, allow a batch of one long row and the bucket's shortest ones: several times
    what the sampler packs, so no use to the max-batch search.)

    With speed factors, durations are as played (guarantee 9): each row enters once per factor, at
    duration / factor with its share of the copies (a factor at which it would be infeasible giving
    its share to 1.0), and with its most copies at each (a looser cap on rows, never a tighter one).

    One pass over the manifest in slices (a histogram over bucket x duration, 1/16 of a frame wide,
    up to max_batch_duration), then prefix sums over the bins (measured: docs/benchmarks.md)."""
    f, cap = sampler.frame_seconds, sampler.max_batch_duration
    per_frame = _BOUND_BINS_PER_FRAME
    # The copies of each row an epoch draws: q_l / n_l on average, at most its ceiling.
    copies = sampler._quotas / np.maximum(sampler._counts, 1)
    most_copies = np.ceil(copies)
    with_tokens = sampler.token_lengths is not None
    width = (math.ceil(min(longest_played(sampler), cap) / f) + 1) * per_frame
    size = (len(sampler.boundaries) + 1) * width
    weight, seconds, squares, rows = (np.zeros(size) for _ in range(4))
    tokens = np.zeros(size, dtype=np.int64)
    most_frames = most_cells = 0.0
    for lo, hi in slices(sampler.num_utterances):
        u_all = np.asarray(sampler.token_lengths[lo:hi]) if with_tokens else None
        mc_all = most_copies[sampler._codes[lo:hi]]
        for d, w in _played_versions(sampler, lo, hi, copies[sampler._codes[lo:hi]]):
            frames = np.ceil(d / f)  # as the collate pads them
            # An utterance over the cap is a batch of its own.
            alone = (d > cap) & (w > 0)
            if alone.any():
                most_frames = max(most_frames, float(frames[alone].max()))
                if with_tokens:
                    most_cells = max(most_cells, float(np.max(frames[alone] * (u_all[alone] + 1))))
            keep = (d <= cap) & (w > 0)
            d, w, frames = d[keep], w[keep], frames[keep]
            # Bins ordered by (bucket, frames, sixteenth of a frame): by duration within a bucket.
            part = np.clip((d / f - (frames - 1)) * per_frame, 0, per_frame - 1).astype(np.int64)
            index = np.maximum(frames.astype(np.int64) - 1, 0) * per_frame + part
            for edge in sampler.boundaries:
                index += (d >= edge) * width
            weight += np.bincount(index, weights=w, minlength=size)
            seconds += np.bincount(index, weights=w * d, minlength=size)
            squares += np.bincount(index, weights=w * d * d, minlength=size)
            # A row may be drawn at any of its factors: each version counts its most copies.
            rows += np.bincount(index, weights=mc_all[keep], minlength=size)
            if with_tokens:
                np.maximum.at(tokens, index, u_all[keep])
    bins = np.arange(width)
    bin_frames = bins // per_frame + 1.0
    shortest = (bins // per_frame + (bins % per_frame) / per_frame) * f
    room = np.maximum(cap - shortest, 0.0)
    for b in range(len(sampler.boundaries) + 1):
        at = slice(b * width, (b + 1) * width)
        if not weight[at].any():
            continue
        total = np.cumsum(weight[at])
        # A batch ending in bin k: the rows below bin k are shorter than any of bin k, so their
        # mean is the least mean of a span that ends there.
        below = np.concatenate([[0.0], total[:-1]])
        summed = np.cumsum(seconds[at])
        mean = np.where(
            below > 0,
            np.concatenate([[0.0], summed[:-1]]) / np.where(below > 0, below, 1.0),
            shortest,
        )
        held = np.where(total > 0, total, 1.0)
        spread = np.sqrt(np.maximum(np.cumsum(squares[at]) / held - (summed / held) ** 2, 0.0))
        n = np.floor(room / np.maximum(mean, _MIN_SORT_SECONDS)) + 1
        low = mean - _BOUND_STANDARD_ERRORS * spread / np.sqrt(n)
        # No mean of the bucket's rows is below its shortest row: for a span of few rows the
        # standard errors can reach below it (even below zero), which no draw can.
        low = np.maximum(low, shortest[np.flatnonzero(weight[at])[0]])
        n = np.floor(room / np.maximum(low, _MIN_SORT_SECONDS)) + 1
        np.minimum(n, np.cumsum(rows[at]), out=n)
        n[weight[at] <= 0] = 0  # no batch ends in a bin that no epoch draws from
        padded = n * bin_frames
        most_frames = max(most_frames, float(padded.max()))
        if with_tokens:
            cells = padded * (np.maximum.accumulate(tokens[at]) + 1)
            if sampler.max_joint_cells > 0:
                # A batch over the cap is cut into parts under it; a lone row stays whole.
                over = np.where(n > 1, np.minimum(cells, sampler.max_joint_cells), 0.0)
                cells = np.maximum(over, bin_frames * (tokens[at] + 1))
            most_cells = max(most_cells, float(cells.max()))
    return most_frames, most_cells


def longest_played(sampler: DurationBucketBatchSampler) -> float:
    """Seconds of the longest utterance as ``sampler`` can play it: the longest duration, divided
    by the slowest speed factor an utterance can be played at (1.0 without speed perturbation)."""
    longest = float(sampler.durations.max())
    if sampler.speed_factors:
        slowest = min(sampler.speed_factors)
        if sampler.token_lengths is not None:
            slowest = min(slowest, 1.0)  # an utterance infeasible at its factor plays at 1.0
        longest /= slowest
    return longest


def _played_versions(sampler: DurationBucketBatchSampler, lo: int, hi: int, copies: np.ndarray):
    """(durations as played, copies an epoch draws on average) of rows ``lo:hi``, once per speed
    factor they can be played at (each factor a 1/K share of the copies, the share of a factor at
    which a row is infeasible going to 1.0), or once as they are without speed perturbation."""
    d = sampler.durations[lo:hi]
    if not sampler.speed_factors:
        yield d, copies
        return
    share = copies / len(sampler.speed_factors)
    at_one = np.zeros(hi - lo)
    for factor in sampler.speed_factors:
        played = d / factor
        feasible = np.ones(hi - lo, dtype=bool)
        if sampler.token_lengths is not None:
            frames = np.floor(played / sampler.frame_seconds + _FRAME_EPS)
            feasible = np.asarray(sampler.token_lengths[lo:hi]) <= frames
            at_one += np.where(feasible, 0.0, share)
        yield played, np.where(feasible, share, 0.0)
    if at_one.any():
        yield d / 1.0, at_one
