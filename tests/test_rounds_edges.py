"""The round step at its edges (``fedweigh.server.rounds``): the plaintext backend's arithmetic, what
the safeguards record of one site, and what the round says of results it refuses (the leave-one-out
search: tests/test_rounds_leave_one_out.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_round_integrity import SITES, result

from fedweigh.server.rounds import PlaintextBackend, RoundOutcome, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.server.validation import ResultLimits
from fedweigh.weighting import get_scheme


def global_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(0, 0.1, (4, 5)).astype(np.float32),
        "b": rng.normal(0, 0.1, 5).astype(np.float32),
        "n": np.array(3, np.int64),
    }


def update(site: str, g: dict, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, site)))
    return {
        k: (v + scale + rng.normal(0, scale / 2, v.shape)).astype(v.dtype)
        if np.issubdtype(v.dtype, np.floating)
        else v + 2
        for k, v in g.items()
    }


def logged_step(g: dict, **options) -> tuple[RoundStep, list[str]]:
    """A uniform-weight round step over ``g`` with ``Safeguards.off(**options)``, and its log."""
    logged: list[str] = []
    step = RoundStep(
        get_scheme("uniform"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards.off(**options),
        log=logged.append,
    )
    return step, logged


# ---- PlaintextBackend --------------------------------------------------------------------------


def test_scale_update_moves_each_array_toward_the_global_model_by_its_factor_in_float64():
    g = global_model()
    backend = PlaintextBackend(g)
    rng = np.random.default_rng(1)
    sent = {
        "w": (g["w"] + rng.normal(0, 3.0, g["w"].shape)).astype(np.float32),
        "b": (g["b"] + rng.normal(0, 3.0, 5)).astype(np.float32),
        "n": np.array(9, np.int64),
    }
    factors = np.array([1.0 / 3.0, 1.0])  # the floating-point arrays in the global model's order: w, b
    out = backend.scale_update(sent, factors)
    g64, c64 = g["w"].astype(np.float64), sent["w"].astype(np.float64)
    expected = (g64 + (1.0 / 3.0) * (c64 - g64)).astype(np.float32)
    assert out["w"].dtype == np.float32
    np.testing.assert_array_equal(out["w"], expected)
    assert out["b"] is sent["b"]  # a factor of 1 leaves the array as it was sent
    assert out["n"] is sent["n"]  # integer buffers are never scaled
    assert sent["w"] is not out["w"] and not np.array_equal(sent["w"], out["w"])  # the input is not changed


def test_scale_update_takes_factors_of_any_shape_one_per_array():
    g = global_model()
    sent = update("site-1", g, scale=1.0)
    flat = PlaintextBackend(g).scale_update(sent, np.array([0.5, 0.25]))
    column = PlaintextBackend(g).scale_update(sent, np.array([[0.5], [0.25]]))
    for key in ("w", "b"):
        np.testing.assert_array_equal(flat[key], column[key])
    with pytest.raises(ValueError):
        PlaintextBackend(g).scale_update(sent, np.array([0.5]))  # one factor for two arrays


def test_aggregate_proposes_and_adopts_the_weighted_mean():
    g = global_model()
    backend = PlaintextBackend(g)
    sent = [update(s, g) for s in SITES[:2]]
    reports = [
        r
        for r, _ in (
            RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=1).validate(result(s, p))
            for s, p in zip(SITES[:2], sent, strict=True)
        )
    ]
    out = backend.aggregate(get_scheme("fedavg"), reports, sent, np.array([0.25, 0.75]))
    expected = g["w"].astype(np.float64) + sum(
        wk * (p["w"].astype(np.float64) - g["w"]) for wk, p in zip((0.25, 0.75), sent, strict=True)
    )
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)
    assert backend.task_params()["w"] is out["w"]  # adopted: the next round starts from it


# ---- what the safeguards record ----------------------------------------------------------------


def test_two_bounds_on_one_site_are_both_recorded_and_logged_as_warnings():
    g = global_model()
    logged: list[str] = []
    step = RoundStep(
        get_scheme("fedavg"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards(max_share=None, min_update_cosine=None),
        log=logged.append,
    )
    sent = {s: update(s, g) for s in SITES}
    sent["site-4"] = update("site-4", g, scale=1.0)  # ~100 x the others' update
    results = [result(s, p, n=100_000 if s == "site-4" else 100) for s, p in sent.items()]  # > 100 x
    outcome = step.run(1, results, list(SITES))
    assert outcome.updated
    record = outcome.bounded["site-4"]
    counts, norms = record.split("; ", 1)
    assert counts.startswith("num_samples=100000 clipped to 10000 ")
    assert norms.startswith("2 of 2 arrays above 1 x the largest norm of the other sites' scaled down to it")
    assert [line for line in logged if "site-4" in line] == [
        f"round 1: site-4: {counts}",
        f"round 1: site-4: {norms}",
    ]


def test_an_outcome_without_params_is_not_updated():
    assert not RoundOutcome(round_index=1).updated
    assert RoundOutcome(round_index=1, params={}).updated


# ---- PlaintextBackend without a global model (stock FedAvg's first round) -------------------------


def test_a_backend_without_a_global_model_starts_from_the_mean_of_the_round_per_array():
    g = global_model()
    sent = [update(s, g, scale=0.5) for s in SITES[:3]]
    backend = PlaintextBackend(None)
    assert backend.global_params is None and backend.task_params() == {}
    checked = [backend.check_params(s, p) for s, p in zip(SITES[:3], sent, strict=True)]
    step = RoundStep(get_scheme("uniform"), PlaintextBackend(g), num_rounds=1)
    reports = [step.validate(result(s, p))[0] for s, p in zip(SITES[:3], sent, strict=True)]
    backend.weigh(get_scheme("uniform"), reports, checked, 1, 1)
    for key in ("w", "b"):  # the element-wise mean over the sites, each array keeping its shape
        expected = np.mean([p[key] for p in sent], axis=0)
        assert backend.global_params[key].shape == g[key].shape
        np.testing.assert_allclose(backend.global_params[key], expected, rtol=1e-6)


def test_a_backend_without_a_global_model_starts_from_one_site_alone_and_proposes_without_weighing():
    g = global_model()
    sent = update("site-1", g, scale=0.5)
    backend = PlaintextBackend(None)
    checked = backend.check_params("site-1", sent)
    report = RoundStep(get_scheme("uniform"), PlaintextBackend(g), num_rounds=1).validate(
        result("site-1", sent)
    )[0]
    out = backend.propose(get_scheme("uniform"), [report], [checked], np.array([1.0]))
    np.testing.assert_allclose(out["w"], sent["w"], rtol=1e-6)  # the mean of one site is the site
    assert backend.global_params is not None  # propose starts the model it proposes from


def test_a_backend_without_a_global_model_checks_later_results_against_the_first_valid_one():
    g = global_model()
    backend = PlaintextBackend(None)
    first = backend.check_params("site-1", update("site-1", g))
    assert set(first) == set(g) and first["w"].shape == g["w"].shape
    wrong = dict(update("site-2", g), w=np.zeros((5, 4), np.float32))  # another shape than site-1's
    with pytest.raises(ValueError, match="site-2"):
        backend.check_params("site-2", wrong)


def test_a_backend_with_a_global_model_checks_every_result_against_it_from_the_first():
    g = global_model()
    wrong = dict(update("site-1", g), w=np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match="site-1"):
        PlaintextBackend(g).check_params("site-1", wrong)


def test_a_stock_fedavg_round_without_a_global_model_runs_with_the_robust_options_on():
    g = global_model()
    sent = {s: update(s, g, scale=0.5) for s in SITES[:3]}
    step = RoundStep(
        get_scheme("fedavg"), PlaintextBackend(None), num_rounds=1, safeguards=Safeguards(clip_norm=1.0)
    )
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(sent))
    assert outcome.updated and set(outcome.weights) == set(sent)
    expected = np.mean([p["w"] for p in sent.values()], axis=0)  # theta_g is their mean, the deltas sum to 0
    np.testing.assert_allclose(outcome.params["w"], expected, rtol=1e-5)
    assert outcome.params["n"].dtype == np.int64 and int(outcome.params["n"]) == 5  # the integer buffer kept


def test_the_mean_a_backend_starts_from_keeps_each_arrays_dtype_and_rounds_integers():
    g = global_model()
    sent = [dict(update(s, g), n=np.array(n, np.int64)) for s, n in zip(SITES[:3], (4, 5, 8), strict=True)]
    backend = PlaintextBackend(None)
    start = backend._start(sent)
    assert start["w"].dtype == np.float32 and start["n"].dtype == np.int64
    assert int(start["n"]) == 6  # round(17 / 3), not its integer part


def test_the_mean_a_backend_starts_from_is_taken_in_float64():
    big = [{"w": np.full(3, 3e38, np.float32)} for _ in range(2)]  # their float32 sum overflows
    start = PlaintextBackend(None)._start(big)
    assert start["w"].dtype == np.float32 and np.all(start["w"] == np.float32(3e38))


def test_a_proposal_the_backend_cannot_make_is_the_reason_the_round_leaves_the_model():
    class Refusing(PlaintextBackend):
        def propose(self, scheme, reports, contributions, weights):
            raise ValueError("no aggregate of these updates")

    g = global_model()
    step = RoundStep(get_scheme("fedavg"), Refusing(g), num_rounds=3, log=lambda _: None)
    outcome = step.run(1, [result(s, update(s, g)) for s in SITES[:3]])
    assert not outcome.updated
    assert outcome.reason == (
        "the aggregate fails the server's check (no aggregate of these updates) and leaving out any one "
        "site does not mend it"
    )


def test_scale_update_keeps_the_shape_of_a_0d_floating_array():
    g = dict(global_model(), s=np.array(0.5, np.float32))
    sent = dict(update("site-1", g, scale=1.0), s=np.array(2.5, np.float32))
    out = PlaintextBackend(g).scale_update(sent, np.array([[1.0], [1.0], [0.5]]))  # w, b, s
    assert out["s"].shape == () and float(out["s"]) == pytest.approx(1.5)


def test_validate_without_a_round_admits_the_result_as_round_0():
    g = global_model()
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3)
    sent = update("site-1", g)
    step.validate(result("site-1", sent))
    with pytest.raises(ValueError, match="replay of the result it sent in round 0$"):
        step.validate(result("site-1", sent), 2)


def test_an_invalid_result_is_refused_naming_its_site():
    g = global_model()
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3)
    bad = result("site-3", update("site-3", g), n=-5)
    with pytest.raises(ValueError, match=r"^site-3: "):
        step.validate(bad, 1)


# ---- the count bound ---------------------------------------------------------------------------


def count_step(**options) -> tuple[RoundStep, dict]:
    g = global_model()
    step = RoundStep(
        get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards.off(**options)
    )
    return step, {s: update(s, g) for s in SITES}


def test_two_sites_are_enough_for_the_count_bound():
    step, sent = count_step()
    outcome = step.run(
        1, [result("site-1", sent["site-1"], n=50), result("site-2", sent["site-2"], n=50_000)]
    )
    assert outcome.bounded == {
        "site-2": "num_samples=50000 clipped to 5000 (at most 100 x the median of the other sites')"
    }
    assert [r.num_samples for r in outcome.reports] == [50, 5000]


def test_the_count_bound_off_leaves_every_count_as_reported():
    from fedweigh.server.safeguards import ResultLimits

    step, sent = count_step(limits=ResultLimits(max_count_ratio=None))
    outcome = step.run(1, [result(s, p, n=50_000 if s == "site-2" else 50) for s, p in sent.items()])
    assert outcome.bounded == {}
    assert [r.num_samples for r in outcome.reports] == [50, 50_000, 50, 50]


def test_one_sample_and_one_step_are_plausible_counts():
    step, sent = count_step()
    outcome = step.run(1, [result(s, p, n=1, steps=1) for s, p in sent.items()])
    assert outcome.bounded == {} and [(r.num_samples, r.num_steps) for r in outcome.reports] == [(1, 1)] * 4


def test_steps_are_bounded_from_below_and_both_counts_of_one_site_are_recorded_together():
    step, sent = count_step(limits=ResultLimits(min_step_ratio=None))  # the ratio bound alone
    counts = {"site-1": (100, 400), "site-2": (100, 400), "site-3": (100, 400), "site-4": (100_000, 1)}
    outcome = step.run(1, [result(s, sent[s], n=n, steps=k) for s, (n, k) in counts.items()])
    assert outcome.bounded == {
        "site-4": "num_samples=100000 clipped to 10000 (at most 100 x the median of the other sites'); "
        "num_steps=1 clipped to 4 (within 100 x the median of the other sites', either way)"
    }
    assert (outcome.reports[3].num_samples, outcome.reports[3].num_steps) == (10_000, 4)


def test_steps_far_above_the_others_are_bounded_from_above():
    step, sent = count_step()
    outcome = step.run(1, [result(s, p, steps=10_000 if s == "site-1" else 2) for s, p in sent.items()])
    assert outcome.bounded == {
        "site-1": "num_steps=10000 clipped to 200 (within 100 x the median of the other sites', either way)"
    }
    assert outcome.reports[0].num_steps == 200


# ---- the norm bound's record -------------------------------------------------------------------


def test_the_norm_bound_record_gives_the_norms_of_the_arrays_it_scaled_and_of_the_whole_update():
    g = global_model()
    step, logged = logged_step(g, update_norm_bound=3.0, norm_colluders="median")
    sent = {s: update(s, g) for s in SITES}
    big = dict(sent["site-4"])
    big["w"] = (g["w"] + 20 * (sent["site-4"]["w"] - g["w"])).astype(np.float32)  # only w far above
    sent["site-4"] = big
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))

    def norms(p):  # independent of the round step: float64 norms of each array's update
        return np.array([np.linalg.norm(p[k].astype(np.float64) - g[k]) for k in ("w", "b")])

    rows = np.array([norms(sent[s]) for s in SITES])
    limit = 3.0 * np.median(rows[:3, 0])
    assert rows[3, 0] > limit and rows[3, 1] < 3.0 * np.median(rows[:3, 1])  # the precondition
    after = np.array([limit, rows[3, 1]])
    expected = (
        f"1 of 2 arrays above 3 x the median of the other sites' scaled down to it (their norm "
        f"{rows[3, 0]:.4g} -> {limit:.4g}; update norm {np.linalg.norm(rows[3]):.6g} -> {np.linalg.norm(after):.6g})"
    )
    assert outcome.bounded == {"site-4": expected}
    assert f"round 1: site-4: {expected}" in logged


def test_an_update_whose_norm_overflows_float64_is_left_out_with_a_logged_reason():
    g = {"w": np.zeros((4, 5)), "b": np.zeros(5)}  # float64 arrays can hold updates beyond any norm
    step, logged = logged_step(g, update_norm_bound=3.0)
    sent = {s: {k: v + 0.01 for k, v in g.items()} for s in SITES}
    sent["site-2"] = {k: np.full_like(v, 1.5e308) for k, v in g.items()}
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    why = "site-2: its update is too large to measure (norm overflows float64)"
    assert outcome.excluded == {"site-2": why}
    assert f"round 1: skipping result: {why}" in logged
    assert outcome.updated and set(outcome.weights) == {"site-1", "site-3", "site-4"}


# ---- the direction check on updates too large to measure ---------------------------------------


def test_updates_whose_inner_products_overflow_are_left_out_and_the_rest_is_no_majority():
    g = {"w": np.zeros((4, 5)), "b": np.zeros(5)}
    step, logged = logged_step(g, min_update_cosine=0.0)
    sent = {s: {k: v + 0.01 for k, v in g.items()} for s in SITES[:3]}
    for site in ("site-2", "site-3"):  # finite norms (~4.5e200), an infinite <Delta, Delta>
        sent[site] = {k: np.full_like(v, 1e200) for k, v in g.items()}
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(sent))
    for site in ("site-2", "site-3"):
        why = f"{site}: its update is too large to measure (overflows float64)"
        assert outcome.excluded[site] == why
        assert f"round 1: skipping result: {why}" in logged
    assert not outcome.updated
    assert (
        outcome.reason == "the safeguards left out 2 of 3 valid result(s); 1 remain, not a majority of them"
    )
    assert logged[-1] == f"round 1: {outcome.reason}; the global model is left unchanged"


def test_an_update_pointing_away_from_the_others_is_left_out_with_a_logged_reason():
    g = global_model()
    step, logged = logged_step(g, min_update_cosine=0.0)
    sent = {s: update(s, g) for s in SITES}
    sent["site-1"] = {k: (3 * g[k] - 2 * v).astype(v.dtype) for k, v in sent["site-1"].items()}  # reversed x2
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    assert list(outcome.excluded) == ["site-1"]
    why = outcome.excluded["site-1"]
    assert why.startswith("site-1: its update points away from 3 of the 3 other sites' updates")
    assert f"round 1: skipping result: {why}" in logged
    assert "round 1: aggregating the 3 remaining of 4 valid results (1 left out by the safeguards)" in logged


# ---- the robust screening's record --------------------------------------------------------------


def test_a_site_bounded_by_the_norm_bound_and_the_clip_keeps_both_notes_and_each_is_logged():
    g = global_model()
    step, logged = logged_step(g, update_norm_bound=3.0, clip_norm=0.05, norm_colluders="median")
    sent = {s: update(s, g) for s in SITES}
    sent["site-4"] = update("site-4", g, scale=1.0)
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    norm_note, clip_note = outcome.bounded["site-4"].rsplit("; ", 1)
    assert norm_note.startswith("2 of 2 arrays above 3 x the median") and norm_note.count("; ") == 1
    assert re.fullmatch(r"update norm [0-9.e+-]+ clipped to clip_norm=0\.05", clip_note)
    assert f"round 1: site-4: {clip_note}" in logged
    assert outcome.bounded["site-1"].startswith("update norm ")  # every update here is above 0.05


def test_multi_krum_logs_the_sites_it_leaves_out():
    g = global_model()
    step, logged = logged_step(g, krum_f=1)
    sent = {s: update(s, g) for s in SITES}
    sent["site-3"] = update("site-3", g, scale=0.5)
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    assert list(outcome.excluded) == ["site-3"]
    assert f"round 1: skipping result: {outcome.excluded['site-3']}" in logged


# ---- what the round says of sites that sent nothing ---------------------------------------------


def test_a_site_asked_that_sent_no_result_is_named_and_logged():
    g = global_model()
    logged: list[str] = []
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, log=logged.append)
    outcome = step.run(2, [result(s, update(s, g)) for s in SITES[:3]], list(SITES))
    assert outcome.excluded == {"site-4": "no result (failed, or no answer within train_timeout)"}
    assert "round 2: site-4 sent no valid result in time; left out of this round" in logged


def test_a_second_result_of_one_site_is_refused_with_its_reason():
    g = global_model()
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, log=lambda _: None)
    outcome = step.run(1, [result("site-1", update("site-1", g)), result("site-1", update("site-2", g))])
    assert outcome.excluded == {"site-1": "site-1: sent more than one result this round"}


def test_a_refused_metric_name_is_logged_with_the_round():
    g = global_model()
    logged: list[str] = []
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, log=logged.append)
    step.run(3, [result(s, update(s, g), metrics={"weights": 1.0}) for s in SITES[:2]], list(SITES[:2]))
    assert (
        "round 3: site-1: metric 'weights' is refused: the name is reserved for the server's record" in logged
    )


# ---- the plaintext backend's pairing of reports and contributions --------------------------------


def test_weigh_and_propose_refuse_reports_and_contributions_of_different_lengths():
    g = global_model()
    sent = [update(s, g) for s in SITES[:2]]
    step = RoundStep(get_scheme("uniform"), PlaintextBackend(g), num_rounds=1)
    reports = [step.validate(result(s, p))[0] for s, p in zip(SITES[:2], sent, strict=True)]
    backend = PlaintextBackend(g)
    with pytest.raises(ValueError):
        backend.weigh(get_scheme("uniform"), reports[:1], sent, 1, 1)
    with pytest.raises(ValueError):
        backend.propose(get_scheme("uniform"), reports[:1], sent, np.array([1.0]))


# ---- when a scaled update is logged as a warning -------------------------------------------------


class GivenNorms(PlaintextBackend):
    """A plaintext backend that reports the update norms it was given (one array per update)."""

    def __init__(self, global_params, norms):
        super().__init__(global_params)
        self.norms = np.asarray(norms, dtype=np.float64)

    def update_norms(self, contributions):
        return self.norms


def test_an_update_scaled_by_exactly_scaled_report_is_recorded_but_not_warned_about():
    from fedweigh.server.rounds import SCALED_REPORT

    g = {"w": np.zeros(3)}
    logged: list[str] = []
    # site-1's norm 1.0 against the others' median 0.33: the bound 3 x 0.33 = 0.99 = (1 - SCALED_REPORT) x 1.0
    assert 3.0 * 0.33 == 1.0 - SCALED_REPORT
    step = RoundStep(
        get_scheme("uniform"),
        GivenNorms(g, [[1.0], [0.33], [0.33]]),
        num_rounds=3,
        safeguards=Safeguards.off(update_norm_bound=3.0),
        log=logged.append,
    )
    outcome = step.run(1, [result(s, {"w": np.full(3, 0.1 * (i + 1))}) for i, s in enumerate(SITES[:3])])
    assert list(outcome.bounded) == ["site-1"] and "update norm 1 -> 0.99" in outcome.bounded["site-1"]
    assert not any("site-1" in line for line in logged)  # a trim of exactly 1% goes to the info log only


def test_an_update_too_large_to_measure_counts_as_pointing_nowhere_when_the_others_are_judged():
    rng = np.random.default_rng(0)
    g = {"w": np.zeros(20)}
    sent = {s: {"w": 0.01 + rng.normal(0, 0.002, 20)} for s in SITES[:3]}
    sent["site-3"] = {"w": -2 * sent["site-3"]["w"]}  # reversed, twice as long
    sent["site-4"] = {"w": np.full(20, 1e200)}  # <Delta, Delta> overflows float64
    step = RoundStep(
        get_scheme("uniform"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards.off(min_update_cosine=0.0),
        log=lambda _: None,
    )
    outcome = step.run(1, [result(s, p) for s, p in sent.items()])
    assert set(outcome.excluded) == {"site-3", "site-4"}
    # site-3 points away from site-1 and site-2; site-4's update, unmeasurable, objects to nothing
    assert outcome.excluded["site-3"].startswith(
        "site-3: its update points away from 2 of the 3 other sites'"
    )
