"""No single site can crash, stall or capture a round: every bad result excludes only its site, with
the reason, and the round still completes with the others; weights and update norms are bounded."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal as ts

from fedweigh.histograms import META_LENGTH, META_NUM_CONTRIBUTIONS, PlainExchange, statistics_vector
from fedweigh.protocol import META_MIN_SECURE_SUM, META_REFUSED
from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context
from fedweigh.secure.exchange import META_CIPHERTEXT, SecureExchange
from fedweigh.secure.updates import UPDATE_PREFIX, encode_update, pack_chunks, unpack_chunks
from fedweigh.server.encrypted import EncryptedGlobalModel
from fedweigh.server.label_stats import sum_statistics
from fedweigh.server.quorum import secure_sum_quorum, server_floor
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import (
    Safeguards,
    direction_outliers,
    norm_scales,
    objecting_sites,
    params_digest,
    resolve_max_share,
)
from fedweigh.weighting import get_scheme

SITES = ("site-1", "site-2", "site-3", "site-4")


def g0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.normal(0, 0.1, (4, 5)).astype(np.float32), "n": np.array(3, np.int64)}


def honest(site: str, g: dict, scale: float = 0.01) -> dict[str, np.ndarray]:
    """A plausible update: a small step in a direction shared by all sites plus some of its own."""
    rng = np.random.default_rng(sum(map(ord, site)))
    common = np.ones_like(g["w"]) * scale
    return {
        "w": (g["w"] + common + rng.normal(0, scale / 2, g["w"].shape)).astype(np.float32),
        "n": g["n"] + 2,
    }


def result(
    site: str, params, n: int = 100, scalars: dict | None = None, metrics=None, **meta
) -> ClientResult:
    return ClientResult(
        site,
        params,
        {"num_samples": n, "NUM_STEPS_CURRENT_ROUND": 2, "fedweigh_scalars": scalars or {}, **meta},
        metrics if metrics is not None else {"val_auc": 0.6},
    )


def run(scheme: str = "fedavg", results=None, g=None, t: int = 1, step: RoundStep | None = None, **options):
    g = g if g is not None else g0()
    step = step or RoundStep(
        get_scheme(scheme), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards(**options)
    )
    results = results if results is not None else [result(s, honest(s, g)) for s in SITES]
    return step.run(t, results, [r.site for r in results]), step


# --------------------------------------------------------------------------- one bad result, one site out
@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"w": np.full((4, 5), np.nan, np.float32), "n": np.array(5)}, "non-finite"),
        ({"w": np.full((4, 5), np.inf, np.float32), "n": np.array(5)}, "non-finite"),
        ({"w": np.ones((5, 4), np.float32), "n": np.array(5)}, "shape"),
        ({"w": np.ones((4, 5), np.complex64), "n": np.array(5)}, "dtype complex64"),
        ({"w": np.full((4, 5), "x"), "n": np.array(5)}, "dtype <U1"),
        ({"w": np.ones((4, 5), np.int32), "n": np.array(5)}, "dtype int32, the global model holds float32"),
        ({"w": [[1.0, 2.0], [3.0]], "n": np.array(5)}, "not an array"),
    ],
)
def test_a_malformed_parameter_array_excludes_only_its_site(bad, reason):
    g = g0()
    results = [result(s, honest(s, g)) for s in SITES[:3]] + [result("site-4", bad)]
    outcome, _ = run(results=results, g=g)
    assert outcome.updated, outcome.reason
    assert set(outcome.weights) == set(SITES[:3])
    assert set(outcome.excluded) == {"site-4"} and reason in outcome.excluded["site-4"]
    assert "site-4" in outcome.excluded["site-4"]


def test_non_numeric_metrics_and_meta_do_not_fail_the_round():
    g = g0()
    results = [result(s, honest(s, g)) for s in SITES[:2]]
    results.append(
        result("site-3", honest("site-3", g), metrics={"val_auc": "high", "x": [1, 2], "y": 10**400})
    )
    results.append(ClientResult("site-4", honest("site-4", g), ["not", "a", "dict"], "nor this"))
    outcome, _ = run(results=results, g=g)
    assert outcome.updated and set(outcome.weights) == {"site-1", "site-2", "site-3"}
    assert outcome.metrics == {"val_auc": pytest.approx(0.6)}
    assert "meta must be a mapping" in outcome.excluded["site-4"]


@pytest.mark.parametrize(
    "scheme, options, scalar, value",
    [
        ("cbr", {}, "skew", -0.5),
        ("dafl", {"mode": "inverse_imbalance"}, "imbalance", -1.0),
        ("feddisco", {}, "discrepancy", -0.1),
        ("cbr", {}, "skew", "0.5x"),
        ("cbr", {}, "skew", True),
    ],
)
def test_a_scalar_out_of_its_schemes_range_excludes_only_its_site(scheme, options, scalar, value):
    g = g0()
    step = RoundStep(get_scheme(scheme, **options), PlaintextBackend(g), num_rounds=3)
    results = [result(s, honest(s, g), scalars={scalar: 0.5 + i}) for i, s in enumerate(SITES[:3])]
    results.append(result("site-4", honest("site-4", g), scalars={scalar: value}))
    outcome, _ = run(results=results, step=step)
    assert outcome.updated, outcome.reason  # before: the scheme raised and the whole round was lost
    assert set(outcome.excluded) == {"site-4"} and scalar in outcome.excluded["site-4"]


def test_similarity_outside_minus_one_one_is_refused_under_he_plans():
    scheme = get_scheme("feddraw")
    assert scheme.scalar_range("similarity") == (-1.0, 1.0)
    assert scheme.scalar_range("skew") == (0.0, float("inf"))


def test_scalars_nobody_asked_for_are_dropped_unread():
    g = g0()
    results = [result(s, honest(s, g), scalars={"similarity": 1.0, "imbalance": -5.0}) for s in SITES]
    outcome, _ = run(results=results, g=g)
    assert outcome.updated and not outcome.excluded
    assert all(r.scalars == {} for r in outcome.reports)


def test_plaintext_feddraw_computes_the_similarity_itself():
    """A forged similarity of 1.0 changes nothing: the server holds the parameters and computes it
    (the round step drops the unasked scalar, and the scheme itself prefers its own value)."""
    from fedweigh.weighting import ClientReport

    g = g0()
    sites = {s: honest(s, g) for s in SITES}
    sites["site-4"] = {"w": (g["w"] - 0.05).astype(np.float32), "n": g["n"] + 2}  # least similar
    # the parameter cosine, spread by min-max (the literal reading), where a forged 1.0 would matter most
    literal = {"beta_max": 2.0, "similarity": "params", "spread": "minmax", "prior_factor": None}
    weights = []
    for forged in (False, True):
        reports = [
            ClientReport(s, 100, 2, {"similarity": 1.0} if forged and s == "site-4" else {}, p)
            for s, p in sites.items()
        ]
        weights.append(get_scheme("feddraw", **literal).weights(reports, g, 3, 4))
        results = [
            result(s, p, scalars={"similarity": 1.0} if forged and s == "site-4" else {})
            for s, p in sites.items()
        ]
        step = RoundStep(
            get_scheme("feddraw", **literal),
            PlaintextBackend(g),
            num_rounds=4,
            safeguards=Safeguards.off(),
        )
        outcome, _ = run(results=results, step=step, t=3)
        assert list(outcome.weights.values()) == pytest.approx(list(weights[-1]), abs=1e-12)
    assert weights[0] == pytest.approx(weights[1], abs=1e-12)
    assert weights[0][3] < 0.2  # the dissimilar site's weight, which a forged 1.0 would have raised


# --------------------------------------------------------------------------- capture: weight cap
@pytest.mark.parametrize(
    "scheme, options, scalar, forged, honest_value",
    [
        ("dafl", {"mode": "inverse_imbalance"}, "imbalance", 0.0, 20.0),  # uncapped: ~100 %
        ("cbr", {}, "skew", 0.0, 1.0),  # uncapped: ~62 %
    ],
)
def test_a_forged_scalar_takes_at_most_half_the_weight_by_default(
    scheme, options, scalar, forged, honest_value
):
    g = g0()
    results = [result(s, honest(s, g), scalars={scalar: honest_value}) for s in SITES[:3]]
    results.append(result("site-4", honest("site-4", g), scalars={scalar: forged}))

    def weight(**kw):
        step = RoundStep(
            get_scheme(scheme, **options), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards(**kw)
        )
        return run(results=results, step=step)[0].weights["site-4"]

    assert weight(max_share=None) > 0.6  # what the forged scalar would buy without the cap
    assert weight() == pytest.approx(0.5)


def test_the_default_cap_starts_at_three_sites():
    assert resolve_max_share("auto", 2) is None  # with two, any unequal weighting is a majority
    assert resolve_max_share("auto", 3) == 0.5
    assert resolve_max_share(None, 10) is None and resolve_max_share(0.3, 2) == 0.3
    g = g0()
    results = [result(s, honest(s, g), n=10_000_000 if s == "site-1" else 10) for s in SITES]
    outcome, _ = run(results=results, g=g)
    assert outcome.weights["site-1"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- influence: norm bound
def test_a_huge_finite_update_is_scaled_to_the_bound():
    g = g0()
    results = [result(s, honest(s, g)) for s in SITES[:3]]
    results.append(result("site-4", {"w": np.full((4, 5), 1e30, np.float32), "n": g["n"] + 2}))
    free, _ = run(results=results, g=g, update_norm_bound=None, min_update_cosine=None)
    assert np.abs(free.params["w"]).max() > 1e28  # what one site did to the global model before
    outcome, _ = run(results=results, g=g, min_update_cosine=None)
    assert (
        outcome.updated
        and "site-4" in outcome.bounded
        and "above 1 x the largest norm" in outcome.bounded["site-4"]
    )
    honest_norm = max(np.linalg.norm(results[i].params["w"] - g["w"]) for i in range(3))
    moved = np.linalg.norm(outcome.params["w"] - g["w"])
    assert moved <= honest_norm * (1 + 1e-6)  # no update longer than an honest one: a mean of them neither


def test_the_norm_bound_holds_array_by_array():
    """An update may not pour its whole budget into one array: each array has its own bound."""
    g = {"a": np.zeros(100, np.float32), "b": np.zeros(4, np.float32)}
    rng = np.random.default_rng(1)
    results = [
        result(s, {"a": rng.normal(0, 0.1, 100).astype(np.float32), "b": np.full(4, 0.01, np.float32)})
        for s in SITES[:3]
    ]
    attack = {"a": rng.normal(0, 0.1, 100).astype(np.float32), "b": np.full(4, 0.9, np.float32)}
    results.append(result("site-4", attack))  # same total norm as an honest update, all of it in b
    outcome, _ = run(results=results, g=g, min_update_cosine=None)
    assert "1 of 2 arrays" in outcome.bounded["site-4"]
    assert np.abs(outcome.params["b"]).max() < 0.25 * 3 * 0.01 + 0.75 * 0.01 + 1e-6


def test_a_scaled_sign_flipped_update_cannot_undo_the_others():
    g = g0()
    results = [result(s, honest(s, g)) for s in SITES[:3]]
    flipped = {"w": (g["w"] - 100 * (results[0].params["w"] - g["w"])).astype(np.float32), "n": g["n"] + 2}
    results.append(result("site-4", flipped))
    honest_mean = np.mean([r.params["w"] - g["w"] for r in results[:3]], axis=0)
    direction = lambda p: float(np.sum((p["w"] - g["w"]) * honest_mean))  # noqa: E731
    free, _ = run(results=results, g=g, update_norm_bound=None, min_update_cosine=None)
    assert direction(free.params) < 0  # without the checks, the model moves against the honest sites
    bounded, _ = run(results=results, g=g, min_update_cosine=None)
    assert "site-4" in bounded.bounded and "the largest norm" in bounded.bounded["site-4"]
    assert direction(bounded.params) > direction(free.params)  # the norm bound alone limits the damage
    checked, _ = run(results=results, g=g)  # the defaults: it points away from the others, so it is left out
    assert "points away from 3 of the 3 other sites' updates, which agree" in checked.excluded["site-4"]
    assert set(checked.weights) == set(SITES[:3]) and direction(checked.params) > 0


def test_the_direction_check_needs_a_majority_of_the_others():
    # three sites, one flipped: the honest two each object to one of two others (not a majority)
    g = g0()
    results = [result(s, honest(s, g)) for s in SITES[:2]]
    results.append(
        result("site-3", {"w": (g["w"] - (results[0].params["w"] - g["w"])).astype(np.float32), "n": g["n"]})
    )
    outcome, _ = run(results=results, g=g)
    assert set(outcome.excluded) == {"site-3"} and set(outcome.weights) == {"site-1", "site-2"}
    # two sites: no majority to tell who points away, so no check
    outcome, _ = run(results=results[1:], g=g)
    assert not outcome.excluded
    gram = np.array([[1.0, 0.5, -0.5], [0.5, 1.0, -0.5], [-0.5, -0.5, 1.0]])
    assert objecting_sites(gram, 0.0).tolist() == [1, 1, 2]
    assert direction_outliers(gram, 0.0, min_pull=0.5) == [2]  # (a) and (b); the pull apart


def test_updates_scattering_in_all_directions_are_all_kept():
    # late in training honest updates are nearly orthogonal and their cosines fall either side of 0:
    # each site may point away from most others, but the others disagree among themselves too
    gram = np.array(
        [
            [1.0, -0.1, -0.2, 0.1],
            [-0.1, 1.0, 0.05, -0.15],
            [-0.2, 0.05, 1.0, -0.05],
            [0.1, -0.15, -0.05, 1.0],
        ]
    )
    assert (2 * objecting_sites(gram, 0.0) > 3).all()  # the majority rule alone would leave out every site
    assert direction_outliers(gram, 0.0) == []
    rng = np.random.default_rng(3)
    g = {"w": np.zeros(4096, np.float32)}
    results = [result(s, {"w": (0.01 * rng.standard_normal(4096)).astype(np.float32)}) for s in SITES]
    outcome, _ = run(results=results, g=g, update_norm_bound=None)
    assert outcome.updated and not outcome.excluded and set(outcome.weights) == set(SITES)


def test_an_update_opposing_agreeing_others_is_left_out_even_among_scattered_ones():
    # sites 1-3 agree pairwise (cosines > 0); site 4 opposes all three
    gram = np.array(
        [
            [1.0, 0.3, 0.2, -0.4],
            [0.3, 1.0, 0.25, -0.3],
            [0.2, 0.25, 1.0, -0.2],
            [-0.4, -0.3, -0.2, 1.0],
        ]
    )
    assert direction_outliers(gram, 0.0, min_pull=0.5) == [3]  # (a) and (b); the pull apart
    assert (
        direction_outliers(gram, -0.35, min_pull=0.5) == []
    )  # only -0.4 is below -0.35: one of three, no majority


def test_an_update_too_large_to_measure_is_excluded():
    g = {"w": np.zeros(3, np.float64)}
    results = [result(s, {"w": np.full(3, 0.01 * (i + 1))}) for i, s in enumerate(SITES[:3])]
    results.append(result("site-4", {"w": np.full(3, 1e300)}))
    outcome, _ = run(results=results, g=g)
    assert outcome.updated and "too large to measure" in outcome.excluded["site-4"]


def test_norm_scales_are_leave_one_out():
    scales = norm_scales(np.array([1.0, 1.0, 1.2, 100.0]), 3.0)
    assert scales[:3] == pytest.approx([1, 1, 1]) and scales[3] == pytest.approx(3.0 / 100)
    assert norm_scales(np.array([1.0, 50.0]), 3.0) == pytest.approx([1, 3 / 50])  # even with two sites
    assert norm_scales(np.array([7.0]), 3.0) == pytest.approx([1])


# --------------------------------------------------------------------------- replay
def test_a_replayed_result_is_excluded():
    g = g0()
    first, step = run(g=g)
    old = honest("site-2", g)
    g1 = step.backend.task_params()
    results = [result(s, honest(s, g1)) for s in ("site-1", "site-3", "site-4")] + [result("site-2", old)]
    outcome, _ = run(results=results, step=step, t=2)
    assert outcome.updated and "replay of the result it sent in round 1" in outcome.excluded["site-2"]
    assert params_digest(old) == params_digest({k: v.copy() for k, v in old.items()})


def test_a_refusal_is_recorded_with_its_reason():
    g = g0()
    results = [result(s, honest(s, g)) for s in SITES[:3]]
    results.append(ClientResult("site-4", None, {META_REFUSED: "the job sends model updates in clear"}))
    outcome, _ = run(results=results, g=g)
    assert outcome.updated and "refused under its site policy: the job sends" in outcome.excluded["site-4"]


# --------------------------------------------------------------------------- encrypted updates
@pytest.fixture(scope="module")
def contexts():
    secret = make_context()
    public = context_from_bytes(serialize_context(secret, with_secret_key=False), role="server")
    return secret, public


def _he_results(secret, g, sites, bad=None, minimums=None):
    layout_model = EncryptedGlobalModel(
        context_from_bytes(serialize_context(secret, with_secret_key=False)), g
    )
    out = []
    for s in sites:
        sent = encode_update(secret, honest(s, g), g, layout_model.layout)
        if bad is not None and s == bad:
            chunks, clear = unpack_chunks(sent, UPDATE_PREFIX)
            vec = ts.ckks_vector_from(secret, chunks[0])
            values = vec.decrypt()
            chunks[0] = ts.ckks_vector(secret, values, scale=2**30).serialize()  # another CKKS scale
            sent = {**pack_chunks(chunks, UPDATE_PREFIX), **clear}
        meta = {} if minimums is None else {META_MIN_SECURE_SUM: minimums.get(s, 2)}
        out.append(result(s, sent, **meta))
    return out


def test_an_he_chunk_at_another_scale_excludes_only_its_site(contexts):
    secret, public = contexts
    g = g0()
    server = EncryptedGlobalModel(public, g)
    outcome, _ = run(
        results=_he_results(secret, g, SITES, bad="site-2"),
        step=RoundStep(get_scheme("fedavg"), server, num_rounds=2),
    )
    assert outcome.updated, outcome.reason  # before: SEAL's "scale mismatch" lost every round
    assert set(outcome.weights) == {"site-1", "site-3", "site-4"}
    assert "CKKS scale 2^30" in outcome.excluded["site-2"] and "chunk 0" in outcome.excluded["site-2"]


def test_an_encrypted_sum_needs_its_quorum(contexts):
    secret, public = contexts
    g = g0()
    step = RoundStep(
        get_scheme("fedavg"),
        EncryptedGlobalModel(public, g),
        num_rounds=2,
        safeguards=Safeguards(min_secure_sum=3),
    )
    outcome, _ = run(results=_he_results(secret, g, SITES[:2]), step=step)
    assert not outcome.updated and "fewer than the 3" in outcome.reason
    assert step.backend.contributions == 0  # nothing was summed, so nothing can be decrypted
    # a site whose policy asks for more than the round has is left out; the rest go ahead
    step = RoundStep(
        get_scheme("fedavg"),
        EncryptedGlobalModel(public, g),
        num_rounds=2,
        safeguards=Safeguards(min_secure_sum=2),
    )
    results = _he_results(secret, g, SITES, minimums={"site-1": 9})
    outcome, _ = run(results=results, step=step)
    assert outcome.updated and set(outcome.weights) == {"site-2", "site-3", "site-4"}
    assert "at least 9 contributions" in outcome.excluded["site-1"]
    assert step.backend.contributions == 3 and step.backend.meta()["contributions"] == 3


def test_quorum_rules():
    assert server_floor(3, 2) == 2 and server_floor(3, 10) == 3 and server_floor(1, 10) == 2
    q = secure_sum_quorum({"a": 3, "b": 3, "c": 5, "d": 2}, 2)
    assert q.ok and q.members == ["a", "b", "d"] and q.required == 3 and "c" in q.dropped
    q = secure_sum_quorum({"a": 2}, 2)
    assert not q.ok and "1 contribution(s), fewer than the 2" in q.reason
    q = secure_sum_quorum({"a": 2, "b": 2}, 3)
    assert not q.ok


# --------------------------------------------------------------------------- statistics phase
def _plain_payloads(lengths: dict[str, int]) -> dict[str, dict]:
    out = {}
    for i, (site, length) in enumerate(lengths.items()):
        vec = statistics_vector(np.arange(length - 2) + i, 100 + i)
        out[site] = {META_LENGTH: length, **PlainExchange().encode(vec)}
    return out


def test_a_statistics_vector_of_the_wrong_length_excludes_only_its_site():
    payloads = _plain_payloads({"site-1": 16, "site-2": 16, "site-3": 16, "site-4": 9})
    outcome = sum_statistics(PlainExchange(), payloads, 2)
    assert outcome.total is not None and outcome.members == ["site-1", "site-2", "site-3"]
    assert "length 9, the majority of sites send 16" in outcome.excluded["site-4"]
    # no strict majority: nothing is summed, and nothing fails
    outcome = sum_statistics(PlainExchange(), _plain_payloads({"site-1": 16, "site-2": 9}), 2)
    assert outcome.total is None and "no strict majority" in outcome.reason


def test_refusals_and_garbage_in_the_collect_step_are_left_out():
    payloads = _plain_payloads({"site-1": 16, "site-2": 16})
    payloads["site-3"] = {META_REFUSED: "statistics mode 'plain' is not accepted"}
    payloads["site-4"] = ["garbage"]
    payloads["site-5"] = {META_LENGTH: True}
    outcome = sum_statistics(PlainExchange(), payloads, 2)
    assert outcome.members == ["site-1", "site-2"]
    assert "refused the job" in outcome.excluded["site-3"] and "not a mapping" in outcome.excluded["site-4"]
    assert "no valid" in outcome.excluded["site-5"]


def test_the_server_never_sums_one_contribution_and_sites_never_decode_too_few(contexts):
    payloads = _plain_payloads({"site-1": 16, "site-2": 16, "site-3": 16})
    del payloads["site-2"], payloads["site-3"]
    outcome = sum_statistics(PlainExchange(), payloads, 3)
    assert outcome.total is None and "fewer than the 3" in outcome.reason
    # a site announcing min 3 is left out of a sum of two, so the other two must not sum alone either
    two = _plain_payloads({"site-1": 16, "site-2": 16})
    two["site-1"][META_MIN_SECURE_SUM] = 3
    outcome = sum_statistics(PlainExchange(), two, 2)
    assert outcome.total is None and "2 contribution(s), fewer than the 3" in outcome.reason
    # the sites' side: a sum of two is decoded only by a site whose policy accepts two
    total = sum_statistics(PlainExchange(), _plain_payloads({"site-1": 16, "site-2": 16}), 2).total
    assert total[META_NUM_CONTRIBUTIONS] == 2
    PlainExchange(min_contributions=2).decode(total)
    with pytest.raises(ValueError, match="holds 2 contribution.*at least 3"):
        PlainExchange(min_contributions=3).decode(total)


def test_a_ciphertext_at_another_scale_or_level_is_left_out_of_the_secure_sum(contexts):
    secret, public = contexts
    provider = {"client": secret, "server": public}.__getitem__
    client, server = SecureExchange(provider, 3), SecureExchange(provider)
    payloads = {}
    for i, site in enumerate(SITES):
        vec = statistics_vector(np.arange(14) + i, 100 + i)
        payloads[site] = {META_LENGTH: 16, **client.encode(vec)}
    import base64

    slots = ts.ckks_vector_from(secret, base64.b64decode(payloads["site-4"][META_CIPHERTEXT])).decrypt()
    payloads["site-4"][META_CIPHERTEXT] = base64.b64encode(
        ts.ckks_vector(secret, slots, scale=2**35).serialize()
    ).decode()
    level = ts.ckks_vector(secret, slots) * 1.0  # one rescale: another level
    payloads["site-3"][META_CIPHERTEXT] = base64.b64encode(level.serialize()).decode()
    outcome = sum_statistics(server, payloads, 2)
    assert outcome.members == ["site-1", "site-2"], outcome.excluded
    assert "scale 2^35" in outcome.excluded["site-4"] and "level" in outcome.excluded["site-3"]
    with pytest.raises(ValueError, match="at least 3"):  # two contributions: this site's policy wants 3
        client.decode(outcome.total)
    assert SecureExchange(provider, 2).decode(outcome.total)[-2] == pytest.approx(201)
