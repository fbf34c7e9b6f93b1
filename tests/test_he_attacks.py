"""The encrypted paths against one bad site: the attacks on HE updates (a value added to every encrypted
value, a forged check slot; the attack suite runs them through the round loop, fedweigh.bench.attacks)
and on the secure statistics (forged inside the ciphertext), applied to a small model or stand-in
sites, and the defence that
stops it: the sites' checks on what they decrypt (fedweigh.site.he_guard), the named forged check and
count slots, the decoded sum against the announced sizes, the server's log of every site's answer and
FedDisco's fallback to the uniform target."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from fedweigh.flare.statistics import META_MODE, META_STEP, answer_statistics_task, run_statistics_phase
from fedweigh.histograms import META_EXCHANGE_ID, decode_sum, statistics_vector
from fedweigh.secure.contexts import (
    CONTEXT_DIR_ENV,
    make_context,
    save_context_files,
)
from fedweigh.secure.stats_release import ReleasedHistogram
from fedweigh.secure.updates import decode_global, decrypt_global, encode_update
from fedweigh.server.encrypted import EncryptedGlobalModel
from fedweigh.server.rounds import ClientResult, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.site.he_guard import CLIP_FACTOR, RATIO_BOUND, HEModelGuard
from fedweigh.weighting import feddisco, get_scheme
from fedweigh.weighting.base import ScalarContext

ROOT = Path(__file__).resolve().parents[1]


def tamper_update(kind: str, outgoing: dict, keys_encrypted) -> tuple[dict, float]:
    """The attacker's parameters before encryption and its check slot: +0.1 / +1.0 on every encrypted
    value, or a check slot of 5."""
    if kind.startswith("he-add-"):
        shift = float(kind.rsplit("-", 1)[1])
        out = dict(outgoing)
        for k in keys_encrypted:
            out[k] = (np.asarray(outgoing[k], np.float64) + shift).astype(np.asarray(outgoing[k]).dtype)
        return out, 1.0
    if kind == "he-check-slot":
        return dict(outgoing), 5.0
    raise ValueError(f"not an HE update attack: {kind!r}")


def tamper_statistics(kind: str, payload: dict, secret_ctx, length: int) -> dict:
    """The attacker's statistics contribution (its collect answer's meta), forged inside the ciphertext:
    the slot layout is [lo_1..lo_L, hi_1..hi_L, count] (fedweigh.secure.vectors), entry j = hi_j 2^20 +
    lo_j; the entries are [n_1..n_C, N_k, N_k c_k]."""
    import base64

    import tenseal as ts

    from fedweigh.secure.exchange import META_CIPHERTEXT

    slots = list(ts.ckks_vector_from(secret_ctx, base64.b64decode(payload[META_CIPHERTEXT])).decrypt())
    if kind == "stats-negative":
        slots[0] = -5000.0  # n_1 -5000 (lo limb): the sum's first count goes negative
    elif kind == "stats-count-slot":
        slots[-1] = 2.0
    elif kind == "stats-inflate":
        n_index = length - 2
        slots[n_index] = (
            slots[n_index] + 1_000_000.0 - round(slots[n_index] + 2**20 * slots[length + n_index])
        )
    else:
        raise ValueError(f"not a statistics attack: {kind!r}")
    forged = ts.ckks_vector(secret_ctx, slots).serialize()
    return {**payload, META_CIPHERTEXT: base64.b64encode(forged).decode()}


SITES = ("site-1", "site-2", "site-3", "site-4")
ATTACKER = "site-4"


def small_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.normal(0, 0.1, (8, 1, 3, 3)).astype(np.float32),
        "bn.weight": np.ones(8, np.float32),
        "bn.bias": np.zeros(8, np.float32),
        "bn.running_var": np.ones(8, np.float32),
        "fc.weight": rng.normal(0, 0.1, (4, 300)).astype(np.float32),
        "fc.bias": np.zeros(4, np.float32),
    }


def honest_training(g: dict, site: str, t: int) -> dict[str, np.ndarray]:
    """A small honest update (0.002 per value, as a late round's per-value update in the benchmark)."""
    rng = np.random.default_rng(1000 * t + SITES.index(site))
    return {k: (v + rng.normal(0, 0.002, v.shape)).astype(v.dtype) for k, v in g.items()}


class Federation:
    """Four sites under HE with the server's round step; site-4 attacks with ``kind`` in chosen rounds.
    ``guarded=False``: the sites use whatever decrypts (the defence removed)."""

    def __init__(self, keys, kind: str | None, attack_rounds=(2,), guarded: bool = True):
        self.keys, self.kind, self.attack_rounds, self.guarded = keys, kind, set(attack_rounds), guarded
        self.g0 = small_model()
        self.server = EncryptedGlobalModel(keys.public, self.g0)
        self.step = RoundStep(
            get_scheme("fedavg"),
            self.server,
            num_rounds=10,
            safeguards=Safeguards(max_share=None),
            log=lambda m: None,
        )
        self.guards = {s: HEModelGuard(s) for s in SITES}
        self.held: dict[str, dict] = {}
        self.refusals: dict[int, list[str]] = {}

    def round(self, t: int) -> None:
        received = self.server.task_params()
        results = []
        for site in SITES:
            decrypted = decrypt_global(self.keys.secret, received, self.server.meta(), self.g0)
            if self.guarded:
                receipt = self.guards[site].receive(decrypted, t)
                if receipt.refusal:
                    self.refusals.setdefault(t, []).append(receipt.refusal)
            else:
                problem = decrypted.check_problem
                if problem:
                    raise ValueError(problem)
                receipt = attacks_he_receipt(decrypted)
            self.held[site] = receipt.use
            trained = honest_training(receipt.use, site, t)
            if site == ATTACKER and self.kind and t in self.attack_rounds:
                outgoing, check = tamper_update(self.kind, trained, decrypted.layout.keys)
                params = encode_update(
                    self.keys.secret, outgoing, receipt.received, decrypted.layout, check=check
                )
            elif self.guarded:
                params = self.guards[site].encode(self.keys.secret, trained, receipt, decrypted.layout)
            else:
                params = encode_update(self.keys.secret, trained, receipt.received, decrypted.layout)
            results.append(ClientResult(site, params, {"num_samples": 100, "NUM_STEPS_CURRENT_ROUND": 1}))
        assert self.step.run(t, results).updated

    def final(self) -> dict[str, np.ndarray]:
        """The model site-1 holds after receiving the current global model."""
        decrypted = decrypt_global(self.keys.secret, self.server.task_params(), self.server.meta(), self.g0)
        if not self.guarded:
            return decrypted.params
        return self.guards["site-1"].receive(decrypted).use


def attacks_he_receipt(decrypted):
    from fedweigh.site.he_guard import HEReceipt

    return HEReceipt(decrypted.params, decrypted.params)


def shift_from_last_good(model: dict, good: dict) -> float:
    return max(float(np.abs(np.asarray(model[k], np.float64) - good[k]).mean()) for k in good)


# ------------------------------------------------------------------------------ HE model updates
@pytest.mark.parametrize("kind", ["he-add-0.1", "he-add-1.0"])
def test_a_site_adding_to_every_value_is_refused_and_the_last_good_model_kept(keys, kind):
    fed = Federation(keys, kind, attack_rounds=(2,))
    fed.round(1)
    fed.round(2)  # site-4 adds to every value of its update
    good = {k: np.array(v, np.float64) for k, v in fed.held["site-1"].items()}  # accepted after round 1
    fed.round(3)  # the sites decrypt the poisoned sum: every honest site refuses it, named, and trains on
    assert len(fed.refusals[3]) == 4, fed.refusals  # site-4 runs the same site code when it does not attack
    assert all("times this site's reference" in r for r in fed.refusals[3])
    assert shift_from_last_good(fed.held["site-1"], good) < 1e-6  # it kept the last good model
    # the honest sites' updates, taken against the poisoned model, pulled the sum back: accepted again
    fed.round(4)
    assert 4 not in fed.refusals
    assert shift_from_last_good(fed.final(), good) < 0.01


def test_without_the_sites_checks_the_shifted_model_is_used(keys):
    fed = Federation(keys, "he-add-0.1", attack_rounds=(2,), guarded=False)
    fed.round(1)
    good = {k: np.array(v, np.float64) for k, v in fed.held["site-1"].items()}
    fed.round(2)
    fed.round(3)
    # w = 1/4 of +0.1 on every value: the sites train on a model shifted by 0.025 everywhere
    assert shift_from_last_good(fed.held["site-1"], good) > 0.02


def test_forged_check_slot_is_named_and_repaired(keys):
    fed = Federation(keys, "he-check-slot", attack_rounds=(2,))
    fed.round(1)
    fed.round(2)
    with pytest.raises(ValueError, match="forged check slot") as info:
        decode_global(keys.secret, fed.server.task_params(), fed.server.meta(), fed.g0)
    assert "provisioning" not in str(info.value)
    fed.round(3)  # every site refuses it, naming the forged slot, and repairs it with its update
    assert len(fed.refusals[3]) == 4 and all("forged check slot" in r for r in fed.refusals[3])
    repaired = decrypt_global(keys.secret, fed.server.task_params(), fed.server.meta(), fed.g0)
    assert repaired.check_problem is None  # the sites' check slots 1 + expected - decrypted undid it
    fed.round(4)
    assert 4 not in fed.refusals


def test_a_contribution_under_another_key_still_blames_the_keys(keys):
    g0 = small_model()
    server = EncryptedGlobalModel(keys.public, g0)
    good = encode_update(keys.secret, honest_training(g0, "site-1", 1), g0, server.layout)
    foreign = encode_update(make_context(), honest_training(g0, "site-2", 1), g0, server.layout)
    results = [
        ClientResult(s, p, {"num_samples": 10, "NUM_STEPS_CURRENT_ROUND": 1})
        for s, p in (("site-1", good), ("site-2", foreign))
    ]
    assert (
        RoundStep(get_scheme("fedavg"), server, num_rounds=2, safeguards=Safeguards(max_share=None))
        .run(1, results)
        .updated
    )
    decrypted = decrypt_global(keys.secret, server.task_params(), server.meta(), g0)
    assert "another key" in decrypted.check_problem
    with pytest.raises(ValueError, match="another key"):
        HEModelGuard("site-1").receive(decrypted)  # nothing decrypted is usable: no repair


def test_guard_refuses_non_finite_values_and_negative_variances():
    guard = HEModelGuard("site-1")
    model = small_model()
    assert guard.refusal(model, list(model)) is None
    assert "NaN or infinite" in guard.refusal(
        {**model, "fc.bias": np.full(4, np.nan, np.float32)}, list(model)
    )
    bad_var = {**model, "bn.running_var": -np.ones(8, np.float32)}
    assert "negative BatchNorm variance" in guard.refusal(bad_var, list(model))


def test_each_site_clips_its_own_update_to_the_accepted_global_updates():
    guard = HEModelGuard("site-1")
    g0 = small_model()
    keys_ = list(g0)
    guard.last_good = g0
    g1 = {k: v + np.float32(0.001) for k, v in g0.items()}
    receipt = guard.receive(
        SimpleNamespace(params=g1, layout=SimpleNamespace(keys=keys_), check_problem=None)
    )
    assert receipt.refusal is None and guard.clip_norm() is not None
    bound = guard.clip_norm()
    total = np.sqrt(sum(float(np.sum((np.float64(g1[k]) - g0[k]) ** 2)) for k in keys_))
    assert bound == pytest.approx(CLIP_FACTOR * total, rel=1e-3)
    big = {k: v + np.float32(1.0) for k, v in g1.items()}  # an update far above the bound
    out = guard.outgoing(big, receipt, keys_)
    norm = np.sqrt(sum(float(np.sum((np.float64(out[k]) - g1[k]) ** 2)) for k in keys_))
    assert norm == pytest.approx(bound, rel=1e-4)
    assert RATIO_BOUND >= CLIP_FACTOR  # a site that clipped stays inside what the others accept


# ------------------------------------------------------------------------------ secure statistics
@pytest.fixture
def stats_keys(tmp_path, monkeypatch):
    ctx = make_context()
    save_context_files(tmp_path / "keys", ctx)
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(tmp_path / "keys"))
    monkeypatch.chdir(tmp_path)
    return ctx


def stand_in_sites() -> dict:
    rng = np.random.default_rng(3)
    sites = {}
    for k, site in enumerate(SITES):
        n = 300
        counts = rng.integers(10, 120, size=5)
        sites[site] = SimpleNamespace(
            site_name=site,
            job_id="job",
            global_stats=None,
            num_train=n,
            class_counts=counts,
            released_statistics=lambda c=counts, n=n: ReleasedHistogram(np.asarray(c), n, None, None),
        )
        sites[site].index = k
    return sites


class Controller:
    """Stand-in controller: every site answers through answer_statistics_task; site-4's collect answer is
    forged with ``kind``; warnings and failures are recorded."""

    def __init__(self, sites, kind, secret):
        self.sites, self.kind, self.secret = sites, kind, secret
        self.warnings, self.infos, self.failures = [], [], []

    def ask_sites(self, task_name, data, targets, min_responses):
        out = []
        for site in targets:
            answer = answer_statistics_task(self.sites[site], FLModel(params={}, meta=dict(data.meta)))
            meta = dict(answer.meta or {})
            if site == ATTACKER and data.meta[META_STEP] == "collect" and self.kind:
                meta = tamper_statistics(self.kind, meta, self.secret, int(meta["fedweigh_stats_length"]))
            answer.meta = {**meta, "client_name": site}
            out.append(answer)
        return out

    def info(self, msg):
        self.infos.append(msg)

    def warning(self, msg):
        self.warnings.append(msg)

    def fail_job(self, reason):
        self.failures.append(reason)


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("stats-negative", "implausible global statistics"),
        ("stats-count-slot", "forged count slot"),
        ("stats-inflate", "the server holds sum N_k = 1,200"),
    ],
)
def test_a_forged_statistics_ciphertext_is_refused_by_every_site_and_logged_by_the_server(
    stats_keys, kind, named
):
    sites = stand_in_sites()
    controller = Controller(sites, kind, stats_keys)
    run_statistics_phase(controller, list(SITES), "secure", floor=3)
    assert all(s.global_stats is None for s in sites.values())  # nobody uses the forged sum
    refused = [w for w in controller.warnings if "could not use the global statistics" in w]
    assert len(refused) == 4 and all(named in w for w in refused), controller.warnings
    assert any("no site could use the summed statistics" in w for w in controller.warnings)
    assert not controller.failures  # a refused sum is no failed job: the sites train on


def test_honest_statistics_are_decoded_and_every_answer_logged(stats_keys):
    sites = stand_in_sites()
    controller = Controller(sites, None, stats_keys)
    run_statistics_phase(controller, list(SITES), "secure", floor=3)
    assert all(s.global_stats is not None and s.global_stats.num_samples == 1200 for s in sites.values())
    assert any("4 of 4 site(s) decoded" in m for m in controller.infos)
    assert not [w for w in controller.warnings if "could not use" in w]


def test_without_the_announced_size_inflated_counts_would_be_used(stats_keys):
    """The inflation attack decodes to a plausible histogram: only the announced sum of N_k stops it."""
    sites = stand_in_sites()
    collect = FLModel(
        params={}, meta={META_STEP: "collect", META_MODE: "secure", META_EXCHANGE_ID: "exchange-0123456789"}
    )
    from fedweigh.secure.exchange import SecureExchange
    from fedweigh.server.label_stats import sum_statistics

    payloads = {}
    for site, trainer in sites.items():
        meta = dict(answer_statistics_task(trainer, collect).meta)
        if site == ATTACKER:
            meta = tamper_statistics("stats-inflate", meta, stats_keys, int(meta["fedweigh_stats_length"]))
        payloads[site] = meta
    from fedweigh.flare.keys import role_context_provider

    outcome = sum_statistics(SecureExchange(role_context_provider()), payloads, 3)
    stats = decode_sum(SecureExchange(role_context_provider()).decode(outcome.total))
    assert stats.num_samples == 1_000_900  # N = 1,000,900 while the server holds sum N_k = 1,200 in clear
    assert sum(p["num_samples"] for p in payloads.values()) == 1200


def test_feddisco_global_target_trains_on_after_a_refused_sum(monkeypatch):
    monkeypatch.setattr(feddisco, "_FALLBACK_WARNED", [])
    scheme = get_scheme("feddisco", target="global")
    scalars = scheme.client_scalars(ScalarContext(class_counts=np.array([5, 1, 3]), num_samples=9))
    uniform = get_scheme("feddisco").client_scalars(
        ScalarContext(class_counts=np.array([5, 1, 3]), num_samples=9)
    )
    assert scalars == uniform


def test_statistics_vector_roundtrip_reference():
    """The honest vector of the stand-in sites decodes to the sizes the server announces."""
    total = sum(statistics_vector(s.class_counts, s.num_train) for s in stand_in_sites().values())
    assert decode_sum(total).num_samples == 1200


def test_a_statistics_phase_where_every_site_errors_fails_the_job(stats_keys):
    sites = stand_in_sites()

    class Failing(Controller):
        def ask_sites(self, task_name, data, targets, min_responses):
            return [
                FLModel(
                    metrics={"fedweigh_error": 1.0},
                    meta={"fedweigh_site_error": f"OSError: {s} has no data", "client_name": s},
                )
                for s in targets
            ]

    controller = Failing(sites, None, stats_keys)
    run_statistics_phase(controller, list(SITES), "secure", floor=3)
    assert len(controller.failures) == 1
    assert "every site that answered failed" in controller.failures[0]
    assert "site-1: OSError: site-1 has no data" in controller.failures[0]


def test_logging_is_quiet_for_the_fallback_after_the_first(caplog, monkeypatch):
    monkeypatch.setattr(feddisco, "_FALLBACK_WARNED", [])
    scheme = get_scheme("feddisco", target="global")
    with caplog.at_level(logging.WARNING, logger="fedweigh.weighting.feddisco"):
        for _ in range(3):
            scheme.client_scalars(ScalarContext(class_counts=np.array([1, 2]), num_samples=3))
    assert caplog.text.count("uniform target instead") == 1


def test_a_site_that_trained_fewer_steps_expects_a_larger_aggregate():
    """A site of 1 local step among sites of 63 (quantity skew) sees an honest aggregate about 9 times
    its own update: refused without the step scaling, accepted with the round's announced steps."""
    g0 = small_model()
    keys_ = list(g0)
    own = {k: v + np.float32(0.001) for k, v in g0.items()}
    aggregate = {k: v + np.float32(0.009) for k, v in g0.items()}

    def judged(round_steps):
        guard = HEModelGuard("site-small")
        guard.last_good = g0
        receipt = guard.receive(
            SimpleNamespace(params=g0, layout=SimpleNamespace(keys=keys_), check_problem=None)
        )
        guard.outgoing(own, receipt, keys_, steps=1)
        decrypted = SimpleNamespace(params=aggregate, layout=SimpleNamespace(keys=keys_), check_problem=None)
        return guard.receive(decrypted, 2, round_steps).refusal

    assert judged(None) is not None  # nothing announced: 9 times its own update, refused
    assert judged(63) is None


def test_the_round_steps_are_a_weighted_median_one_site_cannot_inflate():
    from fedweigh.server.encrypted import weighted_median_steps

    assert weighted_median_steps([63, 3, 1, 1], [0.93, 0.04, 0.015, 0.015]) == 63
    assert weighted_median_steps([10, 10, 10, 10_000_000], [0.25, 0.25, 0.25, 0.25]) == 10
    assert weighted_median_steps([10, 12, 14], [0.2, 0.2, 0.6]) == 14
