"""The benchmark's effect estimates at their edges (``fedweigh.bench.effects``): the pairing a paired
effect needs and its message, resamples that are undefined, and the verdict of an interval that
touches 0 or is not finite."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedweigh.bench.effects import Effect, paired_effect, verdict

NEEDS_PAIRS = r"^paired_effect: one \(method, reference\) pair per seed is needed$"


def seed(full: float, resampled) -> tuple[float, np.ndarray]:
    return full, np.asarray(resampled, dtype=float)


# ---- paired_effect -----------------------------------------------------------------------------


def test_a_paired_effect_needs_one_reference_per_seed():
    method = [seed(0.7, [0.7, 0.6]), seed(0.8, [0.8, 0.7])]
    with pytest.raises(ValueError, match=NEEDS_PAIRS):
        paired_effect(method, method[:1])
    with pytest.raises(ValueError, match=NEEDS_PAIRS):
        paired_effect([], [])


def test_with_every_resample_undefined_there_is_no_effect():
    method = [seed(0.7, [np.nan, np.nan]), seed(0.8, [np.nan, np.nan])]
    reference = [seed(0.6, [0.6, 0.5]), seed(0.7, [0.7, 0.6])]
    assert paired_effect(method, reference) is None


def test_one_defined_resample_gives_an_interval_of_one_point():
    method = [seed(0.7, [0.75, np.nan]), seed(0.8, [0.85, np.nan])]
    reference = [seed(0.6, [0.65, 0.5]), seed(0.6, [0.55, 0.6])]
    effect = paired_effect(method, reference)
    assert effect == Effect(pytest.approx(0.15), pytest.approx(0.2), pytest.approx(0.2))


def test_an_undefined_full_auc_gives_no_effect():
    method = [seed(math.nan, [0.7, 0.6]), seed(0.8, [0.8, 0.7])]
    reference = [seed(0.6, [0.6, 0.5]), seed(0.7, [0.7, 0.6])]
    assert paired_effect(method, reference) is None


# ---- verdict -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "low, high, expected",
    [
        (0.01, 0.2, "better"),
        (0.0, 0.2, "no evidence"),  # an interval that touches 0 holds it
        (-0.2, -0.01, "worse"),
        (-0.2, 0.0, "no evidence"),
        (-0.1, 0.1, "no evidence"),
        (None, 0.2, "no evidence"),
        (0.01, None, "no evidence"),
        (None, None, "no evidence"),
        (0.01, math.inf, "no evidence"),  # an interval that is not finite is undefined
        (-math.inf, -0.01, "no evidence"),
        (math.nan, 0.2, "no evidence"),
    ],
)
def test_the_verdict_of_an_interval(low, high, expected):
    assert verdict(low, high) == expected
