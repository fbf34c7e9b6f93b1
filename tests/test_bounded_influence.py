"""Bounded influence by construction: no update moves the global model further than an honest site's,
and reported counts or steps buy no weight beyond what the federation can verify (docs/security.md,
"Bounded influence"). Each attack of the suite is applied to synthetic honest updates and goes
through the server's RoundStep with the defaults."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedweigh.bench.attacks import ATTACKS, RoundView, float_keys, make_attack
from fedweigh.errors import ConfigError
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS
from fedweigh.server.declared import (
    DECLARED_SIZES_ENV,
    combine_declarations,
    load_declared_sizes,
    server_declaration,
)
from fedweigh.server.robust import nearest_neighbour_mixing, screen_updates
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import (
    Safeguards,
    auto_colluders,
    norm_reference,
    norm_scales,
    reference_name,
    step_ceiling,
    step_floor,
)
from fedweigh.server.validation import ResultLimits
from fedweigh.weighting import get_scheme

SITES = ("site-1", "site-2", "site-3", "site-4")
DECLARED = dict.fromkeys(SITES, 300)


def global_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.normal(0, 0.1, (8, 1, 3, 3)).astype(np.float32),
        "fc.weight": rng.normal(0, 0.1, (4, 30)).astype(np.float32),
        "fc.bias": np.zeros(4, np.float32),
        "bn.num_batches_tracked": np.array(7, np.int64),
    }


def honest_result(site: str, g: dict, t: int = 1) -> ClientResult:
    """A plausible update: a step shared by all sites plus a part of the site's own."""
    rng = np.random.default_rng([t, SITES.index(site)])
    params = {
        k: (v + 0.01 + rng.normal(0, 0.005, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v + 2
        for k, v in g.items()
    }
    return ClientResult(site, params, {META_NUM_SAMPLES: 300, META_NUM_STEPS: 10, "fedweigh_scalars": {}})


def attacked_round(attack: str, **options):
    """The round with site-4 attacking, and the same round of the three honest sites alone."""
    g = global_model()
    honest = [honest_result(s, g) for s in SITES[:3]]
    view = RoundView(1, g, tuple(honest))
    sent = make_attack(attack).tamper(honest_result("site-4", g), view, np.random.default_rng(0))
    guards = Safeguards(**{"declared_sizes": DECLARED, **options})
    scheme = "fednova" if "steps" in attack else "fedavg"

    def step() -> RoundStep:
        return RoundStep(get_scheme(scheme), PlaintextBackend(g), num_rounds=3, safeguards=guards)

    alone = step().run(1, honest, list(SITES[:3]))
    return step().run(1, [*honest, sent], list(SITES)), alone, g, honest


def array_norm(params: dict, g: dict, key: str) -> float:
    return float(np.linalg.norm(np.asarray(params[key], np.float64) - np.asarray(g[key], np.float64)))


def pulled(outcome, alone, g: dict, honest) -> dict[str, float]:
    """Per array, how far the attacker moved the global model from the honest sites' own aggregate,
    in units of the longest honest update of the array."""
    return {
        key: array_norm(outcome.params, alone.params, key) / max(array_norm(r.params, g, key) for r in honest)
        for key in float_keys(g)
    }


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a != "labelflip"])
def test_no_attack_moves_an_array_further_than_an_honest_update_or_buys_weight(attack):
    """With its declared share w of the weight and its update no longer than an honest one, the
    attacker moves each array at most w (its update) + w (the honest share it displaces) honest
    update lengths from where the honest sites take it: 0.5 of one for one of four."""
    outcome, alone, g, honest = attacked_round(attack)
    assert outcome.updated
    for key in float_keys(g):
        longest = max(array_norm(r.params, g, key) for r in honest)
        assert array_norm(outcome.params, g, key) <= longest * (1 + 1e-5), key
    assert max(pulled(outcome, alone, g, honest).values()) <= 0.5 + 1e-5
    if "site-4" in outcome.weights:  # its declared share of four equal sites, whatever it reports
        assert outcome.weights["site-4"] <= 0.25 + 1e-9


# what removing each bound lets through: the update norm bound back at 3 x the median, no declaration,
# no step floor
@pytest.mark.parametrize("attack", ["model-replacement", "gaussian", "classifier-flip"])
def test_without_the_norm_bound_of_one_an_attacker_pulls_an_array_further(attack):
    outcome, alone, g, honest = attacked_round(attack, min_update_cosine=None, update_norm_bound=3.0)
    assert max(pulled(outcome, alone, g, honest).values()) > 0.5


@pytest.mark.parametrize("attack", ["ipm", "signflip"])
def test_an_update_that_undoes_the_others_is_left_out_and_kept_without_the_direction_check(attack):
    outcome, alone, g, honest = attacked_round(attack)
    assert "site-4" in outcome.excluded and "would undo" in outcome.excluded["site-4"]
    kept, alone, g, honest = attacked_round(attack, min_update_cosine=None)
    assert "site-4" in kept.weights and max(pulled(kept, alone, g, honest).values()) > 0.2


# the attacks whose updates are inside an honest length by design: their bound is the declared weight
@pytest.mark.parametrize("attack", ["alie", "min-max", "min-sum", "ipm", "gaussian", "model-replacement"])
def test_with_a_forged_count_and_no_declaration_an_attacker_pulls_further(attack):
    outcome, alone, g, honest = attacked_round(f"{attack}+forged-count", min_update_cosine=None)
    held = max(pulled(outcome, alone, g, honest).values())
    assert held <= 0.5 + 1e-5 and outcome.weights["site-4"] <= 0.25 + 1e-9  # declared: its share of four
    loose, alone, g, honest = attacked_round(
        f"{attack}+forged-count", min_update_cosine=None, declared_sizes=None
    )
    assert loose.weights["site-4"] == pytest.approx(0.5)  # the cap, and nothing below it
    assert max(pulled(loose, alone, g, honest).values()) > 1.3 * held  # twice the weight


@pytest.mark.parametrize(
    "attack, loosened",
    [
        ("forged-count", {"declared_sizes": None}),
        ("forged-steps", {"limits": ResultLimits(min_step_ratio=None)}),
    ],
)
def test_without_the_declaration_or_the_step_floor_a_forged_count_buys_weight(attack, loosened):
    outcome, _, _, _ = attacked_round(attack, **loosened)
    assert outcome.weights["site-4"] > 0.4


# ---- declared sizes ----------------------------------------------------------------------------
def _count_round(counts: dict[str, int], declared: dict[str, int] | None):
    g = global_model()
    results = []
    for site, n in counts.items():
        r = honest_result(site, g)
        results.append(ClientResult(site, r.params, {**r.meta, META_NUM_SAMPLES: n}))
    step = RoundStep(
        get_scheme("fedavg"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards(
            declared_sizes=declared, update_norm_bound=None, min_update_cosine=None, max_share=None
        ),
    )
    return step.run(1, results, list(counts))


def test_a_count_above_the_declaration_is_clipped_to_it_and_an_undeclared_site_to_the_smallest():
    declared = {"site-1": 100, "site-2": 300, "site-3": 600}
    outcome = _count_round({"site-1": 5000, "site-2": 200, "site-3": 600, "site-4": 900}, declared)
    assert [r.num_samples for r in outcome.reports] == [100, 200, 600, 100]
    assert outcome.bounded["site-1"] == "num_samples=5000 clipped to 100 (its declared size)"
    assert (
        outcome.bounded["site-4"] == "num_samples=900 clipped to 100 (undeclared: the smallest declared size)"
    )
    assert set(outcome.bounded) == {"site-1", "site-4"}  # fewer than declared is the site's own loss
    assert outcome.weights == pytest.approx({"site-1": 0.1, "site-2": 0.2, "site-3": 0.6, "site-4": 0.1})


def test_one_site_alone_is_still_held_to_its_declaration():
    outcome = _count_round({"site-1": 5000}, {"site-1": 100})
    assert outcome.reports[0].num_samples == 100


def test_the_declaration_is_checked_where_it_is_given(tmp_path):
    assert load_declared_sizes({"site-1": 3}, "here") == {"site-1": 3}
    assert load_declared_sizes(None, "here") is None
    for bad, says in [
        ({}, "non-empty JSON object"),
        ({"site-1": 0}, r"declared_sizes\['site-1'\] = 0 is not allowed; a declared size is an integer >= 1"),
        ({"site-1": 2.5}, r"declared_sizes\['site-1'\] = 2.5 is not allowed"),
        ({"site-1": True}, r"declared_sizes\['site-1'\] = True is not allowed"),
        ({"": 3}, "a site name must be a non-empty string"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_declared_sizes(bad, "here")
    path = tmp_path / "sizes.json"
    path.write_text('{"site-1": 30,\n "site-2": }')
    with pytest.raises(ConfigError, match=r"sizes.json' \(str\) is not allowed; not JSON \(line 2, column"):
        load_declared_sizes(str(path), "declared_sizes")
    with pytest.raises(ConfigError, match=r"missing.json' \(str\) is not allowed; cannot read the file"):
        load_declared_sizes(str(tmp_path / "missing.json"), "declared_sizes")
    with pytest.raises(ConfigError, match="round safeguards: declared_sizes = "):
        Safeguards(declared_sizes={"site-1": -1})


def test_the_operators_declaration_bounds_the_jobs(tmp_path):
    path = tmp_path / "declared.json"
    path.write_text(json.dumps({"site-1": 100, "site-2": 200}))
    operator = server_declaration({DECLARED_SIZES_ENV: str(path)})
    assert operator == {"site-1": 100, "site-2": 200} and server_declaration({}) is None
    job = {"site-1": 500, "site-2": 150, "site-3": 50}
    assert combine_declarations(job, operator) == {"site-1": 100, "site-2": 150, "site-3": 50}
    assert combine_declarations(None, None) is None


def test_the_controller_reads_a_declaration_file_only_where_the_server_lets_jobs_read(tmp_path, monkeypatch):
    from fedweigh.flare.controller import FedweighController
    from fedweigh.flare.persistor import SERVER_READ_DIRS_ENV

    path = tmp_path / "declared.json"
    path.write_text(json.dumps({"site-1": 100}))
    controller = FedweighController(declared_sizes=str(path))
    monkeypatch.setenv(SERVER_READ_DIRS_ENV, str(tmp_path))
    assert controller._job_declaration() == {"site-1": 100}
    monkeypatch.setenv(SERVER_READ_DIRS_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(PermissionError, match="declared_sizes="):
        controller._job_declaration()
    assert FedweighController(declared_sizes={"site-1": 7})._job_declaration() == {"site-1": 7}
    with pytest.raises(ConfigError, match="declared_sizes = .* is not allowed; a mapping of site name"):
        FedweighController(declared_sizes=[("site-1", 7)])


# ---- the step floor ----------------------------------------------------------------------------
def honest_federations(epochs: int, cap: int | None, seed: int):
    """500 honest federations of 2 to 8 sites (4 to 250 batches of 16 each): (sizes, steps), each site
    taking tau = E ceil(N / B) steps, or the common cap."""
    rng = np.random.default_rng(seed)
    for _ in range(500):
        sizes = rng.integers(4 * 16, 4000, size=rng.integers(2, 9))
        steps = epochs * np.ceil(sizes / 16)
        yield sizes, (steps if cap is None else np.minimum(steps, cap))


@pytest.mark.parametrize("epochs", [1, 2, 3])
@pytest.mark.parametrize("cap", [None, 20, 50])
def test_the_step_floor_never_raises_an_honest_site(epochs, cap):
    """tau = E ceil(N / B), or a common cap: never below the floor of its size (sites of 4 batches on)."""
    for sizes, steps in honest_federations(epochs, cap, epochs * 100 + (cap or 0)):
        assert (step_floor(steps, sizes, 1.25) <= steps).all()


def test_the_step_floor_holds_a_forged_count_to_an_honest_sites_weight_per_step():
    steps, sizes = np.array([10.0, 10.0, 10.0, 1.0]), np.array([300.0, 300.0, 300.0, 300.0])
    assert step_floor(steps, sizes, 1.25).tolist() == [10.0, 10.0, 10.0, 10.0]  # equal sizes: equal steps
    # forging a small size as well: its floor shrinks with its size, so p_k / tau_k stays bounded
    sizes = np.array([300.0, 300.0, 300.0, 30.0])
    floor = step_floor(np.array([10.0, 10.0, 10.0, 1.0]), sizes, 1.25)
    assert floor[3] == 0.0 or (sizes[3] / floor[3]) <= 1.25 * 300.0 / 10.0
    assert step_floor(np.array([5.0]), np.array([10.0])).tolist() == [0.0]  # one site: nothing to compare


# ---- nearest-neighbour mixing ------------------------------------------------------------------
def test_nearest_neighbour_mixing_is_byzfls_nnm():
    byzfl = pytest.importorskip("byzfl")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 40))
    x[6] *= 20
    for f in (1, 2, 3):
        np.testing.assert_allclose(nearest_neighbour_mixing(x @ x.T, f) @ x, byzfl.NNM(f)(x), atol=1e-12)
    assert (nearest_neighbour_mixing(x @ x.T, 0) == np.eye(7)).all()


def test_mixing_in_the_round_replaces_each_update_by_its_neighbours_mean():
    g = global_model()
    results = [honest_result(s, g) for s in SITES]
    far = dict(results[3].params)
    far["fc.weight"] = far["fc.weight"] + 5.0
    contributions = [r.params for r in results[:3]] + [far]
    screened = screen_updates(Safeguards.off(nnm_f=1), g, list(SITES), contributions)
    # the far update's nearest three are itself and two honest ones: a third of its distance is left
    mixed = np.asarray(screened.contributions[3]["fc.weight"], np.float64)
    assert np.abs(mixed - np.asarray(g["fc.weight"])).max() < 2.0
    # an honest update's three nearest are the three honest ones: their mean
    honest_mean = np.mean([np.asarray(r.params["fc.weight"], np.float64) for r in results[:3]], axis=0)
    np.testing.assert_allclose(screened.contributions[0]["fc.weight"], honest_mean, rtol=1e-6)
    assert screened.contributions[0]["bn.num_batches_tracked"] == results[0].params["bn.num_batches_tracked"]


# ---- the norm reference ------------------------------------------------------------------------
def test_the_reference_is_an_honest_norm_whenever_at_most_f_others_attack():
    """Whatever norms the f attackers among the others send, the (f + 1)-th largest of the others'
    is at most the largest honest one, and with f = 0 an honest update is never scaled by another's."""
    rng = np.random.default_rng(5)
    for _ in range(2000):
        k = int(rng.integers(2, 12))
        f = int(rng.integers(0, k - 1))
        honest = rng.uniform(0.5, 2.0, (k - 1 - f, 3))
        attackers = rng.choice([0.0, 1e-3, 1e3, 1e30], (f, 3))
        others = np.vstack([honest, attackers])
        assert (norm_reference(others, f) <= honest.max(axis=0)).all()
    honest = np.array([1.0, 1.2, 0.8, 1.1])
    assert (norm_scales(honest, 1.0, 0) < 1).sum() == 1  # only the longest, to the second longest
    assert (norm_scales(honest, 1.0, "median") < 1).sum() == 2  # the median rule scales half of them
    assert [auto_colluders(k) for k in (2, 4, 5, 8, 9, 12)] == [0, 0, 1, 1, 2, 2]
    assert (
        reference_name("auto", 4) == "the largest norm"
        and reference_name("auto", 8) == "the 2nd largest norm"
    )
    assert reference_name("median", 8) == "the median"


@pytest.mark.parametrize("epochs", [1, 2, 3])
@pytest.mark.parametrize("cap", [None, 20, 50])
def test_the_step_ceiling_never_clips_an_honest_site(epochs, cap):
    for sizes, steps in honest_federations(epochs, cap, epochs * 1000 + (cap or 0)):
        assert (step_ceiling(steps, sizes, 1.25) >= steps).all()


def test_with_declared_sizes_a_larger_site_may_move_further_and_a_forged_step_count_buys_no_norm():
    # site-1 holds ten times the data and takes ten times the steps: its longer update is honest
    norms = np.array([10.0, 1.0, 1.1, 0.9])
    assert norm_scales(norms, 1.0, 0)[0] < 0.2  # judged against the others' norms alone
    assert norm_scales(norms, 1.0, 0, steps=np.array([100.0, 10, 10, 10]))[0] == 1.0
    # a site of the others' size that reports 100 steps: the ceiling holds it to theirs, and its norm too
    steps, sizes = np.array([10.0, 10, 10, 100]), np.full(4, 300.0)
    held = np.minimum(steps, step_ceiling(steps, sizes, 1.25))
    assert held.tolist() == [10.0, 10.0, 10.0, 10.0]
    forged = np.array([1.0, 1.1, 0.9, 10.0])
    assert norm_scales(forged, 1.0, 0, steps=held)[3] == pytest.approx(1.1 / 10.0)


def test_a_forged_step_count_is_clipped_to_the_ceiling_in_the_round():
    g = global_model()
    results = [honest_result(s, g) for s in SITES[:3]]
    last = honest_result("site-4", g)
    results.append(ClientResult("site-4", last.params, {**last.meta, META_NUM_STEPS: 1000}))
    step = RoundStep(
        get_scheme("fedavg"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards(declared_sizes=DECLARED),
    )
    outcome = step.run(1, results, list(SITES))
    assert (
        "num_steps=1000 clipped to 10 (more than its declared size makes plausible"
        in outcome.bounded["site-4"]
    )
    assert outcome.reports[3].num_steps == 10


def test_a_recipes_declaration_reaches_the_exported_controller(tmp_path):
    """The job's declaration travels in the server's configuration, where NVFlare builds the controller
    from it (a path is read at the server, when the run starts)."""
    import sys as _sys
    from pathlib import Path as _Path

    from fedweigh.flare.recipes import FedDRAWRecipe

    example = _Path(__file__).resolve().parents[1] / "examples" / "byo_feddraw"
    _sys.path.insert(0, str(example))
    try:
        from model import TinyNet
    finally:
        _sys.path.remove(str(example))
    declared = {"site-1": 1200, "site-2": 300}
    recipe = FedDRAWRecipe(
        name="declared",
        min_clients=2,
        train_script=str(example / "train.py"),
        model=TinyNet(),
        declared_sizes=declared,
    )
    recipe.export(str(tmp_path))
    config = json.loads((tmp_path / "declared" / "app" / "config" / "config_fed_server.json").read_text())
    controller = next(c for c in config["workflows"] if c["id"] == "controller")
    assert controller["args"]["declared_sizes"] == declared
    assert controller["args"].get("norm_colluders", "auto") == "auto"  # NVFlare exports non-defaults


def test_with_two_sites_no_length_is_called_the_honest_one():
    """The norm bound needs three updates (as the weight cap): with two, each would be held to the
    other's length, and the larger site of a two-hospital federation to the smaller one's."""
    g = global_model()
    a, b = honest_result("site-1", g), honest_result("site-2", g)
    long = {
        k: (g[k] + 5 * (v - g[k])).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in b.params.items()
    }
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3)
    outcome = step.run(1, [a, ClientResult("site-2", long, b.meta)], ["site-1", "site-2"])
    assert outcome.updated and not outcome.bounded
    three = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3).run(
        1,
        [a, ClientResult("site-2", long, b.meta), honest_result("site-3", g)],
        ["site-1", "site-2", "site-3"],
    )
    assert "site-2" in three.bounded
