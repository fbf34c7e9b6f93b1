"""The direction check of :class:`fedweigh.site.he_guard.HEModelGuard` on constructed updates: the
cosine of the decrypted global update with the site's own last update and with the trend of the
global updates it accepted, refused when every one known is below the bound."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fedweigh.site.he_guard import DIRECTION_BOUND, RATIO_BOUND, HEModelGuard

SITES = 4
SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (4, 500), "fc.bias": (4,)}
KEYS = list(SHAPES)


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in SHAPES.items()}


def decrypted(params: dict[str, np.ndarray]) -> SimpleNamespace:
    """What decrypt_global gives a site, as the guard reads it."""
    return SimpleNamespace(params=params, layout=SimpleNamespace(keys=KEYS), check_problem=None)


def add(params: dict, delta: dict, factor: float = 1.0) -> dict[str, np.ndarray]:
    return {k: (np.float64(params[k]) + factor * delta[k]).astype(np.float32) for k in params}


class Updates:
    """Honest site updates: a common direction that drifts slowly over the rounds (the trend) plus
    per-site noise of 0.3 its size (correlation about 0.9 between two sites' updates, as the benchmark's
    local Adam steps on SynthCXR give: honest cos_own about 0.9, -3 x one update about 0.05)."""

    def __init__(self, seed: int = 0, scale: float = 0.002):
        self.rng = np.random.default_rng(seed)
        self.scale = scale
        self.common = {k: self.rng.normal(0, scale, s) for k, s in SHAPES.items()}

    def next_round(self) -> list[dict[str, np.ndarray]]:
        self.common = {
            k: 0.8 * v + 0.6 * self.rng.normal(0, self.scale, v.shape) for k, v in self.common.items()
        }
        return [
            {k: v + self.rng.normal(0, 0.3 * self.scale, v.shape) for k, v in self.common.items()}
            for _ in range(SITES)
        ]


def run_rounds(attack_factor: float | None, rounds: int = 5, attack_from: int = 3, **guard_args) -> list:
    """Site-1's guard over ``rounds`` aggregates of 4 equally weighted updates; from round
    ``attack_from`` on, the 4th update is ``attack_factor`` x itself. Returns the refusals per round."""
    rng = np.random.default_rng(7)
    good = model(rng)
    guard = HEModelGuard("site-1", **guard_args)
    receipt = guard.receive(decrypted(good))
    updates = Updates()
    refusals = []
    for t in range(1, rounds + 1):
        deltas = updates.next_round()
        if attack_factor is not None and t >= attack_from:
            deltas[-1] = {k: attack_factor * v for k, v in deltas[-1].items()}
        guard.outgoing(add(receipt.use, deltas[0]), receipt, KEYS)  # site-1's own update, as it sends it
        mean = {k: sum(d[k] for d in deltas) / SITES for k in KEYS}
        receipt = guard.receive(decrypted(add(receipt.use, mean)), t + 1)
        refusals.append(receipt.refusal)
    return refusals


def test_honest_noisy_means_of_correlated_updates_are_accepted():
    for seed in range(5):
        rng_updates = Updates(seed)
        guard = HEModelGuard("site-1")
        good = model(np.random.default_rng(seed))
        receipt = guard.receive(decrypted(good))
        for t in range(1, 8):
            deltas = rng_updates.next_round()
            guard.outgoing(add(receipt.use, deltas[0]), receipt, KEYS)
            mean = {k: sum(d[k] for d in deltas) / SITES for k in KEYS}
            receipt = guard.receive(decrypted(add(receipt.use, mean)), t + 1)
            assert receipt.refusal is None, (seed, t, guard.direction)
            assert guard.direction["cos_own"] > DIRECTION_BOUND


def test_one_site_sending_its_update_negated_and_tripled_is_refused():
    refusals = run_rounds(-3.0)
    assert refusals[:2] == [None, None]  # honest rounds 1-2
    assert all(r is not None and "points against" in r for r in refusals[2:]), refusals


def test_negated_and_tripled_passes_without_the_direction_check():
    """The size check alone lets it through (the finding the direction check answers)."""
    assert run_rounds(-3.0, direction_bound=None) == [None] * 5


def test_the_first_judgement_uses_the_own_update_alone_and_the_first_model_is_not_judged():
    rng = np.random.default_rng(3)
    g0 = model(rng)
    guard = HEModelGuard("site-1")
    # the first model received: no last good model, nothing to compare it with: accepted as it is
    receipt = guard.receive(decrypted(g0))
    assert receipt.refusal is None and guard.direction == {}
    own = {k: rng.normal(0, 0.002, s) for k, s in SHAPES.items()}
    guard.outgoing(add(g0, own), receipt, KEYS)
    # no accepted global update yet: no trend; a global update against the own one is refused on it
    against = guard.receive(decrypted(add(g0, own, -0.5)), 2)
    assert guard.direction["cos_trend"] is None and guard.direction["cos_own"] < -0.99
    assert against.refusal is not None and "own -1" in against.refusal
    # the same site with its own update along the aggregate: accepted, and it starts the trend
    along = guard.receive(decrypted(add(g0, own, 0.5)), 2)
    assert along.refusal is None and guard.trend is not None


def test_a_guard_without_any_reference_does_not_judge_the_direction():
    guard = HEModelGuard("site-1")
    g0 = model(np.random.default_rng(4))
    guard.receive(decrypted(g0))
    shifted = {k: v - np.float32(0.001) for k, v in g0.items()}
    assert guard.receive(decrypted(shifted), 2).refusal is None  # no own update, no trend: no judgement
    assert guard.direction == {"cos_own": None, "cos_trend": None}


def unit_with_cosine(reference: np.ndarray, cos: float, rng: np.random.Generator) -> np.ndarray:
    """A vector whose cosine with ``reference`` is exactly ``cos`` (float64)."""
    r = reference / np.linalg.norm(reference)
    other = rng.normal(size=reference.shape)
    other -= other.dot(r) * r
    other /= np.linalg.norm(other)
    return cos * r + np.sqrt(1 - cos * cos) * other


@pytest.mark.parametrize("bound", [DIRECTION_BOUND, 0.6, -0.2])
def test_the_bound_on_both_sides(bound):
    rng = np.random.default_rng(5)
    guard = HEModelGuard("site-1", direction_bound=bound)
    guard.own_vector = rng.normal(size=2000).astype(np.float32)
    own = guard.own_vector.astype(np.float64)
    below = unit_with_cosine(own, bound - 0.02, rng).astype(np.float32)
    above = unit_with_cosine(own, bound + 0.02, rng).astype(np.float32)
    assert guard.direction_refusal(above) is None
    assert guard.direction_refusal(below) is not None
    assert guard.direction["cos_own"] == pytest.approx(bound - 0.02, abs=1e-4)
    # either reference at or above the bound is enough: a trend along the update accepts it
    guard.trend = below.copy()
    assert guard.direction_refusal(below) is None
    # a trend below the bound too: refused
    guard.trend = unit_with_cosine(below.astype(np.float64), bound - 0.02, rng).astype(np.float32)
    assert guard.direction_refusal(below) is not None


def test_the_guard_keeps_two_flat_float32_vectors():
    guard = HEModelGuard("site-1")
    rng = np.random.default_rng(6)
    g0 = model(rng)
    receipt = guard.receive(decrypted(g0))
    guard.outgoing(add(g0, Updates().next_round()[0]), receipt, KEYS)
    size = sum(int(np.prod(s)) for s in SHAPES.values())
    assert guard.own_vector.dtype == np.float32 and guard.own_vector.shape == (size,)
    guard.receive(decrypted(add(g0, Updates().next_round()[0])), 2)
    assert guard.trend.dtype == np.float32 and guard.trend.shape == (size,)
    assert RATIO_BOUND > 1  # the size check is still there alongside
