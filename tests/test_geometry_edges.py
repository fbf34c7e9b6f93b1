"""Parameter geometry's edges (fedweigh.weighting.geometry): the zero-vector convention on each side, the
clip at +-1 on both sides, the precision each input dtype is computed in, overflow and non-finite values
named by who holds them, and every message."""

import math
import re
import warnings

import numpy as np
import pytest

from fedweigh.weighting import FedDRAWWeights
from fedweigh.weighting.geometry import (
    cosine_from_gram,
    cosine_from_parts,
    delta_gram,
    delta_gram64,
    delta_norms,
    direction_similarity,
    geometry_keys,
    layer_stats,
    model_similarity,
)


# ------------------------------------------------------------------------------------ cosines
@pytest.mark.parametrize(
    ("sq_a", "sq_b", "want"),
    [(0.0, 0.0, 1.0), (0.5, 0.0, 0.0), (0.0, 0.5, 0.0), (2.0, 0.0, 0.0), (0.0, 2.0, 0.0)],
)
def test_cosine_from_gram_zero_vector_convention(sq_a, sq_b, want):
    """cos(0, 0) = 1; cos(0, v) = cos(v, 0) = 0 for v != 0, whatever the size of v."""
    assert cosine_from_gram(0.0, sq_a, sq_b).tolist() == want


@pytest.mark.parametrize(
    ("dot", "want"), [(1.0 + 1e-12, 1.0), (-1.0 - 1e-12, -1.0), (0.5, 0.5), (-0.5, -0.5)]
)
def test_cosine_from_gram_is_clipped_to_the_unit_interval_on_both_sides(dot, want):
    """Rounding can put <a, b> a little beyond ||a|| ||b||; the cosine stays in [-1, 1]."""
    assert cosine_from_gram(dot, 1.0, 1.0).tolist() == want


@pytest.mark.parametrize(
    ("a", "g", "c", "want"),
    [
        (0.0, 0.0, 0.0, 1.0),  # both zero
        (0.5, -0.5, 0.5, 0.0),  # theta_k = 0 next to a non-zero global model with ||theta_g||^2 < 1
        (0.0, 0.0, 0.5, 0.0),  # theta_g = 0, theta_k != 0
        (1.0, 0.0, -1e-6, 1.0),  # parts a little inconsistent by rounding: (a + g) / denom > 1
        (1.0, -2.0, 4.0 - 1e-6, -1.0),  # ... and < -1
    ],
)
def test_cosine_from_parts_convention_and_clip(a, g, c, want):
    assert cosine_from_parts(a, g, c).tolist() == want


# ------------------------------------------------------------------------------------ precision
def _float32_round(rng, k=3, n=1000):
    g = rng.normal(size=n).astype(np.float32)
    clients = [(g + rng.normal(scale=0.1, size=n)).astype(np.float32) for _ in range(k)]
    return g, clients


def test_float32_layer_stats_are_float32_inner_products_and_float64_ones_otherwise():
    rng = np.random.default_rng(1)
    g, (p, *_) = _float32_round(rng)
    a, gd, c = layer_stats({"w": p}, {"w": g})
    d = p - g
    assert (a[0], gd[0], c[0]) == (float(np.dot(g, g)), float(np.dot(g, d)), float(np.dot(d, d)))
    g64, d64 = g.astype(np.float64), p.astype(np.float64) - g.astype(np.float64)
    assert c[0] != float(np.dot(d64, d64))  # the float32 path is not the float64 one
    mixed = layer_stats({"w": p}, {"w": g.astype(np.float64)})  # one float64 side: float64
    assert mixed[2][0] == float(np.dot(d64, d64)) and mixed[0][0] == float(np.dot(g64, g64))


def test_float32_delta_gram_is_one_float32_product_and_a_float64_global_stays_float64():
    rng = np.random.default_rng(2)
    g, clients = _float32_round(rng)
    gram = delta_gram({"w": g}, [{"w": p} for p in clients], ["a", "b", "c"])
    x = np.stack([g] + [p - g for p in clients])
    want = (x @ x.T).astype(np.float64)
    assert gram.global_sq == want[0, 0]
    assert gram.global_dot.tolist() == want[0, 1:].tolist()
    assert gram.gram.tolist() == want[1:, 1:].tolist()
    g64 = np.array([1.0 + 1e-10, 2.0])  # not representable in float32
    mixed = delta_gram({"w": g64}, [{"w": g64.astype(np.float32)}], ["a"])
    assert mixed.global_sq == float(g64 @ g64)


def test_delta_gram64_over_chunks_is_the_exact_gram():
    rng = np.random.default_rng(3)
    g = rng.normal(size=10)
    clients = [{"w": g + rng.normal(size=10)} for _ in range(3)]
    deltas = np.stack([p["w"] - g for p in clients])
    np.testing.assert_allclose(delta_gram64({"w": g}, clients, chunk=3), deltas @ deltas.T, rtol=1e-13)


# ------------------------------------------------------------------------------------ overflow, non-finite
def test_delta_norms_and_gram64_of_huge_updates_are_quiet_and_exact_or_infinite():
    g = {"w": np.array([-1e308, 0.0])}
    huge = {"w": np.array([1e308, 0.0])}  # the difference overflows float64
    big = {"w": np.array([-1e308 + 3e300, 1e200])}  # 1e200^2 overflows, its norm does not
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norms = delta_norms(g, [huge, big, {"w": np.array([-1e308, 0.0])}])
        gram = delta_gram64(g, [huge, {"w": np.array([-1e308, 0.0])}])
    assert norms[0, 0] == math.inf and norms[2, 0] == 0.0
    assert norms[1, 0] == math.inf  # 3e300^2 + 1e400 is beyond float64 in a dot product
    assert gram[0, 0] == math.inf and gram[1, 1] == 0.0


def test_delta_norms_of_a_nan_update_is_infinite():
    norms = delta_norms({"w": np.zeros(2)}, [{"w": np.array([math.nan, 0.0])}])
    assert norms.tolist() == [[math.inf]]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # raised on, named below
def test_float32_inner_products_that_overflow_are_named_by_who_holds_them():
    one = np.ones(2, dtype=np.float32)
    large = np.full(2, 2e19, dtype=np.float32)  # (2e19)^2 = 4e38 > float32 max
    with pytest.raises(ValueError, match=r"^global parameters hold non-finite values$"):
        delta_gram({"w": large}, [{"w": large}], ["a"])
    with pytest.raises(ValueError, match=r"^client 'a': parameters hold non-finite values$"):
        delta_gram({"w": one}, [{"w": one + large}], ["a"])
    with pytest.raises(ValueError, match=r"^global parameters hold non-finite values$"):
        layer_stats({"w": large}, {"w": large})
    # <theta_g, Delta> = 2 * 2e19 is finite, ||Delta||^2 is not: still the client's
    with pytest.raises(ValueError, match=r"^client 'client': parameters hold non-finite values$"):
        layer_stats({"w": one + large}, {"w": one})


def test_delta_gram_names_a_mismatched_client_and_needs_one_name_each():
    g = {"w": np.zeros(2)}
    with pytest.raises(ValueError, match=r"client 'b'"):
        delta_gram(g, [{"w": np.zeros(2)}, {"w": np.zeros(3)}], ["a", "b"])
    with pytest.raises(ValueError, match=r"^one name per client parameter dict is required$"):
        delta_gram(g, [{"w": np.zeros(2)}], ["a", "b"])


# ------------------------------------------------------------------------------------ similarities
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # raised on, named below
def test_direction_similarity_sums_over_every_array_and_checks_each_side():
    g = {"u": np.array([1.0, 0.0]), "v": np.array([0.0, 1.0])}
    before = {"u": np.array([0.0, 0.0]), "v": np.array([0.0, 0.0])}  # previous update = theta_g
    p = {"u": np.array([2.0, 0.0]), "v": np.array([0.0, 3.0])}  # delta = (1, 0, 0, 2)
    assert direction_similarity(p, g, before) == pytest.approx(
        3.0 / (math.sqrt(2.0) * math.sqrt(5.0)), rel=1e-15
    )
    with pytest.raises(ValueError, match=r"^client 'client': parameters hold non-finite values$"):
        # the update's dot with the previous step is finite (0), its own norm is not
        direction_similarity(
            {"u": np.array([1.0, 1e200]), "v": np.array([0.0, 1.0])},
            g,
            {"u": np.zeros(2), "v": np.zeros(2)},
        )
    with pytest.raises(ValueError, match=r"^global parameters hold non-finite values$"):
        direction_similarity(g, g, {"u": np.array([1e200, 0.0]), "v": np.zeros(2)})


def test_direction_similarity_with_no_step_on_either_side_is_zero():
    g = {"w": np.array([1.0, 2.0])}
    assert direction_similarity(g, g, g) == 0.0


def test_direction_similarity_names_the_missing_and_the_misshaped_arrays():
    g = {k: np.zeros(1) for k in "abcde"}
    with pytest.raises(
        ValueError, match=re.escape("lacks array(s) ['a', 'b', 'c'] that the geometry compares")
    ):
        direction_similarity(g, g, {"e": np.zeros(1)})
    with pytest.raises(ValueError, match=r"^the previous global model's array 'a' has 2 values, not 1$"):
        direction_similarity(g, g, {**g, "a": np.zeros(2)})


def test_layer_mode_over_one_array_is_its_cosine_and_over_none_is_refused():
    g = {"w": np.array([1.0, 0.0])}
    p = {"w": np.array([1.0, 1.0])}
    assert model_similarity(p, g, "layer") == pytest.approx(1.0 / math.sqrt(2.0), rel=1e-15)
    with pytest.raises(ValueError, match=r"^no floating-point parameters to compare$"):
        model_similarity(p, g, "layer", keys=[])
    with pytest.raises(ValueError, match=r"^similarity mode must be 'params' or 'layer' here, got 'delta'$"):
        model_similarity(p, g, "delta")


def test_geometry_keys_messages():
    with pytest.raises(ValueError, match=r"^parameter geometry: geometry must be 'trainable'"):
        geometry_keys({"w": np.zeros(1)}, "buffers")
    ints = {"n": np.zeros(1, dtype=np.int64), "bn.running_mean": np.zeros(1)}
    with pytest.raises(ValueError, match=r"^no floating-point arrays to compare$"):
        geometry_keys({"n": np.zeros(1, dtype=np.int64)}, "all")
    with pytest.raises(ValueError, match=r"^no floating-point parameters to compare$"):
        geometry_keys(ints, "trainable")


def test_a_schemes_exact_buffer_keys_decide_what_it_compares():
    scheme = FedDRAWWeights()
    params = {"w": np.zeros(1), "stat": np.zeros(1)}  # "stat" is no buffer by the name rule
    assert scheme.compared_keys(params) == ["w", "stat"]
    scheme.buffer_keys = frozenset({"stat"})
    assert scheme.compared_keys(params) == ["w"]


@pytest.mark.parametrize("mode", ["params", "layer"])
def test_model_similarity_names_a_non_finite_client_by_its_name_or_as_client(mode):
    g = {"w": np.zeros(2)}
    bad = {"w": np.array([math.nan, 0.0])}
    with pytest.raises(ValueError, match=r"^client 'client': parameters hold non-finite values$"):
        model_similarity(bad, g, mode)
    with pytest.raises(ValueError, match=r"^client 'site-2': parameters hold non-finite values$"):
        model_similarity(bad, g, mode, name="site-2")


def test_an_infinite_array_on_both_sides_gives_an_infinite_norm_without_a_warning():
    # inf - inf is NaN (NumPy's "invalid"): the norm is reported as infinite, quietly
    glob = {"w": np.array([np.inf, 0.0], dtype=np.float32)}
    client = {"w": np.array([np.inf, 1.0], dtype=np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norms = delta_norms(glob, [client])
    assert norms.shape == (1, 1) and norms[0, 0] == math.inf
