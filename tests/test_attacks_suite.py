"""The attack suite (fedweigh.bench.attacks): each attack alters what the attacker sends as its paper
or ByzFL defines it, and a run goes through the shipped round loop, where the server's round step
and recorder see the attacker's result like any site's."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from fedweigh.bench import attacks as A
from fedweigh.bench.attacks import (
    ATTACKS,
    AttackRecord,
    RoundView,
    TamperingSites,
    attacker_sites,
    flipped_site,
    make_attack,
    run_attack,
    summarise,
    summary_line,
)
from fedweigh.bench.federations import federation_for
from fedweigh.data.base import LabeledImages, SiteData
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS
from fedweigh.server.loop import TrainTask
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import ClientResult, RoundStep

KEYS = ("net.features.conv0.weight", "net.class_layers.out.weight", "net.class_layers.out.bias")


def _params(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {
        KEYS[0]: (scale * rng.normal(size=(3, 2, 2))).astype(np.float32),
        KEYS[1]: (scale * rng.normal(size=(4, 5))).astype(np.float32),
        KEYS[2]: (scale * rng.normal(size=4)).astype(np.float32),
        "net.features.norm0.num_batches_tracked": np.array(7, dtype=np.int64),
    }


def _round(honest: int = 3):
    """theta_g, the honest sites' results (theta_g + a small update each), the attacker's honest result."""
    rng = np.random.default_rng(0)
    g = _params(rng)

    def result(site: str) -> ClientResult:
        step = _params(rng, 0.1)
        params = {k: (g[k] + step[k]).astype(g[k].dtype) if g[k].dtype.kind == "f" else g[k] for k in g}
        return ClientResult(site, params, {META_NUM_SAMPLES: 54, META_NUM_STEPS: 2}, {"val_auc": 0.6})

    others = tuple(result(f"site-{i}") for i in range(1, honest + 1))
    return g, RoundView(1, g, others), result(f"site-{honest + 1}")


def _flat(params, g) -> np.ndarray:
    return A.flat_update(params, g, A.float_keys(g))


def _honest(view: RoundView) -> np.ndarray:
    return view.honest_updates(A.float_keys(view.global_params))


def _sent(attack: str, seed: int = 1):
    g, view, own = _round()
    out = make_attack(attack).tamper(own, view, np.random.default_rng(seed))
    return g, view, own, out


def test_the_registry_holds_every_attack_of_the_suite():
    assert set(ATTACKS) == {
        "alie",
        "ipm",
        "signflip",
        "gaussian",
        "labelflip",
        "model-replacement",
        "min-max",
        "min-sum",
        "classifier-flip",
        "forged-count",
        "forged-steps",
        "nan",
        "inf",
        "wrong-dtype",
        "wrong-shape",
        "huge",
        "replay",
        "he-add-0.1",
        "he-add-1",
        "he-check-slot",
    }
    assert all(make_attack(a).name == a for a, _ in A.SUITE if "+" not in a)
    assert all(make_attack(a).name == a for a in ATTACKS)
    with pytest.raises(ValueError, match=r"unknown attack\(s\) \['nope'\].*known: alie"):
        make_attack("alie+nope")


def test_alie_sends_the_honest_mean_plus_tau_std():
    g, view, own, out = _sent("alie")
    h = _honest(view)
    np.testing.assert_allclose(_flat(out.params, g), h.mean(0) + 1.5 * h.std(0, ddof=1), atol=1e-6)
    # only floating-point arrays are attacked, each in the dtype the site sent
    assert out.params["net.features.norm0.num_batches_tracked"] == 7
    assert all(out.params[k].dtype == own.params[k].dtype for k in own.params)
    assert out.meta == own.meta


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
    g, view, _, out = _sent("ipm")
    np.testing.assert_allclose(_flat(out.params, g), -2.0 * _honest(view).mean(0), atol=1e-6)


def test_sign_flipping_sends_the_negated_honest_mean():
    g, view, _, out = _sent("signflip")
    np.testing.assert_allclose(_flat(out.params, g), -_honest(view).mean(0), atol=1e-6)


def test_gaussian_sends_seeded_unit_noise_and_leaves_numpy_global_state_alone():
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    g, view, own, out = _sent("gaussian", seed=5)
    assert np.array_equal(np.random.get_state()[1], before)
    delta = _flat(out.params, g)
    assert abs(float(delta.std()) - 1.0) < 0.35  # N(0, 1) per coordinate (37 of them)
    assert not np.allclose(delta, _flat(own.params, g))
    np.testing.assert_array_equal(_flat(_sent("gaussian", seed=5)[3].params, g), delta)  # reproducible
    assert not np.allclose(_flat(_sent("gaussian", seed=6)[3].params, g), delta)


def test_label_flipping_trains_on_flipped_labels_and_sends_that_update():
    attack = make_attack("labelflip")
    assert attack.flips_labels
    _, view, own = _round()
    assert attack.tamper(own, view, np.random.default_rng(0)) is own
    labels = np.array([[1, 0, 0], [0, 1, 1]], dtype=np.float32)
    images = np.zeros((2, 1, 4, 4), dtype=np.float32)
    multi = LabeledImages(images, labels, ("a", "b", "c"), "multilabel")
    site = SiteData("site-4", multi, multi)
    np.testing.assert_array_equal(flipped_site(site).train.labels, 1.0 - labels)
    classes = LabeledImages(images, np.array([0, 2]), ("a", "b", "c"), "multiclass")
    np.testing.assert_array_equal(flipped_site(SiteData("s", classes, classes)).train.labels, [2, 0])


def test_model_replacement_boosts_the_flipped_update_four_times():
    attack = make_attack("model-replacement")
    assert attack.flips_labels
    g, _, own, out = _sent("model-replacement")
    np.testing.assert_allclose(_flat(out.params, g), 4.0 * _flat(own.params, g), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("objective", ["min-max", "min-sum"])
def test_min_max_and_min_sum_take_the_largest_gamma_their_bound_allows(objective):
    g, view, _, out = _sent(objective)
    h = _honest(view)
    mu, p = h.mean(0), -h.std(0, ddof=1)
    m = _flat(out.params, g)
    gamma = float(np.dot(m - mu, p) / np.dot(p, p))
    np.testing.assert_allclose(m, mu + gamma * p, atol=1e-5)  # on the line mean - gamma * std
    pair = np.linalg.norm(h[:, None] - h[None], axis=2)

    def fits(x: np.ndarray) -> bool:
        d = np.linalg.norm(h - x, axis=1)
        if objective == "min-max":
            return d.max() <= pair.max() + 1e-9
        return (d**2).sum() <= (pair**2).sum(axis=1).max() + 1e-9

    assert gamma > 0.1 and fits(m)
    assert not fits(mu + (gamma + 1e-3) * p)  # the largest gamma within the bound


def test_classifier_flip_negates_only_the_classifier_at_2_9_times_its_update():
    g, _, own, out = _sent("classifier-flip")
    head = ["net.class_layers.out.weight", "net.class_layers.out.bias"]
    assert A.classifier_keys(g) == head
    np.testing.assert_allclose(
        A.flat_update(out.params, g, head), -2.9 * A.flat_update(own.params, g, head), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(out.params[KEYS[0]], own.params[KEYS[0]])


def test_forged_count_and_steps_change_only_the_meta_the_weights_read():
    _, _, own, out = _sent("forged-count")
    assert out.meta[META_NUM_SAMPLES] == 1000 * 54 and out.params is own.params
    _, _, own, out = _sent("forged-steps")
    assert out.meta[META_NUM_STEPS] == 1 and out.meta[META_NUM_SAMPLES] == 54
    both = make_attack("labelflip+forged-count")
    assert both.flips_labels and both.name == "labelflip+forged-count"


def test_attackers_are_the_last_sites_and_at_most_half():
    names = [f"site-{i}" for i in range(1, 9)]
    assert attacker_sites(names, 2) == ["site-7", "site-8"]
    assert attacker_sites(names[:4], 1) == ["site-4"]
    with pytest.raises(ValueError, match="3 attacker"):
        attacker_sites(names[:4], 3)


def test_an_attack_that_reads_honest_updates_needs_two_of_them():
    g, view, own = _round(honest=1)
    with pytest.raises(ValueError, match="1 honest result"):
        make_attack("alie").tamper(own, view, np.random.default_rng(0))


def test_the_transport_alters_only_the_attackers_with_the_honest_results_in_view():
    g, view, own = _round()
    colluder = replace(view.honest[-1], site="site-5")
    results = [*view.honest, own, colluder]
    transport = TamperingSites(None, dict, make_attack("signflip"), ["site-4", "site-5"], seed=0)  # type: ignore[arg-type]
    task = TrainTask(1, 2, [r.site for r in results], g, {"he": False}, {})
    out = {r.site: r for r in transport.tamper(task, results)}
    honest = _honest(view)  # site-1..3; the colluder site-5 (a copy of site-3's result) is not honest
    for site in ("site-4", "site-5"):
        np.testing.assert_allclose(_flat(out[site].params, g), -honest.mean(0), atol=1e-6)
        assert transport.sent[1][site] is out[site]
    assert all(out[r.site] is r for r in view.honest)


def test_a_run_goes_through_run_rounds_and_the_round_step_sees_the_forged_result(monkeypatch):
    """The forged count reaches the round step through the path of an honest result: validated by
    RoundStep.validate like the others, clipped, capped, and on the recorder's rows."""
    validated: list[tuple[int, str, object]] = []
    stepped: list[list[ClientResult]] = []
    validate, run = RoundStep.validate, RoundStep.run

    def spy_validate(self, result, round_index=0):
        validated.append((round_index, result.site, result))
        return validate(self, result, round_index)

    def spy_run(self, round_index, results, targets=()):
        stepped.append(list(results))
        return run(self, round_index, results, targets)

    monkeypatch.setattr(RoundStep, "validate", spy_validate)
    monkeypatch.setattr(RoundStep, "run", spy_run)
    transports: list = []
    labels: dict[str, np.ndarray] = {}

    def seen(transport) -> None:  # the trainers the rounds will drive (closed after the run)
        transports.append(transport)
        labels.update({n: t.site.train.labels.copy() for n, t in transport.sites.trainers.items()})

    recorder = RoundRecorder(None, "fedavg")
    record = run_attack(
        "labelflip+forged-count",
        sites=4,
        rounds=2,
        settings="smoke",
        clean_auc=0.5,
        recorder=recorder,
        on_transport=seen,
    )
    (transport,) = transports
    assert isinstance(transport, TamperingSites) and record.attackers == ["site-4"]
    assert not record.crashed_or_stalled, record.error
    assert sorted(transport.sent) == [1, 2]
    # the attacker trains on flipped labels (its own data, every label flipped), the others on theirs
    fed = federation_for(A.attack_config(4, settings="smoke", rounds=2), "iid-4", 0)
    for site in fed.sites:
        flip = site.name == "site-4"
        np.testing.assert_array_equal(
            labels[site.name], 1.0 - site.train.labels if flip else site.train.labels
        )
    trained = [r for r in recorder.rows if r.get("round", 0) >= 1 and "global_updated" in r]
    assert [r["round"] for r in trained] == [1, 2]
    for t, row in zip((1, 2), trained, strict=True):
        sent = transport.sent[t]["site-4"]
        # (b) the attacker's result object itself is handed to the round step and validated there,
        # in the same list and by the same call as the honest sites' results
        (results,) = [rs for rs in stepped if any(r is sent for r in rs)]
        assert sorted(r.site for r in results) == ["site-1", "site-2", "site-3", "site-4"]
        assert [s for rt, s, _ in validated if rt == t] == ["site-1", "site-2", "site-3", "site-4"]
        assert any(r is sent for rt, _, r in validated if rt == t)
        honest = next(r for r in results if r.site == "site-1").meta[META_NUM_SAMPLES]
        assert sent.meta[META_NUM_SAMPLES] == 1000 * honest
        # (a) the recorder holds what the server did with it: the count clipped to its declared size,
        # so its weight is its true share
        assert (
            f"num_samples={sent.meta[META_NUM_SAMPLES]} clipped to {honest} (its declared size)"
            in (row["bounded"]["site-4"])
        )
        assert row["weights"]["site-4"] == pytest.approx(0.25)
    assert sorted(record.bounded) == ["1", "2"] and all("site-4" in v for v in record.bounded.values())
    assert record.attacker_max_weight == pytest.approx(0.25)
    assert np.isfinite(record.auc) and record.drop == pytest.approx(0.5 - record.auc)


def _record(attack: str, sites: int, attackers: int, drop: float, seed: int = 0, **kw) -> AttackRecord:
    names = [f"site-{sites - i}" for i in range(attackers)]
    return AttackRecord(attack, names, sites, "fedavg", "deploy", 2, seed, "smoke", drop=drop, **kw)


def test_the_summary_line_takes_the_worst_mean_drop_of_each_group():
    records = [
        _record("alie", 4, 1, 0.02, seed=0),
        _record("alie", 4, 1, 0.06, seed=1),  # mean 0.04
        _record("ipm", 4, 1, 0.05),
        _record("ipm", 8, 1, 0.01),
        _record("ipm", 8, 2, 0.03),
        _record("min-sum", 8, 2, float("nan"), crashed=True),
        _record("signflip", 4, 2, 0.9),  # two of four: in the JSON, not on the line
    ]
    summary = summarise(records)
    assert summary_line(summary) == (
        "attacks: 7 tried, 1 crashed or stalled, worst AUC drop 0.0500 (one of 4), 0.0100 (one of 8), "
        "0.0300 (two of 8), not run (HE)"
    )
    assert summary_line(summarise([_record("alie", 4, 1, 0.01, stalled=[2])])) == (
        "attacks: 1 tried, 1 crashed or stalled, worst AUC drop 0.0100 (one of 4), n/a (one of 8), "
        "n/a (two of 8), not run (HE)"
    )


def test_the_suite_runner_prints_the_summary_last_and_writes_its_runs(tmp_path, capsys):
    out = tmp_path / "attacks.json"
    argv = ["--rounds", "2", "--seeds", "0", "--sites", "4", "--colluders", "1"]
    code = A.main([*argv, "--settings", "smoke", "--attacks", "forged-count", "--out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"attacks: 1 tried, 0 crashed or stalled, worst AUC drop -?\d\.\d{4} \(one of 4\), n/a \(one of 8\), "
        r"n/a \(two of 8\), not run \(HE\)",
        last,
    ), last
    assert code == 0
    body = json.loads(out.read_text())
    assert body["complete"] and summary_line(body["summary"]) == last
    (run,) = body["runs"]
    assert run["attack"] == "forged-count" and run["attackers"] == ["site-4"] and run["rounds"] == 2
    assert sorted(run["bounded"]) == ["1", "2"] and all("site-4" in v for v in run["bounded"].values())


@pytest.mark.parametrize(
    "attack, scheme, defended, undefended, bought",
    [
        # the consortium's declaration of sizes: a forged count buys no weight (without it: the cap)
        ("forged-count", "fedavg", "deploy", "undeclared", 0.5),
        # the step floor: a forged step count of 1 against 2 buys FedNova no weight (without it:
        # twice the others' weight each, (1 / 1) / (3 / 2 + 1 / 1))
        ("forged-steps", "fednova", "deploy", "before", 0.4),
    ],
)
def test_a_forged_count_buys_weight_only_without_its_defence(attack, scheme, defended, undefended, bought):
    held = run_attack(attack, scheme=scheme, rounds=2, settings="smoke", clean_auc=0.5, safeguards=defended)
    assert held.attacker_max_weight == pytest.approx(0.25, abs=0.02)  # its true share of four
    open_ = run_attack(
        attack, scheme=scheme, rounds=2, settings="smoke", clean_auc=0.5, safeguards=undefended
    )
    assert open_.attacker_max_weight == pytest.approx(bought)


def test_under_he_the_round_step_sees_ciphertext_and_the_sites_guards_judge_the_sum(monkeypatch):
    """An HE run goes through run_rounds with the server's EncryptedGlobalModel: every result it
    validates holds ciphertext for every floating-point array; a forged check slot makes every site
    refuse the sum it decrypts (recorded per round)."""
    from fedweigh.bench.he_sites import EncryptedInProcessSites
    from fedweigh.secure.updates import UPDATE_PREFIX, unpack_chunks
    from fedweigh.server.encrypted import EncryptedGlobalModel

    validated: list = []
    validate = RoundStep.validate

    def spy(self, result, round_index=0):
        validated.append((type(self.backend), result))
        return validate(self, result, round_index)

    monkeypatch.setattr(RoundStep, "validate", spy)
    seen: list = []
    record = run_attack(
        "he-check-slot", sites=4, rounds=2, settings="smoke", clean_auc=0.5, he=True, on_transport=seen.append
    )
    (transport,) = seen
    assert isinstance(transport, EncryptedInProcessSites) and record.he
    assert not record.crashed_or_stalled, record.error
    assert len(validated) == 8 and {backend for backend, _ in validated} == {EncryptedGlobalModel}
    for _, result in validated:
        chunks, clear = unpack_chunks(result.params, UPDATE_PREFIX)
        assert chunks and not any(
            np.asarray(v).dtype.kind == "f" and np.asarray(v).size > 1 for v in clear.values()
        )
    # round 2's model holds the forged slot: every site refuses it, and the final one as well
    assert record.refused["2"] == ["site-1", "site-2", "site-3", "site-4"]
    assert "-1" in record.refused


@pytest.mark.parametrize(
    "attack, he, says", [("he-add-1", False, "with he=True"), ("nan", True, "without HE")]
)
def test_an_attack_runs_only_on_the_path_it_is_made_for(attack, he, says):
    with pytest.raises(ValueError, match=says):
        run_attack(attack, sites=4, rounds=1, settings="smoke", clean_auc=0.5, he=he)


@pytest.mark.parametrize("attack", ["nan", "inf", "wrong-dtype", "wrong-shape", "replay"])
def test_a_malformed_result_is_left_out_every_round_it_is_sent(attack):
    record = run_attack(attack, sites=4, rounds=2, settings="smoke", clean_auc=0.5)
    assert not record.crashed_or_stalled, record.error
    rounds = ["2"] if attack == "replay" else ["1", "2"]  # a replay needs an earlier result
    assert sorted(record.left_out) == rounds and all(v == ["site-4"] for v in record.left_out.values())


def test_a_huge_finite_update_is_held_to_an_honest_length_every_round():
    record = run_attack("huge", sites=4, rounds=2, settings="smoke", clean_auc=0.5)
    assert not record.crashed_or_stalled, record.error
    assert all("site-4" in record.bounded[t] for t in ("1", "2"))
    assert abs(record.drop - (0.5 - record.auc)) < 1e-12 and np.isfinite(record.auc)


def test_an_attacker_whose_own_model_breaks_answers_nothing_and_the_run_completes():
    """+1 on every encrypted value: the honest sites refuse the sum; the attacker's own guard, which
    never clipped an update of its own, accepts it and its model breaks: its tasks fail, as an NVFlare
    site's would, and the run completes on the honest sites' last good models."""
    record = run_attack("he-add-1", sites=4, rounds=2, settings="smoke", clean_auc=0.5, he=True)
    assert not record.crashed_or_stalled, record.error
    assert record.refused["2"] == ["site-1", "site-2", "site-3"] and np.isfinite(record.auc)
