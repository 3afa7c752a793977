"""training_step.lr_at_step: warmup to PHASE1_LR, re-warmup to PHASE2_LR at UNFREEZE_STEP, cosine to MIN_LR."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from training_step import lr_at_step

S = dict(
    warmup_steps=100,
    phase1_lr=3e-4,
    unfreeze_step=1000,
    phase2_warmup=50,
    phase2_lr=1e-4,
    min_lr=1e-6,
    max_steps=5000,
)


def lr(step, **over):
    return lr_at_step(step, **{**S, **over})


def test_phase1_warmup_rises_linearly_from_the_first_step_to_the_peak():
    assert lr(0) == pytest.approx(3e-4 / 100)
    assert lr(49) == pytest.approx(3e-4 * 50 / 100)
    assert lr(99) == pytest.approx(3e-4)
    assert all(lr(s) < lr(s + 1) for s in range(99))


def test_phase1_stays_at_peak_until_unfreezing():
    assert {lr(s) for s in (100, 500, 999)} == {3e-4}


def test_unfreezing_restarts_a_linear_warmup_to_phase2_lr():
    assert lr(1000) == pytest.approx(1e-4 / 50)
    assert lr(1049) == pytest.approx(1e-4)
    assert all(lr(s) < lr(s + 1) for s in range(1000, 1049))


def test_cosine_decay_reaches_min_lr_at_max_steps_and_stays():
    assert lr(1050) == pytest.approx(1e-4)
    midpoint = 1050 + (5000 - 1050) // 2
    assert lr(midpoint) == pytest.approx((1e-4 + 1e-6) / 2, rel=1e-3)
    assert lr(5000) == pytest.approx(1e-6)
    assert lr(7000) == pytest.approx(1e-6)
    assert all(lr(s) >= lr(s + 1) for s in range(1050, 5000, 7))


def test_unfreeze_step_zero_means_a_single_phase2_schedule():
    assert lr(0, unfreeze_step=0) == pytest.approx(1e-4 / 50)
    assert lr(49, unfreeze_step=0) == pytest.approx(1e-4)
    assert lr(5000, unfreeze_step=0) == pytest.approx(1e-6)


def test_no_warmup_starts_at_peak():
    assert lr(0, warmup_steps=0) == 3e-4
    assert lr(1000, phase2_warmup=0) == pytest.approx(1e-4)


@given(
    step=st.integers(0, 20_000),
    warmup=st.integers(0, 500),
    unfreeze=st.integers(0, 4000),
    warmup2=st.integers(0, 500),
    max_steps=st.integers(1, 10_000),
)
def test_lr_is_always_finite_positive_and_at_most_the_larger_peak(
    step, warmup, unfreeze, warmup2, max_steps
):
    value = lr(
        step,
        warmup_steps=warmup,
        unfreeze_step=unfreeze,
        phase2_warmup=warmup2,
        max_steps=max_steps,
    )
    assert math.isfinite(value) and 0 < value <= 3e-4 + 1e-18
