"""The direction check end to end under HE: four sites decrypt, judge, train, clip and encrypt with the
code the NVFlare client runs (``decrypt_global``, ``HEModelGuard.receive`` / ``encode``), the server sums
with ``RoundStep`` and ``EncryptedGlobalModel``; site-4 sends its own update negated and tripled."""

from __future__ import annotations

import numpy as np
from test_he_attacks import ATTACKER, SITES, small_model

from fedweigh.secure.updates import decrypt_global, encode_update
from fedweigh.server.encrypted import EncryptedGlobalModel
from fedweigh.server.rounds import ClientResult, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.site.he_guard import HEModelGuard
from fedweigh.weighting import get_scheme


class Training:
    """Honest local training: every site moves along a common direction that drifts over the rounds,
    plus noise of its own of 0.3 its size (pairwise correlation about 0.9, as local steps on data of one
    distribution in benchmarks/bench_he_direction.py)."""

    def __init__(self, g0: dict, scale: float = 0.002):
        self.rng = np.random.default_rng(11)
        self.scale = scale
        self.common = {k: self.rng.normal(0, scale, v.shape) for k, v in g0.items()}
        self.round = 0

    def step(self, t: int) -> None:
        if t != self.round:
            self.round = t
            self.common = {
                k: 0.8 * v + 0.6 * self.rng.normal(0, self.scale, v.shape) for k, v in self.common.items()
            }

    def train(self, g: dict, site: str, t: int) -> dict[str, np.ndarray]:
        self.step(t)
        rng = np.random.default_rng(1000 * t + SITES.index(site))
        return {
            k: (np.float64(v) + self.common[k] + rng.normal(0, 0.3 * self.scale, v.shape)).astype(v.dtype)
            for k, v in g.items()
        }


def run(keys, factor: float | None, rounds: int = 5, attack_from: int = 2, **guard_args) -> dict:
    """``rounds`` rounds under HE; from round ``attack_from`` site-4 sends ``factor`` x the update its
    guard would send. Returns the honest sites' refusals per round and site-1's models."""
    g0 = small_model()
    server = EncryptedGlobalModel(keys.public, g0)
    step = RoundStep(
        get_scheme("fedavg"),
        server,
        num_rounds=rounds,
        safeguards=Safeguards(max_share=None),
        log=lambda m: None,
    )
    guards = {s: HEModelGuard(s, **guard_args) for s in SITES}
    training = Training(g0)
    refusals: dict[int, list[str]] = {}
    held: dict[int, dict] = {}
    for t in range(1, rounds + 2):
        received = server.task_params()
        results = []
        for site in SITES:
            decrypted = decrypt_global(keys.secret, received, server.meta(), g0)
            receipt = guards[site].receive(decrypted, t)
            if receipt.refusal and site != ATTACKER:
                refusals.setdefault(t, []).append(receipt.refusal)
            if site == "site-1":
                held[t] = receipt.use
            if t > rounds:
                continue
            trained = training.train(receipt.use, site, t)
            layout = decrypted.layout
            if site == ATTACKER and factor is not None and t >= attack_from:
                honest = guards[site].outgoing(trained, receipt, layout.keys)
                sent = {
                    k: (
                        np.float64(receipt.received[k])
                        + factor * (np.float64(honest[k]) - np.float64(receipt.received[k]))
                    ).astype(honest[k].dtype)
                    for k in layout.keys
                }
                params = encode_update(keys.secret, sent, receipt.received, layout, check=receipt.check)
            else:
                params = guards[site].encode(keys.secret, trained, receipt, layout)
            results.append(ClientResult(site, params, {"num_samples": 100, "NUM_STEPS_CURRENT_ROUND": 1}))
        if t <= rounds:
            assert step.run(t, results).updated
    return {"refusals": refusals, "held": held, "guards": guards}


def test_honest_sites_refuse_the_round_of_a_site_sending_its_update_negated_and_tripled(keys):
    out = run(keys, -3.0)
    assert 2 not in out["refusals"]  # round 2's model holds only honest round-1 updates
    for t in (3, 4, 5, 6):  # every model that holds the negated update: all three honest sites refuse
        assert len(out["refusals"].get(t, [])) == 3, (t, out["refusals"])
        assert all("points against this site's references" in r for r in out["refusals"][t])
    # site-1 keeps training on the last model it accepted (round 2's)
    kept = out["held"][2]
    assert all(np.array_equal(out["held"][6][k], kept[k]) for k in kept)


def test_without_the_direction_check_the_negated_round_is_accepted(keys):
    """The size check alone lets the negated and tripled update through: the finding this answers."""
    out = run(keys, -3.0, direction_bound=None)
    assert out["refusals"] == {}


def test_an_honest_federation_is_not_refused(keys):
    out = run(keys, None, rounds=6)
    assert out["refusals"] == {}
    judged = [g.direction for s, g in out["guards"].items()]
    assert all(max(c for c in d.values() if c is not None) > 0.5 for d in judged)
