"""Contract shared by all schemes: validation, registry, aggregate(), geometry, state round trip."""

import json
import re

import numpy as np
import pytest

from fedweigh.histograms import global_stats_of
from fedweigh.weighting import SCHEMES, ClientReport, get_scheme
from fedweigh.weighting.base import ScalarContext, check_reports
from fedweigh.weighting.geometry import delta_gram, layer_stats, model_similarity

NAMES = (
    "fedavg",
    "uniform",
    "fedprox",
    "fednova",
    "fedadp",
    "ida",
    "feddisco",
    "fedawa",
    "feddraw",
    "cbr",
    "dafl",
)


def make_global(dtype=np.float64):
    return {
        "conv.weight": np.arange(6, dtype=dtype).reshape(3, 2) / 7 + 0.5,
        "conv.bias": np.array([0.3, -0.2], dtype=dtype),
        "bn.num_batches_tracked": np.array(10, dtype=np.int64),
    }


def make_client(global_params, delta_w, delta_b, steps=0):
    return {
        "conv.weight": global_params["conv.weight"]
        + np.asarray(delta_w, dtype=global_params["conv.weight"].dtype),
        "conv.bias": global_params["conv.bias"] + np.asarray(delta_b, dtype=global_params["conv.bias"].dtype),
        "bn.num_batches_tracked": np.array(10 + steps, dtype=np.int64),
    }


def full_reports(global_params, sizes, hists, seed=0):
    """Reports carrying params and every scalar the schemes use (computed with client_scalars)."""
    rng = np.random.default_rng(seed)
    pooled = global_stats_of(zip(hists, sizes, strict=True))  # the statistics phase's result
    reports = []
    for i, (n, h) in enumerate(zip(sizes, hists, strict=True)):
        params = make_client(global_params, rng.normal(0, 0.1, (3, 2)), rng.normal(0, 0.1, 2), steps=5 + i)
        scalars = {}
        for name in ("feddraw", "cbr", "dafl", "feddisco"):
            scalars.update(
                get_scheme(name).client_scalars(
                    ScalarContext(
                        class_counts=np.asarray(h),
                        num_samples=n,
                        global_stats=pooled,
                        params=params,
                        global_params=global_params,
                    )
                )
            )
        reports.append(ClientReport(f"site-{i + 1}", n, num_steps=3 + 2 * i, scalars=scalars, params=params))
    return reports


# ----------------------------------------------------------------------------- registry
def test_registry_has_every_scheme():
    assert set(SCHEMES) == set(NAMES)
    for name in NAMES:
        assert get_scheme(name).name == name


def test_unknown_scheme_lists_known_names():
    with pytest.raises(KeyError, match="fedavg.*feddraw"):
        get_scheme("fedmagic")


def test_unknown_option_names_the_options():
    with pytest.raises(TypeError, match="beta_max"):
        get_scheme("feddraw", beta=3)


def test_declarations():
    assert not get_scheme("ida").he_compatible
    assert not get_scheme("fedawa").he_compatible
    assert get_scheme("feddisco", target="global").needs_global_histogram
    assert not get_scheme("feddisco").needs_global_histogram  # uniform target: no histogram
    assert get_scheme("cbr").required_scalars == ("skew",)
    assert get_scheme("fedprox").client_mu == 0.01
    assert get_scheme("fedprox", client_mu=0.01).client_mu == 0.01


# ----------------------------------------------------------------------------- validation
def test_empty_reports_rejected():
    for name in NAMES:
        with pytest.raises(ValueError, match="no client reports"):
            get_scheme(name).weights([], make_global(), 1, 5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_sample_count_names_client(bad):
    reps = [ClientReport("a", 10), ClientReport("hospital-b", bad)]
    with pytest.raises(ValueError, match="hospital-b.*num_samples"):
        get_scheme("fedavg").weights(reps, None, 1, 5)


def test_bad_steps_duplicate_and_nonfinite():
    with pytest.raises(ValueError, match="'b'.*num_steps"):
        get_scheme("fednova").weights([ClientReport("a", 1), ClientReport("b", 1, num_steps=0)], None, 1, 2)
    with pytest.raises(ValueError, match="'a' reported twice"):
        get_scheme("fedavg").weights([ClientReport("a", 1), ClientReport("a", 2)], None, 1, 2)
    reps = [
        ClientReport("a", 5, scalars={"skew": 0.5}),
        ClientReport("site-x", 5, scalars={"skew": float("nan")}),
    ]
    with pytest.raises(ValueError, match="site-x.*'skew'.*not finite"):
        get_scheme("cbr").weights(reps, None, 1, 2)


def test_missing_scalar_names_client_and_scalar():
    reps = [ClientReport("a", 5, scalars={"skew": 0.5}), ClientReport("b", 5, scalars={"imbalance": 1.0})]
    with pytest.raises(ValueError, match="'b'.*missing required scalar 'skew'"):
        get_scheme("cbr").weights(reps, None, 1, 2)


def test_missing_params_for_param_schemes():
    g = make_global()
    for name in ("ida", "fedawa", "fedadp"):
        reps = [ClientReport("a", 5, params=make_client(g, 0.1, 0.1)), ClientReport("b", 5)]
        with pytest.raises(ValueError, match="'b'.*no parameters"):
            get_scheme(name).weights(reps, g, 1, 2)


def test_round_index_validated():
    with pytest.raises(ValueError, match="1-based"):
        get_scheme("fedavg").weights([ClientReport("a", 1)], None, 0, 5)
    with pytest.raises(ValueError, match="1-based"):
        get_scheme("fedavg").weights([ClientReport("a", 1)], None, 6, 5)


def test_check_reports_returns_sizes():
    sizes = check_reports([ClientReport("a", 2), ClientReport("b", np.int64(6))], scheme="x")
    assert sizes.dtype == np.float64 and sizes.tolist() == [2.0, 6.0]


# ----------------------------------------------------------------------------- aggregate
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_aggregate_equals_manual_delta_sum(dtype):
    g = make_global(dtype)
    c1 = make_client(g, [[0.1, 0.2], [0.0, -0.1], [0.3, 0.0]], [0.05, 0.0], steps=4)
    c2 = make_client(g, [[-0.2, 0.0], [0.1, 0.1], [0.0, 0.2]], [0.0, -0.05], steps=9)
    reps = [ClientReport("a", 1, params=c1), ClientReport("b", 3, params=c2)]
    w = np.array([0.3, 0.9])  # need not sum to 1 (FedNova)
    snapshot = {k: v.copy() for k, v in g.items()}
    out = get_scheme("fedavg").aggregate(g, reps, w)
    for key in ("conv.weight", "conv.bias"):
        manual = g[key].astype(np.float64) + 0.3 * (c1[key] - g[key]) + 0.9 * (c2[key] - g[key])
        assert out[key].dtype == dtype
        np.testing.assert_allclose(out[key], manual, rtol=1e-6 if dtype == np.float32 else 1e-14)
    # integer buffer, "weighted": 10 + rint(0.3 * 4 + 0.9 * 9) = 10 + rint(9.3) = 19
    assert out["bn.num_batches_tracked"].dtype == np.int64 and int(out["bn.num_batches_tracked"]) == 19
    for k in g:  # inputs untouched
        np.testing.assert_array_equal(g[k], snapshot[k])


def test_aggregate_integer_buffer_max_rule():
    g = make_global()
    reps = [
        ClientReport("a", 1, params=make_client(g, 0.0, 0.0, steps=4)),
        ClientReport("b", 1, params=make_client(g, 0.0, 0.0, steps=9)),
    ]
    out = get_scheme("fedavg", integer_buffers="max").aggregate(g, reps, np.array([0.5, 0.5]))
    assert int(out["bn.num_batches_tracked"]) == 19
    with pytest.raises(ValueError, match="integer_buffers"):
        get_scheme("fedavg", integer_buffers="min")


def test_aggregate_rejects_bad_inputs():
    g = make_global()
    good = make_client(g, 0.1, 0.1)
    bad = make_client(g, 0.1, 0.1)
    bad["conv.bias"] = bad["conv.bias"].copy()
    bad["conv.bias"][0] = np.inf
    scheme = get_scheme("fedavg")
    with pytest.raises(ValueError, match="'conv.bias'.*'site-bad'"):
        scheme.aggregate(
            g, [ClientReport("ok", 1, params=good), ClientReport("site-bad", 1, params=bad)], [0.5, 0.5]
        )
    short = {k: v for k, v in good.items() if k != "conv.bias"}
    with pytest.raises(ValueError, match="'short'.*lack"):
        scheme.aggregate(g, [ClientReport("short", 1, params=short)], [1.0])
    wrong = dict(good, **{"conv.bias": np.zeros(3)})
    with pytest.raises(ValueError, match="'wrong'.*'conv.bias'.*shape"):
        scheme.aggregate(g, [ClientReport("wrong", 1, params=wrong)], [1.0])
    with pytest.raises(ValueError, match="'he'.*no parameters"):
        scheme.aggregate(g, [ClientReport("he", 1)], [1.0])
    with pytest.raises(ValueError, match="2 weight"):
        scheme.aggregate(g, [ClientReport("ok", 1, params=good)], [0.5, 0.5])


# ----------------------------------------------------------------------------- geometry
def test_delta_gram_matches_float64_reference_across_chunks():
    rng = np.random.default_rng(3)
    g = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=5), "n": np.array(3, dtype=np.int64)}
    clients = [
        {"a": g["a"] + rng.normal(size=(4, 3)), "b": g["b"] + rng.normal(size=5), "n": g["n"]}
        for _ in range(3)
    ]
    ref_g = np.concatenate([g["a"].ravel(), g["b"]])
    deltas = np.stack([np.concatenate([c["a"].ravel(), c["b"]]) - ref_g for c in clients])
    for chunk in (1, 4, 7, 1 << 20):  # 1 and 4 split arrays across blocks
        dg = delta_gram(g, clients, ["x", "y", "z"], chunk=chunk)
        assert dg.global_sq == pytest.approx(ref_g @ ref_g, rel=1e-13)
        np.testing.assert_allclose(dg.global_dot, deltas @ ref_g, rtol=1e-12)
        np.testing.assert_allclose(dg.gram, deltas @ deltas.T, rtol=1e-12)
    thetas = deltas + ref_g
    cos_ref = thetas @ ref_g / (np.linalg.norm(thetas, axis=1) * np.linalg.norm(ref_g))
    np.testing.assert_allclose(dg.param_cosines(), cos_ref, rtol=1e-12)


def test_delta_gram_float32_close_to_float64():
    rng = np.random.default_rng(4)
    g64 = {"w": rng.normal(size=20000)}
    c64 = [{"w": g64["w"] + 0.01 * rng.normal(size=20000)} for _ in range(3)]
    g32 = {"w": g64["w"].astype(np.float32)}
    c32 = [{"w": c["w"].astype(np.float32)} for c in c64]
    ref = delta_gram(g32, [{"w": c["w"].astype(np.float64)} for c in c32], "abc")  # same values, float64 math
    fast = delta_gram(g32, c32, "abc")
    np.testing.assert_allclose(fast.gram, ref.gram, rtol=1e-4)
    # 1 - cos is ~1e-4 here; float32 products keep it to 1e-3 relative thanks to the delta decomposition
    np.testing.assert_allclose(1 - fast.param_cosines(), 1 - ref.param_cosines(), rtol=1e-3)


def test_geometry_names_client_with_nonfinite_params():
    g = make_global()
    bad = make_client(g, 0.0, 0.0)
    bad["conv.weight"] = bad["conv.weight"].copy()
    bad["conv.weight"][0, 0] = np.nan
    with pytest.raises(ValueError, match="'nan-site'.*non-finite"):
        delta_gram(g, [make_client(g, 0.1, 0.1), bad], ["ok", "nan-site"])
    with pytest.raises(ValueError, match="'nan-site'.*non-finite"):
        layer_stats(bad, g, name="nan-site")


def test_model_similarity_by_hand():
    g = {"a": np.array([1.0, 0.0]), "b": np.array([2.0])}
    c = {"a": np.array([1.0, 1.0]), "b": np.array([3.0])}
    # params: theta_k = (1, 1, 3), theta_g = (1, 0, 2): cos = 7 / (sqrt(11) sqrt(5))
    assert model_similarity(c, g, "params") == pytest.approx(7 / np.sqrt(55))
    # layer: mean(cos((1,1),(1,0)), cos(3, 2)) = (1/sqrt(2) + 1) / 2
    assert model_similarity(c, g, "layer") == pytest.approx((1 / np.sqrt(2) + 1) / 2)
    # zero-vector convention: cos(0, 0) = 1, cos(0, v) = 0
    z = {"a": np.zeros(2), "b": np.zeros(1)}
    assert model_similarity(z, z, "layer") == 1.0
    assert model_similarity({"a": np.array([1.0, 0.0]), "b": np.zeros(1)}, z, "params") == 0.0


# ----------------------------------------------------------------------------- cross-scheme properties
@pytest.mark.parametrize("name", NAMES)
def test_one_client_gets_weight_one(name):
    g = make_global()
    rep = full_reports(g, [37], [[3, 0, 9]])
    w = get_scheme(name).weights(rep, g, 2, 5)
    np.testing.assert_allclose(w, [1.0], rtol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_identical_clients_get_uniform_weights(name):
    g = make_global()
    params = make_client(g, [[0.1, 0.0], [0.0, 0.2], [-0.1, 0.1]], [0.0, 0.1])
    hist = np.array([4, 1, 7])
    scheme = get_scheme(name)
    scalars = {}
    for other in ("feddraw", "cbr", "dafl", "feddisco"):
        scalars.update(
            get_scheme(other).client_scalars(
                ScalarContext(
                    class_counts=hist,
                    num_samples=20,
                    global_stats=global_stats_of([(hist, 20)] * 3),
                    params=params,
                    global_params=g,
                )
            )
        )
    reps = [ClientReport(f"s{i}", 20, num_steps=4, scalars=dict(scalars), params=params) for i in range(3)]
    for t in (1, 2):
        np.testing.assert_allclose(scheme.weights(reps, g, t, 5), np.full(3, 1 / 3), rtol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trip_gives_identical_next_round(name):
    g = make_global()
    reps = full_reports(g, [10, 40, 25], [[1, 5, 0], [8, 8, 3], [0, 2, 9]])
    reps2 = full_reports(g, [10, 40, 25], [[1, 5, 0], [8, 8, 3], [0, 2, 9]], seed=7)
    a = get_scheme(name)
    a.weights(reps, g, 1, 4)
    b = get_scheme(name)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    np.testing.assert_array_equal(a.weights(reps2, g, 2, 4), b.weights(reps2, g, 2, 4))
    assert json.loads(json.dumps(a.state_dict())) == b.state_dict()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_scheme_names_itself_when_refusing_a_report(name):
    """check_reports' message starts with the scheme's name (the controller logs it next to the site)."""
    scheme = get_scheme(name)
    reports = [ClientReport("site-1", 0), ClientReport("site-2", 10)]
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: client 'site-1': num_samples must be"):
        scheme.weights(reports, None, 1, 3)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "uniform"])
def test_size_weighted_and_uniform_schemes_log_the_size_prior(name):
    """last_details["size_prior"] = N_k / N (also for uniform, whose weights ignore it), replaced per call."""
    scheme = get_scheme(name)
    scheme.weights([ClientReport("a", 1), ClientReport("b", 3), ClientReport("c", 6)], None, 1, 3)
    assert scheme.last_details == {"size_prior": pytest.approx([0.1, 0.3, 0.6], abs=1e-15)}
    scheme.weights([ClientReport("a", 2), ClientReport("b", 2)], None, 2, 3)
    assert scheme.last_details == {"size_prior": pytest.approx([0.5, 0.5], abs=1e-15)}
