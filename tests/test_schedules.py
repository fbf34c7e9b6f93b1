"""Schedules: ramps 0 -> 1 and FedDRAW's deferred anneal, against hand-computed values."""

import math

import pytest

from fedweigh import schedules


@pytest.mark.parametrize("shape", schedules.RAMP_SHAPES)
def test_ramps_start_at_zero_end_at_one_and_rise(shape):
    values = [schedules.ramp(shape, x / 10) for x in range(11)]
    assert values[0] == pytest.approx(0.0, abs=1e-15)
    assert values[-1] == pytest.approx(1.0, abs=1e-15)
    assert all(b > a for a, b in zip(values, values[1:], strict=False))


def test_ramp_values_by_hand():
    assert schedules.linear(0.3) == pytest.approx(0.3)
    assert schedules.cosine(0.5) == pytest.approx(0.5)
    assert schedules.cosine(1 / 3) == pytest.approx(0.25)  # (1 - cos(pi/3)) / 2
    # (1 - e^{-5 * 0.2}) / (1 - e^{-5})
    assert schedules.exponential(0.2) == pytest.approx((1 - math.exp(-1.0)) / (1 - math.exp(-5.0)))
    assert schedules.exponential(0.2, rate=2.0) == pytest.approx((1 - math.exp(-0.4)) / (1 - math.exp(-2.0)))


def test_ramp_rejects_bad_input():
    with pytest.raises(ValueError, match="progress"):
        schedules.linear(1.5)
    with pytest.raises(ValueError, match="rate"):
        schedules.exponential(0.5, rate=0.0)
    with pytest.raises(ValueError, match="unknown schedule shape 'step'"):
        schedules.ramp("step", 0.5)


def test_progress():
    assert schedules.progress(1, 10) == 0.0
    assert schedules.progress(10, 10) == 1.0
    assert schedules.progress(4, 7) == pytest.approx(0.5)
    assert schedules.progress(1, 1) == 0.0
    with pytest.raises(ValueError, match="1-based"):
        schedules.progress(0, 10)
    with pytest.raises(ValueError, match="1-based"):
        schedules.progress(11, 10)


def test_deferred_anneal_holds_then_anneals_to_zero():
    # T = 10, rho = 0.5: t_d = 5; beta_max held through round 5, 0 at round 10.
    betas = [schedules.deferred_anneal(t, 10, 2.0, 0.5, "cosine") for t in range(1, 11)]
    assert betas[:5] == [2.0] * 5
    assert betas[-1] == pytest.approx(0.0, abs=1e-15)
    # round 6: x = (6 - 5) / (10 - 5) = 0.2; cosine ramp (1 - cos(0.2 pi)) / 2
    assert betas[5] == pytest.approx(2.0 * (1 - (1 - math.cos(0.2 * math.pi)) / 2))
    assert all(b >= a for a, b in zip(betas[1:], betas, strict=False))


def test_deferred_anneal_linear_and_rho_edges():
    # T = 4, rho = 0.5 -> t_d = 2; round 3: x = 0.5 -> beta = 0.5 beta_max
    assert schedules.deferred_anneal(3, 4, 4.0, 0.5, "linear") == pytest.approx(2.0)
    # rho = 1 never anneals
    assert schedules.deferred_anneal(4, 4, 3.0, 1.0, "cosine") == 3.0
    # rho = 0 anneals from round 1: x = 1/T
    assert schedules.deferred_anneal(1, 4, 1.0, 0.0, "linear") == pytest.approx(0.75)
    # non-integer deferral point: T = 10, rho = 0.95 -> t_d = 9.5, round 10 -> 0
    assert schedules.deferred_anneal(10, 10, 1.0, 0.95, "exponential") == pytest.approx(0.0, abs=1e-12)


def test_deferred_anneal_validates():
    with pytest.raises(ValueError, match="rho"):
        schedules.deferred_anneal(1, 10, 1.0, 1.5)
    with pytest.raises(ValueError, match="beta_max"):
        schedules.deferred_anneal(1, 10, -1.0, 0.5)
    with pytest.raises(ValueError, match="shape"):
        schedules.deferred_anneal(1, 10, 1.0, 0.5, "square")
    with pytest.raises(ValueError, match="round_index"):
        schedules.deferred_anneal(0, 10, 1.0, 0.5)


def test_an_unknown_shape_is_refused_with_the_shapes_that_exist():
    """The message lists the known shapes as written, for the ramp and for the deferred anneal."""
    known = "known: linear, cosine, exponential"
    with pytest.raises(ValueError, match=f"unknown schedule shape 'step'; {known}$"):
        schedules.ramp("step", 0.5)
    with pytest.raises(ValueError, match=f"unknown schedule shape 'square'; {known}$"):
        schedules.deferred_anneal(1, 10, 1.0, 0.5, "square")
