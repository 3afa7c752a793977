"""max_batch.py: the heaviest micro-batch preflight and the step benchmark run, and the search for
the largest MAX_BATCH_DURATION."""

from __future__ import annotations

import pytest

import config
import max_batch


def test_timed_batch_is_the_samplers_heaviest_in_the_longest_bucket():
    shape = max_batch.heaviest_batch_shape(90.0, tokens_per_second=5.0)
    assert min(shape.durations) >= config.BUCKET_BOUNDARIES[-1]
    assert max(shape.durations) <= config.MAX_DURATION
    assert 90.0 - config.MAX_DURATION < shape.audio_seconds <= 90.0
    assert shape.tokens == [1 + round(5.0 * d) for d in shape.durations]


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
